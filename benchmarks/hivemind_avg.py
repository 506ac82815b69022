"""hivemind ``DecentralizedAverager`` baseline: two averager peers on loopback, one machine.

Run it directly::

    python benchmarks/hivemind_avg.py --sizes 4096,1048576,67108864 --resnet18 --repeats 5 \\
        --json out.json

or import it and call :func:`run`. hivemind is an optional dependency (the ``bench`` extra); when it
cannot be imported the script says why, writes ``{"skipped": "<reason>"}`` and exits with code 0.

Setup. Two worker processes are started with the ``spawn`` method. Rank 0 starts a DHT on
``/ip4/127.0.0.1/tcp/0`` and hands its visible multiaddrs to rank 1, which joins with
``initial_peers``. UPnP / NAT-PMP port mapping and AutoNAT are switched off so that nothing leaves
loopback. For every case each rank builds a ``DecentralizedAverager`` over its own tensors with
``target_group_size=2`` (so a group is assembled as soon as both peers have met),
``min_matchmaking_time=--matchmaking-time`` (2 s) and ``request_timeout`` of half that; all other
settings are hivemind's defaults (no compression, 512 KiB parts, equal weights,
``averaging_alpha=1``).

Cases: one float32 tensor of each ``--sizes`` byte count and, with ``--resnet18``, the 62 parameter
tensors of ResNet-18 (11,689,512 float32 values, shapes written out by hand below).

Every repeat starts from tensors filled with the peer's rank (0.0 and 1.0), so the average is 0.5
everywhere; after every step each peer checks ``|x - 0.5| <= 1e-6`` with numpy. Two timings are
taken per case, each with one extra warm-up repeat that is not counted:

* ``step``: wall time of a plain blocking ``averager.step()`` -- what a user sees. Both peers enter
  it at the same moment (a process barrier), so it **includes matchmaking** (the DHT declarations
  and the join request that form the group) and the all-reduce.
* ``allreduce``: the all-reduce alone, measured after group formation. Each peer calls
  ``averager.step(wait=False, require_trigger=True)`` (the pre-scheduling hivemind's own
  ``Optimizer`` uses), waits until the returned ``StepControl`` reaches
  ``AveragingStage.AWAITING_TRIGGER`` (group formed; that wait is reported as ``matchmaking``),
  both peers pass a barrier, then the time from ``control.allow_allreduce()`` to
  ``control.result()`` is taken.

Failed rounds. hivemind sometimes fails a round on this loaded 2-CPU machine: no group within the
step's 60 s (``could not find a group``), or a step that returns with one peer's tensors left
unaveraged. A user's training loop would carry on; the benchmark starts the round over instead of
giving up. After each round both peers tell each other (a shared flag per peer, then a barrier)
whether theirs worked; if either did not, both shut their averager down, start a new one under a
fresh DHT prefix, run its untimed warm-up round and repeat the round. Failed rounds are not timed
(which favours hivemind) and are listed per case (``failed_rounds``, ``failures``); after more
than ``retries`` (3) in one case the benchmark fails with every error. So a wrong average shows
as a failed round: ``max_abs_err`` and ``correct`` describe the rounds that counted. Each round
is bounded: the search for a group by ``step(timeout=60)``, the all-reduce by
``allreduce_timeout`` (60 s; hivemind's default is none).

Statistics: each peer's median over the repeats; the reported value is the **maximum over the two
peers** (the slower peer bounds a collective), as in ``p2p_vs_gloo.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import multiprocessing as mp
import os
import platform
import queue
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

LOOPBACK_MADDR = "/ip4/127.0.0.1/tcp/0"
TOLERANCE = 1e-6
WORLD = 2
MODES = ("step", "allreduce")
#: a failed round's error on the peer whose own part of it worked (report.py leaves it out)
OTHER_PEER_FAILED = "the other peer failed"


# ---------------------------------------------------------------------------------------- cases


def resnet18_shapes() -> list[tuple[int, ...]]:
    """Shapes of ResNet-18's 62 parameter tensors (11,689,512 values), ``named_parameters`` order.

    Stem conv + bn, four stages of two BasicBlocks (conv-bn-conv-bn; the first block of stages 2-4
    also has a 1x1 stride-2 downsample conv + bn), then the 1000-way classifier. BatchNorm running
    statistics are buffers, not parameters, and are not included.
    """
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    in_ch = 64
    for out_ch in (64, 128, 256, 512):
        for block in range(2):
            shapes += [(out_ch, in_ch, 3, 3), (out_ch,), (out_ch,)]
            shapes += [(out_ch, out_ch, 3, 3), (out_ch,), (out_ch,)]
            if block == 0 and in_ch != out_ch:
                shapes += [(out_ch, in_ch, 1, 1), (out_ch,), (out_ch,)]
            in_ch = out_ch
    shapes += [(1000, 512), (1000,)]
    return shapes


@dataclass
class Case:
    """One thing to average: a list of float32 tensor shapes."""

    name: str
    shapes: list[tuple[int, ...]]

    @property
    def numel(self) -> int:
        """Total number of float32 values."""
        return sum(int(np.prod(s)) for s in self.shapes)

    @property
    def nbytes(self) -> int:
        """Total payload in bytes."""
        return 4 * self.numel


def make_cases(sizes_bytes: Sequence[int], resnet18: bool) -> list[Case]:
    """One single-tensor case per size (rounded down to whole float32 values), then ResNet-18."""
    cases = []
    for size in sizes_bytes:
        if size < 4:
            raise ValueError(f"size {size} B holds no float32 value")
        cases.append(Case(f"float32x{size // 4}", [(size // 4,)]))
    if resnet18:
        cases.append(Case("resnet18", resnet18_shapes()))
    return cases


# ---------------------------------------------------------------------------------------- worker


@dataclass
class Config:
    """Settings shared by both peers."""

    repeats: int = 5
    matchmaking_time: float = 2.0
    #: a round not done by then has failed (a ResNet-18 round takes 1-2 s here)
    step_timeout: float = 60.0
    torch_threads: int = 1
    barrier_timeout: float = 600.0
    #: failed rounds per case that are started over before the benchmark gives up
    retries: int = 3


@dataclass
class PeerResult:
    """One peer's samples for one case (seconds; warm-up excluded)."""

    samples: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in MODES})
    matchmaking: list[float] = field(default_factory=list)
    max_abs_err: float = 0.0  # over the rounds that counted
    failures: list[dict[str, Any]] = field(default_factory=list)  # rounds started over


