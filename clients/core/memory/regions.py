"""Worker memory registered with the daemon: tensor storages the daemon reads and writes in place.

An in-place op on a large tensor would otherwise copy it into the arena and the result back out,
which at 64 MiB costs more than the network exchange on a fast link. A storage that already lives
in fd-backed shared memory (torch's ``share_memory_()``) has its file descriptor handed to the
daemon at its first in-place op; the daemon maps it at offsets above the arena, and from then on
requests name those offsets and nothing is copied: the memory registration of RDMA stacks.
Private memory is never moved behind the user's back (numpy views or DLPack exports of it would be
left pointing at freed memory): it is copied as before.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

PAGE = 4096
#: registered regions get offsets from here up, far above any arena
FIRST_BASE = 1 << 44
#: refused storages remembered; dead ones are pruned past this many
MAX_REFUSED = 1024


class SharedStorage(NamedTuple):
    """A tensor's memory block in fd-backed shared memory, as a codec finds it."""

    address: int
    nbytes: int
    alive: Callable[[], bool]  # False once the block is freed (its address may be reused)
    fd: int  # owned by the block


@dataclass
class Region:
    """One registered storage: its bytes at ``address`` are daemon offsets ``base + i``."""

    address: int
    nbytes: int
    base: int
    alive: Callable[[], bool]


class RegionTable:
    """The worker's registered regions. Thread-safe."""

    def __init__(self) -> None:
        self._regions: list[Region] = []  # sorted by address
        self._addresses: list[int] = []
        self._next_base = FIRST_BASE
        self._released: list[int] = []  # bases of dead regions the daemon has not been told of
        self._refused: dict[int, Callable[[], bool]] = {}  # storages the daemon had no room for
        self._lock = threading.Lock()

    def offset_of(self, address: int, nbytes: int) -> int | None:
        """The daemon offset of ``[address, address + nbytes)`` if a live region holds it."""
        with self._lock:
            i = bisect.bisect_right(self._addresses, address) - 1
            if i < 0:
                return None
            r = self._regions[i]
            if address + nbytes > r.address + r.nbytes:
                return None
            if not r.alive():  # the storage is gone; its address may belong to another now
                self._drop(i)
                return None
            return r.base + (address - r.address)

    def reserve(self, nbytes: int) -> int:
        """A fresh base for a region of ``nbytes`` (bases are never reused)."""
        with self._lock:
            base = self._next_base
            self._next_base += (nbytes + PAGE - 1) // PAGE * PAGE + PAGE
            return base

    def add(self, region: Region) -> None:
        """Record a region the daemon has mapped; dead regions it overlaps are dropped."""
        with self._lock:
            end = region.address + region.nbytes
            i = bisect.bisect_left(self._addresses, region.address)
            while i > 0 and self._regions[i - 1].address + self._regions[i - 1].nbytes > \
                    region.address:
                i -= 1
            while i < len(self._regions) and self._regions[i].address < end:
                self._drop(i)  # memory of a live storage cannot overlap another live one
            self._regions.insert(i, region)
            self._addresses.insert(i, region.address)

    def sweep(self) -> list[int]:
        """Drop regions whose storage is gone; returns (and forgets) every base to release."""
        with self._lock:
            for i in range(len(self._regions) - 1, -1, -1):
                if not self._regions[i].alive():
                    self._drop(i)
            released, self._released = self._released, []
            return released

    def refuse(self, address: int, alive: Callable[[], bool]) -> None:
        """The daemon had no room for the storage at ``address``: do not ask again while it
        lives."""
        with self._lock:
            if len(self._refused) >= MAX_REFUSED:
                self._refused = {a: f for a, f in self._refused.items() if f()}
            self._refused[address] = alive

    def refused(self, address: int) -> bool:
        """Whether the live storage at ``address`` was refused before."""
        with self._lock:
            alive = self._refused.get(address)
            if alive is not None and not alive():
                del self._refused[address]
                return False
            return alive is not None

    def requeue(self, bases: list[int]) -> None:
        """Bases whose release did not reach the daemon: tell it next time."""
        with self._lock:
            self._released.extend(bases)

    def _drop(self, i: int) -> None:
        self._released.append(self._regions[i].base)
        del self._regions[i]
        del self._addresses[i]

    @property
    def nbytes(self) -> int:
        """Bytes of live registered regions."""
        with self._lock:
            return sum(r.nbytes for r in self._regions if r.alive())
