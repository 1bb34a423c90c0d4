"""Benchmark: the start gate through the real daemon's socket.

1. Grant latency: a load holds the only slot (maxStarting=1) and another waits
   on a second connection; the holder says ``ready``, and the time until the
   waiter hears it is admitted is measured (p50, p99). It includes the holder's
   request, the admission, the group-committed write of the state file (fsync)
   and the waiter's response. Baseline: the round trip of a ``ping`` over the
   same socket, measured in the same run.
2. Admissions per second of no-op loads (no readiness check: admitted and ready
   at once, then released): ``submit`` + ``release`` from 16 concurrent
   connections. Baseline: ``ping`` round trips per second over the same connections.

The state directory is on tmpfs (/dev/shm) when there is one, as /run/nodeguard
is in production; the grant latency is measured once more with the state on
the disk under the system temp directory. Prints one JSON object last.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nodeguard.config import Settings
from nodeguard.gate.connection import GateClient

GRANTS = 1000
PINGS = 3000
CLIENTS = 16
NOOP_LOADS = 16_000


def percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


@contextlib.contextmanager
def daemon(state_root: str | None) -> Iterator[str]:
    tmp = tempfile.mkdtemp(prefix="nodeguard-bench-gate-", dir=state_root)
    sock = os.path.join(tmp, "gate.sock")
    config = {
        "global": {
            "sensing": {"kubepods": False},
            "actuation": {"ledgerPath": os.path.join(tmp, "ledger.json")},
            "gate": {"socket": sock, "maxStarting": 1, "maxStartingPerCore": None, "minRate": 0, "maxLoads": 100_000},
            # No HTTP endpoints: the default port may be taken by a daemon already running here.
            **({"http": {"enabled": False}} if "http" in Settings.model_fields else {}),
        }
    }
    config_path = os.path.join(tmp, "config.json")
    Path(config_path).write_text(json.dumps(config))
    proc = subprocess.Popen(
        [sys.executable, "-m", "nodeguard", "--log-level", "warning", "run", "--config", config_path],
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as probe:
                probe.connect(sock)
                break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("the daemon did not start serving the gate")
            time.sleep(0.05)
        yield sock
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


async def ping_latencies(path: str) -> list[float]:
    client = await GateClient.connect(path)
    samples = []
    for _ in range(PINGS):
        started = time.perf_counter()
        await client.request("ping")
        samples.append(time.perf_counter() - started)
    await client.close()
    return samples


async def grant_latencies(path: str, count: int) -> list[float]:
    """Slot freed (the holder's ``ready`` sent) -> the waiter hears it is admitted."""
    holder, waiter = await GateClient.connect(path), await GateClient.connect(path)
    notify = {"type": "notify"}
    held = "g-0"
    assert (await holder.request("submit", name=held, readiness=notify))["load"]["state"] == "starting"
    samples = []
    for i in range(1, count + 1):
        name = f"g-{i}"
        assert (await waiter.request("submit", name=name, readiness=notify))["load"]["state"] == "pending"
        admitted = asyncio.ensure_future(waiter.request("wait", name=name, until="starting"))
        await waiter.request("ping")  # requests of one connection are handled in order: the wait is registered
        started = time.perf_counter()
        await holder.request("ready", name=held)
        response = await admitted
        samples.append(time.perf_counter() - started)
        assert response["load"]["state"] == "starting", response
        await holder.request("release", name=held)
        held, holder, waiter = name, waiter, holder
    await holder.request("ready", name=held)
    await holder.request("release", name=held)
    await holder.close()
    await waiter.close()
    return samples


async def throughput(path: str, op: str) -> float:
    """Requests (``ping``) or no-op loads (``load``: submit + release) per second over CLIENTS connections."""
    clients = [await GateClient.connect(path) for _ in range(CLIENTS)]
    per_client = NOOP_LOADS // CLIENTS

    async def work(index: int, client: GateClient) -> None:
        for i in range(per_client):
            if op == "ping":
                await client.request("ping")
                continue
            name = f"noop-{index}-{i}"
            response = await client.request("submit", name=name)
            assert response["load"]["state"] == "ready", response
            await client.request("release", name=name)

    started = time.perf_counter()
    await asyncio.gather(*(work(i, c) for i, c in enumerate(clients)))
    elapsed = time.perf_counter() - started
    for client in clients:
        await client.close()
    return per_client * CLIENTS / elapsed


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


async def measure(path: str) -> dict[str, float]:
    await grant_latencies(path, 50)  # warm-up
    pings = await ping_latencies(path)
    grants = await grant_latencies(path, GRANTS)
    pings_per_s = await throughput(path, "ping")
    loads_per_s = await throughput(path, "load")
    return {
        "grant_latency_p50_ms": ms(statistics.median(grants)),
        "grant_latency_p99_ms": ms(percentile(grants, 0.99)),
        "admissions_per_s": round(loads_per_s),
        "baseline_ping_p50_ms": ms(statistics.median(pings)),
        "baseline_ping_p99_ms": ms(percentile(pings, 0.99)),
        "baseline_pings_per_s": round(pings_per_s),
    }


def main() -> None:
    tmpfs = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    with daemon(tmpfs) as path:
        result = asyncio.run(measure(path))
    with daemon(None) as path:
        on_disk = asyncio.run(grant_latencies(path, GRANTS // 2))
    result.update(
        {
            "grant_latency_p50_ms_state_on_disk": ms(statistics.median(on_disk)),
            "grant_latency_p99_ms_state_on_disk": ms(percentile(on_disk, 0.99)),
            "state_dir": "tmpfs" if tmpfs else "disk",
            "grants": GRANTS,
            "noop_loads": NOOP_LOADS,
            "clients": CLIENTS,
        }
    )
    for key, value in result.items():
        print(f"{key:40} {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    from bench.common import stop_cleanly_on_sigterm

    stop_cleanly_on_sigterm()
    main()
