"""The WAN benchmark's shared learning rate, chosen for the baseline: a sweep of AdamW's lr over
the gloo baseline's own arithmetic, in one process and without a network::

    .venv/bin/python benchmarks/wan_lr.py                     # charlm, 5 rates, ~4 min
    .venv/bin/python benchmarks/wan_lr.py --lrs 3e-3,1.2e-2 --steps 100

``benchmarks/wan_train.py`` gives every method the same inner AdamW, so its lr must not favour
decent's methods: it is the rate at which the baseline itself does best after the step budget.
The baseline averages the gradients of the ranks' batches, each the mean loss over a batch of the
same size, which is the gradient of the mean loss over all of them together
(:func:`baseline_step` takes one step on the ranks' batches stacked). The ranks draw their
batches exactly as in the WAN benchmark (each its own generator, seeded with the seed and its
rank) and the model starts from the same seed, so each rate's curve is the one that benchmark's
baseline would follow (up to the order of the float sums). The DiLoCo family is left out: it
runs on the same rate whatever this finds.

Writes ``--json``, ``--md`` (the table: held-out loss at the budget per rate, the best marked)
and ``--png`` (held-out loss against steps per rate).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/wan_lr.py` puts only benchmarks/ on it
    sys.path.insert(0, str(REPO))

from benchmarks.wan.workloads import WORKLOADS, Workload, load  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
#: the rates swept by default: doubling from the digits recipe's 3e-3
DEFAULT_LRS = "3e-3,6e-3,1.2e-2,2.4e-2,4.8e-2"


def rank_generators(nodes: int, seed: int) -> list[Any]:
    """Each rank's batch generator, seeded as ``benchmarks/wan/training.py`` seeds it."""
    import torch

    return [torch.Generator().manual_seed(seed * 1000 + rank) for rank in range(nodes)]


def baseline_step(data: Workload, net: Any, opt: Any, generators: list[Any], batch: int) -> None:
    """One step of the baseline: each rank draws its batch, and the optimizer steps on the
    gradient of the mean loss over all of them (the mean of the ranks' gradients)."""
    import torch

    xs, ys = zip(*(data.batch(gen, batch) for gen in generators), strict=True)
    opt.zero_grad()
    data.loss(net, torch.cat(xs), torch.cat(ys)).backward()
    opt.step()


def sweep_one(data: Workload, lr: float, a: argparse.Namespace) -> list[tuple[int, float]]:
    """The baseline at rate ``lr``: (step, held-out loss) every ``a.eval_every`` steps."""
    import torch

    torch.manual_seed(a.seed)
    net = data.model()
    opt = torch.optim.AdamW(net.parameters(), lr=lr)
    generators = rank_generators(a.nodes, a.seed)
    curve = []
    for k in range(a.steps):
        baseline_step(data, net, opt, generators, a.batch)
        if (k + 1) % a.eval_every == 0 or k + 1 == a.steps:
            curve.append((k + 1, data.held_out_loss(net)))
    return curve


def table(result: dict[str, Any]) -> str:
    """Markdown: the loss at the budget per rate, the best and the recipe's rate marked."""
    lines = [f"Baseline learning-rate sweep ({result['date']}, {result['workload']}, "
             f"{result['nodes']} ranks x batch {result['batch']}, {result['steps']} steps, "
             f"command: `{result['command']}`)", "",
             "| AdamW lr | held-out loss after the budget | |", "|--:|--:|:--|"]
    for lr, loss in result["final"].items():
        marks = [m for m, hit in (("best", lr == result["best"]),
                                  ("the recipe's", float(lr) == result["recipe_lr"])) if hit]
        lines.append(f"| {float(lr):g} | {loss:.4f} | {', '.join(marks)} |")
    return "\n".join(lines) + "\n"


def draw(result: dict[str, Any], png: Path) -> None:
    """Held-out loss against steps, one line per rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for lr, curve in result["curves"].items():
        steps, losses = zip(*curve, strict=True)
        ax.plot(steps, losses, marker=".", label=f"lr {float(lr):g}")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss (baseline)")
    ax.set_title(f"gloo baseline's arithmetic, {result['workload']}: AdamW lr")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="charlm")
    p.add_argument("--lrs", default=DEFAULT_LRS, help="comma-separated rates")
    p.add_argument("--steps", type=int, default=200, help="the budget (wan_train.py's --steps)")
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=20)
    for suffix in ("json", "md", "png"):
        p.add_argument(f"--{suffix}", type=Path, default=RESULTS / f"wan_lr.{suffix}")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Sweep, then write the results."""
    import torch
    from rich.progress import track

    a = parse(argv)
    torch.set_num_threads(1)
    data = load(a.workload, 0, a.nodes)
    lrs = [s.strip() for s in a.lrs.split(",") if s.strip()]
    curves = {lr: sweep_one(data, float(lr), a)
              for lr in track(lrs, description=f"baseline lr sweep ({a.workload})")}
    final = {lr: curve[-1][1] for lr, curve in curves.items()}
    result = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "command": " ".join(["benchmarks/wan_lr.py", *(argv or sys.argv[1:])]),
              "workload": a.workload, "nodes": a.nodes, "batch": a.batch, "steps": a.steps,
              "recipe_lr": WORKLOADS[a.workload][1].lr, "curves": curves, "final": final,
              "best": min(final, key=lambda lr: final[lr])}
    a.json.write_text(json.dumps(result, indent=1))
    a.md.write_text(table(result))
    draw(result, a.png)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
