"""Gradient compression on the worker side (Horovod's ``Compression``): a tensor is compressed
before it is reduced and decompressed after. Adapters add framework compressors (``fp16``)."""

from __future__ import annotations

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
