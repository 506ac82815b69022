"""The client's runtime topology (BlueFog's ``set_topology`` and friends), behind
:class:`decent.core.Client`'s topology methods.

``set_topology`` gives this worker's job a topology of its own, from its next op on: every rank
calls it at the same point of its own sequence of ops. An op already in flight keeps the
topology it started with, and ranks whose ops disagree about it fail with MISMATCH naming both.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import networkx as nx
import numpy as np

from decent.core.requests.calls import op_call
from decent.core.surface.op_calls import OpCalls
from decent.core.surface.window_calls import WindowCalls
from decent_wire.topology import Topology, build_topology, from_graph, from_spec
from decent_wire.v1 import decent_pb2 as pb

T = TypeVar("T")
log = logging.getLogger("decent")


def bluefog_graph(graph: nx.Graph, weighted: bool) -> Topology:
    """A topology from a BlueFog-style networkx graph on ranks 0..n-1.

    Unweighted: the edges only (uniform weights). Weighted: edge ``i -> j`` carries the weight
    ``j`` gives ``i`` (attribute ``weight``, 1 when missing), and a rank's self weight is its
    self-loop's weight, 0 without one.
    """
    g: nx.DiGraph = nx.DiGraph()
    g.add_nodes_from(graph.nodes)
    directed: nx.DiGraph = nx.DiGraph(graph)
    for a, b, data in directed.edges(data=True):
        if a == b:
            if weighted:
                g.nodes[a]["self_weight"] = float(data.get("weight", 1.0))
            continue
        g.add_edge(a, b, **({"weight": float(data.get("weight", 1.0))} if weighted else {}))
    if weighted:
        for node in g.nodes:
            g.nodes[node].setdefault("self_weight", 0.0)
    return from_graph(g)


class TopologyCalls(Generic[T]):
    """This worker's topology: the ``set_topology`` control request, and what reads it."""

    def __init__(self, calls: OpCalls[T], windows: WindowCalls[T], size: int,
                 info: pb.TopologyInfo) -> None:
        self.calls = calls
        self.windows = windows
        self.size = size
        #: neighbors and weights at step 0 of the current topology
        self.info = info
        #: whether the last set_topology took the graph's weights
        self.weighted = False
        #: the graph the last set_topology was given (load_topology returns it), or None
        self.graph: nx.Graph | None = None

    def topology_at(self, name: str | None = None) -> pb.TopologyInfo:
        """Neighbors and weights at the step the next call of op ``name`` will use."""
        submitter = self.calls.submitter
        return self.calls.connection.topology(name or "",
                                              submitter.round_of(name) if name else 0)

    def set_topology(self, topology: str | Topology | nx.Graph | None = None,
                     is_weighted: bool = False) -> bool:
        """Use ``topology`` (a kind name, a :class:`~decent_wire.topology.Topology` or a
        networkx graph, BlueFog-style; None: back to the daemon's) for this worker's ops from
        the next one on. ``is_weighted`` (graphs): take the edges' ``weight`` and the
        self-loops' as the weights, else uniform. Call it at the same point on every rank.

        False, as BlueFog, while windows exist (free them first).
        """
        names = self.windows.window_names()
        if names:
            log.warning("set_topology: windows %s exist; free them first (topology unchanged)",
                        names)
            return False
        built = self._build(topology, is_weighted)
        self.calls.submitter.flush()  # what was submitted before keeps its topology
        spec = "" if built is None else built.spec_json()
        self.calls.call(op_call("set_topology", pb.SetTopology(spec_json=spec)), None,
                        "set_topology", None).join()
        self.weighted = bool(is_weighted) and built is not None
        self.graph = topology if isinstance(topology, nx.Graph) else None
        self.info = self.topology_at()
        return True

    def _build(self, topology: str | Topology | nx.Graph | None,
               weighted: bool) -> Topology | None:
        if topology is None:
            return None
        if isinstance(topology, Topology):
            built = topology
        elif isinstance(topology, nx.Graph):
            built = bluefog_graph(topology, weighted)
        else:
            built = build_topology(str(topology), self.size)
        if built.size != self.size:
            raise ValueError(f"topology {built.kind!r} is for {built.size} ranks, the job has "
                             f"{self.size}")
        return built

    def load_topology(self) -> nx.Graph:
        """The current topology as a networkx graph (BlueFog's ``load_topology``): the graph
        given to ``set_topology``, as BlueFog returns it (with its own weights, even when
        ``is_weighted=False`` made the ops average uniformly); otherwise one built from the
        topology, where edge ``j -> i`` carries the weight ``i`` gives ``j``, and a self-loop
        each rank's self weight (at step 0 of a dynamic schedule)."""
        if self.graph is not None:
            return self.graph
        topo = from_spec(json.loads(self.info.spec_json), self.size)
        w = topo.matrix(0)
        g = topo.graph(0)
        for j, i in g.edges:
            g.edges[j, i]["weight"] = float(w[i, j])
        for i in g.nodes:
            g.add_edge(i, i, weight=float(w[i, i]))
        return g


def _check_ranks(ranks: Sequence[int], size: int, rank: int, what: str) -> list[int]:
    out = [int(r) for r in ranks]
    if len(set(out)) != len(out) or any(not 0 <= r < size or r == rank for r in out):
        raise ValueError(f"{what} must be distinct ranks in 0..{size - 1} other than this one "
                         f"({rank}), got {out}")
    return out


def infer_peers(client: Any, ranks: Sequence[int], given: str,
                adjacency: bool = False) -> list[int] | tuple[list[int], np.ndarray]:
    """The ranks that name this rank in their ``given`` list (``"src"``: their sources, so
    they are this rank's destinations; ``"dst"``: the opposite), from every rank's list
    (collective: call it on every rank). ``adjacency``: also the 0/1 matrix with ``W[i, j] = 1``
    when ``i`` sends to ``j``, self-loops included, each column scaled to sum to 1 (a
    receiver's weights)."""
    mine = _check_ranks(ranks, client.size, client.rank, f"{given}_ranks")
    counts = client.values(client.allgather(client.tensor(np.array([len(mine)], np.int64)),
                                            name=f"decent.infer.{given}.counts"))
    flat = client.values(client.allgather(client.tensor(np.array(mine, np.int64)),
                                          name=f"decent.infer.{given}.ranks"))
    lists = np.split(flat, np.cumsum(counts)[:-1])
    sends = np.eye(client.size)
    for r, listed in enumerate(lists):
        for other in listed:
            if given == "src":
                sends[int(other), r] = 1.0  # r receives from other
            else:
                sends[r, int(other)] = 1.0  # r sends to other
    me = client.rank
    found = sorted(j for j in range(client.size) if j != me and
                   (sends[me, j] if given == "src" else sends[j, me]))
    if not adjacency:
        return found
    return found, sends / sends.sum(axis=0, keepdims=True)
