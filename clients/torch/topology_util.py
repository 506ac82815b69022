"""BlueFog's ``topology_util``: the graph builders and helpers BlueFog programs call
(``bf.topology_util.ExponentialTwoGraph(bf.size())``, ``GetRecvWeights``, ...), written here
with BlueFog's weights.

A graph is an ``nx.DiGraph`` over ranks ``0..size-1`` whose edge ``i -> j`` (self-loops
included) carries in ``"weight"`` the share of ``i``'s tensor in ``j``'s average, as BlueFog
builds them and as ``set_topology(G, is_weighted=True)`` reads them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import networkx as nx
import numpy as np

__all__ = ["ExponentialGraph", "ExponentialTwoGraph", "FullyConnectedGraph",
           "GetDynamicOnePeerSendRecvRanks", "GetRecvWeights", "GetSendWeights",
           "IsRegularGraph", "IsTopologyEquivalent", "MeshGrid2DGraph", "RingGraph",
           "StarGraph", "SymmetricExponentialGraph"]


def _circulant(row: np.ndarray) -> nx.DiGraph:
    """Rank ``i`` sends to ``i + k`` with weight ``row[k]`` (``row`` sums to 1)."""
    size = len(row)
    return _graph(np.stack([np.roll(row, i) for i in range(size)]))


def _graph(matrix: np.ndarray) -> nx.DiGraph:
    """The graph of ``matrix[i, j]``: edge ``i -> j`` where it is not 0."""
    g: nx.DiGraph = nx.DiGraph()
    g.add_nodes_from(range(len(matrix)))
    g.add_weighted_edges_from((int(i), int(j), float(matrix[i, j]))
                              for i, j in zip(*np.nonzero(matrix), strict=True))
    return g


def _power_of(x: int, base: int) -> bool:
    return x >= 1 and base ** round(math.log(x, base)) == x


def ExponentialGraph(size: int, base: int = 2) -> nx.DiGraph:
    """Rank ``i`` sends to itself and to ``i + base^k``, all with the same weight."""
    if size < 1:
        raise ValueError(f"size must be positive, got {size}")
    row = np.array([1.0] + [1.0 if _power_of(k, base) else 0.0 for k in range(1, size)])
    return _circulant(row / row.sum())


def ExponentialTwoGraph(size: int) -> nx.DiGraph:
    """:func:`ExponentialGraph` with base 2 (BlueFog's default topology)."""
    return ExponentialGraph(size, 2)


def SymmetricExponentialGraph(size: int, base: int = 4) -> nx.DiGraph:
    """Like :func:`ExponentialGraph`, with the offsets past the half mirrored (undirected)."""
    if size < 1:
        raise ValueError(f"size must be positive, got {size}")
    row = np.array([1.0] + [1.0 if _power_of(min(k, size - k), base) else 0.0
                            for k in range(1, size)])
    return _circulant(row / row.sum())


def RingGraph(size: int, connect_style: int = 0) -> nx.DiGraph:
    """A ring: ``connect_style`` 0 both neighbors (weights 1/3), 1 the left one, 2 the right
    one (weights 1/2)."""
    if size < 1 or connect_style not in (0, 1, 2):
        raise ValueError(f"RingGraph needs size >= 1 and connect_style 0, 1 or 2, got "
                         f"{size}, {connect_style}")
    if size <= 2:
        return _graph(np.full((size, size), 1.0 / size))
    row = np.zeros(size)
    if connect_style == 0:
        row[[0, 1, -1]] = 1 / 3
    else:
        row[0] = 0.5
        row[-1 if connect_style == 1 else 1] = 0.5
    return _circulant(row)


def MeshGrid2DGraph(size: int, shape: tuple[int, int] | None = None
                    ) -> nx.DiGraph:
    """A 2D grid (``shape`` rows x columns; default: the two closest factors of ``size``),
    with Metropolis-Hastings weights ``1 / max(deg_i, deg_j)`` (degrees counting self)."""
    if shape is None:
        rows = math.isqrt(size)
        while size % rows:
            rows -= 1
        shape = (rows, size // rows)
    rows, cols = shape
    if rows * cols != size:
        raise ValueError(f"a grid of shape {shape} does not have {size} nodes")
    adjacent = np.eye(size)
    for i in range(size):
        if (i + 1) % cols:
            adjacent[i, i + 1] = adjacent[i + 1, i] = 1.0
        if i + cols < size:
            adjacent[i, i + cols] = adjacent[i + cols, i] = 1.0
    degree = adjacent.sum(axis=1)
    w = adjacent.copy()  # the diagonal's 1 stays in each row's sum below: BlueFog's rounding
    for i, j in zip(*np.nonzero(adjacent), strict=True):
        if i != j:
            w[i, j] = 1.0 / max(degree[i], degree[j])
    for i in range(size):
        w[i, i] = 2.0 - w[i].sum()
    return _graph(w)


def StarGraph(size: int, center_rank: int = 0) -> nx.DiGraph:
    """Every rank exchanges with ``center_rank`` (weight ``1/size`` both ways); the others
    keep ``1 - 1/size`` of their own, the center ``1/size``."""
    w = np.zeros((size, size))
    w[np.diag_indices(size)] = 1.0 - 1.0 / size
    w[center_rank, :] = w[:, center_rank] = 1.0 / size
    return _graph(w)


def FullyConnectedGraph(size: int) -> nx.DiGraph:
    """Every rank averages with every rank (weights ``1/size``)."""
    return _graph(np.full((size, size), 1.0 / size))


def _split(rank: int, edges: Iterable[tuple[int, int, dict[str, float]]], incoming: bool
           ) -> tuple[float, dict[int, float]]:
    """(the self-loop's weight, {peer: weight}) of ``rank``'s ``edges`` (the peer: each
    edge's source when ``incoming``, else its destination)."""
    self_weight, peers = 0.0, {}
    for src, dst, data in edges:
        peer, weight = int(src if incoming else dst), float(data.get("weight", 1.0))
        if peer == rank:
            self_weight = weight
        else:
            peers[peer] = weight
    return self_weight, peers


def GetRecvWeights(topo: nx.DiGraph, rank: int) -> tuple[float, dict[int, float]]:
    """(self weight, {source: weight}) of ``rank``: its in-edges' weights."""
    return _split(rank, topo.in_edges(rank, data=True), True)


def GetSendWeights(topo: nx.DiGraph, rank: int) -> tuple[float, dict[int, float]]:
    """(self weight, {destination: weight}) of ``rank``: its out-edges' weights."""
    return _split(rank, topo.out_edges(rank, data=True), False)


def GetDynamicOnePeerSendRecvRanks(topo: nx.DiGraph, self_rank: int
                                   ) -> Iterator[tuple[list[int], list[int]]]:
    """Each step's ([the one rank to send to], [the ranks that send here]): every rank takes
    its out-neighbors in turn, clockwise from itself."""
    size = topo.number_of_nodes()

    def clockwise(rank: int) -> list[int]:
        return sorted((r for r in topo.successors(rank) if r != rank),
                      key=lambda r: (r - rank) % size)

    outs = [clockwise(r) for r in range(size)]
    index = 0
    while True:
        send = outs[self_rank][index % len(outs[self_rank])]
        recv = [r for r in range(size) if r != self_rank and outs[r]
                and outs[r][index % len(outs[r])] == self_rank]
        yield [send], recv
        index += 1


def IsTopologyEquivalent(topo1: nx.DiGraph | None, topo2: nx.DiGraph | None
                         ) -> bool:
    """Whether two graphs have the same weighted adjacency matrix (not isomorphism)."""
    if topo1 is None or topo2 is None:
        return False
    if (topo1.number_of_nodes(), topo1.number_of_edges()) != \
            (topo2.number_of_nodes(), topo2.number_of_edges()):
        return False
    return bool((nx.to_numpy_array(topo1) == nx.to_numpy_array(topo2)).all())


def IsRegularGraph(topo: nx.DiGraph) -> bool:
    """Whether every node has the same degree."""
    return len({d for _, d in topo.degree()}) <= 1
