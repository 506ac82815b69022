"""Moves TensorFlow tensors and variables in and out of the shared-memory arena.

TensorFlow tensors are immutable, so TensorFlow memory is never handed to the daemon: a request
copies the tensor's value into its arena slot (read through DLPack; GPU and bfloat16 tensors
through ``.numpy()``). A result is a tensor over the memory the daemon wrote it into (DLPack,
no copy); an in-place op assigns it to its ``tf.Variable``, which then holds that memory.
Results TensorFlow cannot take so (GPU, bfloat16, misaligned) are copied.

Numpy arrays go through as :class:`decent.core.memory.numpy_codec.NumpyCodec` moves them (their
results are numpy arrays): the Keras optimizer runs the algorithms over host buffers it keeps
(:mod:`decent.tf.host`).
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import numpy as np
import tensorflow as tf

from decent.core.memory.arena import ClientArena
from decent.core.memory.codec import HostCodec
from decent.core.memory.numpy_codec import NumpyCodec
from decent.core.memory.regions import SharedStorage
from decent_wire.v1 import decent_pb2 as pb

_TO_WIRE = {
    tf.float16: pb.FLOAT16,
    tf.bfloat16: pb.BFLOAT16,
    tf.float32: pb.FLOAT32,
    tf.float64: pb.FLOAT64,
    tf.int32: pb.INT32,
    tf.int64: pb.INT64,
    tf.uint8: pb.UINT8,
    tf.int8: pb.INT8,
    tf.int16: pb.INT16,
}
_FROM_WIRE = {v: k for k, v in _TO_WIRE.items()}

#: the alignment TensorFlow's CPU kernels require of a tensor's memory (EIGEN_MAX_ALIGN_BYTES)
ALIGNMENT = 64

#: a tensor or a variable (or a numpy array): what the TensorFlow client takes
TFTensor = Any

#: how numpy arrays given to the TensorFlow client move
_NUMPY = NumpyCodec()


def unwrap(tensor: TFTensor) -> TFTensor:
    """The ``tf.Variable`` inside a Keras variable; anything else as it is."""
    inner = getattr(tensor, "value", None)
    return inner if isinstance(inner, tf.Variable) else tensor


class _Exported:
    """A host tensor as numpy sees a DLPack producer (``numpy.from_dlpack``)."""

    def __init__(self, tensor: tf.Tensor) -> None:
        self.tensor = tensor

    def __dlpack__(self, **_: Any) -> Any:
        return tf.experimental.dlpack.to_dlpack(self.tensor)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU


def _value(tensor: TFTensor) -> tf.Tensor:
    """The tensor itself, or a variable's value."""
    tensor = unwrap(tensor)
    return tensor.read_value() if isinstance(tensor, tf.Variable) else tensor


def host_view(value: tf.Tensor) -> np.ndarray | None:
    """A view of a CPU tensor's memory through DLPack (``.numpy()`` would copy it); None for a
    GPU tensor, a bfloat16 one (numpy has no DLPack import for it) or an empty one."""
    if "GPU" in value.device.upper() or value.dtype == tf.bfloat16 or \
            not value.shape.num_elements():
        return None
    return np.from_dlpack(_Exported(value))


def _host(tensor: TFTensor) -> np.ndarray:
    """The tensor's values on the host: a view where there is one (:func:`host_view`), else a
    copy."""
    value = _value(tensor)
    view = host_view(value)
    return view if view is not None else np.ascontiguousarray(value.numpy())


def tensor_over(src: memoryview, dtype: tf.DType, shape: tuple[int, ...],
                 like: TFTensor) -> tf.Tensor | None:
    """A tensor over ``src`` through DLPack (valid while ``src`` is), or None where TensorFlow
    cannot take it: a GPU destination, bfloat16 (no numpy DLPack export), no elements, or
    memory not aligned as TensorFlow's kernels require (it aborts the process)."""
    if dtype == tf.bfloat16 or not math.prod(shape) or \
            "GPU" in (getattr(like, "device", "") or "").upper():
        return None
    typed = np.frombuffer(src, dtype.as_numpy_dtype).reshape(shape)
    if typed.ctypes.data % ALIGNMENT:
        return None
    return tf.experimental.dlpack.from_dlpack(typed.__dlpack__())


