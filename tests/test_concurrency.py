"""Many ops in flight, submitted in different orders on different ranks."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch
from test_neighbor_allreduce import expected_matrix

from cluster import Cluster, delay
from conftest import ClusterFactory
from decent.core.requests.handles import Latch
from decent_wire.errors import DecentError


@pytest.mark.slow
def test_many_concurrent_named_ops(cluster: ClusterFactory) -> None:
    n, k = 4, 64
    c = cluster(n, "exponential")
    w = expected_matrix("exponential", n)
    rng = np.random.default_rng(7)
    xs = rng.standard_normal((n, k, 33))

    def work(cl):  # type: ignore[no-untyped-def]
        handles = [cl.neighbor_allreduce_async(torch.from_numpy(xs[cl.rank, t]), name=f"m{t}")
                   for t in range(k)]
        return [h.wait(timeout=60).numpy() for h in handles]

    got = c.run(work)
    for i in range(n):
        for t in range(k):
            np.testing.assert_allclose(got[i][t], w[i] @ xs[:, t], rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_ranks_submit_in_different_orders(cluster: ClusterFactory) -> None:
    n, k = 5, 24
    c = cluster(n, "ring")
    w = expected_matrix("ring", n)
    xs = np.random.default_rng(8).standard_normal((n, k, 4))

    def work(cl):  # type: ignore[no-untyped-def]
        order = list(range(k))
        random.Random(cl.rank).shuffle(order)
        ops = {}
        for t in order:  # mix op types too: neighbor_allreduce and allreduce interleaved
            x = torch.from_numpy(xs[cl.rank, t])
            if t % 3 == 0:
                ops[t] = cl.allreduce_async(x, name=f"o{t}")
            else:
                ops[t] = cl.neighbor_allreduce_async(x, name=f"o{t}")
        return {t: h.wait(timeout=60).numpy() for t, h in ops.items()}

    got = c.run(work)
    for i in range(n):
        for t in range(k):
            want = xs[:, t].mean(axis=0) if t % 3 == 0 else w[i] @ xs[:, t]
            np.testing.assert_allclose(got[i][t], want, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_repeated_rounds_of_one_name(cluster: ClusterFactory) -> None:
    n = 4
    c = cluster(n, "ring")
    w = expected_matrix("ring", n)
    x0 = np.random.default_rng(9).standard_normal((n, 8))

    def work(cl):  # type: ignore[no-untyped-def]
        t = torch.from_numpy(x0[cl.rank])
        for _ in range(20):
            t = cl.neighbor_allreduce(t, name="iter")
        return t.numpy()

    got = np.stack(c.run(work))
    want = np.linalg.matrix_power(w, 20) @ x0
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_more_in_flight_than_the_arena_holds(cluster: ClusterFactory) -> None:
    # 48 MiB submitted before any wait into 32 MiB arenas: finished results are moved out of the
    # arena to make room instead of deadlocking
    n, k, numel = 4, 48, 1 << 18  # 48 tensors of 1 MiB
    c = cluster(n, "ring")
    assert c.clients[0].arena.nbytes < k * numel * 4

    def work(cl):  # type: ignore[no-untyped-def]
        handles = [cl.neighbor_allreduce_async(torch.full((numel,), 3.0 * cl.rank + t),
                                               name=f"big{t}") for t in range(k)]
        return [float(h.wait(timeout=120)[0]) for h in handles]

    got = c.run(work, timeout=300)
    for i in range(n):
        for t in range(k):
            want = (i - 1) % 4 + i + (i + 1) % 4 + t  # mean of 3*j + t over the 3 ranks
            assert abs(got[i][t] - want) <= 1e-5 * want, (i, t, got[i][t])


@pytest.mark.slow
def test_a_full_arena_with_opposite_orders_completes_in_memory_of_its_own() -> None:
    # two ranks submit x, y and y, x; each arena (1 MiB) holds one 600 KiB tensor: each rank's
    # second op would wait for room that only the peer's second op frees. It goes to memory of
    # its own instead (the daemon counts it), and both ops complete exactly
    c = Cluster(2, "ring", "--set", "memory.arena_bytes=1048576")
    try:
        c.connect()
        numel = 600 * 1024 // 4

        def work(cl):  # type: ignore[no-untyped-def]
            delay(cl.rank)
            names = ["x", "y"] if cl.rank == 0 else ["y", "x"]
            handles = {name: cl.neighbor_allreduce_async(
                torch.full((numel,), float(cl.rank + (10 if name == "y" else 0))), name=name,
                timeout=30) for name in names}
            return {name: h.wait(timeout=60) for name, h in handles.items()}

        got = c.run(work)
        for rank in (0, 1):
            assert torch.equal(got[rank]["x"], torch.full((numel,), 0.5))
            assert torch.equal(got[rank]["y"], torch.full((numel,), 10.5))
        status = [c.status(i) for i in (0, 1)]
        assert all(s.arena_spills >= 1 for s in status), status
        assert all(s.arena_spill_bytes == 0 for s in status)  # released once read
        # and the arena path goes on as before
        ok = c.run(lambda cl: float(cl.neighbor_allreduce(
            torch.full((numel,), float(cl.rank)), name="z")[0]))
        assert ok == [0.5, 0.5]
    finally:
        c.stop()


@pytest.mark.slow
@pytest.mark.serial  # its ops time out after 3 s on purpose: a loaded host must not beat that
def test_without_registered_memory_a_full_arena_with_opposite_orders_fails_naming_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the same, with workers that may not hand memory to the daemon (DECENT_REGISTER=0): the
    # second ops cannot fit, and the errors say why (the arena) instead of only blaming the
    # peer; nothing else breaks
    monkeypatch.setenv("DECENT_REGISTER", "0")
    c = Cluster(2, "ring", "--set", "memory.arena_bytes=1048576")
    try:
        c.connect()
        numel = 600 * 1024 // 4

        def work(cl):  # type: ignore[no-untyped-def]
            outcomes = []
            for name in (["x", "y"] if cl.rank == 0 else ["y", "x"]):
                try:
                    h = cl.neighbor_allreduce_async(torch.full((numel,), 1.0), name=name,
                                                    timeout=3)
                    outcomes.append(h)
                except DecentError as exc:
                    outcomes.append(exc.with_traceback(None))
            for i, h in enumerate(outcomes):
                if not isinstance(h, DecentError):
                    try:
                        h.wait(timeout=60)
                        outcomes[i] = None
                    except DecentError as exc:
                        # no traceback: its frames would keep a handle, and the arena slot of
                        # the result it holds, alive past this function
                        outcomes[i] = exc.with_traceback(None)
            return outcomes

        got = c.run(work)
        errors = [e for rank in got for e in rank if e is not None]
        assert errors, got
        for e in errors:
            assert (e.code_name == "ARENA_ERROR" and "memory.arena_bytes" in e.message) or \
                (e.code_name in ("TIMEOUT", "ABORTED") and "full arena" in e.message), e
        assert [c.status(i).arena_spills for i in (0, 1)] == [0, 0]
        ok = c.run(lambda cl: float(cl.neighbor_allreduce(
            torch.full((numel,), float(cl.rank)), name="z")[0]))
        assert ok == [0.5, 0.5]
    finally:
        c.stop()


def test_a_requests_latch_lets_every_waiter_through_once_it_is_set() -> None:
    latch = Latch()
    assert not latch.is_set() and latch.wait(0.01) is False  # nobody set it: the wait times out
    started = [threading.Event() for _ in range(3)]
    passed: list[bool] = []

    def waiter(i: int) -> None:
        started[i].set()
        passed.append(latch.wait(60))

    threads = [threading.Thread(target=waiter, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for e in started:
        e.wait(60)
    latch.set()
    latch.set()  # a second set changes nothing
    for t in threads:
        t.join(60)
    assert passed == [True, True, True] and latch.is_set() and latch.wait(0) is True


def test_threads_waiting_at_once_each_get_their_own_result(cluster: ClusterFactory) -> None:
    # one waiting thread reads the completions for all (the leader), the others wait on it or
    # on the background reader (followers); every thread must get its own op's result
    c = cluster(2, "ring")
    k = 4

    def work(cl):  # type: ignore[no-untyped-def]
        got: dict[int, float] = {}

        def one(i: int) -> None:
            x = torch.full((8,), float(i + 1) * (1 if cl.rank == 0 else 10))
            got[i] = float(cl.neighbor_allreduce(x, name=f"threads{i}", timeout=60)[0])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        return got

    for got in c.run(work):
        assert got == {i: 5.5 * (i + 1) for i in range(k)}  # (x + 10 x) / 2


def test_an_op_nobody_waits_for_finishes_in_the_background(cluster: ClusterFactory) -> None:
    # after a waited op (its caller read the completions itself), the next op's completion
    # still reaches its handle and its callbacks without anyone waiting for it
    c = cluster(2, "ring")
    fired = threading.Event()

    def work(cl):  # type: ignore[no-untyped-def]
        assert float(cl.neighbor_allreduce(torch.ones(4), name="waited")[0]) == 1.0
        h = cl.neighbor_allreduce_async(torch.full((4,), float(cl.rank)), name="unwaited")
        if cl.rank == 0:
            h.on_done(fired.set)
            assert fired.wait(60), "the op's completion never reached its handle"
            assert h.done()
        return float(h.wait(timeout=60)[0])

    assert c.run(work) == [0.5, 0.5]
