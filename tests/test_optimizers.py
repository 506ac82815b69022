"""Every algorithm of ``DecentralizedOptimizer`` trains around the optimizers users wrap: SGD with
and without momentum, Adam, AdamW, RMSprop and Adagrad, on heterogeneous least squares (4 ranks
on a ring, real daemons). The stateful optimizers create their state on their first step: the
algorithm's state must not be in the way (it crashed Adam with ``KeyError: 'exp_avg'``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import decent.torch as dt
from conftest import ClusterFactory
from decent.core import Client
from decent.core.algorithms import ALGORITHMS, AlgorithmError
from decent_wire.topology import build_topology

N, DIM, ROWS, STEPS = 4, 4, 10, 60
RNG = np.random.default_rng(7)
A = RNG.normal(size=(N, ROWS, DIM)) / np.sqrt(ROWS)
B = RNG.normal(size=(N, ROWS)) + np.arange(N)[:, None]
X0 = RNG.normal(size=DIM) * 3.0
XSTAR = np.linalg.solve(np.einsum("nrd,nre->de", A, A), np.einsum("nrd,nr->d", A, B))

#: the lazy ring (1/2 self): D2 needs lambda_min(W) > -1/3, which the plain 4-ring misses
LAZY = build_topology("ring", N, weights={i: {i: 0.5, (i - 1) % N: 0.25, (i + 1) % N: 0.25}
                                          for i in range(N)})
OPTIONS: dict[str, dict[str, Any]] = {"d2": {"topology": LAZY}, "pga": {"period": 4},
                                      "wagma": {"group_size": 2, "tau": 4},
                                      "choco": {"compressor": "int8", "consensus_step": 0.8},
                                      "decentlam": {"beta": 0.5}}
OPTIMIZERS: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.1),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=1e-4),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.05),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.5),
}


def loss(x: np.ndarray) -> float:
    """The global objective at ``x``."""
    return float(0.5 * ((np.einsum("nrd,d->nr", A, x) - B) ** 2).sum())


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_trains_around_every_optimizer(cluster: ClusterFactory, algorithm: str,
                                                       optimizer: str) -> None:
    c = cluster(N, "ring")
    if algorithm == "decentlam" and optimizer == "sgd-momentum":
        with pytest.raises(AlgorithmError, match="applies its own momentum"):
            dt.DecentralizedOptimizer(OPTIMIZERS[optimizer]([torch.nn.Parameter(
                torch.zeros(DIM))]), algorithm=algorithm, client=c.clients[0])
        return

    def run(cl: Client[torch.Tensor]) -> np.ndarray:
        r = cl.rank
        x = torch.nn.Parameter(torch.tensor(X0))
        a, b = torch.tensor(A[r]), torch.tensor(B[r])
        opt = dt.DecentralizedOptimizer(OPTIMIZERS[optimizer]([x]), algorithm=algorithm,
                                        client=cl, prefix=f"opt.{algorithm}.{optimizer}",
                                        **OPTIONS.get(algorithm, {}))
        for _ in range(STEPS):
            opt.zero_grad()
            (0.5 * ((a @ x - b) ** 2).sum()).backward()
            opt.step()
        cl.barrier(name=f"opt.{algorithm}.{optimizer}.done")
        return x.detach().numpy().copy()

    xs = np.stack(c.run(run, timeout=300))
    assert np.isfinite(xs).all()
    start, best = loss(X0), loss(XSTAR)
    final = loss(xs.mean(axis=0))
    assert final - best < 0.5 * (start - best), (final, start, best)


def test_the_wrapped_optimizers_state_is_its_own(cluster: ClusterFactory) -> None:
    # the algorithm's state lives beside Adam's: Adam's state dict holds only its own entries,
    # and a checkpoint carries the algorithm's next to it
    c = cluster(N, "ring")

    def run(cl: Client[torch.Tensor]) -> tuple[set[str], set[str]]:
        x = torch.nn.Parameter(torch.tensor(X0))
        opt = dt.DecentralizedOptimizer(torch.optim.Adam([x], lr=0.1), algorithm="extra",
                                        client=cl, prefix="opt.own")
        for _ in range(3):
            opt.zero_grad()
            (x ** 2).sum().backward()
            opt.step()
        state = opt.state_dict()
        return set(opt.optimizer.state[x]), set(state["decent"]["state"][0])

    for adam, extra in c.run(run):
        assert adam == {"step", "exp_avg", "exp_avg_sq"} and extra == {"x", "wx", "d"}
