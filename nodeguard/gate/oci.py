"""The OCI runtime hook: what to ask the gate for a container, from the OCI state and its annotations.

In ``createRuntime`` (state ``creating``) the container waits for admission;
in ``poststop`` (state ``stopped``) its load is released. Annotations:

- ``nodeguard.io/name``: the load's name (default: ``oci-`` and the container id)
- ``nodeguard.io/after``: names it depends on, comma-separated
- ``nodeguard.io/ready-http``, ``nodeguard.io/ready-tcp``, ``nodeguard.io/ready-exec``
  (a shell command): how the daemon finds out it is ready; none: ready once admitted.
  Probes run in the daemon's network namespace: use an address reachable from the host.
- ``nodeguard.io/priority``, ``nodeguard.io/start-timeout`` (seconds)
- ``nodeguard.io/semaphore``: a cluster semaphore it also needs a slot of while starting
"""

from __future__ import annotations

from collections.abc import Mapping

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: the hook runs on every container create
if TYPE_CHECKING:
    from typing import Any

PREFIX = "nodeguard.io/"


class HookInputError(ValueError):
    """OCI state or annotations the hook cannot use."""


class HookAction:
    """What the hook asks of the gate (a plain class: dataclasses would import inspect, on every container create)."""

    __slots__ = ("kind", "name", "submit")

    def __init__(self, kind: str, name: str, submit: dict[str, Any]) -> None:
        self.kind = kind  # "admit", "release" or "none"
        self.name = name
        self.submit = submit


def readiness_of(
    http: str | None, tcp: str | None, exec_command: str | None, notify: bool = False
) -> dict[str, Any] | None:
    """The readiness object for the gate from client options (at most one may be given)."""
    given = [
        kind for kind, value in (("http", http), ("tcp", tcp), ("exec", exec_command), ("notify", notify)) if value
    ]
    if len(given) > 1:
        raise HookInputError(f"give one readiness check, not {' and '.join(given)}")
    if http:
        return {"type": "http", "url": http}
    if tcp:
        return {"type": "tcp", "address": tcp}
    if exec_command:
        return {"type": "exec", "command": ["/bin/sh", "-c", exec_command]}
    if notify:
        return {"type": "notify"}
    return None


def hook_action(state: object) -> HookAction:
    if not isinstance(state, Mapping):
        raise HookInputError("the OCI state on stdin is not a JSON object")
    container_id = state.get("id")
    if not isinstance(container_id, str) or not container_id:
        raise HookInputError("the OCI state has no container id")
    raw_annotations = state.get("annotations") or {}
    if not isinstance(raw_annotations, Mapping):
        raise HookInputError("the OCI state's annotations are not an object")
    annotations = {str(k): str(v) for k, v in raw_annotations.items()}
    name = annotations.get(PREFIX + "name") or f"oci-{container_id[:64]}"
    status = state.get("status")
    if status == "stopped":
        return HookAction("release", name, {})
    if status not in ("creating", "created"):
        return HookAction("none", name, {})
    after = [dep.strip() for dep in annotations.get(PREFIX + "after", "").split(",") if dep.strip()]
    submit: dict[str, Any] = {
        "name": name,
        "dependsOn": after,
        "readiness": readiness_of(
            annotations.get(PREFIX + "ready-http"),
            annotations.get(PREFIX + "ready-tcp"),
            annotations.get(PREFIX + "ready-exec"),
        ),
        "detach": True,  # the hook exits once admitted; the container lives on
    }
    if annotations.get(PREFIX + "semaphore"):
        submit["semaphore"] = annotations[PREFIX + "semaphore"]
    for key, field, kind in (("priority", "priority", int), ("start-timeout", "startTimeoutSeconds", float)):
        text = annotations.get(PREFIX + key)
        if text is not None:
            try:
                submit[field] = kind(text)
            except ValueError:
                raise HookInputError(f"annotation {PREFIX}{key}: expected a number, got {text!r}") from None
    return HookAction("admit", name, submit)
