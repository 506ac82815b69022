"""A training state cut into checksummed chunks, and which donor sends which chunk
(framework-neutral, no I/O: :mod:`decent.core.training.transfer` moves the bytes).

Every tensor of a state is cut into chunks of at most ``chunk_bytes`` (a chunk never spans two
tensors). A donor announces one BLAKE2b digest per chunk. The joining rank takes the state of
its first donor (the *primary*), byte for byte: a chunk may come from any donor whose digest of
that chunk equals the primary's, that is from any donor holding the same bytes, and is checked
on arrival; a chunk that fails (its bytes, or its donor) is fetched again from another holder.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: bytes a chunk is read from
Buffer = bytes | bytearray | memoryview | np.ndarray

#: the default chunk size: large enough that an op's own cost is small against its transfer
CHUNK_BYTES = 4 << 20
#: the chunk sizes a joining rank accepts
MIN_CHUNK_BYTES, MAX_CHUNK_BYTES = 64, 1 << 30
#: bytes of one chunk's digest
DIGEST_BYTES = 32


@dataclass(frozen=True)
class Chunk:
    """Bytes ``start:stop`` of tensor ``tensor`` (as it travels: its wire dtype's bytes)."""

    tensor: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        """Its length in bytes."""
        return self.stop - self.start


def layout(sizes: Sequence[int], chunk_bytes: int) -> list[Chunk]:
    """The chunks of tensors of ``sizes`` bytes, in order (an empty tensor has none)."""
    return [Chunk(i, start, min(start + chunk_bytes, size))
            for i, size in enumerate(sizes) for start in range(0, size, chunk_bytes)]


def view_of(data: Buffer) -> memoryview:
    """``data``'s bytes, without a copy."""
    return data.data if isinstance(data, np.ndarray) else memoryview(data)


def digest(data: Buffer) -> bytes:
    """The digest of one chunk's bytes."""
    return hashlib.blake2b(view_of(data), digest_size=DIGEST_BYTES).digest()


def manifest(tensors: Sequence[Buffer], chunks: Sequence[Chunk]) -> bytes:
    """The digests of ``chunks`` of ``tensors`` (each tensor's bytes), one after another."""
    views = [view_of(t) for t in tensors]
    return b"".join(digest(views[c.tensor][c.start:c.stop]) for c in chunks)


def digests_of(manifest_bytes: bytes, count: int) -> list[bytes]:
    """A :func:`manifest` split into its ``count`` digests (ValueError when it is not that
    long)."""
    if len(manifest_bytes) != count * DIGEST_BYTES:
        raise ValueError(f"{len(manifest_bytes)} bytes of digests for {count} chunks")
    return [manifest_bytes[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES] for i in range(count)]


class ChunkPlan:
    """Which donor sends which chunk, round after round, until every chunk has arrived whole.

    ``primary``: the digests of the state taken; ``holders``: each donor's digests (the
    primary's included, in donor order). A donor holds a chunk when its digest equals the
    primary's. Each round spreads the chunks still wanted over their holders by bytes; a chunk
    that failed from a donor is not asked of that donor again while another holder is left,
    and a donor that failed is asked nothing more."""

    def __init__(self, chunks: Sequence[Chunk], primary: Sequence[bytes],
                 holders: dict[int, Sequence[bytes] | None]) -> None:
        self.chunks = list(chunks)
        self.primary = list(primary)
        self.holders = {c: [d for d, got in holders.items()
                            if got is not None and got[c] == self.primary[c]]
                        for c in range(len(self.chunks))}
        self.wanted = set(range(len(self.chunks)))
        self.failed_from: dict[int, set[int]] = {c: set() for c in self.wanted}
        self.dropped: set[int] = set()
        #: bytes that arrived whole from each donor
        self.taken: dict[int, int] = {d: 0 for d in holders}
        #: chunks whose bytes failed their digest (each is fetched again)
        self.refetched = 0
        self.rounds = 0
        #: after this many rounds, a chunk still wanted fails the transfer
        self.max_rounds = len(holders) + 2

    def next_round(self) -> dict[int, list[int]]:
        """The chunks each donor sends in the next round (empty when all have arrived);
        ValueError naming the chunk when one has no holder left, or after :attr:`max_rounds`."""
        if self.wanted and self.rounds >= self.max_rounds:
            c = min(self.wanted)
            raise ValueError(f"chunk {c} of tensor {self.chunks[c].tensor} failed its checksum "
                             f"from ranks {sorted(self.failed_from[c])} in {self.rounds} rounds")
        self.rounds += 1
        load = {d: 0 for d in self.taken if d not in self.dropped}
        ask: dict[int, list[int]] = {d: [] for d in load}
        for c in sorted(self.wanted):
            live = [d for d in self.holders[c] if d in load]
            fresh = [d for d in live if d not in self.failed_from[c]]
            if not live:
                chunk = self.chunks[c]
                raise ValueError(f"no donor left holds chunk {c} (bytes {chunk.start}:"
                                 f"{chunk.stop} of tensor {chunk.tensor}); it failed from "
                                 f"ranks {sorted(self.failed_from[c])}")
            donor = min(fresh or live, key=lambda d: (load[d], d))
            load[donor] += self.chunks[c].size
            ask[donor].append(c)
        return ask

    def matches(self, c: int, data: Buffer) -> bool:
        """Whether ``data`` are the primary's bytes of chunk ``c``."""
        return digest(data) == self.primary[c]

    def arrived(self, donor: int, c: int, whole: bool) -> None:
        """Chunk ``c`` came from ``donor``, ``whole`` (:meth:`matches`) or not: when not, it
        is wanted again, from another holder if there is one."""
        if whole:
            self.wanted.discard(c)
            self.taken[donor] += self.chunks[c].size
            return
        self.failed_from[c].add(donor)
        self.refetched += 1

    def donor_failed(self, donor: int) -> None:
        """``donor``'s ops failed (it died, or timed out): it is asked nothing more."""
        self.dropped.add(donor)

    @property
    def done(self) -> bool:
        """Whether every chunk has arrived whole."""
        return not self.wanted
