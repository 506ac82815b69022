"""Several workers per daemon, with real daemons at 2x4 and 4x2: global ranks, worker-level ops
across and within daemons, hierarchical collectives and averaging, exact values."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch

import decent.torch as dt
from conftest import ClusterFactory
from decent.core import Client, DecentError
from decent_wire.topology import build_topology

pytestmark = pytest.mark.slow

T = Client[torch.Tensor]
SHAPES = [(2, 4), (4, 2)]  # (daemons, workers per daemon)


def ids(shape: tuple[int, int]) -> str:
    return f"{shape[0]}x{shape[1]}"


def uniform_average(kind: str, n: int, x: np.ndarray) -> np.ndarray:
    """Each rank's average of itself and its in-neighbors on ``kind``: the sum, divided once
    (what the daemons compute for uniform weights)."""
    topo = build_topology(kind, n)
    out = np.empty(n)
    for r in range(n):
        srcs = sorted(topo.step(r, 0).src_weights)
        out[r] = (x[r] + sum(x[j] for j in srcs)) / (len(srcs) + 1)
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_ranks_are_global_and_the_daemon_lists_its_workers(cluster: ClusterFactory,
                                                           shape: tuple[int, int]) -> None:
    nodes, per = shape
    c = cluster(nodes, "ring", per)
    for r, cl in enumerate(c.clients):
        assert (cl.rank, cl.size) == (r, nodes * per)
        assert (cl.machine_rank, cl.machine_size) == (r // per, nodes)
        assert (cl.local_rank, cl.local_size) == (r % per, per)
    for m in range(nodes):
        status = c.status(m)
        assert (status.rank, status.size, status.workers_per_node) == (m, nodes, per)
        job = c.clients[0].job
        mine = [(w.rank, w.local_rank) for w in status.local_workers if w.job == job]
        assert mine == [(m * per + i, i) for i in range(per)]


@pytest.mark.parametrize("kind", ["ring", "exponential"])
@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_neighbor_allreduce_among_workers(cluster: ClusterFactory, shape: tuple[int, int],
                                          kind: str) -> None:
    nodes, per = shape
    c = cluster(nodes, kind, per)
    n = nodes * per
    got = c.run(lambda cl: cl.neighbor_allreduce(torch.full((3,), float(cl.rank)),
                                                 name="mw.nar"))
    want = uniform_average(kind, n, np.arange(n, dtype=np.float64))
    for r, g in enumerate(got):
        assert torch.equal(g, torch.full((3,), float(want[r])))


@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_hierarchical_neighbor_allreduce_with_topology_and_explicit_weights(
        cluster: ClusterFactory, shape: tuple[int, int]) -> None:
    nodes, per = shape
    c = cluster(nodes, "ring", per)
    n = nodes * per
    x = np.arange(n, dtype=np.float64) ** 2
    means = x.reshape(nodes, per).mean(axis=1)

    def run(cl: T) -> tuple[torch.Tensor, torch.Tensor]:
        mine = torch.full((5,), x[cl.rank])
        by_topology = cl.hierarchical_neighbor_allreduce(mine, name="mw.hier")
        m = cl.machine_rank
        src = {(m + 1) % nodes: 0.25, (m - 1) % nodes: 0.25} if nodes > 2 else {1 - m: 0.5}
        explicit = cl.hierarchical_neighbor_allreduce(mine, name="mw.hier.w", self_weight=0.5,
                                                      src_machine_weights=src)
        return by_topology, explicit

    by_topology = uniform_average("ring", nodes, means)
    explicit = 0.5 * means + 0.5 * (means[np.r_[1:nodes, 0]] + means[np.r_[nodes - 1,
                                                                           0:nodes - 1]]) / 2
    for r, (g, e) in enumerate(c.run(run)):
        assert torch.equal(g, torch.full((5,), float(by_topology[r // per])))
        assert torch.equal(e, torch.full((5,), float(explicit[r // per])))


@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_allreduce_and_broadcast_are_hierarchical(cluster: ClusterFactory,
                                                  shape: tuple[int, int]) -> None:
    nodes, per = shape
    c = cluster(nodes, "ring", per)
    n = nodes * per
    root = per + 1  # a worker on the second node

    def run(cl: T) -> list[torch.Tensor]:
        r = cl.rank
        return [cl.allreduce(torch.full((7,), float(r)), name="mw.avg"),
                cl.allreduce(torch.full((3,), r, dtype=torch.int8), op="sum", name="mw.sum"),
                cl.allreduce(torch.full((3,), 2 * r + 1, dtype=torch.int64), name="mw.iavg"),
                cl.broadcast(torch.full((4,), 100.0 + r), root=root, name="mw.bcast"),
                cl.allreduce(torch.full((300_000,), float(r), dtype=torch.float16),
                             name="mw.ring")]

    total = n * (n - 1) // 2
    for got in c.run(run):
        assert torch.equal(got[0], torch.full((7,), (n - 1) / 2))
        assert torch.equal(got[1], torch.full((3,), total, dtype=torch.int64).to(torch.int8))
        assert torch.equal(got[2], torch.full((3,), n, dtype=torch.int64))  # mean of 2r+1
        assert torch.equal(got[3], torch.full((4,), 100.0 + root))
        assert torch.equal(got[4], torch.full((300_000,), (n - 1) / 2, dtype=torch.float16))


@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_windows_between_workers_on_one_node_and_across(cluster: ClusterFactory,
                                                        shape: tuple[int, int]) -> None:
    nodes, per = shape
    c = cluster(nodes, "ring", per)
    n = nodes * per

    def run(cl: T) -> torch.Tensor:
        r = cl.rank
        x = torch.full((6,), float(r))
        cl.win_create(x, "mw.win")
        cl.barrier(name="mw.win.created")
        cl.win_put(x * 3, "mw.win", dst_weights={(r - 1) % n: 1.0, (r + 1) % n: 1.0})
        cl.barrier(name="mw.win.put")
        out = cl.win_update("mw.win", self_weight=0.5,
                            neighbor_weights={(r - 1) % n: 0.25, (r + 1) % n: 0.25})
        cl.barrier(name="mw.win.read")
        cl.win_free("mw.win")
        return out

    for r, got in enumerate(c.run(run)):
        want = 0.5 * r + 0.25 * 3 * ((r - 1) % n + (r + 1) % n)
        assert torch.equal(got, torch.full((6,), want))


def test_barrier_and_allgather_span_both_levels(cluster: ClusterFactory) -> None:
    c = cluster(2, "ring", 4)

    def run(cl: T) -> torch.Tensor:
        cl.barrier(name="mw.barrier")
        return cl.allgather(torch.full((cl.rank % 3, 2), float(cl.rank)), name="mw.gather")

    want = torch.cat([torch.full((r % 3, 2), float(r)) for r in range(8)])
    for got in c.run(run):
        assert torch.equal(got, want)


def _bytes_sent(c: Any) -> list[int]:
    return [sum(p.bytes_sent for p in c.status(m).peers) for m in range(c.n)]


def test_a_node_sends_what_one_worker_would(cluster: ClusterFactory) -> None:
    # 4 MB per worker: an allreduce ring among 2 daemons and a hierarchical step on a
    # 2-machine ring each cross the link once per daemon, whatever the worker count
    size = 1 << 20  # float32 elements
    sent: dict[int, list[int]] = {}
    for per in (1, 4):
        c = cluster(2, "ring", per)
        before = _bytes_sent(c)
        c.run(lambda cl: cl.allreduce(torch.ones(size), name="mw.bytes.all"))
        middle = _bytes_sent(c)
        c.run(lambda cl: cl.hierarchical_neighbor_allreduce(torch.ones(size),
                                                            name="mw.bytes.hier"))
        after = _bytes_sent(c)
        sent[per] = [middle[m] - before[m] for m in range(2)] + \
            [after[m] - middle[m] for m in range(2)]
    for m in range(4):
        assert 4 * size <= sent[4][m] < 4 * size * 1.01, sent
        assert abs(sent[4][m] - sent[1][m]) < 0.01 * 4 * size, sent


def test_a_worker_that_leaves_fails_its_node_collectives_with_a_clear_error(
        cluster: ClusterFactory) -> None:
    c = cluster(2, "ring", 2)
    leaver = c.clients[1]

    def run(cl: T) -> Any:
        if cl is leaver:
            cl.close()
            return None
        try:
            return cl.allreduce(torch.ones(3), name="mw.left", timeout=60)
        except DecentError as err:
            return err

    got = c.run(run)
    for r in (0, 2, 3):
        err = got[r]
        assert isinstance(err, DecentError), (r, err)
        assert "rank 1 left" in err.message, err.message
    # the daemons and the other workers go on
    def pair(cl: T) -> torch.Tensor | None:
        if cl.rank not in (2, 3):
            return None
        other = 5 - cl.rank
        return cl.neighbor_allreduce(torch.full((2,), float(cl.rank)), name="mw.after",
                                     self_weight=0.5, src_weights={other: 0.5},
                                     dst_weights={other: 1.0})

    got = c.run(pair)
    assert torch.equal(got[2], torch.full((2,), 2.5)) and torch.equal(got[3], got[2])


@pytest.mark.parametrize("algorithm", ["dsgd", "pga", "dsgd-cta"])
@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_the_hierarchical_optimizer_matches_its_recursion(
        cluster: ClusterFactory, shape: tuple[int, int], algorithm: str) -> None:
    # x_i' = sum_J Wm[I, J] mean_{j in J} (x_j - lr g_j(x_j)) on the machine ring (pga: every
    # 4th combine the global mean; dsgd-cta, BlueFog's AWC with hierarchical_neighbor_allreduce:
    # x_i' = sum_J Wm[I, J] mean_{j in J} x_j - lr g_i(x_i)), least squares with each worker's
    # own data
    nodes, per = shape
    n, dim, steps, lr = nodes * per, 3, 30, 0.1
    rng = np.random.default_rng(5)
    a = rng.normal(size=(n, 6, dim)) / np.sqrt(6)
    b = rng.normal(size=(n, 6)) + np.arange(n)[:, None]
    x0 = rng.normal(size=(n, dim))
    options: dict[str, Any] = {"period": 4} if algorithm == "pga" else {}
    c = cluster(nodes, "ring", per)

    def run(cl: T) -> np.ndarray:
        r = cl.rank
        x = torch.nn.Parameter(torch.tensor(x0[r]))
        opt = dt.DecentralizedOptimizer(torch.optim.SGD([x], lr=lr), algorithm=algorithm,
                                        client=cl, prefix=f"mw.opt.{algorithm}",
                                        hierarchical=True, **options)
        assert opt.flattened
        for _ in range(steps):
            opt.zero_grad()
            (0.5 * ((torch.tensor(a[r]) @ x - torch.tensor(b[r])) ** 2).sum()).backward()
            opt.step()
        return x.detach().numpy().copy()

    got = np.stack(c.run(run, timeout=300))
    wm = build_topology("ring", nodes).matrix()
    x = x0.copy()
    for k in range(steps):
        step = lr * np.einsum("nrd,nr->nd", a, np.einsum("nrd,nd->nr", a, x) - b)
        if algorithm == "dsgd-cta":
            x = np.repeat(wm @ x.reshape(nodes, per, dim).mean(axis=1), per, axis=0) - step
            continue
        half = x - step
        means = half.reshape(nodes, per, dim).mean(axis=1)
        if algorithm == "pga" and (k + 1) % 4 == 0:
            mixed = np.repeat(half.mean(axis=0, keepdims=True), nodes, axis=0)
        else:
            mixed = wm @ means
        x = np.repeat(mixed, per, axis=0)
    np.testing.assert_allclose(got, x, rtol=1e-10, atol=1e-10)


def test_dynamic_and_compressed_gossip_among_workers(cluster: ClusterFactory) -> None:
    c = cluster(2, "one-peer-exponential", 4)
    topo = build_topology("one-peer-exponential", 8)

    def run(cl: T) -> list[torch.Tensor]:
        x = torch.full((4,), float(cl.rank))
        return [cl.neighbor_allreduce(x, name="mw.dyn") for _ in range(4)]

    for r, got in enumerate(c.run(run)):
        for k, g in enumerate(got):  # step k: the mean with rank r - 2^(k mod 3)
            (src,) = topo.step(r, k).src_weights
            assert torch.equal(g, torch.full((4,), (r + src) / 2)), (r, k)
    c2 = cluster(2, "ring", 4)
    mixed = c2.run(lambda cl: cl.compressed_neighbor_allreduce(
        torch.full((3,), float(cl.rank)), "topk", ratio=1.0, name="mw.choco"))
    want = uniform_average("ring", 8, np.arange(8, dtype=np.float64))
    for r, g in enumerate(mixed):
        assert torch.equal(g[0], torch.full((3,), float(want[r])))
        assert torch.equal(g[1], torch.full((3,), float(r)))


def test_workers_of_one_node_never_use_the_network(cluster: ClusterFactory) -> None:
    c = cluster(2, "ring", 4)
    size = 1 << 18  # 1 MiB of float32 per worker

    def pair(cl: T) -> torch.Tensor:
        other = cl.rank ^ 1  # the partner on the same node
        return cl.neighbor_allreduce(torch.full((size,), float(cl.rank)), name="mw.local",
                                     self_weight=0.5, src_weights={other: 0.5},
                                     dst_weights={other: 1.0})

    before = _bytes_sent(c)
    got = c.run(pair)
    after = _bytes_sent(c)
    for r, g in enumerate(got):
        assert torch.equal(g, torch.full((size,), (r + (r ^ 1)) / 2))
    assert all(a - b < 16 << 10 for a, b in zip(after, before, strict=True)), (before, after)


def test_the_daemon_holds_its_workers_arenas_and_bounded_buffers_only(
        cluster: ClusterFactory) -> None:
    # a node's collectives stage one tensor, whatever the worker count: the receive buffers
    # the daemon holds stay a few tensors large, and its memory grows by no copy per worker
    c = cluster(2, "ring", 4)
    size = 1 << 20  # 4 MiB of float32 per worker

    def steps(cl: T) -> None:
        for k in range(3):
            x = torch.full((size,), float(cl.rank))
            cl.allreduce(x, name=f"mw.mem.all.{k}")
            cl.hierarchical_neighbor_allreduce(x, name=f"mw.mem.hier.{k}")
            cl.neighbor_allreduce(x, name=f"mw.mem.nar.{k}")

    c.run(steps)  # warm: the pool has its buffers
    before = [c.status(m) for m in range(2)]
    c.run(steps)
    after = [c.status(m) for m in range(2)]
    tensor = 4 * size
    for b, a in zip(before, after, strict=True):
        # at most: the worker-level step's 2 tensors per worker (8) plus a node op's staged
        # tensor and its segments in flight; not a copy per worker and step (36)
        assert a.pool_peak_bytes <= 12 * tensor, a.pool_peak_bytes
        assert a.rss_bytes - b.rss_bytes < 4 * tensor, (b.rss_bytes, a.rss_bytes)


def test_peers_leave_out_a_worker_that_left_at_once_until_it_is_back(
        cluster: ClusterFactory) -> None:
    c = cluster(2, "ring", 2)
    c.clients[3].close()  # rank 3, on the second daemon

    def wait_for_three(cl: T) -> Any:
        h = cl.neighbor_allreduce_async(torch.ones(2), name="mw.gone", self_weight=0.5,
                                        src_weights={3: 0.5}, dst_weights={3: 1.0},
                                        timeout=20)
        return h.wait(timeout=60), h.src_ranks

    # faults.on_peer_loss: reweight (the default): its weight goes to self, at once
    got, srcs = c.run(lambda cl: wait_for_three(cl) if cl.rank == 0 else (None, None))[0]
    assert torch.equal(got, torch.ones(2)) and srcs == []
    back = dt.connect(f"unix://{c.sockets[1]}", 60, job=c.clients[0].job, local_rank=1)
    try:
        assert back.rank == 3
        with ThreadPoolExecutor(2) as pool:
            zero = pool.submit(c.clients[0].neighbor_allreduce, torch.ones(2), name="mw.back",
                               self_weight=0.5, src_weights={3: 0.5}, dst_weights={3: 1.0})
            three = pool.submit(back.neighbor_allreduce, torch.full((2,), 3.0), name="mw.back",
                                self_weight=0.5, src_weights={0: 0.5}, dst_weights={0: 1.0})
            got, mine = zero.result(timeout=60), three.result(timeout=60)
        assert torch.equal(got, torch.full((2,), 2.0)) and torch.equal(mine, got)
    finally:
        back.close()


def _rank_three_comes_back(c: Any) -> T:
    """Close rank 3 (on the second daemon) and register it again in its job; returns the new
    client, once an op with rank 0 proves that both daemons heard it come back."""
    c.clients[3].close()
    back: T = dt.connect(f"unix://{c.sockets[1]}", 60, job=c.clients[0].job, local_rank=1)
    assert back.rank == 3
    c.clients[3] = back  # closed with the others when the test ends

    def pair(cl: T) -> torch.Tensor | None:
        if cl.rank not in (0, 3):
            return None
        other = 3 - cl.rank
        return cl.neighbor_allreduce(torch.full((2,), float(cl.rank)), name="mw.again",
                                     self_weight=0.5, src_weights={other: 0.5},
                                     dst_weights={other: 1.0}, timeout=30)

    got = c.run(pair)
    assert torch.equal(got[0], torch.full((2,), 1.5)) and torch.equal(got[3], got[0])
    return back


def _exchanges_with_rank_three(cl: T) -> torch.Tensor | None:
    """Ranks 0 and then 2 average with rank 3's window (across daemons, then on its own);
    rank 2's answer: ((3 + 0) / 2 + 2) / 2."""
    x = torch.full((4,), float(cl.rank), dtype=torch.float64)
    cl.win_create(x.clone(), "mw.xchg")
    got = None
    for turn, rank in enumerate((0, 2)):
        cl.barrier(name=f"mw.xchg.b{turn}")
        if cl.rank == rank:
            got = cl.win_exchange(x, "mw.xchg", peer=3, timeout=30)
    cl.barrier(name="mw.xchg.end")
    cl.win_free("mw.xchg")
    return got


