"""What BlueFog users' code expects: exact uniform averages, windows created in any order, the
window extras (mutex, associated p, clone, free all), runtime topology, small integer dtypes and
gathers with variable first dimensions. Real daemons; exact values."""

from __future__ import annotations

import threading
import time
from functools import partial
from typing import Any

import networkx as nx
import numpy as np
import pytest
import torch

from cluster import Cluster
from conftest import ClusterFactory
from decent.core import Client, DecentError
from decent.core.surface.topology_ops import infer_peers
from decent.core.training.algorithms import make_algorithm
from decent_wire.topology import from_graph

T = Client[torch.Tensor]


def near_fifty(rank: int, n: int = 1000) -> torch.Tensor:
    return torch.tensor(np.random.default_rng(rank).uniform(45, 55, n).astype(np.float32))


@pytest.mark.slow
def test_uniform_averages_sum_first_and_divide_once(cluster: ClusterFactory) -> None:
    # ring of 3: weights 1/3; BlueFog sums and divides by 3, which rounds once
    c = cluster(3, "ring")
    got = c.run(lambda cl: cl.neighbor_allreduce(near_fifty(cl.rank), name="uniform"))
    means = c.run(lambda cl: cl.allreduce(near_fifty(cl.rank), name="uniform.all"))
    xs = [near_fifty(r).numpy() for r in range(3)]
    three = np.float32(3)
    for r in range(3):
        lo, hi = sorted({(r - 1) % 3, (r + 1) % 3})
        want = ((xs[r] + xs[lo]) + xs[hi]) / three  # the daemon's order: self, then ascending
        assert np.array_equal(got[r].numpy(), want), r
        # the test can tell: scaling each term by 1/3 rounded gives other bits
        third = np.float32(1.0 / 3.0)
        assert not np.array_equal((xs[r] * third + xs[lo] * third) + xs[hi] * third, want)
        assert np.array_equal(means[r].numpy(), ((xs[0] + xs[1]) + xs[2]) / three)
    exact = np.mean(np.stack(xs).astype(np.float64), axis=0)
    assert np.abs(means[0].numpy() - exact).max() < 6e-6


# ---------------------------------------------------------------------- windows in any order


@pytest.mark.slow
def test_a_write_before_win_create_is_applied_at_creation(cluster: ClusterFactory) -> None:
    c = cluster(2, "ring")
    zero, one = c.clients
    x1, t0 = torch.full((5,), 10.0), torch.arange(5.0)
    zero.win_create(torch.zeros(5), "early.acc")
    zero.win_accumulate(t0, "early.acc", dst_weights={1: 2.0})  # rank 1 has no window yet
    zero.win_create(torch.zeros(5), "early.put")
    zero.win_put(t0, "early.put", dst_weights={1: 2.0})
    assert c.status(1).early_window_bytes == 2 * 5 * 4  # both kept at rank 1, not applied yet
    one.win_create(x1.clone(), "early.acc")
    one.win_create(x1.clone(), "early.put")
    acc = one.win_update("early.acc", self_weight=0.0, neighbor_weights={0: 1.0})
    put = one.win_update("early.put", self_weight=0.0, neighbor_weights={0: 1.0})
    assert torch.equal(acc, x1 + 2 * t0)  # the initial copy, plus what was accumulated
    assert torch.equal(put, 2 * t0)  # a put replaces it
    assert c.status(1).early_window_bytes == 0
    for cl in (zero, one):
        cl.win_free()


@pytest.mark.slow
def test_a_read_before_win_create_waits_for_the_window(cluster: ClusterFactory) -> None:
    c = cluster(2, "ring")
    zero, one = c.clients
    zero.win_create(torch.zeros(3), "late.get")
    get = zero.win_get_async("late.get", src_weights={1: 1.0}, timeout=60)
    while not c.status(1).parked_window_requests:  # rank 1's daemon holds the read
        time.sleep(0.01)
    assert not get.done()
    one.win_create(torch.tensor([7.0, 8.0, 9.0]), "late.get")
    get.join()
    got = zero.win_update("late.get", self_weight=0.0, neighbor_weights={1: 1.0})
    assert torch.equal(got, torch.tensor([7.0, 8.0, 9.0]))
    assert c.status(1).parked_window_requests == 0
    for cl in (zero, one):
        cl.win_free()


@pytest.mark.slow
def test_early_writes_are_bounded() -> None:
    c = Cluster(2, "ring", "--set", "memory.window_early_bytes=4096")
    try:
        zero, _one = c.connect()
        zero.win_create(torch.zeros(2048), "big")  # 8 KiB: more than rank 1 keeps
        with pytest.raises(DecentError) as info:
            zero.win_put(torch.ones(2048), "big", dst_weights=[1])
        assert info.value.code_name == "RESOURCE_EXHAUSTED"
        assert "'big'" in info.value.message and "window_early_bytes" in info.value.message
    finally:
        assert c.stop() == [0, 0]


