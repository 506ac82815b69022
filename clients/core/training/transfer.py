"""Sending a training state to a rank that joined late, and taking it there (framework-neutral:
the adapter supplies its tensors' :class:`~decent.core.training.state.StateKit`).

The state (parameters, the optimizer's state, the algorithm's state and counters) travels as
tensors and plain values (:mod:`decent.core.training.state`), never a pickle, one way with dynamic
neighbor gathers under the names of :mod:`decent.core.surface.rejoin`, from several donors at
once in checksummed chunks (:mod:`decent.core.training.chunks`). Per donor, in order: the
newcomer says it is ready; the donor sends its step count; the newcomer names the step to
snapshot at; the donor sends its description's size and the step it snapshotted at (the one
named, or later when it was already past it), the description (JSON) and its chunks' digests;
then rounds of chunk requests (a mask over the chunks, its last byte set in the final round) and
the chunks asked for.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

import numpy as np

from decent.core.surface.client import Client
from decent.core.surface.rejoin import (
    ASSIGN_NAME,
    CHUNK_NAME,
    DIGESTS_NAME,
    META_NAME,
    READY_NAME,
    SIZE_NAME,
    STEP_NAME,
    TARGET_NAME,
    pair_name,
)
from decent.core.training.algorithms import AlgorithmError
from decent.core.training.chunks import (
    CHUNK_BYTES,
    DIGEST_BYTES,
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    Chunk,
    ChunkPlan,
    digests_of,
    layout,
    manifest,
)
from decent.core.training.state import StateFormatError, StateKit, decode, encode
from decent_wire import dtypes

T = TypeVar("T")

log = logging.getLogger("decent.rejoin")

#: the largest state description a joining rank accepts (the tensors travel apart)
MAX_META = 256 << 20
#: the most chunks a joining rank accepts from one donor
MAX_CHUNKS = 1 << 20
#: the most rounds of chunk requests a donor serves
MAX_ROUNDS = 64
#: the donors snapshot at least this many steps, and this many seconds of steps, ahead of the
#: furthest one (they step on while the newcomer names the step: a donor already past it
#: snapshots at once, and then holds other bytes than the primary)
LEAD_STEPS, LEAD_SECONDS = 2, 0.2

#: donors whose steps differ by at most this many leads count as in step (each says its step
#: when its answer is sent: at different moments, the more so on a loaded host)
IN_STEP_LEADS = 10
#: the most steps ahead a newcomer names
MAX_LEAD_STEPS = 1 << 20
#: the target step a newcomer names to a donor it takes nothing from
NOT_NEEDED = -1

#: a snapshot: the state's description and each tensor's bytes (as it travels)
Snapshot = tuple[bytes, list[np.ndarray]]


@dataclass
class Manifest:
    """What a donor announced: its description, chunk size and digests."""

    meta: bytes
    chunk_bytes: int
    digests: bytes
    #: the step the donor took its snapshot at (the one named, or later when it was past it)
    step: int


@dataclass
class Taken:
    """How a joining rank took its state: bytes per donor, chunks fetched again, time."""

    primary: int
    step: int
    bytes_from: dict[int, int] = field(default_factory=dict)
    refetched: int = 0
    rounds: int = 0
    seconds: float = 0.0

    def __str__(self) -> str:
        total = sum(self.bytes_from.values())
        return (f"{total} bytes of rank {self.primary}'s state at step {self.step} in "
                f"{self.seconds:.2f} s from ranks {self.bytes_from} ({self.rounds} rounds, "
                f"{self.refetched} chunks fetched again)")


def near_donors(steps: dict[int, tuple[int, int]], donors: Sequence[int]) -> list[int]:
    """The donors to take chunks from, the primary first, from ``steps`` (donor: its step, its
    lead in steps). Donors count as in step while their steps differ by at most
    :data:`IN_STEP_LEADS` times the larger lead: they said their steps at different moments (a
    loaded host; a donor that has not timed its steps yet says a lead of 2). The primary is
    ``donors[0]`` unless a donor is further ahead of it than that (it is a worker that
    restarted alone and counts from 0): then the furthest. The others kept are in step with
    the primary: a donor far behind or ahead would keep the newcomer waiting, or hold other
    bytes."""
    def in_step(a: int, b: int) -> bool:
        return abs(steps[a][0] - steps[b][0]) <= IN_STEP_LEADS * max(steps[a][1], steps[b][1])

    first = donors[0]
    furthest = max(steps, key=lambda d: (steps[d][0], -donors.index(d)))
    primary = first if in_step(first, furthest) else furthest
    return [primary, *(d for d in donors if d != primary and d in steps
                       and in_step(d, primary))]


def lead_steps(period: float) -> int:
    """The steps a donor that steps every ``period`` seconds makes in the lead time."""
    return max(LEAD_STEPS, min(MAX_LEAD_STEPS, math.ceil(LEAD_SECONDS / max(period, 1e-9))))


class StateLink(Generic[T]):
    """Sends a training state (tensors and plain values, :mod:`decent.core.training.state`)
    from donors to a rank that joined late. ``kit``: the framework's tensors; ``chunk_bytes``:
    the size of the chunks this rank sends as a donor."""

    def __init__(self, client: Client[T], kit: StateKit[T],
                 chunk_bytes: int = CHUNK_BYTES) -> None:
        if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes={chunk_bytes}: between {MIN_CHUNK_BYTES} and "
                             f"{MAX_CHUNK_BYTES}")
        self.client = client
        self.kit = kit
        self.chunk_bytes = chunk_bytes
        #: the step count at the last step boundary (:meth:`hand_out`), when it was, and the
        #: time a step takes (smoothed)
        self.step = 0
        self._stepped_at: float | None = None
        self._period: float | None = None
        #: (step to snapshot at, where the training thread puts the snapshot)
        self._wanted: queue.Queue[tuple[int, queue.Queue[tuple[int, Snapshot]]]] = \
            queue.Queue()
        #: how the last state this rank took came (None before it took one)
        self.taken: Taken | None = None

    # ------------------------------------------------------------------ both sides

    def _to(self, to: int, t: T, name: str) -> None:
        self.client.neighbor_allgather(t, name=name, src_ranks=[], dst_ranks=[to])

    def _from(self, src: int, t: T, name: str) -> T:
        got: Any = self.client.neighbor_allgather(t, name=name, src_ranks=[src], dst_ranks=[])
        return cast(T, got[0])  # stacked on a new leading dimension: the one source's

    def _send_array(self, to: int, values: np.ndarray, name: str) -> None:
        self._to(to, self.client.tensor(values), name)

    def _take_array(self, src: int, like: np.ndarray, name: str) -> np.ndarray:
        return self.client.values(self._from(src, self.client.tensor(like), name))

    # ------------------------------------------------------------------ the donor's side

    def snapshot(self, state: Any) -> Snapshot:
        """``state`` as a description and host copies of its tensors' bytes (training goes
        on)."""
        meta, tensors = encode(state, self.kit)
        return meta, [self.client.values(t).reshape(-1).view(np.uint8) for t in tensors]

    def hand_out(self, step: int, state: Callable[[], Any]) -> None:
        """At a step boundary, ``step`` steps done: a snapshot of ``state()`` for every
        newcomer whose step this is (or was)."""
        now = time.monotonic()
        if self._stepped_at is not None and step > self.step:
            last = (now - self._stepped_at) / (step - self.step)
            self._period = last if self._period is None else self._period + 0.2 * (
                last - self._period)
        self.step, self._stepped_at = step, now
        later, taken = [], None
        while not self._wanted.empty():
            target, box = self._wanted.get_nowait()
            if step < target:
                later.append((target, box))
                continue
            taken = taken or self.snapshot(state())
            box.put((step, taken))
        for item in later:
            self._wanted.put(item)

    def serve_in_background(self, to: int, patience: float) -> threading.Thread:
        """On a thread of its own (the donor's training goes on): serve rank ``to`` the
        snapshot of the step it names, taken by :meth:`hand_out`, and the chunks it asks for.
        A failure is logged: the newcomer takes those chunks from another donor."""
        def run() -> None:
            try:
                self._serve(to, patience)
            except Exception as exc:  # the joining rank died again, or timed out
                log.warning("sending the training state to rank %d failed: %s", to, exc)

        thread = threading.Thread(target=run, name=f"decent-rejoin-{to}", daemon=True)
        thread.start()
        return thread

    def _serve(self, to: int, patience: float) -> None:
        def named(name: str) -> str:
            return pair_name(name, self.client.rank, to)

        self._take_array(to, np.zeros(1, np.float32), named(READY_NAME))
        lead = lead_steps(self._period or 1.0)
        self._send_array(to, np.array([self.step, lead], np.int64), named(STEP_NAME))
        target = int(self._take_array(to, np.zeros(1, np.int64), named(TARGET_NAME))[0])
        if target == NOT_NEEDED:  # this rank's step is too far from the primary donor's
            log.info("rank %d takes its state from donors nearer its step", to)
            return
        box: queue.Queue[tuple[int, Snapshot]] = queue.Queue(1)
        self._wanted.put((target, box))
        try:
            step, (meta, tensors) = box.get(timeout=patience)
        except queue.Empty:
            raise AlgorithmError(f"this rank did not reach step {target} (at {self.step}) "
                                 f"within {patience:g}s") from None
        chunks = layout([t.nbytes for t in tensors], self.chunk_bytes)
        self._send_array(to, np.array([len(meta), self.chunk_bytes, len(chunks), step],
                                      np.int64), named(SIZE_NAME))
        self._send_array(to, np.frombuffer(bytearray(meta), np.uint8), named(META_NAME))
        if chunks:
            self._send_array(to, np.frombuffer(bytearray(manifest(tensors, chunks)), np.uint8),
                             named(DIGESTS_NAME))
        for r in range(MAX_ROUNDS):
            mask = self._take_array(to, np.zeros(len(chunks) + 1, np.uint8),
                                    named(f"{ASSIGN_NAME}{r}"))
            for c in np.flatnonzero(mask[:-1]):
                chunk = chunks[c]
                self._send_array(to, tensors[chunk.tensor][chunk.start:chunk.stop],
                                 named(f"{CHUNK_NAME}{r}.{c}"))
            if mask[-1]:
                return

    # ------------------------------------------------------------------ the newcomer's side

    def receive(self, donors: Sequence[int]) -> Any:
        """The state of the primary donor (``donors[0]``, unless it is far behind another:
        :func:`near_donors`; checked before use), its chunks from every donor holding the same
        bytes. AlgorithmError when it is not well formed or a chunk cannot be had whole; an
        op's error when ``donors[0]`` fails to say its step, or the primary later."""
        start = time.monotonic()
        with ThreadPoolExecutor(len(donors), thread_name_prefix="decent-take") as pool:
            steps = self._each(pool, donors, self._ask_step)
            near = near_donors(steps, donors)
            target = max(steps[d][0] + steps[d][1] for d in near)
            self._release(pool, [d for d in steps if d not in near], near[0], steps)
            manifests = self._each(pool, near, lambda d: self._ask_manifest(d, target))
            primary = manifests[near[0]]
            sizes = self._sizes(primary.meta, near[0])
            chunks = layout(sizes, primary.chunk_bytes)
            plan = ChunkPlan(chunks, self._digests(primary, chunks, near[0]),
                             {d: self._holding(m, primary, chunks) for d, m in manifests.items()})
            buffers = [bytearray(size) for size in sizes]
            self._fetch(pool, plan, buffers)
        self.taken = Taken(near[0], primary.step, dict(plan.taken), plan.refetched, plan.rounds,
                           time.monotonic() - start)
        log.info("took %s", self.taken)
        codec = self.client.codec
        return decode(primary.meta, lambda i, wire: codec.read(memoryview(buffers[i]),
                                                              *codec.describe(wire), None),
                      self.kit)

    def _release(self, pool: ThreadPoolExecutor, far: list[int], primary: int,
                 steps: dict[int, tuple[int, int]]) -> None:
        """Tell the donors ``far`` from the primary's step that nothing is taken from them."""
        for d in far:
            log.warning("rank %d is at step %d, the primary donor rank %d at %d: nothing is "
                        "taken from it", d, steps[d][0], primary, steps[primary][0])
            pool.submit(self._send_array, d, np.array([NOT_NEEDED], np.int64),
                        self._taking(d, TARGET_NAME))

    def _each(self, pool: ThreadPoolExecutor, donors: Sequence[int],
              ask: Callable[[int], Any]) -> dict[int, Any]:
        """``ask(d)`` of every donor at once: what each answered; a donor other than the
        primary that fails is left out (logged), the primary's error is raised."""
        futures = {d: pool.submit(ask, d) for d in donors}
        answers = {}
        for d, f in futures.items():
            try:
                answers[d] = f.result()
            except Exception as exc:
                if d == donors[0]:
                    raise
                log.warning("rank %d cannot serve this rank's state: %s", d, exc)
        return answers

    def _taking(self, donor: int, name: str) -> str:
        """``name`` for this newcomer's ops with ``donor``."""
        return pair_name(name, donor, self.client.rank)

    def _ask_step(self, donor: int) -> tuple[int, int]:
        """(the donor's step count, the steps it makes in the lead time)."""
        self._send_array(donor, np.ones(1, np.float32), self._taking(donor, READY_NAME))
        step, lead = self._take_array(donor, np.zeros(2, np.int64),
                                      self._taking(donor, STEP_NAME))
        return int(step), min(max(int(lead), LEAD_STEPS), MAX_LEAD_STEPS)

    def _ask_manifest(self, donor: int, target: int) -> Manifest:
        self._send_array(donor, np.array([target], np.int64), self._taking(donor, TARGET_NAME))
        size, chunk_bytes, count, step = (int(v) for v in self._take_array(
            donor, np.zeros(4, np.int64), self._taking(donor, SIZE_NAME)))
        if step < target:
            raise AlgorithmError(f"rank {donor} snapshotted at step {step}, before the step "
                                 f"{target} it was asked for")
        if not 0 < size <= MAX_META:
            raise AlgorithmError(f"rank {donor} announced a state description of {size} bytes "
                                 f"(at most {MAX_META})")
        if not (MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES and 0 <= count <= MAX_CHUNKS):
            raise AlgorithmError(f"rank {donor} announced {count} chunks of {chunk_bytes} bytes "
                                 f"(at most {MAX_CHUNKS} of {MIN_CHUNK_BYTES}-{MAX_CHUNK_BYTES})")
        meta = self._take_array(donor, np.zeros(size, np.uint8),
                                self._taking(donor, META_NAME)).tobytes()
        digests = self._take_array(donor, np.zeros(count * DIGEST_BYTES, np.uint8),
                                   self._taking(donor, DIGESTS_NAME)).tobytes() if count else b""
        return Manifest(meta, chunk_bytes, digests, step)

    def _sizes(self, meta: bytes, src: int) -> list[int]:
        """The sizes in bytes (as they travel) of the tensors ``meta`` announces (checked)."""
        templates: list[T] = []

        def keep(_: int, wire: T) -> T:
            templates.append(wire)
            return wire

        try:
            decode(meta, keep, self.kit)
        except (StateFormatError, ValueError, KeyError, TypeError) as exc:
            raise AlgorithmError(f"rank {src} sent a training state this rank cannot read: "
                                 f"{exc}") from None
        return [dtypes.nbytes(*self.client.codec.describe(t)) for t in templates]

    @staticmethod
    def _digests(primary: Manifest, chunks: list[Chunk], src: int) -> list[bytes]:
        try:
            return digests_of(primary.digests, len(chunks))
        except ValueError as exc:
            raise AlgorithmError(f"rank {src} sent digests that do not fit its state: "
                                 f"{exc}") from None

    @staticmethod
    def _holding(m: Manifest, primary: Manifest, chunks: list[Chunk]) -> list[bytes] | None:
        """A donor's digests, when its chunks are cut as the primary's (else it holds none)."""
        if m.chunk_bytes != primary.chunk_bytes or len(m.digests) != len(primary.digests):
            return None
        return digests_of(m.digests, len(chunks))

    def _fetch(self, pool: ThreadPoolExecutor, plan: ChunkPlan,
               buffers: list[bytearray]) -> None:
        """Rounds of requests until every chunk of ``plan`` is in ``buffers``, whole; then the
        final round (nothing asked) ends each donor's serving."""
        for r in itertools.count():
            try:
                ask = plan.next_round() if not plan.done else {}
            except ValueError as exc:
                raise AlgorithmError(f"the training state cannot be had whole: {exc}") from None
            donors = [d for d in plan.taken if d not in plan.dropped]
            futures = {d: pool.submit(self._round, d, r, ask.get(d, []), not ask, plan,
                                      buffers) for d in donors}
            for d, f in futures.items():
                arrived, error = f.result()
                for c, whole in arrived:
                    plan.arrived(d, c, whole)
                if error is not None:
                    log.warning("rank %d failed while sending chunks of the state: %s", d, error)
                    plan.donor_failed(d)
            if not ask:
                return

    def _round(self, donor: int, r: int, asked: list[int], final: bool, plan: ChunkPlan,
               buffers: list[bytearray]) -> tuple[list[tuple[int, bool]], Exception | None]:
        """Round ``r`` with one donor: the chunks ``asked`` (maybe none), each checked and,
        when whole, put in its place; after the ``final`` one the donor is done. (chunk,
        whole) per chunk that came, and the error that stopped the round, if one did."""
        mask = np.zeros(len(plan.chunks) + 1, np.uint8)
        mask[asked] = 1
        mask[-1] = final
        arrived: list[tuple[int, bool]] = []
        try:
            self._send_array(donor, mask, self._taking(donor, f"{ASSIGN_NAME}{r}"))
            for c in asked:
                chunk = plan.chunks[c]
                data = self._take_array(donor, np.zeros(chunk.size, np.uint8),
                                        self._taking(donor, f"{CHUNK_NAME}{r}.{c}"))
                whole = data.nbytes == chunk.size and plan.matches(c, data)
                if whole:
                    buffers[chunk.tensor][chunk.start:chunk.stop] = data.tobytes()
                arrived.append((c, whole))
        except Exception as exc:
            return arrived, exc
        return arrived, None

