"""The decentralized algorithms, written once over the client core (``algorithms.md``).

:mod:`~decent.core.training.algorithms.base` holds what every algorithm declares and the hooks the
adapters call; :mod:`~decent.core.training.algorithms.gossip` the synchronous ones and
:mod:`~decent.core.training.algorithms.asynchronous` AD-PSGD and WAGMA,
:mod:`~decent.core.training.algorithms.local_updates` DiLoCo (local steps, an outer optimizer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from decent.core.surface.client import Client
from decent.core.training.algorithms.asynchronous import ADPSGD, WAGMA
from decent.core.training.algorithms.base import (
    AdaptThenCombine,
    Algorithm,
    AlgorithmError,
    Arithmetic,
    State,
)
from decent.core.training.algorithms.gossip import (
    D2,
    DSGD,
    AllreduceBaseline,
    Choco,
    DecentLaM,
    DSGDCombineThenAdapt,
    ExactDiffusion,
    Extra,
    GradientTracking,
    PeriodicGlobalAveraging,
)
from decent.core.training.algorithms.gradients import GradientAllreduce
from decent.core.training.algorithms.local_updates import DiLoCo
from decent.core.training.algorithms.push import PushSum, WinPut

T = TypeVar("T", bound=Arithmetic)

__all__ = [
    "ADPSGD",
    "ALGORITHMS",
    "ALIASES",
    "WAGMA",
    "AdaptThenCombine",
    "Algorithm",
    "AlgorithmError",
    "DiLoCo",
    "GradientAllreduce",
    "PushSum",
    "State",
    "WinPut",
    "consensus_distance",
    "make_algorithm",
]

ALGORITHMS: dict[str, type[Algorithm[Any]]] = {
    cls.name: cls for cls in (DSGD, DSGDCombineThenAdapt, AllreduceBaseline,
                              PeriodicGlobalAveraging, GradientTracking, Extra, ExactDiffusion,
                              D2, DecentLaM, Choco, ADPSGD, WAGMA, GradientAllreduce, WinPut,
                              PushSum, DiLoCo)
}
#: other names users know them by
ALIASES = {"dmsgd": "dsgd", "d-sgd": "dsgd", "dgd": "dsgd-cta", "d-psgd": "dsgd-cta",
           "pmsgd": "allreduce", "diging": "gradient-tracking", "gt": "gradient-tracking",
           "exact_diffusion": "exact-diffusion", "periodic-global-averaging": "pga",
           "choco-sgd": "choco", "ad-psgd": "adpsgd", "wagma-sgd": "wagma",
           "horovod": "gradient-allreduce", "winput": "win-put", "sgp": "push-sum",
           "pushsum": "push-sum"}


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
