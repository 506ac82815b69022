"""Prometheus metrics (issue 25): a real job moves the counters by what it did.

Two daemons serve ``/metrics`` (``metrics.port``); heartbeats are off (``timeouts.heartbeat``
an hour), so every frame on the links is an op's: three neighbor averages of 1000 floats are
three requests of one tensor and 4000 bytes, three OK ops, and three DATA frames each way (plus
the credit they lent, given back).
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from cluster import Cluster, free_ports
from decent.core import Client, DecentError
from decent_wire.v1 import decent_pb2 as pb

pytestmark = pytest.mark.slow

#: the dashboard shipped for these metrics
DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "decent.json"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    """Every sample of ``/metrics`` by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
    """How much one sample grew."""
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


class Served(Cluster):
    """A cluster whose daemon i serves its metrics on ``ports[i]``."""

    ports: list[int] = []

    def spawn(self, i: int, topology: str, *extra: str) -> subprocess.Popen[bytes]:
        """Daemon ``i`` with its own metrics port."""
        return super().spawn(i, topology, *extra, "--set", f"metrics.port={self.ports[i]}")


@pytest.fixture
def served() -> Iterator[tuple[Cluster, list[int]]]:
    ports = free_ports(2)
    Served.ports = ports
    c = Served(2, "ring", "--set", "timeouts.heartbeat=3600")
    try:
        yield c, ports
    finally:
        c.stop()


def average(cl: Client[torch.Tensor], name: str) -> torch.Tensor:
    """Ranks 0 and 1 average 1000 floats (0 and 2: ones)."""
    return cl.neighbor_allreduce(torch.full((1000,), 2.0 * cl.rank), name=name, timeout=30)


def test_a_real_job_moves_the_counters_by_what_it_did(served: tuple[Cluster, list[int]]) -> None:
    c, ports = served
    c.connect(job="metrics")
    assert [c.status(i).metrics_port for i in range(2)] == ports
    before = [scrape(p) for p in ports]
    for name in ("m0", "m1", "m2"):
        got = c.run(functools.partial(average, name=name))
        assert all(torch.equal(g, torch.ones(1000)) for g in got)
    after = [scrape(p) for p in ports]
    for i, peer in ((0, "1"), (1, "0")):
        b, a = before[i], after[i]
        assert moved(b, a, "decent_ops_total", op="NEIGHBOR_ALLREDUCE", outcome="OK") == 3
        assert moved(b, a, "decent_op_seconds_count", op="NEIGHBOR_ALLREDUCE") == 3
        assert moved(b, a, "decent_request_tensors_count") == 3
        assert moved(b, a, "decent_request_tensors_sum") == 3
        assert moved(b, a, "decent_request_bytes_sum") == 3 * 4000
        for direction in ("sent", "received"):  # a DATA frame per op, and the credit it
            # lent given back on the next frame, or on its own later (timing decides)
            frames = moved(b, a, "decent_peer_messages_total", peer=peer, direction=direction)
            assert 3 <= frames <= 6, frames
            grew = moved(b, a, "decent_peer_bytes_total", peer=peer, direction=direction)
            assert 3 * 4000 < grew < 3 * 4000 + 6 * 256  # payloads and their headers
        assert a[("decent_peer_connected", (("peer", peer),))] == 1
        assert a[("decent_peer_connections", (("peer", peer),))] == 1  # loopback: one
        assert 0 < a[("decent_peer_connect_rtt_seconds", (("peer", peer),))] < 1
        assert a[("decent_ops_in_flight", ())] == 0
        assert a[("decent_workers", ())] == 1
        assert a[("decent_arena_bytes", ())] == c.status(i).arena_bytes > 0


def test_failed_ops_are_counted_by_their_error(served: tuple[Cluster, list[int]]) -> None:
    c, ports = served
    c.connect(job="metrics-fail")
    before = scrape(ports[0])
    results = c.run_catching(lambda cl: cl.neighbor_allreduce(
        torch.zeros(4 + cl.rank), name="shapes", timeout=30))
    assert all(isinstance(r, DecentError) and r.code == pb.MISMATCH for r in results), results
    after = scrape(ports[0])
    assert moved(before, after, "decent_ops_total", op="NEIGHBOR_ALLREDUCE",
                 outcome="MISMATCH") == 1
    assert moved(before, after, "decent_ops_total", op="NEIGHBOR_ALLREDUCE", outcome="OK") == 0


def test_every_metric_the_grafana_dashboard_asks_for_is_served(
        served: tuple[Cluster, list[int]]) -> None:
    c, ports = served
    c.connect(job="metrics-dashboard")
    c.run(functools.partial(average, name="d0"))
    with urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/metrics", timeout=30) as reply:
        families = list(text_string_to_metric_families(reply.read().decode()))
    served_names = {s.name for f in families for s in f.samples} | {
        f.name + suffix for f in families for suffix in ("", "_total", "_bucket", "_count")}
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    asked = {name for e in exprs for name in re.findall(r"\bdecent_\w+", e)}
    assert len(asked) >= 12, asked  # every kind of metric the issue lists has a panel
    assert asked <= served_names, asked - served_names
