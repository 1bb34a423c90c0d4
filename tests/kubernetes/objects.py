"""Kubernetes objects shaped as the API reference shows them: Pod, PodList, Node, Status."""

from __future__ import annotations

from typing import Any

NODE = "worker-1"


def pod(
    name: str,
    uid: str,
    *,
    namespace: str = "default",
    node: str = NODE,
    qos: str = "Burstable",
    priority: int = 0,
    priority_class: str | None = None,
    cpu_requests: tuple[str | None, ...] = ("250m",),
    cpu_limits: tuple[str | None, ...] = (None,),
    memory_request: str | None = "64Mi",
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    grace: int = 30,
    created: str = "2024-05-01T10:00:00Z",
    started: str | None = "2024-05-01T10:00:03Z",
    init_containers: list[dict[str, Any]] | None = None,
    overhead: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A running Pod as the API server returns it in a PodList (items carry no kind/apiVersion)."""
    containers = []
    for index, cpu in enumerate(cpu_requests):
        requests: dict[str, str] = {}
        limits: dict[str, str] = {}
        if cpu is not None:
            requests["cpu"] = cpu
        if memory_request is not None:
            requests["memory"] = memory_request
        limit = cpu_limits[index] if index < len(cpu_limits) else None
        if limit is not None:
            limits["cpu"] = limit
        resources: dict[str, Any] = {}
        if requests:
            resources["requests"] = requests
        if limits:
            resources["limits"] = limits
        containers.append(
            {
                "name": f"c{index}",
                "image": "registry.k8s.io/pause:3.9",
                "resources": resources,
                "terminationMessagePath": "/dev/termination-log",
                "terminationMessagePolicy": "File",
                "imagePullPolicy": "IfNotPresent",
            }
        )
    spec: dict[str, Any] = {
        "containers": containers,
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": grace,
        "dnsPolicy": "ClusterFirst",
        "serviceAccountName": "default",
        "serviceAccount": "default",
        "nodeName": node,
        "securityContext": {},
        "schedulerName": "default-scheduler",
        "tolerations": [
            {
                "key": "node.kubernetes.io/not-ready",
                "operator": "Exists",
                "effect": "NoExecute",
                "tolerationSeconds": 300,
            }
        ],
        "priority": priority,
        "enableServiceLinks": True,
        "preemptionPolicy": "PreemptLowerPriority",
    }
    if priority_class is not None:
        spec["priorityClassName"] = priority_class
    if init_containers is not None:
        spec["initContainers"] = init_containers
    if overhead is not None:
        spec["overhead"] = overhead
    status: dict[str, Any] = {
        "phase": "Running",
        "conditions": [
            {"type": "Ready", "status": "True", "lastProbeTime": None, "lastTransitionTime": created},
        ],
        "hostIP": "10.0.0.5",
        "podIP": "10.244.1.7",
        "podIPs": [{"ip": "10.244.1.7"}],
        "qosClass": qos,
    }
    if started is not None:
        status["startTime"] = started
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "uid": uid,
        "resourceVersion": "4711",
        "creationTimestamp": created,
        "labels": labels if labels is not None else {"app": name},
    }
    if annotations:
        metadata["annotations"] = annotations
    return {"metadata": metadata, "spec": spec, "status": status}


def pod_list(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "123456"}, "items": items}


def node(name: str = NODE, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "uid": "9f1c8a2e-0000-4000-8000-00000000beef",
            "resourceVersion": "99",
            "creationTimestamp": "2024-01-01T00:00:00Z",
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                **(labels or {}),
            },
            "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24"]},
        "status": {
            "capacity": {"cpu": "8", "memory": "32Gi", "pods": "110"},
            "allocatable": {"cpu": "7910m", "memory": "31Gi", "pods": "110"},
            "addresses": [{"type": "InternalIP", "address": "10.0.0.5"}, {"type": "Hostname", "address": name}],
            "nodeInfo": {"kubeletVersion": "v1.30.2", "containerRuntimeVersion": "containerd://1.7.18"},
        },
    }


def status(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success" if code < 400 else "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details is not None:
        body["details"] = details
    return body


def budget_refusal(name: str, namespace: str = "default") -> dict[str, Any]:
    """What the API server answers (429) when a PodDisruptionBudget does not allow an eviction."""
    return status(
        429,
        "TooManyRequests",
        "Cannot evict pod as it would violate the pod's disruption budget.",
        {
            "name": name,
            "kind": "pods",
            "group": "policy",
            "causes": [
                {
                    "reason": "DisruptionBudget",
                    "message": "The disruption budget web-pdb needs 2 healthy pods and has 2 currently",
                }
            ],
        },
    )
