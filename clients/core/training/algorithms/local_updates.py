"""Local updates with an outer optimizer: DiLoCo, decentralized DiLoCo and their streaming form
(``algorithms.md``, "DiLoCo and decentralized DiLoCo").

Every iteration is one step of the wrapped (inner) optimizer with no communication; every
``local_steps``-th iteration ends with an outer step on the pseudo-gradient
``delta = anchor - x``: an outer momentum ``u`` (Nesterov by default), and the outer iterates
``z`` mixed globally (``mix="allreduce"``: DiLoCo as published) or with the topology's neighbors
(``mix="neighbor"``: no global step at all). The anchor and the outer momentum are
per-parameter state, so checkpoints and a rejoining rank's state carry them.

Streaming (``fragments=F``, ``overlap=tau``): the parameters are split into ``F`` contiguous
fragments of about equal size; fragment ``p`` takes its outer step after the inner steps
``c`` with ``c mod H = floor(p H / F)``, so each sync sends ``1/F`` of the model. Its exchange
runs during the next ``tau`` inner steps and is merged when they are done:
``x_p <- alpha x_p + (1 - alpha) theta_p'`` (``alpha``: 0.5 with an overlap, else 0).

Compressed (``compressor="int8"``, ...):

* ``mix="allreduce"``: each rank sends ``q = Q(delta + e)`` and keeps the residual
  ``e' = delta + e - q`` (error feedback); the outer step runs on ``mean_j q_j``. The mean is
  exact over the ranks' compressed tensors: each rank sends its ``q`` to every other one
  (``compressed_neighbor_allreduce`` over the complete graph, weights ``1/n``); a ring would
  re-quantize partial sums and match no recursion.
* ``mix="neighbor"``: CHOCO's public copies of ``z``: ``zhat += Q(z - zhat)`` goes to the
  neighbors, ``s += sum_j w_ij Q_j`` and ``theta' = z + consensus_step (s - zhat)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from decent.core.requests.handles import Handle
from decent.core.surface.client import Client
from decent.core.training.algorithms.base import Algorithm, AlgorithmError, Arithmetic, State
from decent_wire.protocol import COMPRESSORS
from decent_wire.topology import TopologyError

T = TypeVar("T", bound=Arithmetic)

MIXES = ("allreduce", "neighbor")


@dataclass
class Flight:
    """One fragment's exchange under way: what was sent, and the requests to wait for (or the
    key of an uncompressed mix, :meth:`Algorithm.mixed`'s)."""

    sent: list[Any]
    handles: list[Handle[Any]] = field(default_factory=list)
    key: str = ""


def elements(shape: Sequence[Any]) -> int:
    """Entries of a tensor of ``shape`` (torch's, numpy's or TensorFlow's)."""
    count = 1
    for n in shape:
        count *= int(n)
    return count


def fragment_bounds(sizes: Sequence[int], fragments: int) -> list[int]:
    """Where each of ``fragments`` contiguous groups of parameters (of ``sizes`` elements)
    starts, none empty, each boundary the one nearest an equal split; the list ends with
    ``len(sizes)``."""
    n, total = len(sizes), sum(sizes)
    before = [sum(sizes[:k]) for k in range(n + 1)]  # elements before parameter k
    starts = [0]
    for p in range(1, fragments):
        target = p * total / fragments
        allowed = range(starts[-1] + 1, n - fragments + p + 1)
        starts.append(min(allowed, key=lambda k: abs(before[k] - target)))
    return [*starts, n]