def test_a_window_exchange_reaches_a_worker_that_came_back(cluster: ClusterFactory) -> None:
    # a worker that registers again counts its rounds from 0, and its peers place its rounds
    # afresh (decentd.net.late_rounds); its daemon's answers to window requests pair with no round,
    # so they must not wait for one to be placed
    c = cluster(2, "ring", 2)
    _rank_three_comes_back(c)
    got = c.run(_exchanges_with_rank_three)
    assert got[2] is not None and torch.equal(got[2], torch.full((4,), 1.75, dtype=torch.float64))


def test_a_worker_that_came_back_in_one_job_is_a_new_one_in_the_next(
        cluster: ClusterFactory) -> None:
    # the shared daemons go on: a later job's rank 3 is a new worker, whose rounds pair with
    # everyone's from round 0 (none placed afresh: its first op with rank 0 is at round 1)
    c = cluster(2, "ring", 2)
    job = c.clients[0].job
    _rank_three_comes_back(c)
    c.disconnect()
    c.connect(job=f"{job}-next")
    partners = [{0: 1, 1: 0, 2: 3, 3: 2}, {0: 3, 3: 0, 1: 2, 2: 1}]

    def pairs(cl: T) -> list[float]:
        out = []
        for rnd in partners:
            other = rnd[cl.rank]
            y = cl.neighbor_allreduce(torch.full((2,), float(cl.rank)), name="mw.pairs",
                                      self_weight=0.5, src_weights={other: 0.5},
                                      dst_weights={other: 1.0}, timeout=30)
            out.append(float(y[0]))
        return out

    assert c.run(pairs) == [[(r + rnd[r]) / 2 for rnd in partners] for r in range(4)]
    got = c.run(_exchanges_with_rank_three)
    assert got[2] is not None and torch.equal(got[2], torch.full((4,), 1.75, dtype=torch.float64))


