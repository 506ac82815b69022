"""Shared fixtures: daemons are started once per (size, topology) and reused across tests; each
test gets clients of its own, in a job of its own, so no test meets another's ops."""

from __future__ import annotations

import hashlib
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


class SharedDaemons:
    """Running daemon clusters by (size, topology), the least recently used stopped first."""

    def __init__(self) -> None:
        self.cache: dict[tuple[int, str, int], Cluster] = {}

    def get(self, n: int, topology: str, per_node: int = 1) -> Cluster:
        """The cluster of ``n`` daemons (``per_node`` workers each) on ``topology``, started if
        it is not running."""
        key = (n, topology, per_node)
        if key not in self.cache:
            while len(self.cache) >= KEEP:
                self.stop(self.cache.pop(next(iter(self.cache))))
            self.cache[key] = Cluster(n, topology, "--set", f"memory.arena_bytes={ARENA_BYTES}",
                                      per_node=per_node)
        self.cache[key] = self.cache.pop(key)  # most recently used last
        return self.cache[key]

    @staticmethod
    def stop(c: Cluster) -> None:
        """Stop one cluster; its daemons must exit cleanly."""
        codes = c.stop()
        assert codes == [0] * c.n, f"daemons exited with {codes}"


@pytest.fixture(scope="session")
def _shared_daemons() -> Iterator[SharedDaemons]:
    daemons = SharedDaemons()
    yield daemons
    for c in daemons.cache.values():
        daemons.stop(c)


@pytest.fixture
def cluster(_shared_daemons: SharedDaemons, request: pytest.FixtureRequest
            ) -> Iterator[ClusterFactory]:
    """``cluster(n, topology, per_node=1)``: shared daemons (``n`` of them, ``per_node``
    workers each), with clients of this test's own job."""
    job = "test-" + hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:12]
    used: list[Cluster] = []

    def get(n: int, topology: str = "ring", per_node: int = 1) -> Cluster:
        c = _shared_daemons.get(n, topology, per_node)
        if c not in used:
            c.disconnect()  # a cluster left connected by an interrupted test
            c.connect(job=job)
            used.append(c)
        return c

    yield get
    for c in used:
        c.disconnect()