# ---------------------------------------------------------------------- window extras


@pytest.mark.slow
def test_two_ranks_never_hold_a_window_mutex_at_once(cluster: ClusterFactory) -> None:
    # the lock at rank 0: rank 1 takes it remotely, then rank 0 asks for it for itself
    c = cluster(2, "ring")
    zero, one = c.clients
    held, order = threading.Event(), []

    def hold_until_rank_zero_waits() -> None:
        with one.win_mutex("mtx", ranks=[0]):
            held.set()
            while not c.status(0).window_lock_waiters:  # rank 0 now waits in line
                time.sleep(0.01)
            order.append("rank 1 releases")

    holder = threading.Thread(target=hold_until_rank_zero_waits)
    holder.start()
    assert held.wait(60)
    with zero.win_mutex("mtx", for_self=True, ranks=[1]):
        order.append("rank 0 holds")
    holder.join()
    assert order == ["rank 1 releases", "rank 0 holds"]
    assert c.status(0).window_lock_waiters == 0


@pytest.mark.slow
def test_associated_p_travels_with_writes_and_updates(cluster: ClusterFactory) -> None:
    # BlueFog's ring test: rank 0 accumulates with self weight 0.5 and 0.5 to each side, then
    # every rank collects (all weights 1, reset): p is 0.5 at the sender, 1.5 next to it
    c = cluster(4, "ring")

    def run(cl: T) -> tuple[float, torch.Tensor]:
        x = torch.full((3,), float(cl.rank))
        cl.win_create(x, "assoc", zero_init=True)
        cl.barrier(name="assoc.created")
        if cl.rank == 0:
            cl.win_accumulate(x, "assoc", dst_weights={1: 0.5, 3: 0.5}, self_weight=0.5)
        cl.barrier(name="assoc.written")
        ring = {(cl.rank - 1) % 4: 1.0, (cl.rank + 1) % 4: 1.0}
        cl.win_update("assoc", self_weight=1.0, neighbor_weights=ring, reset=True)
        p = cl.win_associated_p("assoc")
        cl.barrier(name="assoc.read")
        cl.win_free("assoc")
        return p, x

    got = c.run(run)
    assert [p for p, _ in got] == [0.5, 1.5, 1.0, 1.5]
    assert torch.equal(got[0][1], torch.zeros(3))  # 0 * 0.5: the sender's tensor is scaled


@pytest.mark.slow
def test_clone_leaves_the_window_and_free_all_frees_every_window(
        cluster: ClusterFactory) -> None:
    c = cluster(2, "ring")

    def run(cl: T) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
        x = torch.full((2,), float(cl.rank + 1))
        cl.win_create(x, "clone.a")
        cl.win_create(x.clone(), "clone.b")
        cl.barrier(name="clone.created")
        cloned = cl.win_update("clone.a", self_weight=0.0, neighbor_weights={1 - cl.rank: 1.0},
                               clone=True)
        cl.barrier(name="clone.updated")
        cl.win_get("clone.a", src_weights={1 - cl.rank: 1.0})  # the peer's own copy
        peer = cl.win_update("clone.a", self_weight=0.0, neighbor_weights={1 - cl.rank: 1.0},
                             clone=True)
        names = cl.window_names()
        cl.barrier(name="clone.read")
        cl.win_free()
        assert cl.window_names() == []
        return cloned, x, peer, names

    for r, (cloned, x, peer, names) in enumerate(c.run(run)):
        # neighbor slots start as a copy of the creator's own tensor (BlueFog's zero_init=False)
        assert torch.equal(cloned, torch.full((2,), float(r + 1)))
        assert torch.equal(x, torch.full((2,), float(r + 1)))  # not written into
        assert torch.equal(peer, torch.full((2,), float(2 - r)))  # the peer's own copy unchanged
        assert names == ["clone.a", "clone.b"]


# ---------------------------------------------------------------------- runtime topology


