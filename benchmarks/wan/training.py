"""One rank of ``benchmarks/wan_train.py``: every method trains the same model on the same data
from the same seed with the same inner optimizer, one method after the other, and this rank
writes what it measured to a JSON file of its own (the driver merges them; nothing crosses
processes as a pickle).

The workload (``--workload``, :mod:`benchmarks.wan.workloads`): the character-level transformer
LM of ``examples/train_charlm.py`` by default, or the digits MLP; each rank draws its own
batches of 32 and steps AdamW; every ``eval_every`` inner steps it evaluates its own model on
the held-out split (not timed).

Per method this rank records: the held-out loss at each evaluation with the training time so far
(evaluations excluded), the time spent in forward and backward (compute), the loop's wall time,
and the bytes its namespace's interface sent (``/sys/class/net/veth0/statistics/tx_bytes``:
everything on the wire, control traffic and headers included, the same for gloo and decent).
It keeps its parameters at every evaluation and writes them next to its results, so that the
driver can evaluate the ranks' averaged model (:func:`averaged_losses`): the model a
decentralized run ends with after one last average.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.wan.workloads import Workload, load

#: the methods, in the order they run: how each one steps, and its options
METHODS: dict[str, dict[str, Any]] = {
    "gloo-allreduce": {},
    "dsgd": {"algorithm": "dsgd", "topology": "one-peer-exponential"},
    "choco-int8": {"algorithm": "choco", "topology": "hypercube", "compressor": "int8",
                   "consensus_step": 0.8},
    "diloco": {"algorithm": "diloco", "mix": "allreduce"},
    "diloco-neighbor": {"algorithm": "diloco", "mix": "neighbor",
                        "topology": "one-peer-exponential"},
    "streaming-diloco-int8": {"algorithm": "diloco", "mix": "neighbor", "topology": "hypercube",
                              "compressor": "int8", "consensus_step": 0.8, "fragments": 3},
}
#: the methods that take DiLoCo's outer options (``--local-steps``, ``--outer-lr``, ...)
OUTER = ("diloco", "diloco-neighbor", "streaming-diloco-int8")


def flat_parameters(net: Any) -> Any:
    """The model's parameters as one float32 numpy vector (a copy)."""
    import torch

    return torch.nn.utils.parameters_to_vector(net.parameters()).detach().numpy().copy()


def averaged_losses(workload: str, snapshots: list[Any]) -> list[float]:
    """The held-out loss of the ranks' averaged model at each evaluation (``snapshots``: each
    rank's ``[evaluations, parameters]`` array)."""
    import numpy as np
    import torch

    data = load(workload, 0, 1)
    net = data.model()
    mean = np.mean(np.stack(snapshots), axis=0)
    out = []
    with torch.no_grad():
        for row in mean:
            torch.nn.utils.vector_to_parameters(torch.from_numpy(row), net.parameters())
            out.append(data.held_out_loss(net))
    return out


def tx_bytes() -> int:
    """Bytes this namespace's link has sent so far."""
    return int(Path("/sys/class/net/veth0/statistics/tx_bytes").read_text())


def outer_options(name: str, a: Any) -> dict[str, Any]:
    """DiLoCo's options from the command line (the streaming one's overlap too)."""
    options = {"local_steps": a.local_steps, "outer_lr": a.outer_lr,
               "outer_momentum": a.outer_momentum}
    if "streaming" in name:
        options["overlap"] = a.overlap
    return options


def timed_adamw(params: Any, lr: float) -> Any:
    """AdamW that counts the seconds its own steps take (compute, not communication)."""
    import torch

    class TimedAdamW(torch.optim.AdamW):
        """AdamW with :attr:`seconds`, the time spent in its steps."""

        seconds = 0.0

        def step(self, closure: Any = None) -> Any:
            began = time.perf_counter()
            try:
                return super().step(closure)
            finally:
                self.seconds += time.perf_counter() - began

    return TimedAdamW(params, lr=lr)


