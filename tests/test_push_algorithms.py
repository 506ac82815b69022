"""BlueFog's win-put optimizer and push-sum through real daemons, against numpy runs of their
recursions on least squares (``least_squares.py``)."""

from __future__ import annotations

from collections.abc import Callable

import networkx as nx
import numpy as np
import pytest

from conftest import ClusterFactory
from decent_wire.topology import build_topology, from_graph
from least_squares import LR, X0, N, grads, train

pytestmark = pytest.mark.slow

STEPS = 60


def push_sum(graph: nx.DiGraph, steps: int) -> np.ndarray:
    """num' = P (num - d(z)), w' = P w, z = num / w, with P[i, j] = 1 / (out_degree(j) + 1)
    on the edges j -> i and the diagonal: column-stochastic."""
    p = np.eye(N)
    for j, i in graph.edges:
        p[i, j] = 1.0
    p /= p.sum(axis=0, keepdims=True)
    z, w = X0.copy(), np.ones(N)
    for _ in range(steps):
        num = p @ (z * w[:, None] - LR * grads(z))
        w = p @ w
        z = num / w[:, None]
    return z


IRREGULAR = nx.DiGraph([(0, 1), (1, 2), (2, 3), (3, 0), (0, 2), (3, 1)])  # out-degrees 2 1 1 2
EXPONENTIAL = nx.DiGraph([(i, (i + h) % N) for i in range(N) for h in (1, 2)])


@pytest.mark.parametrize("graph", [IRREGULAR, EXPONENTIAL], ids=["irregular", "exponential"])
def test_push_sum_matches_its_recursion_on_directed_graphs(cluster: ClusterFactory,
                                                           graph: nx.DiGraph) -> None:
    got = train(cluster(N, "ring"), "push-sum", STEPS, topology=from_graph(graph))
    np.testing.assert_allclose(got, push_sum(graph, STEPS), rtol=1e-9, atol=1e-12)


def test_push_sum_on_a_regular_graph_is_dsgd_cta(cluster: ClusterFactory) -> None:
    # out-degree 2 everywhere: P = W, the weights stay 1, and z' = W (z - d)... combined after
    # the step: W z - W d, the adapt-then-combine form
    w = build_topology("ring", N).matrix()
    got = train(cluster(N, "ring"), "push-sum", STEPS)
    x = X0.copy()
    for _ in range(STEPS):
        x = w @ (x - LR * grads(x))
    np.testing.assert_allclose(got, x, rtol=1e-9, atol=1e-12)


def win_put(steps: int, dst: Callable[[int, int], list[int]]) -> np.ndarray:
    """x' = self * x + sum_j w_j * buffer[j] - d, where buffer[i][j] holds what j put into i's
    window last (at first: a copy of i's own x) and the weights are the ring's (1/3 each)."""
    x = X0.copy()
    buffers = {(i, j): X0[i].copy() for i in range(N) for j in ((i - 1) % N, (i + 1) % N)}
    for k in range(steps):
        for j in range(N):
            for i in dst(j, k):
                buffers[i, j] = x[j].copy()
        mixed = np.stack([(x[i] + buffers[i, (i - 1) % N] + buffers[i, (i + 1) % N]) / 3
                          for i in range(N)])
        x = mixed - LR * grads(x)
    return x


def test_win_put_with_a_barrier_is_the_synchronous_recursion(cluster: ClusterFactory) -> None:
    got = train(cluster(N, "ring"), "win-put", STEPS, barrier=True)
    want = win_put(STEPS, lambda j, _k: [(j - 1) % N, (j + 1) % N])
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    w = build_topology("ring", N).matrix()
    x = X0.copy()
    for _ in range(STEPS):
        x = w @ x - LR * grads(x)
    np.testing.assert_allclose(got, x, rtol=1e-9, atol=1e-12)  # x' = W x - d


def test_win_put_with_dynamic_destinations(cluster: ClusterFactory) -> None:
    # even steps push to the right neighbor only, odd steps to the left: the other slot keeps
    # what arrived before (or the initial copy)
    def right_then_left(j: int, k: int) -> list[int]:
        return [(j + 1) % N] if k % 2 == 0 else [(j - 1) % N]

    def destinations(rank: int) -> dict[str, Callable[[int], dict[int, float]]]:
        return {"dst_weights": lambda k: dict.fromkeys(right_then_left(rank, k), 1.0)}

    got = train(cluster(N, "ring"), "win-put", STEPS, rank_options=destinations, barrier=True)
    np.testing.assert_allclose(got, win_put(STEPS, right_then_left), rtol=1e-9, atol=1e-12)


def test_win_put_without_a_barrier_still_converges(cluster: ClusterFactory) -> None:
    # BlueFog's default: no barrier, so what a rank combines depends on timing; the iterates
    # still reach a neighborhood of the consensus optimum
    got = train(cluster(N, "ring"), "win-put", 300)
    want = win_put(300, lambda j, _k: [(j - 1) % N, (j + 1) % N])
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()
