"""Out-of-place results as tensors over the memory the daemon wrote them into: nothing is copied
out, and a fresh model-sized allocation (with its first-touch page faults) is not made per call.

The slot (an arena slot, or a request's memory of its own when the arena was full) belongs to
the result from then on and is freed when the last tensor using it is garbage-collected. Results
the framework cannot wrap (a CUDA input's result goes back to its device; TensorFlow tensors) are
copied out, and counted.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

import numpy as np

from decent.core.memory.arena import ClientArena
from decent.core.memory.spill import SpillMemory
from decent_wire.v1 import decent_pb2 as pb

T = TypeVar("T")


class ResultMemory(Generic[T]):
    """The results of one client that hold memory. Thread-safe."""

    def __init__(self, arena: ClientArena, spill: SpillMemory,
                 free_arena: Callable[[int, int], None]) -> None:
        self._arena = arena
        self._spill = spill
        self._free_arena = free_arena
        self._lock = threading.Lock()
        self._held = 0
        self._live = 0
        #: results copied out instead (devices, frameworks that cannot wrap memory)
        self.copied = 0
        #: in-place results that were their input unchanged (nothing copied back)
        self.unchanged = 0
        #: bytes of in-place results copied out (or combined) before their op ended
        self.drained_early = 0
        #: in-place results the worker combined itself (:mod:`decent.core.requests.combine`)
        self.combined = 0

    def adopt(self, slot: tuple[int, int], nbytes: int, make: Callable[[np.ndarray], T | None]
              ) -> T | None:
        """The result in ``slot`` (offset, size) as what ``make`` builds over the slot's first
        ``nbytes`` (a tensor that owns the slot), or None (``make`` gave None: the framework
        copies this one, and the slot stays the request's)."""
        offset, size = slot
        spilled = self._spill.owns(offset)
        memory = self._spill.segment_view(offset) if spilled else self._arena.buf
        owner = np.frombuffer(memory, np.uint8, count=nbytes, offset=0 if spilled else offset)
        result = make(owner)
        if result is None:
            return None
        segment = self._spill.detach(offset) if spilled else None
        release: Callable[[], None] = segment.close if segment is not None else \
            functools.partial(self._free_arena, offset, size)
        with self._lock:
            self._held += size
            self._live += 1
        weakref.finalize(owner, self._released, release, size)
        return result

    def _released(self, release: Callable[[], None], size: int) -> None:
        with self._lock:
            self._held -= size
            self._live -= 1
        release()

    def reported(self, reply: pb.StatusReply) -> pb.StatusReply:
        """``reply`` (the daemon's status) with this worker's results filled in."""
        reply.worker_results_held, reply.worker_results_held_bytes = self.held
        reply.worker_results_copied = self.copied
        reply.worker_results_unchanged = self.unchanged
        reply.worker_results_drained_early_bytes = self.drained_early
        reply.worker_results_combined = self.combined
        return reply

    @property
    def held(self) -> tuple[int, int]:
        """(results alive that hold memory, their bytes)."""
        with self._lock:
            return self._live, self._held
