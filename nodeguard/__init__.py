"""nodeguard: keeps a node healthy for its important workloads."""

__version__ = "0.1.0"
