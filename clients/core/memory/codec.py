"""What a framework adapter supplies: how its tensors go into and come out of the arena."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import numpy as np

from decent.core.memory.arena import ClientArena
from decent.core.memory.regions import SharedStorage
from decent_wire import dtypes
from decent_wire.v1 import decent_pb2 as pb

T = TypeVar("T")


class TensorCodec(Protocol[T]):
    """How a framework's tensors go into and come out of the arena."""

    framework: str

    def describe(self, tensor: T) -> tuple[int, tuple[int, ...]]:
        """(wire dtype, shape) of ``tensor``; raise TypeError for an unsupported dtype."""

    def write(self, tensor: T, dst: memoryview) -> None:
        """Copy ``tensor``'s bytes into ``dst`` (exactly its size), finished on return."""

    def read(self, src: memoryview, dtype: int, shape: tuple[int, ...], like: T | None) -> T:
        """A new tensor of ``dtype``/``shape`` from ``src``, on ``like``'s device."""

    def read_into(self, src: memoryview, into: T) -> T:
        """Copy ``src`` (``into``'s dtype and shape) into ``into``, finished on return."""

    def host_bytes(self, tensor: T) -> np.ndarray | None:
        """``tensor``'s bytes as a flat uint8 array over its own host memory (no copy; valid
        while ``tensor`` lives and is not changed), or None when getting them needs a copy
        (device tensors, non-contiguous ones, dtypes without a host view)."""

    def address(self, tensor: T) -> int | None:
        """The host address of ``tensor``'s bytes if they are contiguous in host memory."""

    def wrap(self, owner: Any, dtype: int, shape: tuple[int, ...], like: T | None = None) -> T:
        """A tensor over the bytes of buffer ``owner``, keeping ``owner`` alive as long as it
        (of ``like``'s kind, for a codec that takes more than one)."""

    def result(self, owner: Any, dtype: int, shape: tuple[int, ...], like: T | None
               ) -> T | None:
        """The result of an out-of-place op on ``like`` as a tensor over buffer ``owner`` (the
        memory the daemon wrote it into; kept alive as long as the tensor), or None when it
        has to be copied out (a device tensor's result, a dtype the framework cannot wrap)."""

    def take(self, owner: Any, into: T) -> T | None:
        """An in-place op's result, over buffer ``owner``, handed to ``into`` as it lies (no
        copy; ``owner`` kept alive as long as ``into`` uses it), for frameworks whose tensors
        never change; None to have it copied into ``into`` (:meth:`read_into`)."""

    def stager(self, tensor: T) -> Callable[[memoryview], Iterator[int]] | None:
        """For a device tensor: a function that copies it into host memory (a slot of its
        size) chunk by chunk, yielding the bytes there so far, so that the daemon sends the
        first chunks while the rest is staged; None for a tensor in host memory."""

    def release_after_read(self, release: Callable[[], None]) -> None:
        """Run ``release`` (it frees the slot the last read on this thread read from) once
        nothing reads that slot any more: at once for a codec whose reads are done when they
        return; after its copy for one that copies to a device asynchronously."""

    def close(self) -> None:
        """The client closes: finish what still runs (copies a slot waits on)."""

    def attach(self, arena: ClientArena) -> None:
        """Called once the arena is mapped (e.g. to pin it for GPU copies)."""

    def check_call(self) -> None:
        """Raise when an op may not be called now (TensorFlow: a handle inside a
        ``tf.function``); most codecs allow every call."""

    def shared_storage(self, tensor: T) -> SharedStorage | None:
        """The memory block holding a contiguous host ``tensor`` if that block is fd-backed
        shared memory (never moving it there); None otherwise, cheaply for private memory."""


#: the wire dtype of each numpy dtype the wire has (numpy has no bfloat16)
DTYPE_OF = {v: k for k, v in dtypes.STORAGE.items() if k != pb.BFLOAT16}


def tensor_of(codec: TensorCodec[T], values: Any, like: T | None = None) -> T:
    """A tensor of ``codec``'s framework holding ``values`` (a numpy array or a list of
    numbers; on ``like``'s device)."""
    array = np.ascontiguousarray(values)
    dtype = DTYPE_OF.get(array.dtype)
    if dtype is None:
        raise TypeError(f"no wire dtype for numpy {array.dtype}")
    return codec.read(array.view(np.uint8).reshape(-1).data, dtype, array.shape, like)


def values_of(codec: TensorCodec[T], tensor: T) -> np.ndarray:
    """The values of a tensor of ``codec``'s framework, as a numpy array (a copy)."""
    dtype, shape = codec.describe(tensor)
    raw = bytearray(dtypes.nbytes(dtype, shape))
    if raw:
        codec.write(tensor, memoryview(raw))
    return np.frombuffer(raw, dtypes.STORAGE[dtype]).reshape(shape)


class HostCodec:
    """What a codec whose tensors all live in host memory does about staging (nothing): its
    reads are done when they return, and nothing runs after a call."""

    def stager(self, tensor: Any) -> None:
        """None: every tensor of this codec is read from host memory."""
        return None

    @staticmethod
    def release_after_read(release: Callable[[], None]) -> None:
        """Reads are done when they return: release now."""
        release()

    def close(self) -> None:
        """Nothing runs after a call returns."""
