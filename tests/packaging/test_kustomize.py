"""packaging/kubernetes/ as a kustomize base, its overlays (canary, fleet-wide dry run) and the broker, rendered with
`kubectl kustomize`: every object valid against the API schemas, and each overlay changing only what it says."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from nodeguard.config import parse_text
from nodeguard.daemon import effective
from nodeguard.surfaces.cli import _parser
from tests.packaging.kustomize import (
    BASE,
    BROKER,
    CANARY,
    DRY_RUN,
    broker_copy,
    of_kind,
    render,
    run_kustomize,
)

K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
EXAMPLE_POD = "gate-pod-snippet.yaml"
RESTORE_JOB = "restore-job.yaml"  # one node's manual restore, applied by hand


def kustomization(directory: Path) -> dict[str, Any]:
    return dict(yaml.safe_load((directory / "kustomization.yaml").read_text(encoding="utf-8")))


def file_objects(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc is not None]


def container(objects: list[dict[str, Any]], kind: str = "DaemonSet") -> Any:
    """The one container of the DaemonSet's (or Deployment's) pod, itself: changing it changes ``objects``."""
    [found] = of_kind(objects, kind)["spec"]["template"]["spec"]["containers"]
    return found


def identity(obj: dict[str, Any]) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def rendered(directory: Path, tmp_path: Path) -> list[dict[str, Any]]:
    return render(broker_copy(tmp_path / "broker") if directory == BROKER else directory)


@pytest.mark.parametrize("directory", [BASE, CANARY, DRY_RUN, BROKER], ids=["base", "canary", "dry-run", "broker"])
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_rendered_object_validates(directory: Path, version: str, tmp_path: Path) -> None:
    """Each kustomization renders, and every object it renders validates (strict: no unknown fields)."""
    objects = rendered(directory, tmp_path)
    assert objects
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_base_applies_every_manifest_but_the_example_pod_and_the_restore_job_namespace_first() -> None:
    """The base lists every manifest of the folder except the gate's example pod and the one-node restore Job, and
    renders them unchanged, the namespace first (the order `kubectl apply -k` creates them in)."""
    listed = kustomization(BASE)["resources"]
    manifests = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml", EXAMPLE_POD, RESTORE_JOB}
    assert sorted(listed) == sorted(manifests)
    assert listed[0] == "namespace.yaml"
    assert [o["kind"] for o in file_objects(BASE / EXAMPLE_POD)] == ["Pod"]
    objects = render(BASE)
    assert objects[0]["kind"] == "Namespace"
    assert not {"Pod", "Job"} & {o["kind"] for o in objects}
    expected = [obj for name in listed for obj in file_objects(BASE / name)]
    assert sorted(objects, key=identity) == sorted(expected, key=identity)


def test_canary_runs_the_daemonset_only_on_labelled_nodes_and_changes_nothing_else() -> None:
    """The canary's DaemonSet selects nodes labelled nodeguard.io/canary=true; without that selector its render is
    the base's."""
    canary = render(CANARY)
    pod = of_kind(canary, "DaemonSet")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nodeguard.io/canary": "true"}
    assert {"operator": "Exists"} in pod["tolerations"]  # a tainted canary node still gets it
    del pod["nodeSelector"]
    assert canary == render(BASE)


