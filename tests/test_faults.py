"""Peers that die, drop and come back, with real daemons (issue 26, docs/faults.md).

Every wait here is on a condition (an op in flight, a peer's state in the daemon's status), never
on a fixed sleep: ``until`` polls a condition with a deadline that only bounds a failure.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

import decent.torch as dt
from cluster import Cluster, delay, ring_round, until, until_running, until_state
from decent_wire.errors import DecentError
from decent_wire.v1 import decent_pb2 as pb

pytestmark = pytest.mark.slow

#: a ring of 3 with uniform weights: every rank gives itself and each in-neighbor 1/3
THIRD = np.float32(1 / 3)


def submit_and_kill(c: Cluster, name: str, victim: int) -> list:
    """Ranks other than ``victim`` start a neighbor_allreduce of ``rank + 1``; once every
    survivor's daemon runs it, ``victim``'s daemon gets SIGKILL. The survivors' handles."""
    survivors = [i for i in range(c.n) if i != victim]
    handles = [c.clients[i].neighbor_allreduce_async(torch.full((1000,), float(i + 1)),
                                                     name=name, timeout=30) for i in survivors]
    for i in survivors:
        until_running(c, i)
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
        for i in (0, 1):  # once it is down (not just reconnecting), ops plan without it
            until_state(c, i, 2, "down")
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
            until_state(c, i, 2, "down")
    finally:
        c.clients = c.clients[:2]
        c.stop()


def test_a_lone_in_neighbor_killed_before_sending_is_reweighted_by_the_worker() -> None:
    # rank 1 averages a large private tensor in place with rank 2 alone, so its worker
    # combines its own result (decent.core.requests.combine); rank 2's daemon dies before it sends:
    # its weight goes to rank 1's own tensor, in the worker's arithmetic
    c = Cluster(3, "ring")
    try:
        c.connect()
        big = torch.arange(3 << 20, dtype=torch.float32)  # 12 MiB: streamed, combined there
        mine = big.clone()
        h0 = c.clients[0].neighbor_allreduce_async(torch.zeros_like(big), name="lone",
                                                   self_weight=0.5, src_weights={1: 0.5},
                                                   dst_weights=[], timeout=30)
        h1 = c.clients[1].neighbor_allreduce_async_(mine, name="lone", self_weight=0.25,
                                                    src_weights={2: 0.5}, dst_weights=[0],
                                                    timeout=30)
        until_running(c, 1)
        c.procs[2].send_signal(signal.SIGKILL)
        c.procs[2].wait()
        assert h1.wait(timeout=60) is mine and h1.src_ranks == []
        assert torch.equal(mine, big * 0.75)  # 0.25 + rank 2's 0.5
        assert torch.equal(h0.wait(timeout=60), big * 0.5)
        assert c.clients[1].status().worker_results_combined == 1
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
        # once it is down, later ops that need rank 2 fail at once, naming it; those that do
        # not still run
        for i in (0, 1):
            until_state(c, i, 2, "down")
        with pytest.raises(DecentError, match=r"PEER_UNAVAILABLE.*rank 2 is gone.*fail"):
            c.clients[0].neighbor_allreduce(torch.ones(2), name="needs2", timeout=30)
        got = [c.clients[i].neighbor_allreduce(torch.ones(2), name="alive", self_weight=0.5,
                                               src_weights={}, dst_weights=[]) for i in (0, 1)]
        assert all(torch.equal(g, torch.full((2,), 0.5)) for g in got)
    finally:
        c.clients = c.clients[:2]
        c.stop()


