"""A large private input goes out while it is copied into the arena (issue 27, point 2).

The client sends the request first and copies the tensor in chunks, telling the daemon after
each; the daemon's sender threads write each chunk as soon as it is in. Results are exact on every
path of neighbor_allreduce; the first chunk is on the wire before the rest is copied; a worker
that stops copying fails its op by the timeout and the link carries the next op whole. An
in-place result with a lone in-neighbor is combined by the worker itself, with the daemon's bits.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
import torch

import decent.core.requests.placement as placement
from cluster import Cluster, delay, run_each, tf_cluster, until
from conftest import ClusterFactory
from decent_wire.errors import DecentError
from decent_wire.v1 import decent_pb2 as pb

pytestmark = pytest.mark.slow

NUMEL = 3 * placement.STREAM_MIN_BYTES // 4 // 2  # 12 MiB of float32: six chunks
CHUNK = placement.STREAM_CHUNK


def values(rank: int) -> torch.Tensor:
    """Exact small integers, different per rank and per element."""
    return (torch.arange(NUMEL, dtype=torch.float32) % 1000) + 1000.0 * rank


def one_peer(rank: int, size: int) -> dict[str, Any]:
    """Send to the next rank, receive from the previous one, half each (one in-neighbor)."""
    return dict(self_weight=0.5, src_weights={(rank - 1) % size: 0.5},
                dst_weights=[(rank + 1) % size])


def one_way(rank: int, size: int) -> dict[str, Any]:
    """Rank 0 sends to rank 1, which keeps nothing of its own (its result is rank 0's)."""
    if rank == 0:
        return dict(self_weight=1.0, src_weights={}, dst_weights=[1])
    return dict(self_weight=0.0, src_weights={0: 1.0}, dst_weights=[])


def expected(rank: int, size: int, path: str) -> torch.Tensor:
    if path == "pair":
        return sum(values(r) for r in range(size)) / size  # type: ignore[return-value]
    if path == "one-peer":
        return (values(rank) + values((rank - 1) % size)) / 2
    return values(0)


PATHS: dict[str, tuple[int, Callable[[int, int], dict[str, Any]] | None]] = {
    "pair": (2, None),  # two ranks on one host, topology weights: averaged by halves
    "one-peer": (3, one_peer),  # one in-neighbor: folded in while it arrives
    "one-way": (2, one_way),  # rank 1 receives straight into its output
}


@contextlib.contextmanager
def copy_held(cl: Any, at: int, done: Callable[[], bool], held: threading.Event
              ) -> Iterator[None]:
    """Inside: ``cl``'s client stops before it tells its daemon that ``at`` bytes are copied
    in, until ``done()`` (at most 30 s), then sets ``held``."""
    send = cl._submitter._send_request

    def hold(req: pb.SubmitRequest) -> None:
        if req.WhichOneof("op") == "fill" and req.fill.bytes == at:
            deadline = time.monotonic() + 30
            while not done() and time.monotonic() < deadline:
                time.sleep(0.01)
            held.set()
        send(req)

    cl._submitter._send_request = hold
    try:
        yield
    finally:
        cl._submitter._send_request = send


@pytest.mark.parametrize("in_place", [False, True], ids=["out-of-place", "in-place"])
@pytest.mark.parametrize("path", list(PATHS))
def test_a_large_private_input_is_streamed_and_the_result_is_exact(
        cluster: ClusterFactory, path: str, in_place: bool) -> None:
    size, weights = PATHS[path]
    c = cluster(size)

    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        kw = {} if weights is None else weights(cl.rank, size)
        before = cl.status().inputs_streamed  # the daemons may have run other tests
        got = []
        for _ in range(3):
            x = values(cl.rank)
            got.append(cl.neighbor_allreduce_(x, name="s", **kw) if in_place
                       else cl.neighbor_allreduce(x, name="s", **kw))
        return got, cl.status().inputs_streamed - before

    for rank, (got, streamed) in enumerate(c.run(work)):
        # every call went out while it was copied in, but a receive-only call's input, which
        # is never read, is not copied at all
        assert streamed == (0 if path == "one-way" and rank == 1 else 3), rank
        for out in got:
            assert torch.equal(out, expected(rank, size, path)), rank


def test_the_first_chunk_is_on_the_wire_before_the_rest_is_copied(
        cluster: ClusterFactory) -> None:
    # rank 0's client stops after its first chunk until its daemon has sent that chunk to rank
    # 1: it can only get there if the daemon sends before the copy ends
    c = cluster(2)
    held = threading.Event()

    def sent_to_peer(cl) -> int:  # type: ignore[no-untyped-def]
        return sum(p.bytes_sent for p in cl.status().peers if p.rank == 1)

    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        kw = one_way(cl.rank, 2)
        if cl.rank == 1:
            return cl.neighbor_allreduce(values(1), name="w", **kw)
        before = sent_to_peer(cl)
        with copy_held(cl, 2 * CHUNK, lambda: sent_to_peer(cl) - before >= CHUNK, held):
            return cl.neighbor_allreduce(values(0), name="w", **kw), sent_to_peer(cl) - before

    (out0, sent), out1 = c.run(work)
    assert held.is_set()
    assert torch.equal(out1, values(0)) and torch.equal(out0, values(0))
    assert c.status(0).inputs_streamed_early_bytes >= CHUNK  # cumulative, but >= this op's
    assert sent >= NUMEL * 4


def test_an_in_place_result_is_copied_out_while_the_rest_arrives(
        cluster: ClusterFactory) -> None:
    # rank 0 sends; its client stops before it says the fifth chunk is in (the daemon has sent
    # 8 MiB) until rank 1's client has copied part of its result out: rank 1's op cannot end
    # before rank 0 goes on, so that part was copied out while the rest was still to come
    c = cluster(2)
    held = threading.Event()

    def drained(cl) -> int:  # type: ignore[no-untyped-def]
        return int(cl.status().worker_results_drained_early_bytes)

    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        kw = one_way(cl.rank, 2)
        if cl.rank == 1:
            before = drained(cl)
            t = torch.full((NUMEL,), float("nan"))
            out = cl.neighbor_allreduce_(t, name="d", **kw)
            return out is t, t, drained(cl) - before
        other = c.clients[1]
        before = drained(other)
        # rank 1's op waits for the tensor before it comes (else it lands elsewhere first)
        until(lambda: c.status(1).ops_in_flight > 0, "rank 1's op to run")
        with copy_held(cl, 5 * CHUNK, lambda: drained(other) - before >= CHUNK, held):
            return cl.neighbor_allreduce_(values(0), name="d", **kw)

    out0, (same, out1, early) = c.run(work)
    assert held.is_set()
    assert torch.equal(out0, values(0)) and same and torch.equal(out1, values(0))
    assert CHUNK <= early < NUMEL * 4


def test_a_worker_that_stops_copying_fails_its_op_and_the_link_carries_the_next(
        cluster: ClusterFactory) -> None:
    # rank 0's client copies one chunk and never says more: the frame that carried it is cut
    # off once nothing came for two seconds (the connection is reopened at once), rank 1's op
    # fails, and the next op, once the link is back, is exact on both
    c = cluster(2)
    both_ended = threading.Barrier(2)

    def reopened(cl) -> bool:  # type: ignore[no-untyped-def]
        return all(p.reconnects >= 1 and p.state == "up" for p in cl.status().peers)

    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        kw = one_way(cl.rank, 2)
        send = cl._submitter._send_request

        def stall(req: pb.SubmitRequest) -> None:
            if req.WhichOneof("op") != "fill" or req.fill.bytes <= CHUNK:
                send(req)

        if cl.rank == 0:
            cl._submitter._send_request = stall
        try:
            cl.neighbor_allreduce(values(cl.rank), name="stalled", timeout=20, **kw)
            first: Any = None
        except DecentError as err:
            first = err
        finally:
            cl._submitter._send_request = send
        both_ended.wait(timeout=60)  # rank 0's op ends once its frame was cut
        deadline = time.monotonic() + 30
        while not reopened(cl) and time.monotonic() < deadline:
            time.sleep(0.05)
        x = torch.full((1000,), float(cl.rank + 1))
        return first, cl.neighbor_allreduce(x, name="after", timeout=30)

    (err0, after0), (err1, after1) = c.run(work)
    # cut for the stall, long before the op's own timeout would have ended it
    assert "copied nothing for 2s" in c.log(0)
    # rank 0 sends and keeps its own: with rank 1 out of reach it ends either way
    assert err0 is None or err0.code in (pb.TIMEOUT, pb.PEER_UNAVAILABLE), err0
    assert err1 is not None and "stalled" in str(err1), err1
    assert torch.equal(after0, torch.full((1000,), 1.5))
    assert torch.equal(after1, torch.full((1000,), 1.5))


def test_a_receiver_still_copying_its_input_waits_for_it_before_combining(
        cluster: ClusterFactory) -> None:
    # rank 1 receives rank 0's tensor and keeps half of its own, sending nothing: its client
    # holds the rest of its copy until rank 0's whole tensor has reached its daemon, so the
    # combine must wait for the copy, not only for the arrival
    c = cluster(2)

    # counted before either rank starts: rank 0's tensor may reach rank 1's daemon before
    # rank 1 submits (it is held there as an early arrival)
    before = received_from(c.clients[1], 0)

    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        mine = values(cl.rank) + 7.0  # values no earlier test left in an arena slot
        if cl.rank == 0:
            return cl.neighbor_allreduce(mine, name="late", self_weight=1.0, src_weights={},
                                         dst_weights=[1])
        send = cl._submitter._send_request

        def hold(req: pb.SubmitRequest) -> None:
            if req.WhichOneof("op") == "fill" and req.fill.bytes == 2 * CHUNK:
                deadline = time.monotonic() + 30
                while received_from(cl, 0) - before < NUMEL * 4:
                    assert time.monotonic() < deadline, "rank 0's tensor never arrived"
                    time.sleep(0.01)
            send(req)

        cl._submitter._send_request = hold
        try:
            return cl.neighbor_allreduce(mine, name="late", self_weight=0.5,
                                         src_weights={0: 0.5}, dst_weights=[])
        finally:
            cl._submitter._send_request = send

    out0, out1 = c.run(work)
    assert torch.equal(out0, values(0) + 7.0)
    assert torch.equal(out1, (values(0) + values(1)) / 2 + 7.0)


def test_a_tensorflow_input_is_streamed_through_dlpack() -> None:
    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        out = cl.neighbor_allreduce(tf.constant(values(cl.rank).numpy()), name="t").numpy()
        var = tf.Variable(values(cl.rank).numpy())
        cl.neighbor_allreduce_(var, name="v")
        return out, var.numpy(), cl.status().inputs_streamed

    with tf_cluster(2) as clients:
        got = run_each(clients, work)
    want = ((values(0) + values(1)) / 2).numpy()
    for out, var, streamed in got:
        assert streamed == 2
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(var, want)


@pytest.fixture
def fresh_pair() -> Iterator[Cluster]:
    """Two daemons of this test's own: their links start with full credit, so a 12 MiB tensor
    goes out at once rather than after its receiver's op asked for it (RTS/CTS)."""
    c = Cluster(2, "ring")
    try:
        c.connect()
        yield c
    finally:
        c.stop()


def received_from(cl: Any, peer: int) -> int:
    """Bytes ``cl``'s daemon has received from ``peer``'s."""
    return sum(p.bytes_received for p in cl.status().peers if p.rank == peer)


def noise(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Values with every mantissa bit in use (sums of them round), fixed per rank: 12 MiB
    whatever the dtype (streamed)."""
    g = torch.Generator().manual_seed(100 + rank)
    numel = NUMEL * 4 // torch.finfo(dtype).bits * 8
    return (torch.randn(numel, generator=g) * 3.0).to(dtype)


#: (self weight, in-neighbor's weight, sender's dst weight): uniform (summed, then divided
#: once) and scaled (each term times its weight, the sender's weight too)
WEIGHTS = {"uniform": (0.5, 0.5, 1.0), "scaled": (0.25, 0.375, 2.0)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("weights", list(WEIGHTS))
def test_an_in_place_result_is_combined_by_its_worker_with_the_daemons_bits(
        cluster: ClusterFactory, weights: str, dtype: torch.dtype) -> None:
    # three ranks in a one-way cycle: one in-neighbor each, so every in-place call's worker
    # combines its own result from the neighbor's tensor the daemon received for it; the same
    # call out of place is combined by the daemon: both must give the same bits, and those of
    # the formula computed here
    self_w, src_w, dst_w = WEIGHTS[weights]
    c = cluster(3)

    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        n, r = cl.size, cl.rank
        kw = dict(self_weight=self_w, src_weights={(r - 1) % n: src_w},
                  dst_weights={(r + 1) % n: dst_w})
        before = cl.status().worker_results_combined
        mine = noise(r, dtype)
        same = cl.neighbor_allreduce_(mine, name="ip", **kw) is mine
        combined = cl.status().worker_results_combined - before
        # (after: its result holds arena space, which the in-place call needs twice over)
        return cl.neighbor_allreduce(noise(r, dtype), name="oop", **kw), mine, same, combined

    for rank, (out_of_place, mine, same, combined) in enumerate(c.run(work)):
        x, y = noise(rank, dtype).float(), noise((rank - 1) % 3, dtype).float()
        want = (x + y) / 2 if weights == "uniform" else x * self_w + y * (src_w * dst_w)
        assert same and combined == 1, (rank, combined)
        assert torch.equal(out_of_place, want.to(dtype)), rank
        assert torch.equal(mine, out_of_place), rank


def test_an_in_place_call_whose_neighbor_sent_another_dtype_fails_and_keeps_its_tensor(
        cluster: ClusterFactory) -> None:
    # rank 1 averages in place with rank 0, which sends float16: rank 1's call fails naming
    # the tensor, the peer and both tensors, and its own tensor is as it was (nothing of the
    # wrong tensor landed where the worker combines from)
    c = cluster(2)

    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        if cl.rank == 0:
            try:
                cl.neighbor_allreduce(values(0).half(), name="mixed", self_weight=1.0,
                                      src_weights={}, dst_weights=[1], timeout=30)
            except DecentError as err:  # rank 1 refuses it: a one-way edge fails both
                return err
            return None
        mine = values(1)
        with pytest.raises(DecentError) as info:
            cl.neighbor_allreduce_(mine, name="mixed", self_weight=0.5, src_weights={0: 0.5},
                                   dst_weights=[], timeout=30)
        return info.value, mine

    _, (err, mine) = c.run(work)
    assert err.code == pb.MISMATCH, err
    assert "'mixed'" in err.message and "rank 0 sent" in err.message, err.message
    assert "float16" in err.message and "float32" in err.message, err.message
    assert torch.equal(mine, values(1))


def test_without_arena_room_for_the_neighbors_tensor_the_daemon_combines(
        cluster: ClusterFactory) -> None:
    # each rank holds an earlier 12 MiB result: the in-place call's second slot does not fit
    # the tests' 32 MiB arena beside its input, so the call runs in one slot, the daemon
    # combines, and the worker copies the result out
    c = cluster(3)

    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        kw = one_peer(cl.rank, cl.size)
        held = cl.neighbor_allreduce(values(cl.rank), name="held", **kw)
        before = cl.status().worker_results_combined
        mine = values(cl.rank)
        cl.neighbor_allreduce_(mine, name="crowded", **kw)
        return held, mine, cl.status().worker_results_combined - before

    for rank, (held, mine, combined) in enumerate(c.run(work)):
        assert combined == 0, rank
        assert torch.equal(mine, expected(rank, 3, "one-peer")), rank
        assert torch.equal(held, expected(rank, 3, "one-peer")), rank


def test_a_neighbors_tensor_that_arrived_before_the_call_is_combined_by_the_worker(
        fresh_pair: Cluster) -> None:
    # rank 1 calls only once rank 0's whole tensor is at its daemon, held there as an early
    # arrival: the daemon copies it into the call's second slot, and the worker combines.
    # Rank 0 starts once rank 1 counted what it had received
    c = fresh_pair
    ready = threading.Event()

    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        if cl.rank == 0:
            assert ready.wait(timeout=60)
            return cl.neighbor_allreduce(values(0), name="early", self_weight=1.0,
                                         src_weights={}, dst_weights=[1])
        before = received_from(cl, 0)
        ready.set()
        until(lambda: received_from(cl, 0) - before >= NUMEL * 4, "rank 0's tensor")
        combined = cl.status().worker_results_combined
        mine = values(1)
        cl.neighbor_allreduce_(mine, name="early", self_weight=0.5, src_weights={0: 0.5},
                               dst_weights=[])
        return mine, cl.status().worker_results_combined - combined

    out0, (mine, combined) = c.run(work)
    assert torch.equal(out0, values(0))
    assert combined == 1 and torch.equal(mine, (values(0) + values(1)) / 2)


def test_a_neighbors_tensor_half_here_before_the_call_is_combined_once_whole(
        fresh_pair: Cluster) -> None:
    # rank 0's client holds its copy after two chunks until rank 1's op runs; rank 1 calls once
    # part of the tensor is at its daemon: the rest arrives where the first part did, not in
    # the call's second slot, so nothing may be combined before the daemon copied it there.
    # Rank 0 starts once rank 1 is ready (a hold of 2 s would cut the frame off)
    c = fresh_pair
    held, ready = threading.Event(), threading.Event()

    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        if cl.rank == 0:
            assert ready.wait(timeout=60)
            with copy_held(cl, 3 * CHUNK, lambda: c.status(1).ops_in_flight > 0, held):
                return cl.neighbor_allreduce(values(0), name="half", self_weight=1.0,
                                             src_weights={}, dst_weights=[1])
        combined, before = cl.status().worker_results_combined, received_from(cl, 0)
        ready.set()
        until(lambda: received_from(cl, 0) - before >= CHUNK, "part of rank 0's tensor")
        mine = values(1)
        cl.neighbor_allreduce_(mine, name="half", self_weight=0.5, src_weights={0: 0.5},
                               dst_weights=[])
        return mine, cl.status().worker_results_combined - combined

    out0, (mine, combined) = c.run(work)
    assert held.is_set()
    assert torch.equal(out0, values(0))
    assert combined == 1 and torch.equal(mine, (values(0) + values(1)) / 2)


def test_an_in_place_request_is_locked_from_before_it_is_sent_until_it_is_copied_in(
        cluster: ClusterFactory) -> None:
    # what the daemon tells about an in-place request (how much of the in-neighbor's tensor
    # landed, for the worker to combine into its tensor) waits for the tensor's copy into the
    # arena: the reader thread cannot take the request's lock between its request and the copy
    c = cluster(2)
    free_after_send: list[bool] = []

    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        kw = one_way(cl.rank, 2)
        if cl.rank == 0:
            return cl.neighbor_allreduce(values(0), name="locked", **kw)
        send = cl._submitter._send_request

        def probe(req: pb.SubmitRequest) -> None:
            send(req)
            if req.WhichOneof("op") == "neighbor_allreduce":
                (p,) = cl._submitter._in_flight[req.request_id]
                taken: list[bool] = []
                thread = threading.Thread(target=lambda: taken.append(
                    p.lock.acquire(blocking=False) and (p.lock.release() or True)))
                thread.start()
                thread.join()
                free_after_send.extend(taken)

        cl._submitter._send_request = probe
        try:
            mine = values(1)
            cl.neighbor_allreduce_(mine, name="locked", self_weight=0.5, src_weights={0: 0.5},
                                   dst_weights=[])
            return mine
        finally:
            cl._submitter._send_request = send

    _, mine = c.run(work)
    assert free_after_send == [False]
    assert torch.equal(mine, (values(0) + values(1)) / 2)
