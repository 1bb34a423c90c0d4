"""What the tests (and bench/, through bench/common.py) share, one module per concern.

- ``poll``: the one wait on state (``wait_until``, ``wait_until_async``).
- ``ports``: loopback ports for the servers a test starts.
- ``cgroups``: child cgroups in this machine's real hierarchies, with busy processes in them.
- ``workloads``: duty-cycled burners and the latency probe.
- ``node``: the e2e node shapes (kubelet-laid-out pods, a protected pod, a plain host's groups).
- ``daemon``: ``nodeguard run`` as a child process with its JSON log.
- ``processes``: whether a process is alive, as /proc shows it.
- ``levers``: levers driven by hand, as an earlier daemon would have left them.
- ``endpoints``: the daemon's HTTP endpoints as a test reads them.
- ``gate``: the daemon with its gate, real clients, a socket client; ``slow_server.py`` and ``records``: a real
  server that records its start and readiness, and how many overlapped. slow_server.py runs as a script from
  this directory, so no module here takes a standard module's name (tests/test_suite_imports.py checks).
- ``broker``: a real mosquitto and a proxy to it that can be cut; ``cluster``: nodes on one broker, the auditor
  of the wire, and the one cluster the coordination tests start.
"""
