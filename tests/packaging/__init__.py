"""Checks of the deployment files: systemd unit, Dockerfile, Kubernetes manifests, Grafana dashboard."""
