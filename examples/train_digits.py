"""Decentralized training of a small CNN on scikit-learn's digits, D-SGD vs. an allreduce baseline.

Run it on a local 4-worker cluster::

    decentrun -np 4 --topology exponential python examples/train_digits.py

Every worker loads the same 1797 8x8 digit images, makes the same stratified 80/20 train/test
split and takes its own iid shard of the training set. Two algorithms are then trained one after
the other in the same processes, from the same initial weights and with the same hyper-parameters
and minibatch order:

``dsgd``
    Decentralized SGD, adapt-then-combine: each worker takes its local step (``torch.optim.SGD``
    with ``--momentum``, default 0.9: DmSGD, the momentum buffer stays local), then averages the
    parameters with its neighbors (one ``neighbor_allreduce`` per step, fused)::

        x_{k+1} = sum_j w_ij (x_j - lr * m_j)

``allreduce``
    The centralized baseline (PmSGD): the same local step, then the global average of the
    parameters, so the models stay identical.

Both are ``dt.DecentralizedOptimizer(torch.optim.SGD(...), model, algorithm=...)``. With
``--hierarchical`` (``decentrun -np 4 --nodes 2 -- python examples/train_digits.py
--hierarchical``) D-SGD averages each node's workers in shared memory and mixes the node means
over the daemons' machine topology (allreduce is hierarchical by itself);
``--algorithms`` also takes the library's other names (``dsgd-cta``, ``gradient-tracking``, ...;
those that need a symmetric mixing matrix refuse the exponential graph and say what to use).

At the end every worker evaluates its own model on the test set; rank 0 prints each worker's
accuracy, the accuracy of the averaged model (the parameters allreduce-averaged over workers), the
consensus distance ``sum_i ||x_i - mean||^2`` and the training wall time.

With the defaults (10 epochs, constant lr 0.05, momentum 0.9, batch 32 per worker; 110 steps)
both algorithms reach 95-97% test accuracy; averaged D-SGD model vs allreduce with seeds 0, 1, 2:
96.39 vs 96.11, 96.67 vs 95.83, 95.28 vs 95.83. The whole run (``make run``) took 15-25 s with 4
workers on a 2-core machine, most of it importing torch and scikit-learn in four processes.
"""

from __future__ import annotations

import argparse
import copy
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from tqdm import tqdm

import decent.torch as dt
from decent.core.training.algorithms import ALGORITHMS as ALGORITHM_NAMES
from decent.core.training.algorithms import ALIASES

ALGORITHMS = ("dsgd", "allreduce")  # the default comparison
#: the algorithms with a hierarchical form (``--hierarchical``)
HIERARCHICAL = ("dsgd", "dmsgd", "pga", "allreduce")
TorchClient = dt.TorchClient


