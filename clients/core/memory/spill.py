"""Memory beyond the arena for requests that find it full.

A request whose arena has no room right now does not wait for other requests to finish (ranks
may submit in any order, and each rank's waiting request may be what the other rank's earlier
one waits for): its tensor goes to a shared-memory segment of its own, which the daemon maps for
it like a registered tensor (``MemoryRequest.spill``) and unmaps once its result is read. The
daemon counts these in ``StatusReply.arena_spills``. Only when the daemon cannot map more does
a request wait for arena room.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading

import numpy as np

from decent.core.memory.regions import FIRST_BASE
from decent.core.memory.registrar import Registrar


class Segment:
    """One request's memory: an anonymous shared-memory file, mapped here."""

    def __init__(self, nbytes: int) -> None:
        self.fd = os.memfd_create("decent-spill", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, nbytes)
            self.map = mmap.mmap(self.fd, nbytes, flags=mmap.MAP_SHARED,
                                 prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.nbytes = nbytes
        self.view = memoryview(self.map)
        self.address = int(np.frombuffer(self.view, np.uint8).ctypes.data)
        self.registered = True

    def alive(self) -> bool:
        """False once the daemon need not map it any more."""
        return self.registered

    def close(self) -> None:
        """Unmap and close (the daemon's mapping, if any, stays until it releases it)."""
        self.registered = False
        os.close(self.fd)
        view, self.view = self.view, memoryview(b"")
        with contextlib.suppress(BufferError):  # a view still in use: unmapped once it goes
            view.release()
            self.map.close()


class SpillMemory:
    """The segments of one client's requests that found the arena full. Thread-safe."""

    def __init__(self, registrar: Registrar) -> None:
        self._registrar = registrar
        self._segments: dict[int, Segment] = {}  # daemon offset -> segment
        self._lock = threading.Lock()

    @staticmethod
    def owns(offset: int) -> bool:
        """Whether ``offset`` is a registered region's, not the arena's."""
        return offset >= FIRST_BASE

    def take(self, nbytes: int) -> int | None:
        """The daemon offset of a fresh segment of ``nbytes`` it has mapped, or None (it
        cannot map more, or registering is off)."""
        if not self._registrar.enabled:
            return None
        segment = Segment(max(nbytes, 1))
        base = self._registrar.spill(segment.address, segment.nbytes, segment.alive, segment.fd)
        if base is None:
            segment.close()
            return None
        with self._lock:
            self._segments[base] = segment
        return base

    def segment_view(self, offset: int) -> memoryview:
        """All of the segment at ``offset``."""
        with self._lock:
            return self._segments[offset].view

    def view(self, offset: int, nbytes: int) -> memoryview:
        """Bytes ``[0, nbytes)`` of the segment at ``offset``."""
        return self.segment_view(offset)[:nbytes]

    def free(self, offset: int) -> None:
        """The request let go of its segment: unmapped here, and released at the daemon."""
        segment = self.detach(offset)
        if segment is not None:
            segment.close()

    def detach(self, offset: int) -> Segment | None:
        """The segment at ``offset``, released at the daemon (its request is over) but still
        mapped here: its result lives on in it, and whoever holds it closes it."""
        with self._lock:
            segment = self._segments.pop(offset, None)
        if segment is not None:
            segment.registered = False
            self._registrar.release_dead()
        return segment

    def close(self) -> None:
        """Unmap every segment (the client closes)."""
        with self._lock:
            segments, self._segments = list(self._segments.values()), {}
        for segment in segments:
            segment.close()
