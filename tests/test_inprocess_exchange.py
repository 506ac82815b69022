"""Every way the daemon runs a neighbor_allreduce, with daemons in this process (test-fast).

The daemon picks the exchange by the call (docs/architecture.md, "Data path details"): whole
tensors out of place or in place; a lone in-neighbor's tensor folded in as it arrives; a pair of
ranks averaging by halves; the worker combining its own in-place result; receive-only calls that
leave their input out and land the neighbor's tensor in the output; large inputs streamed while
they are copied in and large results drained while they arrive. Each test checks the exact result
(inputs whose weighted sums are exact in float32, or numpy's float32 arithmetic in the daemon's
order) and that its variant ran, by the counters ``client.status()`` reports. Only the public
client API and those counters are used, so the tests hold across changes of the data path's
internals.

Sizes come from the documented thresholds (64 Ki elements for folding in; 8 MiB for streaming,
draining, combining and pairs) with room to spare. A tensor meant to arrive in several pieces is
larger than the kernel can buffer on one loopback connection (:func:`kernel_buffered_bytes`), so
its receiver cannot read it whole at once.

Which counter proves which variant: streaming in, ``inputs_streamed``; a receive-only call,
``inputs_left_out``; the worker combining, ``worker_results_combined``; an in-place call whose
result is its input, ``worker_results_unchanged``; fusion, ``ops_completed`` (one op for the
block). Three variants have no counter of their own and are proven by what only they do: a fold
while the tensor arrives and a landing in the output both make part of an in-place result final
before the op ends (``worker_results_drained_early_bytes``; only a fold or a landing can, when the
worker does not combine), and a pair step by halves is told from a whole exchange by
``worker_results_combined`` (the worker combines a whole exchange's lone in-neighbor, never a
pair's half).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from inprocess import InProcessCluster, NumpyClient, kernel_buffered_bytes, run_ranks, wait_for

from conftest import InProcessFactory

MiB = 1 << 20
#: a lone in-neighbor's tensor of this many elements or more is folded in as it arrives
FOLD_ELEMENTS = 64 << 10
#: private tensors this large stream in and (in place) drain out; pairs average them by halves
LARGE_BYTES = 8 * MiB
#: a tensor past every large-tensor threshold: 12 MiB of float32
BIG = 3 * LARGE_BYTES // 2 // 4
#: bytes of a tensor larger than one loopback connection can hold in its kernel buffers
HUGE = -(-(kernel_buffered_bytes() + 16 * MiB) // (4 * MiB)) * 4 * MiB
#: room for one HUGE tensor (or a BIG one twice), not for a HUGE one twice: an in-place call of
#: a HUGE tensor gets no second slot for its neighbor's tensor
ARENA = HUGE + 16 * MiB
PAIR = {"memory.arena_bytes": ARENA}
TRIO = {"memory.arena_bytes": 32 * MiB}

#: what each variant moves in ``client.status()`` (the worker's counters and its daemon's)
COUNTERS = ("ops_completed", "inputs_streamed", "inputs_left_out", "worker_results_unchanged",
            "worker_results_drained_early_bytes", "worker_results_combined")


def counters(cl: NumpyClient) -> dict[str, int]:
    """The counters of ``cl`` and its daemon now."""
    status = cl.status()
    return {name: int(getattr(status, name)) for name in COUNTERS}


def moved(cl: NumpyClient, before: dict[str, int]) -> dict[str, int]:
    """How far each counter moved since ``before`` (those that did not are left out)."""
    now = counters(cl)
    return {k: now[k] - before[k] for k in COUNTERS if now[k] != before[k]}


def ints(n: int, rank: int, scale: int = 4) -> np.ndarray:
    """Small integers in float32, different per rank and element, multiples of ``scale``: every
    weighted sum below (weights that are multiples of 1/scale) is exact."""
    return (((np.arange(n) % 1000) + 1000 * rank) * scale).astype(np.float32)


def noise(n: int, rank: int) -> np.ndarray:
    """float32 values with every mantissa bit in use (their sums round), fixed per rank."""
    return (np.random.default_rng(100 + rank).standard_normal(n) * 3.0).astype(np.float32)


def one_way(rank: int, weight: float = 1.0) -> dict[str, Any]:
    """Rank 0 sends (with ``weight``) and keeps its own; rank 1 keeps nothing of its own and
    sends nothing: it receives only."""
    if rank == 0:
        return dict(self_weight=1.0, src_weights={}, dst_weights={1: weight})
    return dict(self_weight=0.0, src_weights={0: 1.0}, dst_weights=[])


def both_ways(rank: int) -> dict[str, Any]:
    """Each of two ranks averages with the other, the weights given explicitly (the same as the
    ring's: but a call with explicit weights is never a pair step)."""
    return dict(self_weight=0.5, src_weights={1 - rank: 0.5})


def pair(inprocess: InProcessFactory) -> InProcessCluster:
    """Two daemons, on a ring (each the other's only neighbor, weights 1/2)."""
    return inprocess(2, settings=PAIR)


def after_peer_runs(c: InProcessCluster, peer: int, submitted: threading.Event) -> None:
    """Until ``peer``'s worker submitted and its daemon runs the op (what is sent to it from now
    on arrives while the op waits for it)."""
    assert submitted.wait(60), f"rank {peer} never submitted"
    wait_for(lambda: c.status(peer).ops_in_flight > 0, f"rank {peer}'s op to run")


# ---------------------------------------------------------------------- whole tensors

def test_out_of_place_sums_every_in_neighbor_in_rank_order(inprocess: InProcessFactory) -> None:
    # three ranks on a ring: two in-neighbors each, weights 1/3; inputs multiples of 3, so the
    # sum divided by 3 is exact. Nothing but the op itself is counted: no stream, no blank
    # input, no drain, no combine
    c = inprocess(3, settings=TRIO)

    def work(cl: NumpyClient) -> tuple[np.ndarray, dict[str, int]]:
        before = counters(cl)
        out = cl.neighbor_allreduce(ints(1000, cl.rank, 3), name="plain")
        return out.copy(), moved(cl, before)

    for r, (out, delta) in enumerate(run_ranks(c.clients, work)):
        want = (ints(1000, (r - 1) % 3, 3) + ints(1000, r, 3) + ints(1000, (r + 1) % 3, 3)) / 3
        np.testing.assert_array_equal(out, want.astype(np.float32))
        assert delta == {"ops_completed": 1}, (r, delta)


def test_out_of_place_with_scaled_weights_matches_numpy_bit_for_bit(
        inprocess: InProcessFactory) -> None:
    # weights that are not 1/k: each term is scaled (by the receiver's weight times the
    # sender's), then added in rank order, in float32
    c = inprocess(3, settings=TRIO)
    n = 3 * FOLD_ELEMENTS + 5  # past the combine block and the fold threshold: several passes

    def kw(r: int) -> dict[str, Any]:
        return dict(self_weight=0.25, src_weights={(r - 1) % 3: 0.125, (r + 1) % 3: 0.375},
                    dst_weights={(r - 1) % 3: 3.0, (r + 1) % 3: 0.5})

    def work(cl: NumpyClient) -> np.ndarray:
        return cl.neighbor_allreduce(noise(n, cl.rank), name="scaled", **kw(cl.rank)).copy()

    for r, out in enumerate(run_ranks(c.clients, work)):
        lo, hi = sorted(((r - 1) % 3, (r + 1) % 3))
        # rank j sent with its dst weight for r: rank r-1 sends to r+1 of its own (0.5), r+1 to
        # its r-1 (3.0)
        sent = {(r - 1) % 3: 0.5, (r + 1) % 3: 3.0}
        want: np.ndarray = noise(n, r) * np.float32(0.25)
        for j in (lo, hi):
            want = want + noise(n, j) * np.float32(kw(r)["src_weights"][j] * sent[j])
        np.testing.assert_array_equal(out, want)


def test_in_place_writes_the_result_into_the_tensor(inprocess: InProcessFactory) -> None:
    c = inprocess(3, settings=TRIO)

    def work(cl: NumpyClient) -> tuple[bool, np.ndarray, dict[str, int]]:
        before = counters(cl)
        mine = ints(1000, cl.rank, 3)
        same = cl.neighbor_allreduce_(mine, name="inplace") is mine
        return same, mine, moved(cl, before)

    for r, (same, mine, delta) in enumerate(run_ranks(c.clients, work)):
        want = (ints(1000, (r - 1) % 3, 3) + ints(1000, r, 3) + ints(1000, (r + 1) % 3, 3)) / 3
        assert same, r
        np.testing.assert_array_equal(mine, want.astype(np.float32))
        assert delta == {"ops_completed": 1}, (r, delta)


def test_fused_tensors_go_as_one_op_with_exact_results(inprocess: InProcessFactory) -> None:
    # several tensors in one request (one op per daemon): dtypes and sizes of their own
    c = inprocess(2, settings=PAIR)
    sizes = [(1, np.float32), (1000, np.float64), (FOLD_ELEMENTS + 1, np.float32), (7, np.int64)]

    def tensors(rank: int) -> list[np.ndarray]:
        return [ints(n, rank).astype(dtype) for n, dtype in sizes]

    def work(cl: NumpyClient) -> tuple[list[np.ndarray], dict[str, int]]:
        before = counters(cl)
        with cl.fused():
            handles = [cl.neighbor_allreduce_async(t, name=f"f{i}", **both_ways(cl.rank))
                       for i, t in enumerate(tensors(cl.rank))]
        outs = [h.wait().copy() for h in handles]
        return outs, moved(cl, before)

    for r, (outs, delta) in enumerate(run_ranks(c.clients, work)):
        for out, a, b in zip(outs, tensors(0), tensors(1), strict=True):
            assert out.dtype == a.dtype
            np.testing.assert_array_equal(out, ((a + b) // 2 if a.dtype == np.int64
                                                else (a + b) / 2).astype(a.dtype))
        assert delta == {"ops_completed": 1}, (r, delta)


def test_an_in_place_call_that_keeps_its_own_tensor_copies_nothing_back(
        inprocess: InProcessFactory) -> None:
    # rank 0 sends and adds nothing (self_weight 1, no sources): its tensor is its result as
    # it is (worker_results_unchanged); rank 1 averages it in
    c = pair(inprocess)

    def work(cl: NumpyClient) -> tuple[np.ndarray, dict[str, int]]:
        before = counters(cl)
        mine = ints(1000, cl.rank)
        kw = one_way(0) if cl.rank == 0 else dict(self_weight=0.5, src_weights={0: 0.5},
                                                   dst_weights=[])
        assert cl.neighbor_allreduce_(mine, name="keep", **kw) is mine
        return mine, moved(cl, before)

    (mine0, delta0), (mine1, delta1) = run_ranks(c.clients, work)
    np.testing.assert_array_equal(mine0, ints(1000, 0))
    np.testing.assert_array_equal(mine1, (ints(1000, 0) + ints(1000, 1)) / 2)
    assert delta0 == {"ops_completed": 1, "worker_results_unchanged": 1}, delta0
    assert delta1 == {"ops_completed": 1}, delta1


# ---------------------------------------------------------------------- a lone in-neighbor

@pytest.mark.parametrize("n", [FOLD_ELEMENTS - 1, FOLD_ELEMENTS, FOLD_ELEMENTS + 1, BIG + 3])
def test_a_lone_in_neighbors_tensor_is_folded_in_exactly(inprocess: InProcessFactory,
                                                          n: int) -> None:
    # one in-neighbor each (explicit weights: not a pair step), out of place, below, at and
    # above the fold threshold: the same bits as numpy, uniform (sum, halved) and scaled
    c = pair(inprocess)

    def work(cl: NumpyClient) -> tuple[np.ndarray, np.ndarray]:
        r = cl.rank
        uniform = cl.neighbor_allreduce(noise(n, r), name="u", **both_ways(r)).copy()
        scaled = cl.neighbor_allreduce(noise(n, r), name="s", self_weight=0.25,
                                       src_weights={1 - r: 0.375},
                                       dst_weights={1 - r: 2.0}).copy()
        return uniform, scaled

    for r, (uniform, scaled) in enumerate(run_ranks(c.clients, work)):
        x, y = noise(n, r), noise(n, 1 - r)
        np.testing.assert_array_equal(uniform, (x + y) * np.float32(0.5))
        np.testing.assert_array_equal(scaled, x * np.float32(0.25) + y * np.float32(0.75))


def test_a_lone_in_neighbors_tensor_is_folded_in_while_it_arrives(
        inprocess: InProcessFactory) -> None:
    # rank 1 averages in place with rank 0, which only sends. Rank 1's tensor fills its arena
    # (no second slot: the worker cannot combine it itself), and rank 0's tensor, larger than
    # the kernel buffers, arrives in pieces while rank 1's op waits for it: the daemon folds
    # each piece into the result as it comes and the worker copies that much out before the
    # op ends (worker_results_drained_early_bytes). Neither is true of a tensor combined once
    # it is all there
    c = pair(inprocess)
    n = HUGE // 4
    submitted = threading.Event()

    def work(cl: NumpyClient) -> tuple[np.ndarray, dict[str, int]]:
        before = counters(cl)
        if cl.rank == 0:
            after_peer_runs(c, 1, submitted)
            out = cl.neighbor_allreduce(ints(n, 0), name="fold", **one_way(0))
            ok = np.array_equal(out, ints(n, 0))
            del out  # its arena slot
            assert ok
            return np.empty(0), moved(cl, before)
        mine = ints(n, 1)
        handle = cl.neighbor_allreduce_async_(mine, name="fold", self_weight=0.5,
                                              src_weights={0: 0.5}, dst_weights=[], fuse=False)
        submitted.set()
        handle.wait()
        return mine, moved(cl, before)

    (_, delta0), (mine, delta1) = run_ranks(c.clients, work)
    np.testing.assert_array_equal(mine, (ints(n, 0) + ints(n, 1)) / 2)
    assert delta0 == {"ops_completed": 1, "inputs_streamed": 1}, delta0
    early = delta1.pop("worker_results_drained_early_bytes", 0)
    assert 0 < early < HUGE, early
    assert delta1 == {"ops_completed": 1, "inputs_streamed": 1}, delta1


def test_the_worker_combines_its_own_in_place_result(inprocess: InProcessFactory) -> None:
    # in place, a large private tensor with a lone in-neighbor and room for a second slot: the
    # daemon receives the neighbor's tensor into that slot and the worker computes its result
    # itself (worker_results_combined), with the daemon's bits: the same call out of place is
    # combined by the daemon, and both are numpy's float32 arithmetic in the same order
    c = pair(inprocess)

    def kw(r: int) -> dict[str, Any]:
        return dict(self_weight=0.25, src_weights={1 - r: 0.375}, dst_weights={1 - r: 2.0})

    def work(cl: NumpyClient) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
        r = cl.rank
        before = counters(cl)
        mine = noise(BIG, r)
        assert cl.neighbor_allreduce_(mine, name="ip", **kw(r)) is mine
        delta = moved(cl, before)
        out = cl.neighbor_allreduce(noise(BIG, r), name="oop", **kw(r)).copy()
        return mine, out, delta

    for r, (mine, out, delta) in enumerate(run_ranks(c.clients, work)):
        want = noise(BIG, r) * np.float32(0.25) + noise(BIG, 1 - r) * np.float32(0.75)
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(mine, want)
        assert delta.pop("worker_results_combined", 0) == 1, (r, delta)
        delta.pop("worker_results_drained_early_bytes", None)  # as the pieces came: any
        assert delta == {"ops_completed": 1, "inputs_streamed": 1}, (r, delta)


def test_the_worker_combines_a_tensor_that_arrived_before_its_call(
        inprocess: InProcessFactory) -> None:
    # rank 1 calls only once rank 0's whole tensor waits at its daemon (early_arrival_bytes):
    # the daemon copies it into the call's second slot and the worker still combines
    c = pair(inprocess)
    base = c.status(1).early_arrival_bytes

    def work(cl: NumpyClient) -> tuple[np.ndarray, dict[str, int]]:
        before = counters(cl)
        if cl.rank == 0:
            out = cl.neighbor_allreduce(ints(BIG, 0), name="early", **one_way(0))
            ok = np.array_equal(out, ints(BIG, 0))
            del out
            assert ok
            return np.empty(0), moved(cl, before)
        wait_for(lambda: cl.status().early_arrival_bytes - base >= BIG * 4,
                 "rank 0's tensor to wait at rank 1's daemon")
        mine = ints(BIG, 1)
        cl.neighbor_allreduce_(mine, name="early", self_weight=0.5, src_weights={0: 0.5},
                               dst_weights=[])
        return mine, moved(cl, before)

    _, (mine, delta) = run_ranks(c.clients, work)
    np.testing.assert_array_equal(mine, (ints(BIG, 0) + ints(BIG, 1)) / 2)
    assert delta.pop("worker_results_combined", 0) == 1, delta
    delta.pop("worker_results_drained_early_bytes", None)
    assert delta == {"ops_completed": 1, "inputs_streamed": 1}, delta


# ---------------------------------------------------------------------- pairs by halves

def test_a_pair_averages_large_tensors_by_halves(inprocess: InProcessFactory) -> None:
    # two ranks on one host, each the other's only neighbor with the ring's weights: a large
    # tensor is averaged by halves (each rank combines one half and sends it back), which the
    # worker never combines itself. The same call with the same weights given explicitly is
    # not a pair step: a whole exchange, whose lone in-neighbor's tensor the worker combines.
    # So worker_results_combined tells the two apart, and at most half a tensor drains early
    c = pair(inprocess)

    def work(cl: NumpyClient) -> tuple[list[np.ndarray], list[dict[str, int]]]:
        r = cl.rank
        got, deltas = [], []
        for name, kw in (("halves", {}), ("whole", both_ways(r))):
            before = counters(cl)
            mine = ints(BIG, r)
            assert cl.neighbor_allreduce_(mine, name=name, **kw) is mine
            got.append(mine)
            deltas.append(moved(cl, before))
        return got, deltas

    for r, (got, (halves, whole)) in enumerate(run_ranks(c.clients, work)):
        for out in got:
            np.testing.assert_array_equal(out, (ints(BIG, 0) + ints(BIG, 1)) / 2)
        assert halves.pop("worker_results_drained_early_bytes", 0) <= BIG * 4 // 2, r
        assert halves == {"ops_completed": 1, "inputs_streamed": 1}, (r, halves)
        whole.pop("worker_results_drained_early_bytes", None)
        assert whole == {"ops_completed": 1, "inputs_streamed": 1,
                         "worker_results_combined": 1}, (r, whole)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.float64])
