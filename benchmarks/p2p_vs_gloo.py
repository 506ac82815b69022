"""decent against torch.distributed gloo, raw TCP and hivemind, in one run between 2 daemons.

Run under the local launcher with one node per rank (it starts one daemon per rank and sets
``DECENT_DAEMON``, ``DECENT_RANK``, ``DECENT_SIZE``)::

    decentrun -np 2 --nodes 2 -- python benchmarks/p2p_vs_gloo.py [--sizes 4K,64K,1M,16M,64M]
        [--quick] [--no-hivemind] [--out benchmarks/results]

Both workers connect to their daemon, join a gloo process group on loopback and open one raw TCP
connection to each other. Inputs are ``(arange(n) % 1024) + rank + 1`` (float32), so every
average and sum is exact and every decent result is compared with ``torch.equal`` against the
closed form of 2 ranks on a ring (``neighbor_allreduce`` = ``allreduce`` average =
``(x0 + x1) / 2``). Per tensor size, in the same two processes:

* ``gloo``: ``dist.all_reduce(t)`` (SUM, in place; ``t`` is refilled before each call, untimed);
* ``nar_``: ``client.neighbor_allreduce_(t, name=...)`` (in place, like gloo; a private tensor,
  copied into the arena and the result back out on every call);
* ``nar``: ``client.neighbor_allreduce(x, name=...)`` (returns a new tensor);
* ``ar_``: ``client.allreduce_(t, name=...)`` (average, in place);
* ``tcp_exchange``: raw TCP, both ranks send ``size`` bytes and receive ``size`` bytes at once
  (blocking sockets, ``sendall`` in a helper thread above 64 KiB, ``recv_into`` a preallocated
  buffer): the physical floor of a 2-peer neighbor_allreduce;
* ``tcp_oneway``: raw TCP, rank 0 sends ``size`` bytes, rank 1 receives them into a preallocated
  buffer and answers 1 byte;
* ``oneway``: decent bulk transfer, rank 0 ``neighbor_allreduce_(t, self_weight=1.0,
  src_weights={}, dst_weights=[1])``, rank 1 ``neighbor_allreduce_(t, self_weight=0.0,
  src_weights={0: 1.0}, dst_weights=[])`` (rank 1 receives rank 0's tensor);
* ``nar_reg`` / ``oneway_reg`` (when the client registers memory): ``nar_`` / ``oneway`` on
  tensors in torch's shared memory (``t.share_memory_()``): the client hands them to the daemon
  at the first call (a warm-up call) and nothing is copied after that.

Then the 62 tensors of ResNet-18 (11.69M float32 values; shapes from
``benchmarks/hivemind_avg.py``), one step each: ``gloo_list`` (``all_reduce(t, async_op=True)``
per tensor, then wait all), ``gloo_flat`` (``torch.cat`` into one preallocated buffer, one
all_reduce, copy back; all included), ``nar_list`` (``neighbor_allreduce_async_`` per tensor, then
``wait()`` all: the client fuses them), ``ar_list`` (the same with ``allreduce_async_``) and
``nar_list_reg`` (``nar_list`` on ``share_memory_()`` tensors).

Last, rank 0 runs ``benchmarks/hivemind_avg.py`` (hivemind's ``DecentralizedAverager``, 2 peers)
in a subprocess on the same sizes and ResNet-18 while rank 1 waits at a gloo barrier; when
hivemind is not installed its JSON says ``skipped`` and so does the report.

Timing: per op, ``--warmup`` untimed calls (the first result is checked), then ``R`` timed calls,
interleaved round-robin over all ops by default (``--blocks``: one block per op), so that load
from other processes hits every series alike; the last result is checked again. Each rank
computes median / p10 / p90 / mean / min of its own per-call times; the reported statistic is the
maximum over the ranks. ``R`` = ``min(200, max(10, 2**28 // size))``, capped so that one op takes
about ``--budget`` seconds (judged from the slower rank's last warm-up call), or ``--repeats``.
A decent op that raises is reported with its error text and dropped from the rest of that size.

A background thread in each worker samples its daemon's VmRSS / RssAnon / RssShmem every 50 ms
(start, peak per phase, end). Rank 0 writes ``p2p_vs_gloo.json`` (every number, environment,
load average), ``p2p_vs_gloo.md`` (tables and the acceptance table, rendered by
``benchmarks/report.py``) and the plots ``p2p_vs_gloo.png`` (time, throughput and ratio to gloo
vs size) and ``p2p_vs_gloo_resnet18.png`` into ``--out``. Exit code 1 when a decent op failed or
a result was not exact.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import inspect
import json
import math
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import decent.torch as dt

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/p2p_vs_gloo.py` puts only benchmarks/ on it
    sys.path.insert(0, str(REPO))

from benchmarks import report  # noqa: E402
from benchmarks.hivemind_avg import resnet18_shapes  # noqa: E402
from benchmarks.hostprobe import memmove_ms  # noqa: E402
from benchmarks.netns_dsgd import proc_cpu_seconds  # noqa: E402
from decentd.service.config import MemoryConfig  # noqa: E402

OPS = tuple(report.OPS)
RN_OPS = tuple(report.RN_OPS)
STATS = ("median", "p10", "p90", "mean", "min")
DEFAULT_SIZES = tuple(4 << (2 * k) << 10 for k in range(8))  # 4 KiB, 16 KiB, ..., 64 MiB
QUICK_SIZES = (4 << 10, 64 << 10, 1 << 20)
EXCHANGE_THREAD_MIN = 64 << 10  # below this both ranks can sendall first without deadlock
RSS_INTERVAL = 0.05


# ---------------------------------------------------------------------------------- helpers


def parse_size(text: str) -> int:
    """``4K``, ``16KiB``, ``1M``, ``65536`` -> bytes (binary units)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    number = t[:-1] if t[-1:] in "KMG" else t
    return int(float(number) * mult)