def _reset(averager: Any, value: float) -> None:
    """Refill the averaged (shared-memory) tensors with ``value``."""
    with averager.get_tensors() as tensors:
        for t in tensors:
            t.fill_(value)


def _max_err(averager: Any) -> float:
    """Largest ``|x - 0.5|`` over all averaged tensors."""
    with averager.get_tensors() as tensors:
        return max(float(np.max(np.abs(t.numpy() - 0.5))) for t in tensors)


def _await_group(control: Any, stages: Any, deadline: float) -> None:
    """Poll a ``StepControl`` until its group is formed and it waits for the trigger."""
    while control.stage != stages.AWAITING_TRIGGER:
        if control.done():  # failed before a group was formed: raises the averager's error
            control.result()
            raise RuntimeError("averaging step finished without being triggered")
        if time.monotonic() > deadline:
            raise TimeoutError("no averaging group formed in time")
        time.sleep(0.0005)


def agree(ok: bool, rank: int, flags: Any, barrier: Any, timeout: float) -> bool:
    """Tell the other peer whether this rank's part of an attempt worked; True if both did.

    Both peers always call it at the same points of an attempt, so they retry in lockstep.
    """
    flags[rank] = 1 if ok else 0
    barrier.wait(timeout)
    agreed = all(flags[r] for r in range(WORLD))
    barrier.wait(timeout)  # both have read the flags before either writes them again
    return agreed


