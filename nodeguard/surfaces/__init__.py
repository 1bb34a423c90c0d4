"""How people and programs reach nodeguard: the CLI, the HTTP endpoints, Prometheus metrics, the demo.

Surfaces sit on top: they read the running daemon through ``Daemon.view()``,
``health()`` and ``status()`` and attach to it from above (``run(serve=...)``,
``on_tick``); the daemon imports none of them.
"""
