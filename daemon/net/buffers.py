"""Reusable receive buffers: training sends the same sizes every step, so after the first step a
message lands in memory that is already mapped and touched instead of a fresh model-sized one."""

from __future__ import annotations

import collections

import numpy as np

PAGE = 4096


def size_class(nbytes: int) -> int:
    """The capacity a request of ``nbytes`` is served from (powers of two up to 1 MiB, then MiB)."""
    if nbytes <= 4096:
        return 4096
    if nbytes <= 1 << 20:
        return 1 << (nbytes - 1).bit_length()
    return -(-nbytes // (1 << 20)) << 20


class BufferPool:
    """Free lists of uint8 buffers by size class, holding at most ``limit`` idle bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.idle_bytes = 0
        self.in_use_bytes = 0
        self.peak_in_use = 0
        self.allocated = 0  # buffers created (not served from a free list)
        self._free: dict[int, collections.deque[np.ndarray]] = {}

    def get(self, nbytes: int) -> np.ndarray:
        """A buffer of exactly ``nbytes`` (a view of a pooled block); give it back with put()."""
        cap = size_class(nbytes)
        free = self._free.get(cap)
        if free:
            block = free.pop()
            self.idle_bytes -= cap
        else:
            block = np.empty(cap, np.uint8)
            block[::PAGE] = 0  # fault the pages in now, in one pass
            self.allocated += 1
        self.in_use_bytes += cap
        self.peak_in_use = max(self.peak_in_use, self.in_use_bytes)
        return block[:nbytes]

    def put(self, buf: np.ndarray) -> None:
        """Return a buffer from get(); it is dropped when the idle bytes would pass the limit."""
        block = buf.base if isinstance(buf.base, np.ndarray) else buf
        cap = block.size
        self.in_use_bytes -= cap
        if self.idle_bytes + cap > self.limit:
            return
        self._free.setdefault(cap, collections.deque()).append(block)
        self.idle_bytes += cap