def test_a_restarted_node_rejoins_and_pairs_with_the_current_rounds() -> None:
    c = Cluster(3, "ring")
    try:
        c.connect()
        values = {0: 1.0, 1: 2.0, 2: 4.0}
        for _ in range(3):  # rounds 0..2 of "w" everywhere
            got = ring_round(c.clients, "w", values)
            assert got[0] == (pytest.approx(7 / 3, rel=1e-6), [1, 2])
        old_incarnation = c.status(2).incarnation
        c.kill_node(2)
        survivors = c.clients[:2]
        got = ring_round(survivors, "w", values)  # round 3 without rank 2
        assert got[0] == (pytest.approx(2 / 3 * 1 + 1 / 3 * 2, rel=1e-6), [1])
        c.procs[2] = c.spawn(2, "ring")
        for i in (0, 1):
            until_state(c, i, 2, "up")
        assert c.status(2).incarnation > old_incarnation
        c.clients[2] = dt.connect(f"unix://{c.sockets[2]}", 60)
        assert c.clients[2].rejoining  # it joins a running job: left out until it says so
        c.clients[2].connection.join()  # (its first op would; here every rank must be in)
        for i in (0, 1):
            until(partial(lambda k: c.clients[k].membership().ranks == (0, 1, 2), i),
                  f"rank {i} to count rank 2's worker in")
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


def allreduce_all(clients: list, name: str, values: dict[int, float]) -> dict[int, object]:
    """An averaging allreduce of ``name`` on the given clients at once; rank -> (value,
    src_ranks) or the DecentError it raised."""
    handles = {}
    for c in clients:
        delay(c.rank)
        handles[c.rank] = c.allreduce_async(torch.full((4,), values[c.rank]), name=name,
                                            timeout=30)
    out: dict[int, object] = {}
    for r, h in handles.items():
        try:
            out[r] = (h.wait(timeout=60)[0].item(), h.src_ranks)
        except DecentError as exc:
            out[r] = exc
    return out


def test_allreduce_fails_across_a_view_change_then_runs_over_the_new_view_and_the_rejoined() \
        -> None:
    c = Cluster(3, "ring")
    try:
        c.connect()
        values = {0: 1.0, 1: 2.0, 2: 6.0}
        assert allreduce_all(c.clients, "g", values) == {r: (3.0, [0, 1, 2]) for r in range(3)}
        # ranks 0 and 1 start round 1 of "g"; rank 2 dies before it takes part
        handles = [c.clients[i].allreduce_async(torch.full((4,), values[i]), name="g",
                                                timeout=30) for i in (0, 1)]
        for i in (0, 1):
            until_running(c, i)
        c.kill_node(2)
        for h in handles:  # nobody gets a partial average
            with pytest.raises(DecentError) as info:
                h.wait(timeout=60)
            assert info.value.code == pb.PEER_UNAVAILABLE and "rank 2" in info.value.message
        for i in (0, 1):  # until then it might come back (a dropped link): collectives wait
            until_state(c, i, 2, "down")
        # the next round runs over the live view, and says which ranks it covers
        assert allreduce_all(c.clients[:2], "g", values) == {0: (1.5, [0, 1]), 1: (1.5, [0, 1])}
        # broadcast and barrier too; a broadcast from the dead root fails, naming it
        bcast = [c.clients[i].broadcast_async(torch.full((2,), float(i)), root=1, name="b")
                 for i in (0, 1)]
        assert [(h.wait(timeout=60)[0].item(), h.src_ranks) for h in bcast] == \
            [(1.0, [0, 1])] * 2
        with ThreadPoolExecutor(2) as pool:  # a barrier of the two live ranks returns
            list(pool.map(lambda i: c.clients[i].barrier(name="bar", timeout=30), (0, 1)))
        dead_root = [c.clients[i].broadcast_async(torch.zeros(2), root=2, name="b2")
                     for i in (0, 1)]
        for h in dead_root:
            with pytest.raises(DecentError, match=r"PEER_UNAVAILABLE.*root 2 is not live"):
                h.wait(timeout=60)
        c.procs[2] = c.spawn(2, "ring")
        for i in (0, 1):
            until_state(c, i, 2, "up")
        c.clients[2] = dt.connect(f"unix://{c.sockets[2]}", 60)
        c.clients[2].connection.join()
        for i in (0, 1):
            until(partial(lambda k: c.clients[k].membership().ranks == (0, 1, 2), i),
                  f"rank {i} to count rank 2's worker in")
        # ranks 0 and 1 are at round 3 of "g", the rejoined worker at round 0: they pair
        assert allreduce_all(c.clients, "g", values) == {r: (3.0, [0, 1, 2]) for r in range(3)}
    finally:
        c.stop()


