"""Kubernetes integration: pod metadata, evictions through the API server, events, node labels.

This part owns nodeguard's actions on the *cluster*, as ``actuators/`` owns
its actions on the node: ``evictor.py`` evicts pods through the ``policy/v1``
Eviction API (behind the actuators' ``Evictor`` interface, so the executor
cannot tell it from the cgroup evictor), and ``events.py`` records Events on
the pods acted on. Nothing else in nodeguard writes to the API server; the
rest of this part only reads (pod metadata, node labels).
"""
