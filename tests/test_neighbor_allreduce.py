"""neighbor_allreduce through real daemons equals W @ x computed independently in numpy; an async
handle returns at once, and the time spent blocked on one is counted."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from conftest import ClusterFactory

pytestmark = pytest.mark.slow


def expected_matrix(kind: str, n: int) -> np.ndarray:
    """Mixing matrix from the definitions (not from decent_wire.topology): uniform 1/(indeg+1)."""
    hops = [1 << k for k in range(n.bit_length()) if (1 << k) < n]
    senders: dict[int, set[int]] = {i: set() for i in range(n)}
    for i in range(n):
        if kind == "ring":
            targets = {(i + 1) % n, (i - 1) % n}
        elif kind == "exponential":
            targets = {(i + h) % n for h in hops}
        elif kind == "hypercube":
            targets = {i ^ h for h in hops}
        else:
            raise ValueError(kind)
        for t in targets - {i}:
            senders[t].add(i)
    w = np.zeros((n, n))
    for i in range(n):
        share = 1.0 / (len(senders[i]) + 1)
        w[i, i] = share
        for j in senders[i]:
            w[i, j] = share
    return w


def inputs(n: int, shape: tuple[int, ...], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape) for _ in range(n)]


CASES = [(kind, n) for kind in ("ring", "exponential", "hypercube") for n in (4, 5, 8)
         if not (kind == "hypercube" and n == 5)]


@pytest.mark.parametrize(("kind", "n"), CASES)
def test_matches_w_times_x(cluster: ClusterFactory, kind: str, n: int) -> None:
    c = cluster(n, kind)
    xs = inputs(n, (3, 5), seed=n)
    w = expected_matrix(kind, n)
    want = np.einsum("ij,jab->iab", w, np.stack(xs))
    got = c.run(lambda cl: cl.neighbor_allreduce(torch.from_numpy(xs[cl.rank]), name=f"w{kind}"))
    for i in range(n):
        assert got[i].dtype == torch.float64 and got[i].shape == (3, 5)
        np.testing.assert_allclose(got[i].numpy(), want[i], rtol=1e-12, atol=1e-12)
    neighbors = c.run(lambda cl: cl.in_neighbors())
    for i in range(n):
        assert neighbors[i] == [j for j in range(n) if j != i and w[i, j] > 0]


def test_hypercube_needs_power_of_two(tmp_path: object) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "decentd", "--rank", "0", "--peers",
         ",".join(f"127.0.0.1:{p}" for p in (47611, 47612, 47613, 47614, 47615)),
         "--topology", "hypercube"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode != 0
    assert "hypercube" in proc.stderr and "power-of-two" in proc.stderr and "5" in proc.stderr


def test_async_handle_returns_at_once_and_keeps_device_dtype(cluster: ClusterFactory) -> None:
    c = cluster(4, "ring")

    def work(cl):  # type: ignore[no-untyped-def]
        t = torch.full((2, 2), 3.0 * cl.rank, dtype=torch.float32)
        h = cl.neighbor_allreduce_async(t, name="async")
        out = h.wait(timeout=30)
        assert h.done()
        return out

    got = c.run(work)
    for i, out in enumerate(got):
        assert out.dtype == torch.float32 and out.device.type == "cpu"
        assert torch.all(out == (i - 1) % 4 + i + (i + 1) % 4)


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64]
)
def test_dtypes(cluster: ClusterFactory, dtype: torch.dtype) -> None:
    c = cluster(4, "ring")
    # values chosen so each weighted average is exactly representable: ranks hold 0, 3, 6, 9
    got = c.run(lambda cl: cl.neighbor_allreduce(
        torch.full((7,), 3 * cl.rank, dtype=dtype), name=f"dt{dtype}"))
    for i, out in enumerate(got):
        want = (3 * ((i - 1) % 4) + 3 * i + 3 * ((i + 1) % 4)) / 3
        assert out.dtype == dtype and out.shape == (7,)
        assert torch.all(out.double() == want), (dtype, i, out)


@pytest.mark.parametrize("shape", [(), (0,), (1,), (2, 3, 4), (1000, 17)])
def test_shapes(cluster: ClusterFactory, shape: tuple[int, ...]) -> None:
    c = cluster(4, "ring")
    xs = inputs(4, shape, seed=1)
    w = expected_matrix("ring", 4)
    got = c.run(lambda cl: cl.neighbor_allreduce(torch.from_numpy(xs[cl.rank]), name=f"s{shape}"))
    for i in range(4):
        want = sum(w[i, j] * xs[j] for j in range(4))
        assert tuple(got[i].shape) == shape
        np.testing.assert_allclose(got[i].numpy(), want, rtol=1e-12, atol=1e-12)


def test_one_peer_exponential_reaches_exact_average(cluster: ClusterFactory) -> None:
    c = cluster(8, "one-peer-exponential")
    xs = inputs(8, (16,), seed=3)
    mean = np.mean(xs, axis=0)

    def work(cl):  # type: ignore[no-untyped-def]
        t = torch.from_numpy(xs[cl.rank])
        seen = []
        for _ in range(3):  # log2(8) rounds
            seen.append(cl.in_neighbors("onepeer"))
            t = cl.neighbor_allreduce(t, name="onepeer")
        return t, seen

    got = c.run(work)
    for i, (t, seen) in enumerate(got):
        assert seen == [[(i - 1) % 8], [(i - 2) % 8], [(i - 4) % 8]]
        np.testing.assert_allclose(t.numpy(), mean, rtol=1e-12, atol=1e-12)


def test_per_call_weights_static_edges(cluster: ClusterFactory) -> None:
    c = cluster(4, "ring")
    xs = inputs(4, (6,), seed=4)

    def work(cl):  # type: ignore[no-untyped-def]
        r = cl.rank
        left, right = (r - 1) % 4, (r + 1) % 4
        return cl.neighbor_allreduce(torch.from_numpy(xs[r]), name="pcw", self_weight=0.5,
                                     src_weights={left: 0.3, right: 0.2})

    got = c.run(work)
    for i in range(4):
        want = 0.5 * xs[i] + 0.3 * xs[(i - 1) % 4] + 0.2 * xs[(i + 1) % 4]
        np.testing.assert_allclose(got[i].numpy(), want, rtol=1e-12, atol=1e-12)


def test_per_call_dynamic_dst_weights(cluster: ClusterFactory) -> None:
    # on a ring topology, a dynamic call may use any edges: i sends to i+2 with dst weight 2
    c = cluster(4, "ring")
    xs = inputs(4, (5,), seed=5)

    def work(cl):  # type: ignore[no-untyped-def]
        r = cl.rank
        return cl.neighbor_allreduce(torch.from_numpy(xs[r]), name="dyn", self_weight=0.25,
                                     src_weights={(r + 2) % 4: 0.375},
                                     dst_weights={(r + 2) % 4: 2.0})

    got = c.run(work)
    for i in range(4):
        want = 0.25 * xs[i] + 0.375 * 2.0 * xs[(i + 2) % 4]
        np.testing.assert_allclose(got[i].numpy(), want, rtol=1e-12, atol=1e-12)


def test_dynamic_directed_pairs(cluster: ClusterFactory) -> None:
    # rank 0 only sends, rank 1 only receives (from 0), others idle with empty weights
    c = cluster(4, "ring")

    def work(cl):  # type: ignore[no-untyped-def]
        t = torch.tensor([float(cl.rank + 1)], dtype=torch.float64)
        if cl.rank == 0:
            return cl.neighbor_allreduce(t, name="pair", self_weight=1.0, src_weights={},
                                         dst_weights=[1])
        if cl.rank == 1:
            return cl.neighbor_allreduce(t, name="pair", self_weight=0.5, src_weights={0: 0.5},
                                         dst_weights=[])
        return cl.neighbor_allreduce(t, name="pair", self_weight=1.0, src_weights={},
                                     dst_weights=[])

    got = c.run(work)
    assert [float(g) for g in got] == [1.0, 1.5, 3.0, 4.0]


def test_non_contiguous_and_grad_tensors(cluster: ClusterFactory) -> None:
    c = cluster(4, "ring")
    xs = inputs(4, (4, 6), seed=11)
    w = expected_matrix("ring", 4)

    def work(cl):  # type: ignore[no-untyped-def]
        base = torch.from_numpy(xs[cl.rank].T.copy()).requires_grad_(True)
        t = base.t()  # a non-contiguous view of x_i, part of an autograd graph
        assert not t.is_contiguous()
        return cl.neighbor_allreduce(t, name="noncontig")

    for i, out in enumerate(c.run(work)):
        # part of the graph: its gradient is the transposed op (tests/test_gradients.py)
        assert out.requires_grad and out.shape == (4, 6)
        want = (w[i] @ np.stack(xs).reshape(4, -1)).reshape(4, 6)
        np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-12, atol=1e-12)


def test_blocked_seconds_count_waits_on_unfinished_ops_only(cluster: ClusterFactory) -> None:
    """``client.blocked_seconds``: a wait on an op a peer has not joined yet counts (a timed-out
    one too); a wait on an op already finished adds nothing."""
    c = cluster(2, "ring")
    timed_out = threading.Event()

    def work(cl):  # type: ignore[no-untyped-def]
        x = torch.full((4,), float(cl.rank))
        if cl.rank == 1:
            assert timed_out.wait(60)  # rank 0 has been blocked on "late": join it now
            cl.allreduce(x, name="late")
            return cl.allreduce(x, name="finished")
        h = cl.allreduce_async(x, name="late")
        before = cl.blocked_seconds
        with pytest.raises(TimeoutError):
            h.wait(timeout=0.2)  # rank 1 has not submitted "late": this cannot finish
        after_timeout = cl.blocked_seconds
        timed_out.set()
        late = h.wait(timeout=60)
        after_late = cl.blocked_seconds
        done = cl.allreduce_async(x, name="finished")
        while not done.done():  # until the completion is in, then a wait blocks on nothing
            time.sleep(0.01)
        finished = done.wait()
        return before, after_timeout, after_late, cl.blocked_seconds, late, finished

    (before, after_timeout, after_late, end, late, finished), theirs = c.run(work)
    assert before == 0.0
    assert after_timeout - before >= 0.2 * 0.99  # the lock's timeout, on the same clock family
    assert after_late >= after_timeout
    assert end == after_late  # the finished op's wait added nothing
    assert torch.equal(late, torch.full((4,), 0.5)) and torch.equal(finished, late)
    assert torch.equal(theirs, late)