def test_workers_of_one_node_that_disagree_fail_everywhere_naming_both(
        cluster: ClusterFactory) -> None:
    c = cluster(2, "ring", 2)

    def run(cl: T) -> Any:
        try:
            return cl.allreduce(torch.ones(3 + (cl.rank == 1)), name="mw.odd", timeout=30)
        except DecentError as err:
            return err

    for r, err in enumerate(c.run(run)):
        assert isinstance(err, DecentError) and err.code_name == "MISMATCH", (r, err)
        assert "'mw.odd'" in err.message and "float32[4]" in err.message, err.message
        assert "float32[3]" in err.message and "same node" in err.message, err.message


BIG = 2_500_001  # float32 elements: ~10 MB, three segments among the daemons (the last short)


def test_large_node_tensors_run_in_segments_exactly(cluster: ClusterFactory) -> None:
    # every element keeps its place: a segment delivered to the wrong offset, or the short
    # last one cut, changes some element
    c = cluster(2, "ring", 2)
    ramp = torch.arange(BIG, dtype=torch.float32)

    def run(cl: T) -> list[torch.Tensor]:
        mine = ramp + 1000.0 * cl.rank
        return [cl.hierarchical_neighbor_allreduce(mine, name="mw.seg.hier"),
                cl.allreduce(mine, name="mw.seg.avg"),
                cl.allreduce(mine, op="sum", name="mw.seg.sum"),
                cl.broadcast(mine, root=3, name="mw.seg.bcast")]

    for hier, avg, total, bcast in c.run(run):
        # machine means 500 and 2500 (plus the ramp), averaged on the 2-machine ring
        assert torch.equal(hier, ramp + 1500.0)
        assert torch.equal(avg, ramp + 1500.0)
        assert torch.equal(total, 4 * ramp + 6000.0)
        assert torch.equal(bcast, ramp + 3000.0)


