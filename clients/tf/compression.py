"""Horovod's gradient compressors for TensorFlow tensors."""

from __future__ import annotations

from typing import Any

import tensorflow as tf


class NoneCompressor:
    """No compression (Horovod's ``Compression.none``)."""

    is_none = True

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        """The tensor as it is."""
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, context: Any) -> Any:
        """The tensor as it is."""
        return tensor


class FP16Compressor:
    """Floating-point tensors travel as float16 and come back in their dtype."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        """A float16 copy of a floating-point tensor, and its dtype."""
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, context: Any) -> Any:
        """The tensor in the dtype it had."""
        return tf.cast(tensor, context) if context is not None else tensor


class Compression:
    """Horovod's gradient compressors."""

    none = NoneCompressor()
    fp16 = FP16Compressor()
