"""Cluster coordination over MQTT: cluster-wide caps (semaphores) that never overshoot."""
