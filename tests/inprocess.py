"""Real daemons inside the test process: no subprocesses, no namespaces, no mocks.

:class:`InProcessCluster` builds ``n`` real :class:`decentd.service.server.Daemon` objects from
:class:`~decentd.service.config.NodeConfig` and serves each on an event loop (uvloop, as
``decentd`` does) in a thread of its own: peers over loopback TCP, workers over Unix sockets in
a temporary directory. Tests talk to them through real clients (:class:`decent.core.Client` with
:class:`~decent.core.NumpyCodec`) over real gRPC, data channels and shared memory.

Three things ``decentd`` does for its whole process are left out here: signal handlers (a loop
in a thread cannot install them; the loop below records them instead, and
:meth:`InProcessCluster.stop` does what SIGTERM would: set ``Daemon.stopping``), the SIGBUS
handler (only registered memory needs it, and numpy arrays are never registered) and the
``gc.freeze()`` of a daemon that is ready (undone here: in a test process it would keep the
cyclic garbage of every later test).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import grpc
import numpy as np

from decent.core import Client, NumpyCodec
from decent_wire.v1 import decent_pb2 as pb
from decent_wire.v1 import decent_pb2_grpc as pb_grpc
from decentd.service.config import NodeConfig, load_config
from decentd.service.server import Daemon
from decentd.tools.launcher import free_ports

__all__ = ["InProcessCluster", "NumpyClient", "kernel_buffered_bytes", "run_ranks", "wait_for"]

NumpyClient = Client[np.ndarray]

try:
    import uvloop

    _BaseLoop: type[asyncio.AbstractEventLoop] = uvloop.Loop
except ImportError:  # pragma: no cover - uvloop is a dependency of decentd
    _BaseLoop = asyncio.SelectorEventLoop


class _ThreadLoop(_BaseLoop):  # type: ignore[misc,valid-type]
    """An event loop for a thread that is not the main one: it keeps the signal handlers a
    daemon asks for (only the main thread may install them) instead of installing them."""

    def __init__(self) -> None:
        super().__init__()
        self.signal_handlers: dict[int, Callable[..., object]] = {}

    def add_signal_handler(self, sig: int, callback: Callable[..., object],
                           *args: Any) -> None:
        self.signal_handlers[sig] = callback

    def remove_signal_handler(self, sig: int) -> bool:
        return self.signal_handlers.pop(sig, None) is not None


class _Node:
    """One daemon served on its own loop in its own thread."""

    def __init__(self, cfg: NodeConfig) -> None:
        self.cfg = cfg
        self.loop = _ThreadLoop()
        self.daemon: Daemon | None = None
        self.error: BaseException | None = None
        self.built = threading.Event()
        self.thread = threading.Thread(target=self._serve, name=f"decentd-{cfg.rank}",
                                       daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def main() -> None:
            try:
                self.daemon = Daemon(self.cfg)
            finally:
                self.built.set()
            await self.daemon.run()

        try:
            self.loop.run_until_complete(main())
        except BaseException as exc:  # reported by stop() and wait_ready()
            self.error = exc
        finally:
            self.built.set()
            try:
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            finally:
                self.loop.close()

    def wait_ready(self, timeout: float) -> None:
        """Until the daemon has all its peers (AssertionError naming why not)."""
        if not self.built.wait(timeout) or self.daemon is None:
            raise AssertionError(f"daemon {self.cfg.rank} was not built: {self.error!r}")
        deadline = time.monotonic() + timeout
        while not self.daemon.ready.is_set():
            if self.error is not None or not self.thread.is_alive():
                raise AssertionError(f"daemon {self.cfg.rank} stopped: {self.error!r}")
            if time.monotonic() > deadline:
                raise AssertionError(f"daemon {self.cfg.rank} not ready after {timeout}s")
            time.sleep(0.005)

    def signal_stop(self) -> None:
        """What SIGTERM does: the daemon stops serving and shuts down."""
        if self.daemon is not None and self.thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self.loop.call_soon_threadsafe(self.daemon.stopping.set)

    def stop(self, timeout: float) -> None:
        """Stop the daemon (:meth:`signal_stop`) and wait for it; AssertionError if it failed
        or did not stop within ``timeout``."""
        self.signal_stop()
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise AssertionError(f"daemon {self.cfg.rank} did not stop within {timeout}s")
        if self.error is not None:
            raise AssertionError(f"daemon {self.cfg.rank} failed: {self.error!r}") from self.error


class InProcessCluster:
    """``n`` daemons in this process (``per_node`` workers each), on ``topology``; ``settings``
    are dotted config keys (``{"memory.arena_bytes": 64 << 20}``). Use as a context manager, or
    call :meth:`stop`."""

    #: every cluster started in this session (a session fixture stops what a test left)
    started: ClassVar[list[InProcessCluster]] = []

    def __init__(self, n: int, topology: str = "ring", per_node: int = 1,
                 settings: dict[str, Any] | None = None, ready_timeout: float = 30.0) -> None:
        self.n, self.per_node = n, per_node
        self.dir = tempfile.mkdtemp(prefix="decent-inproc-")
        self.peers = [f"127.0.0.1:{p}" for p in free_ports(n)]
        self.sockets = [os.path.join(self.dir, f"rank{i}.sock") for i in range(n)]
        self.nodes: list[_Node] = []
        self.clients: list[NumpyClient] = []
        InProcessCluster.started.append(self)
        try:
            for i in range(n):
                overrides = {"rank": i, "peers": self.peers, "socket": self.sockets[i],
                             "topology.kind": topology, "workers_per_node": per_node,
                             "timeouts.start": ready_timeout, "log_level": "warning",
                             **(settings or {})}
                self.nodes.append(_Node(load_config(None, overrides)))
            for node in self.nodes:
                node.wait_ready(ready_timeout)
        except BaseException:
            self.stop(check=False)
            raise
        finally:
            # a daemon freezes the objects alive at its start (gc.freeze: its own stay for
            # good); in a test process that would keep every test's cyclic garbage after it
            gc.unfreeze()

    def __enter__(self) -> InProcessCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(check=exc[0] is None)

    @property
    def daemons(self) -> list[Daemon]:
        """The running daemons, by rank."""
        return [node.daemon for node in self.nodes if node.daemon is not None]

    def connect(self, job: str, **options: Any) -> list[NumpyClient]:
        """One numpy client per worker rank, all in job ``job`` (connected side by side:
        registration waits for every daemon's peers). ``options`` go to every client; a list
        value gives one per worker."""
        self.disconnect()
        per = self.per_node

        def one(r: int) -> NumpyClient:
            kwargs = {k: v[r] if isinstance(v, list) else v for k, v in options.items()}
            return Client(NumpyCodec(), f"unix://{self.sockets[r // per]}", 30, job=job,
                          local_rank=r % per, **kwargs)

        with ThreadPoolExecutor(self.n * per) as pool:
            futures = [pool.submit(one, r) for r in range(self.n * per)]
            clients, failed = [], None
            for f in futures:
                try:
                    clients.append(f.result())
                except Exception as exc:  # closed below, then raised
                    failed = exc
        if failed is not None:
            for c in clients:
                c.close()
            raise failed
        self.clients = clients
        return clients

    def disconnect(self) -> None:
        """Close the clients (the daemons run on)."""
        for c in self.clients:
            c.close()
        self.clients = []

    def status(self, i: int) -> pb.StatusReply:
        """Daemon ``i``'s status over its worker socket, as ``decentctl status`` asks it."""
        with grpc.insecure_channel(f"unix://{self.sockets[i]}") as channel:
            reply: pb.StatusReply = pb_grpc.WorkerStub(channel).Status(pb.StatusRequest(),
                                                                       timeout=10)
        return reply

    def stop(self, check: bool = True, timeout: float = 30.0) -> None:
        """Close the clients and stop every daemon; with ``check``, AssertionError unless each
        shut down cleanly. Idempotent."""
        self.disconnect()
        for node in self.nodes:  # all at once, as SIGTERM to every daemon would
            node.signal_stop()
        errors = []
        for node in self.nodes:
            try:
                node.stop(timeout)
            except AssertionError as exc:
                errors.append(str(exc))
        self.nodes = []
        if errors and check:
            raise AssertionError("; ".join(errors))
        shutil.rmtree(self.dir, ignore_errors=True)


def job_of(nodeid: str) -> str:
    """A job id of a test's own (ops of different jobs never meet)."""
    return "inproc-" + hashlib.sha1(nodeid.encode()).hexdigest()[:12]


def run_ranks(clients: list[NumpyClient], fn: Callable[[NumpyClient], Any],
              timeout: float = 60.0) -> list[Any]:
    """``fn(client)`` on every rank at once (a thread each); results in rank order.

    ``$DECENT_TEST_DELAY=RANK:SECONDS`` starts that rank late: a test with several ranks must
    pass with it (it waits on events, not on time).
    """
    spec = os.environ.get("DECENT_TEST_DELAY", "")
    late_rank, late_s = (int(float(spec.split(":")[0])), float(spec.split(":")[1])) if spec \
        else (-1, 0.0)

    def start(c: NumpyClient) -> Any:
        if c.rank == late_rank:
            time.sleep(late_s)
        return fn(c)

    with ThreadPoolExecutor(len(clients)) as pool:
        futures = [pool.submit(start, c) for c in clients]
        return [f.result(timeout=timeout) for f in futures]


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll ``condition`` until it holds; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.002)


def kernel_buffered_bytes() -> int:
    """The most bytes the kernel can hold in flight on one loopback TCP connection (the
    largest receive plus send buffer autotuning may reach): a payload larger than this plus a
    margin cannot arrive in one read, so its receiver sees it arrive in pieces."""
    total = 0
    for name in ("tcp_rmem", "tcp_wmem"):
        try:
            with open(f"/proc/sys/net/ipv4/{name}") as f:
                total += int(f.read().split()[2])
        except (OSError, ValueError, IndexError):
            total += 32 << 20
    return total


