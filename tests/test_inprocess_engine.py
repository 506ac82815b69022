"""The request engine, with daemons in this process (``make test-fast``).

A worker's request is checked, run as an op with a timeout, and failed on its own when it is
bad: the error names the tensor and what is wrong, both sides of a disagreement fail with it,
and the daemon, the worker and its other requests go on. Through the public client API only.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from inprocess import NumpyClient, run_ranks, wait_for

from conftest import InProcessFactory
from decent_wire.errors import DecentError
from decent_wire.v1 import decent_pb2 as pb

SETTINGS = {"memory.arena_bytes": 16 << 20}


def ints(n: int, rank: int) -> np.ndarray:
    """Even small integers per rank (their average with another rank's is exact)."""
    return ((np.arange(n) % 100) * 2 + 200 * rank).astype(np.float32)


def failure(fn: object) -> DecentError:
    """The DecentError ``fn()`` raises (AssertionError if it returns)."""
    with pytest.raises(DecentError) as info:
        fn()  # type: ignore[operator]
    return info.value


def average(cl: NumpyClient, name: str) -> np.ndarray:
    """An exact average with the other rank (a check that the daemons serve on)."""
    return cl.neighbor_allreduce(ints(1000, cl.rank), name=name, timeout=30).copy()


def check_averages(got: list[np.ndarray]) -> None:
    for out in got:
        np.testing.assert_array_equal(out, (ints(1000, 0) + ints(1000, 1)) / 2)


@pytest.mark.parametrize("what", ["shape", "dtype"])
def test_tensors_that_differ_fail_on_both_ranks_naming_both(inprocess: InProcessFactory,
                                                            what: str) -> None:
    c = inprocess(2, settings=SETTINGS)

    def mine(rank: int) -> np.ndarray:
        if what == "shape":
            return np.ones(1000 + 4 * rank, np.float32)
        return np.ones(1000, [np.float32, np.float64][rank])

    def work(cl: NumpyClient) -> tuple[DecentError, np.ndarray]:
        err = failure(lambda: cl.neighbor_allreduce(mine(cl.rank), name="odd", timeout=30))
        return err, average(cl, "after")

    got = run_ranks(c.clients, work)
    described = {0: "float32[1000]", 1: "float32[1004]" if what == "shape" else "float64[1000]"}
    # whichever rank finds the difference first fails with it and tells the other
    either = [f"rank {r} expected {described[r]} but rank {1 - r} sent {described[1 - r]}"
              for r in (0, 1)]
    for err, _ in got:
        assert err.code == pb.MISMATCH, err
        assert "'odd' round 0" in err.message, err.message
        assert any(text in err.message for text in either), err.message
    check_averages([out for _, out in got])


def test_an_op_times_out_naming_the_rank_it_waits_for(inprocess: InProcessFactory) -> None:
    # rank 0 calls alone: its op fails after its timeout, naming the tensor and rank 1; rank
    # 1's call of the same round, later, fails with rank 0's error (its ABORT), and the next
    # round of the name is exact on both
    c = inprocess(2, settings=SETTINGS)
    zero, one = c.clients
    failed = c.status(0).ops_failed
    began = time.monotonic()
    err = failure(lambda: zero.neighbor_allreduce(ints(10, 0), name="lonely", timeout=0.5))
    assert time.monotonic() - began >= 0.45  # not before its timeout
    assert err.code == pb.TIMEOUT, err
    assert "'lonely' round 0 timed out after 0.5s on rank 0" in err.message, err.message
    assert "rank(s) [1]" in err.message, err.message
    assert c.status(0).ops_failed == failed + 1
    late = failure(lambda: one.neighbor_allreduce(ints(10, 1), name="lonely", timeout=30))
    assert late.code == pb.TIMEOUT and "rank 0" in late.message, late
    assert "'lonely' round 0 timed out after 0.5s" in late.message, late.message
    check_averages(run_ranks(c.clients, lambda cl: average(cl, "lonely")))


def test_the_daemons_default_timeout_applies_to_a_call_without_one(
        inprocess: InProcessFactory) -> None:
    c = inprocess(2, settings={**SETTINGS, "timeouts.op": 0.5})
    zero = c.clients[0]
    err = failure(lambda: zero.neighbor_allreduce(ints(10, 0), name="default"))
    assert err.code == pb.TIMEOUT, err
    assert "'default' round 0 timed out after 0.5s" in err.message, err.message


def test_a_bad_request_fails_alone(inprocess: InProcessFactory) -> None:
    # each rank has a good request in flight when rank 0 sends two bad ones: a name the wire
    # reserves (refused outright) and weights that do not go together (failed as an op, and
    # rank 1's call of that name with it). The good requests are exact; the daemons go on
    c = inprocess(2, settings=SETTINGS)

    def work(cl: NumpyClient) -> tuple[np.ndarray, list[DecentError]]:
        good = cl.neighbor_allreduce_async(ints(1000, cl.rank), name="good", fuse=False)
        errors = []
        if cl.rank == 0:
            errors.append(failure(lambda: cl.neighbor_allreduce(
                ints(10, 0), name="bad\x1ename", timeout=30)))
            errors.append(failure(lambda: cl.neighbor_allreduce(
                ints(10, 0), name="bad", src_weights={1: 0.5}, timeout=30)))
        else:
            errors.append(failure(lambda: cl.neighbor_allreduce(ints(10, 1), name="bad",
                                                                timeout=30)))
        return good.wait(timeout=30).copy(), errors

    (good0, (reserved, weights)), (good1, (aborted,)) = run_ranks(c.clients, work)
    check_averages([good0, good1])
    assert reserved.code == pb.INVALID_ARGUMENT, reserved
    assert "'bad\\x1ename'" in reserved.message, reserved.message
    assert weights.code == pb.INVALID_ARGUMENT, weights
    assert "'bad' round 0" in weights.message, weights.message
    assert "src_weights given without self_weight" in weights.message, weights.message
    assert aborted.code == pb.INVALID_ARGUMENT, aborted
    assert "rank 0 failed" in aborted.message and weights.message in aborted.message, aborted
    check_averages(run_ranks(c.clients, lambda cl: average(cl, "after")))


def test_a_worker_that_leaves_fails_its_ops_and_the_daemon_serves_the_next(
        inprocess: InProcessFactory) -> None:
    # rank 0's op waits for rank 1, which never calls; rank 0's worker closes: the daemon fails
    # the op (its handle says why) and forgets it, and new workers average exactly
    c = inprocess(2, settings=SETTINGS)
    zero = c.clients[0]
    handle = zero.neighbor_allreduce_async(ints(10, 0), name="left", fuse=False, timeout=60)
    wait_for(lambda: c.status(0).ops_in_flight == 1, "rank 0's op to run")
    zero.close()
    err = failure(lambda: handle.wait(timeout=30))
    assert err.code in (pb.ABORTED, pb.SHUTTING_DOWN), err
    assert "'left'" in err.message or "closed" in err.message, err.message
    wait_for(lambda: c.status(0).ops_in_flight == 0, "rank 0's op to end")
    clients = c.connect("a new job of " + c.clients[1].job)
    check_averages(run_ranks(clients, lambda cl: average(cl, "next")))