def test_pair_halves_are_exact_for_odd_sizes_and_every_dtype(inprocess: InProcessFactory,
                                                             dtype: type) -> None:
    # out of place, an odd number of elements (the halves differ by one), past 8 MiB
    c = pair(inprocess)
    n = LARGE_BYTES // np.dtype(dtype).itemsize + 1

    def values(r: int) -> np.ndarray:
        return ((np.arange(n) % 7) * 4 * (r + 1)).astype(dtype)

    def work(cl: NumpyClient) -> np.ndarray:
        return cl.neighbor_allreduce(values(cl.rank), name="odd").copy()

    for out in run_ranks(c.clients, work):
        assert out.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(out, ((np.arange(n) % 7) * 6).astype(dtype))


# ---------------------------------------------------------------------- receive-only calls

@pytest.mark.parametrize("in_place", [False, True], ids=["out-of-place", "in-place"])
def test_a_receive_only_call_leaves_its_input_out(inprocess: InProcessFactory,
                                                  in_place: bool) -> None:
    # rank 1 keeps nothing of its own and sends nothing: its input is never read, so its worker
    # does not copy it in (inputs_left_out); rank 0's tensor, sent with weight 2, is scaled by
    # 0.25 in rank 1's output
    c = pair(inprocess)

    def work(cl: NumpyClient) -> tuple[np.ndarray, dict[str, int]]:
        before = counters(cl)
        if cl.rank == 0:
            out = cl.neighbor_allreduce(ints(1000, 0), name="ro", **one_way(0, 2.0)).copy()
            return out, moved(cl, before)
        mine = np.full(1000, np.nan, np.float32)
        kw: dict[str, Any] = dict(self_weight=0.0, src_weights={0: 0.25}, dst_weights=[])
        out = cl.neighbor_allreduce_(mine, name="ro", **kw) if in_place \
            else cl.neighbor_allreduce(mine, name="ro", **kw).copy()
        assert (out is mine) == in_place
        return out, moved(cl, before)

    (out0, delta0), (out1, delta1) = run_ranks(c.clients, work)
    np.testing.assert_array_equal(out0, ints(1000, 0))
    np.testing.assert_array_equal(out1, ints(1000, 0) / 2)
    assert delta0 == {"ops_completed": 1}, delta0
    assert delta1 == {"ops_completed": 1, "inputs_left_out": 1}, delta1


