"""Sending a state dict between ranks as tensors and plain values, never as a pickle.

A state dict (an optimizer's: momentum buffers, step counts, hyperparameters, the algorithm's
state) is split into a *skeleton* of plain values in JSON, where every tensor is replaced by its
index, and the list of tensors. Containers carry a tag so that the receiver rebuilds exactly the
same types (int keys, tuples). Only tensors and plain values travel: anything else is refused on
the sending side, and the receiving side parses JSON and allocates tensors of the announced
dtypes and shapes after checking them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

#: tensors on the wire as they are
WIRE_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64,
                         torch.int32, torch.int64, torch.uint8, torch.int8, torch.int16})
#: booleans travel as uint8 and are cast back (exactly)
WIDENED = {torch.bool: torch.uint8}
#: complex tensors travel as their real view
COMPLEX = {torch.complex64: torch.float32, torch.complex128: torch.float64}
#: the most elements the receiver allocates for one announced tensor
MAX_ELEMENTS = 1 << 34

Skeleton = Any


class StateFormatError(ValueError):
    """A state dict that cannot travel, or a received one that is not well formed."""


def flatten(state: Any, tensors: list[torch.Tensor], where: str = "state") -> Skeleton:
    """``state`` as JSON-ready plain values; its tensors appended to ``tensors``."""
    if isinstance(state, torch.Tensor):
        tensors.append(state.detach())
        return {"t": len(tensors) - 1}
    if state is None or isinstance(state, bool | int | float | str):
        return state
    if isinstance(state, Mapping):
        return {"d": [[flatten(k, tensors, where), flatten(v, tensors, f"{where}[{k!r}]")]
                      for k, v in state.items()]}
    if isinstance(state, list | tuple):
        items = [flatten(v, tensors, f"{where}[{i}]") for i, v in enumerate(state)]
        return {"u" if isinstance(state, tuple) else "l": items}
    raise StateFormatError(f"{where} is a {type(state).__name__}: only tensors and plain values "
                           "(numbers, strings, None, lists, tuples, dicts) can be sent")


def unflatten(skeleton: Skeleton, tensors: list[torch.Tensor]) -> Any:
    """The state :func:`flatten` took apart."""
    if not isinstance(skeleton, dict):
        if skeleton is None or isinstance(skeleton, bool | int | float | str):
            return skeleton
        raise StateFormatError(f"a {type(skeleton).__name__} in a state skeleton")
    if len(skeleton) != 1:
        raise StateFormatError(f"a state container with tags {sorted(skeleton)}")
    ((tag, body),) = skeleton.items()
    if tag == "t":
        if not isinstance(body, int) or not 0 <= body < len(tensors):
            raise StateFormatError(f"tensor index {body!r} of {len(tensors)}")
        return tensors[body]
    if not isinstance(body, list):
        raise StateFormatError(f"container {tag!r} holds a {type(body).__name__}")
    if tag == "l":
        return [unflatten(v, tensors) for v in body]
    if tag == "u":
        return tuple(unflatten(v, tensors) for v in body)
    if tag == "d":
        if not all(isinstance(kv, list) and len(kv) == 2 for kv in body):
            raise StateFormatError("a dict entry that is not a [key, value] pair")
        return {unflatten(k, tensors): unflatten(v, tensors) for k, v in body}
    raise StateFormatError(f"unknown state container tag {tag!r}")


def describe(t: torch.Tensor) -> list[Any]:
    """``[dtype name, shape]`` of a tensor to send."""
    if t.dtype not in WIRE_DTYPES and t.dtype not in WIDENED and t.dtype not in COMPLEX:
        raise StateFormatError(f"a {t.dtype} tensor cannot be sent")
    return [str(t.dtype).removeprefix("torch."), list(t.shape)]


def on_wire(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor of a wire dtype holding ``t``."""
    t = t.detach().to("cpu")
    if t.dtype in WIDENED:
        t = t.to(WIDENED[t.dtype])
    elif t.dtype in COMPLEX:
        t = torch.view_as_real(t)
    return t.contiguous()


def receiving(desc: Any) -> tuple[torch.dtype, torch.Tensor]:
    """The announced dtype of a tensor and the wire tensor to receive it in (checked)."""
    if not (isinstance(desc, list) and len(desc) == 2 and isinstance(desc[0], str)
            and isinstance(desc[1], list) and all(isinstance(s, int) and s >= 0
                                                  for s in desc[1])):
        raise StateFormatError(f"a tensor description {desc!r}")
    dtype = getattr(torch, desc[0], None)
    if not isinstance(dtype, torch.dtype) or not (dtype in WIRE_DTYPES or dtype in WIDENED
                                                  or dtype in COMPLEX):
        raise StateFormatError(f"a tensor of dtype {desc[0]!r}")
    shape = list(desc[1])
    if math.prod(shape) > MAX_ELEMENTS:
        raise StateFormatError(f"a tensor of shape {shape}, more than {MAX_ELEMENTS} elements")
    wire = WIDENED.get(dtype) or COMPLEX.get(dtype) or dtype
    if dtype in COMPLEX:
        shape = [*shape, 2]
    return dtype, torch.empty(shape, dtype=wire)


def from_wire(dtype: torch.dtype, t: torch.Tensor) -> torch.Tensor:
    """The received wire tensor as the announced dtype."""
    if dtype in COMPLEX:
        return torch.view_as_complex(t.contiguous())
    return t.to(dtype) if t.dtype != dtype else t


def encode(state: Any) -> tuple[bytes, list[torch.Tensor]]:
    """``state`` as a JSON description (plain values, tensors by index with dtype and shape)
    and its tensors, ready for the wire (:func:`on_wire`)."""
    tensors: list[torch.Tensor] = []
    skeleton = flatten(state, tensors)
    meta = json.dumps({"skeleton": skeleton, "tensors": [describe(t) for t in tensors]})
    return meta.encode(), [on_wire(t) for t in tensors]


def decode(meta: bytes, fetch: Callable[[int, torch.Tensor], torch.Tensor]) -> Any:
    """The state an :func:`encode` description announces; ``fetch(i, wire)`` fills tensor
    ``i`` into ``wire`` (allocated after its description was checked) and returns it.
    StateFormatError (a ValueError), KeyError or TypeError when it is not well formed."""
    received = json.loads(meta)
    descriptions = received["tensors"]
    if not isinstance(descriptions, list):
        raise StateFormatError("no tensor list")
    values = []
    for i, desc in enumerate(descriptions):
        dtype, wire = receiving(desc)
        values.append(from_wire(dtype, fetch(i, wire)))
    return unflatten(received["skeleton"], values)