def default_repeats(nbytes: int) -> int:
    """More repeats for small tensors: ``min(200, max(10, 2**28 // nbytes))``."""
    return int(min(200, max(10, (1 << 28) // max(1, nbytes))))


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """median / p10 / p90 / mean / min of per-call times (seconds)."""
    a = np.asarray(samples, dtype=np.float64)
    return {"median": float(np.median(a)), "p10": float(np.percentile(a, 10)),
            "p90": float(np.percentile(a, 90)), "mean": float(a.mean()), "min": float(a.min())}


def pattern(numel: int, offset: int = 0) -> torch.Tensor:
    """``((arange(numel) + offset) % 1024)`` as float32: small integers, so sums are exact."""
    return ((torch.arange(numel, dtype=torch.int64) + offset) % 1024).to(torch.float32)


def max_abs_err(got: Any, want: torch.Tensor | Sequence[torch.Tensor] | None) -> float:
    """0.0 when ``got`` equals ``want`` exactly (tensor or list), else the largest difference.

    ``want`` None: nothing to check (0.0).
    """
    if want is None:
        return 0.0
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.shape != want.shape \
                or got.dtype != want.dtype:
            return math.inf
        if torch.equal(got, want):
            return 0.0
        return float((got.double() - want.double()).abs().max())
    if not isinstance(got, (list, tuple)) or len(got) != len(want):
        return math.inf
    return max((max_abs_err(g, w) for g, w in zip(got, want, strict=True)), default=0.0)


def mismatch_detail(got: Any, want: torch.Tensor | Sequence[torch.Tensor] | None) -> str:
    """Where ``got`` differs from ``want``: count, first/last index, values (for the report)."""
    if want is None:
        return ""
    if not isinstance(want, torch.Tensor):
        got_list = list(got) if isinstance(got, (list, tuple)) else []
        for i, (g, w) in enumerate(zip(got_list, want, strict=False)):
            if max_abs_err(g, w):
                return f"tensor {i} of {len(want)}: {mismatch_detail(g, w)}"
        return f"got {type(got).__name__} of length {len(got_list)}, want {len(want)} tensors"
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        what = (f"{got.dtype}{list(got.shape)}" if isinstance(got, torch.Tensor)
                else type(got).__name__)
        return f"got {what}, want {want.dtype}{list(want.shape)}"
    bad = (got != want).nonzero().flatten()
    i, j = int(bad[0]), int(bad[-1])
    return (f"{bad.numel()} of {want.numel()} values differ (indices {i}..{j}); "
            f"[{i}] = {float(got[i])!r}, want {float(want[i])!r}; "
            f"[{j}] = {float(got[j])!r}, want {float(want[j])!r}")


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a copy."""
    array: Any = t.numpy()
    return memoryview(array).cast("B")


def recv_exact(sock: socket.socket, buf: memoryview) -> None:
    """Fill ``buf`` from ``sock`` (blocking)."""
    pos, n = 0, len(buf)
    while pos < n:
        got = sock.recv_into(buf[pos:], n - pos)
        if not got:
            raise ConnectionError("raw TCP peer closed the connection")
        pos += got


def describe(exc: BaseException) -> str:
    """``Type: message`` (DecentError's code name included)."""
    code = getattr(exc, "code_name", None)
    return f"{type(exc).__name__}{f' [{code}]' if code else ''}: {exc}"


# ---------------------------------------------------------------------------------- environment


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def git_revision() -> str:
    """``<short sha>`` of the checkout, ``+dirty`` when tracked files have local changes."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, check=True,
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO, capture_output=True, text=True, timeout=10).stdout
        return sha + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def uptime_text() -> str:
    """Output of ``uptime`` (load averages), or the load averages alone."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True,
                              timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{v:.2f}" for v in os.getloadavg())


def versions() -> dict[str, str]:
    """Versions of python and the packages that matter (hivemind without importing it)."""
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "numpy": np.__version__}
    for dist_name in ("grpcio", "protobuf", "hivemind", "decent"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[dist_name] = importlib.metadata.version(dist_name)
    return out


def launch_command(size: int) -> str:
    """The decentrun command line that started us (read from the parent), else a reconstruction."""
    with contextlib.suppress(OSError):
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
        argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
        for i, arg in enumerate(argv):
            if os.path.basename(arg) == "decentrun":
                return shlex.join(["decentrun", *argv[i + 1:]])
    return shlex.join(["decentrun", "-np", str(size), "--nodes", str(size), "--", "python",
                       *sys.argv])


def proc_memory(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM (peak RSS), RssAnon and RssShmem of ``pid`` in bytes (empty if unreadable)."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


def find_daemon_pid() -> int | None:
    """The pid of our daemon: a ``decentd`` process whose ``--socket`` is $DECENT_DAEMON.

    The status reply carries no pid; decentrun starts each daemon as ``python -m decentd
    ... --socket PATH``, so the process is found by its command line.
    """
    sock = os.environ.get("DECENT_DAEMON", "").removeprefix("unix://")
    if not sock:
        return None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any("decentd" in a for a in argv[:3]) and sock in argv:
            return int(entry.name)
    return None


#: ``--placement``: where this rank and its daemon run (None: the scheduler's choice); each
#: value maps (rank, CPU count) to (this rank's CPU, its daemon's CPU)
PLACEMENTS: dict[str, Callable[[int, int], tuple[int, int]] | None] = {
    "none": None,
    "node": lambda rank, ncpu: (rank % ncpu, rank % ncpu),  # a node per CPU, as machines
    "split": lambda rank, ncpu: (0, 1 % ncpu),  # the ranks together, the daemons together
}


def pin_process(pid: int, cpus: set[int]) -> set[int]:
    """Run every thread of ``pid`` on ``cpus`` (threads made later inherit it); the CPUs it
    could use before."""
    before = os.sched_getaffinity(pid)
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(task.name), cpus)
    return before


def place(placement: str, rank: int, daemon_pid: int | None) -> dict[str, Any]:
    """Pin this rank and its daemon as ``placement`` says: what was pinned where, and how to
    undo it for the daemon (which may outlive this run)."""
    where = PLACEMENTS[placement]
    if where is None:
        return {}
    mine, its = where(rank, os.cpu_count() or 1)
    pinned: dict[str, Any] = {"rank": mine, "before": pin_process(os.getpid(), {mine})}
    if daemon_pid is not None:
        pinned |= {"daemon": its, "daemon_pid": daemon_pid,
                   "daemon_before": pin_process(daemon_pid, {its})}
    return pinned


def unplace(pinned: dict[str, Any]) -> None:
    """Give the daemon back the CPUs it had before :func:`place` (this rank ends anyway)."""
    if "daemon_pid" in pinned:
        with contextlib.suppress(OSError):
            pin_process(pinned["daemon_pid"], pinned["daemon_before"])


#: sizes whose timed calls also count their CPU (two /proc reads per call: nothing next to a
#: millisecond call of a MiB or more, too much next to a 4 KiB one)
CPU_COUNTED_FROM = 1 << 20


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds used so far by ``pids`` (all their threads)."""
    return sum(proc_cpu_seconds(pid) for pid in pids)


class RssSampler(threading.Thread):
    """Samples a process's memory every 50 ms: start, end, and the peak per phase."""

    def __init__(self, pid: int | None) -> None:
        super().__init__(daemon=True, name="rss-sampler")
        self.pid = pid
        self.phase = "start"
        self.start_mem = proc_memory(pid) if pid else {}
        self.peak: dict[str, int] = dict(self.start_mem)
        self.phase_peak: dict[str, int] = {}
        self.samples = 0
        self._halt = threading.Event()

    def run(self) -> None:
        """Sample until :meth:`stop`."""
        while self.pid and not self._halt.wait(RSS_INTERVAL):
            mem = proc_memory(self.pid)
            if not mem:
                break
            self.samples += 1
            for k, v in mem.items():
                self.peak[k] = max(self.peak.get(k, 0), v)
            rss = mem.get("VmRSS", 0)
            self.phase_peak[self.phase] = max(self.phase_peak.get(self.phase, 0), rss)

    def stop(self) -> dict[str, Any]:
        """Stop sampling; the summary (start / peak / end, per-phase peak RSS)."""
        self._halt.set()
        if self.is_alive():
            self.join(2)
        end = proc_memory(self.pid) if self.pid else {}
        return {"pid": self.pid, "start": self.start_mem, "peak": self.peak, "end": end,
                "phase_peak_rss": self.phase_peak, "samples": self.samples,
                "interval_s": RSS_INTERVAL}


def wait_for_pool_floor(bench: Bench, limit: float = 30.0) -> float:
    """Wait until the daemon has freed its idle receive buffers down to the default
    ``memory.pool_floor_bytes`` after the run's bursts (at most ``limit`` s): the "end" memory
    is then what an idle daemon keeps. The seconds waited."""
    floor = MemoryConfig().pool_floor_bytes
    t0 = time.monotonic()
    while (time.monotonic() - t0 < limit
           and bench.daemon_status().get("pool_bytes", 0) > floor):
        time.sleep(0.25)
    return time.monotonic() - t0


# ---------------------------------------------------------------------------------- raw TCP


class RawLink:
    """One TCP connection between the two workers, for the raw-socket baselines."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._job: memoryview | None = None
        self._go = threading.Semaphore(0)
        self._done = threading.Semaphore(0)
        self._error: OSError | None = None
        self._ack = bytearray(1)
        self._closing = False
        self._sender = threading.Thread(target=self._send_loop, daemon=True, name="raw-sender")
        self._sender.start()

    def _send_loop(self) -> None:
        while True:
            self._go.acquire()
            if self._closing:
                return
            try:
                assert self._job is not None
                self.sock.sendall(self._job)
            except OSError as exc:
                self._error = exc
            self._done.release()

    def send_oneway(self, data: memoryview) -> None:
        """Send ``data``, return when the receiver's 1-byte answer arrived."""
        self.sock.sendall(data)
        recv_exact(self.sock, memoryview(self._ack))

    def recv_oneway(self, buf: memoryview) -> None:
        """Receive exactly ``len(buf)`` bytes into ``buf``, then answer 1 byte."""
        recv_exact(self.sock, buf)
        self.sock.sendall(b"k")

    def exchange(self, send: memoryview, recv: memoryview) -> None:
        """Send ``send`` and receive ``len(recv)`` bytes at the same time."""
        if len(send) <= EXCHANGE_THREAD_MIN:  # fits the socket buffers: no deadlock possible
            self.sock.sendall(send)
            recv_exact(self.sock, recv)
            return
        self._job = send
        self._go.release()
        recv_exact(self.sock, recv)
        self._done.acquire()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Stop the sender thread and close the socket."""
        self._closing = True
        self._go.release()
        self._sender.join(2)
        self.sock.close()


# ---------------------------------------------------------------------------------- measurement


@dataclass
class Op:
    """One timed series: ``call`` returns what must equal ``want`` (None: nothing to check)."""

    name: str
    call: Callable[[], Any]
    want: torch.Tensor | list[torch.Tensor] | None
    before: Callable[[], object] | None = None


class Bench:
    """One worker's side: a decent client, a gloo process group and a raw TCP link."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.client = dt.init()
        self.rank, self.size = self.client.rank, self.client.size
        env_rank = os.environ.get("DECENT_RANK")
        if env_rank is not None and int(env_rank) != self.rank:
            raise RuntimeError(f"$DECENT_RANK={env_rank} but the daemon says rank {self.rank}")
        if self.size != 2:
            raise SystemExit(f"this benchmark needs exactly 2 ranks (decentrun -np 2 --nodes 2), "
                             f"got {self.size}")
        info = self.client.topology_at()
        if sorted(info.in_neighbors) != [1 - self.rank] or \
                abs(float(info.self_weight) - 0.5) > 1e-12:
            raise SystemExit("the closed-form checks assume a 2-rank ring with weights 1/2; "
                             f"got in-neighbors {list(info.in_neighbors)}, self weight "
                             f"{info.self_weight}")
        self.port = self._agree_port()
        dist.init_process_group("gloo", rank=self.rank, world_size=self.size,
                                init_method=f"tcp://127.0.0.1:{self.port}",
                                timeout=datetime.timedelta(seconds=args.gloo_timeout))
        self.link = self._connect_raw()
        #: this client version registers shared-memory tensors with the daemon
        self.has_reg = "register" in inspect.signature(dt.connect).parameters
        #: whose CPU a timed call of a large size counts: this worker and its daemon
        self.cpu_pids = [os.getpid(), *([pid] if (pid := self.client.status().pid) else [])]

    def _agree_port(self) -> int:
        """Rank 0 picks a free loopback port (or $BENCH_GLOO_PORT) and broadcasts it via decent."""
        port = 0
        if self.rank == 0:
            port = int(os.environ.get("BENCH_GLOO_PORT", "0"))
            if not port:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
        got = self.client.broadcast(torch.tensor([port], dtype=torch.int64), root=0,
                                    name="bench.port")
        return int(got[0])

    def _connect_raw(self) -> RawLink:
        """Rank 0 listens on a free loopback port, tells rank 1 via gloo, rank 1 connects."""
        port = torch.zeros(1, dtype=torch.int64)
        if self.rank == 0:
            srv = socket.socket()
            srv.bind(("127.0.0.1", 0))
            srv.listen(1)
            port[0] = srv.getsockname()[1]
            dist.broadcast(port, src=0)
            srv.settimeout(60)
            conn, _ = srv.accept()
            conn.settimeout(None)
            srv.close()
            return RawLink(conn)
        dist.broadcast(port, src=0)
        return RawLink(socket.create_connection(("127.0.0.1", int(port[0])), timeout=60))

    # -------------------------------------------------------------- control (gloo, untimed)

    def max_over_ranks(self, values: Sequence[float]) -> list[float]:
        """Elementwise max over ranks."""
        t = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [float(v) for v in t.tolist()]

    def sum_over_ranks(self, values: Sequence[float]) -> list[float]:
        """Elementwise sum over ranks (NaN where any rank has none)."""
        t = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return [float(v) for v in t.tolist()]

    def sync(self) -> None:
        """Line both ranks up: gloo barrier, then decent barrier."""
        dist.barrier()
        self.client.barrier(name="bench.sync")

    # -------------------------------------------------------------- generic timing

    def run_ops(self, ops: list[Op], cap: int, budget: float,
                tick: Callable[[str], None], count_cpu: bool = False) -> dict[str, Any]:
        """Warm up and check every op, agree on repeats, time them, check again, aggregate.
        ``count_cpu``: also the CPU each timed call took, this worker's and its daemon's (read
        from /proc outside the timed span), summed over the ranks."""
        args = self.args
        cpu: dict[str, list[float]] = {op.name: [] for op in ops}
        failures: dict[str, str] = {}
        errors: dict[str, float] = {}
        mismatches: dict[str, str] = {}
        warm: dict[str, float] = {}
        last: dict[str, Any] = {}

        def check(op: Op, got: Any, when: str) -> None:
            err = max_abs_err(got, op.want)
            errors[op.name] = max(errors.get(op.name, 0.0), err)
            if err and op.name not in mismatches:
                mismatches[op.name] = f"{when}: {mismatch_detail(got, op.want)}"
        for op in ops:
            tick(op.name)
            self.sync()
            try:
                for i in range(args.warmup):
                    if op.before is not None:
                        op.before()
                    t0 = time.perf_counter()
                    got = op.call()
                    warm[op.name] = time.perf_counter() - t0
                    if i == 0:
                        check(op, got, "first warm-up call")
                    last[op.name] = got
            except Exception as exc:
                failures[op.name] = describe(exc)
        # both ranks drop an op that failed on either; both agree on the repeats
        flags = self.max_over_ranks([1.0 if op.name in failures else 0.0 for op in ops]
                                    + [warm.get(op.name, 0.0) for op in ops])
        live = [op for i, op in enumerate(ops) if flags[i] == 0.0]
        repeats: dict[str, int] = {}
        for i, op in enumerate(ops):
            if flags[i] == 0.0:
                slow = max(flags[len(ops) + i], 1e-6)
                repeats[op.name] = args.repeats or min(
                    cap, max(args.min_repeats, int(budget / slow)))
        samples: dict[str, list[float]] = {op.name: [] for op in live}

        def timed(op: Op) -> bool:
            if op.before is not None:
                op.before()
            c0 = cpu_seconds(self.cpu_pids) if count_cpu else 0.0
            t0 = time.perf_counter()
            try:
                got = op.call()
            except Exception as exc:
                failures[op.name] = describe(exc)
                return False
            samples[op.name].append(time.perf_counter() - t0)
            if count_cpu:
                cpu[op.name].append(cpu_seconds(self.cpu_pids) - c0)
            last[op.name] = got
            return True

        if args.blocks:
            for op in live:
                self.sync()
                for _ in range(repeats[op.name]):
                    if not timed(op):
                        break
        elif live:
            r = min(repeats.values())
            repeats = dict.fromkeys(repeats, r)
            running = list(live)
            self.sync()
            for _ in range(r):
                running = [op for op in running if timed(op)]
        for op in live:  # the last result must still be exact
            if op.name not in failures and op.name in last:
                check(op, last[op.name], f"last of {repeats[op.name]} timed calls")
        last.clear()
        # aggregate: max over ranks; a missing value (failed op) is inf
        local: list[float] = []
        for op in ops:
            ok_local = op.name not in failures and samples.get(op.name)
            s = summarize(samples[op.name]) if ok_local else None
            local += [s[k] if s else math.inf for k in STATS]
        agg = self.max_over_ranks(local)
        err = self.max_over_ranks([errors.get(op.name, math.inf) for op in ops])
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, (failures, mismatches))
        merged: dict[str, str] = {}
        wrong: dict[str, str] = {}
        for rank, (fails, mism) in enumerate(gathered):
            for name, text in fails.items():
                merged[name] = merged.get(name, "") + f"rank {rank}: {text}\n"
            for name, text in mism.items():
                wrong[name] = wrong.get(name, "") + f"rank {rank}: {text}\n"
        stats: dict[str, dict[str, float]] = {}
        for i, op in enumerate(ops):
            vals = agg[i * len(STATS):(i + 1) * len(STATS)]
            if all(math.isfinite(v) for v in vals) and op.name not in merged:
                stats[op.name] = dict(zip(STATS, vals, strict=True))
        mean_cpu = self.sum_over_ranks([statistics.fmean(cpu[op.name]) if cpu[op.name]
                                        else math.nan for op in ops]) if count_cpu else []
        return {
            "repeats": repeats,
            "stats": stats,
            "cpu_s_per_call": {op.name: v for op, v in zip(ops, mean_cpu, strict=False)
                               if math.isfinite(v)},
            "errors": {op.name: (e if math.isfinite(e) else None)
                       for op, e in zip(ops, err, strict=True)},
            "ok": {op.name: op.name not in merged and err[i] == 0.0
                   for i, op in enumerate(ops)},
            "failures": merged,
            "mismatches": wrong,
        }

    # -------------------------------------------------------------- one size

    def size_ops(self, nbytes: int) -> list[Op]:
        """The per-size series (see the module docs); inputs are exact small integers."""
        c, rank = self.client, self.rank
        numel = nbytes // 4
        a = pattern(numel)
        x = a + float(rank + 1)
        want_sum, want_avg = 2 * a + 3.0, a + 1.5
        want_x0, want_other = a + 1.0, a + float(2 - rank)
        del a
        gbuf, nar_t, ar_t, one_t = x.clone(), x.clone(), x.clone(), x.clone()
        reg_t = x.clone().share_memory_() if self.has_reg else None
        reg_one = x.clone().share_memory_() if self.has_reg else None
        rbuf = torch.empty_like(x)
        x_bytes, r_bytes = byte_view(x), byte_view(rbuf)
        names = {op: f"{op}.{nbytes}" for op in OPS}
        if rank == 0:
            one_kw: dict[str, Any] = dict(self_weight=1.0, src_weights={}, dst_weights=[1])
        else:
            one_kw = dict(self_weight=0.0, src_weights={0: 1.0}, dst_weights=[])

        def gloo() -> torch.Tensor:
            dist.all_reduce(gbuf)
            return gbuf

        def nar_() -> torch.Tensor:
            return c.neighbor_allreduce_(nar_t, name=names["nar_"])

        def nar() -> torch.Tensor:
            return c.neighbor_allreduce(x, name=names["nar"])


        def ar_() -> torch.Tensor:
            return c.allreduce_(ar_t, name=names["ar_"])

        def nar_reg() -> torch.Tensor:
            assert reg_t is not None
            return c.neighbor_allreduce_(reg_t, name=names["nar_reg"])

        def tcp_exchange() -> torch.Tensor:
            self.link.exchange(x_bytes, r_bytes)
            return rbuf

        def tcp_oneway() -> torch.Tensor | None:
            if rank == 0:
                self.link.send_oneway(x_bytes)
                return None
            self.link.recv_oneway(r_bytes)
            return rbuf

        def oneway() -> torch.Tensor:
            return c.neighbor_allreduce_(one_t, name=names["oneway"], **one_kw)

        def oneway_reg() -> torch.Tensor:
            assert reg_one is not None
            return c.neighbor_allreduce_(reg_one, name=names["oneway_reg"], **one_kw)

        return [
            Op("gloo", gloo, want_sum, lambda: gbuf.copy_(x)),
            Op("nar_", nar_, want_avg),
            Op("nar", nar, want_avg),
            Op("ar_", ar_, want_avg),
            Op("tcp_exchange", tcp_exchange, want_other),
            Op("tcp_oneway", tcp_oneway, None if rank == 0 else want_x0),
            Op("oneway", oneway, want_x0),
        ] + ([Op("nar_reg", nar_reg, want_avg), Op("oneway_reg", oneway_reg, want_x0)]
             if reg_t is not None else [])

    def run_size(self, nbytes: int, tick: Callable[[str], None]) -> dict[str, Any]:
        """Every per-size series for one tensor size."""
        res = self.run_ops(self.size_ops(nbytes), default_repeats(nbytes), self.args.budget, tick,
                           count_cpu=nbytes >= CPU_COUNTED_FROM)
        return {"nbytes": nbytes, **res}

    # -------------------------------------------------------------- ResNet-18

    def resnet_ops(self) -> tuple[list[Op], dict[str, int]]:
        """The ResNet-18 list variants; each step averages all 62 tensors once."""
        c, rank = self.client, self.rank
        shapes = resnet18_shapes()
        base = [pattern(math.prod(s), i).view(s) for i, s in enumerate(shapes)]
        xs = [b + float(rank + 1) for b in base]
        want_sum = [2 * b + 3.0 for b in base]
        want_avg = [b + 1.5 for b in base]
        del base
        gl = [x.clone() for x in xs]
        gf = [x.clone() for x in xs]
        nl = [x.clone() for x in xs]
        al = [x.clone() for x in xs]
        rl = [x.clone().share_memory_() for x in xs] if self.has_reg else []
        numel = sum(x.numel() for x in xs)
        flat = torch.empty(numel, dtype=torch.float32)

        def refill(ts: list[torch.Tensor]) -> Callable[[], None]:
            def go() -> None:
                for t, x in zip(ts, xs, strict=True):
                    t.copy_(x)
            return go

        def gloo_list() -> list[torch.Tensor]:
            works = [dist.all_reduce(t, async_op=True) for t in gl]
            for w in works:
                assert w is not None
                w.wait()
            return gl

        def gloo_flat() -> list[torch.Tensor]:
            torch.cat([t.view(-1) for t in gf], out=flat)
            dist.all_reduce(flat)
            off = 0
            for t in gf:
                n = t.numel()
                t.view(-1).copy_(flat[off:off + n])
                off += n
            return gf

        def each_then_wait(start: Callable[..., Any], ts: list[torch.Tensor],
                           prefix: str) -> Callable[[], list[torch.Tensor]]:
            """Start ``start`` on every tensor (the client fuses them), then wait for all."""
            def step() -> list[torch.Tensor]:
                hs = [start(t, name=f"{prefix}.{i}") for i, t in enumerate(ts)]
                for h in hs:
                    h.wait()
                return ts
            return step

        nar_list = each_then_wait(c.neighbor_allreduce_async_, nl, "rn.nar")
        ar_list = each_then_wait(c.allreduce_async_, al, "rn.ar")
        nar_list_reg = each_then_wait(c.neighbor_allreduce_async_, rl, "rn.narr")

        ops = [
            Op("gloo_list", gloo_list, want_sum, refill(gl)),
            Op("gloo_flat", gloo_flat, want_sum, refill(gf)),
            Op("nar_list", nar_list, want_avg),
            Op("ar_list", ar_list, want_avg),
        ] + ([Op("nar_list_reg", nar_list_reg, want_avg)] if rl else [])
        return ops, {"tensors": len(shapes), "numel": numel, "nbytes": 4 * numel}

    def run_resnet(self, tick: Callable[[str], None]) -> dict[str, Any]:
        """All ResNet-18 list variants."""
        ops, info = self.resnet_ops()
        cap = self.args.resnet_repeats or 40
        res = self.run_ops(ops, cap, 2 * self.args.budget, tick)
        return {**info, **res}

    # -------------------------------------------------------------- daemon

    def daemon_status(self) -> dict[str, Any]:
        """This rank's daemon counters (``client.status()``)."""
        st = self.client.status()
        extra = {k: int(getattr(st, k)) for k in ("pid", "rss_bytes", "pool_bytes",
                                                   "pool_peak_bytes") if hasattr(st, k)}
        return {**extra,
                "ops_completed": int(st.ops_completed), "ops_failed": int(st.ops_failed),
                "ops_in_flight": int(st.ops_in_flight),
                "early_arrival_bytes": int(st.early_arrival_bytes),
                "peers": [{"rank": int(p.rank), "bytes_sent": int(p.bytes_sent),
                           "bytes_received": int(p.bytes_received)} for p in st.peers]}

    def close(self) -> None:
        """Tear down the raw link, gloo and the decent client."""
        with contextlib.suppress(Exception):
            self.link.close()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        dt.shutdown()


# ---------------------------------------------------------------------------------- hivemind


def run_hivemind(sizes: Sequence[int], repeats: int, timeout: float) -> dict[str, Any]:
    """``benchmarks/hivemind_avg.py`` on ``sizes`` + ResNet-18 in a subprocess; its JSON."""
    with tempfile.TemporaryDirectory(prefix="bench-hivemind-") as tmp:
        out = Path(tmp) / "hivemind.json"
        cmd = [sys.executable, str(REPO / "benchmarks" / "hivemind_avg.py"),
               "--sizes", ",".join(str(s) for s in sizes), "--resnet18",
               "--repeats", str(repeats), "--timeout", str(int(timeout)),
               "--json", str(out), "--no-progress"]
        started = time.monotonic()
        try:
            proc = subprocess.run(cmd, timeout=timeout + 120, check=False)
            code: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        data: dict[str, Any]
        try:
            data = json.loads(out.read_text())
        except (OSError, ValueError):
            data = {"error": f"hivemind_avg.py exited with {code} without a JSON result"}
        if code != 0 and "error" not in data and "skipped" not in data:
            data["error"] = f"hivemind_avg.py exited with {code}"
        data["command"] = shlex.join(["python", *cmd[1:]])
        data["subprocess_wall_s"] = time.monotonic() - started
        return data


# ---------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """Command line of the benchmark."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="",
                   help="comma-separated sizes, e.g. 4K,64K,1M,16M,64M (default 4K..64M, x4)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: sizes 4K,64K,1M, few repeats, ResNet-18 x3, no hivemind")
    p.add_argument("--no-hivemind", action="store_true", help="skip the hivemind baseline")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results",
                   help="directory for p2p_vs_gloo.{json,md,png}")
    p.add_argument("--repeats", type=int, default=0,
                   help="timed calls per size and op (default: adapted to size and --budget)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per size and op")
    p.add_argument("--placement", choices=sorted(PLACEMENTS), default="none",
                   help="pin each rank and its daemon (every thread) before measuring: node = a "
                   "rank and its daemon on CPU rank mod CPUs (a node per CPU), split = the ranks "
                   "on CPU 0 and the daemons on CPU 1, none = where the scheduler puts them "
                   "(default). On a VM a wake-up across CPUs costs tens of microseconds, which "
                   "small calls show")
    p.add_argument("--budget", type=float, default=4.0,
                   help="approximate seconds of timed calls per (size, op)")
    p.add_argument("--min-repeats", type=int, default=10, help="lower bound of the adapted R")
    p.add_argument("--resnet-repeats", type=int, default=0,
                   help="cap of timed ResNet-18 steps per variant (default 40, budget-adapted)")
    p.add_argument("--blocks", action="store_true",
                   help="time one block per op instead of interleaving the ops round-robin")
    p.add_argument("--hivemind-sizes", default="",
                   help="sizes for hivemind (default: the same as --sizes)")
    p.add_argument("--hivemind-repeats", type=int, default=3,
                   help="timed hivemind steps per case and mode")
    p.add_argument("--hivemind-timeout", type=float, default=1500.0,
                   help="give the hivemind subprocess this many seconds")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark on this rank; rank 0 writes the results. 1 when a decent op failed."""
    args = build_parser().parse_args(argv)
    if args.warmup < 1:
        raise SystemExit("--warmup must be >= 1 (the first warm-up call is the correctness check)")
    if args.quick:
        args.no_hivemind = True
        args.warmup = min(args.warmup, 2)
        args.budget = min(args.budget, 0.3)
        args.min_repeats = min(args.min_repeats, 5)
        args.resnet_repeats = args.resnet_repeats or 3
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()] or list(
        QUICK_SIZES if args.quick else DEFAULT_SIZES)
    if any(s <= 0 or s % 4 for s in sizes):
        raise SystemExit(f"sizes must be positive multiples of 4 bytes, got {sizes}")
    hm_sizes = [parse_size(s) for s in args.hivemind_sizes.split(",") if s.strip()] or sizes
    args.gloo_timeout = 120.0 if args.no_hivemind else args.hivemind_timeout + 300.0
    torch.set_num_threads(1)
    started = time.monotonic()
    load_start, uptime_start = os.getloadavg(), uptime_text()
    git_start = git_revision()  # the daemons run the code checked out now
    bench = Bench(args)
    rank = bench.rank
    status_start = bench.daemon_status()
    daemon_pid = status_start.get("pid") or find_daemon_pid()
    pinned = place(args.placement, rank, daemon_pid)
    sampler = RssSampler(daemon_pid)
    sampler.start()
    if rank == 0:
        listed = ", ".join(map(report.human_bytes, sizes))
        print(f"decent vs gloo vs raw TCP: 2 ranks, sizes {listed}; gloo on "
              f"127.0.0.1:{bench.port}; {uptime_start}", flush=True)
        if load_start[0] > report.LOAD_WARNING:
            print(f"note: load average {load_start[0]:.2f} > {report.LOAD_WARNING} at start: "
                  "the machine is busy with other work", flush=True)
    dist.barrier()
    memmove_start = memmove_ms() if rank == 0 else None  # rank 1 waits: one copy at a time
    dist.barrier()

    progress: Any = None
    if rank == 0:
        from tqdm import tqdm

        n_ops, n_rn = len(OPS), len(RN_OPS)
        if not bench.has_reg:
            n_ops, n_rn = n_ops - 2, n_rn - 1
        total = len(sizes) * n_ops + n_rn + (0 if args.no_hivemind else 1)
        progress = tqdm(total=total, desc="benchmark", unit="op", file=sys.stdout,
                        mininterval=1.0, ncols=100)

    def ticker(label: str) -> Callable[[str], None]:
        def tick(op: str) -> None:
            if progress is not None:
                progress.update(1)
                progress.set_postfix_str(f"{label} {op}")
        return tick

    results: list[dict[str, Any]] = []
    resnet: dict[str, Any] = {}
    hivemind: dict[str, Any] | None = None
    try:
        sampler.phase = "sizes"
        for nbytes in sizes:
            res = bench.run_size(nbytes, ticker(report.human_bytes(nbytes)))
            results.append(res)
            if progress is not None:
                parts = [f"{op} {report.ms(report.median(res, op))}"
                         + (f" {report.op_status(res, op)}" if report.op_status(res, op) else "")
                         for op in OPS]
                progress.write(f"{report.human_bytes(nbytes):>8} ms: " + ", ".join(parts))
        sampler.phase = "resnet18"
        resnet = bench.run_resnet(ticker("ResNet-18"))
        if progress is not None:
            progress.write("ResNet-18 ms/step: " + ", ".join(
                f"{op} {report.ms(report.median(resnet, op))}" for op in RN_OPS))
        sampler.phase = "hivemind (decent idle)"
        if not args.no_hivemind:
            if rank == 0:
                progress.set_postfix_str("hivemind (subprocess, several minutes)")
                progress.write("running benchmarks/hivemind_avg.py (rank 1 waits)")
                hivemind = run_hivemind(hm_sizes, args.hivemind_repeats, args.hivemind_timeout)
                progress.update(1)
            dist.barrier()  # rank 1 waits here (gloo timeout covers the hivemind run)
    finally:
        if progress is not None:
            progress.close()

    sampler.phase = "idle (receive pool back to its floor)"
    idle_wait = 0.0 if args.quick else wait_for_pool_floor(bench)  # quick: a smoke run
    status = bench.daemon_status()
    mem = sampler.stop()
    mem["idle_wait_s"] = round(idle_wait, 2)
    gathered: list[Any] = [None] * bench.size
    dist.all_gather_object(gathered, {"rank": rank, **mem, "status_start": status_start,
                                      "status": status})
    runtime = time.monotonic() - started
    failed = any(not ok for e in [*results, resnet] for ok in e.get("ok", {}).values())

    if rank == 0:
        meta = {
            "command": launch_command(bench.size),
            "argv": sys.argv,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "nproc": os.cpu_count(),
            "cpu": cpu_model(),
            "platform": platform.platform(),
            "versions": versions(),
            "git": git_start,
            "git_end": git_revision(),
            "threads": torch.get_num_threads(),
            "warmup": args.warmup,
            "budget": args.budget if not args.repeats else f"n/a (--repeats {args.repeats})",
            "mode": "one block per op (--blocks)" if args.blocks
            else "interleaved round-robin over all series",
            "quick": args.quick,
            "sizes": sizes,
            "loadavg_start": list(load_start),
            "loadavg_end": list(os.getloadavg()),
            "memmove_64mib_ms": memmove_start,
            "uptime_start": uptime_start,
            "uptime_end": uptime_text(),
            "loaded_at_start": load_start[0] > report.LOAD_WARNING,
            "runtime_s": runtime,
            "placement": args.placement,
            "pinned_cpus": {k: pinned[k] for k in ("rank", "daemon") if k in pinned},
        }
        data: dict[str, Any] = {"meta": meta, "ops": report.OPS, "resnet18_ops": report.RN_OPS,
                                "sizes": results, "resnet18": resnet,
                                "hivemind": hivemind, "daemons": gathered}
        out: Path = args.out
        out.mkdir(parents=True, exist_ok=True)
        report.plot_sizes(data, out / report.P2P_PNGS[0])
        report.plot_resnet(data, out / report.P2P_PNGS[1])
        data["acceptance"] = report.acceptance(data, None, [out / n for n in report.P2P_PNGS])
        (out / "p2p_vs_gloo.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
        (out / "p2p_vs_gloo.md").write_text(report.render_p2p(data, out))
        print("\n".join(report.acceptance_lines(data["acceptance"])))
        for line in report.failure_lines(data):
            print(line)
        print(f"total runtime {runtime:.1f} s; wrote {out / 'p2p_vs_gloo.json'}, "
              f"{out / 'p2p_vs_gloo.md'}, {out / report.P2P_PNGS[0]}, "
              f"{out / report.P2P_PNGS[1]}", flush=True)
        if failed:
            print("an op FAILED or returned a wrong result (see the report)", flush=True)
    dist.barrier()
    unplace(pinned)
    bench.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