@pytest.mark.parametrize("other", [1000, 1_500_000], ids=["one-segment", "two-segments"])
def test_daemons_whose_large_tensors_differ_fail_with_both_shapes(cluster: ClusterFactory,
                                                                 other: int) -> None:
    # segments carry the whole tensor's shape: MISMATCH names both, and the segments only
    # one side has stop with the rest instead of waiting out the (hour-long) timeout
    c = cluster(2, "ring", 2)

    def run(cl: T) -> Any:
        size = BIG if cl.machine_rank == 0 else other
        try:
            return cl.hierarchical_neighbor_allreduce(torch.ones(size), name="mw.seg.odd",
                                                      timeout=3600)
        except DecentError as err:
            return err

    for r, err in enumerate(c.run(run)):
        assert isinstance(err, DecentError) and err.code_name == "MISMATCH", (r, err)
        assert "'mw.seg.odd'" in err.message, err.message
        assert f"float32[{BIG}]" in err.message and f"float32[{other}]" in err.message, \
            err.message
    after = c.run(lambda cl: cl.hierarchical_neighbor_allreduce(
        torch.full((BIG,), float(cl.machine_rank)), name="mw.seg.after"))
    assert all(torch.equal(t, torch.full((BIG,), 0.5)) for t in after)


KILLED_WORKER = """
import sys, torch, decent.torch as dt
cl = dt.connect(sys.argv[1], 60, job=sys.argv[2], local_rank=1)
print("ready", cl.rank, flush=True)
cl.allreduce(torch.ones(3), name="mw.killed", timeout=3600)
"""


