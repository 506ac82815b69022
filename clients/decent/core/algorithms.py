"""The decentralized algorithms, written once over the client core (``algorithms.md``).

An algorithm sees each parameter ``x`` of a worker and the *local update* ``d`` the wrapped
optimizer makes at it (``x - d`` is what the optimizer's own step writes: ``lr * g`` for plain
SGD, whatever momentum, weight decay or Adam make of it otherwise). It declares what its mixing
matrix must satisfy, and implements two hooks:

* :meth:`Algorithm.start` runs before the forward pass (or at the start of :meth:`step` when no
  forward hook is installed): exchanges that need only values known at that point (``W x_k``,
  ``W y_{k-1}``) are started here, so they overlap forward and backward;
* :meth:`Algorithm.finish` runs after the local update: it receives ``x_k`` (the parameters the
  gradient was taken at) and ``d_k``, waits for what :meth:`start` began, may exchange more, and
  returns ``x_{k+1}``.

Tensors are the framework's own; the algorithms use only arithmetic operators and the client's
ops, so the torch and TensorFlow adapters share them. Per-parameter state lives in a dict the
adapter provides (for torch, the wrapped optimizer's ``state``, so ``state_dict()`` carries it).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import networkx as nx
import numpy as np

from decent.core.client import COMPRESSORS, GROUP_RULES, Client, Handle
from decentd.topology import Topology, TopologyError, build_topology, from_graph, from_spec


class Arithmetic(Protocol):
    """What the algorithms ask of a framework's tensor: elementwise +, -, scaling and
    indexing along the first dimension."""

    def __add__(self, other: Any, /) -> Any: ...
    def __sub__(self, other: Any, /) -> Any: ...
    def __mul__(self, other: Any, /) -> Any: ...
    def __getitem__(self, index: Any, /) -> Any: ...


T = TypeVar("T", bound=Arithmetic)

#: where an algorithm keeps one parameter's state (a dict in the optimizer's state)
State = MutableMapping[str, Any]


class AlgorithmError(ValueError):
    """An algorithm cannot run as configured (unknown option, wrong topology, ...)."""


class Algorithm(Generic[T]):
    """Base of the algorithms: the schedule, the exchanges, and the two hooks."""

    #: registry name (``algorithm="..."``)
    name: ClassVar[str] = ""
    #: properties the mixing matrix must have at every step (``Topology.check``)
    needs: ClassVar[tuple[str, ...]] = ("doubly-stochastic",)
    #: options besides the common ones, with defaults
    defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, client: Client[T], prefix: str = "decent",
                 topology: str | Topology | nx.Graph | None = None,
                 communication_interval: int = 1, **options: Any) -> None:
        unknown = sorted(set(options) - set(self.defaults))
        if unknown:
            known = ", ".join(sorted({"topology", "communication_interval", *self.defaults}))
            raise AlgorithmError(f"algorithm {self.name!r} has no option(s) {unknown}; it takes "
                                 f"{known}")
        if int(communication_interval) < 1:
            raise AlgorithmError(f"communication_interval must be >= 1, got "
                                 f"{communication_interval}")
        self.client = client
        self.prefix = prefix
        self.options = {**self.defaults, **options}
        self.interval = int(communication_interval)
        self.own_topology = topology is not None
        self.topology = self._topology(topology)
        try:
            self.topology.check(self.needs, f"algorithm {self.name!r}")
        except TopologyError as exc:
            raise AlgorithmError(str(exc)) from None
        self.iteration = 0  # local updates so far
        self.exchanges = 0  # neighbor averaging rounds so far (the schedule's step)
        self._pending: dict[str, list[Handle[T]]] = {}

    def _topology(self, topology: str | Topology | nx.Graph | None) -> Topology:
        size = self.client.size
        if topology is None:
            spec = self.client.topology.spec_json
            if not spec:
                raise AlgorithmError("the daemon did not report its topology; upgrade decentd")
            return from_spec(json.loads(spec), size)
        if isinstance(topology, Topology):
            built = topology
        elif isinstance(topology, nx.Graph):
            built = from_graph(topology)
        else:
            built = build_topology(str(topology), size)
        if built.size != size:
            raise AlgorithmError(f"topology {built.kind!r} is for {built.size} ranks, the job "
                                 f"has {size}")
        return built

    # ------------------------------------------------------------------ schedule

    @property
    def communicates(self) -> bool:
        """Whether the current iteration averages with neighbors."""
        return (self.iteration + 1) % self.interval == 0

    # ------------------------------------------------------------------ exchanges

    def _weights(self) -> dict[str, Any]:
        """Explicit weights of this exchange when the algorithm has its own topology."""
        if not self.own_topology:
            return {}
        s = self.topology.step(self.client.rank, self.exchanges)
        return {"self_weight": s.self_weight, "src_weights": dict(s.src_weights),
                "dst_weights": list(s.dst_ranks)}

    def mix_async(self, key: str, tensors: Sequence[T], mean: bool = False,
                  in_place: bool = False) -> None:
        """Start ``W t`` (or the global mean) for every tensor; :meth:`mixed` collects them.
        ``in_place``: each result is written into its tensor, one unfused op per tensor (for a
        few large tensors, such as an adapter's flat parameter buffers)."""
        c = self.client
        names = [f"{self.prefix}.{key}.{i}" for i in range(len(tensors))]
        if mean:
            hs = [c.allreduce_async_(t, name=n, _fuse=False) if in_place
                  else c.allreduce_async(t, name=n) for t, n in zip(tensors, names, strict=True)]
        else:
            w = self._weights()
            hs = [c.neighbor_allreduce_async_(t, name=n, _fuse=False, **w) if in_place
                  else c.neighbor_allreduce_async(t, name=n, **w)
                  for t, n in zip(tensors, names, strict=True)]
        self._pending[key] = hs

    def mixed(self, key: str) -> list[T]:
        """The results of :meth:`mix_async` ``key``."""
        return [h.wait() for h in self._pending.pop(key)]

    def mix(self, key: str, tensors: Sequence[T], mean: bool = False) -> list[T]:
        """``W t`` for every tensor (blocking)."""
        self.mix_async(key, tensors, mean)
        return self.mixed(key)

    # ------------------------------------------------------------------ hooks

    def prepare(self, xs: Sequence[T]) -> None:
        """Once, when the adapter is built (every rank does it, before training): set up what
        the algorithm keeps in the daemons (windows). Nothing by default."""

    def create_windows(self, xs: Sequence[T]) -> list[str]:
        """One window per parameter (``<prefix>.<name>.<i>``, holding it), then a barrier: once
        it returns, every rank's windows exist. The window names."""
        names = [f"{self.prefix}.{self.name}.{i}" for i in range(len(xs))]
        for x, name in zip(xs, names, strict=True):
            self.client.win_create(x, name, zero_init=True)
        self.client.barrier(name=f"{self.prefix}.{self.name}.ready")
        return names

    def start(self, xs: Sequence[T], states: Sequence[State]) -> None:
        """Before the forward pass of an iteration: start what needs only ``x_k``."""

    def finish(self, xs: Sequence[T], ds: Sequence[T], states: Sequence[State]) -> list[T]:
        """After the local update ``d_k`` at ``x_k``: the next parameters ``x_{k+1}``."""
        raise NotImplementedError

    def advance(self) -> None:
        """Count one iteration (and one exchange round when it communicated)."""
        if self.communicates:
            self.exchanges += 1
        self.iteration += 1


class AdaptThenCombine(Algorithm[T]):
    """Algorithms whose update is ``x' = M (x - d)``: the optimizer's own step, then one linear
    combine chosen per iteration by :meth:`combine` (or none).

    ``x - d`` is exactly what the wrapped optimizer writes into the parameters, so an adapter
    that keeps them where the daemon can read them (torch: one shared-memory buffer per dtype)
    finishes with :meth:`finish_in_place` instead: nothing is cloned, subtracted or copied, and
    the combine reads and writes the parameters themselves.
    """

    def combine(self) -> tuple[str, bool] | None:
        """This iteration's combine, ``(exchange key, global mean?)``, or None (a local step)."""
        return ("x", False) if self.communicates else None

    def finish(self, xs: Sequence[T], ds: Sequence[T], states: Sequence[State]) -> list[T]:
        half = [x - d for x, d in zip(xs, ds, strict=True)]
        how = self.combine()
        return half if how is None else self.mix(how[0], half, mean=how[1])

    def finish_in_place(self, halves: Sequence[T]) -> None:
        """``x' = M halves`` written into ``halves``, which hold ``x - d`` (the parameters after
        the optimizer's step)."""
        how = self.combine()
        if how is not None:
            self.mix_async(how[0], halves, mean=how[1], in_place=True)
            self.mixed(how[0])


class DSGD(AdaptThenCombine[T]):
    """Adapt-then-combine D-SGD: ``x' = W (x - d)``; with a momentum optimizer, DmSGD."""

    name = "dsgd"


class DSGDCombineThenAdapt(Algorithm[T]):
    """Combine-then-adapt D-SGD: ``x' = W x - d(x)``; ``W x`` overlaps forward/backward."""

    name = "dsgd-cta"

    def start(self, xs: Sequence[T], states: Sequence[State]) -> None:
        if self.communicates and "x" not in self._pending:
            self.mix_async("x", xs)

    def finish(self, xs: Sequence[T], ds: Sequence[T], states: Sequence[State]) -> list[T]:
        if not self.communicates:
            return [x - d for x, d in zip(xs, ds, strict=True)]
        self.start(xs, states)
        return [wx - d for wx, d in zip(self.mixed("x"), ds, strict=True)]


class AllreduceBaseline(AdaptThenCombine[T]):
    """PmSGD: every worker takes its local step, then all average globally."""

    name = "allreduce"
    needs = ()

    def combine(self) -> tuple[str, bool] | None:
        """The global mean, every ``communication_interval``-th iteration."""
        return ("x", True) if self.communicates else None


class PeriodicGlobalAveraging(AdaptThenCombine[T]):
    """ATC D-SGD whose every ``period``-th combine is a global average."""

    name = "pga"
    defaults: ClassVar[dict[str, Any]] = {"period": 8}

    def __init__(self, client: Client[T], **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        if int(self.options["period"]) < 1:
            raise AlgorithmError(f"pga: period must be >= 1, got {self.options['period']}")

    def combine(self) -> tuple[str, bool] | None:
        """The global mean every ``period``-th iteration, else D-SGD's."""
        if (self.iteration + 1) % int(self.options["period"]) == 0:
            return ("g", True)
        return super().combine()


class GradientTracking(Algorithm[T]):
    """DIGing: ``x' = W x - y``, ``y' = W y + d(x') - d(x)``, ``y_0 = d_0`` (both exchanges
    start before the forward pass)."""

    name = "gradient-tracking"

    def start(self, xs: Sequence[T], states: Sequence[State]) -> None:
        if "x" in self._pending:
            return
        self.mix_async("x", xs)
        if all("y" in s for s in states):
            self.mix_async("y", [s["y"] for s in states])

    def finish(self, xs: Sequence[T], ds: Sequence[T], states: Sequence[State]) -> list[T]:
        self.start(xs, states)
        wys = self.mixed("y") if "y" in self._pending else None
        wxs = self.mixed("x")
        out = []
        for i, (wx, d, s) in enumerate(zip(wxs, ds, states, strict=True)):
            y = d if wys is None else wys[i] + d - s["d"]
            s["y"], s["d"] = y, d
            out.append(wx - y)
        return out


class Extra(Algorithm[T]):
    """EXTRA: ``x^{k+2} = x^{k+1} + W x^{k+1} - (x^k + W x^k)/2 - (d_{k+1} - d_k)``, and
    ``x^1 = W x^0 - d_0`` (one exchange per iteration, started before the forward pass)."""

    name = "extra"
    needs = ("doubly-stochastic", "symmetric")

    def start(self, xs: Sequence[T], states: Sequence[State]) -> None:
        if "x" not in self._pending:
            self.mix_async("x", xs)

    def finish(self, xs: Sequence[T], ds: Sequence[T], states: Sequence[State]) -> list[T]:
        self.start(xs, states)
        out = []
        for x, wx, d, s in zip(xs, self.mixed("x"), ds, states, strict=True):
            first = "x" not in s
            new = wx - d if first else x + wx - (s["x"] + s["wx"]) * 0.5 - d + s["d"]
            s["x"], s["wx"], s["d"] = x, wx, d
            out.append(new)
        return out


class ExactDiffusion(Algorithm[T]):
    """Exact diffusion: ``psi' = x - d``; ``phi = psi' + x - psi``; ``x' = (phi + W phi)/2``
    (``psi_0 = x_0``)."""

    name = "exact-diffusion"
    needs = ("doubly-stochastic", "symmetric")
    #: x' = Wbar phi with Wbar = (I + W)/2 (exact diffusion) or W itself (D2)
    halve: ClassVar[bool] = True

    def finish(self, xs: Sequence[T], ds: Sequence[T], states: Sequence[State]) -> list[T]:
        phis = []
        for x, d, s in zip(xs, ds, states, strict=True):
            psi = x - d
            phis.append(psi + x - s["psi"] if "psi" in s else psi)
            s["psi"] = psi
        wphis = self.mix("phi", phis)
        if not self.halve:
            return wphis
        return [(p + wp) * 0.5 for p, wp in zip(phis, wphis, strict=True)]


class D2(ExactDiffusion[T]):
    """D2: exact diffusion with ``W`` instead of ``(I + W)/2`` (needs lambda_min(W) > -1/3)."""

    name = "d2"
    halve = False

    def __init__(self, client: Client[T], **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        for phase in self.topology.phases():
            low = float(np.linalg.eigvalsh(self.topology.matrix(phase)).min())
            if low <= -1.0 / 3.0 + 1e-9:  # the bound is strict
                raise AlgorithmError(f"algorithm 'd2' needs lambda_min(W) > -1/3, but topology "
                                     f"{self.topology.kind!r} has {low:.4f} at step {phase}; use "
                                     "'exact-diffusion' (it mixes with (I+W)/2)")


class DecentLaM(Algorithm[T]):
    """DecentLaM: ``psi = x - d``; ``m' = beta m + (x - W psi)``; ``x' = x - m'``.

    The wrapped optimizer gives the plain local step (SGD without momentum); the algorithm
    applies momentum ``beta`` to the combined direction, so the fixed point is ATC D-SGD's.
    """

    name = "decentlam"
    needs = ("doubly-stochastic", "symmetric")
    defaults: ClassVar[dict[str, Any]] = {"beta": 0.9}

    def finish(self, xs: Sequence[T], ds: Sequence[T], states: Sequence[State]) -> list[T]:
        beta = float(self.options["beta"])
        psis = [x - d for x, d in zip(xs, ds, strict=True)]
        wpsis = self.mix("psi", psis)
        out = []
        for x, wpsi, s in zip(xs, wpsis, states, strict=True):
            g = x - wpsi
            m = g if "m" not in s else s["m"] * beta + g
            s["m"] = m
            out.append(x - m)
        return out


class Choco(Algorithm[T]):
    """CHOCO-SGD: gossip of compressed differences to public copies.

    ``q = Q(x - d - xhat)`` travels compressed (the daemon's compressed_neighbor_allreduce);
    ``xhat += q``, ``s += sum_j w_ij q_j`` (``s = sum_j w_ij xhat_j``), and
    ``x' = x - d + consensus_step * (s - xhat)``. ``xhat`` and ``s`` start at 0 and live in the
    optimizer state. With ``topk`` at ratio 1 and consensus_step 1 it is ATC D-SGD.
    """

    name = "choco"
    needs = ("doubly-stochastic", "symmetric", "static")
    #: topk 10% wants a small consensus step (0.5 left the digits workers apart, see
    #: benchmarks/convergence.py); int8 is nearly lossless and takes 0.8
    defaults: ClassVar[dict[str, Any]] = {"compressor": "topk", "ratio": 0.1,
                                          "consensus_step": 0.2}

    def __init__(self, client: Client[T], **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        comp, ratio = self.options["compressor"], self.options["ratio"]
        if comp not in COMPRESSORS:
            raise AlgorithmError(f"choco: unknown compressor {comp!r}; known: "
                                 f"{', '.join(sorted(COMPRESSORS))}")
        if comp == "topk" and not 0.0 < float(ratio) <= 1.0:
            raise AlgorithmError(f"choco: topk needs 0 < ratio <= 1, got {ratio}")
        if not 0.0 < float(self.options["consensus_step"]) <= 1.0:
            raise AlgorithmError(f"choco: consensus_step must be in (0, 1], got "
                                 f"{self.options['consensus_step']}")

    def finish(self, xs: Sequence[T], ds: Sequence[T], states: Sequence[State]) -> list[T]:
        halves = [x - d for x, d in zip(xs, ds, strict=True)]
        if not self.communicates:
            return halves
        comp = str(self.options["compressor"])
        ratio = float(self.options["ratio"]) if comp == "topk" else None
        step = float(self.options["consensus_step"])
        w = self._weights()
        handles = []
        for i, (half, s) in enumerate(zip(halves, states, strict=True)):
            if "xhat" not in s:
                s["xhat"], s["s"] = half * 0.0, half * 0.0
            handles.append(self.client.compressed_neighbor_allreduce_async(
                half - s["xhat"], comp, ratio=ratio, name=f"{self.prefix}.q.{i}", **w))
        out = []
        for half, s, h in zip(halves, states, handles, strict=True):
            result = h.wait()  # [2, *shape]: the mix of Q's, and our own Q
            mixed, own = result[0], result[1]
            s["xhat"] = s["xhat"] + own
            s["s"] = s["s"] + mixed
            out.append(half + (s["s"] - s["xhat"]) * step)
        return out


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
        self._windows: list[str] = []

    def prepare(self, xs: Sequence[T]) -> None:
        """A window per parameter on every rank, then one barrier: nobody averages with a
        rank whose windows do not exist yet."""
        if not self._windows:
            self._windows = self.create_windows(xs)

    def finish(self, xs: Sequence[T], ds: Sequence[T], states: Sequence[State]) -> list[T]:
        self.prepare(xs)
        if not self.active:
            return [self.client.win_add(d * -1.0, name)
                    for d, name in zip(ds, self._windows, strict=True)]
        half = [x - d for x, d in zip(xs, ds, strict=True)]
        if not self.communicates or not self.peers:
            return half
        peer = self._rng.choice(self.peers)
        handles = [self.client.win_exchange_async(h, name, peer)
                   for h, name in zip(half, self._windows, strict=True)]
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
        self._windows: list[str] = []
        self._group_calls = 0

    @property
    def global_step(self) -> bool:
        """Whether this iteration is the blocking global average."""
        return (self.iteration + 1) % (self.tau + 1) == 0

    def prepare(self, xs: Sequence[T]) -> None:
        """A window per parameter on every rank (the published models), then one barrier."""
        if not self._windows:
            self._windows = self.create_windows(xs)

    def start(self, xs: Sequence[T], states: Sequence[State]) -> None:
        self.prepare(xs)
        if self.global_step or "g" in self._pending:
            return
        self._group_calls += 1
        self._pending["g"] = [
            self.client.group_allreduce_async(x, name, self.group_size,
                                              rule=str(self.options["rule"]))
            for x, name in zip(xs, self._windows, strict=True)]

    def finish(self, xs: Sequence[T], ds: Sequence[T], states: Sequence[State]) -> list[T]:
        if self.global_step:
            self.prepare(xs)
            mixed = self.mix("global", xs, mean=True)
        else:
            self.start(xs, states)
            mixed = self.mixed("g")
        new = [m - d for m, d in zip(mixed, ds, strict=True)]
        # what the next group round would take from this rank: served if it is late
        for x, name in zip(new, self._windows, strict=True):
            self.client.win_publish(x, name, step=self._group_calls + 1)
        return new


ALGORITHMS: dict[str, type[Algorithm[Any]]] = {
    cls.name: cls for cls in (DSGD, DSGDCombineThenAdapt, AllreduceBaseline,
                              PeriodicGlobalAveraging, GradientTracking, Extra, ExactDiffusion,
                              D2, DecentLaM, Choco, ADPSGD, WAGMA)
}
#: other names users know them by
ALIASES = {"dmsgd": "dsgd", "d-sgd": "dsgd", "dgd": "dsgd-cta", "d-psgd": "dsgd-cta",
           "pmsgd": "allreduce", "diging": "gradient-tracking", "gt": "gradient-tracking",
           "exact_diffusion": "exact-diffusion", "periodic-global-averaging": "pga",
           "choco-sgd": "choco", "ad-psgd": "adpsgd", "wagma-sgd": "wagma"}


def make_algorithm(name: str, client: Client[T], **options: Any) -> Algorithm[T]:
    """The algorithm ``name`` (or an alias) with ``options``; AlgorithmError says what is
    wrong."""
    key = ALIASES.get(name.lower(), name.lower())
    cls = ALGORITHMS.get(key)
    if cls is None:
        known = ", ".join(sorted({*ALGORITHMS, *ALIASES}))
        raise AlgorithmError(f"unknown algorithm {name!r}; known: {known}")
    return cls(client, **options)


def consensus_distance(client: Client[T], xs: Sequence[T], square_norm: Callable[[T], T],
                       to_float: Callable[[T], float], name: str = "decent.consensus") -> float:
    """``sum_i ||x_i - mean||^2`` over the ranks, the same on every rank: an average of the
    parameters and a sum of one scalar. ``square_norm`` gives ``||t||^2`` as a 0-d tensor."""
    means = [client.allreduce_async(x, name=f"{name}.{i}") for i, x in enumerate(xs)]
    local = None
    for x, h in zip(xs, means, strict=True):
        term = square_norm(x - h.wait())
        local = term if local is None else local + term
    if local is None:
        return 0.0
    return to_float(client.allreduce(local, op="sum", name=f"{name}.sum"))
