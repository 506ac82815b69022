"""Topologies: who averages with whom at each step, and with which weights.

A topology is a directed graph per step (edge ``j -> i``: j sends to i) plus a mixing matrix
``W`` with ``W[i, j]`` the weight receiver i gives sender j (``W[i, i]`` its self weight).
Unless weights are given, receiver i uses ``1/(in_degree_i + 1)`` for itself and every in-neighbor.
Dynamic schedules return a different graph per step; the daemon uses an op's round as its step,
so the schedule advances once per call of each op name.

New kinds register with :func:`register`; the clients read the same module.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache

import networkx as nx
import numpy as np


class TopologyError(ValueError):
    """A topology cannot be built as asked; the message says why and what to use instead."""


@dataclass(frozen=True)
class Step:
    """One rank's view of one step: whom it receives from (with weights) and sends to."""

    self_weight: float
    src_weights: Mapping[int, float]
    dst_ranks: tuple[int, ...]

    @property
    def in_neighbors(self) -> list[int]:
        """Ranks this rank receives from, ascending."""
        return sorted(self.src_weights)

    @property
    def out_neighbors(self) -> list[int]:
        """Ranks this rank sends to, ascending."""
        return sorted(self.dst_ranks)


GraphFn = Callable[[int, int], nx.DiGraph]


class Topology:
    """A (possibly time-varying) communication graph over ``size`` ranks."""

    def __init__(
        self,
        kind: str,
        size: int,
        graph_at: GraphFn,
        period: int = 1,
        weights: Mapping[int, Mapping[int, float]] | None = None,
    ) -> None:
        if size < 1:
            raise TopologyError(f"topology {kind!r}: size must be >= 1, got {size}")
        self.kind = kind
        self.size = size
        self.period = max(1, period)
        self._graph_at = graph_at
        self._weights = {int(i): {int(j): float(w) for j, w in row.items()}
                         for i, row in (weights or {}).items()}
        for i, row in self._weights.items():
            for j in (i, *row):
                if not 0 <= j < size:
                    raise TopologyError(
                        f"topology weights name rank {j}, outside 0..{size - 1}"
                    )
        self._matrix = lru_cache(maxsize=64)(self._build_matrix)
        self._steps = lru_cache(maxsize=4096)(self._build_step)

    @property
    def dynamic(self) -> bool:
        """True when the graph changes from step to step."""
        return self.period > 1

    def graph(self, step: int = 0) -> nx.DiGraph:
        """The directed communication graph at ``step`` (edge j -> i: j sends to i)."""
        g = self._graph_at(self.size, step % self.period)
        g.add_nodes_from(range(self.size))
        for i, row in self._weights.items():
            g.remove_edges_from([(j, i) for j in list(g.predecessors(i))])
            g.add_edges_from((j, i) for j in row if j != i)
        g.remove_edges_from(nx.selfloop_edges(g))
        return g

    def _build_matrix(self, phase: int) -> np.ndarray:
        g = self.graph(phase)
        w = np.zeros((self.size, self.size))
        for i in range(self.size):
            srcs = sorted(g.predecessors(i))
            if i in self._weights:
                row = self._weights[i]
                w[i, i] = row.get(i, 1.0 - sum(v for j, v in row.items() if j != i))
                for j in srcs:
                    w[i, j] = row[j]
            else:
                share = 1.0 / (len(srcs) + 1)
                w[i, i] = share
                w[i, srcs] = share
        return w

    def matrix(self, step: int = 0) -> np.ndarray:
        """The mixing matrix W at ``step`` (a copy)."""
        return self._matrix(step % self.period).copy()

    def step(self, rank: int, step: int = 0) -> Step:
        """What ``rank`` does at ``step`` (cached: the daemon asks once per op)."""
        return self._steps(rank, step % self.period)

    def _build_step(self, rank: int, step: int) -> Step:
        g = self.graph(step)
        w = self._matrix(step % self.period)
        return Step(
            self_weight=float(w[rank, rank]),
            src_weights={j: float(w[rank, j]) for j in sorted(g.predecessors(rank))},
            dst_ranks=tuple(sorted(g.successors(rank))),
        )

    def rho(self, step: int = 0) -> float:
        """Spectral gap measure ``||W - 11^T/n||_2`` at ``step``."""
        w = self.matrix(step)
        return float(np.linalg.norm(w - np.full_like(w, 1.0 / self.size), 2))


def _edges(size: int, pairs: list[tuple[int, int]]) -> nx.DiGraph:
    g: nx.DiGraph = nx.DiGraph()
    g.add_nodes_from(range(size))
    g.add_edges_from((a % size, b % size) for a, b in pairs if a % size != b % size)
    return g


def hops(size: int) -> list[int]:
    """Powers of two below ``size``: 1, 2, 4, ... (exponential graphs, dissemination rounds)."""
    return [1 << k for k in range(max(0, math.ceil(math.log2(size))))] if size > 1 else []


def _ring(size: int, _step: int) -> nx.DiGraph:
    return _edges(size, [(i, i + d) for i in range(size) for d in (1, -1)])


def _exponential(size: int, _step: int) -> nx.DiGraph:
    return _edges(size, [(i, i + h) for i in range(size) for h in hops(size)])


def _hypercube(size: int, _step: int) -> nx.DiGraph:
    return _edges(size, [(i, i ^ h) for i in range(size) for h in hops(size)])


def _full(size: int, _step: int) -> nx.DiGraph:
    return _edges(size, [(i, j) for i in range(size) for j in range(size)])


def _star(size: int, _step: int) -> nx.DiGraph:
    return _edges(size, [p for i in range(1, size) for p in ((0, i), (i, 0))])


def _one_peer_exponential(size: int, step: int) -> nx.DiGraph:
    powers = hops(size)
    if not powers:
        return _edges(size, [])
    h = powers[step % len(powers)]
    return _edges(size, [(i, i + h) for i in range(size)])


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _check_hypercube(size: int) -> None:
    if not _is_power_of_two(size):
        raise TopologyError(
            f"topology 'hypercube' needs a power-of-two number of ranks, got {size}; "
            "use 'exponential' or 'ring' for this size"
        )


@dataclass(frozen=True)
class _Kind:
    graph_at: GraphFn
    period: Callable[[int], int] = lambda _n: 1
    check: Callable[[int], None] = lambda _n: None


_KINDS: dict[str, _Kind] = {
    "ring": _Kind(_ring),
    "exponential": _Kind(_exponential),
    "hypercube": _Kind(_hypercube, check=_check_hypercube),
    "full": _Kind(_full),
    "star": _Kind(_star),
    "one-peer-exponential": _Kind(_one_peer_exponential, period=lambda n: max(1, len(hops(n)))),
}


def register(
    kind: str,
    graph_at: GraphFn,
    period: Callable[[int], int] = lambda _n: 1,
    check: Callable[[int], None] = lambda _n: None,
) -> None:
    """Add a topology kind: ``graph_at(size, phase)`` returns its graph at phase < period(size)."""
    _KINDS[kind] = _Kind(graph_at, period, check)


def kinds() -> list[str]:
    """Names of all known topology kinds."""
    return sorted(_KINDS)


def build_topology(
    kind: str, size: int, weights: Mapping[int, Mapping[int, float]] | None = None
) -> Topology:
    """Build the topology ``kind`` over ``size`` ranks (TopologyError says what is wrong)."""
    if kind not in _KINDS:
        raise TopologyError(f"unknown topology {kind!r}; known: {', '.join(kinds())}")
    spec = _KINDS[kind]
    spec.check(size)
    return Topology(kind, size, spec.graph_at, spec.period(size), weights)
