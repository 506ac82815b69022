"""The bulk data path and tensor fusion, checked for exact results at every size boundary.

Boundaries: the combine block (BLOCK elements), the receive window (eager vs. rendezvous, set to
1 MiB here), the receiver's scratch buffer and the ring threshold; 0 and 1 element too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import random
import signal
import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from cluster import Cluster
from decent.core import Client, DecentError
from decent_wire.numerics import BLOCK, weighted_sum
from decent_wire.v1 import decent_pb2 as pb
from decentd.net.inbound import SCRATCH
from decentd.net.outbound import Sender
from decentd.ops.neighbor import PAIR_MIN_BYTES

WINDOW = 1 << 20
F32 = 4
F64 = 8
#: element counts (float32) at and around each boundary
SIZES = sorted({0, 1, BLOCK - 1, BLOCK, BLOCK + 1,
                SCRATCH // F32 - 1, SCRATCH // F32, SCRATCH // F32 + 1,
                WINDOW // F32 - 1, WINDOW // F32, WINDOW // F32 + 1})


@pytest.fixture(scope="module")
def small_window() -> Iterator[Cluster]:
    """3 daemons on a ring whose receive window is 1 MiB per peer."""
    c = Cluster(3, "ring", "--set", f"memory.early_arrival_bytes={2 * WINDOW}",
                "--set", "memory.arena_bytes=67108864")
    try:
        c.connect()
        yield c
    finally:
        assert c.stop() == [0, 0, 0]


def _pattern(n: int, rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return ((torch.arange(n) % 7) * (rank + 1)).to(dtype)


@pytest.mark.parametrize("n", [5, BLOCK, BLOCK + 3])
@pytest.mark.parametrize("out_is", ["x", "a view of x", "its own"])
def test_weighted_sums_over_the_input_or_into_memory_of_their_own(n: int, out_is: str) -> None:
    """One pass (up to BLOCK elements) or block by block, an output that is the input, a view
    of its memory or memory of its own (NaN before): the same float32 operations in the same
    order as the formula, so the bits are equal."""
    x0 = ((np.arange(n) % 11) * 0.37).astype(np.float32)
    y = ((np.arange(n) % 5) * 1.9 + 0.1).astype(np.float32)
    z = ((np.arange(n) % 3) * -2.3).astype(np.float32)
    half = np.float32(0.5)
    cases = [(0.5, [(y, 0.5)], (x0 + y) * half),  # uniform: summed, then halved
             (1 / 3, [(y, 1 / 3), (z, 1 / 3)], (x0 + y + z) / np.float32(3)),
             (0.3, [(y, 0.7)], x0 * np.float32(0.3) + y * np.float32(0.7))]
    for self_weight, terms, want in cases:
        memory = x0.copy()
        x = memory
        out = {"x": memory, "a view of x": memory.view(np.uint8).view(np.float32),
               "its own": np.full(n, np.nan, np.float32)}[out_is]
        weighted_sum(out, x, self_weight, terms, pb.FLOAT32)
        np.testing.assert_array_equal(out, want)


@pytest.mark.slow
@pytest.mark.parametrize("n", SIZES)
def test_neighbor_allreduce_exact_at_boundaries(small_window: Cluster, n: int) -> None:
    # ring of 3, uniform weights 1/3: (x_{r-1} + x_r + x_{r+1}) / 3 = (arange % 7) * 6 / 3
    got = small_window.run(lambda cl: cl.neighbor_allreduce(_pattern(n, cl.rank, torch.float64),
                                                            name=f"b{n}"))
    want = (torch.arange(n) % 7).to(torch.float64) * 2
    for out in got:
        assert torch.allclose(out, want, rtol=0, atol=1e-12), (n, out[:4])


@pytest.mark.slow
@pytest.mark.parametrize("n", SIZES)
def test_allreduce_and_broadcast_exact_at_boundaries(small_window: Cluster, n: int) -> None:
    sums = small_window.run(lambda cl: cl.allreduce(_pattern(n, cl.rank), op="sum",
                                                    name=f"s{n}"))
    bcast = small_window.run(lambda cl: cl.broadcast(_pattern(n, cl.rank), root=2,
                                                     name=f"c{n}"))
    for s, b in zip(sums, bcast, strict=True):
        assert torch.equal(s, _pattern(n, 5))  # (1 + 2 + 3) * pattern
        assert torch.equal(b, _pattern(n, 2))


@pytest.mark.slow
def test_in_place_ops_write_into_the_tensor(small_window: Cluster) -> None:
    def run(cl: Client[torch.Tensor]) -> tuple[bool, torch.Tensor]:
        t = _pattern(1000, cl.rank)
        out = cl.neighbor_allreduce_(t, name="inplace")
        return out is t, t
    for same, t in small_window.run(run):
        assert same and torch.equal(t, (torch.arange(1000) % 7).float() * 2)


MIXED = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64]


def _mixed_tensors(rank: int) -> list[torch.Tensor]:
    shapes = [(), (0,), (1,), (3, 4), (BLOCK + 3,), (2, 0, 5), (17,)]
    out = []
    for i in range(42):
        dtype = MIXED[i % len(MIXED)]
        shape = shapes[i % len(shapes)]
        out.append(torch.full(shape, 2 * (rank + 1) + i % 5, dtype=dtype))
    return out


@pytest.mark.slow
def test_fusion_mixed_dtypes_and_shapes(small_window: Cluster) -> None:
    before = [cl.status().ops_completed for cl in small_window.clients]

    def run(cl: Client[torch.Tensor]) -> list[torch.Tensor]:
        hs = [cl.neighbor_allreduce_async(t, name=f"mix{i}")
              for i, t in enumerate(_mixed_tensors(cl.rank))]
        return [h.wait() for h in reversed(hs)][::-1]

    got = small_window.run(run)
    after = [cl.status().ops_completed for cl in small_window.clients]
    want = [(t.double() * 0 + 4 + i % 5).to(t.dtype)  # the mean of 2(r+1) over r=0..2 is 4
            for i, t in enumerate(_mixed_tensors(0))]
    for rank_out in got:
        for i, (o, w) in enumerate(zip(rank_out, want, strict=True)):
            assert o.dtype == w.dtype and o.shape == w.shape, (i, o, w)
            # weights are 1/3: floats are right to their precision, integers round exactly
            tol = {torch.float16: 1e-2, torch.bfloat16: 1e-2, torch.float32: 1e-6}.get(
                o.dtype, 1e-12)
            assert torch.allclose(o.double(), w.double(), rtol=tol, atol=0), (i, o, w)
            if not o.is_floating_point():
                assert torch.equal(o, w), (i, o, w)
    # 42 tensors went to each daemon in far fewer requests
    assert all(a - b < 42 for a, b in zip(after, before, strict=True)), (before, after)


@pytest.mark.slow
def test_a_fused_block_goes_out_as_one_request_however_slowly_it_is_filled(
        small_window: Cluster) -> None:
    # the requests of a `fused()` block wait for its end (or the size threshold), not for the
    # 1 ms cycle timer: 10 tensors submitted 20 ms apart travel as one request
    before = [cl.status().ops_completed for cl in small_window.clients]

    def run(cl: Client[torch.Tensor]) -> list[torch.Tensor]:
        with cl.fused():
            hs = []
            for i in range(10):
                hs.append(cl.neighbor_allreduce_async(torch.full((100,), float(cl.rank + i)),
                                                      name=f"held{i}"))
                time.sleep(0.02)
        return [h.wait() for h in hs]

    for out in small_window.run(run):
        for i, t in enumerate(out):
            assert torch.equal(t, torch.full((100,), 1.0 + i)), (i, t[:2])  # (i + i+1 + i+2)/3
    after = [cl.status().ops_completed for cl in small_window.clients]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1, 1]


@pytest.mark.slow
def test_fused_allreduce_and_broadcast(small_window: Cluster) -> None:
    def run(cl: Client[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        ts = _mixed_tensors(cl.rank)
        ar = [cl.allreduce_async(t, op="sum", name=f"far{i}") for i, t in enumerate(ts)]
        bc = [cl.broadcast_async(t, root=1, name=f"fbc{i}") for i, t in enumerate(ts)]
        return [h.wait() for h in ar], [h.wait() for h in bc]

    for sums, bcasts in small_window.run(run):
        for i, (s, b) in enumerate(zip(sums, bcasts, strict=True)):
            base = _mixed_tensors(0)[i]
            assert torch.equal(s, (base.double() * 0 + 12 + 3 * (i % 5)).to(base.dtype)), i
            assert torch.equal(b, _mixed_tensors(1)[i]), i


@pytest.mark.slow
def test_ranks_fusing_differently_still_match() -> None:
    # rank 0 sends every tensor alone, rank 1 fuses them all, rank 2 in buckets of ~3 tensors:
    # each tensor is matched by its own key, whatever message it travelled in
    c = Cluster(3, "ring", "--set", "memory.arena_bytes=67108864")
    try:
        c.connect(fusion_threshold=[0, 64 << 20, 3 * 4000], cycle_time=[0.001, 10.0, 10.0])

        def run(cl: Client[torch.Tensor]) -> list[torch.Tensor]:
            hs = [cl.neighbor_allreduce_async(torch.full((1000,), float(cl.rank + i)),
                                              name=f"g{i}") for i in range(30)]
            return [h.wait() for h in hs]

        for out in c.run(run):
            for i, t in enumerate(out):
                assert torch.allclose(t, torch.full((1000,), 1.0 + i), rtol=1e-6), (i, t[:2])
    finally:
        assert c.stop() == [0, 0, 0]


@pytest.mark.slow
def test_many_ops_in_flight_random_order(small_window: Cluster) -> None:
    sizes = [random.Random(7).randint(0, 300_000) for _ in range(60)]

    def run(cl: Client[torch.Tensor]) -> list[torch.Tensor]:
        hs = [cl.neighbor_allreduce_async(_pattern(n, cl.rank), name=f"fl{i}")
              for i, n in enumerate(sizes)]
        order = list(range(len(hs)))
        random.Random(cl.rank).shuffle(order)
        out: dict[int, torch.Tensor] = {i: hs[i].wait(timeout=120) for i in order}
        return [out[i] for i in range(len(hs))]

    for out in small_window.run(run, timeout=300):
        for n, t in zip(sizes, out, strict=True):
            assert torch.equal(t, (torch.arange(n) % 7).float() * 2), n


@pytest.mark.slow
def test_shared_tensors_skip_the_copies(small_window: Cluster) -> None:
    def run(cl: Client[torch.Tensor]) -> tuple[bool, torch.Tensor, torch.Tensor, int]:
        free = cl.arena.free_bytes
        t = cl.shared(_pattern(BLOCK + 5, cl.rank))
        ptr = t.data_ptr()
        out = cl.neighbor_allreduce_(t, name="sh")  # in place: the daemon writes into t
        # not in place: t stays, a new tensor back (over arena memory of its own: a clone kept
        # here, so that the arena space is all back below)
        copy = cl.neighbor_allreduce(t, name="sh2").clone()
        fused = [cl.shared(torch.full((3,), float(cl.rank + i))) for i in range(5)]
        hs = [cl.neighbor_allreduce_async_(f, name=f"shf{i}") for i, f in enumerate(fused)]
        for h in hs:
            h.wait()
        del h
        ok = out is t and t.data_ptr() == ptr and all(
            torch.equal(f, torch.full((3,), 1.0 + i)) for i, f in enumerate(fused))
        del t, out, fused, hs
        return ok, copy, torch.empty(0), cl.arena.free_bytes - free

    for ok, copy, _, leaked in small_window.run(run):
        want = (torch.arange(BLOCK + 5) % 7).float() * 2
        assert ok
        assert torch.allclose(copy, want, rtol=1e-6)  # (2, 2, 2) averaged again is the same
        assert leaked == 0  # the shared tensors' arena space came back


@pytest.mark.slow
def test_streamed_results_stay_exact_under_repetition() -> None:
    # a lone neighbor (2 ranks), tensors larger than the sockets' buffers, so sending and
    # receiving overlap: the result must never be written over an input still being sent
    c = Cluster(2, "ring", "--set", "memory.arena_bytes=134217728")
    try:
        c.connect()
        n = (24 << 20) // F32

        def run(cl: Client[torch.Tensor]) -> list[bool]:
            t = torch.full((n,), float(2 * cl.rank))
            ok = []
            for _ in range(15):
                t = cl.neighbor_allreduce(t, name="rep")
                ok.append(bool(torch.equal(t, torch.full((n,), 1.0))))
            return ok

        for ok in c.run(run, timeout=300):
            assert all(ok), ok
    finally:
        assert c.stop() == [0, 0]


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, BLOCK + 1, WINDOW // F32 + 1])
def test_one_way_received_straight_into_the_output(small_window: Cluster, n: int) -> None:
    # rank 1 keeps nothing of its own and sends nothing: rank 0's tensor (sent with weight 2)
    # lands in rank 1's output and is scaled there by 0.25
    def run(cl: Client[torch.Tensor]) -> torch.Tensor | None:
        if cl.rank == 0:
            cl.neighbor_allreduce_(cl.shared(_pattern(n, 0)), name=f"ow{n}", self_weight=1.0,
                                   src_weights={}, dst_weights={1: 2.0})
            return None
        if cl.rank == 1:
            t = cl.shared(torch.full((n,), -1.0))
            return cl.neighbor_allreduce_(t, name=f"ow{n}", self_weight=0.0,
                                          src_weights={0: 0.25}, dst_weights=[])
        return None
    got = small_window.run(run)
    assert torch.equal(got[1], _pattern(n, 0) * 0.5)


@pytest.mark.slow
def test_in_place_ops_register_shared_memory_tensors(small_window: Cluster) -> None:
    # a tensor in torch's shared memory (share_memory_()) is handed to the daemon at its first
    # in-place op; from then on the daemon reads and writes it in place, views included
    n = (1 << 20) // F64 + 3
    want = (torch.arange(n) % 7).double() * 2  # ring of 3: the mean of 1x, 2x, 3x the pattern

    def run(cl: Client[torch.Tensor]) -> dict[str, object]:
        base = torch.zeros(n + 8, dtype=torch.float64).share_memory_()
        t = base[8:]  # a view: the whole storage is registered, the op covers the view's part
        ptr = t.data_ptr()
        seen: list[bool] = []
        for k in range(3):
            t.copy_(_pattern(n, cl.rank, torch.float64) + k)
            out = cl.neighbor_allreduce_(t, name="reg")
            seen.append(cl.regions.nbytes > 0)
            assert out is t and t.data_ptr() == ptr
            assert torch.allclose(t, want + k, rtol=0, atol=1e-12), k
        registered = cl.status().registered_bytes
        head = base[:8].clone()
        small = torch.full((5,), float(cl.rank)).share_memory_()  # below the threshold
        cl.neighbor_allreduce_(small, name="small")
        h = cl.neighbor_allreduce_async(t, name="reg_copy")  # out of place: t is copied at once
        t.fill_(-1.0)
        copied = h.wait()
        return {"seen": seen, "registered": registered, "head": head, "small": small,
                "copied": copied, "size": cl.regions.nbytes}

    for r in small_window.run(run):
        assert r["seen"] == [True, True, True]
        assert r["registered"] == (n + 8) * F64 == r["size"]
        assert torch.equal(r["head"], torch.zeros(8, dtype=torch.float64))  # outside the view
        assert torch.equal(r["small"], torch.ones(5))
        assert torch.allclose(r["copied"], want + 2, rtol=0, atol=1e-12)


@pytest.mark.slow
def test_private_tensors_are_copied_never_moved(small_window: Cluster) -> None:
    # moving private memory into shared memory would leave numpy views of it dangling
    n = (2 << 20) // F32

    def run(cl: Client[torch.Tensor]) -> tuple[bool, bool, int]:
        arr = np.zeros(n, np.float32)
        t = torch.from_numpy(arr)  # t and arr alias
        u = torch.zeros(n)
        v = u.numpy()  # and so do u and v
        ok = True
        for _ in range(3):
            t.fill_(float(2 * cl.rank))
            u.fill_(float(2 * cl.rank))
            cl.allreduce_(t, name="alias_t")
            cl.allreduce_(u, name="alias_u")
            ok = ok and bool(arr[0] == 2.0 and arr[-1] == 2.0 and v[0] == 2.0 and v[-1] == 2.0)
        return ok, t.is_shared() or u.is_shared(), cl.regions.nbytes

    for ok, moved, size in small_window.run(run):
        assert ok and not moved and size == 0


@pytest.mark.slow
def test_concurrent_first_uses_register_a_storage_once(small_window: Cluster) -> None:
    n = (1 << 20) // F32

    def run(cl: Client[torch.Tensor]) -> tuple[int, bool]:
        base = torch.zeros(2 * n).share_memory_()
        halves = [base[:n], base[n:]]
        for h in halves:
            h.fill_(float(cl.rank))
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda i: cl.allreduce_(halves[i], name=f"half{i}"), range(2)))
        size = cl.regions.nbytes
        halves.clear()
        del base
        cl.barrier(name="halves_done")  # releases the region: the next test starts clean
        return size, True

    for size, ok in small_window.run(run):
        assert ok and size == 2 * n * F32


@pytest.mark.slow
def test_registered_memory_is_released_when_its_tensor_is_gone(small_window: Cluster) -> None:
    n = (2 << 20) // F32

    def run(cl: Client[torch.Tensor]) -> tuple[int, int, int, bool]:
        t = torch.full((n,), float(cl.rank)).share_memory_()
        for _ in range(2):
            t.fill_(float(cl.rank))
            cl.neighbor_allreduce_(t, name="gone")
        ok = bool(torch.equal(t, torch.ones(n)))
        held = cl.status().registered_bytes
        del t
        cl.barrier(name="gone_barrier")  # sync point: dead registrations are released
        after = cl.status().registered_bytes
        u = torch.full((n,), float(cl.rank)).share_memory_()  # maybe at the old address
        for _ in range(3):
            u.fill_(float(cl.rank))
            cl.neighbor_allreduce_(u, name="again")
        ok = ok and bool(torch.equal(u, torch.ones(n)))
        return held, after, cl.status().registered_bytes, ok

    for held, after, again, ok in small_window.run(run):
        assert ok
        assert held >= n * F32 and after == held - n * F32 and again == after + n * F32


@pytest.mark.slow
def test_registration_can_be_turned_off(small_window: Cluster) -> None:
    n = (2 << 20) // F32
    off = [Client(cl.codec, cl.address, register=False, job="noreg")
           for cl in small_window.clients]
    try:
        def run(rank: int) -> tuple[bool, int]:
            cl = off[rank]
            t = torch.full((n,), float(cl.rank)).share_memory_()
            for _ in range(3):
                t.fill_(float(cl.rank))
                cl.neighbor_allreduce_(t, name="noreg")
            return bool(torch.equal(t, torch.ones(n))), cl.regions.nbytes

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            for ok, size in pool.map(run, range(3)):
                assert ok and size == 0
    finally:
        for cl in off:
            cl.close()


@pytest.mark.slow
def test_past_the_region_limit_tensors_are_copied() -> None:
    c = Cluster(2, "ring", "--set", "memory.max_regions=2")
    try:
        c.connect()
        n = (1 << 20) // F32

        def run(cl: Client[torch.Tensor]) -> tuple[list[bool], int]:
            ts = [torch.full((n,), float(2 * cl.rank + i)).share_memory_() for i in range(3)]
            for i, t in enumerate(ts):
                cl.allreduce_(t, name=f"lim{i}")
            ok = [bool(torch.equal(t, torch.full((n,), 1.0 + i))) for i, t in enumerate(ts)]
            return ok, cl.status().registered_bytes

        for ok, registered in c.run(run):
            assert ok == [True, True, True]
            assert registered == 2 * n * F32  # the third was refused and went through the arena
    finally:
        assert c.stop() == [0, 0]


@pytest.mark.slow
def test_file_backed_tensors_are_copied_and_registration_stays_on(
        small_window: Cluster, tmp_path_factory: pytest.TempPathFactory) -> None:
    # torch.from_file storages say is_shared() but are not torch's shared memory: copied
    n = (1 << 20) // F32
    folder = tmp_path_factory.mktemp("from_file")

    def run(cl: Client[torch.Tensor]) -> tuple[bool, int, int]:
        path = folder / f"t{cl.rank}.bin"
        f = torch.from_file(str(path), shared=True, size=n, dtype=torch.float32)
        f.fill_(float(2 * cl.rank))
        cl.allreduce_(f, name="from_file")
        after_file = cl.regions.nbytes
        t = torch.full((n,), float(2 * cl.rank)).share_memory_()
        cl.allreduce_(t, name="after_file")
        ok = bool(torch.equal(f, torch.full((n,), 2.0)) and torch.equal(t, torch.full((n,), 2.0)))
        return ok, after_file, cl.regions.nbytes

    for ok, after_file, after in small_window.run(run):
        assert ok and after_file == 0 and after == n * F32


@pytest.mark.slow
def test_a_registration_whose_answer_is_lost_is_released() -> None:
    c = Cluster(2, "ring")
    try:
        c.connect()
        n = (1 << 20) // F32

        def run(cl: Client[torch.Tensor]) -> tuple[int, int, bool]:
            real = cl.connection.memory_call

            def lossy(req: pb.MemoryRequest, fd: int | None) -> list[int]:
                got = real(req, fd)
                if fd is not None:  # the daemon mapped it, but the answer never came back
                    raise DecentError(pb.PEER_UNAVAILABLE, "lost")
                return got

            cl.connection.memory_call = lossy  # type: ignore[method-assign]
            t = torch.full((n,), float(2 * cl.rank)).share_memory_()
            cl.allreduce_(t, name="lossy")
            mapped = cl.status().registered_bytes
            cl.connection.memory_call = real  # type: ignore[method-assign]
            cl.barrier(name="lossy_done")  # releases what the client could not record
            return mapped, cl.status().registered_bytes, bool(torch.equal(t, torch.ones(n)))

        for mapped, after, ok in c.run(run):
            assert ok and mapped == n * F32 and after == 0
    finally:
        assert c.stop() == [0, 0]


PAIR_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64]


def _pair_tensors(rank: int) -> list[torch.Tensor]:
    """Large tensors (averaged by halves on a pair step, odd element counts too) and small ones
    (whole tensors), values 4 (rank + 1) * (i % 7): every average below is an exact integer."""
    big = [(PAIR_MIN_BYTES // 4 + 1, torch.float32), (PAIR_MIN_BYTES // 2 + 3, torch.float16),
           (PAIR_MIN_BYTES // 2, torch.bfloat16), (PAIR_MIN_BYTES // 8 + 5, torch.int64)]
    small = [(1000, d) for d in PAIR_DTYPES] + [(0, torch.float32), (1, torch.float64)]
    return [((torch.arange(n) % 7) * 4 * (rank + 1)).to(d) for n, d in big + small]


def test_sender_is_idle_only_when_nothing_is_queued_or_going_out() -> None:
    # the heartbeat loop writes only on idle links: a frame stuck behind a peer that stopped
    # reading must keep the sender busy, so that heartbeats do not pile up behind it
    a, b = socket.socketpair()
    loop = asyncio.new_event_loop()
    sender = Sender(a, loop, peer=1)
    try:
        assert sender.idle
        sender.send([b"x" * 100])  # fits the socket buffer: written at once
        assert sender.idle
        sender.send([bytes(64 << 20)])  # more than the socket holds
        assert not sender.idle
        time.sleep(0.2)
        assert not sender.idle  # nobody reads b: still going out
        received = 0
        while received < 100 + (64 << 20):
            received += len(b.recv(1 << 20))
        deadline = time.monotonic() + 10
        while not sender.idle and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sender.idle
    finally:
        sender.close()
        loop.close()
        a.close()
        b.close()


@pytest.mark.slow
def test_pairs_average_large_tensors_by_halves_exactly() -> None:
    # one-peer exponential graph on 4 ranks: round 0 sends to r+1 (one-way edges), round 1
    # pairs r with r+2 (each other's only neighbor, weights 1/2): there every tensor of at
    # least PAIR_MIN_BYTES is averaged by halves, the rest whole, however each rank fused them
    c = Cluster(4, "one-peer-exponential", "--set", "memory.arena_bytes=134217728")
    try:
        c.connect(fusion_threshold=[0, 64 << 20, 3 << 20, 64 << 20],
                  cycle_time=[0.001, 10.0, 10.0, 0.001])

        def run(cl: Client[torch.Tensor]) -> list[list[torch.Tensor]]:
            ts = _pair_tensors(cl.rank)
            ts[1].share_memory_()  # registered: the peer's half lands in the tensor itself
            rounds = []
            for _ in range(2):
                hs = [cl.neighbor_allreduce_async_(t, name=f"pair{i}") for i, t in enumerate(ts)]
                for h in hs:
                    h.wait(timeout=120)
                rounds.append([t.clone() for t in ts])
            return rounds

        got = c.run(run, timeout=300)
        scale = {r: 4 * (r + 1) for r in range(4)}
        after0 = {r: (scale[r] + scale[(r - 1) % 4]) // 2 for r in range(4)}
        for r, rounds in enumerate(got):
            want1 = (after0[r] + after0[(r + 2) % 4]) // 2
            for factor, out in ((after0[r], rounds[0]), (want1, rounds[1])):
                for i, (o, base) in enumerate(zip(out, _pair_tensors(0), strict=True)):
                    want = ((torch.arange(base.numel()) % 7) * factor).to(base.dtype)
                    assert o.dtype == base.dtype and torch.equal(o, want), (r, i, o[:8], want[:8])
    finally:
        assert c.stop() == [0, 0, 0, 0]


@pytest.mark.slow
def test_pair_halves_of_different_shapes_fail_with_mismatch() -> None:
    c = Cluster(2, "ring")
    try:
        c.connect()
        n = PAIR_MIN_BYTES // 4

        def run(cl: Client[torch.Tensor]) -> torch.Tensor:
            return cl.neighbor_allreduce(torch.ones(n + 4 * cl.rank), name="odd", timeout=30)

        errors = c.run_catching(run)
        for r, err in enumerate(errors):
            assert isinstance(err, DecentError) and err.code == pb.MISMATCH, err
            assert "'odd'" in str(err) and f"rank {1 - r}" in str(err), err
            assert f"[{n}]" in str(err) and f"[{n + 4}]" in str(err), err
        ok = c.run(lambda cl: cl.neighbor_allreduce(torch.full((n,), float(cl.rank)), name="ok"))
        assert all(torch.equal(t, torch.full((n,), 0.5)) for t in ok)  # nothing else broke
    finally:
        assert c.stop() == [0, 0]


def _from(cl: Client[torch.Tensor], peer: int) -> pb.PeerStatus:
    """This daemon's status of its link to ``peer``."""
    (link,) = [p for p in cl.status().peers if p.rank == peer]
    return link