def test_a_receive_only_result_lands_in_the_output_and_drains_as_it_arrives(
        inprocess: InProcessFactory) -> None:
    # rank 1 receives rank 0's tensor with weight 1, in place, into a tensor of NaN: the tensor
    # lands in the output as it is, so each piece is final as it lands and the worker copies it
    # out before the op ends (worker_results_drained_early_bytes); its input was left out
    c = pair(inprocess)
    n = HUGE // 4
    submitted = threading.Event()

    def work(cl: NumpyClient) -> tuple[np.ndarray, dict[str, int]]:
        before = counters(cl)
        if cl.rank == 0:
            after_peer_runs(c, 1, submitted)
            out = cl.neighbor_allreduce(ints(n, 0), name="land", **one_way(0))
            ok = np.array_equal(out, ints(n, 0))
            del out
            assert ok
            return np.empty(0), moved(cl, before)
        mine = np.full(n, np.nan, np.float32)
        handle = cl.neighbor_allreduce_async_(mine, name="land", fuse=False, **one_way(1))
        submitted.set()
        handle.wait()
        return mine, moved(cl, before)

    (_, delta0), (mine, delta1) = run_ranks(c.clients, work)
    np.testing.assert_array_equal(mine, ints(n, 0))
    assert delta0 == {"ops_completed": 1, "inputs_streamed": 1}, delta0
    early = delta1.pop("worker_results_drained_early_bytes", 0)
    assert 0 < early < HUGE, early
    assert delta1 == {"ops_completed": 1, "inputs_left_out": 1}, delta1


