"""The ``kubernetes`` section of the config: pod metadata, evictions through the API, events, node labels.

Which source of pod metadata: ``apiserver`` by default. The DaemonSet does not
use hostNetwork, so the kubelet is not on the pod's 127.0.0.1; it is on the
node's IP (``NODE_IP`` from the downward API's ``status.hostIP``), where it
authorizes ``/pods`` as ``nodes/proxy`` (``nodes/pods`` with
KubeletFineGrainedAuthz) and often serves a self-signed certificate that the
cluster CA does not verify. The API server is reachable from every pod, is
signed by the service account's CA, and needs only ``pods list``.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator

from nodeguard.config_base import Model

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class KubernetesSettings(Model):
    """The Kubernetes integration; off unless ``enabled``."""

    enabled: bool = Field(False, description="use pod metadata, the Eviction API, events and node labels")
    source: Literal["apiserver", "kubelet"] = Field(
        "apiserver", description="where pod metadata comes from: the API server (default) or the kubelet's /pods"
    )
    kubelet_url: str | None = Field(
        None, description="default: https://$NODE_IP:10250, or https://127.0.0.1:10250 without NODE_IP"
    )
    api_server_url: str | None = Field(
        None, description="default: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT"
    )
    token_path: str = Field(f"{SERVICE_ACCOUNT_DIR}/token", description="bearer token file, re-read as it rotates")
    ca_path: str = Field(f"{SERVICE_ACCOUNT_DIR}/ca.crt", description="CA bundle that signs the API server")
    kubelet_ca_path: str | None = Field(None, description="CA bundle that signs the kubelet; default: caPath")
    refresh_seconds: float = Field(15.0, gt=0, le=3600, description="pod metadata is listed again this often")
    timeout_seconds: float = Field(5.0, gt=0, le=300, description="for each request")
    evict_via: Literal["api", "cgroup", "api-then-cgroup"] = Field(
        "api",
        description="evict pods through the Eviction API (PodDisruptionBudgets hold), by killing the cgroup, "
        "or through the API and by the cgroup when the API cannot be asked (never when a budget says no)",
    )
    eviction_grace_seconds: int | None = Field(
        None, ge=0, le=86_400, description="grace period of an eviction; null: the pod's terminationGracePeriodSeconds"
    )
    eviction_backoff_seconds: float = Field(
        60.0,
        gt=0,
        le=86_400,
        description="a pod whose eviction was refused (e.g. by a PodDisruptionBudget) is not a candidate for this "
        "long, doubling on each refusal in a row up to 10 minutes",
    )
    events: bool = Field(True, description="record a Kubernetes Event on the pod for each throttle, restore, eviction")
    node_labels_from_api: bool = Field(
        True, description="select perNode rules by this node's labels from the API (read from the global section)"
    )

    @field_validator("token_path", "ca_path", "kubelet_ca_path")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise ValueError("expected an absolute path")
        return value

    @field_validator("kubelet_url", "api_server_url")
    @classmethod
    def _https(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("https://", "http://")):
            raise ValueError('expected a URL like "https://10.0.0.1:6443"')
        return value.rstrip("/") if value is not None else None

    def resolved_api_server_url(self) -> str:
        """The API server's URL; the in-cluster service from the environment unless configured."""
        if self.api_server_url:
            return self.api_server_url
        host = os.environ.get("KUBERNETES_SERVICE_HOST") or "kubernetes.default.svc"
        port = os.environ.get("KUBERNETES_SERVICE_PORT") or "443"
        return f"https://{_host(host)}:{port}"

    def resolved_kubelet_url(self) -> str:
        if self.kubelet_url:
            return self.kubelet_url
        return f"https://{_host(os.environ.get('NODE_IP') or '127.0.0.1')}:10250"

    def resolved_kubelet_ca_path(self) -> str:
        return self.kubelet_ca_path or self.ca_path
