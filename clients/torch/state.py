"""Torch tensors in a state sent between ranks (:mod:`decent.core.training.state`): the wire dtypes,
booleans widened to uint8 and complex tensors as their real view, exactly restored."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from decent.core.training import state as core_state
from decent.core.training.state import StateFormatError

__all__ = ["KIT", "StateFormatError", "TorchStateKit", "decode", "encode"]

#: tensors on the wire as they are
WIRE_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64,
                         torch.int32, torch.int64, torch.uint8, torch.int8, torch.int16})
#: booleans travel as uint8 and are cast back (exactly)
WIDENED = {torch.bool: torch.uint8}
#: complex tensors travel as their real view
COMPLEX = {torch.complex64: torch.float32, torch.complex128: torch.float64}
#: the dtypes a state may announce, by name
NAMED = {str(d).removeprefix("torch."): d for d in (*WIRE_DTYPES, *WIDENED, *COMPLEX)}


class TorchStateKit:
    """Torch tensors in a state (:class:`decent.core.training.state.StateKit`)."""

    def is_tensor(self, value: Any) -> bool:
        """Whether ``value`` is a torch tensor."""
        return isinstance(value, torch.Tensor)

    def describe(self, t: torch.Tensor) -> list[Any]:
        """``[dtype name, shape]`` of a tensor to send."""
        if t.dtype not in WIRE_DTYPES and t.dtype not in WIDENED and t.dtype not in COMPLEX:
            raise StateFormatError(f"a {t.dtype} tensor cannot be sent")
        return [str(t.dtype).removeprefix("torch."), list(t.shape)]

    def on_wire(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous CPU tensor of a wire dtype holding ``t``."""
        t = t.detach().to("cpu")
        if t.dtype in WIDENED:
            t = t.to(WIDENED[t.dtype])
        elif t.dtype in COMPLEX:
            t = torch.view_as_real(t)
        return t.contiguous()

    def receiving(self, desc: Any) -> tuple[torch.dtype, torch.Tensor]:
        """The announced dtype of a tensor and the wire tensor to receive it in (checked)."""
        name, shape = core_state.checked_description(desc, NAMED)
        dtype = NAMED[name]
        wire = WIDENED.get(dtype) or COMPLEX.get(dtype) or dtype
        if dtype in COMPLEX:
            shape = [*shape, 2]
        return dtype, torch.empty(shape, dtype=wire)

    def from_wire(self, dtype: torch.dtype, t: torch.Tensor) -> torch.Tensor:
        """The received wire tensor as the announced dtype."""
        if dtype in COMPLEX:
            return torch.view_as_complex(t.contiguous())
        return t.to(dtype) if t.dtype != dtype else t

    def copied(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t``."""
        return t.clone()


#: the kit of torch tensors
KIT = TorchStateKit()


def encode(state: Any) -> tuple[bytes, list[torch.Tensor]]:
    """``state`` as a JSON description and its torch tensors, ready for the wire."""
    return core_state.encode(state, KIT)


def decode(meta: bytes, fetch: Callable[[int, torch.Tensor], torch.Tensor]) -> Any:
    """The state an :func:`encode` description announces
    (:func:`decent.core.training.state.decode`)."""
    return core_state.decode(meta, fetch, KIT)
