"""How people and programs reach nodeguard: CLI, HTTP, metrics, systemd."""