def test_a_killed_worker_fails_its_peers_and_spares_its_node(cluster: ClusterFactory) -> None:
    # rank 3 is a process of its own, killed while its node waits for it in an allreduce
    c = cluster(2, "ring", 2)
    c.clients[3].close()
    job = c.clients[0].job
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WORKER, f"unix://{c.sockets[1]}", job],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().split() == ["ready", "3"]
        deadline = time.monotonic() + 60
        while not any(w.rank == 3 and w.ops_in_flight for w in c.status(1).local_workers):
            assert time.monotonic() < deadline, "rank 3's allreduce never reached its daemon"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 60
    while any(w.rank == 3 for w in c.status(1).local_workers):  # the daemon saw it go
        assert time.monotonic() < deadline, "the daemon still lists the killed worker"
        time.sleep(0.05)

    def run(cl: T) -> Any:
        if cl.rank == 3:
            return None
        try:
            return cl.allreduce(torch.ones(3), name="mw.killed", timeout=3600)
        except DecentError as err:
            return err

    for r, err in enumerate(c.run(run)[:3]):
        assert isinstance(err, DecentError) and "rank 3 left" in err.message, (r, err)

    def pair(cl: T) -> torch.Tensor | None:  # the node's other worker and the daemons go on
        if cl.rank not in (1, 2):
            return None
        other = 3 - cl.rank
        return cl.neighbor_allreduce(torch.full((2,), float(cl.rank)), name="mw.killed.after",
                                     self_weight=0.5, src_weights={other: 0.5},
                                     dst_weights={other: 1.0})

    got = c.run(pair)
    assert torch.equal(got[1], torch.full((2,), 1.5)) and torch.equal(got[2], got[1])
