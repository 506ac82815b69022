"""Every algorithm of ``DecentralizedOptimizer`` trains around the optimizers users wrap: SGD with
and without momentum, Adam, AdamW, RMSprop and Adagrad, on heterogeneous least squares (4 ranks
on a ring, real daemons). The stateful optimizers create their state on their first step: the
algorithm's state must not be in the way (it crashed Adam with ``KeyError: 'exp_avg'``).

The asynchronous algorithms (the ones that communicate through windows) are synchronized here,
so that what a rank reads from its neighbors does not depend on timing and the runs are the same
every time: win-put with its own barriers, wagma with a barrier after each step, adpsgd one rank
at a time. Their asynchrony is tested in ``test_asynchrony.py`` and ``test_push_algorithms.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import decent.torch as dt
from conftest import ClusterFactory
from decent.core import Client
from decent.core.training.algorithms import ALGORITHMS, AlgorithmError
from decent_wire.topology import build_topology

pytestmark = pytest.mark.slow

#: 40 steps: every pair closes at least half the gap to the optimum (the runs are the same every
#: time; the closest, Adam's, leave 0.35 of it)
N, DIM, ROWS, STEPS = 4, 4, 10, 40
RNG = np.random.default_rng(7)
A = RNG.normal(size=(N, ROWS, DIM)) / np.sqrt(ROWS)
B = RNG.normal(size=(N, ROWS)) + np.arange(N)[:, None]
X0 = RNG.normal(size=DIM) * 3.0
XSTAR = np.linalg.solve(np.einsum("nrd,nre->de", A, A), np.einsum("nrd,nr->d", A, B))

#: the lazy ring (1/2 self): D2 needs lambda_min(W) > -1/3, which the plain 4-ring misses
LAZY = build_topology("ring", N, weights={i: {i: 0.5, (i - 1) % N: 0.25, (i + 1) % N: 0.25}
                                          for i in range(N)})
#: win-put's barrier: every put of a step lands before any rank combines, and every rank
#: combines before any rank puts again (x' = W x - d exactly; without it, a rank combines whatever
#: its neighbors put last, from zero to a dozen steps of theirs when the machine is loaded);
#: diloco: 8 outer steps in 40, too few for the published outer momentum (0.9) to build up
OPTIONS: dict[str, dict[str, Any]] = {"d2": {"topology": LAZY}, "pga": {"period": 4},
                                      "wagma": {"group_size": 2, "tau": 4},
                                      "choco": {"compressor": "int8", "consensus_step": 0.8},
                                      "decentlam": {"beta": 0.5}, "win-put": {"barrier": True},
                                      "diloco": {"local_steps": 5, "mix": "neighbor",
                                                 "outer_lr": 1.0, "outer_momentum": 0.5}}
#: wagma: every rank has published the model of its last step before any group round starts, so
#: a member that arrives late contributes the model it brings (the group mean is exact)
BARRIER_AFTER_EACH_STEP = {"wagma"}
#: adpsgd: one rank steps at a time, so the active ranks' exchanges and the passive ranks' adds
#: on the same model happen in rank order
ONE_RANK_AT_A_TIME = {"adpsgd"}
#: the algorithms that use windows (asynchronous): each must be synchronized above
SYNCHRONIZED = {"win-put", *BARRIER_AFTER_EACH_STEP, *ONE_RANK_AT_A_TIME}
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


def local_loss(r: int, x: torch.Tensor) -> torch.Tensor:
    """Rank ``r``'s objective at ``x`` (torch, for backward)."""
    return 0.5 * ((torch.tensor(A[r]) @ x - torch.tensor(B[r])) ** 2).sum()


