"""allgather, allreduce (direct and ring), broadcast and barrier through real daemons."""

from __future__ import annotations

import functools
import threading
import time

import numpy as np
import pytest
import torch

from conftest import ClusterFactory
from decent.core import Client

pytestmark = pytest.mark.slow


def test_neighbor_allgather_ring(cluster: ClusterFactory) -> None:
    c = cluster(4, "ring")

    def work(cl):  # type: ignore[no-untyped-def]
        h = cl.neighbor_allgather_async(torch.full((2, 3), float(cl.rank)), name="ag")
        return h.wait(), h.src_ranks

    for i, (out, srcs) in enumerate(c.run(work)):
        want_srcs = sorted({(i - 1) % 4, (i + 1) % 4})
        assert srcs == want_srcs
        assert out.shape == (2, 2, 3)
        for k, j in enumerate(want_srcs):
            assert torch.all(out[k] == j)


def test_neighbor_allgather_dynamic(cluster: ClusterFactory) -> None:
    c = cluster(4, "ring")

    def work(cl):  # type: ignore[no-untyped-def]
        r = cl.rank
        t = torch.arange(3, dtype=torch.int64) + 100 * r
        return cl.neighbor_allgather(t, name="agd", src_ranks=[(r + 2) % 4, (r + 3) % 4],
                                     dst_ranks=[(r + 2) % 4, (r + 1) % 4])

    for i, out in enumerate(c.run(work)):
        srcs = sorted([(i + 2) % 4, (i + 3) % 4])
        want = torch.stack([torch.arange(3) + 100 * j for j in srcs])
        assert torch.equal(out, want)


@pytest.mark.parametrize("numel", [1, 5, 1000, 300_000])  # 300k floats: above the ring threshold
@pytest.mark.parametrize("n", [4, 5])
def test_allreduce_average_and_sum(cluster: ClusterFactory, n: int, numel: int) -> None:
    c = cluster(n, "ring")
    rng = np.random.default_rng(numel + n)
    xs = [rng.integers(-1000, 1000, numel).astype(np.float64) for _ in range(n)]
    total = np.sum(xs, axis=0)
    avg = c.run(lambda cl: cl.allreduce(torch.from_numpy(xs[cl.rank]), name=f"ar{numel}"))
    sums = c.run(lambda cl: cl.allreduce(torch.from_numpy(xs[cl.rank]), op="sum",
                                         name=f"ars{numel}"))
    for i in range(n):
        np.testing.assert_array_equal(sums[i].numpy(), total)  # integers in float64: exact
        np.testing.assert_array_equal(avg[i].numpy(), total / n)  # the exact sum, divided once
        assert torch.equal(avg[i], avg[0]), "every rank must get bit-identical results"


@pytest.mark.parametrize("n", [3, 4])
def test_ring_average_in_place_divides_each_chunk_once(cluster: ClusterFactory, n: int) -> None:
    """In place, the ring sums in the tensor itself and only the rank that summed a chunk last
    divides it: every rank still ends with the correctly rounded average, bit for bit (n = 3:
    a division; n = 4: a multiplication by 1/4, exact)."""
    c = cluster(n, "ring")
    xs = [np.arange(300_000, dtype=np.float32) * (r + 1) - 7 * r for r in range(n)]
    total = np.sum(np.stack(xs).astype(np.float64), axis=0).astype(np.float32)  # exact here
    got = c.run(lambda cl: cl.allreduce_(torch.from_numpy(xs[cl.rank].copy()), name="avg_"))
    for out in got:
        np.testing.assert_array_equal(out.numpy(), total / np.float32(n))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float16, torch.bfloat16])
def test_allreduce_sum_dtypes(cluster: ClusterFactory, dtype: torch.dtype) -> None:
    c = cluster(4, "ring")
    def work(cl: Client[torch.Tensor], m: int) -> torch.Tensor:
        return cl.allreduce(torch.full((m,), cl.rank + 1, dtype=dtype), op="sum",
                            name=f"ard{dtype}{m}")

    for numel in (10, 200_000):  # direct and ring
        got = c.run(functools.partial(work, m=numel))
        for out in got:
            assert out.dtype == dtype and torch.all(out.double() == 10)


