"""What Horovod's torch users' code expects: gradient averaging (``gradient-allreduce`` and
``DistributedOptimizer`` with Horovod's arguments) exact against numpy, reductions started by
backward, and the optimizer state from the root. Real daemons."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

import decent.torch as dt
from conftest import ClusterFactory
from decent.core import Client
from least_squares import LR, X0, N, grads, train

pytestmark = pytest.mark.slow

T = Client[torch.Tensor]
STEPS = 40


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_gradient_allreduce_steps_on_the_average_gradient(cluster: ClusterFactory,
                                                          momentum: float) -> None:
    # x_i' = x_i - lr m_i, m_i' = momentum m_i + mean_j g_j(x_j): every rank steps on the same
    # average, from its own start
    got = train(cluster(N, "ring"), "gradient-allreduce", STEPS,
                make_opt=lambda ps: torch.optim.SGD(ps, lr=LR, momentum=momentum))
    x, m = X0.copy(), np.zeros_like(X0)
    for _ in range(STEPS):
        m = momentum * m + grads(x).mean(axis=0)
        x = x - LR * m
    np.testing.assert_allclose(got, x, rtol=1e-12, atol=1e-12)


class Recorder:
    """Horovod's compressor interface, doing nothing but noting when it is called."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        self.events.append(f"reduce {tuple(tensor.shape)}")
        return tensor, None

    def decompress(self, tensor: torch.Tensor, _context: Any) -> torch.Tensor:
        return tensor


def _model(r: int) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    return (torch.nn.Parameter(torch.full((3,), 10.0 + r)),
            torch.nn.Parameter(torch.full((2,), -float(r))))


def _loss(r: int, w: torch.Tensor, b: torch.Tensor, k: int) -> torch.Tensor:
    # gradients (r + k) on w and 2 (r + k) on b: exact in float32
    return ((r + k) * (w.sum() + 2 * b.sum()))


def test_distributed_optimizer_reduces_during_backward_after_the_last_pass(
        cluster: ClusterFactory) -> None:
    c = cluster(N, "ring")

    def run(cl: T) -> tuple[list[str], torch.Tensor, torch.Tensor, bool]:
        r, events = cl.rank, list[str]()
        w, b = _model(r)
        opt = dt.DistributedOptimizer(torch.optim.SGD([w, b], lr=0.5),
                                      named_parameters=[("w", w), ("b", b)],
                                      compression=Recorder(events), backward_passes_per_step=2,
                                      client=cl)
        _loss(r, w, b, 1).backward()
        events.append("backward 1")
        _loss(r, w, b, 2).backward()
        events.append("backward 2")
        opt.step()
        return events, w.detach().clone(), b.detach().clone(), isinstance(opt, torch.optim.SGD)

    mean = float(np.mean([(r + 1) + (r + 2) for r in range(N)]))  # the two passes summed, averaged
    for r, (events, w, b, is_sgd) in enumerate(c.run(run)):
        assert events == ["backward 1", "reduce (2,)", "reduce (3,)", "backward 2"], events
        assert torch.equal(w, torch.full((3,), 10.0 + r - 0.5 * mean))
        assert torch.equal(b, torch.full((2,), -float(r) - 0.5 * 2 * mean))
        assert is_sgd  # Horovod's wrapper is an instance of the wrapped optimizer's class


def test_fp16_compression_rounds_to_half_precision_on_the_way(cluster: ClusterFactory) -> None:
    c = cluster(N, "ring")
    values = [0.1 * (r + 1) + 1e-3 for r in range(N)]  # not representable in float16

    def run(cl: T) -> torch.Tensor:
        x = torch.nn.Parameter(torch.zeros(4))
        opt = dt.DistributedOptimizer(torch.optim.SGD([x], lr=1.0), client=cl,
                                      named_parameters=[("x", x)], compression=dt.Compression.fp16)
        (values[cl.rank] * x.sum()).backward()
        opt.step()
        return x.detach().clone()

    halves = np.array(values, dtype=np.float16).astype(np.float32)
    want = -(halves.sum(dtype=np.float32) / np.float32(N)).astype(np.float16).astype(np.float32)
    for got in c.run(run):
        assert got.dtype == torch.float32 and torch.equal(got, torch.full((4,), float(want)))
        assert float(want) != -float(np.mean(np.array(values, dtype=np.float32)))


