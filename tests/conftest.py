"""Shared fixtures: clusters are started once per (size, topology) and reused across tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from cluster import Cluster

ClusterFactory = Callable[..., Cluster]


@pytest.fixture(scope="session")
def cluster() -> Iterator[ClusterFactory]:
    """``cluster(n, topology)``: a connected cluster, shared by every test that asks for it."""
    cache: dict[tuple[int, str], Cluster] = {}

    def get(n: int, topology: str = "ring") -> Cluster:
        key = (n, topology)
        if key not in cache:
            c = Cluster(n, topology)
            c.connect()
            cache[key] = c
        return cache[key]

    yield get
    for c in cache.values():
        codes = c.stop()
        assert codes == [0] * c.n, f"daemons exited with {codes}"