@pytest.mark.slow
def test_set_topology_applies_to_later_ops_and_in_flight_ops_keep_theirs(
        cluster: ClusterFactory) -> None:
    c = cluster(4, "ring")

    def run(cl: T) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], Any]:
        x = torch.full((4,), float(cl.rank))
        before = cl.neighbor_allreduce_async(x, name="topo.k")  # submitted on the ring
        assert cl.set_topology("full")
        after = cl.neighbor_allreduce(x, name="topo.k")
        graph = cl.load_topology()
        neighbors = cl.in_neighbor_ranks()
        assert cl.set_topology(None)  # back to the daemon's
        again = cl.neighbor_allreduce(x, name="topo.k")
        return before.wait(), after, again, neighbors, graph

    for r, (before, after, again, neighbors, graph) in enumerate(c.run(run)):
        ring = (r + (r - 1) % 4 + (r + 1) % 4) / 3
        assert torch.allclose(before, torch.full((4,), ring), rtol=0, atol=1e-6)
        assert torch.equal(after, torch.full((4,), 1.5))  # (0 + 1 + 2 + 3) / 4
        assert torch.allclose(again, torch.full((4,), ring), rtol=0, atol=1e-6)
        assert neighbors == [j for j in range(4) if j != r]
        assert graph.number_of_edges() == 16 and graph.edges[r, r]["weight"] == 0.25


@pytest.mark.slow
def test_ranks_on_different_topologies_fail_with_mismatch_naming_both(
        cluster: ClusterFactory) -> None:
    c = cluster(4, "ring")

    def run(cl: T) -> torch.Tensor:
        if cl.rank < 2:
            cl.set_topology("full")
        try:
            return cl.neighbor_allreduce(torch.ones(2), name="topo.odd", timeout=30)
        finally:
            cl.set_topology(None)

    for err in c.run_catching(run):
        assert isinstance(err, DecentError) and err.code_name == "MISMATCH", err
        assert "full#" in err.message and "ring#" in err.message, err.message


@pytest.mark.slow
def test_weighted_graphs_as_bluefog_reads_them(cluster: ClusterFactory) -> None:
    # edge j -> i carries i's weight for j; the self-loop is the self weight
    c = cluster(4, "ring")
    g: nx.DiGraph = nx.DiGraph()
    for i in range(4):
        g.add_edge(i, i, weight=0.75)
        g.add_edge((i - 1) % 4, i, weight=0.25)

    def run(cl: T) -> tuple[torch.Tensor, bool, bool]:
        assert cl.set_topology(g, is_weighted=True)
        got = cl.neighbor_allreduce(torch.full((2,), float(cl.rank)), name="topo.w")
        weighted = cl.is_topo_weighted()
        cl.set_topology(None)
        return got, weighted, cl.is_topo_weighted()

    for r, (got, weighted, after) in enumerate(c.run(run)):
        assert torch.equal(got, torch.full((2,), 0.75 * r + 0.25 * ((r - 1) % 4)))
        assert weighted and not after


@pytest.mark.slow
def test_set_topology_refuses_while_windows_exist(cluster: ClusterFactory) -> None:
    cl = cluster(2, "ring").clients[0]
    cl.win_create(torch.zeros(1), "topo.win")
    assert cl.set_topology("full") is False
    cl.win_free("topo.win")


@pytest.mark.slow
def test_infer_peers_from_the_other_side(cluster: ClusterFactory) -> None:
    c = cluster(4, "ring")

    def run(cl: T) -> tuple[Any, Any]:
        r = cl.rank
        dsts = infer_peers(cl, [(r - 1) % 4], "src")
        srcs, w = infer_peers(cl, [(r + 1) % 4, (r + 2) % 4], "dst", True)
        return dsts, (srcs, w)

    for r, (dsts, (srcs, w)) in enumerate(c.run(run)):
        assert dsts == [(r + 1) % 4]
        assert srcs == sorted({(r - 1) % 4, (r - 2) % 4})
        np.testing.assert_allclose(w.sum(axis=0), np.ones(4))


# ---------------------------------------------------------------------- dtypes and gathers


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16])
def test_small_integer_dtypes(cluster: ClusterFactory, dtype: torch.dtype) -> None:
    c = cluster(3, "ring")
    sign = -1 if dtype != torch.uint8 else 1
    got = c.run(lambda cl: cl.neighbor_allreduce(
        torch.full((5,), sign * 3 * (cl.rank + 1), dtype=dtype), name=f"small.{dtype}"))
    sums = c.run(lambda cl: cl.allreduce(torch.full((4,), 100, dtype=dtype), op="sum",
                                         name=f"small.sum.{dtype}"))
    for g, s in zip(got, sums, strict=True):
        assert g.dtype == dtype and torch.equal(g, torch.full((5,), sign * 6, dtype=dtype))
        assert torch.equal(s, torch.full((4,), 300, dtype=torch.int64).to(dtype))  # wraps


