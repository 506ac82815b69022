"""Push-based algorithms: BlueFog's win-put optimizer (push models through windows, combine
what arrived) and push-sum / stochastic gradient push for directed graphs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import numpy as np

from decent.core.surface.client import Client
from decent.core.training.algorithms.base import Algorithm, AlgorithmError, Arithmetic, State

T = TypeVar("T", bound=Arithmetic)


class WinPut(Algorithm[T]):
    """BlueFog's ``DistributedWinPutOptimizer``: ``x' = W x - d`` through windows.

    Before the forward pass each rank puts ``x_k`` into its out-neighbors' windows
    (``win_put``, destination weights ``dst_weights``: a dict, or a function of the iteration
    for dynamic graphs; default weight 1 to every out-neighbor); after the local update it
    combines its own ``x_k`` with whatever its in-neighbors put last (``win_update``, the static
    topology's weights). No barrier, unless ``barrier=True`` (then every put of this iteration
    lands before any rank combines, and every rank combines before any rank puts again: the
    synchronous recursion, exactly).
    """

    name = "win-put"
    needs = ()
    starts_early = True
    defaults: ClassVar[dict[str, Any]] = {"dst_weights": None, "barrier": False}

    def __init__(self, client: Client[T], **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        if self.topology.dynamic:
            raise AlgorithmError(f"win-put combines over a static graph; topology "
                                 f"{self.topology.kind!r} changes from step to step (give "
                                 "dynamic dst_weights instead)")

    def prepare(self, xs: Sequence[T]) -> None:
        """A window per parameter on every rank (neighbor slots start as a copy)."""
        if not self.windows:
            self.create_windows([x * 1.0 for x in xs], zero_init=False)

    def _destinations(self) -> Mapping[int, float] | None:
        weights = self.options["dst_weights"]
        if callable(weights):
            chosen: Mapping[int, float] | None = weights(self.iteration)
            return chosen
        return weights

    def start(self, xs: Sequence[T], states: Sequence[State]) -> None:
        self.prepare(xs)
        if "put" in self._pending or not self.communicates:
            return
        dst = self._destinations()
        self._pending["put"] = [self.client.win_put_async(x, name, dst_weights=dst)
                                for x, name in zip(xs, self.windows, strict=True)]

    def finish(self, xs: Sequence[T], ds: Sequence[T], states: Sequence[State]) -> list[T]:
        if not self.communicates:
            return self.halves(xs, ds)  # read by the adapter before the next step
        self.start(xs, states)
        for h in self._pending.pop("put"):
            h.join()
        if self.options["barrier"]:
            self.client.barrier(name=f"{self.prefix}.{self.name}.step")
        mixed = [self.client.win_update(name, value=x, clone=True)
                 for x, name in zip(xs, self.windows, strict=True)]
        if self.options["barrier"]:  # no rank's next put lands before every rank has combined
            self.client.barrier(name=f"{self.prefix}.{self.name}.combined")
        for m, d in zip(mixed, ds, strict=True):  # in the mixed results: this rank's own
            m -= d
        return mixed


class PushSum(Algorithm[T]):
    """Stochastic gradient push (push-sum, Kempe et al.; Assran et al. 2019): converges on
    directed graphs, where a row-stochastic average would be biased.

    Each rank keeps a numerator ``x`` and a weight ``w`` (1 at the start); the model it trains
    is ``z = x / w``. Step: ``x <- x - d(z)``; then every rank keeps ``1/(out_degree + 1)`` of
    ``(x, w)`` and pushes the same share to each out-neighbor, and adds what it receives
    (column-stochastic mixing); ``z' = x' / w'``.
    """

    name = "push-sum"
    needs = ()

    def __init__(self, client: Client[T], **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        #: this rank's push-sum weight (the model is the numerator divided by it)
        self.weight = 1.0

    def counters(self) -> dict[str, Any]:
        """The iteration counters and the push-sum weight."""
        return {**super().counters(), "weight": self.weight}

    def restore(self, counters: Mapping[str, Any]) -> None:
        """Restore :meth:`counters`."""
        super().restore(counters)
        self.weight = float(counters.get("weight", 1.0))

    def _push(self) -> dict[str, Any]:
        """The column-stochastic weights of this exchange: sender shares by out-degree."""
        t = self.exchanges
        me = self.client.rank
        step = self.topology.step(me, t)
        share = 1.0 / (len(step.dst_ranks) + 1)
        return {"self_weight": share, "src_weights": dict.fromkeys(step.src_weights, 1.0),
                "dst_weights": dict.fromkeys(step.dst_ranks, share)}

    def finish(self, xs: Sequence[T], ds: Sequence[T], states: Sequence[State]) -> list[T]:
        # the numerators: x = z w, then the local step taken at z
        halves = []
        for i, (x, d) in enumerate(zip(xs, ds, strict=True)):
            half = self.copy_of("half", i, x)
            half *= self.weight
            half -= d
            halves.append(half)
            self.spare("half", i, half)  # sent (copied in) or returned this step
        if not self.communicates:
            for half in halves:
                half *= 1.0 / self.weight
            return halves
        c, w = self.client, self._push()
        names = [f"{self.prefix}.ps.{i}" for i in range(len(halves))]
        hs = [c.neighbor_allreduce_async(h, name=n, **w) for h, n in zip(halves, names,
                                                                         strict=True)]
        weight = c.tensor(np.array([self.weight]), like=xs[0] if xs else None)
        hw = c.neighbor_allreduce_async(weight, name=f"{self.prefix}.ps.weight", **w)
        self.weight = float(c.values(hw.wait())[0])
        out = [h.wait() for h in hs]
        for o in out:  # this rank's own results
            o *= 1.0 / self.weight
        return out
