"""One ``DecentralizedOptimizer`` step with the parameters flattened into shared memory or not.

    .venv/bin/decentrun -np 2 --nodes 2 -- .venv/bin/python benchmarks/optimizer_step.py \\
        [--mbytes 25] [--params 16] [--steps 30] [--json benchmarks/results/optimizer_step.json]

Every rank wraps ``torch.optim.SGD`` (lr 0.1) around a model of ``--params`` float32 parameters
adding up to ``--mbytes`` MB, with ``algorithm="dsgd"`` on the daemons' topology, and times
``opt.step()`` after a barrier, ``--steps`` times per round. The gradients are zero, so each
step leaves every rank's values at the average its step's weights give, which is checked.
Rounds alternate ``flatten=True`` (the parameters in one shared buffer, averaged in place by the
daemon), ``flatten=False`` (the general path: the optimizer's step writes ``x - d`` into the
parameters, whose storages it put in shared memory, and the combine writes into them in place),
gradient tracking on the general path (``x`` and ``d`` in arena buffers kept across steps; two
exchanges per step), gradient tracking on one parameter of the same bytes (the flattened
layout of the same math, which the general path is compared with) and the Keras wrapper's D-SGD
and gradient-tracking steps on Keras variables of the same sizes (``decent.tf``, a TensorFlow
client in a job of its own on the same daemon, the step compiled), two rounds each. Rank 0
prints the medians (wall time and the worker's own CPU time per step) and writes them as JSON and
a bar chart next to it.
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
if str(REPO) not in sys.path:  # `python benchmarks/optimizer_step.py` puts only benchmarks/ on it
    sys.path.insert(0, str(REPO))

from benchmarks.netns_dsgd import (  # noqa: E402
    OPT_LR,
    decent_source,
    dsgd_optimizer,
    numel,
    piece_sizes,
)

RESULTS = REPO / "benchmarks" / "results"
WARMUP = 3
#: the rounds' keys and labels
PATHS = {"flat": "dsgd, flattened (shared buffer, in place)",
         "general": "dsgd, general (flatten=False)",
         "gt": "gradient tracking, general (two exchanges per step)",
         "gt1": "gradient tracking, the same bytes in one parameter (its flattened layout)",
         "keras": "dsgd, Keras (decent.tf, compiled step)",
         "keras_gt": "gradient tracking, Keras (decent.tf, compiled step, host buffers)"}
#: what each path's step is compared with: the same algorithm laid out flat
BASELINE = {"flat": "flat", "general": "flat", "gt": "gt1", "gt1": "gt1", "keras": "flat",
            "keras_gt": "gt1"}
#: the algorithm of each round
ALGORITHM = {"gt": "gradient-tracking", "gt1": "gradient-tracking",
             "keras_gt": "gradient-tracking"}


def timed_steps(client: Any, algorithm: Any, tag: str, steps: int,
                reset: Callable[[float], None], step: Callable[[], None],
                holds: Callable[[float], bool], after: Callable[[], None] | None = None,
                ) -> tuple[list[float], list[float], bool, list[float]]:
    """Wall and worker-CPU seconds of ``steps`` timed calls of ``step`` (after :data:`WARMUP`
    more), each after a barrier with every parameter at the rank (``reset``); whether ``holds``
    the value the step's weights give after each; the wall seconds of ``after`` (run after each
    step, if given)."""
    rank = client.rank
    walls: list[float] = []
    cpus: list[float] = []
    afters: list[float] = []
    exact = True
    for k in range(WARMUP + steps):
        reset(float(rank))
        st = algorithm.topology.step(rank, algorithm.exchanges)
        want = st.self_weight * rank + sum(w * j for j, w in st.src_weights.items())
        client.barrier(name=f"{tag}.b")
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        t1, c1 = time.perf_counter(), time.process_time()
        if after is not None:
            after()
        if k >= WARMUP:
            walls.append(t1 - t0)
            cpus.append(c1 - c0)
            afters.append(time.perf_counter() - t1)
        exact &= holds(want)
    return walls, cpus, exact, afters


def one_round(client: Any, flatten: bool, sizes: list[int], steps: int,
              tag: str, algorithm: str = "dsgd") -> tuple[list[float], list[float], bool]:
    """Wall and worker-CPU seconds of ``steps`` timed steps; whether every result was exact."""
    import torch

    opt, params = dsgd_optimizer(client, sizes, tag, flatten, algorithm)
    if opt.flattened != flatten:
        raise SystemExit(f"flatten={flatten} but the optimizer says flattened={opt.flattened}")

    def reset(value: float) -> None:
        for p in params:
            p.data.fill_(value)

    def holds(want: float) -> bool:
        return all(torch.allclose(p, torch.full_like(p, want), rtol=1e-6, atol=0)
                   for p in params)

    walls, cpus, exact, _ = timed_steps(client, opt.algorithm, tag, steps, reset, opt.step,
                                        holds)
    opt.close()
    return walls, cpus, exact


def keras_round(client: Any, sizes: list[int], steps: int, tag: str, algorithm: str = "dsgd",
                ) -> tuple[list[float], list[float], bool, list[float]]:
    """:func:`one_round` for ``decent.tf.DecentralizedOptimizer(keras SGD, algorithm)`` on Keras
    variables of ``sizes`` elements, its step compiled (as ``model.fit`` runs it); then the
    wall seconds of the plain Keras SGD step on the same variables, timed after each."""
    import keras
    import numpy as np
    import tensorflow as tf

    import decent.tf as dtf

    variables = [keras.Variable(np.zeros(n, np.float32)) for n in sizes]
    opt = dtf.DecentralizedOptimizer(keras.optimizers.SGD(OPT_LR), algorithm=algorithm,
                                     client=client, prefix=tag)
    plain = keras.optimizers.SGD(OPT_LR)
    grads = [tf.zeros(n) for n in sizes]
    step = tf.function(lambda: opt.apply_gradients(zip(grads, variables, strict=True)))
    # zero gradients: the plain step leaves the values
    plain_step = tf.function(lambda: plain.apply_gradients(zip(grads, variables, strict=True)))

    def reset(value: float) -> None:
        for v in variables:
            v.assign(tf.fill(v.shape, value))

    def holds(want: float) -> bool:
        return all(np.allclose(v.numpy(), want, rtol=1e-6, atol=0) for v in variables)

    timings = timed_steps(client, opt.algorithm, tag, steps, reset, step, holds, plain_step)
    opt.close()
    return timings


def main(argv: list[str] | None = None) -> int:
    """Run the rounds; rank 0 reports."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mbytes", type=float, default=25.0, help="model size in MB (10^6 bytes)")
    ap.add_argument("--params", type=int, default=16, help="number of parameters")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per round")
    ap.add_argument("--json", type=Path, default=RESULTS / "optimizer_step.json")
    a = ap.parse_args(argv)
    import torch

    import decent.torch as dt

    torch.set_num_threads(1)
    import decent.tf as dtf

    client = dt.connect()
    # the Keras rounds' worker: a TensorFlow client in a job of its own on the same daemon
    tf_client = dtf.connect(job=os.environ.get("DECENT_JOB", "bench") + ".tf")
    sizes = piece_sizes(numel(a.mbytes), a.params)
    runs: dict[str, dict[str, list[float]]] = {key: {"wall": [], "cpu": []} for key in PATHS}
    keras_sgd: list[float] = []
    exact = True
    order = ("flat", "general", "gt", "gt1", "keras", "keras_gt",
             "keras_gt", "keras", "gt1", "gt", "general", "flat")
    for i, key in enumerate(order):
        algorithm = ALGORITHM.get(key, "dsgd")
        if key.startswith("keras"):
            walls, cpus, ok, plains = keras_round(tf_client, sizes, a.steps, f"optstep{i}",
                                                  algorithm)
            keras_sgd += plains
        else:
            walls, cpus, ok = one_round(client, key == "flat",
                                        [sum(sizes)] if key == "gt1" else sizes, a.steps,
                                        f"optstep{i}", algorithm)
        runs[key]["wall"] += walls
        runs[key]["cpu"] += cpus
        exact &= ok
    tf_client.close()
    client.close()
    if client.rank != 0:
        return 0 if exact else 1
    res: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "decent_source": decent_source(),
        "ranks": client.size, "mbytes": a.mbytes, "params": a.params, "steps": a.steps,
        "exact": exact,
        **{key: {"wall_ms": statistics.median(r["wall"]) * 1e3,
                 "cpu_ms": statistics.median(r["cpu"]) * 1e3} for key, r in runs.items()},
        "keras_sgd_ms": statistics.median(keras_sgd) * 1e3}
    report(res, a.json)
    return 0 if exact else 1


