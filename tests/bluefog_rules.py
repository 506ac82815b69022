"""BlueFog programs' calls, as they make them (``import decent.torch as bf``), with BlueFog's
expected values; run on 4 ranks by tests/horovod_rules.py (``decentrun -np 4``, in
tests/test_horovod.py)."""

from __future__ import annotations

import networkx as nx
import torch

import decent.torch as bf
from decent.core.training.algorithms import AlgorithmError

N = 4


def window_push_sum_keeps_its_mass() -> None:
    """BlueFog's window push-sum with require_mutex=True: self_weight scales the own tensor
    and p, so the total of x and of p stay what they were (p: 4.0)."""
    x = torch.tensor([float(bf.rank() + 1)], dtype=torch.float64)
    assert bf.win_create(x, "ps", zero_init=True)
    right = (bf.rank() + 1) % N
    for _ in range(20):
        bf.win_accumulate(x, "ps", self_weight=0.5, dst_weights={right: 0.5},
                          require_mutex=True)
        bf.barrier()
        x = bf.win_update_then_collect("ps")
        bf.barrier()
    p = torch.tensor([bf.win_associated_p("ps")], dtype=torch.float64)
    total_x = bf.allreduce(x, op="sum", name="ps.x")
    total_p = bf.allreduce(p, op="sum", name="ps.p")
    assert abs(float(total_x) - 10.0) < 1e-9, float(total_x)
    assert abs(float(total_p) - 4.0) < 1e-9, float(total_p)
    assert abs(float(x / p) - 2.5) < 1e-3, float(x / p)  # x/p -> the average
    assert bf.win_free("ps") is True


def win_free_returns_true_and_is_local() -> None:
    """``win_free`` returns True, ``win_free()`` frees every window. decent's (like its
    win_create) is local, where BlueFog's is collective: a get from a rank that freed it fails
    with NOT_FOUND; BlueFog programs' ``barrier()`` before it makes the difference moot."""
    t = torch.full((2,), float(bf.rank()))
    bf.win_create(t, "a")
    bf.win_create(t.clone(), "b")
    if bf.rank() == 0:
        assert bf.win_free("a") is True
    bf.barrier()
    if bf.rank() == 1:
        try:
            bf.win_get("a", src_weights={0: 1.0})
        except bf.DecentError as exc:
            assert "NOT_FOUND" in str(exc), exc
        else:
            raise AssertionError("a get from a freed window succeeded")
    bf.barrier()
    if bf.rank() != 0:
        assert bf.win_free("a") is True
    assert bf.window_names() == ["b"]
    bf.barrier()
    assert bf.win_free() is True and bf.window_names() == []


def load_topology_gives_the_graph_set() -> None:
    """set_topology(G, is_weighted=False), then load_topology() is G, with its own weights."""
    g = bf.MeshGrid2DGraph(N)
    assert bf.set_topology(g, is_weighted=False)
    got = bf.load_topology()
    assert got is g and bf.IsTopologyEquivalent(got, bf.MeshGrid2DGraph(N))
    assert bf.GetRecvWeights(got, 0) == (2.0 - (1.0 + 1 / 3 + 1 / 3), {1: 1 / 3, 2: 1 / 3})
    assert bf.set_topology(bf.ExponentialTwoGraph(N))


def optimizer_is_a_torch_optimizer_with_step_weights() -> None:
    """The wrapper is an instance of the wrapped class (CosineAnnealingLR works), and the
    per-step self_weight/src_weights/dst_weights are that step's weights (lr 0: rank 2 gets
    0.5 * 2 + 0.5 * 1 = 1.5, not the topology's average)."""
    w = torch.nn.Parameter(torch.tensor([float(bf.rank())], dtype=torch.float64))
    opt = bf.DistributedAdaptThenCombineOptimizer(torch.optim.SGD([w], lr=0.0),
                                                  communication_type=
                                                  bf.CommunicationType.neighbor_allreduce)
    assert isinstance(opt, torch.optim.SGD) and isinstance(opt.optimizer, torch.optim.SGD)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    left, right = (bf.rank() - 1) % N, (bf.rank() + 1) % N
    opt.self_weight, opt.src_weights, opt.dst_weights = 0.5, {left: 0.5}, {right: 1.0}
    opt.enable_topo_check = True
    w.grad = torch.zeros_like(w)
    opt.step()
    sched.step()
    assert float(w) == 0.5 * bf.rank() + 0.5 * left, float(w)
    other = bf.DecentralizedOptimizer(torch.optim.SGD([w], lr=0.0), algorithm="push-sum")
    other.self_weight = 0.5
    try:
        other.step()
    except AlgorithmError as exc:
        assert "per-step" in str(exc), exc
    else:
        raise AssertionError("push-sum took per-step weights")


