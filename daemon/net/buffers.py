"""Reusable receive buffers: training sends the same sizes every step, so after the first step a
message lands in memory that is already mapped and touched instead of a fresh model-sized one.

After a burst the pool gives memory back: buffers idle for ``idle_seconds`` are freed, oldest
first, until at most ``floor`` idle bytes are left (:meth:`BufferPool.trim`). Blocks of a MiB
or more are anonymous mappings of their own, so freeing one returns its pages to the system at
once instead of leaving them in the allocator's heap."""

from __future__ import annotations

import collections
import mmap
import time
from collections.abc import Callable

import numpy as np

PAGE = 4096
#: blocks this large or larger are mapped on their own (freed, they leave the process)
MAPPED_BLOCK = 1 << 20


def size_class(nbytes: int) -> int:
    """The capacity a request of ``nbytes`` is served from (powers of two up to 1 MiB, then MiB)."""
    if nbytes <= 4096:
        return 4096
    if nbytes <= 1 << 20:
        return 1 << (nbytes - 1).bit_length()
    return -(-nbytes // (1 << 20)) << 20


def new_block(cap: int) -> np.ndarray:
    """A zeroed ``cap``-byte block with its pages faulted in (one pass now, none on the hot
    path); its own mapping when at least :data:`MAPPED_BLOCK`."""
    if cap >= MAPPED_BLOCK:
        block = np.frombuffer(mmap.mmap(-1, cap, flags=mmap.MAP_PRIVATE), np.uint8)
    else:
        block = np.empty(cap, np.uint8)
    block[::PAGE] = 0
    return block


class BufferPool:
    """Free lists of uint8 buffers by size class, holding at most ``limit`` idle bytes, and
    after ``idle_seconds`` without use no more than ``floor``."""

    def __init__(self, limit: int, floor: int | None = None, idle_seconds: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.floor = limit if floor is None else min(floor, limit)
        self.idle_seconds = idle_seconds
        self.idle_bytes = 0
        self.in_use_bytes = 0
        self.peak_in_use = 0
        self.allocated = 0  #: buffers created (not served from a free list)
        self.freed = 0  #: idle buffers given back by trim()
        self._clock = clock
        #: size class -> (block, when it was put back), most recently put last
        self._free: dict[int, collections.deque[tuple[np.ndarray, float]]] = {}
        #: the blocks handed out (by id), so that put() takes back only those, once
        self._lent: set[int] = set()

    def get(self, nbytes: int) -> np.ndarray:
        """A buffer of exactly ``nbytes`` (a view of a pooled block); give it back with put()."""
        cap = size_class(nbytes)
        free = self._free.get(cap)
        if free:
            block, _ = free.pop()
            self.idle_bytes -= cap
        else:
            block = new_block(cap)
            self.allocated += 1
        self._lent.add(id(block))
        self.in_use_bytes += cap
        self.peak_in_use = max(self.peak_in_use, self.in_use_bytes)
        return block[:nbytes]

    def put(self, buf: np.ndarray) -> None:
        """Return a buffer from get(); it is dropped when the idle bytes would pass the limit."""
        block = buf.base if isinstance(buf.base, np.ndarray) else buf  # get() gave a view
        if id(block) not in self._lent:  # not one of ours, or back already: nothing to keep
            return
        self._lent.discard(id(block))
        cap = block.size
        self.in_use_bytes -= cap
        if self.idle_bytes + cap > self.limit:
            return
        self._free.setdefault(cap, collections.deque()).append((block, self._clock()))
        self.idle_bytes += cap

    def trim(self) -> int:
        """Free buffers idle for at least ``idle_seconds``, oldest first, while more than
        ``floor`` bytes are idle; the bytes freed."""
        if self.idle_bytes <= self.floor:
            return 0
        stale = self._clock() - self.idle_seconds
        olds = sorted((when, cap) for cap, free in self._free.items()
                      for _, when in free if when <= stale)
        freed = 0
        for _, cap in olds:
            if self.idle_bytes <= self.floor:
                break
            self._free[cap].popleft()  # the oldest of its class
            self.idle_bytes -= cap
            freed += cap
            self.freed += 1
        return freed
