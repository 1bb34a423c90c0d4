"""The daemon's HTTP endpoints as a test reads them: a GET's status and body, one sample of the metrics text."""

from __future__ import annotations

import urllib.error
import urllib.request


def get(url: str) -> tuple[int, str]:
    """The status and body of a GET of ``url``, an error status included."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """The value of the first sample of ``name`` with these labels in a Prometheus text exposition; None if none."""
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None