def test_sum_with_a_predivide_factor_and_skip_synchronize(cluster: ClusterFactory) -> None:
    c = cluster(N, "ring")

    def run(cl: T) -> torch.Tensor:
        x = torch.nn.Parameter(torch.zeros(2))
        opt = dt.DistributedOptimizer(torch.optim.SGD([x], lr=1.0), client=cl, op=dt.Sum,
                                      gradient_predivide_factor=2.0)
        (float(cl.rank + 1) * torch.tensor([3.0, 4.0]) @ x).backward()
        opt.synchronize()  # the summed gradients are in .grad: clip them before the step
        torch.nn.utils.clip_grad_norm_([x], max_norm=1.0)
        with opt.skip_synchronize():
            opt.step()
        return x.detach().clone()

    for got in c.run(run):  # sum: 10 * (3, 4), norm 50, clipped to norm 1
        torch.testing.assert_close(got, -torch.tensor([0.6, 0.8]), rtol=1e-6, atol=0)


def test_lr_schedulers_and_checkpoints_see_one_optimizer(cluster: ClusterFactory) -> None:
    c = cluster(N, "ring")

    def run(cl: T) -> tuple[float, torch.Tensor, dict[str, Any]]:
        x = torch.nn.Parameter(torch.zeros(1))
        opt = dt.DistributedOptimizer(torch.optim.SGD([x], lr=1.0, momentum=0.5), client=cl)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for _ in range(2):
            opt.zero_grad()
            (float(cl.rank) * x.sum()).backward()
            opt.step()
            scheduler.step()
        with pytest.raises(RuntimeError, match=r"zero_grad.*being reduced"):
            (x.sum()).backward()
            opt.zero_grad()
        opt.synchronize()
        return opt.param_groups[0]["lr"], x.detach().clone(), opt.state_dict()

    g = float(np.mean(range(N)))  # momentum buffer g, then 0.5 g + g; lr 1 then 0.5
    for lr, x, state in c.run(run):
        assert lr == 0.25
        f32 = torch.float32
        torch.testing.assert_close(x, torch.tensor([-(g + 0.5 * 1.5 * g)], dtype=f32),
                                   rtol=1e-6, atol=0)
        torch.testing.assert_close(state["state"][0]["momentum_buffer"],
                                   torch.tensor([1.5 * g], dtype=f32), rtol=1e-6, atol=0)


def test_broadcast_optimizer_state_gives_every_rank_the_roots_adam(
        cluster: ClusterFactory) -> None:
    c = cluster(N, "ring")

    def run(cl: T) -> dict[str, Any]:
        r = cl.rank
        x = torch.nn.Parameter(torch.full((3,), float(r)))
        adam = torch.optim.Adam([x], lr=0.1 * (r + 1), betas=(0.8, 0.9))
        if r != 1:  # rank 1 (the root) steps once, rank 0 twice, others not at all
            for _ in range(2 - min(r, 2)):
                (x * x).sum().backward()
                adam.step()
        else:
            (3 * x).sum().backward()
            adam.step()
        opt = dt.DistributedOptimizer(adam, named_parameters=[("x", x)], client=cl)
        dt.broadcast_parameters([("x", x)], root_rank=1, client=cl)
        dt.broadcast_optimizer_state(opt, root_rank=1, client=cl)
        return {"x": x.detach().clone(), "state": opt.state_dict()}

    got = c.run(run)
    root = got[1]
    for o in got:
        assert torch.equal(o["x"], root["x"])
        assert o["state"]["param_groups"] == root["state"]["param_groups"]
        mine, theirs = o["state"]["state"][0], root["state"]["state"][0]
        assert set(mine) == {"step", "exp_avg", "exp_avg_sq"} == set(theirs)
        for key in mine:
            assert torch.equal(mine[key], theirs[key]), key
    assert root["state"]["param_groups"][0]["lr"] == pytest.approx(0.2)


def test_a_gradient_twice_before_step_is_refused(cluster: ClusterFactory) -> None:
    cl = cluster(1, "ring").clients[0]
    x = torch.nn.Parameter(torch.zeros(2))
    opt = dt.DistributedOptimizer(torch.optim.SGD([x], lr=1.0), client=cl)
    x.sum().backward()
    with pytest.raises(RuntimeError, match="more than backward_passes_per_step"):
        x.sum().backward()
    opt.synchronize()
    with pytest.raises(dt.AlgorithmError, match="Adasum is not supported"):
        dt.DistributedOptimizer(torch.optim.SGD([x], lr=1.0), client=cl, op=dt.Adasum)


