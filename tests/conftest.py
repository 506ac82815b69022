"""Shared fixtures: clusters are started once per (size, topology) and reused across tests."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator

import pytest

from cluster import Cluster

ClusterFactory = Callable[..., Cluster]

#: clusters kept running at once, and each worker's arena size (tests use small tensors)
KEEP = 3
ARENA_BYTES = 32 << 20


@pytest.fixture(scope="session", autouse=True)
def _no_daemon_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """Whatever a failing test left running is killed at the end of the session. Every
    cluster's directory (sockets, daemon logs) is removed, unless a test failed: then they are
    kept, and named, for the daemons' logs."""
    yield
    failed = request.session.testsfailed
    for c in Cluster.started:
        c.kill()
        if not failed:
            shutil.rmtree(c.dir, ignore_errors=True)
    if failed:
        print("\ndaemon logs kept in:", *sorted({c.dir for c in Cluster.started}))


@pytest.fixture(scope="session")
def cluster() -> Iterator[ClusterFactory]:
    """``cluster(n, topology)``: a connected cluster, shared by every test that asks for it."""
    cache: dict[tuple[int, str], Cluster] = {}

    def stop(c: Cluster) -> None:
        codes = c.stop()
        assert codes == [0] * c.n, f"daemons exited with {codes}"

    def get(n: int, topology: str = "ring") -> Cluster:
        key = (n, topology)
        if key not in cache:
            while len(cache) >= KEEP:  # bound memory: stop the least recently used cluster
                stop(cache.pop(next(iter(cache))))
            c = Cluster(n, topology, "--set", f"memory.arena_bytes={ARENA_BYTES}")
            c.connect()
            cache[key] = c
        cache[key] = cache.pop(key)  # most recently used last
        return cache[key]

    yield get
    for c in cache.values():
        stop(c)
