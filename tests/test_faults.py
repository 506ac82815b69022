"""Peers that die, drop and come back, with real daemons (issue 26, docs/faults.md).

Every wait here is on a condition (an op in flight, a peer's state in the daemon's status), never
on a fixed sleep: ``until`` polls a condition with a deadline that only bounds a failure.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch

import decent.torch as dt
from cluster import Cluster
from decent_wire.errors import DecentError
from decent_wire.v1 import decent_pb2 as pb

#: a ring of 3 with uniform weights: every rank gives itself and each in-neighbor 1/3
THIRD = np.float32(1 / 3)


def until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Wait for ``condition`` (polled); fail naming ``what`` when it does not come."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def peer_state(c: Cluster, i: int, peer: int) -> str:
    """Daemon ``i``'s view of daemon ``peer``: up, reconnecting or down."""
    return next(p.state for p in c.status(i).peers if p.rank == peer)


def submit_and_kill(c: Cluster, name: str, victim: int) -> list:
    """Ranks other than ``victim`` start a neighbor_allreduce of ``rank + 1``; once every
    survivor's daemon runs it, ``victim``'s daemon gets SIGKILL. The survivors' handles."""
    survivors = [i for i in range(c.n) if i != victim]
    handles = [c.clients[i].neighbor_allreduce_async(torch.full((1000,), float(i + 1)),
                                                     name=name, timeout=30) for i in survivors]
    for i in survivors:
        until(lambda i=i: c.status(i).ops_in_flight > 0, f"rank {i} to run '{name}'")
    c.procs[victim].send_signal(signal.SIGKILL)
    c.procs[victim].wait()
    return handles


def test_a_daemon_killed_mid_op_is_reweighted_out_exactly() -> None:
    c = Cluster(3, "ring")
    try:
        c.connect()
        handles = submit_and_kill(c, "doomed", 2)
        got = [h.wait(timeout=60) for h in handles]
        # ring of 3, in-neighbors of 0: {1, 2}, of 1: {0, 2}; rank 2's third goes to self
        want0 = np.float32(2 * THIRD) * np.float32(1) + THIRD * np.float32(2)
        want1 = np.float32(2 * THIRD) * np.float32(2) + THIRD * np.float32(1)
        np.testing.assert_allclose(got[0].numpy(), np.full(1000, want0), rtol=1e-6)
        np.testing.assert_allclose(got[1].numpy(), np.full(1000, want1), rtol=1e-6)
        assert [h.src_ranks for h in handles] == [[1], [0]]
        # the next ops leave rank 2 out from the start, at once
        later = [c.clients[i].neighbor_allreduce_async(torch.full((4,), float(i + 1)),
                                                       name="after", timeout=30) for i in (0, 1)]
        assert [h.wait(timeout=60)[0].item() for h in later] == \
            pytest.approx([float(want0), float(want1)], rel=1e-6)
        for i in (0, 1):
            view = c.clients[i].membership()
            assert view.daemons == (0, 1) and view.ranks == (0, 1)
            assert view.epoch >= 1
            # reaching it again was refused: down (it was left out from the drop on)
            until(lambda i=i: peer_state(c, i, 2) == "down", f"rank {i} to call rank 2 down")
    finally:
        c.clients = c.clients[:2]
        c.stop()


def test_a_daemon_killed_mid_op_fails_it_under_fail() -> None:
    c = Cluster(3, "ring", "--set", "faults.on_peer_loss=fail")
    try:
        c.connect()
        handles = submit_and_kill(c, "doomed", 2)
        for h in handles:
            with pytest.raises(DecentError) as info:
                h.wait(timeout=60)
            assert info.value.code == pb.PEER_UNAVAILABLE
            assert "rank 2" in info.value.message and "'doomed'" in info.value.message
        # later ops that need rank 2 fail at once, naming it; those that do not still run
        with pytest.raises(DecentError, match=r"PEER_UNAVAILABLE.*rank 2 is gone.*fail"):
            c.clients[0].neighbor_allreduce(torch.ones(2), name="needs2", timeout=30)
        got = [c.clients[i].neighbor_allreduce(torch.ones(2), name="alive", self_weight=0.5,
                                               src_weights={}, dst_weights=[]) for i in (0, 1)]
        assert all(torch.equal(g, torch.full((2,), 0.5)) for g in got)
    finally:
        c.clients = c.clients[:2]
        c.stop()


def ring_round(clients: list, name: str, values: dict[int, float]) -> dict[int, tuple]:
    """One neighbor_allreduce of ``name`` on the given clients (rank -> its value, all at once);
    rank -> (result value, src_ranks)."""
    handles = {c.rank: c.neighbor_allreduce_async(torch.full((8,), values[c.rank]), name=name,
                                                  timeout=30) for c in clients}
    return {r: (h.wait(timeout=60)[0].item(), h.src_ranks) for r, h in handles.items()}


def test_a_restarted_node_rejoins_and_pairs_with_the_current_rounds() -> None:
    c = Cluster(3, "ring")
    try:
        c.connect()
        values = {0: 1.0, 1: 2.0, 2: 4.0}
        for _ in range(3):  # rounds 0..2 of "w" everywhere
            got = ring_round(c.clients, "w", values)
            assert got[0] == (pytest.approx(7 / 3, rel=1e-6), [1, 2])
        old_incarnation = c.status(2).incarnation
        c.procs[2].send_signal(signal.SIGKILL)
        c.procs[2].wait()
        c.clients[2].close()
        survivors = c.clients[:2]
        got = ring_round(survivors, "w", values)  # round 3 without rank 2
        assert got[0] == (pytest.approx(2 / 3 * 1 + 1 / 3 * 2, rel=1e-6), [1])
        c.procs[2] = c.spawn(2, "ring")
        for i in (0, 1):
            until(lambda i=i: peer_state(c, i, 2) == "up", f"rank {i} to see rank 2 up")
        assert c.status(2).incarnation > old_incarnation
        c.clients[2] = dt.connect(f"unix://{c.sockets[2]}", 60)
        # survivors are at round 4 of "w", the new worker at 0: they pair, with every rank in
        got = ring_round(c.clients, "w", values)
        assert got == {0: (pytest.approx(7 / 3, rel=1e-6), [1, 2]),
                       1: (pytest.approx(7 / 3, rel=1e-6), [0, 2]),
                       2: (pytest.approx(7 / 3, rel=1e-6), [0, 1])}
        got = ring_round(c.clients, "w", {0: 3.0, 1: 3.0, 2: 6.0})  # and the round after
        assert got[2] == (pytest.approx(4.0, rel=1e-6), [0, 1])
        views = [c.clients[i].membership() for i in range(3)]
        until(lambda: len({c.clients[i].membership() for i in range(3)}) == 1,
              "the three daemons to agree on one view")
        assert all(v.daemons == (0, 1, 2) for v in views)
    finally:
        c.stop()