class DiLoCo(Algorithm[T]):
    """DiLoCo: ``local_steps`` inner steps, then an outer (Nesterov) step on the mixed
    pseudo-gradients; ``mix="neighbor"`` gossips the outer iterates instead of averaging them
    globally; ``fragments`` and ``overlap`` stream them."""

    name = "diloco"
    needs: ClassVar[tuple[str, ...]] = ()  # the neighbor mix checks its own (see __init__)
    defaults: ClassVar[dict[str, Any]] = {
        "local_steps": 50, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True,
        "mix": "allreduce", "fragments": 1, "overlap": 0, "alpha": None,
        "compressor": None, "ratio": 0.1, "consensus_step": 1.0}

    def __init__(self, client: Client[T], **kwargs: Any) -> None:
        if int(kwargs.get("communication_interval", 1)) != 1:
            raise AlgorithmError("diloco: its interval is local_steps, not communication_interval")
        super().__init__(client, **kwargs)
        o = self.options
        self.interval = int(o["local_steps"])
        self.fragments, self.overlap = int(o["fragments"]), int(o["overlap"])
        self.alpha = float(o["alpha"]) if o["alpha"] is not None else \
            (0.5 if self.overlap else 0.0)
        self._check_options()
        if o["mix"] == "neighbor":
            needs = ("doubly-stochastic",) if o["compressor"] is None else \
                ("doubly-stochastic", "symmetric", "static")
            try:
                self.topology.check(needs, "algorithm 'diloco' (mix='neighbor')")
            except TopologyError as exc:
                raise AlgorithmError(str(exc)) from None
        #: each fragment's exchange under way, by fragment
        self._flights: dict[int, Flight] = {}
        self._bounds: list[int] = []

    def _check_options(self) -> None:
        o = self.options
        if self.interval < 1:
            raise AlgorithmError(f"diloco: local_steps must be >= 1, got {o['local_steps']}")
        if o["mix"] not in MIXES:
            raise AlgorithmError(f"diloco: mix must be one of {', '.join(MIXES)}, got "
                                 f"{o['mix']!r}")
        if float(o["outer_lr"]) <= 0.0 or not 0.0 <= float(o["outer_momentum"]) < 1.0:
            raise AlgorithmError(f"diloco: needs outer_lr > 0 and 0 <= outer_momentum < 1, got "
                                 f"{o['outer_lr']} and {o['outer_momentum']}")
        if not 1 <= self.fragments <= self.interval or not 0 <= self.overlap < self.interval \
                or not 0.0 <= self.alpha < 1.0:
            raise AlgorithmError(f"diloco: needs 1 <= fragments <= local_steps, 0 <= overlap < "
                                 f"local_steps and 0 <= alpha < 1, got {self.fragments}, "
                                 f"{self.overlap} and {self.alpha} (local_steps "
                                 f"{self.interval})")
        comp = o["compressor"]
        if comp is not None and comp not in COMPRESSORS:
            raise AlgorithmError(f"diloco: unknown compressor {comp!r}; known: "
                                 f"{', '.join(sorted(COMPRESSORS))}")
        if comp == "topk" and not 0.0 < float(o["ratio"]) <= 1.0:
            raise AlgorithmError(f"diloco: topk needs 0 < ratio <= 1, got {o['ratio']}")
        if not 0.0 < float(o["consensus_step"]) <= 1.0:
            raise AlgorithmError(f"diloco: consensus_step must be in (0, 1], got "
                                 f"{o['consensus_step']}")

    # ------------------------------------------------------------------ schedule

    def _syncing(self, done: int) -> list[int]:
        """The fragments whose outer step follows inner step number ``done`` (from 1)."""
        h, f = self.interval, self.fragments
        return [p for p in range(f) if done > 0 and done % h == p * h // f]

    def _starting(self) -> list[int]:
        return self._syncing(self.iteration + 1)

    def _merging(self) -> list[int]:
        return self._syncing(self.iteration + 1 - self.overlap)

    @property
    def communicates(self) -> bool:
        """Whether a fragment's exchange starts at this iteration."""
        return bool(self._starting())

    def local_step(self) -> bool:
        """This iteration is the wrapped optimizer's step alone (no exchange starts or ends,
        no state to set up): an adapter may run just that and call :meth:`advance`."""
        return self.iteration > 0 and not self._starting() and not self._merging()

    # ------------------------------------------------------------------ the step

    def finish(self, xs: Sequence[T], ds: Sequence[T], states: Sequence[State]) -> list[T]:
        for x, s in zip(xs, states, strict=True):
            if "anchor" not in s:  # theta = x^0, u = 0: the model before the first step
                s["anchor"], s["momentum"] = x * 1.0, x * 0.0
        if not self._bounds:
            self._bounds = self._fragment_layout(xs)
        out = self.halves(xs, ds)  # read by the adapter before the next step
        for p in self._starting():
            self._flights[p] = self._begin(p, *self._slices(p, out, states))
        for p in self._merging():
            flight = self._flights.pop(p, None)
            if flight is None:  # started before a checkpoint this run resumed from
                continue
            halves, mine = self._slices(p, out, states)
            lo = self._bounds[p]
            for k, theta in enumerate(self._land(flight, mine)):
                mine[k]["anchor"] = theta * 1.0
                out[lo + k] = theta if self.alpha == 0.0 else \
                    halves[k] * self.alpha + theta * (1.0 - self.alpha)
        return out

    def _fragment_layout(self, xs: Sequence[T]) -> list[int]:
        sizes = [elements(x.shape) for x in xs]  # type: ignore[attr-defined]
        if self.fragments > len(sizes):
            raise AlgorithmError(f"diloco: fragments={self.fragments} but the model has "
                                 f"{len(sizes)} parameter(s)")
        return fragment_bounds(sizes, self.fragments)

    def _slices(self, p: int, halves: list[T], states: Sequence[State]
                ) -> tuple[list[T], list[State]]:
        lo, hi = self._bounds[p], self._bounds[p + 1]
        return halves[lo:hi], list(states[lo:hi])

    def _outer(self, delta: T, s: State) -> T:
        """``u' = mu u + delta``; ``z = theta - eta (delta + mu u')`` (Nesterov) or
        ``theta - eta u'``."""
        mu, eta = float(self.options["outer_momentum"]), float(self.options["outer_lr"])
        s["momentum"] = s["momentum"] * mu + delta
        step = delta + s["momentum"] * mu if self.options["nesterov"] else s["momentum"]
        return s["anchor"] - step * eta

    def _begin(self, p: int, halves: list[T], states: list[State]) -> Flight:
        """Fragment ``p``'s outer step as far as it goes before its exchange, and the
        exchange started."""
        deltas = [s["anchor"] - half for half, s in zip(halves, states, strict=True)]
        comp = self.options["compressor"]
        if comp is not None and self.options["mix"] == "allreduce":
            sent = [d + s.setdefault("residual", d * 0.0) for d, s in zip(deltas, states,
                                                                         strict=True)]
            return Flight(sent, self._compressed(f"q{p}", sent, everyone=True))
        zs = [self._outer(delta, s) for delta, s in zip(deltas, states, strict=True)]
        if comp is not None:  # the neighbor mix over public copies
            diffs = [z - s.setdefault("zhat", z * 0.0) for z, s in zip(zs, states, strict=True)]
            return Flight(zs, self._compressed(f"zq{p}", diffs, everyone=False))
        self.mix_async(f"z{p}", zs, mean=self.options["mix"] == "allreduce")
        return Flight(zs, key=f"z{p}")

    def _land(self, flight: Flight, states: list[State]) -> list[T]:
        """Wait for a fragment's exchange: its new anchors ``theta'``."""
        if flight.key:  # uncompressed
            return self.mixed(flight.key)
        results = [h.wait() for h in flight.handles]  # [2, *shape]: the mix, our own Q
        if self.options["mix"] == "allreduce":  # the outer step on mean_j q_j
            for v, r, s in zip(flight.sent, results, states, strict=True):
                s["residual"] = v - r[1]
            return [self._outer(r[0], s) for r, s in zip(results, states, strict=True)]
        step = float(self.options["consensus_step"])
        out = []
        for z, r, s in zip(flight.sent, results, states, strict=True):
            s["zhat"] = s["zhat"] + r[1]
            s["s"] = s.get("s", z * 0.0) + r[0]
            out.append(z + (s["s"] - s["zhat"]) * step)
        return out

    def _compressed(self, key: str, tensors: Sequence[T], everyone: bool) -> list[Handle[T]]:
        """``compressed_neighbor_allreduce`` of each tensor: over the complete graph with
        weights ``1/n`` (``everyone``), else with the topology's neighbors."""
        comp = str(self.options["compressor"])
        ratio = float(self.options["ratio"]) if comp == "topk" else None
        n, rank = self.client.size, self.client.rank
        w: dict[str, Any] = {"self_weight": 1.0 / n,
                             "src_weights": {j: 1.0 / n for j in range(n) if j != rank},
                             "dst_weights": [j for j in range(n) if j != rank]} \
            if everyone else self._weights()
        return [self.client.compressed_neighbor_allreduce_async(
            t, comp, ratio=ratio, name=f"{self.prefix}.{key}.{i}", **w)
            for i, t in enumerate(tensors)]
