"""What ``nodeguard oci-hook`` says when it cannot reach the gate: one line an operator can act on.

The runtime shows the hook's stderr inside its own error (runc: ``error
running hook #0: error running hook: exit status 75, stdout: , stderr:
<this line>``), so the line names the container, says why the gate is
unavailable (no socket, a socket nobody listens on, a daemon that does not
answer, a socket this user may not use), what to check, and how to fail open.

podman sorts a runtime's error by its words: one that says "no such file or
directory" or "not found" becomes "OCI runtime attempted to invoke a command
that was not found" and exit 127, "permission denied" or "operation not
permitted" a permission error (exit 126), and only the matching line is kept.
So these messages never use those words (nor ``strerror``'s): podman then
keeps the whole line and calls it an "OCI runtime error" (exit 126, podman's
code for any failed create; the hook's own status is in the line).

Standard library only: the hook imports this on its way out.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

MISSING, REFUSED, NO_ANSWER, DENIED = "missing", "refused", "no_answer", "denied"

# The hook's exit status (shown by runc and crun; never 126/127, which a shell and podman read as
# "cannot run"/"no such command"). 75 is EX_TEMPFAIL: try again once the daemon is back; 77 is EX_NOPERM.
EXIT_UNAVAILABLE, EXIT_DENIED = 75, 77

SHORT_ID = 12  # as podman ps and crictl ps show ids
STORE_LIMIT = 16 << 20  # the storage's container list read at most (it lists every container on the node)

# Kubernetes names: (container, pod, namespace) annotation keys. CRI-O copies kubelet's labels into the
# OCI annotations; containerd's CRI plugin sets its own.
KUBERNETES_KEYS = (
    ("io.kubernetes.container.name", "io.kubernetes.pod.name", "io.kubernetes.pod.namespace"),
    ("io.kubernetes.cri.container-name", "io.kubernetes.cri.sandbox-name", "io.kubernetes.cri.sandbox-namespace"),
)
LOAD_NAME = "nodeguard.io/name"

CHECK = 'check "systemctl status nodeguard" (or the nodeguard DaemonSet pod on this node) and "nodeguard status"'
FAIL_OPEN = (
    'to start containers ungated while the gate is down, add "--if-unavailable", "admit" '
    "to the hook's args (hooks.d/nodeguard.json)"
)


def exit_code(cause: str) -> int:
    """The hook's exit status when the gate is unavailable for ``cause``."""
    return EXIT_DENIED if cause == DENIED else EXIT_UNAVAILABLE


def container_label(annotations: Mapping[str, str], container_id: str, stored_name: str | None = None) -> str:
    """How the message names the container: its Kubernetes names, else the runtime's name (``stored_name``),
    else the load's name; always with the short id, which ``podman ps`` and ``crictl ps`` show."""
    short = container_id[:SHORT_ID] or "?"
    for container_key, pod_key, namespace_key in KUBERNETES_KEYS:
        container, pod = annotations.get(container_key), annotations.get(pod_key)
        if container and pod:
            namespace = annotations.get(namespace_key)
            where = f"{namespace}/{pod}" if namespace else pod
            return f'container "{container}" of pod {where} (id {short})'
    if stored_name:
        return f'container "{stored_name}" (id {short})'
    load = annotations.get(LOAD_NAME)
    if load:
        return f'container {short} (gate load "{load}")'
    return f"container {short}"


def stored_name(bundle: object, container_id: str) -> str | None:
    """The container's name as containers/storage records it, or None.

    podman's bundle is ``<graph root>/<driver>-containers/<id>/userdata``, and
    the storage's ``containers.json`` two levels up lists each container's
    names (podman's name first). CRI-O's bundle lies under the run root, where
    no such list is: its annotations name the container instead.
    """
    if not isinstance(bundle, str) or not bundle or not container_id:
        return None
    listing = os.path.join(os.path.dirname(os.path.dirname(os.path.normpath(bundle))), "containers.json")
    try:
        with open(listing, "rb") as file:
            entries = json.loads(file.read(STORE_LIMIT + 1)[:STORE_LIMIT])
    except (OSError, ValueError):
        return None
    if not isinstance(entries, list):
        return None
    for entry in entries:
        if isinstance(entry, dict) and entry.get("id") == container_id:
            names = entry.get("names")
            if isinstance(names, list) and names and isinstance(names[0], str) and names[0]:
                return names[0]
    return None


def describe(state: Mapping[str, object]) -> str:
    """The container of an OCI state, for a message (reads the runtime's storage only if no annotation names it)."""
    container_id = state.get("id")
    container_id = container_id if isinstance(container_id, str) else ""
    raw = state.get("annotations")
    annotations = {str(k): str(v) for k, v in raw.items()} if isinstance(raw, Mapping) else {}
    named = any(annotations.get(c) and annotations.get(p) for c, p, _ in KUBERNETES_KEYS)
    return container_label(annotations, container_id, None if named else stored_name(state.get("bundle"), container_id))


def _seconds(waited: float) -> str:
    return f"{waited:.0f} s" if waited >= 1 else f"{waited:.1f} s"


def unavailable_message(
    container: str, cause: str, socket: str, waited: float, *, fail_open: bool, uid: int | None = None
) -> str:
    """One line: the container, why the gate at ``socket`` is unavailable (``cause``, after ``waited``
    seconds), what to check, and how to fail open (or, with ``fail_open``, that the container starts ungated)."""
    if cause == MISSING:
        why = (
            f"no gate socket at {socket} (waited {_seconds(waited)}): "
            "the nodeguard daemon is not running, or runs with its gate off or on another socket"
        )
    elif cause == REFUSED:
        why = (
            f"the gate socket {socket} refuses connections (for {_seconds(waited)}): "
            "the nodeguard daemon is not running; it stopped or crashed and left the socket behind"
        )
    elif cause == NO_ANSWER:
        why = (
            f"the nodeguard daemon accepted a connection on {socket} but did not answer in {_seconds(waited)}: "
            "it is stopped, hung or overloaded"
        )
    elif cause == DENIED:
        who = "this hook" if uid is None else f"this hook (uid {uid})"
        why = (
            f"{who} may not connect to the gate socket {socket}: its mode or owner keeps the hook out "
            "(gate.socketMode, socketOwner and socketGroup in the daemon's config)"
        )
    else:
        why = f"the gate at {socket} is unavailable"
    if fail_open:
        return f"{container} starts ungated (--if-unavailable admit): {why}; {CHECK}."
    return f"{container} not started: {why}; {CHECK}; {FAIL_OPEN}."


def hook_unavailable(
    state: Mapping[str, object], cause: str, socket: str, waited: float, *, fail_open: bool
) -> tuple[str, int]:
    """The hook's line and exit status when the gate is unavailable (0 with ``fail_open``: the container starts)."""
    uid = os.geteuid() if cause == DENIED else None
    line = unavailable_message(describe(state), cause, socket, waited, fail_open=fail_open, uid=uid)
    return line, 0 if fail_open else exit_code(cause)