def test_a_collective_needs_a_majority_of_the_daemons() -> None:
    c = Cluster(4, "ring")
    try:
        c.connect()
        for victim in (2, 3):
            c.kill_node(victim)
        for i in (0, 1):
            until(partial(lambda k: c.clients[k].membership().daemons == (0, 1), i),
                  f"rank {i} to see ranks 2 and 3 gone")
        got = allreduce_all(c.clients[:2], "half", {0: 1.0, 1: 2.0})
        for r in (0, 1):  # two of four: the other half might be averaging too
            error = got[r]
            assert isinstance(error, DecentError) and error.code == pb.PEER_UNAVAILABLE
            assert "majority" in error.message
        # neighbor ops go on without them (reweighted)
        avg = ring_round(c.clients[:2], "n", {0: 1.0, 1: 2.0})
        assert avg[0][1] == [1] and avg[1][1] == [0]
    finally:
        c.clients = c.clients[:2]
        c.stop()


WORKER_THAT_DIES = """
import os, sys, torch
import decent.torch as dt
c = dt.connect(sys.argv[1], 60)
c.neighbor_allreduce(torch.full((8,), 4.0), name="w", timeout=30)
os._exit(1)  # dies between ops: no close, no goodbye
"""


@pytest.mark.parametrize("policy", ["reweight", "fail"])
def test_a_worker_that_dies_between_ops_is_left_out_at_once(policy: str, tmp_path: Path) -> None:
    c = Cluster(3, "ring", "--set", f"faults.on_peer_loss={policy}")
    script = tmp_path / "dies.py"
    script.write_text(WORKER_THAT_DIES)
    try:
        c.clients = [dt.connect(f"unix://{c.sockets[i]}", 60) for i in (0, 1)]
        worker = subprocess.Popen([sys.executable, str(script), f"unix://{c.sockets[2]}"])
        first = ring_round(c.clients, "w", {0: 1.0, 1: 2.0})  # round 0, with rank 2
        assert first[0] == (pytest.approx(7 / 3, rel=1e-6), [1, 2])
        assert worker.wait(timeout=60) == 1
        # round 1: its daemon is up, its worker is gone; the 60 s op timeout is not waited
        handles = [c.clients[i].neighbor_allreduce_async(torch.full((8,), float(i + 1)),
                                                         name="w", timeout=60) for i in (0, 1)]
        for i, h in enumerate(handles):
            if policy == "reweight":
                assert h.wait(timeout=20)[0].item() == pytest.approx(
                    [4 / 3, 5 / 3][i], rel=1e-6)
                assert h.src_ranks == [1 - i]
                if i == 0:  # a receive-only call from it: its weight cannot go to self
                    t = torch.full((8,), 5.0)
                    with pytest.raises(DecentError, match=r"PEER_UNAVAILABLE.*did not send"):
                        c.clients[0].neighbor_allreduce_(
                            t, name="r", self_weight=0.0, src_weights={2: 1.0},
                            dst_weights=[], timeout=60)
                    assert torch.equal(t, torch.full((8,), 5.0))  # failed: left as it was
            else:
                with pytest.raises(DecentError, match=r"PEER_UNAVAILABLE.*rank 2.*(left|gone)"):
                    h.wait(timeout=20)
    finally:
        c.stop()


def bulk_port(c: Cluster, i: int) -> int:
    """The port daemon ``i`` takes its peers' bulk connections on (from its log)."""
    found = re.search(r"bulk data on port (\d+)", c.log(i))
    assert found, c.log(i)
    return int(found.group(1))