@dataclass
class _Attempt:
    """One averaging round as this peer saw it."""

    elapsed: float = 0.0
    formed: float = 0.0
    max_abs_err: float = 0.0
    error: str = ""


def _attempt(averager: Any, mode: str, rank: int, cfg: Config, stages: Any, barrier: Any,
             flags: Any) -> _Attempt | None:
    """Average once in ``mode``: the round's timings, its ``error`` set if it failed here.

    A round fails when hivemind raises or leaves this peer's tensors unaveraged. Both peers learn
    of it: a peer that saw it returns the round with its ``error``; a peer whose own part worked
    returns None.
    """
    out = _Attempt()
    control = None
    try:
        t0 = time.perf_counter()
        if mode == "step":
            averager.step(timeout=cfg.step_timeout)
            out.elapsed = time.perf_counter() - t0
        else:
            control = averager.step(wait=False, require_trigger=True, timeout=cfg.step_timeout)
            _await_group(control, stages, time.monotonic() + cfg.step_timeout)
            out.formed = time.perf_counter() - t0
    except Exception as e:  # hivemind's round failed: no group, a timeout, a peer error
        out.error = f"{type(e).__name__}: {e}"
    if mode == "allreduce":
        # both groups formed (or neither is used): then the all-reduce alone is timed
        if not agree(not out.error, rank, flags, barrier, cfg.barrier_timeout):
            if control is not None and not control.done():
                control.cancel()
            return out if out.error else None
        assert control is not None
        t1 = time.perf_counter()
        try:
            control.allow_allreduce()
            control.result(timeout=cfg.step_timeout)
            out.elapsed = time.perf_counter() - t1
        except Exception as e:
            out.error = f"{type(e).__name__}: {e}"
    if not out.error:
        out.max_abs_err = _max_err(averager)
        if out.max_abs_err > TOLERANCE:
            out.error = (f"tensors not averaged: max |x - 0.5| = {out.max_abs_err:.3g} "
                         f"on rank {rank}")
    if not agree(not out.error, rank, flags, barrier, cfg.barrier_timeout):
        return out if out.error else None
    return out


def _averager(hivemind: Any, dht: Any, case: Case, rank: int, cfg: Config, generation: int
              ) -> Any:
    """A started averager over fresh tensors filled with ``rank``; ``generation`` > 0 (after a
    failed round) gives it a DHT prefix of its own, so it meets nothing the old one left."""
    import torch

    tensors = [torch.full(s, float(rank), dtype=torch.float32) for s in case.shapes]
    suffix = f"_retry{generation}" if generation else ""
    return hivemind.averaging.DecentralizedAverager(
        tensors,
        dht,
        start=True,
        prefix=f"bench_{case.name}{suffix}",
        target_group_size=WORLD,
        min_group_size=WORLD,
        min_matchmaking_time=cfg.matchmaking_time,
        request_timeout=cfg.matchmaking_time / 2,
        # step(timeout=) bounds the search for a group only; this bounds the all-reduce
        allreduce_timeout=cfg.step_timeout,
    )


def _shutdown(averager: Any, barrier: Any, cfg: Config) -> None:
    """Stop an averager once both peers are done with it.

    Every all-reduce makes the averager re-declare its state in the DHT through an MPFuture
    that carries a pipe; if the averager exits before the DHT process reads that message, the DHT
    logs FileNotFoundError and stalls its own shutdown.
    """
    barrier.wait(cfg.barrier_timeout)
    time.sleep(1.0)
    averager.shutdown()


