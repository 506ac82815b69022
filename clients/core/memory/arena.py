"""The worker's side of the shared-memory arena: attach once, allocate slots for requests."""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import threading
import time
from collections.abc import Callable

import numpy as np

from decent_wire.errors import DecentError
from decent_wire.v1 import decent_pb2 as pb

ALIGN = 64


class ClientArena:
    """A mapped arena plus a first-fit allocator; ``alloc`` blocks while the arena is full."""

    def __init__(self, fd: int, nbytes: int) -> None:
        """Map the arena the daemon handed over as ``fd`` (closed here: the mapping keeps it)."""
        try:
            mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._map: mmap.mmap | None = mapping
        self.nbytes = nbytes
        self.buf: memoryview = memoryview(mapping)
        #: the arena's address in this process (to recognize tensors that live in it); its
        #: pages are mapped at their first use, not here
        self.address = int(np.frombuffer(self.buf, np.uint8, 1).ctypes.data)
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, size), sorted by offset
        self._cond = threading.Condition()
        self._waiting = 0  #: allocations waiting for room (under the condition's lock)

    def alloc(
        self,
        nbytes: int,
        what: str,
        reclaim: Callable[[], bool] | None = None,
        timeout: float | None = None,
    ) -> int:
        """Offset of a free slot of ``nbytes``; waits for space (DecentError if it never fits).

        When the arena is full, ``reclaim()`` is asked to free space (it returns whether it freed
        anything) before waiting for in-flight requests to finish.
        """
        size = max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
        if size > self.nbytes:
            raise DecentError(
                pb.ARENA_ERROR,
                f"{what} needs {nbytes} bytes but the shared-memory arena holds {self.nbytes}; "
                "raise memory.arena_bytes in the daemon's config",
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                off = self._take(size)
                if off is not None:
                    return off
                if reclaim is not None and reclaim():
                    continue
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise DecentError(pb.ARENA_ERROR, self._full(what, nbytes, timeout or 0.0))
                self._waiting += 1
                try:
                    self._cond.wait(left)
                finally:
                    self._waiting -= 1

    def try_alloc(self, nbytes: int, reclaim: Callable[[], bool] | None = None) -> int | None:
        """Offset of a free slot of ``nbytes`` now (after ``reclaim()``, as :meth:`alloc`), or
        None: no waiting."""
        size = max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
        with self._cond:
            while True:
                off = self._take(size)
                if off is not None or reclaim is None or not reclaim():
                    return off

    def _take(self, size: int) -> int | None:
        """First fit of ``size`` aligned bytes (lock held)."""
        for i, (off, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (off + size, free - size)
                return off
        return None

    def _full(self, what: str, nbytes: int, waited: float) -> str:
        """Why an allocation gave up (lock held)."""
        held = self.nbytes - sum(free for _, free in self._free)
        return (f"{what}: the worker's shared-memory arena ({self.nbytes} bytes) had no room "
                f"for {nbytes} bytes for {waited:g}s: {held} bytes are held by requests in "
                "flight or unread results. Ops that wait on each other across ranks (submitted "
                "in different orders) cannot all fit: raise memory.arena_bytes, read results "
                "sooner, or wait for earlier ops before submitting more")

    def free(self, offset: int, nbytes: int) -> None:
        """Return a slot, merging it with free neighbors."""
        size = max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
        with self._cond:
            i = bisect.bisect(self._free, (offset, 0))
            start, end = offset, offset + size
            if i < len(self._free) and self._free[i][0] == end:
                end += self._free.pop(i)[1]
            if i > 0 and sum(self._free[i - 1]) == start:
                i -= 1
                start = self._free.pop(i)[0]
            self._free.insert(i, (start, end - start))
            if self._waiting:
                self._cond.notify_all()

    def notify(self) -> None:
        """Wake allocations waiting for space (a result became reclaimable)."""
        with self._cond:
            if self._waiting:
                self._cond.notify_all()

    def view(self, offset: int, nbytes: int) -> memoryview:
        """Bytes ``[offset, offset + nbytes)`` of the arena."""
        return self.buf[offset:offset + nbytes]

    def offset_of(self, address: int, nbytes: int) -> int | None:
        """The arena offset of memory at ``address`` if all ``nbytes`` lie in the arena."""
        offset = address - self.address
        if offset >= 0 and offset + nbytes <= self.nbytes:
            return offset
        return None

    @property
    def free_bytes(self) -> int:
        """Bytes not allocated right now."""
        with self._cond:
            return sum(size for _, size in self._free)

    def close(self) -> None:
        """Unmap (views still held elsewhere keep it mapped until they go, and no longer: the
        mapping is then theirs alone, not this arena's, which may live on in a reference cycle
        of its client until a full garbage collection)."""
        buf, self.buf = self.buf, memoryview(b"")
        mapping, self._map = self._map, None
        with contextlib.suppress(BufferError):  # shared() tensors still use it: mapped till then
            buf.release()
            if mapping is not None:
                mapping.close()
