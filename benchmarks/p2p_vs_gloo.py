"""decent ``neighbor_allreduce`` / ``allreduce`` against torch.distributed gloo ``all_reduce``.

Run under the local launcher, which starts one daemon per rank and sets ``DECENT_DAEMON``,
``DECENT_RANK`` and ``DECENT_SIZE``::

    decentrun -np 2 python benchmarks/p2p_vs_gloo.py [--repeats N] [--out benchmarks/results]

Every worker connects to its daemon (``decent.torch.init()``) and also joins a gloo process group
on loopback (rank 0 picks a free port and broadcasts it through decent). For each tensor size
(float32, 4 KiB to 64 MiB by default) and each op it

1. runs a few warm-up calls; the first result is checked against the exact expected value (the
   average of all ranks' tensors for the decent ops, their sum for gloo), so a wrong result is
   reported instead of silently timed;
2. synchronizes both ranks (``dist.barrier()`` and ``client.barrier()``);
3. times ``R`` calls back to back, each call on its own (``time.perf_counter`` around the call):

   * gloo: ``dist.all_reduce(buf)`` (SUM, in place; ``buf`` is refilled from the input before each
     call, outside the timed region, so values never overflow);
   * decent neighbor_allreduce: ``client.neighbor_allreduce_async(x, name=...).wait()``;
   * decent allreduce: ``client.allreduce(x, op="average", name=...)``.

   With ``--interleave`` the timed calls go round-robin (gloo, nar, ar, gloo, ...) instead, so
   that load from other processes hits all three ops alike.

   Decent's times therefore include the copy into the shared-memory arena and the copy of the
   result out of it (a new tensor), which is the cost a user of the API pays; gloo works in place.

Statistics: each rank computes median / p10 / p90 / mean / min of its own per-call times; the
reported value of every statistic is the **maximum over the ranks** (the slower rank bounds a
collective). Throughput is tensor bytes / median time (the "algorithm bandwidth" of nccl-tests);
a ratio is decent median / gloo median (> 1: decent is slower).

``R`` defaults to ``min(200, max(5, 2**26 // nbytes))`` and is capped so that one (size, op)
block takes about ``--budget`` seconds, judged from the slower rank's last warm-up call (both
ranks agree on ``R``, or the collectives would not match). ``--repeats N`` fixes ``R``.

Rank 0 prints a table and writes ``p2p_vs_gloo.md``, ``p2p_vs_gloo.png`` and ``p2p_vs_gloo.json``
into ``--out``. The script exits with code 1 when a correctness check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import decent.torch as dt

OPS = ("gloo", "nar", "ar")
OP_TITLES = {
    "gloo": "gloo all_reduce (sum)",
    "nar": "decent neighbor_allreduce",
    "ar": "decent allreduce (average)",
}
STATS = ("median", "p10", "p90", "mean", "min")
DEFAULT_SIZES = tuple(4 << (2 * k) << 10 for k in range(8))  # 4 KiB, 16 KiB, ..., 64 MiB
REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------- helpers


def human_bytes(n: float) -> str:
    """``4 KiB``, ``16 MiB``... (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if float(n).is_integer() else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def mib(n: float) -> str:
    """Bytes as ``12.3 MiB``."""
    return f"{n / (1 << 20):.1f} MiB"


def human_rate(bytes_per_s: float) -> str:
    """Throughput in MB/s or GB/s (decimal units, as network rates usually are)."""
    if bytes_per_s >= 1e9:
        return f"{bytes_per_s / 1e9:.2f} GB/s"
    return f"{bytes_per_s / 1e6:.1f} MB/s"


def parse_size(text: str) -> int:
    """``4K``, ``16KiB``, ``1M``, ``65536`` -> bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    number = t[:-1] if t[-1:] in "KMG" else t
    return int(float(number) * mult)


def default_repeats(nbytes: int) -> int:
    """More repeats for small tensors: ``min(200, max(5, 2**26 // nbytes))``."""
    return int(min(200, max(5, (1 << 26) // max(1, nbytes))))


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """median / p10 / p90 / mean / min of per-call times (seconds)."""
    a = np.asarray(samples, dtype=np.float64)
    return {
        "median": float(np.median(a)),
        "p10": float(np.percentile(a, 10)),
        "p90": float(np.percentile(a, 90)),
        "mean": float(a.mean()),
        "min": float(a.min()),
    }


def time_calls(fn: Callable[[], object], repeats: int,
               before: Callable[[], object] | None = None) -> list[float]:
    """Per-call wall times of ``repeats`` calls of ``fn`` (``before`` runs untimed each time)."""
    times: list[float] = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def make_input(rank: int, numel: int) -> torch.Tensor:
    """Rank ``rank``'s tensor: deterministic, so every rank can rebuild every other's."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(numel, generator=g, dtype=torch.float32)


def max_abs_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference (inf when shapes differ)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return float("inf")
    return float((got - want).abs().max()) if got.numel() else 0.0


# ---------------------------------------------------------------------------------- environment


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def git_revision() -> str:
    """``<short sha>`` of the checkout, ``+dirty`` when the tree has local changes."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, check=True,
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO, capture_output=True, text=True, timeout=10).stdout
        return sha + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def launch_command(size: int) -> str:
    """The decentrun command line that started us (read from the parent), else a reconstruction."""
    with contextlib.suppress(OSError):
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
        argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
        for i, arg in enumerate(argv):
            if os.path.basename(arg) == "decentrun":
                return shlex.join(["decentrun", *argv[i + 1:]])
    return shlex.join(["decentrun", "-np", str(size), "python", *sys.argv])


def proc_memory(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM (peak RSS), RssAnon and RssShmem of ``pid`` in bytes (empty if unreadable).

    RssShmem counts the touched pages of the shared-memory arenas, RssAnon the daemon's own heap.
    """
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


def find_daemon_pid() -> int | None:
    """The pid of our daemon: a ``decentd.cli`` process whose ``--socket`` is $DECENT_DAEMON."""
    address = os.environ.get("DECENT_DAEMON", "")
    sock = address.removeprefix("unix://")
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


# ---------------------------------------------------------------------------------- measurement


@dataclass
class SizeResult:
    """Everything measured for one tensor size (statistics already maxed over ranks)."""

    nbytes: int
    repeats: dict[str, int]
    stats: dict[str, dict[str, float]]
    errors: dict[str, float]
    ok: dict[str, bool] = field(default_factory=dict)


class Bench:
    """One worker's side of the benchmark: a decent client plus a gloo process group."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.client = dt.init()
        self.rank = self.client.rank
        self.size = self.client.size
        env_rank = os.environ.get("DECENT_RANK")
        if env_rank is not None and int(env_rank) != self.rank:
            raise RuntimeError(f"$DECENT_RANK={env_rank} but the daemon says rank {self.rank}")
        port = self._agree_port()
        dist.init_process_group("gloo", rank=self.rank, world_size=self.size,
                                init_method=f"tcp://127.0.0.1:{port}",
                                timeout=datetime.timedelta(seconds=120))
        self.port = port

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

    # -------------------------------------------------------------- collectives on gloo (control)

    def max_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """Elementwise max over ranks (gloo, outside any timed region)."""
        out = values.clone().to(torch.float64)
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return out

    def sync(self) -> None:
        """Line both ranks up before a timed block: gloo barrier, then decent barrier."""
        dist.barrier()
        self.client.barrier(name="bench.sync")

    # -------------------------------------------------------------- one size

    def expected_neighbor(self, inputs: list[torch.Tensor], name: str) -> torch.Tensor:
        """``self_w * x_self + sum_j w_j * x_j`` at the step the next call of ``name`` uses."""
        info = self.client.topology_at(name)
        want = inputs[self.rank] * float(info.self_weight)
        for j, w in sorted(info.src_weights.items()):
            want = want + inputs[int(j)] * float(w)
        return want

    def run_size(self, nbytes: int, on_op: Callable[[str], None]) -> SizeResult:
        """Warm up, check, and time the three ops for one tensor size."""
        args = self.args
        numel = nbytes // 4
        inputs = [make_input(r, numel) for r in range(self.size)]
        x = inputs[self.rank]
        total = torch.stack(inputs).sum(0) if self.size > 1 else x.clone()
        avg = total / self.size
        buf = torch.empty_like(x)
        nar_name, ar_name = f"nar.{nbytes}", f"ar.{nbytes}"
        want_nar = self.expected_neighbor(inputs, nar_name)
        del inputs

        def gloo_call() -> torch.Tensor:
            dist.all_reduce(buf)
            return buf

        def refill() -> None:
            buf.copy_(x)

        def nar_call() -> torch.Tensor:
            return self.client.neighbor_allreduce_async(x, name=nar_name).wait()

        def ar_call() -> torch.Tensor:
            return self.client.allreduce(x, op="average", name=ar_name)

        calls: dict[str, tuple[Callable[[], torch.Tensor], Callable[[], None] | None,
                               torch.Tensor]] = {
            "gloo": (gloo_call, refill, total),
            "nar": (nar_call, None, want_nar),
            "ar": (ar_call, None, avg),
        }
        repeats: dict[str, int] = {}
        errors: dict[str, float] = {}
        samples: dict[str, list[float]] = {}
        for op, (call, before, want) in calls.items():
            on_op(op)
            self.sync()
            # warm-up; the first result is the correctness check
            warm_times: list[float] = []
            for i in range(args.warmup):
                if before is not None:
                    before()
                t0 = time.perf_counter()
                got = call()
                warm_times.append(time.perf_counter() - t0)
                if i == 0:
                    errors[op] = max_abs_err(got, want)
                del got
            slow = float(self.max_over_ranks(torch.tensor([warm_times[-1]]))[0])
            if args.repeats:
                repeats[op] = args.repeats
            else:
                repeats[op] = min(default_repeats(nbytes),
                                  max(args.min_repeats, int(args.budget / slow)))
            if not args.interleave:
                self.sync()
                samples[op] = time_calls(call, repeats[op], before)
        if args.interleave:
            # one call of each op per iteration: load changes hit all ops alike
            r = min(repeats.values())
            repeats = dict.fromkeys(OPS, r)
            samples = {op: [] for op in OPS}
            self.sync()
            for _ in range(r):
                for op, (call, before, _want) in calls.items():
                    samples[op] += time_calls(call, 1, before)
        stats: dict[str, dict[str, float]] = {}
        for op in OPS:
            local = summarize(samples[op])
            agg = self.max_over_ranks(torch.tensor([local[s] for s in STATS]))
            stats[op] = {s: float(v) for s, v in zip(STATS, agg.tolist(), strict=True)}
        err_t = self.max_over_ranks(torch.tensor([errors[op] for op in OPS]))
        errors = {op: float(v) for op, v in zip(OPS, err_t.tolist(), strict=True)}
        ok = {op: errors[op] <= args.atol for op in OPS}
        return SizeResult(nbytes, repeats, stats, errors, ok)

    def close(self) -> None:
        """Tear down gloo and the decent client."""
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        dt.shutdown()


# ---------------------------------------------------------------------------------- reporting


def ms(seconds: float) -> str:
    """Milliseconds with sensible precision."""
    v = seconds * 1e3
    return f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 100 else f"{v:.0f}"


def ratio(res: SizeResult, op: str) -> float:
    """decent median / gloo median."""
    return res.stats[op]["median"] / res.stats["gloo"]["median"]


def rich_table(results: list[SizeResult]) -> Any:
    """The console table (rich)."""
    from rich.table import Table

    table = Table(title="decent vs gloo, float32: median ms (p10-p90), max over ranks; "
                  "ratio = decent / gloo; R = timed calls gloo/nar/ar")
    table.add_column("size", justify="right")
    table.add_column("gloo allreduce ms", justify="right")
    table.add_column("decent neighbor_allreduce ms", justify="right")
    table.add_column("ratio", justify="right")
    table.add_column("decent allreduce ms", justify="right")
    table.add_column("ratio", justify="right")
    table.add_column("R", justify="right")
    for res in results:
        table.add_row(*row_cells(res, lambda err: f" WRONG (err {err:.2g})", "{:.1f}x"))
    return table


def row_cells(res: SizeResult, wrong: Callable[[float], str], ratio_fmt: str) -> list[str]:
    """One size's cells: size, per op median (p10-p90) with ratios to gloo, repeats."""
    cells = [human_bytes(res.nbytes)]
    for op in OPS:
        s = res.stats[op]
        cell = f"{ms(s['median'])} ({ms(s['p10'])}-{ms(s['p90'])})"
        if not res.ok[op]:
            cell += wrong(res.errors[op])
        cells.append(cell)
        if op != "gloo":
            cells.append(ratio_fmt.format(ratio(res, op)))
    cells.append("/".join(str(res.repeats[op]) for op in OPS))
    return cells


def markdown(results: list[SizeResult], meta: dict[str, Any]) -> str:
    """The results file: command, machine, method, tables."""
    lines = [
        "# decent vs gloo: neighbor_allreduce / allreduce between 2 daemons",
        "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}",
        f"- machine: {meta['nproc']} CPUs ({meta['cpu']}), {meta['platform']}",
        f"- load average at start / end: {meta['load_start']} / {meta['load_end']}",
        f"- python {meta['python']}, torch {meta['torch']}, numpy {meta['numpy']}, "
        f"decent {meta['git']}",
        f"- torch threads: {meta['threads']}; warm-up calls: {meta['warmup']}; "
        f"budget per block: {meta['budget']} s; timing: {meta['mode']}; "
        f"total runtime: {meta['runtime_s']:.1f} s",
        "",
        "Times are per call (median, p10-p90) in milliseconds; every statistic is the maximum "
        "over the ranks of that rank's own statistic. gloo: `dist.all_reduce` (SUM, in place). "
        "decent: `neighbor_allreduce_async(x).wait()` and `allreduce(x, op='average')`, "
        "including the copies into and out of the shared-memory arena. Ratio = decent median / "
        "gloo median. Throughput = tensor bytes / median time. R = timed calls "
        "(gloo/nar/ar). Each op's first warm-up result was checked against the exact expected "
        "value (max abs error shown).",
        "",
        "| size | gloo ms | decent nar ms | nar / gloo | decent allreduce ms | ar / gloo | R |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        cells = row_cells(res, lambda _err: " **WRONG**", "{:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Throughput (tensor bytes / median time), fastest call (min ms: less sensitive to other "
        "load on the machine) and correctness (max abs error of the first result):",
        "",
        "| size | gloo | decent nar | decent allreduce | min ms gloo / nar / allreduce "
        "| err gloo | err nar | err allreduce |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        rates = [human_rate(res.nbytes / res.stats[op]["median"]) for op in OPS]
        mins = " / ".join(ms(res.stats[op]["min"]) for op in OPS)
        errs = [f"{res.errors[op]:.1e}" + ("" if res.ok[op] else " WRONG") for op in OPS]
        lines.append("| " + " | ".join([human_bytes(res.nbytes), *rates, mins, *errs]) + " |")
    lines += ["", "Daemons after the run (from `client.status()` and /proc):", ""]
    for d in meta["daemons"]:
        lines.append(f"- {d}")
    lines.append("")
    return "\n".join(lines)


def plot(results: list[SizeResult], path: Path) -> None:
    """Two panels: time vs size (log-log, p10-p90 band) and ratio vs size (line at 1.0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    sizes = np.array([r.nbytes for r in results], dtype=float)
    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(12, 4.8))
    for op, marker in zip(OPS, ("o", "s", "^"), strict=True):
        med = np.array([r.stats[op]["median"] for r in results]) * 1e3
        lo = np.array([r.stats[op]["p10"] for r in results]) * 1e3
        hi = np.array([r.stats[op]["p90"] for r in results]) * 1e3
        ax_t.plot(sizes, med, marker=marker, label=OP_TITLES[op])
        ax_t.fill_between(sizes, lo, hi, alpha=0.2)
    ax_t.set_xscale("log", base=2)
    ax_t.set_yscale("log")
    ax_t.set_xlabel("tensor size (bytes, float32)")
    ax_t.set_ylabel("time per call (ms, median; band p10-p90)")
    ax_t.set_title("time vs size")
    ax_t.grid(True, which="both", alpha=0.3)
    ax_t.legend()
    for op, marker in (("nar", "s"), ("ar", "^")):
        ax_r.plot(sizes, [ratio(r, op) for r in results], marker=marker,
                  label=f"{OP_TITLES[op]} / gloo")
    ax_r.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax_r.set_xscale("log", base=2)
    ax_r.set_yscale("log")
    ax_r.set_xlabel("tensor size (bytes, float32)")
    ax_r.set_ylabel("decent median / gloo median")
    ax_r.set_title("ratio (>1: decent slower)")
    ax_r.grid(True, which="both", alpha=0.3)
    ax_r.legend()
    for ax in (ax_t, ax_r):
        ax.set_xticks(sizes, [human_bytes(s) for s in sizes], rotation=45)
        ax.xaxis.set_minor_locator(NullLocator())
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def daemon_summary(bench: Bench, pid: int | None, mem_start: dict[str, int]) -> str:
    """One line about this rank's daemon: traffic counters and memory."""
    st = bench.client.status()
    peers = ", ".join(
        f"to/from rank {p.rank}: {human_bytes(p.bytes_sent)} / {human_bytes(p.bytes_received)}"
        for p in st.peers
    )
    text = (f"rank {st.rank} daemon: ops completed {st.ops_completed}, failed {st.ops_failed}, "
            f"in flight {st.ops_in_flight}, early-arrival bytes {st.early_arrival_bytes}; "
            f"{peers}")
    if pid is not None:
        mem = proc_memory(pid)
        if mem:
            text += (f"; pid {pid} RSS {mib(mem_start.get('VmRSS', 0))} at start "
                     f"(anon {mib(mem_start.get('RssAnon', 0))}), "
                     f"{mib(mem.get('VmRSS', 0))} at end (anon {mib(mem.get('RssAnon', 0))}, "
                     f"shmem {mib(mem.get('RssShmem', 0))}), peak {mib(mem.get('VmHWM', 0))}")
    return text


# ---------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """Command line of the benchmark."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=0,
                   help="timed calls per size and op (default: adapted to size and --budget)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results",
                   help="directory for p2p_vs_gloo.{md,png,json}")
    p.add_argument("--sizes", default="",
                   help="comma-separated sizes in bytes, e.g. 4K,1M,64M (default 4K..64M, x4)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per size and op")
    p.add_argument("--budget", type=float, default=5.0,
                   help="approximate seconds per (size, op) timed block when --repeats is unset")
    p.add_argument("--min-repeats", type=int, default=5, help="lower bound of the adapted R")
    p.add_argument("--interleave", action="store_true",
                   help="time the ops round-robin (gloo, nar, ar, gloo, ...) instead of one block "
                   "per op: fairer ratios on a machine with fluctuating load")
    p.add_argument("--atol", type=float, default=1e-5,
                   help="max abs error accepted by the correctness check")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark on this rank; rank 0 reports. 1 when a correctness check failed."""
    args = build_parser().parse_args(argv)
    if args.warmup < 1:
        raise SystemExit("--warmup must be >= 1 (the first warm-up call is the correctness check)")
    sizes = [parse_size(s) for s in args.sizes.split(",") if s] or list(DEFAULT_SIZES)
    if any(s <= 0 or s % 4 for s in sizes):
        raise SystemExit(f"sizes must be positive multiples of 4 bytes, got {sizes}")
    torch.set_num_threads(1)
    started = time.monotonic()
    load_start = os.getloadavg()
    pid = find_daemon_pid()
    mem_start = proc_memory(pid) if pid is not None else {}

    bench = Bench(args)
    rank = bench.rank
    if rank == 0:
        print(f"decent vs gloo: {bench.size} ranks, sizes {', '.join(map(human_bytes, sizes))}; "
              f"gloo on 127.0.0.1:{bench.port}; torch threads {torch.get_num_threads()}",
              flush=True)
    dist.barrier()  # gloo is up on every rank

    results: list[SizeResult] = []
    progress: Any = None
    if rank == 0:
        from tqdm import tqdm

        progress = tqdm(total=len(sizes) * len(OPS), desc="benchmark", unit="block",
                        file=sys.stdout, mininterval=1.0, ncols=90)
    try:
        for nbytes in sizes:
            def on_op(op: str, nbytes: int = nbytes) -> None:
                if progress is not None:
                    if op != OPS[0]:
                        progress.update(1)
                    progress.set_postfix_str(f"{human_bytes(nbytes)} {op}")

            res = bench.run_size(nbytes, on_op)
            results.append(res)
            if progress is not None:
                progress.update(1)
                parts = [f"{op} {ms(res.stats[op]['median'])} ms"
                         + ("" if res.ok[op] else " WRONG") for op in OPS]
                progress.write(f"{human_bytes(res.nbytes):>8}: " + ", ".join(parts)
                               + f"; nar/gloo {ratio(res, 'nar'):.1f}x, "
                               f"ar/gloo {ratio(res, 'ar'):.1f}x")
    finally:
        if progress is not None:
            progress.close()

    # daemon counters and memory of every rank, gathered to rank 0
    summaries: list[Any] = [None] * bench.size
    dist.all_gather_object(summaries, daemon_summary(bench, pid, mem_start))
    runtime = time.monotonic() - started
    failed = any(not ok for res in results for ok in res.ok.values())

    if rank == 0:
        from rich.console import Console

        console = Console() if sys.stdout.isatty() else Console(width=150)
        console.print(rich_table(results))
        for line in summaries:
            console.print(line)
        meta = {
            "command": launch_command(bench.size),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "nproc": os.cpu_count(),
            "cpu": cpu_model(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numpy": np.__version__,
            "git": git_revision(),
            "threads": torch.get_num_threads(),
            "warmup": args.warmup,
            "budget": args.budget if not args.repeats else f"n/a (--repeats {args.repeats})",
            "mode": "interleaved (--interleave)" if args.interleave else "one block per op",
            "load_start": " ".join(f"{v:.2f}" for v in load_start),
            "load_end": " ".join(f"{v:.2f}" for v in os.getloadavg()),
            "runtime_s": runtime,
            "daemons": summaries,
        }
        out: Path = args.out
        out.mkdir(parents=True, exist_ok=True)
        (out / "p2p_vs_gloo.md").write_text(markdown(results, meta))
        plot(results, out / "p2p_vs_gloo.png")
        (out / "p2p_vs_gloo.json").write_text(
            json.dumps({"meta": meta, "results": [asdict(r) for r in results]}, indent=1) + "\n"
        )
        console.print(f"total runtime {runtime:.1f} s; wrote {out / 'p2p_vs_gloo.md'}, "
                      f"{out / 'p2p_vs_gloo.png'}, {out / 'p2p_vs_gloo.json'}")
        if failed:
            console.print("[bold red]correctness check FAILED for some op/size (see WRONG)")
    dist.barrier()
    bench.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
