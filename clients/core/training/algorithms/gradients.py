"""Gradient averaging (Horovod's data parallelism): every gradient is averaged over all ranks
before the local step, so every rank takes the same step and the replicas stay identical."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, TypeVar

from decent.core.requests.handles import Handle
from decent.core.surface.client import Client
from decent.core.training.algorithms.base import Algorithm, AlgorithmError, Arithmetic, State

T = TypeVar("T", bound=Arithmetic)


class GradientAllreduce(Algorithm[T]):
    """``x' = step(x, mean_i g_i)``: the wrapped optimizer steps on the average gradient.

    Options (Horovod's): ``op`` (``"average"`` or ``"sum"``), ``gradient_predivide_factor``
    (gradients are divided by it before the sum and multiplied by it after, with the average's
    1/n), ``compression`` (a compressor applied around the reduction).
    """

    name = "gradient-allreduce"
    needs = ()
    reduces_gradients = True
    defaults: ClassVar[dict[str, Any]] = {"op": "average", "gradient_predivide_factor": 1.0,
                                          "compression": None}

    def __init__(self, client: Client[T], **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        if self.options["op"] not in ("average", "sum"):
            raise AlgorithmError(f"gradient-allreduce: op must be 'average' or 'sum' (Adasum is "
                                 f"not supported), got {self.options['op']!r}")
        if float(self.options["gradient_predivide_factor"]) <= 0.0:
            raise AlgorithmError("gradient-allreduce: gradient_predivide_factor must be > 0")

    def average_async(self, grads: Sequence[T], names: Sequence[str]) -> list[Handle[T]]:
        """Start reducing each gradient (in place when nothing transforms it); ``wait()``
        gives the reduced gradient."""
        factor = float(self.options["gradient_predivide_factor"])
        op, compression = str(self.options["op"]), self.options["compression"]
        out = []
        for g, n in zip(grads, names, strict=True):
            name = f"{self.prefix}.grad.{n}"
            if factor == 1.0 and compression is None:
                out.append(self.client.allreduce_async_(g, op, name=name))
            else:
                out.append(self.client.allreduce_async(g, op, name=name, compression=compression,
                                                       prescale_factor=1.0 / factor,
                                                       postscale_factor=factor))
        return out

    def finish(self, xs: Sequence[T], ds: Sequence[T], states: Sequence[State]) -> list[T]:
        """The optimizer's step on the averaged gradients is the whole update."""
        return [x - d for x, d in zip(xs, ds, strict=True)]
