"""DDP over torch.distributed's ``decent`` backend vs the same DDP over gloo, in one run.

Two settings (issue 43's figures), each reported as ratios of the two systems' step times::

    decentrun -np 2 --nodes 2 -- python benchmarks/ddp_vs_gloo.py \
        --json benchmarks/results/ddp_loopback.json              # 2 daemons on loopback
    sudo .venv/bin/python benchmarks/ddp_vs_gloo.py --netns 8 --rate 1gbit \
        --json benchmarks/results/ddp_netns.json                 # 8 namespaces, 1 Gbit/s links

Every rank holds three copies of one ResNet-18 (11.2 M parameters: 45 MB of float32 gradients
per step, CIFAR's 3x3 stem), trained on its own batch of ``--batch`` 16x16 images (small
images: the gradients are ResNet-18's, the compute is small enough that the 2 cores of this
host shared by 8 ranks do not hide the links):

* ``gloo``: ``DistributedDataParallel`` over a gloo group;
* ``decent``: the same over the default ``decent`` group (the daemons' allreduce);
* ``decentralized``: the same DDP model put on D-SGD over the one-peer exponential graph with
  ``decent.torch.ddp.decentralize`` (its default, combine-then-adapt: one neighbor averaging of
  the parameters per step, run while forward and backward compute the gradient).

The systems' steps are interleaved (the order rotates every step), each after a gloo barrier,
so all three meet the same host; a step's time is the slowest rank's. Then the latencies of
two small collectives, decent's default group vs gloo, interleaved in blocks: a 4 KiB
``all_reduce`` (1024 float32) and the broadcast of the model's buffers from rank 0 that DDP
runs before every forward (``broadcast_buffers``: one broadcast per dtype, BatchNorm's running
statistics and counters).
Rank 0 prints a table and writes the JSON (and ``--png``, a bar chart of the medians).

Where a step's time goes: every timed step is cut in four phases (each one's mean over the
ranks, median over the steps): before forward (DDP's buffer broadcast), forward, backward (to
the last gradient computed) and after backward (the reductions still running, then the
optimizer's step). Then ``--profile-steps`` more steps of each system, one system at a time,
while rank 0 reads from ``/proc`` the CPU that this host's processes spent on them: the ranks'
own threads, gloo's threads in the ranks, and the daemons (all ranks and daemons of the run
share this host).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/ddp_vs_gloo.py` puts only benchmarks/ on it
    sys.path.insert(0, str(REPO))

from benchmarks.netns_dsgd import (  # noqa: E402
    NODE_IF,
    Network,
    Runner,
    begin_run,
    skip_reason,
    tear_down,
)
from decentd.security.auth import write_secret  # noqa: E402

SYSTEMS = ("gloo", "decent", "decentralized")
#: the phases a step is cut in (see the module's docstring)
PHASES = ("before forward", "forward", "backward", "after backward")
#: who spends a step's CPU: the ranks' own threads, gloo's threads in the ranks, the daemons
CPU_KINDS = ("ranks", "gloo threads", "daemons")
#: clock ticks per second of /proc's CPU times
TICKS = os.sysconf("SC_CLK_TCK")
#: issue 43's targets: decent / gloo step time on loopback and on the namespaces, and gloo /
#: decentralized on the namespaces
TARGETS = {"loopback_ratio": 1.1, "netns_ratio": 1.0, "decentralized_speedup": 1.6}
DECENT_PORT, TORCH_PORT = 7700, 29500


# ------------------------------------------------------------------------------ the model


def resnet18(classes: int = 10) -> Any:
    """ResNet-18 (two BasicBlocks per stage, 64-512 channels) with CIFAR's 3x3 stem."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                nn.ReLU(), nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
            self.skip = nn.Sequential() if stride == 1 and cin == cout else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x: Any) -> Any:
            return nn.functional.relu(self.body(x) + self.skip(x))

    layers: list[nn.Module] = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64),
                               nn.ReLU()]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


# ------------------------------------------------------------------------------ one rank