@dataclass
class Data:
    """The worker's training shard and the (shared) test set."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    steps_per_epoch: int


@dataclass
class Result:
    """What one algorithm produced, as seen from rank 0 after the gathers."""

    algorithm: str
    worker_acc: list[float]
    avg_model_acc: float
    consensus: float
    train_loss: float
    wall_time: float
    steps: int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The script's command line."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where the model trains: cuda puts worker r on cuda:LOCAL_RANK "
                        "(default auto: cuda where present)")
    p.add_argument("--epochs", type=int, default=10,
                   help="epochs per algorithm (default 10: 110 steps of 32 samples per worker; "
                        "about 10 s per algorithm with 4 workers on 2 cores)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    p.add_argument("--momentum", type=float, default=0.9,
                   help="SGD momentum, local to each worker (default 0.9; 0 for plain SGD)")
    p.add_argument("--schedule", choices=["constant", "cosine"], default="constant",
                   help="learning-rate schedule over all iterations (default constant; cosine "
                        "anneals to 0, which also drives the D-SGD workers to consensus)")
    p.add_argument("--batch-size", type=int, default=32,
                   help="minibatch size per worker (default 32)")
    p.add_argument("--algorithms", "--algorithm", default=",".join(ALGORITHMS),
                   help=f"comma-separated algorithm names (default {','.join(ALGORITHMS)}; "
                        "--algorithm is the same flag, as in train_charlm.py)")
    p.add_argument("--seed", type=int, default=0, help="seed for split, shards and init")
    p.add_argument("--hierarchical", action="store_true",
                   help="dsgd/pga mix node means over the daemons' machine topology (each "
                        "node's workers averaged in shared memory first; run with --nodes)")
    p.add_argument("--test-size", type=float, default=0.2,
                   help="fraction of the data held out for testing (default 0.2)")
    args = p.parse_args(argv)
    algos = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    known = {*ALGORITHM_NAMES, *ALIASES}
    unknown = [a for a in algos if a not in known]
    if unknown or not algos:
        p.error(f"--algorithms: unknown {unknown}; choose from {', '.join(sorted(known))}")
    args.algorithms = algos
    if args.epochs < 1 or args.batch_size < 1:
        p.error("--epochs and --batch-size must be >= 1")
    return args


def load_data(rank: int, size: int, batch_size: int, seed: int, test_size: float) -> Data:
    """Digits, split and sharded identically on every rank; this rank's shard of the train set.

    All ranks compute the same permutation of the training indices and rank ``r`` takes every
    ``size``-th one starting at ``r`` (an iid shard). The number of steps per epoch is derived from
    the smallest shard, so it is the same on every rank (a rank that stepped more often would wait
    forever for partners).
    """
    digits = load_digits()
    x = (digits.images.astype(np.float32) / 16.0)[:, None, :, :]  # (N, 1, 8, 8) in [0, 1]
    y = digits.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_size, stratify=y,
                                              random_state=seed)
    perm = np.random.default_rng(seed).permutation(len(x_tr))
    shards = [perm[r::size] for r in range(size)]
    min_shard = min(len(s) for s in shards)
    steps = min_shard // batch_size
    if steps == 0:
        raise SystemExit(f"--batch-size {batch_size} is larger than the smallest shard "
                         f"({min_shard} samples)")
    mine = shards[rank]
    return Data(torch.from_numpy(x_tr[mine]), torch.from_numpy(y_tr[mine]),
                torch.from_numpy(x_te), torch.from_numpy(y_te), steps)


def make_model() -> nn.Module:
    """The small CNN: two 3x3 convolutions, a 2x2 max-pool and two linear layers."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64), nn.ReLU(),
        nn.Linear(64, 10),
    )


def initial_model(client: TorchClient, seed: int) -> nn.Module:
    """The same freshly initialized model on every rank: identical seed, then rank 0's weights."""
    torch.manual_seed(seed)
    model = make_model()
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(client.broadcast(p.data, root=0, name=f"init.{i}"))
    return model