def report(res: dict[str, Any], path: Path) -> None:
    """Table on the console, JSON and a bar chart next to each other."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"DecentralizedOptimizer(SGD).step(), {res['mbytes']:g} MB in "
                    f"{res['params']} parameters, {res['ranks']} ranks (median ms)")
    for col in ("path", "step", "/ its flattened", "/ flattened dsgd", "worker CPU"):
        t.add_column(col, justify="left" if col == "path" else "right")
    for key, label in PATHS.items():
        t.add_row(label, f"{res[key]['wall_ms']:.1f}",
                  f"{res[key]['wall_ms'] / res[BASELINE[key]]['wall_ms']:.2f}x",
                  f"{res[key]['wall_ms'] / res['flat']['wall_ms']:.2f}x",
                  f"{res[key]['cpu_ms']:.1f}")
    Console().print(t)
    print(f"the plain Keras SGD step on the same variables: {res['keras_sgd_ms']:.1f} ms")
    print(f"results exact: {res['exact']}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    fig, ax = plt.subplots(figsize=(6, 3.2))
    keys = list(PATHS)
    xs = range(len(keys))
    ax.bar([x - 0.2 for x in xs], [res[k]["wall_ms"] for k in keys], 0.4, label="step")
    ax.bar([x + 0.2 for x in xs], [res[k]["cpu_ms"] for k in keys], 0.4, label="worker CPU")
    ax.set_xticks(list(xs), ["dsgd\nflattened", "dsgd\ngeneral", "GT\ngeneral",
                             "GT one\ntensor", "dsgd\nKeras", "GT\nKeras"])
    ax.set_ylabel("ms per step (median)")
    ax.set_title(f"optimizer step, {res['mbytes']:g} MB, {res['ranks']} ranks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    sys.exit(main())