def test_two_ops_of_one_name_in_flight_are_a_value_error_as_in_horovod() -> None:
    # decent.torch used as hvd: Horovod refuses a second op of a name still in flight; a Client
    # runs it as the name's next round (README "Coming from BlueFog or Horovod")
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from cluster import Cluster, delay
    from decent.core.surface.default_client import DefaultClient

    c = Cluster(2, "ring")
    hvds: list[DefaultClient[torch.Tensor, Any]] = []
    try:
        hvds = [DefaultClient("decent.torch", lambda a: dt.connect(a, 60)) for _ in range(2)]
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda i: hvds[i].init(f"unix://{c.sockets[i]}"), range(2)))

        tried = threading.Event()

        def work(i: int) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]:
            hvd = SimpleNamespace(**hvds[i].shortcuts())  # what `import decent.torch as hvd` is
            cl = hvds[i].get()
            delay(i)
            if i == 1:  # rank 0's first op is in flight for sure until rank 1 submits its own
                assert tried.wait(60)
            first = hvd.allreduce_async(torch.full((3,), float(i)), name="dup")
            refused = ""
            if i == 0:
                try:
                    hvd.allreduce_async(torch.full((3,), 10.0), name="dup")
                except ValueError as err:
                    refused = str(err)
                try:
                    hvd.allreduce(torch.ones(3), name="dup")
                except ValueError as err:
                    refused += " | " + str(err)
                tried.set()
            got = first.wait()
            again = hvd.allreduce(torch.full((3,), float(2 * i)), name="dup")  # allowed now
            # the Client itself queues a second one as the next round
            a = cl.allreduce_async(torch.full((3,), float(i)), name="queued")
            b = cl.allreduce_async(torch.full((3,), float(i + 2)), name="queued")
            return refused, got, again, a.wait() + b.wait()

        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(work, range(2)))
        refused = got[0][0]
        assert refused.count("'dup': an op of this name has not been synchronized") == 2, refused
        assert refused.startswith("allreduce_async 'dup'")
        for _, first, again, queued in got:
            assert torch.equal(first, torch.full((3,), 0.5))
            assert torch.equal(again, torch.full((3,), 1.0))
            assert torch.equal(queued, torch.full((3,), 0.5 + 2.5))
    finally:
        for h in hvds:
            h.shutdown()
        c.stop()


@pytest.mark.parametrize("np_", [2, 4])
def test_horovod_and_bluefog_programs_calls_under_decentrun(np_: int) -> None:
    """``tests/horovod_rules.py`` under ``decentrun -np 2`` and ``-np 4``: prescale on
    integers keeps the dtype, a name stays taken until synchronized (allgather too, at once),
    hvd.broadcast/allgather gradients average, broadcast_optimizer_state with parameters
    without gradients or state, ``hvd.allreduce(t, hvd.Sum)``, Horovod's query functions, and
    its warning for step() after synchronize(). On 4 ranks also BlueFog's programs' calls
    (``tests/bluefog_rules.py``), with BlueFog's values: window push-sum with require_mutex
    keeps its mass (p totals 4.0), win_free returns True (no name: every window; local, where
    BlueFog's is collective: a get from a rank that freed it fails with NOT_FOUND),
    load_topology gives the graph set, the optimizer wrappers are torch optimizers
    (CosineAnnealingLR) honouring per-step weights (1.5, not the topology's average; with a
    model, the weights set before the forward pass, where BlueFog's AWC averaging starts),
    BlueFog's graph builders and helpers, neighbor_allreduce_nonblocking with
    enable_topo_check, bf.wait, and the queries."""
    import subprocess
    import sys
    from pathlib import Path

    from cluster import DECENTRUN_ARENA

    script = Path(__file__).with_name("horovod_rules.py")
    proc = subprocess.run([sys.executable, "-m", "decentd.tools.launcher", "-np", str(np_),
                           *DECENTRUN_ARENA, "--", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert proc.stdout.count("ok\n") == np_, proc.stdout[-3000:]
    if np_ == 4:
        assert proc.stdout.count("passed nonblocking_wait_and_queries") == 4, proc.stdout
