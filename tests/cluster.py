"""Real local clusters for tests: decentd processes on loopback and torch clients in threads."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import grpc
import torch
from decentd_fork import ForkedDaemon
from hostspeed import scaled

import decent.torch as dt
from decent.core import Client
from decent_wire.v1 import decent_pb2 as pb
from decent_wire.v1 import decent_pb2_grpc as pb_grpc
from decentd.tools.launcher import free_ports

__all__ = ["DECENTRUN_ARENA", "Cluster", "delay", "free_ports", "peer_state", "run_each",
           "tf_cluster", "until", "until_running", "until_state"]


#: each worker's arena in a test cluster, unless the test sets ``memory.arena_bytes`` (the
#: daemon's default, 256 MiB, is touched whole at registration: eight workers would hold 2 GiB)
ARENA_BYTES = 32 << 20
#: decentrun's daemons in tests: the same arena (each is reserved whole at registration; the
#: default, 256 MiB a worker, made the suite's peak 1 GiB higher for one 4-worker example)
DECENTRUN_ARENA = ("--set", f"memory.arena_bytes={ARENA_BYTES}")
#: daemons are forked from a process that imported decentd once (:mod:`decentd_fork`), unless
#: ``$DECENT_TEST_FORK`` is 0: then each is ``python -m decentd``
FORK = os.environ.get("DECENT_TEST_FORK", "1") != "0"


def delay(rank: int) -> None:
    """Sleep as long as ``$DECENT_TEST_DELAY=RANK:SECONDS`` says for ``rank`` (a manual check
    that multi-rank tests wait on events, not on time)."""
    spec = os.environ.get("DECENT_TEST_DELAY", "")
    if spec and int(float(spec.split(":")[0])) == rank:
        time.sleep(float(spec.split(":")[1]))


def _delayed(fn: Callable[[Client[Any]], Any]) -> Callable[[Client[Any]], Any]:
    """``fn``, started late on the rank ``$DECENT_TEST_DELAY`` names (``RANK:SECONDS``)."""
    spec = os.environ.get("DECENT_TEST_DELAY", "")
    if not spec:
        return fn
    rank, seconds = (float(v) for v in spec.split(":"))

    def late(c: Client[Any]) -> Any:
        if c.rank == int(rank):
            time.sleep(seconds)
        return fn(c)
    return late


class Cluster:
    """``n`` daemons as real processes plus one torch client per worker (``per_node`` per
    daemon: worker r is local rank ``r % per_node`` of daemon ``r // per_node``)."""

    #: every cluster started in this test session (a session fixture kills what tests left)
    started: ClassVar[list[Cluster]] = []

    def __init__(self, n: int, topology: str = "ring", *extra: str, per_node: int = 1,
                 later: tuple[int, ...] = ()) -> None:
        """``later``: daemons not started now (:meth:`spawn` them; until then their place in
        ``procs`` holds a process that has exited)."""
        self.n = n
        self.per_node = per_node
        self.dir = tempfile.mkdtemp(prefix="decent-test-")
        self.peers = [f"127.0.0.1:{p}" for p in free_ports(n)]
        self.sockets = [os.path.join(self.dir, f"rank{i}.sock") for i in range(n)]
        self.logs = [os.path.join(self.dir, f"rank{i}.log") for i in range(n)]
        self.procs: list[subprocess.Popen[bytes]] = []
        for i in range(n):
            self.procs.append(subprocess.Popen(["true"]) if i in later
                              else self.spawn(i, topology, *extra))
        self.clients: list[Client[Any]] = []
        #: every client :meth:`connect` made: closed with the cluster even when a test dropped
        #: it from ``clients`` (a client left open keeps its arena mapped in this process)
        self._connected: list[Client[Any]] = []
        Cluster.started.append(self)

    def spawn(self, i: int, topology: str, *extra: str) -> subprocess.Popen[bytes]:
        """Start daemon ``i`` (with arenas of :data:`ARENA_BYTES` unless ``extra`` sets
        ``memory.arena_bytes``): forked from this process's fork server
        (:mod:`decentd_fork`), or with ``$DECENT_TEST_FORK=0`` as ``python -m decentd``."""
        arena = [] if any("memory.arena_bytes" in a for a in extra) \
            else ["--set", f"memory.arena_bytes={ARENA_BYTES}"]
        cmd = [sys.executable, "-m", "decentd", "--rank", str(i),
               "--peers", ",".join(self.peers), "--socket", self.sockets[i],
               "--topology", topology, "--set", "timeouts.start=30",
               "--workers-per-node", str(self.per_node), *arena, *extra]
        if FORK:
            return ForkedDaemon(cmd[3:], self.logs[i])
        with open(self.logs[i], "ab") as log:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def connect(self, **options: Any) -> list[Client[Any]]:
        """One client per rank (registration waits until each daemon has all its peers).

        ``options`` go to every client; a list value gives one per rank.
        """
        def kwargs(rank: int) -> dict[str, Any]:
            return {k: v[rank] if isinstance(v, list) else v for k, v in options.items()}

        per = self.per_node
        with ThreadPoolExecutor(self.n * per) as pool:
            futures = [pool.submit(dt.connect, f"unix://{self.sockets[r // per]}", 60,
                                   local_rank=r % per, **kwargs(r))
                       for r in range(self.n * per)]
            clients, failed = [], None
            for f in futures:
                try:
                    clients.append(f.result())
                except Exception as exc:  # say why, with what the daemons logged
                    failed = exc
        if failed is not None:
            for c in clients:
                c.close()
            logs = "\n".join(f"--- daemon {i} (exit {p.poll()}):\n{self.log(i)[-2000:]}"
                             for i, p in enumerate(self.procs))
            raise RuntimeError(f"cluster did not come up: {failed}\n{logs}") from failed
        self.clients = list[Client[Any]](clients)
        self._connected.extend(clients)
        return self.clients

    def disconnect(self) -> None:
        """Close this cluster's clients (the daemons run on)."""
        for c in self.clients:
            c.close()
        self.clients = []

    def run(self, fn: Callable[[Client[Any]], Any], timeout: float = 120) -> list[Any]:
        """``fn(client)`` on every rank at once (threads); results in rank order.

        ``$DECENT_TEST_DELAY=RANK:SECONDS`` delays that rank's start: tests that involve
        several ranks must pass with it (they wait on events, not on time).
        """
        with ThreadPoolExecutor(len(self.clients)) as pool:
            futures = [pool.submit(_delayed(fn), c) for c in self.clients]
            return [f.result(timeout=timeout) for f in futures]

    def run_catching(self, fn: Callable[[Client[Any]], Any], timeout: float = 120) -> list[Any]:
        """Like :meth:`run`, but an exception is returned in place of that rank's result."""
        def wrapped(c: Client[Any]) -> Any:
            try:
                return fn(c)
            except Exception as exc:  # returned for the test to inspect
                return exc
        return self.run(wrapped, timeout)

    def status(self, i: int) -> pb.StatusReply:
        """Daemon ``i``'s status, asked over its socket without registering a worker."""
        with grpc.insecure_channel(f"unix://{self.sockets[i]}") as channel:
            reply: pb.StatusReply = pb_grpc.WorkerStub(channel).Status(pb.StatusRequest(),
                                                                       timeout=10)
        return reply

    def log(self, i: int) -> str:
        """Daemon ``i``'s log so far."""
        with open(self.logs[i]) as f:
            return f.read()

    def kill_node(self, i: int) -> None:
        """SIGKILL daemon ``i`` and wait for it; its client (if any) is closed."""
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait()
        if i < len(self.clients):
            self.clients[i].close()

    def kill(self) -> None:
        """SIGKILL whatever is still running (cleanup after a test), then close this cluster's
        clients (at once: their daemons are gone): a client left open keeps its arena mapped in
        this process."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for c in [*self.clients, *self._connected]:
            with contextlib.suppress(Exception):
                c.close()
        self.clients, self._connected = [], []

    def stop(self) -> list[int]:
        """Close clients (those a test dropped from ``clients`` too), SIGTERM every daemon,
        return their exit codes."""
        for c in self.clients:
            c.close()
        for c in self._connected:  # closed already, or their daemon is gone
            with contextlib.suppress(Exception):
                c.close()
        # Cluster.started keeps the cluster: not its clients' arenas
        self.clients, self._connected = [], []
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = []
        deadline = time.monotonic() + 20
        for p in self.procs:
            try:
                codes.append(p.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        return codes


def until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Wait for ``condition`` (polled); fail naming ``what`` when it does not come within
    ``timeout`` s on a quiet host (:func:`hostspeed.scaled`)."""
    deadline = time.monotonic() + scaled(timeout)
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def peer_state(c: Cluster, i: int, peer: int) -> str:
    """Daemon ``i``'s view of daemon ``peer``: up, reconnecting or down."""
    return next(p.state for p in c.status(i).peers if p.rank == peer)


def until_state(c: Cluster, i: int, peer: int, state: str) -> None:
    """Wait until daemon ``i`` holds daemon ``peer`` in ``state``."""
    until(lambda: peer_state(c, i, peer) == state, f"rank {i} to see rank {peer} {state}")


def until_running(c: Cluster, i: int) -> None:
    """Wait until daemon ``i`` runs an op."""
    until(lambda: c.status(i).ops_in_flight > 0, f"rank {i} to run an op")


@contextlib.contextmanager
def tf_cluster(n: int, topology: str = "ring", *daemon_args: str) -> Iterator[list[Any]]:
    """``n`` daemons (``daemon_args`` added to their command line) with one TensorFlow client
    each; closed and stopped afterwards."""
    import decent.tf as dtf

    c = Cluster(n, topology, *daemon_args)
    clients: list[Any] = []
    try:
        with ThreadPoolExecutor(n) as pool:
            clients = list(pool.map(lambda s: dtf.connect(f"unix://{s}", 60), c.sockets))
        yield clients
    finally:
        for cl in clients:
            cl.close()
        c.stop()


def run_each(clients: list[Any], fn: Callable[[Any], Any]) -> list[Any]:
    """``fn(client)`` for every client at once (a thread each), the results in rank order."""
    with ThreadPoolExecutor(len(clients)) as pool:
        return [f.result(timeout=120) for f in [pool.submit(fn, cl) for cl in clients]]


def ring_round(clients: list, name: str, values: dict[int, float]) -> dict[int, tuple]:
    """One neighbor_allreduce of ``name`` on the given clients (rank -> its value, all at once);
    rank -> (result value, src_ranks)."""
    handles = {}
    for c in clients:
        delay(c.rank)
        handles[c.rank] = c.neighbor_allreduce_async(torch.full((8,), values[c.rank]),
                                                     name=name, timeout=30)
    return {r: (h.wait(timeout=60)[0].item(), h.src_ranks) for r, h in handles.items()}


def reweighted(values: dict[int, float], rank: int, src: list[int]) -> float:
    """A ring-of-3 neighbor average with only ``src`` in: a third from each, the rest to self."""
    return (sum(values[j] for j in src) + (3 - len(src)) * values[rank]) / 3


def torch_ranks(c: Cluster, script: str, n: int, env: dict[str, str] | None = None,
                timeout: float = 240) -> list[tuple[int, str]]:
    """``script`` as ranks 0..n-1 of a torch.distributed job on ``c``'s daemons (one worker
    each; torch's store on a free port): each rank's (exit code, output)."""
    port = free_ports(1)[0]
    procs = [subprocess.Popen(
        [sys.executable, script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env=dict(os.environ, **(env or {}), DECENT_DAEMON=f"unix://{c.sockets[r]}",
                 RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port)), text=True) for r in range(n)]
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    return [(int(p.returncode), out) for p, out in zip(procs, outs, strict=True)]