def measure(a: argparse.Namespace) -> dict[str, Any] | None:
    """This rank's part: the three systems' steps and the 4 KiB latencies; rank 0's summary
    (None on the others)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import decent.torch  # noqa: F401  (registers the backend)
    from decent.torch.ddp import decentralize

    torch.set_num_threads(1)
    dist.init_process_group("decent")
    rank, size = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    steppers: dict[str, Callable[[], list[float]]] = {}
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(a.batch, 3, 16, 16, generator=gen)
    y = torch.randint(0, 10, (a.batch,), generator=gen)
    for name in SYSTEMS:
        torch.manual_seed(0)
        model = DDP(resnet18(), process_group=gloo if name == "gloo" else None)
        sgd = torch.optim.SGD(model.parameters(), lr=0.01)
        opt: Any = sgd if name != "decentralized" else decentralize(
            model, sgd, topology="one-peer-exponential")
        steppers[name] = _stepper(model, opt, x, y)
    times: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    phases: dict[str, list[list[float]]] = {name: [] for name in SYSTEMS}
    for k in range(a.warmup + a.steps):
        for j in range(len(SYSTEMS)):
            name = SYSTEMS[(k + j) % len(SYSTEMS)]
            dist.barrier(group=gloo)
            stamps = steppers[name]()
            if k >= a.warmup:
                times[name].append(stamps[-1] - stamps[0])
                phases[name].append(step_phases(stamps))
    cpu = {name: _step_cpu(dist, gloo, rank, steppers[name], a.profile_steps)
           for name in SYSTEMS}
    latency = _latencies(dist, gloo, a.latency_calls, small_ops(torch, dist, resnet18()))
    slowest = {name: _over_ranks(dist, torch, gloo, times[name]) for name in SYSTEMS}
    mean_phases = {name: [_over_ranks(dist, torch, gloo, [p[i] for p in phases[name]], mean=True)
                          for i in range(len(PHASES))] for name in SYSTEMS}
    slow_latency = {op: {name: _over_ranks(dist, torch, gloo, v) for name, v in by.items()}
                    for op, by in latency.items()}
    dist.destroy_process_group()
    if rank != 0:
        return None
    median = {name: statistics.median(v) for name, v in slowest.items()}
    lat = {op: {name: statistics.median(v) for name, v in by.items()}
           for op, by in slow_latency.items()}
    return {
        "phases_ms": {name: {phase: 1e3 * statistics.median(v)
                             for phase, v in zip(PHASES, mean_phases[name], strict=True)}
                      for name in SYSTEMS},
        "cpu_ms_per_step": cpu,
        "profile_steps": a.profile_steps,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "ranks": size, "batch": a.batch, "steps": a.steps, "warmup": a.warmup,
        "step_median_s": median, "steps_s": slowest,
        "decent_over_gloo": median["decent"] / median["gloo"],
        "decentralized_speedup": median["gloo"] / median["decentralized"],
        **{f"{op}_median_us": {k: v * 1e6 for k, v in by.items()} for op, by in lat.items()},
        **{f"{op}_decent_over_gloo": by["decent"] / by["gloo"] for op, by in lat.items()},
        "cpus": os.cpu_count(),
    }


def _stepper(model: Any, opt: Any, x: Any, y: Any) -> Callable[[], list[float]]:
    """One training step that returns its times: begun, the module's forward begun, the loss
    computed, the last gradient computed (the first layer's), ended."""
    import torch

    stamps: list[float] = []
    model.module.register_forward_pre_hook(lambda *_: stamps.append(time.perf_counter()))
    first = next(model.parameters())  # its gradient is the last that backward computes
    first.register_post_accumulate_grad_hook(lambda _: stamps.append(time.perf_counter()))

    def step() -> list[float]:
        stamps.clear()
        stamps.append(time.perf_counter())
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        stamps.append(time.perf_counter())
        loss.backward()
        opt.step()
        stamps.append(time.perf_counter())
        return list(stamps)
    return step


def step_phases(stamps: list[float]) -> list[float]:
    """The durations of :data:`PHASES` from a step's times (:func:`_stepper`)."""
    begun, forward, loss, last_grad, ended = stamps
    return [forward - begun, loss - forward, last_grad - loss, ended - last_grad]


def _step_cpu(dist: Any, gloo: Any, rank: int, step: Callable[[], list[float]],
              steps: int) -> dict[str, list[float]]:
    """Per step of ``steps`` untimed ones: the milliseconds of user and system CPU that each
    of :data:`CPU_KINDS` spent on this host (read by rank 0; empty on the others)."""
    before = cpu_ticks() if rank == 0 else {}
    for _ in range(steps):
        dist.barrier(group=gloo)
        step()
    dist.barrier(group=gloo)
    if rank != 0 or steps == 0:
        return {}
    after = cpu_ticks()
    return {kind: [1e3 * (after[kind][i] - before[kind][i]) / TICKS / steps for i in (0, 1)]
            for kind in CPU_KINDS}


def cpu_ticks(proc: Path = Path("/proc")) -> dict[str, tuple[int, int]]:
    """User and system clock ticks so far of this host's daemons and benchmark ranks, by
    :data:`CPU_KINDS` (threads of gloo by their names)."""
    ticks = {kind: [0, 0] for kind in CPU_KINDS}
    for pid in (p for p in proc.iterdir() if p.name.isdigit()):
        try:
            argv = (pid / "cmdline").read_bytes().split(b"\0")
            kind = process_kind(argv)
            if kind is None:
                continue
            for task in (pid / "task").iterdir():
                name, user, system = thread_ticks((task / "stat").read_text())
                k = "gloo threads" if kind == "ranks" and "gloo" in name else kind
                ticks[k][0] += user
                ticks[k][1] += system
        except (FileNotFoundError, ProcessLookupError):  # it ended meanwhile
            continue
    return {kind: (u, s) for kind, (u, s) in ticks.items()}


def process_kind(argv: list[bytes]) -> str | None:
    """"daemons", "ranks" (a rank of this benchmark) or None, from a process's command line."""
    words = [os.path.basename(w) for w in argv]
    if b"decentd" in words:  # .../bin/decentd, or python -m decentd
        return "daemons"
    if b"ddp_vs_gloo.py" in words and not {b"decentrun", b"--netns"} & set(words):
        return "ranks"  # not the launcher, not the namespaces' driver
    return None


def thread_ticks(stat: str) -> tuple[str, int, int]:
    """(name, user ticks, system ticks) from a ``/proc/PID/task/TID/stat`` line."""
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2:].split()
    return name, int(fields[11]), int(fields[12])