@pytest.mark.slow
def test_an_op_started_while_its_tensor_arrives_acknowledges_it_at_once() -> None:
    # a one-way edge: rank 0's op ends once rank 1's op has taken its tensor, which rank 1 says
    # with an ACK. An op that starts while the tensor is still arriving acknowledges at once (the
    # sender need not wait for the rest of the payload); one that starts after it all arrived
    # can only acknowledge then. Rank 1 submits at each of those two moments, seen on its link;
    # for the first, rank 0's daemon is frozen (SIGSTOP) part way through the tensor
    nbytes = 256 << 20
    c = Cluster(2, "ring", "--set", f"memory.arena_bytes={nbytes + (16 << 20)}")
    sender = c.procs[0].pid
    try:
        c.connect()
        zero, one = c.clients
        sent = zero.shared(torch.full((nbytes // F32,), 3.0))
        got = one.shared(torch.zeros(nbytes // F32))

        def take(name: str) -> None:
            one.neighbor_allreduce_(got, name=name, self_weight=0.0, src_weights={0: 1.0},
                                    dst_weights=[])

        def exchange(name: str, arriving: bool) -> tuple[int, int] | None:
            """Rank 1's (early, late) ACKs, or None if it all came before rank 0 froze."""
            got.zero_()
            before = _from(one, 0)
            handle = zero.neighbor_allreduce_async_(sent, name=name, self_weight=1.0,
                                                    src_weights={}, dst_weights=[1])
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                arrived = _from(one, 0).bytes_received - before.bytes_received
                waiting = one.status().early_arrival_bytes
                # more than a heartbeat frame: the tensor itself is coming
                if arrived > 1 << 20 if arriving else waiting >= nbytes:
                    break
            if not arriving:
                assert waiting == nbytes, waiting
                take(name)
            else:
                os.kill(sender, signal.SIGSTOP)
                time.sleep(0.2)  # what the kernel already buffered lands; nothing more comes
                arrived = _from(one, 0).bytes_received - before.bytes_received
                if arrived >= nbytes:
                    os.kill(sender, signal.SIGCONT)
                    take(name)
                    handle.wait(timeout=60)
                    return None
                assert arrived > 1 << 20, arrived
                mine = one.neighbor_allreduce_async_(got, name=name, self_weight=0.0,
                                                     src_weights={0: 1.0}, dst_weights=[])
                while _from(one, 0).acks_early == before.acks_early \
                        and time.monotonic() < deadline:
                    time.sleep(0.01)  # the ACK goes while the sender is still frozen
                os.kill(sender, signal.SIGCONT)
                mine.wait(timeout=60)
            handle.wait(timeout=60)
            assert torch.equal(got, sent), name
            after = _from(one, 0)
            return after.acks_early - before.acks_early, after.acks_late - before.acks_late

        early = None
        for attempt in range(5):
            early = exchange(f"arriving{attempt}", arriving=True)
            if early is not None:
                break
        assert early is not None, "the whole tensor arrived before rank 0 froze, 5 times"
        assert early == (1, 0), early
        assert exchange("arrived", arriving=False) == (0, 1)
    finally:
        os.kill(sender, signal.SIGCONT)
        assert c.stop() == [0, 0]
