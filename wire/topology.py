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
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import networkx as nx
import numpy as np


class TopologyError(ValueError):
    """A topology cannot be built or used as asked; the message says why and what to use."""


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


#: the graph at a phase (0 <= phase < period)
PhaseFn = Callable[[int], nx.DiGraph]
#: a kind: ``(size, **options) -> (graph at each phase, period)``
KindFn = Callable[..., tuple[PhaseFn, int]]

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
    ) -> None:
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
        #: what rebuilds this topology (:func:`from_spec`); set by the builders
        self.spec: dict[str, Any] = {"kind": kind, "scheme": scheme, "options": {},
                                     "weights": self._weights or None}
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
        return json.dumps(self.spec, sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        """A fingerprint of the spec and size: daemons that differ in it disagree on W."""
        return hashlib.sha256(f"{self.size}:{self.spec_json()}".encode()).hexdigest()

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
        rows = w.sum(axis=1)
        bad = np.flatnonzero(np.abs(rows - 1.0) > _TOL)
        if bad.size or (w < -_TOL).any():
            out["row-stochastic"] = (f"row {bad[0]} sums to {rows[bad[0]]:.6g}" if bad.size
                                     else "W has negative entries")
        cols = w.sum(axis=0)
        bad = np.flatnonzero(np.abs(cols - 1.0) > _TOL)
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


def _edges(size: int, pairs: Iterable[tuple[int, int]]) -> nx.DiGraph:
    g: nx.DiGraph = nx.DiGraph()
    g.add_nodes_from(range(size))
    g.add_edges_from((a % size, b % size) for a, b in pairs if a % size != b % size)
    return g


def _both_ways(size: int, pairs: Iterable[tuple[int, int]]) -> nx.DiGraph:
    return _edges(size, [p for a, b in pairs for p in ((a, b), (b, a))])


def hops(size: int) -> list[int]:
    """Powers of two below ``size``: 1, 2, 4, ... (exponential graphs, dissemination rounds)."""
    return [1 << k for k in range(max(0, math.ceil(math.log2(size))))] if size > 1 else []


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _static(fn: Callable[[int], nx.DiGraph]) -> KindFn:
    def kind(size: int) -> tuple[PhaseFn, int]:
        return (lambda _phase: fn(size)), 1
    kind.__doc__ = fn.__doc__
    return kind


def ring(size: int) -> nx.DiGraph:
    """i <-> i+1 (w = 1/3)."""
    return _both_ways(size, [(i, i + 1) for i in range(size)])


def exponential(size: int) -> nx.DiGraph:
    """i -> i + 2^k (directed; w = 1/(log2 n + 1))."""
    return _edges(size, [(i, i + h) for i in range(size) for h in hops(size)])


def symmetric_exponential(size: int) -> nx.DiGraph:
    """i <-> i + 2^k (undirected)."""
    return _both_ways(size, [(i, i + h) for i in range(size) for h in hops(size)])


def hypercube(size: int) -> nx.DiGraph:
    """i <-> i xor 2^k (a power-of-two number of ranks)."""
    if not _is_power_of_two(size):
        raise TopologyError(f"topology 'hypercube' needs a power-of-two number of ranks, got "
                            f"{size}; use 'symmetric-exponential' or 'ring' for this size")
    return _edges(size, [(i, i ^ h) for i in range(size) for h in hops(size)])


def star(size: int) -> nx.DiGraph:
    """0 <-> every other rank."""
    return _both_ways(size, [(0, i) for i in range(1, size)])


def full(size: int) -> nx.DiGraph:
    """Everyone with everyone (w = 1/n: one step averages exactly)."""
    return _edges(size, [(i, j) for i in range(size) for j in range(size)])


def torus(size: int, rows: int = 0) -> tuple[PhaseFn, int]:
    """2D torus of ``rows`` x ``size/rows`` (default: the most square): 4 neighbors each."""
    if rows <= 0:
        rows = max(r for r in range(1, math.isqrt(size) + 1) if size % r == 0)
    if size % rows:
        raise TopologyError(f"topology 'torus': {rows} rows do not divide {size} ranks; pick "
                            f"rows among {[r for r in range(1, size + 1) if size % r == 0]}")
    cols = size // rows

    def at(r: int, c: int) -> int:
        return (r % rows) * cols + c % cols

    g = _both_ways(size, [(at(r, c), at(r + 1, c)) for r in range(rows) for c in range(cols)]
                   + [(at(r, c), at(r, c + 1)) for r in range(rows) for c in range(cols)])
    return (lambda _phase: g), 1


def one_peer_exponential(size: int) -> tuple[PhaseFn, int]:
    """Step t: i -> i + 2^(t mod log2 n), w = 1/2 (exact average after log2 n steps, n = 2^k)."""
    powers = hops(size)
    if not powers:
        return (lambda _phase: _edges(size, [])), 1
    return (lambda phase: _edges(size, [(i, i + powers[phase]) for i in range(size)])), \
        len(powers)


def shift_one(size: int) -> tuple[PhaseFn, int]:
    """Bagua's shift_one: rank i of the lower half pairs with n/2 + (i + t) mod n/2, w = 1/2.

    A perfect matching at each step, every lower-half rank meeting every upper-half rank once
    per period of n/2 steps.
    """
    if size % 2:
        raise TopologyError(f"topology 'shift-one' pairs the two halves of an even number of "
                            f"ranks, got {size}; use 'random-matching' or "
                            "'one-peer-exponential'")
    half = size // 2
    return (lambda phase: _both_ways(size, [(i, half + (i + phase) % half)
                                            for i in range(half)])), max(1, half)


def random_matching(size: int, seed: int = 0) -> tuple[PhaseFn, int]:
    """A random perfect matching per step (one rank idles when n is odd), w = 1/2.

    Drawn from ``numpy.random.default_rng([seed, step])``: the same on every node, no talk.
    """
    def at(phase: int) -> nx.DiGraph:
        perm = np.random.default_rng([seed, phase]).permutation(size)
        return _both_ways(size, [(int(perm[k]), int(perm[k + 1]))
                                 for k in range(0, size - 1, 2)])
    return at, (1 << 31) - 1


def wagma(size: int, group_size: int = 8, mean: str = "exact") -> tuple[PhaseFn, int]:
    """WAGMA-SGD's butterfly groups: at phase s, rank r's group is every rank that differs from
    r only in bits [s log2 S, (s+1) log2 S); phases cycle.

    ``mean``: ``exact`` (group mean, w = 1/S; the global average after ceil(log_S n) phases) or
    ``reference`` (the reference code's ``(group_sum + own)/(S+1)``).
    """
    if not _is_power_of_two(size):
        raise TopologyError(f"topology 'wagma' needs a power-of-two number of ranks, got {size}")
    if group_size < 2 or not _is_power_of_two(group_size):
        raise TopologyError(f"topology 'wagma': group_size must be a power of two >= 2, got "
                            f"{group_size}")
    if mean not in ("exact", "reference"):
        raise TopologyError(f"topology 'wagma': mean must be 'exact' or 'reference', got "
                            f"{mean!r}")
    bits, width = size.bit_length() - 1, group_size.bit_length() - 1
    period = max(1, math.ceil(bits / width))

    def at(phase: int) -> nx.DiGraph:
        lo, hi = phase * width, min((phase + 1) * width, bits)
        mask = ((1 << hi) - 1) ^ ((1 << lo) - 1)
        g = _edges(size, [(j, i) for i in range(size) for j in range(size)
                          if i != j and (i & ~mask) == (j & ~mask)])
        if mean == "reference":
            members = 1 << (hi - lo)
            for i in range(size):
                g.nodes[i]["self_weight"] = 2.0 / (members + 1)
            for e in g.edges:
                g.edges[e]["weight"] = 1.0 / (members + 1)
        return g
    return at, period


def custom(size: int, edges: Sequence[Sequence[float]] = (),
           self_weights: Mapping[int, float] | None = None) -> tuple[PhaseFn, int]:
    """A static edge list: ``[src, dst]`` (weights from the scheme) or ``[src, dst, w]`` (the
    weight dst gives src; then every edge needs one, and a rank's self weight is the rest
    unless ``self_weights`` says)."""
    g = _edges(size, [])
    weighted = [len(e) == 3 for e in edges]
    if any(weighted) and not all(weighted):
        raise TopologyError("topology 'custom': give every edge as [src, dst, weight] or none")
    for e in edges:
        if len(e) not in (2, 3) or int(e[0]) != e[0] or int(e[1]) != e[1]:
            raise TopologyError(f"topology 'custom': an edge is [src, dst] or [src, dst, "
                                f"weight] with integer ranks, got {list(e)}")
        src, dst = int(e[0]), int(e[1])
        if not (0 <= src < size and 0 <= dst < size) or src == dst:
            raise TopologyError(f"topology 'custom': edge {list(e)} needs two different ranks "
                                f"in 0..{size - 1}")
        g.add_edge(src, dst, **({"weight": float(e[2])} if len(e) == 3 else {}))
    for i, w in (self_weights or {}).items():
        g.nodes[int(i)]["self_weight"] = float(w)
    return (lambda _phase: g), 1


@dataclass(frozen=True)
class _Kind:
    fn: KindFn
    options: tuple[str, ...] = ()


_KINDS: dict[str, _Kind] = {
    "ring": _Kind(_static(ring)),
    "exponential": _Kind(_static(exponential)),
    "symmetric-exponential": _Kind(_static(symmetric_exponential)),
    "hypercube": _Kind(_static(hypercube)),
    "torus": _Kind(torus, ("rows",)),
    "star": _Kind(_static(star)),
    "full": _Kind(_static(full)),
    "custom": _Kind(custom, ("edges", "self_weights")),
    "one-peer-exponential": _Kind(one_peer_exponential),
    "shift-one": _Kind(shift_one),
    "random-matching": _Kind(random_matching, ("seed",)),
    "wagma": _Kind(wagma, ("group_size", "mean")),
}


def register(kind: str, fn: KindFn, options: Sequence[str] = ()) -> None:
    """Add a topology kind: ``fn(size, **options)`` returns (graph at a phase, period)."""
    _KINDS[kind] = _Kind(fn, tuple(options))


def kinds() -> list[str]:
    """Names of all known topology kinds."""
    return sorted(_KINDS)


def kind_options(kind: str) -> tuple[str, ...]:
    """The options ``kind`` takes."""
    return _KINDS[kind].options


def build_topology(
    kind: str, size: int, weights: Mapping[int, Mapping[int, float]] | None = None,
    scheme: str = "uniform", **options: Any,
) -> Topology:
    """Build the topology ``kind`` over ``size`` ranks (TopologyError says what is wrong)."""
    if kind not in _KINDS:
        raise TopologyError(f"unknown topology {kind!r}; known: {', '.join(kinds())}")
    if size < 1:
        raise TopologyError(f"topology {kind!r}: size must be >= 1, got {size}")
    spec = _KINDS[kind]
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        takes = f"it takes {', '.join(spec.options)}" if spec.options else "it takes none"
        raise TopologyError(f"topology {kind!r} has no option(s) {unknown}; {takes}")
    try:
        at, period = spec.fn(size, **options)
    except TypeError as exc:
        raise TopologyError(f"topology {kind!r}: bad option value: {exc}") from exc
    topo = Topology(kind, size, at, period, weights, scheme)
    topo.spec["options"] = {k: options[k] for k in sorted(options)}
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
    topo = Topology(kind, len(nodes), lambda _phase: g, 1, None, scheme)
    edges: list[list[float]] = [[a, b, d["weight"]] if "weight" in d else [a, b]
                                for a, b, d in sorted(g.edges(data=True))]
    selfw = {int(i): float(d["self_weight"]) for i, d in g.nodes(data=True) if "self_weight" in d}
    topo.spec = {"kind": "custom", "scheme": scheme, "weights": None,
                 "options": {"edges": edges, **({"self_weights": selfw} if selfw else {})}}
    return topo


def butterfly_group(rank: int, size: int, group_size: int, round_: int) -> list[int]:
    """WAGMA's group of ``rank`` at ``round_`` (``size`` and ``group_size`` powers of two).

    With ``b = log2(group_size)`` and phase ``s = round_ mod ceil(log2(size) / b)``: the ranks
    that differ from ``rank`` only in bits ``[s b, (s + 1) b)`` (the last phase may have fewer
    bits, so a smaller group). Ascending; the first is the group's leader.
    """
    bits = size.bit_length() - 1
    b = max(1, group_size.bit_length() - 1)
    phases = max(1, -(-bits // b))
    s = round_ % phases
    lo, hi = s * b, min((s + 1) * b, bits)
    mask = ((1 << hi) - 1) ^ ((1 << lo) - 1)
    base = rank & ~mask
    return sorted(base | (v << lo) for v in range(1 << (hi - lo)))
