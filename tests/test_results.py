"""Out-of-place results live in the arena (issue 27): no copy out, exact, and safe to keep.

A result of an out-of-place op on the host is a tensor over the arena slot the daemon wrote it
into; the slot is freed when the last tensor using it is garbage-collected. Kept results never
starve later ops (those go to memory of their own when the arena is full) and stay valid after
the client closes.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import tensorflow as tf
import torch

from cluster import Cluster, delay, run_each, tf_cluster
from conftest import ClusterFactory
from decent.tf.codec import ALIGNMENT, tensor_over


def in_arena(cl, t: torch.Tensor) -> bool:  # type: ignore[no-untyped-def]
    return cl.arena.offset_of(t.data_ptr(), t.numel() * t.element_size()) is not None


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.bfloat16])
def test_an_out_of_place_result_is_a_tensor_over_the_arena_of_the_inputs_shape_and_dtype(
        cluster: ClusterFactory, dtype: torch.dtype) -> None:
    c = cluster(2)

    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        x = torch.full((3, 5, 7), 2.0 * (cl.rank + 1)).to(dtype)
        out = cl.neighbor_allreduce(x, name="r")
        return out, in_arena(cl, out), cl.status().arena_bytes

    got = c.run(work)
    for out, arena_backed, _ in got:
        assert arena_backed
        assert out.shape == (3, 5, 7) and out.dtype == dtype
        assert torch.equal(out, torch.full((3, 5, 7), 3.0).to(dtype))  # (2 + 4) / 2


@pytest.mark.slow
def test_results_kept_past_the_arena_are_exact_and_later_ops_still_run() -> None:
    # a 1 MiB arena; every rank keeps 8 results of 256 KiB: the arena cannot hold them, so later
    # ops go to memory of their own; every kept result stays exact
    c = Cluster(2, "ring", "--set", "memory.arena_bytes=1048576")
    try:
        c.connect()
        numel = 256 * 1024 // 4

        def work(cl):  # type: ignore[no-untyped-def]
            delay(cl.rank)
            kept = [cl.neighbor_allreduce(torch.full((numel,), float(10 * k + cl.rank)),
                                          name=f"k{k}") for k in range(8)]
            return kept, sum(in_arena(cl, t) for t in kept)

        got = c.run(work)
        for kept, arena_backed in got:
            assert 1 <= arena_backed < 8  # some in the arena, the rest elsewhere
            for k, t in enumerate(kept):
                assert torch.equal(t, torch.full((numel,), 10 * k + 0.5)), k
        assert all(c.status(i).arena_spills >= 1 for i in (0, 1))
        del got, kept, t
        gc.collect()
        # the slots are free again once the results are gone
        assert [cl.arena.free_bytes for cl in c.clients] == [cl.arena.nbytes for cl in c.clients]
    finally:
        c.stop()


@pytest.mark.slow
def test_a_result_passed_to_another_op_in_and_out_of_place(cluster: ClusterFactory) -> None:
    c = cluster(2)

    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        first = cl.neighbor_allreduce(torch.arange(1000, dtype=torch.float64) * (cl.rank + 1),
                                      name="p")  # 1.5 * arange on both ranks
        second = cl.allreduce(first, name="q")  # out of place, from arena memory
        cl.allreduce_(first, name="q2")  # in place on arena memory
        return first, second

    for first, second in c.run(work):
        want = torch.arange(1000, dtype=torch.float64) * 1.5
        assert torch.equal(second, want) and torch.equal(first, want)


@pytest.mark.slow
@pytest.mark.parametrize("numel", [1000, 3 << 20], ids=["4 KB", "12 MiB"])
def test_a_one_way_transfer_copies_only_what_it_needs(cluster: ClusterFactory,
                                                       numel: int) -> None:
    # rank 0 sends and keeps its own tensor whole: its result is its input, nothing is copied
    # back; rank 1 only receives: its tensor is never read, so it is not copied in (NaN in it
    # would show if it were used)
    c = cluster(2)

    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        before = cl.status()
        got = []
        for k in range(3):
            if cl.rank == 0:
                t = torch.arange(numel, dtype=torch.float32) + k
                kw = dict(self_weight=1.0, src_weights={}, dst_weights=[1])
            else:
                t = torch.full((numel,), float("nan"))
                kw = dict(self_weight=0.0, src_weights={0: 1.0}, dst_weights=[])
            out = cl.neighbor_allreduce_(t, name="ow", **kw)
            got.append((out is t, t.clone()))
        after = cl.status()
        return (got, after.worker_results_unchanged - before.worker_results_unchanged,
                after.inputs_left_out - before.inputs_left_out)

    for rank, (got, unchanged, left_out) in enumerate(c.run(work)):
        assert (unchanged, left_out) == ((3, 0) if rank == 0 else (0, 3)), rank
        for k, (same, t) in enumerate(got):
            assert same and torch.equal(t, torch.arange(numel, dtype=torch.float32) + k), rank


@pytest.mark.slow
def test_weights_of_zero_and_one_on_a_two_way_call_copy_as_usual(
        cluster: ClusterFactory) -> None:
    # self_weight 0 but sending: the tensor is read; self_weight 1 but receiving: it changes
    c = cluster(2)

    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        peer = 1 - cl.rank
        mine = torch.arange(1000, dtype=torch.float32) + 1000 * cl.rank
        swapped = cl.neighbor_allreduce_(mine.clone(), name="swap", self_weight=0.0,
                                         src_weights={peer: 1.0}, dst_weights=[peer])
        summed = cl.neighbor_allreduce_(mine.clone(), name="sum", self_weight=1.0,
                                        src_weights={peer: 1.0}, dst_weights=[peer])
        return swapped, summed

    base = torch.arange(1000, dtype=torch.float32)
    for rank, (swapped, summed) in enumerate(c.run(work)):
        assert torch.equal(swapped, base + 1000 * (1 - rank)), rank
        assert torch.equal(summed, 2 * base + 1000), rank


@pytest.mark.slow
def test_a_result_outlives_its_client_and_its_daemon() -> None:
    c = Cluster(2, "ring")
    try:
        c.connect()
        got = c.run(lambda cl: cl.neighbor_allreduce(torch.full((4096,), float(cl.rank)),
                                                     name="o"))
        assert all(in_arena(cl, t) for cl, t in zip(c.clients, got, strict=True))
    finally:
        c.stop()  # the clients close, the daemons stop
    for t in got:  # still the values, in memory that stays mapped while they use it
        assert torch.equal(t, torch.full((4096,), 0.5))
        t += 1  # and writable: the user's tensor
        assert float(t.sum()) == 1.5 * 4096



@pytest.mark.slow
def test_tensorflow_results_are_tensors_over_the_arena_through_dlpack() -> None:
    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        out = cl.neighbor_allreduce(tf.fill((64, 33), 2.0 * (cl.rank + 1)), name="tf.r")
        held = cl.status()
        half = cl.neighbor_allreduce(tf.fill((5,), float(cl.rank)), name="tf.h").numpy()
        bf = cl.neighbor_allreduce(tf.cast(tf.fill((7,), float(cl.rank)), tf.bfloat16),
                                   name="tf.b16")
        return out, held, half, bf, cl.status()

    with tf_cluster(2) as clients:
        for out, held, half, bf, after in run_each(clients, work):
            assert out.dtype == tf.float32 and out.shape == (64, 33)
            assert np.array_equal(out.numpy(), np.full((64, 33), 3.0, np.float32))
            assert held.worker_results_held >= 1
            assert held.worker_results_held_bytes >= 64 * 33 * 4
            assert np.array_equal(half, np.full(5, 0.5, np.float32))
            # bfloat16 has no numpy DLPack export: copied out, and counted
            assert bf.dtype == tf.bfloat16 and float(bf[0]) == 0.5
            assert after.worker_results_copied == 1


def test_tensorflow_is_given_only_memory_aligned_as_its_kernels_require() -> None:
    # TensorFlow aborts the process on a misaligned tensor: such memory is copied instead
    raw = np.zeros(4096 + 2 * ALIGNMENT, np.uint8)
    memory = memoryview(raw.data)
    aligned = (-raw.ctypes.data) % ALIGNMENT
    for skew, taken in ((0, True), (4, False), (ALIGNMENT // 2, False)):
        view = memory[aligned + skew: aligned + skew + 4096]
        t = tensor_over(view, tf.float32, (1024,), None)
        assert (t is not None) is taken, skew
    assert tensor_over(memory[aligned:aligned + 8], tf.bfloat16, (4,), None) is None


@pytest.mark.slow
def test_a_tf_variable_takes_its_in_place_result_where_the_daemon_wrote_it() -> None:
    # a 1 MiB arena, a 256 KiB variable averaged in place 12 times: each time the variable
    # takes the slot the result is in (no copy) and gives back the one it held, so the arena
    # never runs out; the values are exact, and stay so after the client and daemon are gone
    numel = 256 * 1024 // 4

    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        v = tf.Variable(tf.fill((numel,), float(cl.rank)))
        for k in range(12):
            v.assign_add(tf.fill((numel,), float(2 * cl.rank + 1)))
            cl.neighbor_allreduce_(v, name="tf.v")  # each rank: its own + (k + 1) * 2 r + 1
            assert np.array_equal(v.numpy(), np.full(numel, 0.5 + 2.0 * (k + 1), np.float32))
        return v, cl.status()

    with tf_cluster(2, "ring", "--set", "memory.arena_bytes=1048576") as clients:
        got = run_each(clients, work)
    for v, status in got:
        assert status.worker_results_held == 1  # the variable's memory
        assert status.worker_results_held_bytes >= numel * 4
        assert status.worker_results_copied == 0 and status.arena_spills == 0
        assert np.array_equal(v.numpy(), np.full(numel, 24.5, np.float32))
        v.assign_add(tf.ones((numel,)))  # still the user's variable
        assert float(tf.reduce_sum(v)) == 25.5 * numel
