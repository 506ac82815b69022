"""Window ops, AD-PSGD's exchange and WAGMA's groups with a dead peer (issue 26): they skip it,
exactly, and what it wrote before it died stays whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cluster import Cluster, until_state
from decent_wire.topology import build_topology

pytestmark = pytest.mark.slow


def test_window_ops_skip_a_dead_peer_and_groups_shrink() -> None:
    c = Cluster(4, "ring")
    try:
        c.connect()
        # every rank's window holds rank + 1; buffers start as copies (ring: in-neighbors r±1)
        c.run(lambda cl: cl.win_create(torch.full((4,), float(cl.rank + 1)), "w"))
        c.run(lambda cl: cl.win_put(torch.full((4,), 10.0 * (cl.rank + 1)), "w"))
        c.kill_node(3)
        survivors = c.clients[:3]
        for i in range(3):
            until_state(c, i, 3, "down")
        s0, s2 = survivors[0], survivors[2]
        # rank 0's buffers: rank 1's put (20) and rank 3's (40), written whole before it died;
        # win_update on the topology's weights (1/3 each) gives rank 3's third to self
        out = s0.win_update("w")
        assert torch.equal(out, torch.full((4,), 2 / 3 * 1 + 1 / 3 * 20, dtype=out.dtype))
        # rank 2 puts to its out-neighbors 1 and 3: rank 3 is skipped, rank 1 gets it
        s2.win_put(torch.full((4,), 7.0), "w")
        got = survivors[1].win_update("w", self_weight=0.0, neighbor_weights={2: 1.0})
        assert torch.equal(got, torch.full((4,), 7.0))
        # AD-PSGD's exchange with the dead peer keeps the own tensor (nobody to average with)
        h = s0.win_exchange_async(torch.full((4,), 5.0), "w", peer=3)
        assert torch.equal(h.wait(), torch.full((4,), 5.0)) and h.src_ranks == []
        # WAGMA: the group of 4 shrinks to the 3 live members, led by the first of them
        # (wait-avoiding: a member not there yet counts with its last own copy, so the first
        # round publishes everyone's tensor and the second is exact)
        for _ in range(2):
            groups = [cl.group_allreduce_async(torch.full((4,), float(cl.rank)), "w",
                                               group_size=4) for cl in survivors]
            got = [g.wait(timeout=60) for g in groups]
        assert all(torch.equal(g, torch.full((4,), (0.0 + 1.0 + 2.0) / 3)) for g in got), got
    finally:
        c.clients = c.clients[:3]
        c.stop()


def test_a_dynamic_schedule_runs_over_the_live_ranks() -> None:
    # one-peer exponential over 4; rank 3 dies: the survivors pair by their positions among
    # the live ranks (the schedule over 3), so each round every survivor has its partner
    c = Cluster(4, "one-peer-exponential")
    try:
        c.connect()
        c.kill_node(3)
        survivors = c.clients[:3]
        for i in range(3):
            until_state(c, i, 3, "down")
        sub = build_topology("one-peer-exponential", 3)
        x = np.array([1.0, 2.0, 4.0])
        for r in range(4):
            handles = [cl.neighbor_allreduce_async(torch.full((2,), x[cl.rank]), name="d")
                       for cl in survivors]
            got = [(h.wait(timeout=60)[0].item(), h.src_ranks) for h in handles]
            w = sub.matrix(r)
            for i in range(3):
                assert got[i][0] == pytest.approx(float(w[i] @ x), rel=1e-12)
                assert got[i][1] == list(sub.step(i, r).src_weights)
    finally:
        c.clients = c.clients[:3]
        c.stop()
