"""Moves torch tensors in and out of the shared-memory arena.

CPU tensors are copied straight into the arena. CUDA tensors are staged through it
(:mod:`decent.torch.cuda`): the arena is registered as pinned host memory once; a tensor is
copied out on a side stream ordered after its producer's stream by an event (in chunks for a
large one, which the daemon sends as they land), and a result comes back on the side stream
with the caller's stream ordered on it; its slot is freed once that copy is done. Nothing
waits for the whole device or a whole stream.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import threading
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from decent.core.memory.arena import ClientArena
from decent.core.memory.regions import SharedStorage
from decent.torch.cuda import DevicePool, Releases, Staging
from decent_wire.v1 import decent_pb2 as pb

_TO_WIRE = {
    torch.float16: pb.FLOAT16,
    torch.bfloat16: pb.BFLOAT16,
    torch.float32: pb.FLOAT32,
    torch.float64: pb.FLOAT64,
    torch.int32: pb.INT32,
    torch.int64: pb.INT64,
    torch.uint8: pb.UINT8,
    torch.int8: pb.INT8,
    torch.int16: pb.INT16,
}
_FROM_WIRE = {v: k for k, v in _TO_WIRE.items()}


def _address(buf: memoryview) -> int:
    return int(np.frombuffer(buf, np.uint8).ctypes.data)


def _plain(t: torch.Tensor) -> bool:
    """A contiguous CPU tensor: its bytes can be moved with one memmove (faster than a
    single-threaded torch copy, and it releases the GIL)."""
    return t.device.type == "cpu" and t.is_contiguous()


def _host_view(buf: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)


class TorchCodec:
    """The torch side of the arena hand-off."""

    framework = "torch"

    def __init__(self) -> None:
        self._registered: int | None = None  #: the arena's address while it is pinned
        #: the CUDA side of the hand-off (made at attach when CUDA is present)
        self._staging: Staging | None = None
        self._releases: Releases | None = None
        self._pool: DevicePool | None = None
        #: the copy the last read on this thread issued (its slot is freed after it)
        self._last = threading.local()

    def describe(self, tensor: torch.Tensor) -> tuple[int, tuple[int, ...]]:
        """Wire dtype and shape of ``tensor``."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        try:
            return _TO_WIRE[tensor.dtype], tuple(tensor.shape)
        except KeyError:
            names = ", ".join(str(d).replace("torch.", "") for d in _TO_WIRE)
            raise TypeError(f"dtype {tensor.dtype} is not supported (use one of {names})") from None

    def check_call(self) -> None:
        """Every call is allowed."""

    def attach(self, arena: ClientArena) -> None:
        """Pin the arena for asynchronous GPU copies when CUDA is present."""
        if not torch.cuda.is_available():
            return
        self._staging, self._releases, self._pool = Staging(), Releases(), DevicePool()
        base = np.frombuffer(arena.buf, np.uint8)
        ptr = base.ctypes.data_as(ctypes.c_void_p).value
        # unregistered before the arena is unmapped (close): a registration left behind would
        # send later copies to its old pages when another arena is mapped at the same address
        with contextlib.suppress(Exception):
            if int(torch.cuda.cudart().cudaHostRegister(ptr, arena.nbytes, 0)) == 0:
                self._registered = ptr

    def stager(self, tensor: torch.Tensor) -> Callable[[memoryview], Iterator[int]] | None:
        """A CUDA tensor staged into a slot in chunks (each chunk's bytes yielded once its
        event fired); None for a host tensor."""
        staging = self._staging
        if staging is None or not tensor.is_cuda:
            return None
        src = tensor.detach()

        def stage(dst: memoryview) -> Iterator[int]:
            for event, done in staging.to_host(src, torch.frombuffer(dst, dtype=torch.uint8)):
                event.synchronize()  # this chunk's copy only
                yield done
        return stage

    def release_after_read(self, release: Callable[[], None]) -> None:
        """Free the slot the last read on this thread copied to a device once that copy is
        done (at once when it copied nothing to a device)."""
        event = getattr(self._last, "event", None)
        self._last.event = None
        if event is None or self._releases is None:
            release()
        else:
            self._releases.after(event, release)

    def close(self) -> None:
        """Wait for the copies still running, free what they read, and unpin the arena (before
        the client unmaps it)."""
        if self._releases is not None:
            self._releases.close()
        if self._registered is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = None

    def write(self, tensor: torch.Tensor, dst: memoryview) -> None:
        """Copy ``tensor`` into ``dst`` (a device tensor on the side stream, waiting for that
        copy's event only)."""
        src = tensor.detach()
        if _plain(src) and len(dst):
            ctypes.memmove(_address(dst), src.data_ptr(), len(dst))
            return
        if src.is_cuda and self._staging is not None:
            host = torch.frombuffer(dst, dtype=torch.uint8) if len(dst) else None
            if host is not None:  # one chunk: its event, not the device, is waited for
                self._staging.to_host(src, host, chunk=len(dst))[-1][0].synchronize()
            return
        host = _host_view(dst, tensor.dtype, tuple(tensor.shape))
        host.copy_(src)

    def read(self, src: memoryview, dtype: int, shape: tuple[int, ...],
             like: torch.Tensor | None) -> torch.Tensor:
        """A new tensor with the result, on ``like``'s device."""
        host = _host_view(src, _FROM_WIRE[dtype], shape)
        if like is not None and like.is_cuda and self._staging is not None \
                and self._pool is not None:
            out = self._pool.take(shape, host.dtype, like.device)
            if host.numel():
                self._last.event = self._staging.to_device(host, out)
            return out
        out = torch.empty(shape, dtype=host.dtype)
        if len(src):
            ctypes.memmove(out.data_ptr(), _address(src), len(src))
        return out

    def read_into(self, src: memoryview, into: torch.Tensor) -> torch.Tensor:
        """Copy the result into ``into`` (same dtype and shape) and return it."""
        if _plain(into) and len(src):
            ctypes.memmove(into.data_ptr(), _address(src), len(src))
            return into
        host = _host_view(src, into.dtype, tuple(into.shape))
        with torch.no_grad():
            if into.is_cuda and self._staging is not None:
                if host.numel():
                    self._last.event = self._staging.to_device(host, into)
            else:
                into.copy_(host)
        return into

    def host_bytes(self, tensor: torch.Tensor) -> np.ndarray | None:
        """A contiguous CPU tensor's bytes (a view over its storage)."""
        src = tensor.detach()
        if not _plain(src) or not src.numel():
            return None
        nbytes = src.numel() * src.element_size()
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(src.data_ptr()))

    def address(self, tensor: torch.Tensor) -> int | None:
        """Host address of a contiguous CPU tensor's bytes (None otherwise)."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            return None
        return int(tensor.data_ptr())

    def wrap(self, owner: np.ndarray, dtype: int, shape: tuple[int, ...],
             like: torch.Tensor | None = None) -> torch.Tensor:
        """A tensor over ``owner``'s bytes (torch keeps ``owner`` alive as long as the storage)."""
        if math.prod(shape) == 0:
            return torch.empty(shape, dtype=_FROM_WIRE[dtype])
        return torch.frombuffer(owner, dtype=_FROM_WIRE[dtype]).view(shape)

    def result(self, owner: np.ndarray, dtype: int, shape: tuple[int, ...],
               like: torch.Tensor | None) -> torch.Tensor | None:
        """A tensor over ``owner`` for a host input (a CUDA input's result is copied to its
        device)."""
        if like is not None and like.device.type != "cpu":
            return None
        return self.wrap(owner, dtype, shape)

    def take(self, owner: np.ndarray, into: torch.Tensor) -> torch.Tensor | None:
        """None: a torch tensor takes its result by copy (into its own storage)."""
        return None

    def shared_storage(self, tensor: torch.Tensor) -> SharedStorage | None:
        """A contiguous CPU tensor's storage if it is in torch's fd-backed shared memory
        (``share_memory_()`` with the default file_descriptor strategy); None for private or
        file_system-shared storages, which are never moved."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            return None
        st = tensor.untyped_storage()
        if st.nbytes() == 0 or not st.is_shared():
            return None
        try:
            fd = int(st._get_shared_fd())  # type: ignore[attr-defined]
        except RuntimeError:
            return None
        # torch's fd strategy keeps an unlinked /dev/shm file open; anything else (a file mapped
        # by from_file, maybe privately) is not memory the daemon may map and write
        try:
            target = os.readlink(f"/proc/self/fd/{fd}") if fd >= 0 else ""
        except OSError:
            return None
        if not target.startswith("/dev/shm/"):
            return None
        ref = StorageWeakRef(st)
        return SharedStorage(int(st.data_ptr()), int(st.nbytes()), lambda: not ref.expired(), fd)
