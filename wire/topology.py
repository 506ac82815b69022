"""Topologies: who averages with whom at each step, and with which weights.

A topology is a directed graph per step (edge ``j -> i``: j sends to i) plus a mixing matrix
``W`` with ``W[i, j]`` the weight receiver i gives sender j (``W[i, i]`` its self weight).
Weights, in order of precedence: explicit ``weights={receiver: {sender: w}}``; weights the kind
puts on its edges (``weight`` edge attribute, ``self_weight`` node attribute: WAGMA's reference
mean, weighted edge lists); the ``scheme``: ``uniform`` (receiver i gives ``1/(in_degree_i + 1)``
to itself and every in-neighbor) or ``metropolis`` (Metropolis-Hastings on an undirected graph:
``w_ij = 1/(1 + max(d_i, d_j))``, the rest to itself; symmetric and doubly stochastic on any
undirected graph).

Dynamic schedules return a different graph per step; the daemon uses an op's round as its step,
so the schedule advances once per call of each op name. The daemon and the clients (which check
what an algorithm needs and compute weights for a topology of their own) use this one module.
New kinds register with :func:`register`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import networkx as nx
import numpy as np

from decent_wire.graphs import KINDS, PhaseFn, TopologyError, hops, kinds, register

__all__ = ["PROPERTIES", "SCHEMES", "Step", "Topology", "TopologyError", "build_topology",
           "from_graph", "from_spec", "hops", "kinds", "register"]


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


SCHEMES = ("uniform", "metropolis")
#: properties :meth:`Topology.check` knows
PROPERTIES = ("row-stochastic", "doubly-stochastic", "symmetric", "static")
#: a dynamic schedule with a longer period is checked on this many phases
CHECKED_PHASES = 1024
_TOL = 1e-9


class Topology:
    """A (possibly time-varying) communication graph over ``size`` ranks, with its weights."""

    def __init__(
        self,
        kind: str,
        size: int,
        graph_at: PhaseFn,
        period: int = 1,
        weights: Mapping[int, Mapping[int, float]] | None = None,
        scheme: str = "uniform",
        options: Mapping[str, Any] | None = None,
        custom: bool = False,
    ) -> None:
        """``options``: what the builder of ``kind`` was given (its spec rebuilds it);
        ``custom``: built from a graph, its spec says so (``from_graph``)."""
        if size < 1:
            raise TopologyError(f"topology {kind!r}: size must be >= 1, got {size}")
        if scheme not in SCHEMES:
            raise TopologyError(f"topology {kind!r}: unknown weight scheme {scheme!r}; known: "
                                f"{', '.join(SCHEMES)}")
        self.kind = kind
        self.size = size
        self.period = max(1, period)
        self.scheme = scheme
        self._graph_at = graph_at
        self._weights = {int(i): {int(j): float(w) for j, w in row.items()}
                         for i, row in (weights or {}).items()}
        for i, row in self._weights.items():
            for j in (i, *row):
                if not 0 <= j < size:
                    raise TopologyError(
                        f"topology weights name rank {j}, outside 0..{size - 1}"
                    )
        #: what rebuilds this topology (:func:`from_spec`)
        self.spec: dict[str, Any] = {"kind": "custom" if custom else kind, "scheme": scheme,
                                     "options": dict(sorted((options or {}).items())),
                                     "weights": self._weights or None}
        self._spec_json = json.dumps(self.spec, sort_keys=True, separators=(",", ":"))
        self._digest = hashlib.sha256(f"{size}:{self._spec_json}".encode()).hexdigest()
        #: ``ring#1a2b3c4d``: its kind and digest, for messages and mismatches
        self.name = f"{kind}#{self._digest[:8]}"
        self._graphs = lru_cache(maxsize=64)(self._build_graph)
        self._matrix = lru_cache(maxsize=64)(self._build_matrix)
        self._steps = lru_cache(maxsize=4096)(self._build_step)

    @property
    def dynamic(self) -> bool:
        """True when the graph changes from step to step."""
        return self.period > 1

    def __repr__(self) -> str:
        return f"Topology({self.kind!r}, size={self.size}, period={self.period}, " \
               f"scheme={self.scheme!r})"

    def spec_json(self) -> str:
        """:attr:`spec` as canonical JSON."""
        return self._spec_json

    def digest(self) -> str:
        """A fingerprint of the spec and size: daemons that differ in it disagree on W."""
        return self._digest

    def graph(self, step: int = 0) -> nx.DiGraph:
        """The directed communication graph at ``step`` (edge j -> i: j sends to i; a copy)."""
        return self._graphs(step % self.period).copy()

    def _build_graph(self, phase: int) -> nx.DiGraph:
        g: nx.DiGraph = nx.DiGraph(self._graph_at(phase))
        g.add_nodes_from(range(self.size))
        if set(g.nodes) != set(range(self.size)):
            raise TopologyError(f"topology {self.kind!r} has nodes outside 0..{self.size - 1}: "
                                f"{sorted(set(g.nodes) - set(range(self.size)))[:5]}")
        for i, row in self._weights.items():
            g.remove_edges_from([(j, i) for j in list(g.predecessors(i))])
            g.add_edges_from((j, i) for j in row if j != i)
        g.remove_edges_from(list(nx.selfloop_edges(g)))
        return g

    def _build_matrix(self, phase: int) -> np.ndarray:
        g = self._graphs(phase)
        w = np.zeros((self.size, self.size))
        for i in range(self.size):
            srcs = sorted(g.predecessors(i))
            if i in self._weights:
                row = self._weights[i]
                w[i, i] = row.get(i, 1.0 - sum(v for j, v in row.items() if j != i))
                for j in srcs:
                    w[i, j] = row[j]
            elif srcs and all("weight" in g.edges[j, i] for j in srcs):
                for j in srcs:
                    w[i, j] = float(g.edges[j, i]["weight"])
                w[i, i] = float(g.nodes[i].get("self_weight", 1.0 - w[i, srcs].sum()))
            elif self.scheme == "metropolis":
                for j in srcs:
                    if not g.has_edge(i, j):
                        raise TopologyError(
                            f"topology {self.kind!r} step {phase}: Metropolis-Hastings weights "
                            f"need an undirected graph, but rank {j} sends to rank {i} and not "
                            "the other way; use weights 'uniform' or a symmetric kind "
                            "(ring, hypercube, symmetric-exponential, torus)")
                    w[i, j] = 1.0 / (1 + max(g.in_degree(i), g.in_degree(j)))
                w[i, i] = 1.0 - w[i].sum()
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

    def _build_step(self, rank: int, phase: int) -> Step:
        g = self._graphs(phase)
        w = self._matrix(phase)
        return Step(
            self_weight=float(w[rank, rank]),
            src_weights={j: float(w[rank, j]) for j in sorted(g.predecessors(rank))},
            dst_ranks=tuple(sorted(g.successors(rank))),
        )

    def rho(self, step: int = 0) -> float:
        """Mixing rate ``||W - 11^T/n||_2`` at ``step`` (0: one step averages exactly)."""
        w = self.matrix(step)
        return float(np.linalg.norm(w - np.full_like(w, 1.0 / self.size), 2))

    def degree(self, step: int = 0) -> tuple[int, int]:
        """(largest in-degree, largest out-degree) at ``step``."""
        g = self._graphs(step % self.period)
        return (max((d for _, d in g.in_degree()), default=0),
                max((d for _, d in g.out_degree()), default=0))

    def phases(self) -> range:
        """The steps :meth:`check` looks at: the whole period, or its first CHECKED_PHASES."""
        return range(min(self.period, CHECKED_PHASES))

    def failures(self, step: int = 0) -> dict[str, str]:
        """Which of PROPERTIES fail at ``step``, each with the evidence."""
        w = self.matrix(step)
        out: dict[str, str] = {}
        odd = np.argwhere(~np.isfinite(w) | (w < -_TOL))  # NaN, infinite or negative
        rows = w.sum(axis=1)
        bad = np.flatnonzero(~(np.abs(rows - 1.0) <= _TOL))  # a NaN row sum too
        if odd.size:
            i, j = (int(v) for v in odd[0])
            out["row-stochastic"] = f"W[{i},{j}] = {w[i, j]:.6g} (rank {i}'s weight of rank {j})"
        elif bad.size:
            out["row-stochastic"] = f"row {bad[0]} sums to {rows[bad[0]]:.6g}"
        cols = w.sum(axis=0)
        bad = np.flatnonzero(~(np.abs(cols - 1.0) <= _TOL))
        if "row-stochastic" in out or bad.size:
            out["doubly-stochastic"] = (out.get("row-stochastic") or
                                        f"column {bad[0]} sums to {cols[bad[0]]:.6g}")
        asym = np.argwhere(np.abs(w - w.T) > _TOL)
        if asym.size:
            i, j = (int(v) for v in asym[0])
            out["symmetric"] = f"W[{i},{j}] = {w[i, j]:.6g} but W[{j},{i}] = {w[j, i]:.6g}"
        if self.dynamic:
            out["static"] = f"its graph changes from step to step (period {self.period})"
        return out

    def check(self, need: Iterable[str], who: str = "this use") -> None:
        """Raise TopologyError unless every property in ``need`` holds at every step.

        The message names the property, the step and the entries that break it, and what to use
        instead.
        """
        need = list(need)
        unknown = sorted(set(need) - set(PROPERTIES))
        if unknown:
            raise TopologyError(f"unknown topology properties {unknown}; known: {PROPERTIES}")
        for phase in self.phases():
            failed = self.failures(phase)
            for prop in need:
                if prop in failed:
                    where = f" at step {phase}" if self.dynamic and prop != "static" else ""
                    raise TopologyError(
                        f"{who} needs a {prop} mixing matrix, but topology {self.kind!r} on "
                        f"{self.size} ranks ({self.scheme} weights) is not{where}: "
                        f"{failed[prop]}; {_ADVICE[prop]}")


_ADVICE = {
    "row-stochastic": "every receiver's weights (self included) must sum to 1",
    "doubly-stochastic": "use uniform weights on a regular graph (ring, exponential, hypercube, "
                         "torus, full) or weights 'metropolis' on an undirected graph",
    "symmetric": "use an undirected graph: 'hypercube' (a power-of-two number of ranks), "
                 "'symmetric-exponential', 'ring' or 'torus', with weights 'metropolis' unless "
                 "it is regular",
    "static": "use a static kind (ring, exponential, symmetric-exponential, hypercube, torus, "
              "full, custom)",
}


def build_topology(
    kind: str, size: int, weights: Mapping[int, Mapping[int, float]] | None = None,
    scheme: str = "uniform", **options: Any,
) -> Topology:
    """Build the topology ``kind`` over ``size`` ranks (TopologyError says what is wrong)."""
    if kind not in KINDS:
        raise TopologyError(f"unknown topology {kind!r}; known: {', '.join(kinds())}")
    if size < 1:
        raise TopologyError(f"topology {kind!r}: size must be >= 1, got {size}")
    spec = KINDS[kind]
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        takes = f"it takes {', '.join(spec.options)}" if spec.options else "it takes none"
        raise TopologyError(f"topology {kind!r} has no option(s) {unknown}; {takes}")
    try:
        at, period = spec.fn(size, **options)
    except TypeError as exc:
        raise TopologyError(f"topology {kind!r}: bad option value: {exc}") from exc
    topo = Topology(kind, size, at, period, weights, scheme, options)
    topo.graph(0)  # a kind that cannot be built says so now, not at the first op
    return topo


def from_spec(spec: Mapping[str, Any], size: int) -> Topology:
    """Rebuild a topology from its :attr:`Topology.spec` (as the daemon reports it)."""
    try:
        weights = spec.get("weights") or None
        return build_topology(str(spec["kind"]), size,
                              {int(i): {int(j): float(w) for j, w in row.items()}
                               for i, row in weights.items()} if weights else None,
                              str(spec.get("scheme", "uniform")), **dict(spec.get("options") or {}))
    except (KeyError, AttributeError, ValueError) as exc:
        if isinstance(exc, TopologyError):
            raise
        raise TopologyError(f"not a topology spec: {dict(spec)!r} ({exc})") from exc


def from_graph(graph: nx.Graph, scheme: str = "uniform", kind: str = "custom") -> Topology:
    """A static topology from a networkx graph on nodes 0..n-1 (undirected: both ways).

    Edges may carry ``weight`` (the weight the receiver gives the sender; then all must) and
    nodes ``self_weight``.
    """
    nodes = sorted(graph.nodes)
    if nodes != list(range(len(nodes))):
        raise TopologyError(f"a topology graph needs nodes 0..n-1, got {nodes[:8]}"
                            f"{' ...' if len(nodes) > 8 else ''}")
    g: nx.DiGraph = nx.DiGraph(graph)  # an undirected edge becomes both directions
    weighted = [("weight" in d) for _, _, d in g.edges(data=True)]
    if any(weighted) and not all(weighted):
        raise TopologyError("a topology graph gives every edge a 'weight' or none")
    edges: list[list[float]] = [[a, b, d["weight"]] if "weight" in d else [a, b]
                                for a, b, d in sorted(g.edges(data=True))]
    selfw = {int(i): float(d["self_weight"]) for i, d in g.nodes(data=True) if "self_weight" in d}
    return Topology(kind, len(nodes), lambda _phase: g, 1, None, scheme,
                    {"edges": edges, **({"self_weights": selfw} if selfw else {})}, custom=True)