def _worker(
    rank: int, cases: list[Case], cfg: Config, barrier: Any, flags: Any, addr_q: Any,
    out_q: Any
) -> None:
    """Body of one peer process: DHT, then one averager per case, timed steps, results to out_q."""
    os.setpgrp()  # so the parent can clean up this peer's whole tree (DHT, averager, p2pd)
    # A spawned child inherits the "spawn" start method, but hivemind's DHT and averager are
    # mp.Process subclasses holding unpicklable state: they only start with "fork".
    mp.set_start_method("fork", force=True)
    dht = None
    try:
        import torch

        torch.set_num_threads(cfg.torch_threads)
        hivemind = importlib.import_module("hivemind")
        stages = importlib.import_module("hivemind.averaging.control").AveragingStage
        dht_kwargs: dict[str, Any] = dict(
            host_maddrs=[LOOPBACK_MADDR], nat_port_map=False, auto_nat=False, start=True
        )
        if rank == 0:
            dht = hivemind.DHT(**dht_kwargs)
            maddrs = [str(m) for m in dht.get_visible_maddrs()]
            for _ in range(WORLD - 1):
                addr_q.put(maddrs)
        else:
            dht = hivemind.DHT(initial_peers=addr_q.get(timeout=120), **dht_kwargs)

        for case in cases:
            generation = 0
            averager = _averager(hivemind, dht, case, rank, cfg, generation)
            res = PeerResult()
            try:
                for mode in MODES:
                    # the first round of each mode, and of each new averager, is an untimed warm-up
                    warm = False
                    while len(res.samples[mode]) < cfg.repeats:
                        _reset(averager, float(rank))
                        barrier.wait(cfg.barrier_timeout)
                        got = _attempt(averager, mode, rank, cfg, stages, barrier, flags)
                        if got is not None and not got.error:
                            if warm:
                                res.max_abs_err = max(res.max_abs_err, got.max_abs_err)
                                res.samples[mode].append(got.elapsed)
                                if mode == "allreduce":
                                    res.matchmaking.append(got.formed)
                            warm = True
                            if rank == 0:
                                out_q.put(("tick", case.name, mode))
                            continue
                        # hivemind failed this round on one peer or both: both start over with a
                        # new averager (and its warm-up); the failed round is not timed
                        res.failures.append({
                            "mode": mode, "timed_so_far": len(res.samples[mode]),
                            "error": got.error if got is not None else OTHER_PEER_FAILED,
                        })
                        if len(res.failures) > cfg.retries:
                            errors = "; ".join(f["error"] for f in res.failures)
                            raise RuntimeError(f"{case.name}/{mode}: hivemind failed "
                                               f"{len(res.failures)} rounds: {errors}")
                        _shutdown(averager, barrier, cfg)
                        averager = None
                        generation += 1
                        averager = _averager(hivemind, dht, case, rank, cfg, generation)
                        warm = False
                _shutdown(averager, barrier, cfg)
            except BaseException:
                if averager is not None:
                    with contextlib.suppress(Exception):
                        averager.shutdown()
                raise
            out_q.put(("case", rank, case.name, asdict(res)))
        out_q.put(("done", rank))
    except BaseException:
        with contextlib.suppress(Exception):
            barrier.abort()  # wake the other peer instead of letting it wait for the timeout
        out_q.put(("error", rank, traceback.format_exc()))
    finally:
        if dht is not None:
            with contextlib.suppress(Exception):
                dht.shutdown()


# ---------------------------------------------------------------------------------------- driver


def hivemind_version() -> tuple[str | None, str | None]:
    """``(version, None)`` if hivemind imports here, else ``(None, reason)``."""
    try:
        return str(importlib.import_module("hivemind").__version__), None
    except Exception as e:
        return None, f"hivemind is not importable: {type(e).__name__}: {e}"


def _versions() -> dict[str, str]:
    """Versions of the packages that matter for the comparison."""
    out = {"python": platform.python_version()}
    for name, mod in (
        ("torch", "torch"),
        ("grpcio", "grpc"),
        ("protobuf", "google.protobuf"),
        ("numpy", "numpy"),
    ):
        with contextlib.suppress(Exception):
            out[name] = str(importlib.import_module(mod).__version__)
    return out


