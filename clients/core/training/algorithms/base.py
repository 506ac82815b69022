"""The base of the decentralized algorithms (``algorithms.md``): what an algorithm declares and
the hooks an adapter calls.

An algorithm sees each parameter ``x`` of a worker and the *local update* ``d`` the wrapped
optimizer makes at it (``x - d`` is what the optimizer's own step writes: ``lr * g`` for plain
SGD, whatever momentum, weight decay or Adam make of it otherwise). It declares what its mixing
matrix must satisfy and what it needs from the adapter, and implements two hooks:

* :meth:`Algorithm.start` runs before the forward pass (or at the start of the step when no
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
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import networkx as nx

from decent.core.requests.handles import Handle
from decent.core.surface.client import Client
from decent_wire.topology import Topology, TopologyError, build_topology, from_graph, from_spec


class Arithmetic(Protocol):
    """What the algorithms ask of a framework's tensor: elementwise +, -, scaling, indexing
    along the first dimension and, where the framework allows it, assignment (``t[...] = u``;
    TensorFlow's tensors refuse it and get new ones)."""

    def __add__(self, other: Any, /) -> Any: ...
    def __sub__(self, other: Any, /) -> Any: ...
    def __mul__(self, other: Any, /) -> Any: ...
    def __getitem__(self, index: Any, /) -> Any: ...

    def __setitem__(self, index: Any, value: Any, /) -> None: ...


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
    #: :meth:`start` begins exchanges of ``x_k`` before the forward pass: the adapter calls it
    #: with a copy of the parameters as they are then
    starts_early: ClassVar[bool] = False
    #: the update is ``x' = M (x - d)``: :meth:`finish_in_place` may combine the parameters
    #: where the wrapped optimizer left them, with nothing copied
    in_place: ClassVar[bool] = False
    #: the update is ``x' = W x - d`` with ``W x`` started before the forward pass: an adapter
    #: that keeps the parameters in shared memory starts it from them (:meth:`start_in_place`,
    #: no copy kept), settles it before the wrapped optimizer's step
    #: (:meth:`settle_in_place`) and adds it to what that step wrote (:meth:`finish_in_place`)
    overlaps_in_place: ClassVar[bool] = False
    #: the gradients are reduced (:meth:`average_async`) before the wrapped optimizer's step
    reduces_gradients: ClassVar[bool] = False

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
        #: weights for the next exchanges instead of the topology's (BlueFog's per-step
        #: ``self_weight``/``src_weights``/``dst_weights``), or None
        self.step_weights: dict[str, Any] | None = None
        self._pending: dict[str, list[Handle[T]]] = {}
        #: the windows this algorithm created in the daemons (:meth:`close` frees them)
        self.windows: list[str] = []
        #: tensors of an earlier step no longer needed, by (key, parameter index): written
        #: over by :meth:`difference` instead of making new ones (not part of the state)
        self._spares: dict[tuple[str, int], T] = {}

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
        """Explicit weights of this exchange: the step's own, or the algorithm's topology's."""
        if self.step_weights is not None:
            return dict(self.step_weights)
        if not self.own_topology:
            return {}
        s = self.topology.step(self.client.rank, self.exchanges)
        return {"self_weight": s.self_weight, "src_weights": dict(s.src_weights),
                "dst_weights": list(s.dst_ranks)}

    def mix_async(self, key: str, tensors: Sequence[T], mean: bool = False,
                  in_place: bool = False) -> None:
        """Start ``W t`` (or the global mean) for every tensor; :meth:`mixed` collects them.
        ``in_place``: each result is written into its tensor (a global mean as one unfused op
        per tensor). The requests fuse by size only (:meth:`Client.fused`)."""
        with self.client.fused():  # one bucket as far as the threshold allows
            self._pending[key] = self._submit_mix(key, tensors, mean, in_place)

    def _submit_mix(self, key: str, tensors: Sequence[T], mean: bool,
                    in_place: bool) -> list[Handle[T]]:
        """The requests of :meth:`mix_async`."""
        c = self.client
        names = [f"{self.prefix}.{key}.{i}" for i in range(len(tensors))]
        if mean:
            hs = [c.allreduce_async_(t, name=n, fuse=False) if in_place
                  else c.allreduce_async(t, name=n) for t, n in zip(tensors, names, strict=True)]
        elif self.options.get("hierarchical"):
            hs = [c.hierarchical_neighbor_allreduce_async_(t, name=n) if in_place
                  else c.hierarchical_neighbor_allreduce_async(t, name=n)
                  for t, n in zip(tensors, names, strict=True)]
        else:
            w = self._weights()
            hs = [c.neighbor_allreduce_async_(t, name=n, fuse=True, **w) if in_place
                  else c.neighbor_allreduce_async(t, name=n, **w)
                  for t, n in zip(tensors, names, strict=True)]
        return hs

    def mixed(self, key: str) -> list[T]:
        """The results of :meth:`mix_async` ``key``."""
        return [h.wait() for h in self._pending.pop(key)]

    def copy_of(self, key: str, i: int, a: T) -> T:
        """A copy of ``a`` in the tensor :meth:`spare` gave for ``(key, i)`` at an earlier step
        (no new tensor after the first steps), else (or for a framework whose tensors never
        change) a new one."""
        out = self._spares.pop((key, i), None)
        if out is not None:
            try:
                out[...] = a
                return out
            except TypeError:  # TensorFlow's tensors take no assignment
                pass
        return a * 1.0

    def difference(self, key: str, i: int, a: T, b: T) -> T:
        """``a - b`` in a tensor of :meth:`copy_of`."""
        out = self.copy_of(key, i, a)
        out -= b
        return out

    def halves(self, xs: Sequence[T], ds: Sequence[T]) -> list[T]:
        """``x - d`` per parameter in reused tensors, for a step that only sends or returns
        them (each is given back with :meth:`spare` at once)."""
        out = [self.difference("half", i, x, d) for i, (x, d) in enumerate(zip(xs, ds,
                                                                                strict=True))]
        for i, half in enumerate(out):
            self.spare("half", i, half)
        return out

    def spare(self, key: str, i: int, tensor: T) -> None:
        """``tensor`` is not needed after this step (a tensor :meth:`finish` returns may be
        one: the adapter reads it before the next step): :meth:`difference` may reuse it."""
        self._spares[(key, i)] = tensor

    def discard_started(self) -> None:
        """Wait for the exchanges started and not collected yet, and drop their results (what
        they were started from changed before they were used)."""
        for key in list(self._pending):
            self.mixed(key)

    def mix(self, key: str, tensors: Sequence[T], mean: bool = False) -> list[T]:
        """``W t`` for every tensor (blocking)."""
        self.mix_async(key, tensors, mean)
        return self.mixed(key)

    # ------------------------------------------------------------------ hooks

    def check_optimizer(self, groups: Sequence[Mapping[str, Any]]) -> None:
        """AlgorithmError when the wrapped optimizer's settings (its parameter groups, or its
        config) cannot run this algorithm. Anything goes by default."""

    def prepare(self, xs: Sequence[T]) -> None:
        """Once, when the adapter is built (every rank does it, before training): set up what
        the algorithm keeps in the daemons (windows). Nothing by default."""

    def create_windows(self, xs: Sequence[T], zero_init: bool = True) -> list[str]:
        """Once: one window per parameter (``<prefix>.<name>.<i>``, holding it; the neighbor
        slots zeroed, or with ``zero_init=False`` a copy of it), then a barrier: once it
        returns, every rank's windows exist. The window names (:attr:`windows`)."""
        if not self.windows:
            names = [f"{self.prefix}.{self.name}.{i}" for i in range(len(xs))]
            for x, name in zip(xs, names, strict=True):
                self.client.win_create(x, name, zero_init=zero_init)
            self.client.barrier(name=f"{self.prefix}.{self.name}.ready")
            self.windows = names
        return self.windows

    def close(self) -> None:
        """Free the windows this algorithm created (collective: every rank, when training is
        over; a barrier first, so that no rank frees a window a neighbor still writes)."""
        if self.windows:
            self.client.barrier(name=f"{self.prefix}.{self.name}.close")
        for name in self.windows:
            self.client.win_free(name)
        self.windows = []

    def start(self, xs: Sequence[T], states: Sequence[State]) -> None:
        """Before the forward pass of an iteration: start what needs only ``x_k``."""

    def local_step(self) -> bool:
        """Whether this iteration is the wrapped optimizer's step alone, with nothing exchanged
        and no state changed: an adapter may then skip :meth:`finish` (and the copies of
        ``x_k`` and ``d_k`` it takes) and only :meth:`advance`. Never, by default."""
        return False

    def finish(self, xs: Sequence[T], ds: Sequence[T], states: Sequence[State]) -> list[T]:
        """After the local update ``d_k`` at ``x_k``: the next parameters ``x_{k+1}``."""
        raise NotImplementedError

    def finish_in_place(self, halves: Sequence[T]) -> None:
        """Algorithms that declare :attr:`in_place` or :attr:`overlaps_in_place`: ``x'``
        written into ``halves``, which hold ``x - d`` (the parameters after the optimizer's
        step): ``M halves``, or ``halves + (W x - x)``."""
        raise NotImplementedError(f"algorithm {self.name!r} does not finish in place")

    def start_in_place(self, xs: Sequence[T]) -> None:
        """Algorithms that declare :attr:`overlaps_in_place`, before the forward pass: start
        the exchange from the parameters themselves (``xs``, in shared memory; they must not
        change until :meth:`settle_in_place`)."""
        raise NotImplementedError(f"algorithm {self.name!r} does not start in place")

    def settle_in_place(self, xs: Sequence[T]) -> None:
        """Algorithms that declare :attr:`overlaps_in_place`, before the wrapped optimizer's
        step: wait for the exchange :meth:`start_in_place` began (starting it now if it has
        not) and keep what :meth:`finish_in_place` adds; ``xs`` may change afterwards."""
        raise NotImplementedError(f"algorithm {self.name!r} does not start in place")

    def average_async(self, grads: Sequence[T], names: Sequence[str]) -> list[Handle[T]]:
        """Algorithms that declare :attr:`reduces_gradients`: start reducing each gradient;
        ``wait()`` gives the reduced gradient."""
        raise NotImplementedError(f"algorithm {self.name!r} does not reduce gradients")

    def counters(self) -> dict[str, Any]:
        """What a checkpoint keeps of the algorithm besides per-parameter state."""
        return {"iteration": self.iteration, "exchanges": self.exchanges}

    def restore(self, counters: Mapping[str, Any]) -> None:
        """Restore :meth:`counters`."""
        self.iteration = int(counters["iteration"])
        self.exchanges = int(counters["exchanges"])

    def advance(self) -> None:
        """Count one iteration (and one exchange round when it communicated)."""
        if self.communicates:
            self.exchanges += 1
        self.iteration += 1


class Hierarchical(Algorithm[T]):
    """Algorithms whose exchange is one neighbor averaging of the parameters, which may be
    hierarchical.

    ``hierarchical``: each exchange averages the node's workers, then mixes the nodes' means
    over the daemons' machine topology (BlueFog's hierarchical_neighbor_allreduce).
    """

    defaults: ClassVar[dict[str, Any]] = {"hierarchical": False}

    def __init__(self, client: Client[T], **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        if self.options["hierarchical"]:
            if self.own_topology:
                raise AlgorithmError(f"algorithm {self.name!r}: hierarchical=True mixes over "
                                     "the daemons' machine topology; it takes no topology of "
                                     "its own")
            machines = from_spec(json.loads(client.machine_topology.spec_json or "{}"),
                                 client.machine_size)
            try:
                machines.check(self.needs, f"algorithm {self.name!r} (machine topology)")
            except TopologyError as exc:
                raise AlgorithmError(str(exc)) from None


class AdaptThenCombine(Hierarchical[T]):
    """Algorithms whose update is ``x' = M (x - d)``: the optimizer's own step, then one linear
    combine chosen per iteration by :meth:`combine` (or none).

    ``x - d`` is exactly what the wrapped optimizer writes into the parameters, so an adapter
    that keeps them where the daemon can read them (torch: one shared-memory buffer per dtype)
    finishes with :meth:`finish_in_place` instead: nothing is cloned, subtracted or copied, and
    the combine reads and writes the parameters themselves.
    """

    in_place = True

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


