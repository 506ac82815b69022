"""The shared-memory arena of one local worker: created, reserved and mapped once by the daemon.

The arena is a sealed memfd: its size can neither shrink nor grow (``F_SEAL_SHRINK``,
``F_SEAL_GROW``), so no worker can pull pages from under the daemon; it has no name anywhere, and
the worker gets its descriptor once, over the memory socket (:meth:`Arena.take_fd`). The worker
writes tensors at offsets it allocates; requests carry offsets.

A worker may also register shared memory of its own (a tensor's storage, see MemoryRequest): the
daemon maps it at offsets above the arena, and :meth:`Arena.view` resolves both. That memory the
worker can shrink: its ranges are watched by :mod:`decentd.workers.sigbus`, so a touch past the new
end reads zeros instead of killing the daemon, and :meth:`Arena.faulted` says so (the worker's ops
then fail)."""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import mmap
import os
import weakref
from collections.abc import Callable, Iterable

import numpy as np

from decent_wire.errors import DecentError
from decent_wire.v1 import decent_pb2 as pb
from decentd.workers import sigbus

PAGE = 4096
#: the arena's size is fixed for its life, and so are its seals
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _sealed_memfd(name: str, nbytes: int, protect: Callable[[int], None] | None) -> int:
    """A memfd of ``nbytes`` reserved now (a node short of memory fails here, not with SIGBUS at
    the first touch) and sealed; DecentError when it cannot be had."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        if protect is not None:
            protect(fd)
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except OSError as exc:
        os.close(fd)
        raise DecentError(
            pb.RESOURCE_EXHAUSTED,
            f"cannot reserve a {nbytes}-byte shared-memory arena ({exc.strerror}): lower "
            "memory.arena_bytes or give the daemon more memory",
        ) from None
    return fd


def address_of(buffer: mmap.mmap) -> int:
    """Where ``buffer``'s bytes start in this process."""
    return int(np.frombuffer(buffer, np.uint8, 1).ctypes.data)


def fault_in(buffers: Iterable[bytes | bytearray | memoryview]) -> None:
    """Touch every page of ``buffers``: pages of watched memory that a worker shrank away become
    zero pages (a system call given such memory fails with EFAULT instead)."""
    for b in buffers:
        pages = np.frombuffer(b, np.uint8)
        if pages.size:
            int(pages[::PAGE].sum()) + int(pages[-1])


class Arena:
    """A daemon-owned shared-memory segment for one worker."""

    def __init__(self, nbytes: int, name: str, max_regions: int = 4096,
                 protect: Callable[[int], None] | None = None) -> None:
        """``protect(fd)`` may give the memory another mode (the workers' group)."""
        self.name = name
        self._fd: int | None = _sealed_memfd(name, nbytes, protect)
        self._map = mmap.mmap(self._fd, nbytes, flags=mmap.MAP_SHARED,
                              prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.nbytes = nbytes
        #: pages are reserved (fallocate) but mapped here at their first use: registration
        #: costs no page faults, and a worker that uses little of its arena maps little
        self.buf: memoryview = memoryview(self._map)
        self.max_regions = max_regions
        self._bases: list[int] = []  # sorted bases of registered regions
        self._regions: dict[int, mmap.mmap] = {}
        self._addresses: dict[int, int] = {}  # base -> where the region is mapped here
        self._faults_seen = sigbus.total()
        self._faulted = False
        self._spill_bases: set[int] = set()
        self.spills = 0  #: regions registered for a request that found the arena full

    def take_fd(self) -> int | None:
        """The arena's descriptor, for the worker; None once taken (the caller closes it)."""
        fd, self._fd = self._fd, None
        return fd

    def close(self) -> None:
        """Unmap; views still held elsewhere keep the mapping until released."""
        for base in list(self._regions):
            self.release_region(base)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        buf, self.buf = self.buf, memoryview(b"")
        with contextlib.suppress(BufferError):
            buf.release()
            self._map.close()

    def faulted(self) -> bool:
        """Whether the worker shrank memory of its while the daemon had it mapped (what the
        daemon touched there read as zeros): its ops fail from then on."""
        total = sigbus.total()
        if total != self._faults_seen:
            self._faults_seen = total
            if any(sigbus.faults(a) for a in self._addresses.values()):
                self._faulted = True
        return self._faulted

    def fault_error(self, what: str) -> DecentError:
        """The error of ``what`` (an op) once :meth:`faulted`."""
        return DecentError(pb.ARENA_ERROR, f"{what}: the worker shrank (truncated) shared memory "
                           "it had registered while the daemon was using it; its ops fail until "
                           "it connects again")

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

    def holds(self, offset: int, nbytes: int) -> bool:
        """Whether ``[offset, offset + nbytes)`` lies in the arena itself (not in a region)."""
        return offset >= 0 and nbytes >= 0 and offset + nbytes <= self.nbytes

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

    def add_region(self, base: int, region: mmap.mmap, spill: bool = False) -> None:
        """Make a mapped region addressable at ``base`` (checked again: ValueError/OverflowError
        leave it to the caller to close); it is watched for SIGBUS from now on. ``spill``: it
        holds a request that found the arena full (counted)."""
        self.check_region(base, len(region))
        if spill:
            self._spill_bases.add(base)
            self.spills += 1
        address = address_of(region)
        sigbus.watch(address, len(region))
        i = bisect.bisect_right(self._bases, base)
        self._bases.insert(i, base)
        self._regions[base] = region
        self._addresses[base] = address

    def release_region(self, base: int) -> None:
        """Forget a region; it is unmapped once ops still using it have let go of their views
        (and watched until then)."""
        region = self._regions.pop(base, None)
        if region is None:
            return
        self._spill_bases.discard(base)
        self._bases.remove(base)
        address = self._addresses.pop(base)
        if sigbus.faults(address):
            self._faulted = True
        try:
            region.close()
        except BufferError:  # still in use: unwatched once unmapped
            weakref.finalize(region, sigbus.unwatch, address)
        else:
            sigbus.unwatch(address)

    @property
    def region_count(self) -> int:
        """Registered regions mapped."""
        return len(self._regions)

    @property
    def spill_bytes(self) -> int:
        """Bytes of regions mapped for requests that found the arena full."""
        return sum(len(self._regions[b]) for b in self._spill_bases)

    @property
    def region_bytes(self) -> int:
        """Bytes of worker memory registered and mapped."""
        return sum(len(r) for r in self._regions.values())