def _kill_tree(proc: Any) -> None:
    """Kill a peer process and everything it started (it leads its own process group)."""
    if proc.pid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.join(5)


def _summarize(case: Case, per_peer: dict[int, dict[str, Any]], repeats: int) -> dict[str, Any]:
    """Per-peer medians, max over peers, plus raw samples."""
    row: dict[str, Any] = {
        "case": case.name,
        "tensors": len(case.shapes),
        "numel": case.numel,
        "bytes": case.nbytes,
        "repeats": repeats,
    }
    for key in (*MODES, "matchmaking"):
        series = {
            r: p["samples"][key] if key in MODES else p["matchmaking"] for r, p in per_peer.items()
        }
        medians = {r: statistics.median(s) for r, s in series.items()}
        row[f"{key}_s"] = max(medians.values())
        row[f"{key}_median_per_peer_s"] = [medians[r] for r in sorted(medians)]
        row[f"{key}_samples_s"] = [series[r] for r in sorted(series)]
    row["max_abs_err"] = max(p["max_abs_err"] for p in per_peer.values())
    # both peers record a round they started over (one of them with the other's failure)
    row["failed_rounds"] = max(len(p["failures"]) for p in per_peer.values())
    row["failures"] = {r: p["failures"] for r, p in sorted(per_peer.items())}
    row["correct"] = row["max_abs_err"] <= TOLERANCE
    return row


def run(
    sizes_bytes: list[int],
    resnet18: bool,
    repeats: int,
    *,
    matchmaking_time: float = 2.0,
    torch_threads: int = 1,
    timeout: float = 1800.0,
    progress: bool = True,
) -> dict[str, Any]:
    """Benchmark hivemind averaging between two local peers.

    Returns ``{"skipped": reason}`` if hivemind is not importable. Otherwise a dict whose
    ``results`` list has one row per case with ``step_s`` (median wall time of a blocking
    ``averager.step()``, matchmaking included), ``allreduce_s`` (median all-reduce time after the
    group was formed) and ``matchmaking_s`` (median time until the group was formed); each is the
    maximum over the two peers of that peer's median. Raises ``RuntimeError`` if a peer fails or a
    result is wrong, ``TimeoutError`` after ``timeout`` seconds.
    """
    version, reason = hivemind_version()
    if version is None:
        return {"skipped": reason}
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    cases = make_cases(sizes_bytes, resnet18)
    cfg = Config(repeats=repeats, matchmaking_time=matchmaking_time, torch_threads=torch_threads)

    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(WORLD)
    flags = ctx.Array("b", WORLD)  # each peer's verdict on the round both just tried
    addr_q, out_q = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, cases, cfg, barrier, flags, addr_q, out_q),
                    daemon=False)
        for r in range(WORLD)
    ]
    per_case: dict[str, dict[int, dict[str, Any]]] = {c.name: {} for c in cases}
    started = time.time()
    prog_cm: Any = contextlib.nullcontext()
    if progress:
        from rich.progress import Progress

        prog_cm = Progress(transient=False)
    try:
        with prog_cm as prog:
            tasks = {}
            if prog is not None:
                for c in cases:
                    tasks[c.name] = prog.add_task(
                        f"{c.name} ({c.nbytes / 2**20:.2f} MiB)", total=len(MODES) * (repeats + 1)
                    )
            for p in procs:
                p.start()
            done = 0
            deadline = time.monotonic() + timeout
            while done < WORLD:
                try:
                    msg = out_q.get(timeout=1.0)
                except queue.Empty:
                    msg = ("idle",)
                if msg[0] == "idle":
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"hivemind benchmark did not finish in {timeout:.0f} s")
                    dead = [p for p in procs if p.exitcode not in (None, 0)]
                    if dead:
                        raise RuntimeError(f"peer process died with exit code {dead[0].exitcode}")
                    continue
                if msg[0] == "tick" and prog is not None:
                    prog.advance(tasks[msg[1]])
                elif msg[0] == "case":
                    per_case[msg[2]][msg[1]] = msg[3]
                elif msg[0] == "done":
                    done += 1
                elif msg[0] == "error":
                    raise RuntimeError(f"peer {msg[1]} failed:\n{msg[2]}")
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            _kill_tree(p)  # no-op for a peer that exited cleanly with its children

    results = [_summarize(c, per_case[c.name], repeats) for c in cases]
    return {
        "tool": "hivemind.averaging.DecentralizedAverager",
        "hivemind": version,
        "versions": _versions(),
        "peers": WORLD,
        "cpu_count": os.cpu_count(),
        "settings": {
            "target_group_size": WORLD,
            "min_matchmaking_time_s": matchmaking_time,
            "request_timeout_s": matchmaking_time / 2,
            "torch_threads_per_peer": torch_threads,
            "warmup_repeats_excluded": 1,
            "step_timeout_s": cfg.step_timeout,
            "allreduce_timeout_s": cfg.step_timeout,
            "failed_rounds_retried_per_case": cfg.retries,
            "statistic": "max over peers of per-peer median",
            "step_s": "blocking averager.step(), matchmaking included",
            "allreduce_s": "allow_allreduce() to result(), group already formed",
            "matchmaking_s": "step(wait=False, require_trigger=True) until AWAITING_TRIGGER",
        },
        "wall_time_s": round(time.time() - started, 1),
        "results": results,
    }


