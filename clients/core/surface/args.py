"""Turning a call's arguments into an op's typed wire arguments."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

#: weights by rank: ``{rank: w}``, or a list of ranks (weight 1 each)
WeightsArg = Mapping[int, float] | Iterable[int] | None


def rank_weights(arg: WeightsArg) -> dict[int, float] | None:
    """Weights by rank (a list of ranks: weight 1 each); None when not given."""
    if arg is None:
        return None
    if isinstance(arg, Mapping):
        return {int(k): float(v) for k, v in arg.items()}
    return {int(k): 1.0 for k in arg}


def op_args(name: str | None, cls: Any, **fields: Any) -> Any:
    """``cls(**fields)``: fields left as None are not given, a dict is a ``RankWeights``.
    ValueError naming the tensor when an argument does not fit the wire (a rank outside int32,
    a weight that is not a number)."""
    given = {k: {"weights": v} if isinstance(v, dict) else v
             for k, v in fields.items() if v is not None}
    try:
        return cls(**given)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"tensor '{name}': bad argument: {exc}") from None