def awc_takes_the_step_weights_set_before_forward() -> None:
    """BlueFog's AWC wrapper with a model averages beside forward and backward: weights set
    before the forward pass (as its dynamic-topology loops set them) are that step's, on the
    flat parameters and with ``flatten=False`` alike (lr 0: x' = 0.5 x + 0.5 x_left)."""
    left, right = (bf.rank() - 1) % N, (bf.rank() + 1) % N
    for flatten in (True, False):
        net = torch.nn.Linear(1, 1, bias=False, dtype=torch.float64)
        torch.nn.init.constant_(net.weight, float(bf.rank()))
        sgd = torch.optim.SGD(net.parameters(), lr=0.0)
        opt = bf.DistributedAdaptWithCombineOptimizer(sgd, model=net) if flatten else \
            bf.DecentralizedOptimizer(sgd, net, algorithm="dsgd-cta", flatten=False)
        for _ in range(2):  # the second step's weights differ from the first's
            opt.self_weight, opt.src_weights, opt.dst_weights = 0.5, {left: 0.5}, {right: 1.0}
            want = 0.5 * float(net.weight) + 0.5 * float(bf.allgather(net.weight.detach()
                                                                      .reshape(1))[left])
            net(torch.ones(1, 1, dtype=torch.float64)).sum().backward()
            opt.step()
            assert opt.flattened == flatten
            assert abs(float(net.weight) - want) < 1e-12, (flatten, float(net.weight), want)
        opt.close()


def graph_builders_have_bluefogs_weights() -> None:
    """BlueFog's topology_util, with its numbers."""
    tu = bf.topology_util
    assert bf.GetRecvWeights(tu.ExponentialTwoGraph(N), 0) == (1 / 3, {2: 1 / 3, 3: 1 / 3})
    assert bf.GetRecvWeights(tu.RingGraph(N), 1) == (1 / 3, {0: 1 / 3, 2: 1 / 3})
    assert bf.GetRecvWeights(tu.RingGraph(N, connect_style=2), 1) == (0.5, {0: 0.5})
    star = tu.StarGraph(N)
    assert bf.GetRecvWeights(star, 0) == (0.25, {1: 0.25, 2: 0.25, 3: 0.25})
    assert bf.GetRecvWeights(star, 2) == (0.75, {0: 0.25})
    gen = tu.GetDynamicOnePeerSendRecvRanks(tu.ExponentialTwoGraph(N), 0)
    assert [next(gen) for _ in range(3)] == [([1], [3]), ([2], [2]), ([1], [3])]
    assert tu.IsTopologyEquivalent(tu.RingGraph(N), tu.RingGraph(N))
    assert not tu.IsTopologyEquivalent(tu.RingGraph(N), tu.ExponentialTwoGraph(N))
    assert isinstance(tu.FullyConnectedGraph(N), nx.DiGraph)


def nonblocking_wait_and_queries() -> None:
    """neighbor_allreduce_nonblocking with enable_topo_check, bf.wait, and the queries."""
    left, right = (bf.rank() - 1) % N, (bf.rank() + 1) % N
    h = bf.neighbor_allreduce_nonblocking(torch.tensor([float(bf.rank())]), self_weight=0.5,
                                          src_weights={left: 0.5}, dst_weights=[right],
                                          enable_topo_check=True, name="nb")
    assert float(bf.wait(h)) == 0.5 * bf.rank() + 0.5 * left
    assert not bf.nccl_built() and bf.is_homogeneous() and bf.suspend() and bf.resume()


#: every check, in order (tests/horovod_rules.py runs them on 4 ranks)
CHECKS = (window_push_sum_keeps_its_mass, win_free_returns_true_and_is_local,
          load_topology_gives_the_graph_set, optimizer_is_a_torch_optimizer_with_step_weights,
          awc_takes_the_step_weights_set_before_forward, graph_builders_have_bluefogs_weights,
          nonblocking_wait_and_queries)