@pytest.mark.slow
@pytest.mark.parametrize("scale", [1, 100_000])  # the large one passes flow control's window
def test_allgather_concatenates_variable_first_dimensions(cluster: ClusterFactory,
                                                          scale: int) -> None:
    c = cluster(4, "ring")

    def rows(r: int) -> torch.Tensor:
        return torch.full((scale * r if r != 2 else 0, 3), float(r))  # rank 2 brings none

    got = c.run(lambda cl: cl.allgather(rows(cl.rank), name="gather.var"))
    want = torch.cat([rows(r) for r in range(4)])
    for g in got:
        assert g.shape == (4 * scale, 3) and torch.equal(g, want)


@pytest.mark.slow
@pytest.mark.parametrize("scale", [1, 100_000])
def test_neighbor_allgather_concatenates_in_the_order_given(cluster: ClusterFactory,
                                                            scale: int) -> None:
    c = cluster(4, "ring")

    def run(cl: T) -> torch.Tensor:
        r = cl.rank
        srcs = [(r + 1) % 4, (r - 1) % 4]  # the higher neighbor first
        mine = torch.full((scale * (r + 1), 2), float(r))
        return cl.neighbor_allgather(mine, name="ngather.var", src_ranks=srcs,
                                     dst_ranks=[(r - 1) % 4, (r + 1) % 4], concat=True)

    for r, g in enumerate(c.run(run)):
        hi, lo = (r + 1) % 4, (r - 1) % 4
        want = torch.cat([torch.full((scale * (hi + 1), 2), float(hi)),
                          torch.full((scale * (lo + 1), 2), float(lo))])
        assert torch.equal(g, want)


@pytest.mark.slow
def test_neighbor_allgather_stacks_by_default_and_concat_checks_the_other_dims(
        cluster: ClusterFactory) -> None:
    c = cluster(4, "ring")
    stacked = c.run(lambda cl: cl.neighbor_allgather(torch.full((2,), float(cl.rank)),
                                                     name="ngather.stack"))
    for r, g in enumerate(stacked):
        lo, hi = sorted({(r - 1) % 4, (r + 1) % 4})
        assert torch.equal(g, torch.tensor([[lo, lo], [hi, hi]], dtype=torch.float32))
    errors = c.run_catching(lambda cl: cl.neighbor_allgather(
        torch.zeros(2, 2 + (cl.rank == 1)), name="ngather.bad", concat=True, timeout=30))
    for err in errors[:3]:  # rank 1 and its receivers (rank 3 hears only from 0 and 2)
        assert isinstance(err, DecentError) and err.code_name == "MISMATCH", err
        assert "'ngather.bad'" in err.message and "rank 1 " in err.message, err.message
        assert "float32[2, 3]" in err.message and "float32[2, 2]" in err.message, err.message


def test_torch_module_has_the_bluefog_names() -> None:
    import decent.torch as dt
    for name in ("set_topology", "load_topology", "is_topo_weighted", "in_neighbor_ranks",
                 "out_neighbor_ranks", "InferDestinationFromSourceRanks",
                 "InferSourceFromDestinationRanks", "allgather", "win_mutex",
                 "win_associated_p", "window_names", "DistributedOptimizer", "Compression",
                 "synchronize", "poll", "local_rank", "local_size"):
        assert callable(getattr(dt, name)) or hasattr(dt, name), name


# ---------------------------------------------------------------------- push-sum


def _consensus(cl: T, graph: nx.DiGraph, steps: int) -> float:
    alg = make_algorithm("push-sum", cl, topology=from_graph(graph), prefix="ps.consensus")
    z = torch.tensor([float(cl.rank) ** 2], dtype=torch.float64)
    for _ in range(steps):
        (z,) = alg.finish([z], [torch.zeros_like(z)], [{}])
        alg.advance()
    return float(z[0])


@pytest.mark.slow
def test_push_sum_reaches_the_exact_average_on_directed_graphs(cluster: ClusterFactory) -> None:
    c = cluster(4, "ring")
    exponential = nx.DiGraph([(i, (i + h) % 4) for i in range(4) for h in (1, 2)])
    irregular = nx.DiGraph([(0, 1), (1, 2), (2, 3), (3, 0), (0, 2)])  # out-degrees 2, 1, 1, 1
    mean = (0 + 1 + 4 + 9) / 4
    for graph in (exponential, irregular):
        got = c.run(partial(_consensus, graph=graph, steps=200))
        assert max(abs(v - mean) for v in got) < 1e-9, got
    # a row-stochastic average of the same irregular graph settles elsewhere
    w = from_graph(irregular).matrix()
    x = np.array([0.0, 1.0, 4.0, 9.0])
    for _ in range(200):
        x = w @ x
    assert abs(x[0] - mean) > 0.1

