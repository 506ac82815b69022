"""The shared-memory arena of one local worker: created, pre-touched and mapped once by the daemon.

The worker attaches by name and writes tensors at offsets it allocates; requests carry offsets.
The name is unlinked as soon as the worker has attached (both mappings stay valid), so nothing is
left in /dev/shm even if a process is killed.

A worker may also register shared memory of its own (a tensor's storage, see MemoryRequest): the
daemon maps it at offsets above the arena, and :meth:`Arena.view` resolves both.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import secrets
import shutil
from collections.abc import Callable
from multiprocessing import shared_memory

import numpy as np

from decent_wire.errors import DecentError
from decent_wire.v1 import decent_pb2 as pb

PAGE = 4096


class Arena:
    """A daemon-owned shared-memory segment for one worker."""

    def __init__(self, nbytes: int, prefix: str, max_regions: int = 4096,
                 protect: Callable[[int], None] | None = None) -> None:
        self.name = f"{prefix}-{secrets.token_hex(4)}"
        # the stdlib resource tracker stays registered: if this process is killed, it unlinks
        # (created with mode 0600; ``protect`` may give it the workers' group)
        self._shm = shared_memory.SharedMemory(name=self.name, create=True, size=nbytes)
        if protect is not None:
            protect(self._shm._fd)  # type: ignore[attr-defined]
        try:
            # reserve the pages now: on a full /dev/shm this fails here (ENOSPC) instead of
            # killing the daemon with SIGBUS at the first touch
            if hasattr(os, "posix_fallocate"):  # not on macOS
                os.posix_fallocate(self._shm._fd, 0, nbytes)  # type: ignore[attr-defined]
        except OSError as exc:
            self._shm.close()
            self._shm.unlink()
            free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
            raise DecentError(
                pb.RESOURCE_EXHAUSTED,
                f"cannot reserve a {nbytes}-byte shared-memory arena ({exc.strerror}; "
                f"/dev/shm has {free} bytes free): lower memory.arena_bytes or give the "
                "node more shared memory (docker: --shm-size)",
            ) from None
        self.nbytes = nbytes
        buf = self._shm.buf
        assert buf is not None
        self.buf: memoryview = buf
        pages = np.frombuffer(self.buf, np.uint8)
        pages[::PAGE] = 0  # first touch now, not on the hot path
        del pages
        self._unlinked = False
        self.max_regions = max_regions
        self._bases: list[int] = []  # sorted bases of registered regions
        self._regions: dict[int, mmap.mmap] = {}

    def unlink(self) -> None:
        """Remove the name from /dev/shm (mappings stay valid)."""
        if not self._unlinked:
            self._unlinked = True
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()

    def close(self) -> None:
        """Unlink and unmap; views still held elsewhere keep the mapping until released."""
        self.unlink()
        for base in list(self._regions):
            self.release_region(base)
        self.buf = memoryview(b"")
        with contextlib.suppress(BufferError):
            self._shm.close()

    def view(self, offset: int, nbytes: int, what: str) -> memoryview:
        """Bytes ``[offset, offset + nbytes)`` of the arena or of one registered region;
        ARENA_ERROR when they lie in neither."""
        if offset >= 0 and nbytes >= 0 and offset + nbytes <= self.nbytes:
            return self.buf[offset:offset + nbytes]
        i = bisect.bisect_right(self._bases, offset) - 1
        if i >= 0 and nbytes >= 0:
            base = self._bases[i]
            region = self._regions[base]
            if offset + nbytes <= base + len(region):
                return memoryview(region)[offset - base:offset - base + nbytes]
        raise DecentError(
            pb.ARENA_ERROR,
            f"{what}: bytes [{offset}, {offset + nbytes}) are outside the {self.nbytes}-byte "
            f"arena and outside every memory region this worker registered",
        )

    def check_region(self, base: int, nbytes: int) -> None:
        """Raise ValueError unless ``[base, base + nbytes)`` could be registered now."""
        if nbytes <= 0 or base < self.nbytes:
            raise ValueError(f"region [{base}, {base + nbytes}) must be non-empty and lie above "
                             f"the {self.nbytes}-byte arena")
        if len(self._regions) >= self.max_regions:
            raise OverflowError(f"this worker already has {self.max_regions} registered regions "
                                "(memory.max_regions)")
        i = bisect.bisect_right(self._bases, base)
        below = i > 0 and self._bases[i - 1] + len(self._regions[self._bases[i - 1]]) > base
        if below or (i < len(self._bases) and base + nbytes > self._bases[i]):
            raise ValueError(f"region [{base}, {base + nbytes}) overlaps a registered one")

    @staticmethod
    def open_region(nbytes: int, fd: int) -> mmap.mmap:
        """Map ``nbytes`` of the worker's shared memory ``fd`` (blocking: pages are populated
        now, not on the hot path; run it off the event loop)."""
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise ValueError(f"the shared memory holds {size} bytes, fewer than the {nbytes} "
                             "registered")
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        return mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)

    def add_region(self, base: int, region: mmap.mmap) -> None:
        """Make a mapped region addressable at ``base`` (checked again: ValueError/OverflowError
        leave it to the caller to close)."""
        self.check_region(base, len(region))
        i = bisect.bisect_right(self._bases, base)
        self._bases.insert(i, base)
        self._regions[base] = region

    def release_region(self, base: int) -> None:
        """Forget a region; it is unmapped once ops still using it have let go of their views."""
        region = self._regions.pop(base, None)
        if region is not None:
            self._bases.remove(base)
            with contextlib.suppress(BufferError):
                region.close()

    @property
    def region_count(self) -> int:
        """Registered regions mapped."""
        return len(self._regions)

    @property
    def region_bytes(self) -> int:
        """Bytes of worker memory registered and mapped."""
        return sum(len(r) for r in self._regions.values())