def parse_size(text: str) -> int:
    """``4096``, ``4k``/``4KiB``, ``1m``/``1MiB``, ``1g`` (binary units) to bytes."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = {"k": 2**10, "m": 2**20, "g": 2**30}.get(t[-1:], 1)
    return int(t[:-1] if mult > 1 else t) * mult


def _print_table(report: dict[str, Any]) -> None:
    """Console table of the medians (rich)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"hivemind {report['hivemind']} DecentralizedAverager, 2 peers, loopback")
    for col in ("case", "tensors", "MiB", "step() ms", "all-reduce ms", "matchmaking ms", "ok"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for r in report["results"]:
        table.add_row(
            r["case"],
            str(r["tensors"]),
            f"{r['bytes'] / 2**20:.3f}",
            f"{r['step_s'] * 1e3:.1f}",
            f"{r['allreduce_s'] * 1e3:.1f}",
            f"{r['matchmaking_s'] * 1e3:.1f}",
            "yes" if r["correct"] else "NO",
        )
    Console(width=None if sys.stdout.isatty() else 120).print(table)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; returns the exit code."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument(
        "--sizes",
        default="4096,1048576,67108864",
        help="comma-separated tensor sizes in bytes (k/m/g suffixes allowed)",
    )
    ap.add_argument("--resnet18", action="store_true", help="also average ResNet-18's parameters")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per case and mode")
    ap.add_argument(
        "--matchmaking-time",
        type=float,
        default=2.0,
        help="min_matchmaking_time in seconds (request_timeout is half of it)",
    )
    ap.add_argument("--torch-threads", type=int, default=1, help="torch threads per peer")
    ap.add_argument("--timeout", type=float, default=1800.0, help="give up after this many s")
    ap.add_argument("--json", type=Path, help="write the report here")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    try:
        report = run(
            sizes,
            args.resnet18,
            args.repeats,
            matchmaking_time=args.matchmaking_time,
            torch_threads=args.torch_threads,
            timeout=args.timeout,
            progress=not args.no_progress,
        )
    except (RuntimeError, TimeoutError) as e:
        print(f"hivemind benchmark failed: {e}", file=sys.stderr)
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"error": str(e)}, indent=2) + "\n")
        return 1
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if "skipped" in report:
        print(f"skipped: {report['skipped']}")
        return 0
    _print_table(report)
    return 0 if all(r["correct"] for r in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
