"""TensorFlow tensors in a state sent between ranks (:mod:`decent.core.training.state`): the wire
dtypes as they are, booleans widened to uint8 and cast back exactly."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from decent.core.training import state as core_state

#: tensors on the wire as they are
WIRE_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64, tf.uint8,
               tf.int8, tf.int16)
#: the dtypes a state may announce, by name
NAMED = {d.name: d for d in (*WIRE_DTYPES, tf.bool)}


class TFStateKit:
    """TensorFlow tensors in a state (:class:`decent.core.training.state.StateKit`); a variable
    travels as its value."""

    def is_tensor(self, value: Any) -> bool:
        """Whether ``value`` is a tensor or a variable."""
        return isinstance(value, tf.Tensor | tf.Variable)

    def describe(self, t: Any) -> list[Any]:
        """``[dtype name, shape]`` of a tensor to send."""
        dtype = t.dtype.base_dtype
        if dtype.name not in NAMED:
            raise core_state.StateFormatError(f"a {dtype.name} tensor cannot be sent")
        return [dtype.name, [int(d) for d in t.shape]]

    def on_wire(self, t: Any) -> tf.Tensor:
        """The value of ``t`` in a wire dtype."""
        value = tf.convert_to_tensor(t)
        return tf.cast(value, tf.uint8) if value.dtype == tf.bool else value

    def receiving(self, desc: Any) -> tuple[tf.DType, tf.Tensor]:
        """The announced dtype of a tensor and the wire tensor to receive it in (checked)."""
        name, shape = core_state.checked_description(desc, NAMED)
        dtype = NAMED[name]
        return dtype, tf.zeros(shape, dtype=tf.uint8 if dtype == tf.bool else dtype)

    def from_wire(self, dtype: tf.DType, t: tf.Tensor) -> tf.Tensor:
        """The received wire tensor as the announced dtype."""
        return tf.cast(t, dtype) if t.dtype != dtype else t

    def copied(self, t: tf.Tensor) -> tf.Tensor:
        """``t`` itself: a TensorFlow tensor never changes."""
        return t


#: the kit of TensorFlow tensors
KIT = TFStateKit()
