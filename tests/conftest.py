"""Shared fixtures: daemons are started once per (size, topology) and reused across tests; each
test gets clients of its own, in a job of its own, so no test meets another's ops.

``cluster`` gives daemon processes (:mod:`cluster`); ``inprocess`` gives daemons running in this
process (:mod:`inprocess`), for the fast tier (``make test-fast``: ``-m "not slow and not deploy
and not netns"``). The markers are registered in pyproject.toml."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable, Iterator

import pytest
from inprocess import InProcessCluster, job_of

from cluster import Cluster

ClusterFactory = Callable[..., Cluster]
InProcessFactory = Callable[..., InProcessCluster]

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
    for local in InProcessCluster.started:
        local.stop(check=False)
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


class SharedInProcess:
    """Running in-process clusters by (size, topology, workers per daemon, settings), the least
    recently used stopped first."""

    def __init__(self) -> None:
        self.cache: dict[tuple[object, ...], InProcessCluster] = {}

    def get(self, n: int, topology: str, per_node: int, settings: dict[str, object]
            ) -> InProcessCluster:
        """The cluster of that shape, started if it is not running."""
        key = (n, topology, per_node, tuple(sorted(settings.items())))
        if key not in self.cache:
            while len(self.cache) >= KEEP:
                self.cache.pop(next(iter(self.cache))).stop()
            self.cache[key] = InProcessCluster(n, topology, per_node, dict(settings))
        self.cache[key] = self.cache.pop(key)  # most recently used last
        return self.cache[key]


@pytest.fixture(scope="session")
def _shared_inprocess() -> Iterator[SharedInProcess]:
    shared = SharedInProcess()
    yield shared
    for c in shared.cache.values():
        c.stop()  # each daemon must shut down cleanly


@pytest.fixture
def inprocess(_shared_inprocess: SharedInProcess, request: pytest.FixtureRequest
              ) -> Iterator[InProcessFactory]:
    """``inprocess(n, topology="ring", per_node=1, settings=None, **client_options)``: shared
    daemons in this process, with numpy clients (``.clients``) of this test's own job."""
    used: list[InProcessCluster] = []

    def get(n: int, topology: str = "ring", per_node: int = 1,
            settings: dict[str, object] | None = None, **options: object) -> InProcessCluster:
        c = _shared_inprocess.get(n, topology, per_node, settings or {})
        c.connect(job_of(request.node.nodeid), **options)
        used.append(c)
        return c

    yield get
    for c in used:
        c.disconnect()
