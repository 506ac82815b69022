"""The graphs of the topology kinds: who sends to whom at each phase of a schedule.

A kind is ``fn(size, **options) -> (graph at a phase, period)``; :mod:`decent_wire.topology`
turns a kind's graphs into a :class:`~decent_wire.topology.Topology` with weights. New kinds
plug in with :func:`register`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import networkx as nx
import numpy as np


class TopologyError(ValueError):
    """A topology cannot be built or used as asked; the message says why and what to use."""


#: the graph at a phase (0 <= phase < period)
PhaseFn = Callable[[int], nx.DiGraph]
#: a kind: ``(size, **options) -> (graph at each phase, period)``
KindFn = Callable[..., tuple[PhaseFn, int]]

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
class Kind:
    """A kind of topology: its graphs and the options it takes."""

    fn: KindFn
    options: tuple[str, ...] = ()


KINDS: dict[str, Kind] = {
    "ring": Kind(_static(ring)),
    "exponential": Kind(_static(exponential)),
    "symmetric-exponential": Kind(_static(symmetric_exponential)),
    "hypercube": Kind(_static(hypercube)),
    "torus": Kind(torus, ("rows",)),
    "star": Kind(_static(star)),
    "full": Kind(_static(full)),
    "custom": Kind(custom, ("edges", "self_weights")),
    "one-peer-exponential": Kind(one_peer_exponential),
    "shift-one": Kind(shift_one),
    "random-matching": Kind(random_matching, ("seed",)),
    "wagma": Kind(wagma, ("group_size", "mean")),
}


def register(kind: str, fn: KindFn, options: Sequence[str] = ()) -> None:
    """Add a topology kind: ``fn(size, **options)`` returns (graph at a phase, period)."""
    KINDS[kind] = Kind(fn, tuple(options))


def kinds() -> list[str]:
    """Names of all known topology kinds."""
    return sorted(KINDS)



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
