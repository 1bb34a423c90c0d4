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
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        if probe in container:
            assert probe_port(container[probe]) == int(port), probe


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