def reduced(cl: Client[torch.Tensor], xs: list[np.ndarray], op: str, name: str) -> torch.Tensor:
    return cl.allreduce(torch.from_numpy(xs[cl.rank]), op=op, name=name)


@pytest.mark.parametrize("numel", [6, 300_000])  # direct, and a ring above the threshold
def test_allreduce_min_max_and_product_are_exact(cluster: ClusterFactory, numel: int) -> None:
    c = cluster(4, "ring")
    rng = np.random.default_rng(numel)
    xs = [rng.integers(-3, 4, numel).astype(np.float64) for _ in range(4)]
    for op, want in (("min", np.min(xs, axis=0)), ("max", np.max(xs, axis=0)),
                     ("product", np.prod(xs, axis=0))):
        got = c.run(functools.partial(reduced, xs=xs, op=op, name=f"{op}{numel}"))
        for out in got:
            np.testing.assert_array_equal(out.numpy(), want)


def test_alltoall_sends_each_rank_its_rows(cluster: ClusterFactory) -> None:
    """Horovod's ``alltoall`` with uneven splits: rank r sends j + 1 rows to rank j, each row
    naming (sender, receiver), and gets r + 1 rows from each rank, in rank order."""
    c = cluster(3, "ring")

    def work(cl: Client[torch.Tensor]) -> torch.Tensor:
        rows = torch.tensor([[cl.rank, j] for j in range(3) for _ in range(j + 1)])
        return cl.alltoall(rows, splits=[1, 2, 3], name="a2a")

    for r, out in enumerate(c.run(work)):
        assert torch.equal(out, torch.tensor([[i, r] for i in range(3) for _ in range(r + 1)]))


def test_broadcast(cluster: ClusterFactory) -> None:
    c = cluster(5, "ring")
    def work(cl: Client[torch.Tensor], r: int) -> torch.Tensor:
        t = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (cl.rank + 1)
        return cl.broadcast(t, root=r, name="bc")

    for root in (0, 3):
        got = c.run(functools.partial(work, r=root))
        for out in got:
            assert torch.equal(out, torch.arange(12, dtype=torch.float32).reshape(3, 4)
                               * (root + 1))


def test_barrier_waits_for_everyone(cluster: ClusterFactory) -> None:
    c = cluster(4, "ring")
    arrived = threading.Event()  # rank 2 is about to enter the barrier

    def work(cl: Client[torch.Tensor]) -> bool:
        if cl.rank == 2:  # the last to come: the other daemons run their barrier already
            for other in (0, 1, 3):
                while not c.status(other).ops_in_flight:
                    time.sleep(0.01)
            arrived.set()
        cl.barrier(name="bar")
        return arrived.is_set()  # nobody left before rank 2 came

    assert c.run(work) == [True] * 4


def test_single_rank_cluster(cluster: ClusterFactory) -> None:
    c = cluster(1, "ring")
    t = torch.arange(4, dtype=torch.float64)
    cl = c.clients[0]
    assert (cl.rank, cl.size) == (0, 1)
    assert torch.equal(cl.neighbor_allreduce(t), t)
    assert torch.equal(cl.allreduce(t), t)
    assert torch.equal(cl.broadcast(t), t)
    cl.barrier()


def test_on_done_calls_back_once_when_the_op_finished(cluster: ClusterFactory) -> None:
    """``Handle.on_done``: called once the op finished (failed ones too), at once for an op
    that already has; never before (the torch backend wakes its completer thread with it)."""
    c = cluster(2, "ring")

    def work(cl: Client[torch.Tensor]) -> tuple[list[str], list[str]]:
        seen: list[str] = []
        h = cl.allreduce_async(torch.ones(3) * (cl.rank + 1), op="sum", name="od")
        h.on_done(lambda: seen.append(f"done={h.done()}"))
        out = h.wait()
        later: list[str] = []
        h.on_done(lambda: later.append("now"))
        assert float(out[0]) == 3.0
        return seen, later

    for seen, later in c.run(work):
        assert seen == ["done=True"] and later == ["now"]