def test_dry_run_overlay_runs_every_node_in_dry_run_on_a_valid_config(tmp_path: Path) -> None:
    """The dry-run overlay's daemon is `nodeguard run --dry-run` on the ConfigMap's config, which `nodeguard
    check-config` accepts; without the flag its render is the base's."""
    dry = render(DRY_RUN)
    args = container(dry)["args"]
    parsed = _parser().parse_args(["run", *args])  # the image's entrypoint is `nodeguard run`
    assert parsed.command == "run" and parsed.dry_run is True
    configmap = of_kind(dry, "ConfigMap")
    config = Path(parsed.config)
    mount = next(m for m in container(dry)["volumeMounts"] if Path(m["mountPath"]) == config.parent)
    volume = next(
        v for v in of_kind(dry, "DaemonSet")["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
    )
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    path = tmp_path / config.name
    path.write_text(configmap["data"][config.name], encoding="utf-8")
    checked = subprocess.run(
        [sys.executable, "-m", "nodeguard", "check-config", str(path), "--node-name", "node-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "valid" in checked.stdout
    settings = parse_text(path.read_text(encoding="utf-8")).settings_for({"kubernetes.io/hostname": "node-1"})
    assert not settings.actuation.dry_run  # the same config acts without the flag: the base's
    running = effective(settings, parsed.dry_run)  # what the daemon runs with
    assert running.actuation.dry_run and running.guard.dry_run
    base = render(BASE)
    without = copy.deepcopy(dry)
    container(without)["args"].remove("--dry-run")
    assert without != dry and without == base


def test_dry_run_patch_refuses_a_daemonset_whose_first_container_is_not_nodeguard(tmp_path: Path) -> None:
    """The patch appends --dry-run to the first container only after testing that it is nodeguard's: a DaemonSet
    with another container first fails the build instead of passing the flag to it."""
    base = tmp_path / "kubernetes"
    base.mkdir()
    for name in kustomization(BASE)["resources"]:
        text = (BASE / name).read_text(encoding="utf-8")
        if name == "daemonset.yaml":
            text = text.replace("- name: nodeguard\n          image:", "- name: sidecar\n          image:", 1)
            assert "name: sidecar" in text
        (base / name).write_text(text, encoding="utf-8")
    (base / "kustomization.yaml").write_text((BASE / "kustomization.yaml").read_text(encoding="utf-8"))
    overlay = tmp_path / "kubernetes-overlays" / "dry-run"
    overlay.mkdir(parents=True)
    for path in DRY_RUN.iterdir():
        (overlay / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    result = run_kustomize(overlay)
    assert result.returncode != 0
    assert "containers/0/name" in result.stderr


def test_broker_is_the_one_the_configmap_names_with_the_secret_the_daemonset_mounts(tmp_path: Path) -> None:
    """The broker's Service is the ConfigMap's coordination.broker host and port; its Secret is the one the
    DaemonSet mounts, under the key the nodes read as passwordFile; its user is the nodes' username."""
    broker = render(broker_copy(tmp_path / "broker"))
    base = render(BASE)
    raw = json.loads(of_kind(base, "ConfigMap")["data"]["config.json"])["global"]["coordination"]["broker"]
    service = of_kind(broker, "Service")
    name, namespace, svc, cluster, local = raw["host"].split(".")
    assert (svc, cluster, local) == ("svc", "cluster", "local")
    assert (service["metadata"]["name"], service["metadata"]["namespace"]) == (name, namespace)
    assert namespace == of_kind(base, "Namespace")["metadata"]["name"]
    [port] = service["spec"]["ports"]
    assert port["port"] == raw["port"]
    deployment = of_kind(broker, "Deployment")
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    mosquitto = container(broker, "Deployment")
    assert port["targetPort"] in {p["name"] for p in mosquitto["ports"]}

    password = Path(raw["passwordFile"])
    daemonset = of_kind(base, "DaemonSet")["spec"]["template"]["spec"]
    [mount] = [m for m in daemonset["containers"][0]["volumeMounts"] if Path(m["mountPath"]) == password.parent]
    [volume] = [v for v in daemonset["volumes"] if v["name"] == mount["name"]]
    secret = of_kind(broker, "Secret")
    assert secret["metadata"]["name"] == volume["secret"]["secretName"]
    assert secret["metadata"]["namespace"] == namespace
    assert list(secret["data"]) == [password.name]
    [init] = deployment["spec"]["template"]["spec"]["initContainers"]
    assert {e["name"]: e["value"] for e in init["env"]}["MQTT_USERNAME"] == raw["username"]


def test_broker_is_never_a_candidate_and_never_runs_twice(tmp_path: Path) -> None:
    """The broker pod is Guaranteed QoS, a class the shipped config never acts on, and its Deployment replaces
    its one pod rather than running a second beside it."""
    broker = render(broker_copy(tmp_path / "broker"))
    deployment = of_kind(broker, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]["spec"]
    for each in [*pod["initContainers"], *pod["containers"]]:
        resources = each["resources"]
        assert resources["requests"] == resources["limits"], each["name"]
        assert set(resources["limits"]) == {"cpu", "memory"}, each["name"]
    config = parse_text(of_kind(render(BASE), "ConfigMap")["data"]["config.json"])
    classes = {str(c) for c in config.settings_for({"kubernetes.io/hostname": "node-1"}).guard.candidates.classes}
    assert "Guaranteed" not in classes


def test_broker_build_fails_without_the_password_file(tmp_path: Path) -> None:
    """Without the operator's password file the broker does not build (and the file is kept out of git)."""
    result = run_kustomize(broker_copy(tmp_path / "broker", password=None))
    assert result.returncode != 0
    assert "password" in result.stderr
    assert "/password" in (BROKER / ".gitignore").read_text(encoding="utf-8").splitlines()
