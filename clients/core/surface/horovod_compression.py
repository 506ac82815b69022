"""Gradient compression on the worker side (Horovod's ``Compression``): a tensor is compressed
before it is reduced and decompressed after. Adapters add framework compressors (``fp16``)."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, Protocol


class Compressor(Protocol):
    """Turns a tensor into what travels, and back."""

    def compress(self, tensor: Any) -> tuple[Any, Any]:
        """(what travels, what :meth:`decompress` needs to undo it)."""

    def decompress(self, tensor: Any, context: Any) -> Any:
        """The tensor :meth:`compress` was given, from what travelled."""


class NoneCompressor:
    """No compression: the tensor travels as it is."""

    def compress(self, tensor: Any) -> tuple[Any, Any]:
        """``tensor`` itself."""
        return tensor, None

    def decompress(self, tensor: Any, context: Any) -> Any:
        """``tensor`` itself."""
        return tensor


class Transform:
    """What Horovod's allreduce does around the reduction: scale, compress; then undo."""

    def __init__(self, compression: Compressor | None, pre: float, post: float,
                 scale: Callable[[Any, float], Any] = operator.mul) -> None:
        self.compression = compression
        self.pre, self.post = float(pre), float(post)
        #: ``scale(tensor, factor)``: the tensor times the factor, in its own dtype
        self.scale = scale

    @property
    def active(self) -> bool:
        """Whether there is anything to do."""
        return self.compression is not None or self.pre != 1.0 or self.post != 1.0

    def before(self, tensor: Any) -> tuple[Any, Any]:
        """What travels, and what undoes the compression."""
        if self.pre != 1.0:
            tensor = self.scale(tensor, self.pre)
        return self.compression.compress(tensor) if self.compression else (tensor, None)

    def after(self, result: Any, context: Any) -> Any:
        """The reduced tensor, decompressed and scaled."""
        if self.compression is not None:
            result = self.compression.decompress(result, context)
        return self.scale(result, self.post) if self.post != 1.0 else result