#: the small collectives timed after the steps, as the table names them
SMALL_OPS = {"allreduce_4kib": "4 KiB all_reduce", "broadcast_buffers": "DDP's buffer broadcast"}


def small_ops(torch: Any, dist: Any, module: Any) -> dict[str, Callable[[Any], None]]:
    """:data:`SMALL_OPS` as calls on a group: a 4 KiB all_reduce, and the broadcast from rank
    0 of ``module``'s buffers, one flat tensor per dtype (as DDP's ``broadcast_buffers`` sends
    them before each forward)."""
    t = torch.ones(1024)
    by_dtype: dict[Any, list[Any]] = {}
    for b in module.buffers():
        by_dtype.setdefault(b.dtype, []).append(b.detach().reshape(-1))
    flats = [torch.cat(bs) for bs in by_dtype.values()]

    def broadcast(group: Any) -> None:
        for flat in flats:
            dist.broadcast(flat, 0, group=group)
    return {"allreduce_4kib": lambda group: dist.all_reduce(t, group=group),
            "broadcast_buffers": broadcast}


def _latencies(dist: Any, gloo: Any, calls: int, ops: dict[str, Callable[[Any], None]]
               ) -> dict[str, dict[str, list[float]]]:
    """Per-call times of each of ``ops``, decent and gloo in alternating blocks of 20."""
    got: dict[str, dict[str, list[float]]] = {op: {"gloo": [], "decent": []} for op in ops}
    for op, call in ops.items():
        for block in range(2 * (calls // 20)):
            name, group = ("gloo", gloo) if block % 2 == 0 else ("decent", None)
            dist.barrier(group=gloo)
            for _ in range(20):
                began = time.perf_counter()
                call(group)
                got[op][name].append(time.perf_counter() - began)
    return got


def _over_ranks(dist: Any, torch: Any, gloo: Any, mine: list[float],
                mean: bool = False) -> list[float]:
    """Each call's time on the slowest rank (an all_reduce MAX over gloo), or its mean over
    the ranks (``mean``)."""
    t = torch.tensor(mine, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if mean else dist.ReduceOp.MAX, group=gloo)
    ranks = dist.get_world_size() if mean else 1
    return [float(v) / ranks for v in t]


# ------------------------------------------------------------------------------ namespaces


def run_netns(a: argparse.Namespace) -> dict[str, Any]:
    """``--netns`` namespaces on ``--rate`` links (benchmarks/netns_dsgd.py's network), a
    daemon and a rank in each; rank 0's result."""
    reason = skip_reason()
    if reason:
        return {"skipped": reason}
    prefix = f"dcnt{os.getpid()}"
    run_dir, cleanup = begin_run(prefix)
    ok = False
    try:
        net = Network(prefix, a.netns, a.rate, cleanup)
        net.up()
        runner = Runner(net, run_dir, cleanup)
        daemons = _daemons(runner, run_dir)
        out = run_dir / "result.json"
        argv = [sys.executable, str(Path(__file__).resolve()), "--rank-of-netns",
                "--batch", str(a.batch), "--steps", str(a.steps), "--warmup", str(a.warmup),
                "--profile-steps", str(a.profile_steps),
                "--latency-calls", str(a.latency_calls), "--json", str(out)]
        ranks = {f"rank-{i}": runner.spawn(i, f"rank-{i}", argv, {
            "DECENT_DAEMON": str(run_dir / f"decentd-{i}.sock"), "RANK": str(i),
            "WORLD_SIZE": str(a.netns), "LOCAL_RANK": "0", "MASTER_ADDR": net.ip(0),
            "MASTER_PORT": str(TORCH_PORT), "GLOO_SOCKET_IFNAME": NODE_IF})
            for i in range(a.netns)}
        runner.wait_all(ranks, timeout=1800, watch=daemons)
        result: dict[str, Any] = json.loads(out.read_text())
        result["rate"] = a.rate
        ok = True
        return result
    finally:
        tear_down(cleanup, run_dir, ok)


def _daemons(runner: Runner, run_dir: Path) -> dict[str, Any]:
    """One decentd per namespace (secret mode, 256 MiB arenas), once their sockets exist."""
    secret = write_secret(run_dir / "secret")
    return runner.start_daemons(DECENT_PORT, "ddp-bench", (
        "memory: {arena_bytes: 268435456}\nlog_level: warning\n"
        f"security: {{mode: secret, secret_file: {secret}}}\n"))


# ------------------------------------------------------------------------------ output


def report(result: dict[str, Any], where: str) -> None:
    """A table of the medians and ratios."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"DDP of ResNet-18 over {where}: {result['ranks']} ranks, median step "
                        f"of the slowest rank over {result['steps']} steps")
    for col in ("system", "step (s)", "vs gloo"):
        table.add_column(col)
    gloo = result["step_median_s"]["gloo"]
    for name in SYSTEMS:
        step = result["step_median_s"][name]
        table.add_row(name, f"{step:.3f}", f"{step / gloo:.2f}x")
    for op, label in SMALL_OPS.items():
        if f"{op}_median_us" in result:  # results from before the buffer broadcast lack it
            lat = result[f"{op}_median_us"]
            table.add_row(label, f"gloo {lat['gloo']:.0f} us, decent {lat['decent']:.0f} us",
                          f"{result[f'{op}_decent_over_gloo']:.2f}x")
    Console().print(table)
    Console().print(breakdown_table(result))


def breakdown_table(result: dict[str, Any]) -> Any:
    """Where a step goes: each system's phases and the CPU its steps took on this host."""
    from rich.table import Table

    table = Table(title="where a step goes: phases (mean over the ranks, median over the steps, "
                        "ms) and CPU per step "
                        f"over {result['profile_steps']} more steps (ms user + system, "
                        "all ranks and daemons)")
    for col in ("system", *PHASES, *CPU_KINDS):
        table.add_column(col)
    for name in SYSTEMS:
        phases = result["phases_ms"][name]
        cpu = result["cpu_ms_per_step"][name]
        table.add_row(name, *(f"{phases[p]:.0f}" for p in PHASES),
                      *(f"{cpu[k][0]:.0f} + {cpu[k][1]:.0f}" if cpu else "-" for k in CPU_KINDS))
    return table


def draw(result: dict[str, Any], png: Path, where: str) -> None:
    """Bar chart of the three systems' median steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    values = [result["step_median_s"][name] for name in SYSTEMS]
    ax.bar(SYSTEMS, values, color=["#888888", "#1f77b4", "#2ca02c"])
    ax.set_ylabel("median step (s), slowest rank")
    ax.set_title(f"DDP ResNet-18, {result['ranks']} ranks, {where}")
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.3f}s", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--netns", type=int, default=0, help="namespaces (0: ranks of decentrun)")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=5,
                   help="steps of each system whose CPU is read from /proc (0: none)")
    p.add_argument("--latency-calls", type=int, default=200)
    p.add_argument("--json", type=Path)
    p.add_argument("--png", type=Path)
    p.add_argument("--rank-of-netns", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run one setting; rank 0 (or the namespace driver) reports."""
    a = parse(argv)
    where = f"{a.netns} namespaces at {a.rate}" if a.netns else "loopback"
    result = run_netns(a) if a.netns else measure(a)
    if result is None:  # a rank other than 0
        return 0
    if "skipped" in result:
        print(result["skipped"])
        return 3
    if a.rank_of_netns:  # the driver reports
        assert a.json is not None
        a.json.write_text(json.dumps(result))
        return 0
    result["setting"] = where
    report(result, where)
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    if a.png:
        draw(result, a.png, where)
    return 0


if __name__ == "__main__":
    sys.exit(main())
