"""A joining rank takes its state from several donors at once, in checksummed chunks: exactly the
primary donor's state, each chunk from any donor holding the same bytes, a chunk that fails
fetched again from another (issue 42 point 4; :mod:`decent.core.training.chunks`)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch

from cluster import Cluster, delay
from decent.core.surface.membership import View
from decent.core.surface.rejoin import CHUNK_NAME, JoinWatch
from decent.core.training.chunks import ChunkPlan, digest, layout
from decent.core.training.transfer import (
    IN_STEP_LEADS,
    MAX_LEAD_STEPS,
    StateLink,
    Taken,
    near_donors,
)
from decent.torch.state import KIT

CHUNK = 256


def test_chunks_never_span_two_tensors_and_cover_every_byte() -> None:
    chunks = layout([600, 0, 256, 10], CHUNK)
    assert [(c.tensor, c.start, c.stop) for c in chunks] == [
        (0, 0, 256), (0, 256, 512), (0, 512, 600), (2, 0, 256), (3, 0, 10)]


def test_a_plan_spreads_chunks_over_their_holders_and_refetches_a_bad_one_elsewhere() -> None:
    chunks = layout([1024], CHUNK)  # 4 chunks
    good = [digest(bytes([i]) * CHUNK) for i in range(4)]
    other = [good[0], b"x" * 32, good[2], good[3]]  # donor 2 differs in chunk 1
    plan = ChunkPlan(chunks, good, {0: good, 2: other, 5: None})
    ask = plan.next_round()
    assert ask == {0: [0, 1], 2: [2, 3], 5: []}  # chunk 1 only from 0; by bytes, then rank
    plan.arrived(2, 2, True)
    plan.arrived(2, 3, False)  # a bad chunk 3 from donor 2
    plan.arrived(0, 0, True)
    plan.arrived(0, 1, True)
    assert plan.next_round() == {0: [3], 2: [], 5: []} and plan.refetched == 1
    plan.donor_failed(0)  # the primary dies: chunk 3 only from donor 2 again
    assert plan.next_round() == {2: [3], 5: []}
    plan.donor_failed(2)
    with pytest.raises(ValueError, match="no donor left holds chunk 3"):
        plan.next_round()


def test_a_chunk_that_keeps_failing_fails_the_transfer_after_a_bounded_number_of_rounds() -> None:
    chunks = layout([CHUNK], CHUNK)
    good = [digest(b"a" * CHUNK)]
    plan = ChunkPlan(chunks, good, {0: good})
    for _ in range(plan.max_rounds):
        assert plan.next_round() == {0: [0]}
        plan.arrived(0, 0, False)
    with pytest.raises(ValueError, match="failed its checksum from ranks \\[0\\]"):
        plan.next_round()


def test_donors_that_said_their_steps_at_different_moments_are_in_step() -> None:
    # (step, lead): donor 2 answered later than donor 1, before donor 1 had timed its steps
    # (lead 2); before, donor 2 became the primary and donor 1 was told it was not needed
    assert near_donors({1: (3, 2), 2: (9, 2)}, [1, 2]) == [1, 2]
    assert near_donors({1: (0, 2), 2: (IN_STEP_LEADS * 150, 150)}, [1, 2]) == [1, 2]
    # a worker restarted alone (its steps from 0) is far behind: the furthest is primary
    assert near_donors({1: (5, 2), 2: (10**6, 150), 3: (10**6 - 40, 150)}, [1, 2, 3]) == [2, 3]
    assert near_donors({1: (10**6, 150), 2: (5, 2)}, [1, 2]) == [1]


def state_at(step: int, rank: int, differ: bool) -> dict[str, Any]:
    """A training state of several dtypes; its ``"step"`` is the step it was taken at, and its
    ``"local"`` tensor is the rank's own when ``differ`` (a decentralized algorithm's)."""
    g = torch.Generator().manual_seed(7)
    return {"params": [torch.randn(300, generator=g), torch.randn(7, 5, generator=g).double()],
            "local": torch.full((100,), float(rank if differ else 0)),
            "flags": torch.arange(50) % 3 == 0,
            "half": torch.randn(200, generator=g).to(torch.bfloat16),
            "step": torch.tensor([step]), "lr": 0.1, "name": "sgd"}


class CorruptingLink(StateLink[torch.Tensor]):
    """A donor whose chunks arrive damaged (one byte flipped): a bad link or bad memory."""

    def _send_array(self, to: int, values: np.ndarray, name: str) -> None:
        if name.startswith(CHUNK_NAME):
            values = values.copy()
            values[0] ^= 0xFF
        super()._send_array(to, values, name)


def donors_in_step(links: list[StateLink[torch.Tensor]], joiner: int,
                   state: Callable[[int, int], dict[str, Any]],
                   first_step: dict[int, int] | None = None,
                  stride: int = 1) -> list[threading.Thread]:
    """Each link serves ``joiner`` while its rank trains in lockstep with the others (a
    barrier per step, as a synchronous algorithm's collective makes it), handing out
    ``state(step, rank)`` at each step boundary, its steps counted from ``first_step`` of its
    rank (0) in ``stride``s; returns the training threads."""
    barrier = threading.Barrier(len(links))
    for link in links:  # a donor serves once it has reached a step boundary (as an optimizer)
        step = (first_step or {}).get(link.client.rank, 0)
        link.hand_out(step, functools.partial(state, step, link.client.rank))
    serving = [link.serve_in_background(joiner, 60) for link in links]

    def train(link: StateLink[torch.Tensor]) -> None:
        step = (first_step or {}).get(link.client.rank, 0)
        while any(t.is_alive() for t in serving):  # a donor told it is not needed trains on
            delay(link.client.rank)
            link.hand_out(step, functools.partial(state, step, link.client.rank))
            step += stride
            try:
                barrier.wait(timeout=60)
            except threading.BrokenBarrierError:  # another donor is done
                return
        barrier.abort()  # the others' waits end too

    threads = [threading.Thread(target=train, args=(link,)) for link in links]
    for t in threads:
        t.start()
    return threads


def take(c: Cluster, differ: bool, corrupt: bool = False,
         first_step: dict[int, int] | None = None, stride: int = 1) -> tuple[Any, Taken]:
    """Rank 0 takes the state of donors 1 (primary) and 2 (damaging its chunks when
    ``corrupt``), their steps counted from ``first_step`` in ``stride``s."""
    links = [StateLink(c.clients[1], KIT, chunk_bytes=CHUNK),
             (CorruptingLink if corrupt else StateLink)(c.clients[2], KIT, chunk_bytes=CHUNK)]
    joiner = StateLink(c.clients[0], KIT)
    training = donors_in_step(links, 0, lambda step, rank: state_at(step, rank, differ),
                              first_step, stride)
    with ThreadPoolExecutor(1) as pool:
        got = pool.submit(joiner.receive, [1, 2]).result(timeout=120)
    for t in training:
        t.join(timeout=60)
    assert joiner.taken is not None
    return got, joiner.taken


def assert_is_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for key in ("params",):
        assert all(torch.equal(a, b) and a.dtype == b.dtype
                   for a, b in zip(got[key], want[key], strict=True))
    for key in ("local", "flags", "half", "step"):
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
    assert (got["lr"], got["name"]) == (want["lr"], want["name"])


@pytest.fixture(scope="module")
def cluster() -> Any:
    c = Cluster(3, "ring")
    try:
        c.connect()
        yield c
    finally:
        c.stop()


def test_donors_in_step_each_send_part_of_the_one_state(cluster: Cluster) -> None:
    got, taken = take(cluster, differ=False)
    assert_is_state(got, state_at(taken.step, 1, differ=False))
    assert int(got["step"]) == taken.step >= 2  # at the step named: both donors were there
    assert taken.bytes_from[1] > 0 and taken.bytes_from[2] > 0, taken
    assert sum(taken.bytes_from.values()) == 1200 + 280 + 400 + 50 + 400 + 8
    assert taken.refetched == 0


def test_a_donor_whose_state_differs_sends_only_the_chunks_it_holds_alike(
        cluster: Cluster) -> None:
    got, taken = take(cluster, differ=True)
    assert_is_state(got, state_at(taken.step, 1, differ=True))  # the primary's, exactly
    assert bool((got["local"] == 1).all())
    assert 0 < taken.bytes_from[2] <= 1200 + 280 + 50 + 400 + 8, taken  # never "local"'s
    assert taken.refetched == 0


def test_chunks_that_fail_their_checksum_are_fetched_again_from_another_donor(
        cluster: Cluster) -> None:
    got, taken = take(cluster, differ=False, corrupt=True)
    assert_is_state(got, state_at(taken.step, 1, differ=False))
    assert taken.refetched > 0 and taken.bytes_from[2] == 0, taken
    assert taken.rounds == 2, taken


def test_donors_already_past_the_step_named_say_the_step_their_state_is_from(
        cluster: Cluster) -> None:
    """Donors that step on past the step the newcomer names before they hear it (a loaded
    host) snapshot at once: the newcomer says the step its state is really from (before: the
    step it named, while the state was from a later one)."""
    stride = 2 * MAX_LEAD_STEPS  # every step boundary is past any step the newcomer names
    got, taken = take(cluster, differ=True, stride=stride)
    assert taken.step % stride == 0 and int(got["step"]) == taken.step, taken
    # the primary: donor 1, or donor 2 when it said a step further ahead than ten leads
    assert_is_state(got, state_at(taken.step, taken.primary, differ=True))


@pytest.mark.parametrize("behind", [1, 2])
def test_a_donor_far_behind_the_others_gives_nothing_and_keeps_nobody_waiting(
        cluster: Cluster, behind: int) -> None:
    """A donor whose steps count from far behind (a worker that restarted alone) is told at
    once that nothing is taken from it, and the newcomer takes the state of the donor ahead,
    even when the one behind is the first donor (before: the newcomer named a step the one
    behind never reached, and waited out the op timeout, or took the one behind's state)."""
    ahead = 3 - behind
    got, taken = take(cluster, differ=True, first_step={ahead: 10**6})  # far past any lead
    assert taken.primary == ahead and taken.step >= 10**6, taken
    assert_is_state(got, state_at(taken.step, ahead, differ=True))
    assert set(taken.bytes_from) == {ahead}, taken


def test_a_daemon_down_at_a_donors_first_look_that_comes_back_as_itself_has_not_joined() -> None:
    """A survivor's first look at the view may come while a daemon is counted out (stopped):
    that daemon coming back as the same process is no newcomer (before: its donors waited for
    a state request that never came, and it was served as if it had restarted)."""
    views = [View(5, (0, 2), (0, 2), ((0, 10), (2, 12)), known=((0, 10), (1, 11), (2, 12))),
             View(6, (0, 1, 2), (0, 1, 2), ((0, 10), (1, 11), (2, 12))),
             View(7, (0, 2), (0, 2), ((0, 10), (2, 12))),
             View(8, (0, 1, 2), (0, 1, 2), ((0, 10), (1, 99), (2, 12)))]
    watch = JoinWatch(0, 1, lambda: views.pop(0))
    assert watch.to_serve(5) == []  # the first look
    assert watch.to_serve(6) == []  # daemon 1 back, the same process
    assert watch.to_serve(7) == []
    assert watch.to_serve(8) == [1]  # daemon 1 restarted: a new process
