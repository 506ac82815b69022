"""Registering a worker's shared-memory tensors with the daemon (see
:mod:`decent.core.memory.regions`).

An in-place op on a tensor of 64 KiB or more that already lives in fd-backed shared memory hands
the storage's file descriptor to the daemon once; from then on requests address it by offset and
nothing is copied. Private memory is never moved: it is copied through the arena as before.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

from decent.core.memory.codec import TensorCodec
from decent.core.memory.regions import Region, RegionTable
from decent_wire.errors import DecentError
from decent_wire.v1 import decent_pb2 as pb

#: in-place ops register shared-memory tensors this large instead of copying them
REGISTER_MIN_BYTES = 64 << 10

log = logging.getLogger("decent")


class MemoryChannel(Protocol):
    """Where memory requests go (the daemon's memory socket)."""

    def memory_call(self, req: pb.MemoryRequest, fd: int | None) -> list[int]:
        """Send ``req`` with ``fd`` and raise the daemon's error, if any; the descriptors that
        came back (none for registrations)."""


class Registrar:
    """The worker's registered memory and its bookkeeping with the daemon. Thread-safe."""

    def __init__(self, codec: TensorCodec[Any], channel: MemoryChannel, worker_id: str,
                 enabled: bool) -> None:
        self._codec = codec
        self._channel = channel
        self._worker_id = worker_id
        self.enabled = enabled
        self.regions = RegionTable()
        self._lock = threading.Lock()

    def offset(self, tensor: Any, at: int, nbytes: int) -> int | None:
        """The daemon offset of an in-place op's tensor if its memory is registered, registering
        it now if it lives in shared memory; None: copy it through the arena."""
        offset = self.regions.offset_of(at, nbytes)
        if offset is not None or not self.enabled or nbytes < REGISTER_MIN_BYTES:
            return offset
        # private memory is copied: moving it would strand its other aliases (numpy views)
        found = self._codec.shared_storage(tensor)
        if found is None:
            return None
        with self._lock:
            offset = self.regions.offset_of(at, nbytes)  # another thread may have just done it
            if offset is not None:
                return offset
            address, size, alive, fd = found
            if self.regions.refused(address) or not self._register(address, size, alive, fd):
                return None
            return self.regions.offset_of(at, nbytes)

    def spill(self, address: int, size: int, alive: Any, fd: int) -> int | None:
        """Hand the daemon memory of a request that found the arena full
        (:mod:`decent.core.memory.spill`); its base, or None when the daemon cannot map it."""
        if not self.enabled:
            return None
        with self._lock:
            if not self._register(address, size, alive, fd, spill=True):
                return None
            return self.regions.offset_of(address, size)

    def _register(self, address: int, size: int, alive: Any, fd: int,
                  spill: bool = False) -> bool:
        """Hand one storage to the daemon; whether it was mapped."""
        base = self.regions.reserve(size)
        released = self.regions.sweep()
        try:
            self._channel.memory_call(pb.MemoryRequest(worker_id=self._worker_id, base=base,
                                                       nbytes=size, release=released,
                                                       spill=spill), fd)
        except DecentError as exc:
            # the daemon may have mapped it before the answer was lost: release it too (an
            # unknown base is a no-op there)
            self.regions.requeue([*released, base])
            if exc.code == pb.RESOURCE_EXHAUSTED:  # a bound: this storage is copied
                self.regions.refuse(address, alive)
            else:
                self.enabled = False
                log.warning("in-place ops go on copying tensors through the arena: the daemon "
                            "cannot map this worker's shared memory (%s)", exc)
            return False
        self.regions.add(Region(address, size, base, alive))
        return True

    def release_dead(self) -> None:
        """Tell the daemon to unmap registered memory whose tensors are all gone."""
        released = self.regions.sweep()
        if released:
            try:
                self._channel.memory_call(pb.MemoryRequest(worker_id=self._worker_id,
                                                           release=released), None)
            except DecentError:
                self.regions.requeue(released)
