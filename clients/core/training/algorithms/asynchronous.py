"""The asynchronous algorithms: AD-PSGD (pairwise, no barrier) and WAGMA-SGD (wait-avoiding
group averaging), both over the daemon's windows."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, ClassVar, TypeVar

import networkx as nx

from decent.core.surface.client import Client
from decent.core.training.algorithms.base import Algorithm, AlgorithmError, Arithmetic, State
from decent_wire.protocol import GROUP_RULES

T = TypeVar("T", bound=Arithmetic)


class ADPSGD(Algorithm[T]):
    """AD-PSGD (Lian et al., 2018): asynchronous pairwise averaging, no barrier in the loop.

    The topology must be bipartite (over all its phases): the side of rank 0 is *active*, the
    other *passive*. An active worker applies its update to its own model, then averages it
    with a random passive neighbor: the neighbor's daemon does ``x_i, x_j <- (x_i + x_j) / 2``
    atomically on the passive model it holds (``win_exchange``), without the passive worker. A
    passive worker's model lives in its daemon: its update is added to the current one there
    (``win_add``), whatever averaging happened meanwhile, and it continues from the result.
    One barrier in :meth:`prepare` (every rank's windows exist before anyone averages).
    """

    name = "adpsgd"
    needs = ()
    defaults: ClassVar[dict[str, Any]] = {"seed": 0}

    def __init__(self, client: Client[T], **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        graph: nx.Graph = nx.Graph()
        graph.add_nodes_from(range(client.size))
        for phase in range(self.topology.period):
            for r in range(client.size):
                graph.add_edges_from((j, r) for j in self.topology.step(r, phase).src_weights)
        if not nx.is_bipartite(graph):
            raise AlgorithmError(f"adpsgd needs a bipartite topology (active and passive "
                                 f"workers alternate); {self.topology.kind!r} on "
                                 f"{client.size} ranks is not (a ring of even size or a "
                                 "hypercube is)")
        colors = nx.bipartite.color(graph)
        self.active = colors[client.rank] == colors[0]
        self.peers = sorted(j for j in graph.neighbors(client.rank)
                            if colors[j] != colors[client.rank])
        if self.active and not self.peers and client.size > 1:
            raise AlgorithmError(f"adpsgd: active rank {client.rank} has no passive neighbor")
        self._rng = random.Random(int(self.options["seed"]) * 1_000_003 + client.rank)

    def prepare(self, xs: Sequence[T]) -> None:
        """A window per parameter on every rank, then one barrier: nobody averages with a
        rank whose windows do not exist yet."""
        self.create_windows(xs)

    def finish(self, xs: Sequence[T], ds: Sequence[T], states: Sequence[State]) -> list[T]:
        self.prepare(xs)
        if not self.active:
            out = []
            for i, (d, name) in enumerate(zip(ds, self.windows, strict=True)):
                minus = self.copy_of("d", i, d)
                minus *= -1.0
                out.append(self.client.win_add(minus, name))
                self.spare("d", i, minus)  # the result is written into it: returned
            return out
        half = self.halves(xs, ds)  # sent (copied in) or returned this step
        if not self.communicates or not self.peers:
            return half
        peer = self._rng.choice(self.peers)
        handles = [self.client.win_exchange_async(h, name, peer)
                   for h, name in zip(half, self.windows, strict=True)]
        return [h.wait() for h in handles]


class WAGMA(Algorithm[T]):
    """WAGMA-SGD (Li et al., 2021): wait-avoiding group model averaging.

    Each iteration averages ``x_k`` over a butterfly group of ``group_size`` ranks that changes
    every iteration (``group_allreduce``, started before the forward pass), then applies the
    local update taken at ``x_k``: ``x' = avg_group(x) - d``. Members that are late contribute
    their last published model; every ``tau + 1``-th iteration is a blocking global average,
    which bounds that staleness by ``tau``. ``rule``: ``"mean"`` or ``"with-self"`` (the
    reference code's ``(group_sum + own) / (S + 1)``). After each step the new model is
    published to the daemon, so a member that is late contributes the model it would bring
    (its updates are not lost), older only when it is more than a step behind. One barrier in
    :meth:`prepare`.
    """

    name = "wagma"
    needs = ()
    starts_early = True
    defaults: ClassVar[dict[str, Any]] = {"group_size": 8, "tau": 10, "rule": "mean"}

    def __init__(self, client: Client[T], **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        size = client.size
        group = min(int(self.options["group_size"]), size)
        if group < 1 or group & (group - 1) or size & (size - 1):
            raise AlgorithmError(f"wagma needs a power-of-two group_size and number of workers; "
                                 f"got group_size {self.options['group_size']}, {size} workers")
        if int(self.options["tau"]) < 0:
            raise AlgorithmError(f"wagma: tau must be >= 0, got {self.options['tau']}")
        if self.options["rule"] not in GROUP_RULES:
            raise AlgorithmError(f"wagma: rule must be one of {sorted(GROUP_RULES)}, got "
                                 f"{self.options['rule']!r}")
        self.group_size = group
        self.tau = int(self.options["tau"])
        self._group_calls = 0

    @property
    def global_step(self) -> bool:
        """Whether this iteration is the blocking global average."""
        return (self.iteration + 1) % (self.tau + 1) == 0

    def prepare(self, xs: Sequence[T]) -> None:
        """A window per parameter on every rank (the published models), then one barrier."""
        self.create_windows(xs)

    def start(self, xs: Sequence[T], states: Sequence[State]) -> None:
        self.prepare(xs)
        if self.global_step or "g" in self._pending:
            return
        self._group_calls += 1
        self._pending["g"] = [
            self.client.group_allreduce_async(x, name, self.group_size,
                                              rule=str(self.options["rule"]))
            for x, name in zip(xs, self.windows, strict=True)]

    def finish(self, xs: Sequence[T], ds: Sequence[T], states: Sequence[State]) -> list[T]:
        if self.global_step:
            self.prepare(xs)
            mixed = self.mix("global", xs, mean=True)
        else:
            self.start(xs, states)
            mixed = self.mixed("g")
        new = mixed
        for m, d in zip(mixed, ds, strict=True):  # in the mixed results: this rank's own
            m -= d
        # what the next group round would take from this rank: served if it is late
        for x, name in zip(new, self.windows, strict=True):
            self.client.win_publish(x, name, step=self._group_calls + 1)
        return new


