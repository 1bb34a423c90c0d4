"""The Kubernetes manifests in packaging/kubernetes/: valid against the API schemas (offline) and consistent."""

from __future__ import annotations

import copy
import socket
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from nodeguard.config import Settings, parse_text
from nodeguard.kubernetes.settings import SERVICE_ACCOUNT_DIR

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "packaging" / "kubernetes"
# The oldest Kubernetes release the manifests are meant for, and the newest the schemas know.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
NAMESPACE = "nodeguard"


def manifest_files() -> list[Path]:
    """The Kubernetes objects of the folder: every YAML file but the kustomization that lists them."""
    found = [*MANIFESTS.glob("*.yaml"), *MANIFESTS.glob("*.yml")]
    return sorted(path for path in found if path.name != "kustomization.yaml")


def documents(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc is not None]


def one(kind: str) -> dict[str, Any]:
    found = [doc for path in manifest_files() for doc in documents(path) if doc.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def daemonset_container() -> dict[str, Any]:
    containers = one("DaemonSet")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def embedded_config_text() -> str:
    return one("ConfigMap")["data"]["config.json"]


def node_settings(labels: dict[str, str] | None = None) -> Settings:
    document = parse_text(embedded_config_text(), "configmap.yaml")
    return document.settings_for({"kubernetes.io/hostname": "node-1", **(labels or {})})


def host_volumes() -> dict[str, dict[str, Any]]:
    """Volume name -> its definition, for the DaemonSet's pod."""
    return {v["name"]: v for v in one("DaemonSet")["spec"]["template"]["spec"]["volumes"]}


def mounts() -> dict[str, dict[str, Any]]:
    """Mount path -> the volume mounted there."""
    volumes = host_volumes()
    return {m["mountPath"]: volumes[m["name"]] for m in daemonset_container()["volumeMounts"]}


def probe_port(probe: dict[str, Any]) -> int:
    port = probe["httpGet"]["port"]
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in daemonset_container()["ports"]}
    return named[port]


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifest_validates_against_kubernetes_schema(path: Path, version: str) -> None:
    """Every document of every YAML file in the folder validates (strict: no unknown fields) against the API schema."""
    docs = documents(path)
    assert docs, f"{path.name} has no documents"
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_expected_manifests_are_present() -> None:
    """The folder holds the namespace, service account, RBAC, config map and DaemonSet."""
    kinds = {doc["kind"] for path in manifest_files() for doc in documents(path)}
    assert {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet"} <= kinds


def test_validation_needs_no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """The schemas ship with kubernetes-validate: validation works with every socket connection refused."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(one("DaemonSet"), version, strict=True)


def _set(doc: dict[str, Any], path: str, value: object) -> None:
    *parents, last = path.split(".")
    node: Any = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[last] = value


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("spec.template.spec.hostPid", True),  # misspelt field (hostPID)
        ("spec.template.spec.containers.0.ports.0.containerPort", "ninety-four"),  # wrong type
        ("spec.updateStrategy.type", 7),  # wrong type
        ("spec.template.spec.containers.0.volumeMounts.0.mountPath", None),  # required field null
    ],
)
def test_broken_manifest_is_rejected(path: str, value: object) -> None:
    """A DaemonSet with a misspelt field, a wrongly typed value or a missing required field fails validation."""
    broken = copy.deepcopy(one("DaemonSet"))
    _set(broken, path, value)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


def test_namespaced_objects_live_in_the_nodeguard_namespace() -> None:
    """Every namespaced object of nodeguard's own manifests is in the namespace that namespace.yaml creates."""
    assert one("Namespace")["metadata"]["name"] == NAMESPACE
    for kind in ("ServiceAccount", "ConfigMap", "DaemonSet"):
        assert one(kind)["metadata"]["namespace"] == NAMESPACE, kind


def test_rbac_grants_exactly_the_four_permissions() -> None:
    """The ClusterRole allows pods get/list/watch, pods/eviction create, events create and nodes get, nothing else."""
    granted = {
        (group, resource, verb)
        for rule in one("ClusterRole")["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert granted == {
        ("", "pods", "get"),
        ("", "pods", "list"),
        ("", "pods", "watch"),
        ("", "pods/eviction", "create"),
        ("", "events", "create"),
        ("", "nodes", "get"),
    }
    assert all(
        not rule.get("resourceNames") and not rule.get("nonResourceURLs") for rule in one("ClusterRole")["rules"]
    )


def test_role_is_bound_to_the_daemonsets_service_account() -> None:
    """The ClusterRoleBinding gives the ClusterRole to the service account the DaemonSet's pods run as."""
    binding = one("ClusterRoleBinding")
    account = one("ServiceAccount")["metadata"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": one("ClusterRole")["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["name"], "namespace": account["namespace"]}
    ]
    assert one("DaemonSet")["spec"]["template"]["spec"]["serviceAccountName"] == account["name"]


def test_configmap_config_passes_nodeguard_validation() -> None:
    """The embedded config is valid for nodeguard, reads the host's cgroups and keeps the pod's (host) /proc."""
    settings = node_settings()
    assert settings.sensing.cgroup_root == "/host/sys/fs/cgroup"
    assert settings.sensing.proc_root == "/proc"  # hostPID: the pod's /proc is the host's
    assert settings.guard.objectives, "the example config guards nothing"
    assert node_settings({"node.kubernetes.io/pool": "batch"}).guard.dry_run


@pytest.mark.parametrize("source", ["configmap.yaml", "examples/kubernetes.json"])
def test_kubernetes_integration_is_on_with_the_pods_own_credentials(source: str) -> None:
    """The shipped configs turn the Kubernetes integration on with in-cluster defaults: pod metadata from the API
    server at the address kubelet gives every pod, the service account's token and CA, evictions through the
    Eviction API, Events, and the Node's labels for the perNode rules."""
    text = embedded_config_text() if source == "configmap.yaml" else (REPO / "packaging" / source).read_text()
    kube = parse_text(text, source).settings_for({"kubernetes.io/hostname": "node-1"}).kubernetes
    assert kube.enabled
    assert (kube.source, kube.evict_via, kube.events, kube.node_labels_from_api) == ("apiserver", "api", True, True)
    assert kube.api_server_url is None  # KUBERNETES_SERVICE_HOST and _PORT, which kubelet sets in every pod
    assert Path(kube.token_path).parent == Path(kube.ca_path).parent == Path(SERVICE_ACCOUNT_DIR)


def test_daemonset_pod_gets_its_service_account_token_and_node_name() -> None:
    """The pod runs as the bound service account with its token mounted where the integration reads it, and gets
    its node's name (whose pods it lists and whose labels it reads) from spec.nodeName."""
    pod = one("DaemonSet")["spec"]["template"]["spec"]
    assert pod.get("automountServiceAccountToken", True) is True
    assert one("ServiceAccount").get("automountServiceAccountToken", True) is True
    assert not any(Path(SERVICE_ACCOUNT_DIR).is_relative_to(path) for path in mounts())
    env = {e["name"]: e for e in daemonset_container()["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


def test_daemonset_runs_privileged_in_the_hosts_pid_namespace() -> None:
    """The pod is privileged, uses the host's PID namespace, is node-critical and tolerates every taint."""
    ds = one("DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    assert daemonset_container()["securityContext"]["privileged"] is True
    assert pod["priorityClassName"] == "system-node-critical"
    assert {"operator": "Exists"} in pod["tolerations"]
    assert ds["spec"]["updateStrategy"]["type"] == "RollingUpdate"


def test_daemonset_mounts_host_cgroups_run_dir_and_config() -> None:
    """The host's cgroup tree, the host's /run/nodeguard and /var/lib/nodeguard (the history) and the ConfigMap are
    mounted where the config expects them."""
    settings = node_settings()
    by_path = mounts()
    cgroup = by_path[settings.sensing.cgroup_root]
    assert cgroup["hostPath"]["path"] == "/sys/fs/cgroup"
    run = by_path["/run/nodeguard"]
    assert run["hostPath"] == {"path": "/run/nodeguard", "type": "DirectoryOrCreate"}
    assert Path(settings.actuation.ledger_path).parent == Path("/run/nodeguard")
    assert Path(settings.gate.socket).parent == Path("/run/nodeguard")
    history = Path(settings.history.path)
    state = next(by_path[str(parent)] for parent in history.parents if str(parent) in by_path)
    assert state["hostPath"] == {"path": "/var/lib/nodeguard", "type": "DirectoryOrCreate"}, "on the host's disk"
    config = by_path["/etc/nodeguard"]
    assert config["configMap"]["name"] == one("ConfigMap")["metadata"]["name"]
    args = daemonset_container()["args"]
    config_file = Path(args[args.index("--config") + 1])
    assert config_file.parent == Path("/etc/nodeguard")
    assert config_file.name in one("ConfigMap")["data"]


def test_node_name_comes_from_the_downward_api() -> None:
    """NODE_NAME is the pod's spec.nodeName, so per-node rules select by the node's name."""
    env = {e["name"]: e for e in daemonset_container()["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def test_probes_reach_the_http_port_of_the_config() -> None:
    """Liveness and readiness probe /healthz and /readyz on the port the config's http.listen binds on all addresses."""
    settings = node_settings()
    assert settings.http.enabled
    host, _, port = settings.http.listen.rpartition(":")
    assert host == "0.0.0.0"  # kubelet probes the pod IP, not the pod's loopback
    container = daemonset_container()
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"].partition("?")[0] == "/readyz"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        if probe in container:
            assert probe_port(container[probe]) == int(port), probe


def test_a_rollout_starts_the_new_pod_before_it_stops_the_old_one() -> None:
    """maxSurge 1, maxUnavailable 0, with a readiness probe that a pod waiting to take over passes (the old pod goes
    only once the new one is ready) and a grace period that covers the old pod's wait for it and the drain."""
    from nodeguard.handover import HANDOVER_SECONDS

    strategy = one("DaemonSet")["spec"]["updateStrategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    path, _, query = daemonset_container()["readinessProbe"]["httpGet"]["path"].partition("?")
    assert (path, query) == ("/readyz", "successor")
    grace = one("DaemonSet")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > HANDOVER_SECONDS + node_settings().coordination.drain_seconds


def test_nodeguard_pod_is_never_its_own_candidate() -> None:
    """The pod is Guaranteed QoS (requests equal limits) and the config never acts on Guaranteed pods; a Guaranteed
    pod's cgroup is also outside the QoS tiers whose CPU weight the protect lever lowers (daemonset.yaml says why a
    CPU request without a limit is not used)."""
    resources = daemonset_container()["resources"]
    for resource in ("cpu", "memory"):
        assert resources["requests"][resource] == resources["limits"][resource], resource
    classes = {str(c) for c in node_settings().guard.candidates.classes}
    assert "Guaranteed" not in classes


def test_memory_limit_covers_every_gate_client_that_does_not_read() -> None:
    """The container's memory limit holds the daemon (~50 MiB, 64 allowed) plus the most gate.maxConnections clients can hold."""
    from nodeguard.gate.server import CLIENT_MEMORY
    from nodeguard.kubernetes.quantities import parse_kube_quantity

    limit = parse_kube_quantity(daemonset_container()["resources"]["limits"]["memory"])
    clients = node_settings().gate.max_connections * CLIENT_MEMORY
    assert 64 * 2**20 + clients <= limit, (limit, clients)


def test_one_configmap_serves_every_node_of_a_coordinating_cluster() -> None:
    """The ConfigMap's coordination section has seeds and no member list, so any node, also one added later,
    joins with it; turned on, it validates, and its password file is where the DaemonSet mounts the Secret."""
    import json

    from nodeguard.coordination.settings import CoordinationSettings

    raw = json.loads(embedded_config_text())["global"]["coordination"]
    assert raw["seeds"] and "nodes" not in raw
    settings = CoordinationSettings.model_validate({**raw, "enabled": True})
    assert settings.genesis_seeds == raw["seeds"] and settings.drain_seconds > 0
    for name in ("node-1", "a-node-added-next-year"):
        assert node_settings({"kubernetes.io/hostname": name}).coordination.seeds == raw["seeds"]
    password = Path(settings.broker.password_file or "")
    volume = mounts()[str(password.parent)]
    assert volume["secret"]["optional"] is True
    grace = one("DaemonSet")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > settings.drain_seconds + 5  # room to drain before the kubelet kills it


RESTORE_JOB = MANIFESTS / "restore-job.yaml"
PLACEHOLDER = "node-to-restore"  # the node's name in restore-job.yaml, replaced by the sed its comment gives


def restore_container() -> dict[str, Any]:
    [container] = one("Job")["spec"]["template"]["spec"]["containers"]
    return container


def restore_mounts() -> dict[str, dict[str, Any]]:
    """Mount path -> the volume mounted there, for the restore Job's container."""
    volumes = {v["name"]: v for v in one("Job")["spec"]["template"]["spec"]["volumes"]}
    return {m["mountPath"]: volumes[m["name"]] for m in restore_container()["volumeMounts"]}


def restore_commands() -> list[list[str]]:
    """The nodeguard command lines the restore Job's shell runs, in order, without `exec`."""
    import shlex

    container = restore_container()
    assert container["command"] == ["/bin/sh", "-c"]
    [script] = container["args"]
    lines = [shlex.split(line) for line in script.splitlines() if line.strip()]
    return [line[1:] if line[0] == "exec" else line for line in lines]


def test_restore_job_mounts_the_host_and_the_config_where_the_daemonset_does() -> None:
    """The restore Job sees the host's cgroup tree, the host's /run/nodeguard and the ConfigMap at the DaemonSet's
    mount paths (so the ConfigMap's cgroupRoot and ledgerPath name the same files), plus a scratch /tmp, with the
    DaemonSet's image, privileges and host PID namespace; not the MQTT password nor the decision history's
    directory, which a restore uses neither of."""
    daemon, job = mounts(), restore_mounts()
    for path, volume in daemon.items():
        if "secret" in volume or volume.get("hostPath", {}).get("path") == "/var/lib/nodeguard":
            assert path not in job
            continue
        assert path in job, path
        assert {k: v for k, v in job[path].items() if k != "name"} == {
            k: v for k, v in volume.items() if k != "name"
        }, path
    assert set(job) - set(daemon) == {"/tmp"} and "emptyDir" in job["/tmp"]  # `held` copies the ledger there
    settings = node_settings()
    assert job[settings.sensing.cgroup_root]["hostPath"]["path"] == "/sys/fs/cgroup"
    assert job[str(Path(settings.actuation.ledger_path).parent)]["hostPath"]["path"] == "/run/nodeguard"
    container, pod = restore_container(), one("Job")["spec"]["template"]["spec"]
    assert container["image"] == daemonset_container()["image"]
    assert container["securityContext"] == {"privileged": True, "runAsUser": 0, "readOnlyRootFilesystem": True}
    assert pod["hostPID"] is True and {"operator": "Exists"} in pod["tolerations"]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"] == {e["name"]: e for e in daemonset_container()["env"]}["NODE_NAME"]


def test_restore_job_shows_what_is_held_then_restores_all_with_the_daemonsets_config() -> None:
    """The Job's shell runs `nodeguard held`, then `nodeguard restore --all`, both parsed by nodeguard's own
    parser and both reading the config file the DaemonSet's daemon reads."""
    from nodeguard.surfaces.cli import _parser

    args = daemonset_container()["args"]
    config = args[args.index("--config") + 1]
    parsed = [_parser().parse_args(line[1:]) for line in restore_commands()]
    assert [line[0] for line in restore_commands()] == ["nodeguard", "nodeguard"]
    assert [p.command for p in parsed] == ["held", "restore"]
    assert parsed[1].all is True and parsed[1].ledger is None and parsed[0].ledger is None
    assert [str(p.config) for p in parsed] == [config, config]


def test_restore_job_is_one_node_at_a_time_and_kept_out_of_the_base() -> None:
    """The Job is bound by name to the node its comment's sed puts in, never retried, and after that sed (run
    here) it validates with its name and node replaced; the kustomize base does not list it."""
    import subprocess

    job = one("Job")
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeName"] == PLACEHOLDER and job["metadata"]["name"] == f"nodeguard-restore-{PLACEHOLDER}"
    assert job["spec"]["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"
    assert job["metadata"]["namespace"] == NAMESPACE
    text = RESTORE_JOB.read_text(encoding="utf-8")
    [usage] = [line for line in text.splitlines() if line.startswith("#") and "sed " in line]
    expression = usage.split('"')[1]
    assert expression == f"s/{PLACEHOLDER}/$NODE/g", usage
    sed = subprocess.run(["sed", expression.replace("$NODE", "worker-7"), str(RESTORE_JOB)], capture_output=True,
                         text=True, check=True, timeout=30)  # fmt: skip
    [edited] = [doc for doc in yaml.safe_load_all(sed.stdout) if doc is not None]
    assert edited["spec"]["template"]["spec"]["nodeName"] == "worker-7"
    assert edited["metadata"]["name"] == "nodeguard-restore-worker-7"
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(edited, version, strict=True)
    base = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text(encoding="utf-8"))
    assert RESTORE_JOB.name not in base["resources"]
