"""The kubernetes config section: defaults and where the URLs come from."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from nodeguard.kubernetes.settings import KubernetesSettings


def test_defaults_are_off_and_use_the_api_server() -> None:
    """Disabled by default; metadata from the API server, evictions through the API, the pod's own grace."""
    settings = KubernetesSettings()
    assert not settings.enabled
    assert settings.source == "apiserver"
    assert settings.evict_via == "api"
    assert settings.eviction_grace_seconds is None
    assert settings.token_path == "/var/run/secrets/kubernetes.io/serviceaccount/token"
    assert settings.ca_path == "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"


def test_urls_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-cluster service variables and NODE_IP give the default URLs, IPv6 in brackets."""
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    monkeypatch.setenv("NODE_IP", "10.0.0.5")
    settings = KubernetesSettings()
    assert settings.resolved_api_server_url() == "https://[fd00::1]:6443"
    assert settings.resolved_kubelet_url() == "https://10.0.0.5:10250"
    monkeypatch.delenv("NODE_IP")
    assert settings.resolved_kubelet_url() == "https://127.0.0.1:10250"


def test_configured_urls_win_and_camel_case_keys() -> None:
    """Configured values override the environment; keys are camelCase."""
    settings = KubernetesSettings.model_validate(
        {"apiServerUrl": "https://api.example:6443/", "evictVia": "api-then-cgroup", "evictionGraceSeconds": 5}
    )
    assert settings.resolved_api_server_url() == "https://api.example:6443"
    assert settings.evict_via == "api-then-cgroup"
    assert settings.eviction_grace_seconds == 5


@pytest.mark.parametrize(
    "data",
    [{"tokenPath": "token"}, {"apiServerUrl": "api:6443"}, {"source": "etcd"}, {"refreshSeconds": 0}, {"bogus": 1}],
)
def test_rejects_bad_values(data: dict[str, object]) -> None:
    """Relative paths, URLs without a scheme, unknown sources and keys are config errors."""
    with pytest.raises(ValidationError):
        KubernetesSettings.model_validate(data)