def win_put(optimizer: str) -> np.ndarray:
    """Every rank's iterate after STEPS steps of x' = W x - d (the ring's weights, 1/3 each),
    ``d`` the step of each rank's own ``optimizer`` at its x: win-put with a barrier."""
    w = torch.tensor(build_topology("ring", N).matrix())
    xs = [torch.nn.Parameter(torch.tensor(X0)) for _ in range(N)]
    opts = [OPTIMIZERS[optimizer]([x]) for x in xs]
    for _ in range(STEPS):
        before = torch.stack([x.detach().clone() for x in xs])
        for r, (x, opt) in enumerate(zip(xs, opts, strict=True)):
            opt.zero_grad()
            local_loss(r, x).backward()
            opt.step()
        with torch.no_grad():
            new = w @ before - (before - torch.stack([x.detach() for x in xs]))
            for x, value in zip(xs, new, strict=True):
                x.copy_(value)
    return np.stack([x.detach().numpy().copy() for x in xs])


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

    prefix = f"opt.{algorithm}.{optimizer}"
    turns = N if algorithm in ONE_RANK_AT_A_TIME else 1

    def run(cl: Client[torch.Tensor]) -> tuple[np.ndarray, bool]:
        x = torch.nn.Parameter(torch.tensor(X0))
        opt = dt.DecentralizedOptimizer(OPTIMIZERS[optimizer]([x]), algorithm=algorithm,
                                        client=cl, prefix=prefix, **OPTIONS.get(algorithm, {}))
        for _ in range(STEPS):
            for turn in range(turns):
                if turns == 1 or turn == cl.rank:
                    opt.zero_grad()
                    local_loss(cl.rank, x).backward()
                    opt.step()
                if algorithm in BARRIER_AFTER_EACH_STEP | ONE_RANK_AT_A_TIME:
                    cl.barrier(name=f"{prefix}.step")
        cl.barrier(name=f"{prefix}.done")
        return x.detach().numpy().copy(), bool(opt.algorithm.windows)

    results = c.run(run, timeout=300)
    # an algorithm that reads windows depends on timing unless this test synchronizes it
    assert all(windows == (algorithm in SYNCHRONIZED) for _, windows in results), algorithm
    xs = np.stack([x for x, _ in results])
    assert np.isfinite(xs).all()
    if algorithm == "win-put":
        np.testing.assert_allclose(xs, win_put(optimizer), rtol=1e-9, atol=1e-12)
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


class LargeAllocations(TorchDispatchMode):
    """Records every op of this thread that makes a new tensor of ``min_numel`` elements or
    more (``made``: a result that shares no storage with the op's inputs), and every op that
    reads or writes the data of such a tensor (``ops``; views and detaches, which touch none,
    left out)."""

    VIEWS = ("aten.detach.", "aten.view.", "aten.alias.", "aten.as_strided.", "aten.slice.")

    def __init__(self, min_numel: int) -> None:
        super().__init__()
        self.min_numel = min_numel
        self.made: list[str] = []
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(t.numel() >= self.min_numel for t in leaves) and \
                not str(func).startswith(self.VIEWS):
            self.ops.append(str(func))
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in leaves}
        self.made += [str(func) for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                      and t.numel() >= self.min_numel
                      and t.untyped_storage().data_ptr() not in inputs]
        return out


@pytest.mark.parametrize("algorithm", ["dsgd", "allreduce", "pga", "dsgd-cta", "gradient-tracking",
                                       "extra", "exact-diffusion", "d2", "decentlam", "choco",
                                       "push-sum", "win-put", "adpsgd", "wagma",
                                       "gradient-allreduce"])
def test_the_general_path_allocates_no_model_sized_tensor_per_step(
        cluster: ClusterFactory, algorithm: str) -> None:
    # parameters that are not flattened (flatten=False: what tied weights, share_memory(),
    # CUDA and TensorFlow get): after the first steps, a step makes no parameter-sized tensor
    # (2 parameters of >= 2560 elements). Adapt-then-combine writes x - d where the optimizer
    # left it and combines into the parameters; x and d live in buffers kept across steps;
    # the others write their arithmetic into tensors of an earlier step that are no longer
    # needed (Algorithm.difference / spare: EXTRA the previous W x, exact diffusion and D2
    # the previous phi, DecentLaM and CHOCO their previous outputs, push-sum and AD-PSGD what
    # they sent); the window and group algorithms update the results they get in place
    c = cluster(2)

    def work(cl: Client[torch.Tensor]) -> list[str]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 10))
        momentum = 0.0 if algorithm == "decentlam" else 0.9  # it applies its own
        opt = dt.DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1,
                                                        momentum=momentum), model,
                                        algorithm=algorithm, client=cl, flatten=False,
                                        prefix=f"alloc.{algorithm}")
        made = []
        for k in range(4):
            opt.zero_grad()
            model(torch.ones(4, 256)).sum().backward()
            watch = LargeAllocations(2560)
            with watch:
                opt.step()
            if k >= 2:
                made += watch.made
        return made

    for made in c.run(work):
        assert made == [], made


