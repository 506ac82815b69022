"""Sending a state dict between ranks as tensors and plain values, never as a pickle
(framework-neutral; each adapter supplies a :class:`StateKit` for its tensors).

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
from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

#: the most elements the receiver allocates for one announced tensor
MAX_ELEMENTS = 1 << 34

Skeleton = Any


class StateFormatError(ValueError):
    """A state dict that cannot travel, or a received one that is not well formed."""


class StateKit(Protocol[T]):
    """What a framework supplies to send its tensors as part of a state."""

    def is_tensor(self, value: Any) -> bool:
        """Whether ``value`` is one of the framework's tensors."""

    def describe(self, t: T) -> list[Any]:
        """``[dtype name, shape]`` of a tensor to send (StateFormatError if it cannot)."""

    def on_wire(self, t: T) -> T:
        """A contiguous host tensor of a wire dtype holding ``t``."""

    def receiving(self, desc: Any) -> tuple[Any, T]:
        """The announced dtype of a tensor and the wire tensor to receive it in (checked:
        :func:`checked_description`)."""

    def from_wire(self, dtype: Any, t: T) -> T:
        """The received wire tensor as the announced dtype."""

    def copied(self, t: T) -> T:
        """A copy of wire tensor ``t`` that later changes to what it came from leave alone."""


def checked_description(desc: Any, dtypes: Collection[str]) -> tuple[str, list[int]]:
    """``(dtype name, shape)`` of a received tensor description; StateFormatError unless the
    dtype is one of ``dtypes`` and the shape is a list of at most :data:`MAX_ELEMENTS`
    elements."""
    if not (isinstance(desc, list) and len(desc) == 2 and isinstance(desc[0], str)
            and isinstance(desc[1], list) and all(isinstance(s, int) and s >= 0
                                                  for s in desc[1])):
        raise StateFormatError(f"a tensor description {desc!r}")
    if desc[0] not in dtypes:
        raise StateFormatError(f"a tensor of dtype {desc[0]!r}")
    shape = list(desc[1])
    if math.prod(shape) > MAX_ELEMENTS:
        raise StateFormatError(f"a tensor of shape {shape}, more than {MAX_ELEMENTS} elements")
    return desc[0], shape


def flatten(state: Any, tensors: list[Any], is_tensor: Callable[[Any], bool],
            where: str = "state") -> Skeleton:
    """``state`` as JSON-ready plain values; its tensors appended to ``tensors``."""
    if is_tensor(state):
        tensors.append(state)
        return {"t": len(tensors) - 1}
    if state is None or isinstance(state, bool | int | float | str):
        return state
    if isinstance(state, Mapping):
        return {"d": [[flatten(k, tensors, is_tensor, where),
                       flatten(v, tensors, is_tensor, f"{where}[{k!r}]")]
                      for k, v in state.items()]}
    if isinstance(state, list | tuple):
        items = [flatten(v, tensors, is_tensor, f"{where}[{i}]") for i, v in enumerate(state)]
        return {"u" if isinstance(state, tuple) else "l": items}
    raise StateFormatError(f"{where} is a {type(state).__name__}: only tensors and plain values "
                           "(numbers, strings, None, lists, tuples, dicts) can be sent")


def unflatten(skeleton: Skeleton, tensors: list[Any]) -> Any:
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


def encode(state: Any, kit: StateKit[T]) -> tuple[bytes, list[T]]:
    """``state`` as a JSON description (plain values, tensors by index with dtype and shape)
    and its tensors, ready for the wire."""
    tensors: list[T] = []
    skeleton = flatten(state, tensors, kit.is_tensor)
    meta = json.dumps({"skeleton": skeleton, "tensors": [kit.describe(t) for t in tensors]})
    return meta.encode(), [kit.on_wire(t) for t in tensors]


def decode(meta: bytes, fetch: Callable[[int, T], T], kit: StateKit[T]) -> Any:
    """The state an :func:`encode` description announces; ``fetch(i, wire)`` fills tensor
    ``i`` into ``wire`` (allocated after its description was checked) and returns it.
    StateFormatError (a ValueError), KeyError or TypeError when it is not well formed."""
    received = json.loads(meta)
    descriptions = received["tensors"]
    if not isinstance(descriptions, list):
        raise StateFormatError("no tensor list")
    values = []
    for i, desc in enumerate(descriptions):
        dtype, wire = kit.receiving(desc)
        values.append(kit.from_wire(dtype, fetch(i, wire)))
    return unflatten(received["skeleton"], values)
