"""The only code that changes the system: cgroup writes, evictions, the ledger of originals."""