class TFCodec(HostCodec):
    """The TensorFlow side of the arena hand-off."""

    framework = "tf"

    def __init__(self) -> None:
        #: variables given a result's buffer in the arena (:meth:`take`): each takes a copy
        #: of its value when the client closes (:meth:`close`)
        self._aliased: weakref.WeakValueDictionary[int, tf.Variable] = (
            weakref.WeakValueDictionary())  # by id: a variable is not hashable

    def describe(self, tensor: TFTensor) -> tuple[int, tuple[int, ...]]:
        """Wire dtype and shape of ``tensor`` (an eager tensor, a variable or a numpy
        array)."""
        if isinstance(tensor, np.ndarray):
            return _NUMPY.describe(tensor)
        tensor = unwrap(tensor)
        if not isinstance(tensor, (tf.Tensor, tf.Variable)):
            raise TypeError(f"expected a tf.Tensor or tf.Variable, got {type(tensor).__name__}")
        dtype = tensor.dtype.base_dtype
        if dtype not in _TO_WIRE:
            names = ", ".join(d.name for d in _TO_WIRE)
            raise TypeError(f"dtype {dtype.name} is not supported (use one of {names})")
        if not tensor.shape.is_fully_defined():
            raise TypeError(f"shape {tensor.shape} is not fully known")
        return _TO_WIRE[dtype], tuple(int(d) for d in tensor.shape)

    def write(self, tensor: TFTensor, dst: memoryview) -> None:
        """Copy the tensor's value into ``dst``."""
        if isinstance(tensor, np.ndarray):
            _NUMPY.write(tensor, dst)
        elif len(dst):
            np.frombuffer(dst, np.uint8)[...] = _host(tensor).reshape(-1).view(np.uint8)

    def read(self, src: memoryview, dtype: int, shape: tuple[int, ...],
             like: TFTensor | None) -> tf.Tensor:
        """A new tensor with the result, on ``like``'s device (a numpy array for one)."""
        if isinstance(like, np.ndarray):
            return _NUMPY.read(src, dtype, shape, like)
        tf_dtype = _FROM_WIRE[dtype]
        if math.prod(shape) == 0:
            return tf.zeros(shape, dtype=tf_dtype)
        host = np.frombuffer(src, tf_dtype.as_numpy_dtype).reshape(shape).copy()
        device = getattr(like, "device", "") or ""
        with tf.device(device or None):
            return tf.identity(tf.convert_to_tensor(host, dtype=tf_dtype))

    def read_into(self, src: memoryview, into: TFTensor) -> TFTensor:
        """Assign a copy of the result to ``into`` (a ``tf.Variable``) and return it (for the
        results :meth:`take` cannot hand over as they lie); a numpy array takes a copy."""
        if isinstance(into, np.ndarray):
            return _NUMPY.read_into(src, into)
        dtype, shape = self.describe(into)
        value = self.read(src, dtype, shape, into)
        if isinstance(unwrap(into), tf.Variable):
            into.assign(value)
            return into
        return value  # a plain tensor cannot change: the result is a new one

    def host_bytes(self, tensor: TFTensor) -> np.ndarray | None:
        """A CPU tensor's bytes through DLPack (None for GPU and bfloat16 tensors)."""
        if isinstance(tensor, np.ndarray):
            return _NUMPY.host_bytes(tensor)
        view = host_view(_value(tensor))
        return None if view is None else view.reshape(-1).view(np.uint8)

    def address(self, tensor: TFTensor) -> int | None:
        """None: TensorFlow does not expose its buffers, so nothing is handed over in place
        (a numpy array's address: its in-place result is copied out as it arrives)."""
        return _NUMPY.address(tensor) if isinstance(tensor, np.ndarray) else None

    def wrap(self, owner: np.ndarray, dtype: int, shape: tuple[int, ...],
             like: TFTensor | None = None) -> TFTensor:
        """A numpy array over ``owner`` for a numpy ``like``; not available for TensorFlow
        tensors: they cannot live in memory the daemon writes."""
        if isinstance(like, np.ndarray):
            return _NUMPY.wrap(owner, dtype, shape)
        raise TypeError("client.shared() is not available for TensorFlow tensors (they are "
                        "immutable; numpy arrays work); use in-place ops on a tf.Variable "
                        "instead")

    def result(self, owner: np.ndarray, dtype: int, shape: tuple[int, ...],
               like: TFTensor | None) -> tf.Tensor | None:
        """A host result as a tensor over ``owner`` through DLPack (no copy: the daemon is
        done writing it, and TensorFlow never writes a tensor); the results
        :func:`tensor_over` refuses are copied. A numpy array's result is an array over
        ``owner``."""
        if isinstance(like, np.ndarray):
            return _NUMPY.result(owner, dtype, shape, like)
        # a view through a memoryview keeps ``owner`` itself alive (numpy would skip it)
        return tensor_over(owner.data, _FROM_WIRE[dtype], shape, like)

    def take(self, owner: np.ndarray, into: TFTensor) -> TFTensor | None:
        """The result as a tensor over ``owner`` (:meth:`result`), assigned to ``into`` when it
        is a ``tf.Variable``: an assign takes the buffer it is given, so the variable holds that
        memory until its next assign, and nothing is copied; for a plain tensor, which cannot
        change, the result itself. None where :meth:`result` copies, and for a numpy array
        (it takes a copy)."""
        if isinstance(into, np.ndarray):
            return None
        dtype, shape = self.describe(into)
        value = self.result(owner, dtype, shape, into)
        if value is None or not isinstance(unwrap(into), tf.Variable):
            return value
        into.assign(value)
        variable = unwrap(into)
        self._aliased[id(variable)] = variable
        return into

    def close(self) -> None:
        """The client closes: every variable still holding a result's buffer in the arena
        takes a copy of its value, so that the arena is unmapped (it stays mapped while
        anything views it, and a model's variables, or what Keras keeps of a compiled step,
        outlive the client: before, each closed client kept its whole arena)."""
        for variable in list(self._aliased.values()):
            variable.assign(np.array(variable.numpy()))
        self._aliased.clear()

    def check_call(self) -> None:
        """RuntimeError inside a ``tf.function``: an op called there would return a handle,
        which a graph cannot hold (the blocking ops are staged before they get here)."""
        if not tf.executing_eagerly():
            raise RuntimeError("decent.tf: asynchronous ops return handles, which a tf.function "
                               "cannot hold; inside tf.function use the blocking ops "
                               "(neighbor_allreduce, allreduce, ...) or start them eagerly")

    def attach(self, arena: ClientArena) -> None:
        """Nothing to pin."""

    def shared_storage(self, tensor: TFTensor) -> SharedStorage | None:
        """None: TensorFlow memory is never registered with the daemon."""
        return None
