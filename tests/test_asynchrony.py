"""Asynchrony through real daemons: AD-PSGD's pairwise exchanges and WAGMA's group averaging."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

import decent.torch as dt
from conftest import ClusterFactory
from decent.core import DecentError
from decent.core.training.algorithms import ADPSGD
from decent_wire.graphs import butterfly_group

pytestmark = pytest.mark.slow

N = 8
#: (daemons, workers per daemon): 8 workers on 8 daemons, and on 2 daemons of 4
LAYOUTS = [(8, 1), (2, 4)]


@pytest.fixture(params=LAYOUTS, ids=lambda lay: f"{lay[0]}x{lay[1]}")
def layout(request: pytest.FixtureRequest) -> tuple[int, int]:
    return tuple(request.param)



@pytest.mark.parametrize("shape", [(4, 1), (2, 2)], ids=["4x1", "2x2"])
def test_exchange_and_add_are_exact_and_atomic_on_the_peer(cluster: ClusterFactory,
                                                           shape: tuple[int, int]) -> None:
    c = cluster(shape[0], "ring", shape[1])

    def work(cl: Any) -> dict[str, Any]:
        r = cl.rank
        x = torch.arange(6, dtype=torch.float64) + 16.0 * r
        cl.win_create(x.clone(), "xchg")
        cl.barrier(name="xchg.b0")
        res: dict[str, Any] = {}
        if r in (0, 2):  # active: average with the passive rank above
            res["avg"] = cl.win_exchange(x, "xchg", peer=r + 1).numpy().copy()
        cl.barrier(name="xchg.b1")
        if r in (1, 3):  # passive: its model (in the daemon) is the average; add an update
            res["own"] = cl.win_add(torch.full((6,), 0.5, dtype=torch.float64),
                                    "xchg").numpy().copy()
            res["versions"] = cl.win_versions("xchg")
        cl.barrier(name="xchg.b2")
        cl.win_free("xchg")
        return res

    got = c.run(work)
    for a in (0, 2):
        want = (np.arange(6) + 16.0 * a + np.arange(6) + 16.0 * (a + 1)) * 0.5
        np.testing.assert_array_equal(got[a]["avg"], want)
        np.testing.assert_array_equal(got[a + 1]["own"], want + 0.5)
        assert got[a + 1]["versions"][a] == 1


@pytest.mark.parametrize(("group_size", "rule"), [(2, "mean"), (4, "mean"), (4, "with-self")])
def test_group_allreduce_of_published_models_is_the_group_average(
        cluster: ClusterFactory, group_size: int, rule: str, layout: tuple[int, int]) -> None:
    c = cluster(layout[0], "hypercube", layout[1])
    rounds = 4
    values = np.random.default_rng(group_size).integers(-64, 64, size=(rounds, N, 3)) / 8.0
    name = f"grp{group_size}{rule}"

    def work(cl: Any) -> list[np.ndarray]:
        r = cl.rank
        cl.win_create(torch.zeros(3, dtype=torch.float64), name)
        out = []
        for k in range(rounds):
            x = torch.from_numpy(values[k, r].copy())
            # published before anyone starts the round: every member's copy is this round's
            cl.win_publish(x, name)
            cl.barrier(name=f"{name}.b{k}")
            out.append(cl.group_allreduce(x, name, group_size, rule=rule).numpy().copy())
        cl.barrier(name=f"{name}.end")
        cl.win_free(name)
        return out

    got = c.run(work)
    for k in range(rounds):
        for r in range(N):
            members = butterfly_group(r, N, group_size, k + 1)  # round 0 was win_create
            total = values[k, members].sum(axis=0)
            want = total / len(members) if rule == "mean" else \
                (total + values[k, r]) / (len(members) + 1)
            np.testing.assert_allclose(got[r][k], want, rtol=1e-15, atol=1e-15)


def test_a_late_member_finds_its_group_result_ready(cluster: ClusterFactory,
                                                    layout: tuple[int, int]) -> None:
    c = cluster(layout[0], "hypercube", layout[1])

    def work(cl: Any) -> dict[str, Any]:
        r = cl.rank
        x = torch.full((4,), float(r), dtype=torch.float64)
        cl.win_create(x, "late")
        cl.barrier(name="late.b0")
        # rank 1 calls only after every other rank's call returned (the barrier needs them all):
        # its group (ranks 1 and 3 at round 1) is averaged without it, or rank 3's op times out
        if r != 1:
            y = cl.group_allreduce(x + 100.0, "late", 2)
        cl.barrier(name="late.mid")
        if r == 1:
            y = cl.group_allreduce(x + 100.0, "late", 2)
        cl.barrier(name="late.b1")
        info = cl.win_info("late")
        cl.barrier(name="late.b2")
        cl.win_free("late")
        return {"y": y.tolist(), "staleness": info.max_staleness}

    assert butterfly_group(1, N, 2, 1) == [1, 3]  # round 0 was win_create; rank 1 leads
    got = c.run(work)
    # rank 3 triggered the group before rank 1 called: its daemon (the leader's) summed rank 1's
    # stale copy (the win_create tensor, 1.0) with rank 3's 103.0; rank 1 found that result
    # ready (summing again would have given (101 + 103) / 2 = 102)
    assert got[3]["y"] == [52.0] * 4 and got[1]["y"] == [52.0] * 4
    assert got[1]["staleness"] == 1 and got[3]["staleness"] == 1
    # ranks 0 and 2 both came on time, but the first to arrive triggers its group at once: the
    # other's copy is then its win_create tensor (stale by one round) or already this round's
    assert got[0]["y"] == got[2]["y"] and got[0]["y"][0] in (101.0, 51.0)


def _least_squares(r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(10 + r)
    a = torch.from_numpy(rng.normal(size=(6, 3)))
    b = torch.from_numpy(rng.normal(size=6) + r)
    x0 = torch.from_numpy(np.random.default_rng(99).normal(size=3) * (r + 1))
    return a, b, x0


def test_adpsgd_never_deadlocks_and_keeps_the_sum(cluster: ClusterFactory,
                                                 layout: tuple[int, int]) -> None:
    c = cluster(layout[0], "hypercube", layout[1])
    steps = 60

    def work(cl: Any) -> dict[str, Any]:
        r = cl.rank
        _, _, x0 = _least_squares(r)
        x = torch.nn.Parameter(x0.clone())
        opt = dt.DecentralizedOptimizer(torch.optim.SGD([x], lr=0.0), algorithm="adpsgd",
                                        client=cl, prefix="adp0", seed=3)
        rng = random.Random(r)
        for i in range(steps):
            time.sleep(rng.random() * 0.004 * (1 + r % 3))
            opt.zero_grad()
            (x ** 2).sum().backward()  # lr 0: only the averaging moves the models
            opt.step()
            if i % 10 == 9:  # asynchronous within a block; no rank runs a block ahead, so the
                cl.barrier(name=f"adp0.s{i}")  # contraction bound holds on a loaded host too
        cl.barrier(name="adp0.done")  # every exchange is over: read the passive models
        assert isinstance(opt.algorithm, ADPSGD)
        active = opt.algorithm.active
        final = x.detach().clone() if active else \
            cl.win_add(torch.zeros(3, dtype=torch.float64), "adp0.adpsgd.0")
        return {"x0": x0.numpy(), "x": final.numpy().copy(), "active": active}

    got = c.run(work, timeout=120)
    assert [g["active"] for g in got] == [bin(r).count("1") % 2 == 0 for r in range(N)]
    x0 = np.stack([g["x0"] for g in got])
    x = np.stack([g["x"] for g in got])
    # a pairwise average keeps the sum; the models contract toward the mean
    np.testing.assert_allclose(x.sum(axis=0), x0.sum(axis=0), rtol=1e-12, atol=1e-12)
    spread0 = np.linalg.norm(x0 - x0.mean(axis=0))
    assert np.linalg.norm(x - x.mean(axis=0)) < 1e-3 * spread0


def test_adpsgd_needs_a_bipartite_topology(cluster: ClusterFactory) -> None:
    cl = cluster(N, "hypercube").clients[0]
    with pytest.raises(dt.AlgorithmError, match="bipartite"):
        dt.DecentralizedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1),
                                  algorithm="adpsgd", client=cl, topology="exponential")


def test_wagma_staleness_never_exceeds_tau(cluster: ClusterFactory) -> None:
    c = cluster(N, "hypercube")
    tau, steps = 3, 24
    first_step = threading.Event()

    def work(cl: Any) -> dict[str, Any]:
        r = cl.rank
        a, b, x0 = _least_squares(r)
        x = torch.nn.Parameter(x0.clone())
        opt = dt.DecentralizedOptimizer(torch.optim.SGD([x], lr=0.05), algorithm="wagma",
                                        client=cl, prefix="wg0", group_size=2, tau=tau)
        for i in range(steps):
            if r == 3:  # a slow worker: the others run ahead of it, up to tau rounds; its group
                # partner rank 1 takes its first step on rank 3's stale copy whatever the timing
                if i == 0 and not first_step.wait(60):
                    raise AssertionError("rank 1's first step waited for rank 3")
                time.sleep(0.02)
            opt.zero_grad()
            (0.5 * ((a @ x - b) ** 2).sum()).backward()
            opt.step()
            if r == 1 and i == 0:
                first_step.set()
        cl.barrier(name="wg0.done")
        info = cl.win_info("wg0.wagma.0")
        return {"staleness": info.max_staleness, "x": x.detach().numpy().copy()}

    got = c.run(work, timeout=120)
    staleness = [g["staleness"] for g in got]
    assert max(staleness) <= tau, staleness
    assert max(staleness) >= 1, f"no stale model was ever used: {staleness}"
    assert all(np.isfinite(g["x"]).all() for g in got)


def test_wagma_and_group_allreduce_refuse_bad_group_sizes(cluster: ClusterFactory) -> None:
    c = cluster(N, "hypercube")
    cl = c.clients[0]
    with pytest.raises(dt.AlgorithmError, match="power-of-two group_size"):
        dt.DecentralizedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1),
                                  algorithm="wagma", client=cl, group_size=3)
    cl.win_create(torch.zeros(2), "badgrp")
    with pytest.raises(DecentError, match="power-of-two group_size"):
        cl.group_allreduce(torch.zeros(2), "badgrp", 3)
    cl.win_free("badgrp")
