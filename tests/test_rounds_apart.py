"""One numbering of rounds across a count-out (docs/faults.md): when daemons counted each other
out and come back as the same processes, a round pairs with the same round everywhere; the
rounds one side ran without the other are left out on both sides, whichever got ahead.

Every wait is on a condition (a peer's state, an op in flight), never on a fixed sleep.
"""

from __future__ import annotations

import signal

import pytest
import torch

from cluster import Cluster, reweighted, ring_round, until_running, until_state

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("stopped", [(2,), (0, 1)], ids=["minority-silent", "majority-silent"])
def test_daemons_silent_past_the_deadline_are_counted_out_then_pair_again(
        stopped: tuple[int, ...]) -> None:
    """SIGSTOP stands in for a link flap: the others count the silent side out and run on (and
    when the others are the silent ones, the one left counts them out and runs rounds alone).
    The silent side's workers submit an op while it is stopped, so it starts with the peers as
    they were. Rounds keep one numbering: the rounds the running side ran without the silent
    one are left out on the silent side too (it was told them once the link was up), so that
    op and the silent side's next ones, up to the round the others reached, take only the
    silent side's parts; from there every rank pairs with every neighbour again."""
    c = Cluster(3, "ring", "--set", "timeouts.heartbeat=0.5", "--set", "timeouts.op=20")
    try:
        c.connect()
        values = {0: 1.0, 1: 2.0, 2: 4.0}
        for _ in range(3):
            assert ring_round(c.clients, "w", values)[0] == (pytest.approx(7 / 3), [1, 2])
        running = [cl for cl in c.clients if cl.rank not in stopped]
        for i in stopped:
            c.procs[i].send_signal(signal.SIGSTOP)
        try:
            for i in {cl.rank for cl in running}:
                for j in stopped:
                    until_state(c, i, j, "down")
            for _ in range(3):  # the running side goes on without the silent one(s)
                got = ring_round(running, "w", values)
                assert all(src == sorted({r.rank for r in running} - {rank})
                           for rank, (_, src) in got.items())
            pending = {i: c.clients[i].neighbor_allreduce_async(
                torch.full((8,), values[i]), name="w", timeout=20) for i in stopped}
        finally:
            for i in stopped:
                c.procs[i].send_signal(signal.SIGCONT)
        silent = [cl for cl in c.clients if cl.rank in stopped]
        apart = {i: (pytest.approx(reweighted(values, i, sorted(set(stopped) - {i})),
                                   rel=1e-6), sorted(set(stopped) - {i})) for i in stopped}
        # rounds 3..5: the running side ran them without the silent one(s), told once up
        got = {i: (h.wait(timeout=60)[0].item(), h.src_ranks) for i, h in pending.items()}
        assert got == apart
        for i in range(3):
            for j in set(range(3)) - {i}:
                until_state(c, i, j, "up")
        for _ in range(2):
            assert ring_round(silent, "w", values) == apart
        for _ in range(2):  # round 6 on: the three pair again, whole averages on every rank
            got = ring_round(c.clients, "w", values)
            assert got == {0: (pytest.approx(7 / 3, rel=1e-6), [1, 2]),
                           1: (pytest.approx(7 / 3, rel=1e-6), [0, 2]),
                           2: (pytest.approx(7 / 3, rel=1e-6), [0, 1])}
    finally:
        for p in c.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
        c.stop()


def test_a_rank_back_from_a_count_out_pairs_by_round_number_with_peers_at_different_rounds(
        ) -> None:
    """Rank 0 is counted out while ranks 1 and 2 run rounds 3 and 4; rank 1 starts round 5
    before it is back, rank 2 only after. Rank 0 then runs rounds 3 and 4 alone (both ran them
    without it), and round 5 with rank 2 only (rank 1 ran it without it); from round 6 the
    three pair again. Before, each peer paired rank 0's next round with its own next one (rank
    2's 5, rank 1's 6): rounds that differ by peer, which in larger cycles wait on each other
    until they time out (``make soak``, a link down for 5 s)."""
    c = Cluster(3, "ring", "--set", "timeouts.heartbeat=0.5", "--set", "timeouts.op=20")
    try:
        c.connect()
        values = {0: 1.0, 1: 2.0, 2: 4.0}
        everyone = {r: (pytest.approx(7 / 3, rel=1e-6), [q for q in range(3) if q != r])
                    for r in range(3)}
        for _ in range(3):
            assert ring_round(c.clients, "w", values) == everyone
        c.procs[0].send_signal(signal.SIGSTOP)
        try:
            for i in (1, 2):
                until_state(c, i, 0, "down")
            for _ in range(2):  # rounds 3, 4 without rank 0
                assert ring_round(c.clients[1:], "w", values) == {
                    1: (pytest.approx(reweighted(values, 1, [2]), rel=1e-6), [2]),
                    2: (pytest.approx(reweighted(values, 2, [1]), rel=1e-6), [1])}
            first = c.clients[1].neighbor_allreduce_async(torch.full((8,), values[1]),
                                                          name="w", timeout=20)
            until_running(c, 1)  # round 5 on rank 1, planned without rank 0
        finally:
            c.procs[0].send_signal(signal.SIGCONT)
        for i in range(3):
            for j in set(range(3)) - {i}:
                until_state(c, i, j, "up")
        second = c.clients[2].neighbor_allreduce_async(torch.full((8,), values[2]), name="w",
                                                       timeout=20)
        for _ in range(2):  # rank 0's rounds 3, 4: both peers ran them without it
            assert ring_round(c.clients[:1], "w", values) == {0: (values[0], [])}
        assert ring_round(c.clients[:1], "w", values) == {  # round 5: with rank 2 only
            0: (pytest.approx(reweighted(values, 0, [2]), rel=1e-6), [2])}
        assert (first.wait(timeout=60)[0].item(), first.src_ranks) == (
            pytest.approx(reweighted(values, 1, [2]), rel=1e-6), [2])
        assert (second.wait(timeout=60)[0].item(), second.src_ranks) == (
            pytest.approx(7 / 3, rel=1e-6), [0, 1])
        for _ in range(2):  # round 6 on: whole averages everywhere
            assert ring_round(c.clients, "w", values) == everyone
    finally:
        for p in c.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
        c.stop()
