"""A small heterogeneous least-squares problem on ``N`` ranks for exact algorithm tests: worker
i minimizes 0.5 ||A_i x - b_i||^2 with full-batch gradients, trained through real daemons and
run again as a numpy recursion."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import decent.torch as dt
from cluster import Cluster
from decent.core import Client

N, DIM, ROWS = 4, 5, 12
LR = 0.05

_rng = np.random.default_rng(7)
A = _rng.normal(size=(N, ROWS, DIM)) / np.sqrt(ROWS)
B = _rng.normal(size=(N, ROWS)) + np.arange(N)[:, None]  # heterogeneous optima
X0 = _rng.normal(size=(N, DIM))


def grads(x: np.ndarray) -> np.ndarray:
    """Every worker's full-batch gradient, row i at x[i]."""
    return np.einsum("nrd,nr->nd", A, np.einsum("nrd,nd->nr", A, x) - B)


def loss(r: int, x: torch.Tensor) -> torch.Tensor:
    """Worker ``r``'s loss at ``x`` (torch, for backward)."""
    return 0.5 * ((torch.tensor(A[r]) @ x - torch.tensor(B[r])) ** 2).sum()


def train(c: Cluster, algorithm: str, steps: int,
          make_opt: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
          rank_options: Callable[[int], dict[str, Any]] | None = None,
          **options: Any) -> np.ndarray:
    """Every rank's iterate after ``steps`` steps of ``DecentralizedOptimizer`` around SGD
    (``make_opt``: another optimizer; ``rank_options``: options that differ by rank)."""
    def run(cl: Client[torch.Tensor]) -> np.ndarray:
        x = torch.nn.Parameter(torch.tensor(X0[cl.rank]))
        inner = make_opt([x]) if make_opt else torch.optim.SGD([x], lr=LR)
        mine = rank_options(cl.rank) if rank_options else {}
        opt = dt.DecentralizedOptimizer(inner, algorithm=algorithm, client=cl,
                                        prefix=f"lsq.{algorithm}", **options, **mine)
        for _ in range(steps):
            opt.zero_grad()
            loss(cl.rank, x).backward()
            opt.step()
        return x.detach().numpy().copy()
    return np.stack(c.run(run, timeout=600))
