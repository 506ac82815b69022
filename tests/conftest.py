"""Shared fixtures: daemons are started once per (size, topology) and reused across tests; each
test gets clients of its own, in a job of its own, so no test meets another's ops.

``cluster`` gives daemon processes (:mod:`cluster`); ``inprocess`` gives daemons running in this
process (:mod:`inprocess`), for the fast tier (``make test-fast``: ``-m "not slow and not deploy
and not netns"``). The markers are registered in pyproject.toml; in a run that leaves slow tests
out, a test that starts a program without being marked slow fails, saying so (the fast tier stays
in-process)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import hostspeed
import pytest
from inprocess import InProcessCluster, job_of
from leftovers import Leftovers

from cluster import Cluster

ClusterFactory = Callable[..., Cluster]
#: the session's check of what it leaves behind (on its first process only)
LEFTOVERS = pytest.StashKey[Leftovers]()
InProcessFactory = Callable[..., InProcessCluster]

#: clusters kept running at once (per pytest-xdist worker: two when several share the machine),
#: and each worker's arena size (tests use small tensors)
KEEP = 2 if os.environ.get("PYTEST_XDIST_WORKER") else 3
ARENA_BYTES = 32 << 20

_running: list[pytest.Item] = []
_popen_init = subprocess.Popen.__init__


def _in_process_only(self: subprocess.Popen[Any], args: Any, *more: Any, **kw: Any) -> None:
    """``Popen.__init__`` while slow tests are left out: refused to a test not marked slow."""
    if _running and _running[-1].get_closest_marker("slow") is None:
        raise RuntimeError(f"{_running[-1].nodeid} starts a program ({str(args)[:120]}) but is "
                           "not marked slow; the fast tier runs in-process tests only: mark it "
                           "@pytest.mark.slow")
    _popen_init(self, args, *more, **kw)


def pytest_configure(config: pytest.Config) -> None:
    """A run that leaves out slow tests (``-m "not slow ..."``) refuses programs to the rest.
    The session's first process (not a pytest-xdist worker) marks what it starts, for the
    check of what is left at its end."""
    if "not slow" in (config.option.markexpr or ""):
        subprocess.Popen.__init__ = _in_process_only  # type: ignore[method-assign]
    if not hasattr(config, "workerinput"):
        config.stash[LEFTOVERS] = Leftovers()
        # measured once, before pytest-xdist starts its workers (they inherit it)
        os.environ.setdefault(hostspeed.ENV, f"{hostspeed.measure():.2f}")


#: the files that take longest (measured: ``--durations``), most first: pytest-xdist hands
#: whole files (``--dist loadfile``) to whichever worker is free, in collection order, so these
#: go first and the short files fill in around them, instead of one long file running alone
#: at the end while the other worker idles
LONGEST_FIRST = ("benchmarks/tests/test_harness.py", "tests/test_tf.py", "tests/test_docs.py",
                 "tests/test_examples.py", "tests/test_torch_ddp.py", "tests/test_algorithms.py",
                 "tests/test_torch_backend.py", "tests/test_decentrun_restarts.py",
                 "tests/test_lifecycle.py", "tests/test_security.py", "tests/test_horovod.py",
                 "tests/test_bluefog.py", "tests/test_optimizers.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (:data:`LONGEST_FIRST`), the rest in their order. (Run after
    pytest's own reordering by fixture scope, which would undo it.)"""
    del config
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item: pytest.Item) -> int:
        return rank.get(item.nodeid.split("::", 1)[0], len(LONGEST_FIRST))
    items.sort(key=key)  # stable: each file's tests keep their order


def pytest_report_header(config: pytest.Config) -> str:
    """The host-speed factor the tests' waits scale by (:mod:`hostspeed`)."""
    return f"host-speed factor: {hostspeed.factor():.2f} (waits for other processes x that)"


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The run fails when a daemon process or a network namespace it started is still there
    (each is removed, and named)."""
    leftovers = session.config.stash.get(LEFTOVERS, None)
    if leftovers is None:
        return
    left = leftovers.find()
    if left:
        print("\nleft behind by this test session (now removed):", *left, sep="\n  ")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _running.append(item)
    try:
        yield
    finally:
        _running.pop()


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
