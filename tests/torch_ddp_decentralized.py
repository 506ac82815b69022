"""DDP's decentralized mode, for tests/torch_backend_worker.py (2 ranks, and 4 under
decentrun): a DDP model over the ``decent`` backend, put on D-SGD over the exponential graph
with ``decent.torch.ddp.decentralize``, follows numpy's recursion on per-rank least-squares
problems: by default combine-then-adapt D-SGD, ``X' = W X - lr G(X)`` (its ``W X`` runs during
forward and backward), and with ``algorithm="dsgd"`` adapt-then-combine, ``X' = W (X - lr G(X))``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from decent.torch.ddp import decentralize

STEPS, LR, DIM = 20, 0.05, 5


def problem(rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s data: ``f_r(x) = 1/2 |A_r x - b_r|^2``."""
    rng = np.random.default_rng(rank)
    return rng.normal(size=(8, DIM)), rng.normal(size=8)


def recursion(n: int, adapt_first: bool) -> np.ndarray:
    """Every rank's x after ``STEPS`` steps of D-SGD from x = 0 (rows: ranks): adapt-then-combine
    or combine-then-adapt."""
    hops = [2 ** k for k in range(int(np.log2(n)))]  # i sends to i + 2^k
    w = np.eye(n) / (len(hops) + 1)
    for i in range(n):
        for h in hops:
            w[(i + h) % n, i] = 1 / (len(hops) + 1)
    data = [problem(r) for r in range(n)]
    x = np.zeros((n, DIM))
    for _ in range(STEPS):
        grads = np.stack([a.T @ (a @ x[r] - b) for r, (a, b) in enumerate(data)])
        x = w @ (x - LR * grads) if adapt_first else w @ x - LR * grads
    return x


def decentralized_mode_follows_the_recursion() -> None:
    """This rank's parameters after ``STEPS`` decentralized DDP steps equal the recursion's,
    for the default algorithm (CTA), for ``"dsgd"`` (ATC), and with ``static_graph=True``."""
    rank, size = dist.get_rank(), dist.get_world_size()
    a, b = (torch.from_numpy(v) for v in problem(rank))
    # the default (CTA), ATC, and CTA under a static graph (DDP's reducer stays on)
    for algorithm, adapt_first, static in ((None, False, False), ("dsgd", True, False),
                                           (None, False, True)):
        net = torch.nn.Linear(DIM, 1, bias=False, dtype=torch.float64)
        torch.nn.init.zeros_(net.weight)
        model = DDP(net, static_graph=static)
        sgd = torch.optim.SGD(model.parameters(), lr=LR)
        opt = decentralize(model, sgd, topology="exponential") if algorithm is None else \
            decentralize(model, sgd, algorithm, topology="exponential")
        assert opt.flattened and model.require_backward_grad_sync == static
        for _ in range(STEPS):
            opt.zero_grad()
            (0.5 * ((model(a).squeeze(1) - b) ** 2).sum()).backward()
            opt.step()
        want = recursion(size, adapt_first)[rank]
        got = net.weight.detach().numpy().reshape(-1)
        print(f"rank {rank} {opt.algorithm.name}: x = {np.round(got, 6).tolist()}, largest "
              f"difference from the recursion {np.abs(got - want).max():.3g}", flush=True)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        if size > 2:  # (on 2 ranks the exponential graph averages exactly)
            assert not np.allclose(want, recursion(size, adapt_first).mean(axis=0))
        opt.close()