def test_combine_then_adapt_on_flat_parameters_keeps_no_copy(cluster: ClusterFactory) -> None:
    # dsgd-cta on flattened parameters: W x is taken from the flat buffer itself while forward
    # and backward run (the forward pre-hook), and a step touches the model-sized buffers twice,
    # W x - x and (x - d) + (W x - x): no torch copy of x, no copy back (the general path copies x
    # into a buffer, takes d = x - (x - d), and copies W x - d back into the parameters)
    c = cluster(2)
    numel = 256 * 256 + 256 + 256 * 10 + 10  # the flat buffer; no parameter is this large

    def work(cl: Client[torch.Tensor]) -> tuple[bool, list[list[str]]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 10))
        opt = dt.DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1,
                                                        momentum=0.9), model,
                                        algorithm="dsgd-cta", client=cl, prefix="flat.cta")
        steps = []
        for _ in range(3):
            opt.zero_grad()
            watch = LargeAllocations(numel)
            with watch:
                model(torch.ones(4, 256)).sum().backward()
                opt.step()
            steps.append(watch.ops)
        return opt.flattened, steps

    for flattened, steps in c.run(work):
        assert flattened
        assert steps == [["aten.sub_.Tensor", "aten.add_.Tensor"]] * 3, steps


def one_weight_after_forward(cl: Client[torch.Tensor], algorithm: str
                             ) -> tuple[torch.nn.Linear, dt.DecentralizedOptimizer]:
    """A one-weight model (the weight: the rank) under ``algorithm`` with lr 0, after its
    first forward and backward (the step not taken)."""
    net = torch.nn.Linear(1, 1, bias=False, dtype=torch.float64)
    torch.nn.init.constant_(net.weight, float(cl.rank))
    opt = dt.DecentralizedOptimizer(torch.optim.SGD(net.parameters(), lr=0.0), net,
                                    algorithm=algorithm, client=cl, prefix=f"late.{algorithm}")
    net(torch.ones(1, 1, dtype=torch.float64)).sum().backward()
    return net, opt


def test_combine_then_adapt_sees_writes_and_layouts_between_forward_and_step(
        cluster: ClusterFactory) -> None:
    # the exchange starts in the forward pre-hook from the flat buffers; a checkpoint loaded
    # after forward makes the step average the parameters as loaded (lr 0: the 2-rank mean of
    # 100 + r), and a parameter group added after forward that cannot be flattened drops the
    # flat exchange for the general path's (the step averaged the stale buffer before, or
    # failed with a size mismatch)
    c = cluster(2)

    def work(cl: Client[torch.Tensor]) -> tuple[float, list[float], float]:
        r = cl.rank
        net, opt = one_weight_after_forward(cl, "dsgd-cta")
        net.load_state_dict({"weight": torch.full((1, 1), 100.0 + r, dtype=torch.float64)})
        opt.step()
        loaded = float(net.weight)
        net(torch.ones(1, 1, dtype=torch.float64)).sum().backward()
        extra = torch.nn.Parameter(torch.full((3,), float(r), dtype=torch.float64)
                                   .share_memory_())
        opt.add_param_group({"params": [extra]})
        opt.step()
        return loaded, extra.detach().tolist(), float(net.weight)

    for loaded, extra, weight in c.run(work):
        assert loaded == 100.5 and weight == 100.5
        assert extra == [0.5, 0.5, 0.5]


def test_adapt_then_combine_takes_step_weights_set_after_forward(
        cluster: ClusterFactory) -> None:
    # ATC averages in step(): BlueFog's per-step weights set after the forward pass still
    # apply to that step (lr 0: 0.25 x_r + 0.75 x_other, not the topology's halves)
    c = cluster(2)

    def work(cl: Client[torch.Tensor]) -> float:
        r = cl.rank
        net, opt = one_weight_after_forward(cl, "dsgd")
        opt.self_weight, opt.src_weights, opt.dst_weights = 0.25, {1 - r: 0.75}, {1 - r: 1.0}
        opt.step()
        return float(net.weight)

    assert c.run(work) == [0.75, 0.25]
