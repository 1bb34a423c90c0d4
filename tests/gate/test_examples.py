"""The gate's examples (systemd unit, pod snippet, OCI hook) are valid and call the clients with options they accept."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from nodeguard.config import parse_text
from nodeguard.surfaces.cli import _parser

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd" / "example-admitted.service"
POD = REPO / "packaging" / "kubernetes" / "gate-pod-snippet.yaml"
HOOK = REPO / "packaging" / "oci-hooks.d" / "nodeguard.json"
CONFIGMAP = REPO / "packaging" / "kubernetes" / "configmap.yaml"


def parses(argv: list[str]) -> Any:
    """The namespace nodeguard's own parser makes of ``argv`` (SystemExit if it refuses it)."""
    return _parser().parse_args(argv)


def unit_commands(key: str) -> list[list[str]]:
    lines = [line.split("=", 1)[1] for line in UNIT.read_text().splitlines() if line.startswith(f"{key}=")]
    # Drop systemd's prefixes ("+" full privileges, "-" ignore failure) and expand %N.
    return [shlex.split(line.lstrip("+-@!").replace("%N", "example-admitted")) for line in lines]


def test_systemd_example_admits_before_start_and_releases_after_stop() -> None:
    """ExecStartPre= runs `nodeguard admit` with a probe and ExecStopPost= `gatectl release` of the same name."""
    (admit,) = unit_commands("ExecStartPre")
    (release,) = unit_commands("ExecStopPost")
    admitted = parses(admit[1:])
    assert admitted.command == "admit" and admitted.name == "example-admitted" and admitted.ready_http
    released = parses(release[1:])
    assert (released.command, released.action, released.name) == ("gatectl", "release", "example-admitted")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_systemd_example_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    """systemd-analyze verify finds nothing wrong with the unit (the nodeguard path pointed at an existing file)."""
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/nodeguard", shutil.which("true") or "/bin/true"))
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


def test_pod_snippet_is_a_valid_pod_whose_init_container_the_gate_admits() -> None:
    """The snippet is a valid Pod; its init container runs `nodeguard admit` on the host's socket with ids the shipped
    config allows, for a cluster semaphore the shipped config has."""
    (pod,) = [doc for doc in yaml.safe_load_all(POD.read_text()) if doc]
    kubernetes_validate.validate(pod, kubernetes_validate.latest_version(), strict=True)
    (init,) = pod["spec"]["initContainers"]
    args = parses(init["command"][1:])
    assert args.command == "admit" and args.ready_http
    mount = next(m for m in init["volumeMounts"] if Path(m["mountPath"]) == Path(args.socket).parent)
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["hostPath"]["path"] == "/run/nodeguard"

    (configmap,) = [doc for doc in yaml.safe_load_all(CONFIGMAP.read_text()) if doc]
    shipped = parse_text(configmap["data"]["config.json"]).global_
    assert shipped.gate.socket == args.socket
    assert init["securityContext"]["runAsGroup"] in shipped.gate.allowed_gids
    assert args.semaphore in shipped.coordination.semaphores  # the cluster cap it waits for is one the nodes share


def test_oci_hook_example_runs_the_hook_at_create_runtime_and_poststop() -> None:
    """The hooks.d file is a version 1.0.0 hook that runs `nodeguard oci-hook` in createRuntime and poststop for annotated containers."""
    hook = json.loads(HOOK.read_text())
    assert hook["version"] == "1.0.0"
    assert set(hook["stages"]) == {"createRuntime", "poststop"}
    assert parses(hook["hook"]["args"][1:]).command == "oci-hook"
    assert hook["when"]["annotations"] == {r"^nodeguard\.io/gate$": "^true$"}