def test_a_reset_link_reconnects_and_every_part_is_applied_at_most_once() -> None:
    c = Cluster(2, "ring")
    try:
        c.connect()
        port = bulk_port(c, 1)
        results: dict[int, list[tuple[float, list[int]]]] = {0: [], 1: []}
        rounds = 60

        def run(rank: int) -> None:
            for r in range(rounds):
                h = c.clients[rank].neighbor_allreduce_async(
                    torch.full((64,), float((rank + 1) * (r + 1))), name="w", timeout=30)
                results[rank].append((h.wait(timeout=60)[0].item(), h.src_ranks))

        with ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(run, r) for r in (0, 1)]
            until(lambda: len(results[0]) >= rounds // 4, "a quarter of the rounds")
            # destroy daemon 0's bulk connection to daemon 1 (daemon 1 gets a reset)
            killed = subprocess.run(["ss", "-K", "dst", "127.0.0.1", "dport", "=", str(port)],
                                    capture_output=True, text=True)
            assert killed.returncode == 0, killed.stderr
            for f in runs:
                f.result(timeout=120)
        for rank in (0, 1):
            for r, (value, srcs) in enumerate(results[rank]):
                mean, own = 1.5 * (r + 1), float((rank + 1) * (r + 1))
                # the peer's part counted once (the average) or, lost with the link, not at all
                assert (value, srcs) in ((pytest.approx(mean), [1 - rank]),
                                         (pytest.approx(own), [])), (rank, r, value, srcs)
        assert "link dropped" in c.log(0) + c.log(1)
        for i in (0, 1):
            until_state(c, i, 1 - i, "up")
        assert sum(p.reconnects for i in (0, 1) for p in c.status(i).peers) >= 1
        last = ring_round(c.clients, "w", {0: 1.0, 1: 3.0})  # after it: whole averages again
        assert last == {0: (2.0, [1]), 1: (2.0, [0])}
    finally:
        c.stop()


def test_a_node_missing_at_start_joins_later_under_min_nodes() -> None:
    c = Cluster(3, "ring", "--set", "faults.min_nodes=2", later=(2,))
    try:
        c.clients = [dt.connect(f"unix://{c.sockets[i]}", 60) for i in (0, 1)]
        assert not any(cl.rejoining for cl in c.clients)
        for _ in range(3):  # rounds 0..2 of "w" without rank 2, which never came
            got = ring_round(c.clients, "w", {0: 1.0, 1: 2.0})
            assert got[0] == (pytest.approx(2 / 3 * 1 + 1 / 3 * 2, rel=1e-6), [1])
        assert "2 of 3 daemons up (faults.min_nodes 2)" in c.log(0)
        c.procs[2] = c.spawn(2, "ring", "--set", "faults.min_nodes=2")
        for i in (0, 1):
            until_state(c, i, 2, "up")
        c.clients.append(dt.connect(f"unix://{c.sockets[2]}", 60))
        assert c.clients[2].rejoining  # a job runs: it takes part once it says so
        c.clients[2].connection.join()
        for i in (0, 1):
            until(partial(lambda k: c.clients[k].membership().ranks == (0, 1, 2), i),
                  f"rank {i} to count rank 2's worker in")
        # the late worker's round 0 is the others' round 3; it sends first, and its parts wait
        # at the others' daemons until their op of "w" starts
        late = c.clients[2].neighbor_allreduce_async(torch.full((8,), 4.0), name="w",
                                                     timeout=30)
        for i in (0, 1):
            until(partial(lambda k: c.status(k).parked_frames > 0, i),
                  f"rank 2's part to wait at daemon {i}")
        got = ring_round(c.clients[:2], "w", {0: 1.0, 1: 2.0})
        got[2] = (late.wait(timeout=60)[0].item(), late.src_ranks)
        assert got == {0: (pytest.approx(7 / 3, rel=1e-6), [1, 2]),
                       1: (pytest.approx(7 / 3, rel=1e-6), [0, 2]),
                       2: (pytest.approx(7 / 3, rel=1e-6), [0, 1])}
        assert allreduce_all(c.clients, "all", {0: 1.0, 1: 2.0, 2: 6.0}) == \
            {r: (3.0, [0, 1, 2]) for r in range(3)}
    finally:
        c.stop()



def test_a_worker_registering_while_peers_count_its_daemon_out_is_readmitted() -> None:
    """A worker restarts on a daemon that its peers then count out (silent past the deadline)
    while the worker registers: once the daemon is back, the new worker is in every neighbour's
    ops again, not left averaging with itself."""
    c = Cluster(3, "ring", "--set", "timeouts.heartbeat=0.5")
    try:
        c.connect()
        values = {0: 1.0, 1: 2.0, 2: 4.0}
        assert ring_round(c.clients, "w", values)[0] == (pytest.approx(7 / 3), [1, 2])
        c.clients[2].close()  # the worker of daemon 2 restarts ...
        c.procs[2].send_signal(signal.SIGSTOP)
        try:
            for i in (0, 1):
                until_state(c, i, 2, "down")
            with ThreadPoolExecutor(1) as pool:  # ... and registers while it is counted out
                joining = pool.submit(dt.connect, f"unix://{c.sockets[2]}", 60)
                c.procs[2].send_signal(signal.SIGCONT)
                c.clients[2] = joining.result(timeout=60)
        finally:
            c.procs[2].send_signal(signal.SIGCONT)
        for i in (0, 1):
            until_state(c, i, 2, "up")
        got = ring_round(c.clients, "after", values)
        assert got == {0: (pytest.approx(7 / 3, rel=1e-6), [1, 2]),
                       1: (pytest.approx(7 / 3, rel=1e-6), [0, 2]),
                       2: (pytest.approx(7 / 3, rel=1e-6), [0, 1])}
    finally:
        c.stop()


def test_workers_restarted_one_after_another_on_live_daemons_pair_with_the_others() -> None:
    """Rank 0's worker restarts (the peers translate its rounds from 0), then rank 2's: its
    daemon drops what it placed for its old worker's keys, and every rank still averages
    exactly with both neighbours (before: rank 2's daemon sent a negative round, INTERNAL,
    and the three stalled; found by ``make soak``)."""
    c = Cluster(3, "ring")
    try:
        c.connect()
        values = {0: 1.0, 1: 2.0, 2: 4.0}
        everyone = {r: (pytest.approx(7 / 3, rel=1e-6), [q for q in range(3) if q != r])
                    for r in range(3)}
        for restarted in (None, 0, 2):
            if restarted is not None:
                c.clients[restarted].close()
                c.clients[restarted] = dt.connect(f"unix://{c.sockets[restarted]}", 60)
            for _ in range(3):
                assert ring_round(c.clients, "w", values) == everyone, restarted
    finally:
        c.stop()


def test_a_daemon_resumed_after_a_stop_does_not_count_its_peers_out() -> None:
    """A daemon stopped (SIGSTOP) past ``peer_dead_after`` is counted out by its peers; when it
    runs again it does not count them out in turn for the silence it slept through (before:
    it declared every peer dead at once, and an 8-node soak collapsed), and all average
    exactly again."""
    c = Cluster(3, "ring", "--set", "timeouts.heartbeat=0.5")
    try:
        c.connect()
        values = {0: 1.0, 1: 2.0, 2: 4.0}
        everyone = {r: (pytest.approx(7 / 3, rel=1e-6), [q for q in range(3) if q != r])
                    for r in range(3)}
        assert ring_round(c.clients, "w", values) == everyone
        c.procs[2].send_signal(signal.SIGSTOP)
        try:
            for i in (0, 1):
                until_state(c, i, 2, "down")
        finally:
            c.procs[2].send_signal(signal.SIGCONT)
        for i in (0, 1):
            until_state(c, i, 2, "up")
        until(lambda: "did not run for" in c.log(2), "daemon 2 to notice its own stop")
        assert "is down" not in c.log(2), c.log(2)[-2000:]
        assert all(p.state == "up" for p in c.status(2).peers)
        for _ in range(3):
            got = ring_round(c.clients, "w", values)
            assert {r: v for r, (v, _) in got.items()} == {r: pytest.approx(7 / 3, rel=1e-6)
                                                           for r in range(3)}, got
    finally:
        c.stop()