def make_step(name: str, net: Any, inner: Any, client: Any, a: Any) -> Callable[[], None]:
    """The step after backward of method ``name``: the gloo baseline averages the gradients
    (one flat allreduce, as DDP's one bucket), then steps; the others are decent's
    ``DecentralizedOptimizer`` around the same inner optimizer."""
    import torch
    import torch.distributed as dist

    import decent.torch as dt

    if name == "gloo-allreduce":
        params = list(net.parameters())

        def averaged() -> None:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
            flat /= dist.get_world_size()
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            inner.step()
        return averaged
    options = dict(METHODS[name])
    if name in OUTER:
        options.update(outer_options(name, a))
    options.update(a.options.get(name, {}))
    opt = dt.DecentralizedOptimizer(inner, net, client=client, prefix=f"wan.{name}", **options)
    return opt.step


def train(name: str, data: Workload, client: Any, a: Any) -> dict[str, Any]:
    """Method ``name`` for ``a.steps`` inner steps (the DiLoCo family: ``a.long_steps``, to see
    when it reaches the baseline's loss): what this rank measured."""
    import numpy as np
    import torch
    import torch.distributed as dist

    torch.manual_seed(a.seed)
    net = data.model()
    inner = timed_adamw(net.parameters(), a.lr)
    step = make_step(name, net, inner, client, a)
    batches = torch.Generator().manual_seed(a.seed * 1000 + client.rank)
    evals: list[list[float]] = []
    budget: dict[str, float] = {}
    snapshots: list[Any] = []  # the parameters at each evaluation (for the averaged model)
    compute = excluded = stepping = 0.0
    dist.barrier()
    sent, began, blocked = tx_bytes(), time.perf_counter(), client.blocked_seconds
    steps = a.long_steps if name in OUTER else a.steps
    for k in range(steps):
        x, y = data.batch(batches, a.batch)
        t = time.perf_counter()
        inner.zero_grad()
        data.loss(net, x, y).backward()
        compute += time.perf_counter() - t
        t = time.perf_counter()
        step()
        stepping += time.perf_counter() - t
        if (k + 1) % a.eval_every == 0:
            t = time.perf_counter()
            trained = t - began - excluded  # training time so far
            val = data.held_out_loss(net)
            snapshots.append(flat_parameters(net))
            excluded += time.perf_counter() - t
            evals.append([trained, k + 1, val])
        if k + 1 == a.steps:  # the budget every method is compared at
            budget = {"wall_s": time.perf_counter() - began - excluded,
                      "tx_bytes": tx_bytes() - sent}
    wall = time.perf_counter() - began - excluded
    sent = tx_bytes() - sent
    waiting = stepping - inner.seconds  # in the step, not in the inner optimizer: the exchanges
    compute += inner.seconds
    dist.barrier()  # nobody's next method meets this one's last exchanges
    np.save(Path(a.out).parent / f"{name}-{client.rank}.npy", np.stack(snapshots))
    if client.rank == 0:
        print(f"method {name} done: {steps} steps in {wall:.1f} s", flush=True)
    return {"evals": evals, "steps": steps, "compute_s": compute, "wall_s": wall,
            "exchange_wait_s": waiting,
            # blocked in decent's waits on exchanges not yet finished (gloo's waits: not counted)
            "blocked_s": client.blocked_seconds - blocked,
            "tx_bytes": sent, "budget": budget,
            "parameters": sum(p.numel() for p in net.parameters())}


def rank_main(a: Any) -> int:
    """This rank: gloo (baseline, barriers) and decent clients, every method in turn, the
    results written to ``a.out``."""
    import os

    import torch
    import torch.distributed as dist

    import decent.torch as dt

    torch.set_num_threads(1)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=size)
    client = dt.init()
    data = load(a.workload, rank, size)
    results = {name: train(name, data, client, a) for name in a.methods}
    Path(a.out).write_text(json.dumps({"rank": rank, "methods": results}))
    dist.destroy_process_group()
    dt.shutdown()
    return 0