# ---------------------------------------------------------------------- streaming in

@pytest.mark.parametrize("in_place", [False, True], ids=["out-of-place", "in-place"])
def test_large_private_inputs_are_streamed_while_copied_in(inprocess: InProcessFactory,
                                                           in_place: bool) -> None:
    # three large calls each go out while their tensor is copied in (inputs_streamed); a
    # small one (1 MiB) is copied first
    c = pair(inprocess)
    shapes: list[tuple[int, ...]] = [(BIG,), (BIG // 1024, 1024), (BIG + 1,), (MiB // 4,)]

    def values(r: int, shape: tuple[int, ...]) -> np.ndarray:
        return ints(int(np.prod(shape)), r).reshape(shape)

    def work(cl: NumpyClient) -> tuple[list[bool], dict[str, int]]:
        r = cl.rank
        before, ok = counters(cl), []
        for i, shape in enumerate(shapes):
            mine = values(r, shape)
            if in_place:
                out = cl.neighbor_allreduce_(mine, name=f"s{i}", **both_ways(r))
                ok.append(out is mine)
            else:
                out = cl.neighbor_allreduce(mine, name=f"s{i}", **both_ways(r))
            ok.append(out.shape == shape and
                      np.array_equal(out, (values(0, shape) + values(1, shape)) / 2))
            del out  # its arena slot
        return ok, moved(cl, before)

    for r, (ok, delta) in enumerate(run_ranks(c.clients, work)):
        assert all(ok), (r, ok)
        delta.pop("worker_results_drained_early_bytes", None)
        combined = delta.pop("worker_results_combined", 0)
        assert combined == (3 if in_place else 0), (r, combined)
        assert delta == {"ops_completed": 4, "inputs_streamed": 3}, (r, delta)
