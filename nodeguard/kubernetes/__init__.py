"""Kubernetes integration: pod metadata, evictions through the API server, events, node labels."""
