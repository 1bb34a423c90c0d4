"""Reading the system: cgroup and proc files, discovery, the per-tick sensor."""
