"""A collective ends the same way on every rank (issue 28, point 1).

Four ranks call one collective with mixed disagreements: two ranks with another dtype, one with
another shape, one with another broadcast root. Each case runs 20 times with a random delay on
a random rank: every rank fails, with the same code and the same message, naming the ranks on
each side; nobody gets data. An agreeing op right after runs exact, so nothing is left behind.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from cluster import Cluster, delay, until
from conftest import ClusterFactory
from decent_wire.errors import DecentError

pytestmark = pytest.mark.slow

N = 4
RUNS = 20


def tensor_of(rank: int, dtype: dict[int, torch.dtype], shape: dict[int, tuple[int, ...]]
              ) -> torch.Tensor:
    return torch.full(shape.get(rank, (6,)), rank + 1).to(dtype.get(rank, torch.float32))


CASES: dict[str, tuple[str, Callable[[Any, int, str], Any], str]] = {
    # (what, the call on rank r, what the message must name)
    "broadcast-dtype-on-two-ranks": (
        "broadcast", lambda cl, r, name: cl.broadcast(
            tensor_of(r, {1: torch.int32, 3: torch.int32}, {}), root=0, name=name),
        "ranks 0, 2 broadcast float32[6]; ranks 1, 3 broadcast int32[6]"),
    "allreduce-shape-on-one-rank": (
        "allreduce", lambda cl, r, name: cl.allreduce(
            tensor_of(r, {}, {2: (7,)}), name=name),
        "ranks 0, 1, 3 allreduce float32[6]; rank 2 allreduce float32[7]"),
    "broadcast-root-on-one-rank": (
        "broadcast", lambda cl, r, name: cl.broadcast(
            tensor_of(r, {}, {}), root=1 if r == 3 else 0, name=name),
        "ranks 0, 1, 2 broadcast float32[6]; rank 3 broadcast float32[6] (root: 1)"),
    "allgather-dtype-on-two-ranks": (
        "allgather", lambda cl, r, name: cl.allgather(
            tensor_of(r, {0: torch.float64, 2: torch.float64}, {}), name=name),
        "ranks 0, 2 allgather float64[6]"),
}


@pytest.fixture(scope="module")
def four() -> Iterator[Cluster]:
    c = Cluster(N, "ring")
    c.connect()
    yield c
    c.stop()


@pytest.mark.parametrize("case", list(CASES))
def test_a_disagreement_fails_every_rank_the_same_way(four: Cluster, case: str) -> None:
    _, call, named = CASES[case]
    rng = random.Random(case)
    for run in range(RUNS):
        slow, pause = rng.randrange(N), rng.uniform(0.0, 0.2)

        def work(cl, slow=slow, pause=pause, run=run):  # type: ignore[no-untyped-def]
            delay(cl.rank)
            if cl.rank == slow:
                time.sleep(pause)  # a different rank is late each run
            try:
                return call(cl, cl.rank, f"{case}.{run}")
            except DecentError as err:
                return err

        got = four.run(work)
        assert all(isinstance(g, DecentError) for g in got), (run, got)  # nobody got data
        codes = {g.code_name for g in got}
        messages = {str(g) for g in got}
        assert codes == {"MISMATCH"}, (run, codes)
        assert len(messages) == 1, "\n".join(sorted(messages))  # the same error everywhere
        (message,) = messages
        assert named in message and "none runs it" in message, message
        # the next op of the same kind runs exact on every rank
        def then(cl, run=run):  # type: ignore[no-untyped-def]
            return cl.allreduce(torch.full((3,), float(cl.rank)), name=f"{case}.after.{run}")

        after = four.run(then)
        for out in after:
            assert torch.equal(out, torch.full((3,), 1.5))


#: two ops of different kinds under one name, one on rank 0 and one on the others
NAMED_OPS: dict[str, Callable[[Any, str], Any]] = {
    "allreduce": lambda cl, name: cl.allreduce(torch.ones(4), name=name, timeout=60),
    "neighbor_allreduce": lambda cl, name: cl.neighbor_allreduce(torch.ones(4), name=name,
                                                                 timeout=60),
    "broadcast": lambda cl, name: cl.broadcast(torch.ones(4), root=0, name=name, timeout=60),
}


@pytest.mark.parametrize(("first", "other"), [(a, b) for a in NAMED_OPS for b in NAMED_OPS
                                              if a != b])
def test_ops_of_different_kinds_under_one_name_fail_as_a_mismatch(
        cluster: ClusterFactory, first: str, other: str) -> None:
    # they once waited out their timeout on both sides (TIMEOUT, naming nothing); now each rank
    # fails with MISMATCH naming both kinds, long before the 60 s timeout
    c = cluster(2)

    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        try:
            return NAMED_OPS[first if cl.rank == 0 else other](cl, f"clash.{first}.{other}")
        except DecentError as err:
            return err

    got = c.run(work)
    assert all(isinstance(g, DecentError) and g.code_name == "MISMATCH" for g in got), got
    for g in got:
        assert first in g.message and other in g.message, g


def test_a_small_and_a_ring_allreduce_under_one_name_fail_alike(cluster: ClusterFactory) -> None:
    """One rank's tensor is small (its allreduce agrees in its exchange), the other's is past
    the ring threshold (agreed beside): every rank still fails with the one verdict."""
    c = cluster(2)

    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        try:
            return cl.allreduce(torch.ones(6 if cl.rank == 0 else 200_000), name="ring.or.not",
                                timeout=60)
        except DecentError as err:
            return err

    got = c.run(work)
    assert all(isinstance(g, DecentError) and g.code_name == "MISMATCH" for g in got), got
    assert len({str(g) for g in got}) == 1, got
    assert "rank 0 allreduce float32[6]; rank 1 allreduce float32[200000]" in str(got[0])


@pytest.mark.parametrize(("n", "bad"), [(4, 1), (4, 0), (3, 1)])
def test_an_invalid_root_on_one_rank_fails_every_rank(cluster: ClusterFactory, n: int,
                                                      bad: int) -> None:
    """Four daemons agree through rank 0 (the one that cannot run it is another rank, or rank 0
    itself); three all to all."""
    c = cluster(n)

    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        try:
            return cl.broadcast(torch.ones(4), root=9 if cl.rank == bad else 1,
                                name=f"bad.root.{bad}")
        except DecentError as err:
            return err

    got = c.run(work)
    assert all(isinstance(g, DecentError) for g in got), got
    assert {g.code_name for g in got} == {"INVALID_ARGUMENT"}
    assert len({str(g) for g in got}) == 1, [str(g) for g in got]
    assert f"rank {bad} cannot run it: root 9 is not a rank" in str(got[0])


def test_a_larger_group_agrees_through_its_lowest_rank() -> None:
    """Five daemons (more than ``ALL_TO_ALL_UP_TO``): in each broadcast from rank 0, every
    other daemon sends rank 0 its description and nothing to the others; rank 0 sends each the
    tensor and the verdict. All to all, each would have sent every other one a description."""
    from decentd.ops.agreement import ALL_TO_ALL_UP_TO

    n, calls = 5, 10
    assert n > ALL_TO_ALL_UP_TO
    c = Cluster(n, "ring", "--set", "timeouts.heartbeat=60")  # no idle heartbeats meanwhile
    try:
        c.connect()
        c.run(lambda cl: cl.broadcast(torch.ones(3), root=0, name="links.up"))

        def frames() -> list[dict[int, int]]:
            return [{p.rank: p.frames_sent for p in c.status(i).peers} for i in range(n)]

        before = frames()
        got = c.run(lambda cl: [cl.broadcast(torch.full((3,), float(cl.rank + 1)), root=0,
                                             name=f"coordinated.{k}") for k in range(calls)])
        after = frames()
        sent = [{j: after[i][j] - before[i][j] for j in after[i]} for i in range(n)]
        assert all(torch.equal(t, torch.ones(3)) for per in got for t in per)
        assert sent[0] == {j: 2 * calls for j in range(1, n)}, sent[0]
        for i in range(1, n):
            # its descriptions (and perhaps a flow-control credit) to rank 0, nothing else
            assert calls <= sent[i][0] <= calls + 2, (i, sent[i])
            assert all(sent[i][j] == 0 for j in range(1, n) if j != i), (i, sent[i])
    finally:
        c.stop()


def test_a_coordinator_that_fused_more_does_not_hold_back_the_others(
        cluster: ClusterFactory) -> None:
    """Rank 0, the coordinator of five, sends t1 and t2 in one request; the others send t2 only
    once t1 has returned. t1's verdict goes out when t1's descriptions are in, not when t2's
    are (which would wait for t1: a deadlock until the timeout)."""
    c = cluster(5)

    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        a, b = torch.full((3,), float(cl.rank)), torch.ones(3)
        if cl.rank == 0:
            with cl.fused():
                first = cl.allreduce_async(a, name="fused.t1", timeout=30)
                second = cl.allreduce_async(b, name="fused.t2", timeout=30)
            return first.wait(), second.wait()
        first_result = cl.allreduce(a, name="fused.t1", timeout=30)
        return first_result, cl.allreduce(b, name="fused.t2", timeout=30)

    for first, second in c.run(work):
        assert torch.equal(first, torch.full((3,), 2.0)) and torch.equal(second, torch.ones(3))


def test_a_coordinators_timeout_names_the_rank_it_still_waits_for() -> None:
    """Five daemons, rank 4 never calls: the coordinator (with the shortest timeout) says it
    waits for rank 4, and the others fail too (its ABORT), long before their own timeout."""
    c = Cluster(5, "ring")
    try:
        c.connect()

        def work(cl):  # type: ignore[no-untyped-def]
            if cl.rank == 4:
                return None
            try:
                return cl.broadcast(torch.ones(2), root=0, name="silent.4",
                                    timeout=2 if cl.rank == 0 else 30)
            except DecentError as err:
                return err

        got = c.run(work)
        assert isinstance(got[0], DecentError) and got[0].code_name == "TIMEOUT", got[0]
        assert "still waiting for rank(s) [4]" in got[0].message, got[0].message
        assert all(isinstance(g, DecentError) for g in got[1:4]), got
    finally:
        c.stop()


def test_agreeing_collectives_still_run_exact(cluster: ClusterFactory) -> None:
    c = cluster(N)

    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        x = torch.arange(5, dtype=torch.float64) + cl.rank
        return (cl.allreduce(x, name="ok.ar"), cl.broadcast(x, root=2, name="ok.bc"),
                cl.allgather(x[: cl.rank + 1].contiguous(), name="ok.ag"))

    for ar, bc, ag in c.run(work):
        assert torch.equal(ar, torch.arange(5, dtype=torch.float64) + 1.5)
        assert torch.equal(bc, torch.arange(5, dtype=torch.float64) + 2)
        assert torch.equal(ag, torch.cat([(torch.arange(5, dtype=torch.float64) + r)[: r + 1]
                                          for r in range(N)]))


# --------------------------------------------------------------------------- group rounds


def test_group_calls_that_disagree_before_their_round_is_decided_fail_every_member(
        cluster: ClusterFactory) -> None:
    # one butterfly group of all four ranks, led by rank 0. Rank 3 has no window yet, so the
    # leader's sum waits for it: the round cannot be decided before both calls reached it.
    c = cluster(N, "hypercube")
    kind = torch.float64
    for i in range(3):
        c.clients[i].win_create(torch.full((3,), float(i), dtype=kind), "d")
    before = c.status(0).group_calls_led
    with_self = c.clients[0].group_allreduce_async(torch.full((3,), 10.0, dtype=kind), "d", 4,
                                                   rule="with-self")
    mean = c.clients[1].group_allreduce_async(torch.full((3,), 11.0, dtype=kind), "d", 4)
    until(lambda: c.status(0).group_calls_led == before + 2, "both calls at the leader")
    c.clients[3].win_create(torch.full((3,), 3.0, dtype=kind), "d")  # the sum goes on
    errors = [catch(h.wait) for h in (with_self, mean)]
    errors += [catch(lambda r=r: c.clients[r].group_allreduce(  # type: ignore[misc]
        torch.full((3,), 10.0 + r, dtype=kind), "d", 4)) for r in (2, 3)]
    terms = "float64[3], group_size 4, rule"
    for e in errors:
        assert e.code_name == "MISMATCH", e
        assert str(e) == str(errors[0])  # the same message on every member
    assert f"the members disagree, so none gets a result: rank 0 asks {terms} with-self; " \
           f"rank 1 asks {terms} mean" in str(errors[0])
    # the next round agrees: exact, from what each member published
    def agree(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        cl.win_publish(torch.full((3,), 20.0 + cl.rank, dtype=kind), "d")
        cl.barrier(name="d.b1")
        return cl.group_allreduce(torch.full((3,), 20.0 + cl.rank, dtype=kind), "d", 4)

    for y in c.run(agree):
        assert torch.equal(y, torch.full((3,), 21.5, dtype=kind))


def test_a_group_call_that_disagrees_with_its_decided_round_fails_alone(
        cluster: ClusterFactory) -> None:
    # wait-avoiding: rank 2 calls after the others have their results (which used its last
    # published copy, as WAGMA does); its call asks another rule, so it fails, naming both
    c = cluster(N, "hypercube")
    kind = torch.float64

    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        r = cl.rank
        cl.win_create(torch.full((3,), float(r), dtype=kind), "late")
        if r != 2:
            cl.win_publish(torch.full((3,), 10.0 + r, dtype=kind), "late")
        cl.barrier(name="late.b0")
        y: Any = None
        if r != 2:
            y = cl.group_allreduce(torch.full((3,), 10.0 + r, dtype=kind), "late", 4)
        cl.barrier(name="late.mid")
        if r == 2:
            y = catch(lambda: cl.group_allreduce(torch.full((3,), 12.0, dtype=kind), "late", 4,
                                                 rule="with-self"))
        cl.win_publish(torch.full((3,), 20.0 + r, dtype=kind), "late")
        cl.barrier(name="late.b1")
        z = cl.group_allreduce(torch.full((3,), 20.0 + r, dtype=kind), "late", 4)
        return y, z

    got = c.run(work)
    for r, (y, z) in enumerate(got):
        if r == 2:
            assert y.code_name == "MISMATCH", y
            assert ("group round 1 (leader rank 0) ran as float64[3], group_size 4, rule mean; "
                    "rank 2 asks float64[3], group_size 4, rule with-self") in str(y)
        else:  # (10 + 11 + 2 + 13) / 4: rank 2's copy was its win_create tensor
            assert torch.equal(y, torch.full((3,), 9.0, dtype=kind)), r
        assert torch.equal(z, torch.full((3,), 21.5, dtype=kind)), r


def catch(call: Callable[[], Any]) -> DecentError:
    """The DecentError ``call`` raises (AssertionError if it returns)."""
    with pytest.raises(DecentError) as e:
        call()
    return e.value


#: (what differs, the call on rank r of a group of n, what the message must name)
FEW: dict[str, tuple[Callable[[Any, int, int, str], Any], str]] = {
    "shape": (lambda cl, r, n, name: cl.allreduce(tensor_of(r, {}, {n - 1: (7,)}), name=name),
              "allreduce float32[7]"),
    "dtype": (lambda cl, r, n, name: cl.allreduce(tensor_of(r, {0: torch.float64}, {}),
                                                  name=name), "rank 0 allreduce float64[6]"),
    "reduce op": (lambda cl, r, n, name: cl.allreduce(tensor_of(r, {}, {}), name=name,
                                                      op="sum" if r == 1 else "average"),
                  "reduce_op: SUM"),
}


@pytest.mark.parametrize("n", [2, 3])
def test_a_small_allreduce_among_a_few_agrees_in_its_own_exchange(cluster: ClusterFactory,
                                                                  n: int) -> None:
    """Up to ALL_TO_ALL_UP_TO daemons, a direct allreduce carries each tensor's description in
    its own message: one frame per peer and call (no agreement messages beside it), exact; and
    a disagreement still fails every rank with the same message, however late a rank is."""
    from decentd.ops.agreement import ALL_TO_ALL_UP_TO

    assert n <= ALL_TO_ALL_UP_TO
    c = cluster(n)
    c.run(lambda cl: cl.allreduce(torch.ones(3), name="links.up"))

    def frames() -> list[dict[int, int]]:
        return [{p.rank: p.frames_sent for p in c.status(i).peers} for i in range(n)]

    before, calls = frames(), 10
    got = c.run(lambda cl: [cl.allreduce(torch.full((5,), float(cl.rank + 1)), op="sum",
                                         name=f"few.{k}") for k in range(calls)])
    after = frames()
    total = float(sum(range(1, n + 1)))
    assert all(torch.equal(t, torch.full((5,), total)) for per in got for t in per)
    for i in range(n):  # its tensors (perhaps a credit or a heartbeat) to each other rank
        assert all(calls <= after[i][j] - before[i][j] <= calls + 2 for j in after[i]), \
            (i, before[i], after[i])
    rng = random.Random(n)
    for what, (call, named) in FEW.items():
        for run in range(RUNS // 2):
            errors = c.run(_late_one(call, n, rng.randrange(n), rng.uniform(0.0, 0.2),
                                     f"few.{what}.{run}"))
            assert all(isinstance(e, DecentError) for e in errors), (what, run, errors)
            assert {e.code_name for e in errors} == {"MISMATCH"}, (what, errors)
            assert len({str(e) for e in errors}) == 1, "\n".join(map(str, errors))
            assert named in str(errors[0]) and "none runs it" in str(errors[0]), errors[0]
    after_all = c.run(lambda cl: cl.allreduce(torch.full((3,), float(cl.rank)), op="sum",
                                              name="few.after"))
    assert all(torch.equal(t, torch.full((3,), float(sum(range(n))))) for t in after_all)


def _late_one(call: Callable[[Any, int, int, str], Any], n: int, slow: int, pause: float,
              name: str) -> Callable[[Any], Any]:
    """Rank ``slow`` makes ``call`` ``pause`` seconds after the others; its error, if any."""
    def work(cl: Any) -> Any:
        delay(cl.rank)
        if cl.rank == slow:
            time.sleep(pause)
        try:
            return call(cl, cl.rank, n, name)
        except DecentError as err:
            return err
    return work