def batches(data: Data, batch_size: int, seed: int, rank: int, epoch: int
            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This epoch's minibatches of the local shard (same order for every algorithm)."""
    order = torch.from_numpy(np.random.default_rng([seed, rank, epoch])
                             .permutation(len(data.y_train)))
    out = []
    for s in range(data.steps_per_epoch):
        idx = order[s * batch_size:(s + 1) * batch_size]
        out.append((data.x_train[idx], data.y_train[idx]))
    return out


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Top-1 accuracy of ``model`` on ``(x, y)``, in percent."""
    model.eval()
    pred = model(x).argmax(dim=1)
    model.train()
    return 100.0 * (pred == y).float().mean().item()


def gather(client: TorchClient, value: float, name: str) -> list[float]:
    """Every rank's ``value``, in rank order, on every rank (allreduce-sum of one-hot slots)."""
    slot = torch.zeros(client.size, dtype=torch.float64)
    slot[client.rank] = value
    return client.allreduce(slot, op="sum", name=name).tolist()


def evaluate(client: TorchClient, algo: str, model: nn.Module, data: Data, train_loss: float,
             wall_time: float, steps: int) -> Result:
    """Per-worker and averaged-model accuracy, consensus distance; gathered on every rank."""
    own = accuracy(model, data.x_test, data.y_test)
    avg_model = copy.deepcopy(model)
    dist = torch.zeros((), dtype=torch.float64, device=data.x_test.device)
    with torch.no_grad():
        for i, (p, q) in enumerate(zip(model.parameters(), avg_model.parameters(), strict=True)):
            mean = client.allreduce(p.data, op="average", name=f"eval.{algo}.avg.{i}")
            q.copy_(mean)
            dist += (p.data.double() - mean.double()).pow(2).sum()
    consensus = float(client.allreduce(dist.reshape(1), op="sum",
                                       name=f"eval.{algo}.consensus").item())
    return Result(
        algorithm=algo,
        worker_acc=gather(client, own, f"eval.{algo}.acc"),
        avg_model_acc=accuracy(avg_model, data.x_test, data.y_test),
        consensus=consensus,
        train_loss=float(np.mean(gather(client, train_loss, f"eval.{algo}.loss"))),
        wall_time=max(gather(client, wall_time, f"eval.{algo}.time")),
        steps=steps,
    )


def train(client: TorchClient, algo: str, init: dict[str, torch.Tensor], data: Data,
          args: argparse.Namespace) -> Result:
    """Train ``algo`` from the initial weights ``init`` and evaluate it."""
    model = make_model().to(data.x_train.device)
    model.load_state_dict(init)
    model.train()
    # the wrapped optimizer's step is the local update; the algorithm turns it into the
    # decentralized one (and, given the model, starts exchanges before the forward pass)
    local = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    extra = {"hierarchical": True} if args.hierarchical and algo in HIERARCHICAL else {}
    opt = dt.DecentralizedOptimizer(local, model, algorithm=algo, client=client,
                                    prefix=f"train.{algo}", **extra)
    total = args.epochs * data.steps_per_epoch
    sched: torch.optim.lr_scheduler.LRScheduler | None = None
    if args.schedule == "cosine":
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(local, T_max=total)
    bar = tqdm(total=total, desc=f"{algo:>9}", unit="it", disable=client.rank != 0,
               mininterval=0.5, dynamic_ncols=False, ncols=90)
    client.barrier(name=f"start.{algo}")
    t0 = time.perf_counter()
    last_epoch_loss = float("nan")
    for epoch in range(args.epochs):
        losses = []
        for xb, yb in batches(data, args.batch_size, args.seed, client.rank, epoch):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if sched is not None:
                sched.step()
            bar.update(1)
        last_epoch_loss = float(np.mean(losses))
        bar.set_postfix(epoch=epoch + 1, loss=f"{last_epoch_loss:.4f}", refresh=False)
    wall = time.perf_counter() - t0
    bar.close()
    opt.close()
    return evaluate(client, algo, model, data, last_epoch_loss, wall, total)


def report(results: list[Result], args: argparse.Namespace, size: int, topology: str) -> None:
    """Rank 0's final table."""
    table = Table(title=f"digits, {size} workers, topology {topology}, {args.epochs} epochs, "
                        f"lr {args.lr} ({args.schedule}), momentum {args.momentum}, "
                        f"batch {args.batch_size}/worker")
    table.add_column("algorithm")
    table.add_column("worker accuracies (%)")
    table.add_column("mean", justify="right")
    table.add_column("averaged model", justify="right")
    table.add_column("consensus dist", justify="right")
    table.add_column("train loss", justify="right")
    table.add_column("wall time", justify="right")
    for r in results:
        table.add_row(
            r.algorithm,
            " ".join(f"{a:.2f}" for a in r.worker_acc),
            f"{np.mean(r.worker_acc):.2f}",
            f"{r.avg_model_acc:.2f}",
            f"{r.consensus:.3g}",
            f"{r.train_loss:.4f}",
            f"{r.wall_time:.1f} s ({r.steps} it)",
        )
    Console(width=140).print(table)


def main(argv: list[str] | None = None) -> int:
    """Train every requested algorithm, print the comparison on rank 0; the exit code."""
    args = parse_args(argv)
    torch.set_num_threads(1)  # the workers share a few cores
    client = dt.init()
    try:
        data = load_data(client.rank, client.size, args.batch_size, args.seed, args.test_size)
        device = client.device if args.device == "cuda" or (
            args.device == "auto" and torch.cuda.is_available()) else torch.device("cpu")
        data = Data(data.x_train.to(device), data.y_train.to(device), data.x_test.to(device),
                    data.y_test.to(device), data.steps_per_epoch)
        init = {k: v.clone() for k, v in initial_model(client, args.seed).state_dict().items()}
        if client.rank == 0:
            print(f"{client.size} workers on {device.type}, topology {client.topology.kind} "
                  f"(rank 0 receives from {list(client.topology.in_neighbors)}): "
                  f"{len(data.y_train)} train samples on rank 0, {len(data.y_test)} test, "
                  f"{data.steps_per_epoch} steps/epoch", flush=True)
        results = [train(client, algo, init, data, args) for algo in args.algorithms]
        if client.rank == 0:
            report(results, args, client.size, client.topology.kind)
        client.barrier(name="done")
    finally:
        dt.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
