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

from cluster import Cluster, delay
from conftest import ClusterFactory
from decent_wire.errors import DecentError

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


def test_an_invalid_root_on_one_rank_fails_every_rank(cluster: ClusterFactory) -> None:
    c = cluster(N)

    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        try:
            return cl.broadcast(torch.ones(4), root=9 if cl.rank == 1 else 0, name="bad.root")
        except DecentError as err:
            return err

    got = c.run(work)
    assert all(isinstance(g, DecentError) for g in got), got
    assert {g.code_name for g in got} == {"INVALID_ARGUMENT"}
    assert len({str(g) for g in got}) == 1
    assert "rank 1 cannot run it: root 9 is not a rank" in str(got[0])


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
