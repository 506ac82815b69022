"""Matching incoming tensors to the ops that take them, with one slot record per key.

Every tensor a peer sends is a *part* keyed ``(sender, name, round, tag)``: ``(name, round)``
is the op's key (the job-qualified name and the k-th call of it), the tag a phase within the
op. Whatever message a part came in, it is handed to the op that asks for its key, so two ranks
may fuse the same tensors into different messages. A :class:`Slot` holds everything about one
key: an op waiting for it, what that op accepts, a part arriving or arrived before anyone asked,
a large message announced by RTS, our own part waiting for the peer's acknowledgement.

An op *opens* its keys when it starts and *closes* them when it ends: closing drops every slot of
the op at once, releases what it held, and late arrivals for it are dropped from then on. The
mailbox talks to the network only through an :class:`Outbox` (acknowledgements, clear-to-send),
so it runs without sockets in the unit tests.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Iterable

import numpy as np

from decent_wire.v1 import decent_pb2 as pb
from decentd.keys import OpKey, job_of, node_level, op_name
from decentd.mailbox.absences import Absences
from decentd.mailbox.arrivals import Arrival
from decentd.mailbox.horizons import Started
from decentd.mailbox.records import (
    Accepts,
    Key,
    Landing,
    OpListener,
    Outbox,
    Progress,
    Slot,
    accepts_of,
    key_of,
)
from decentd.net.flow import Announced, MessageId

#: closed ops remembered (their late arrivals are dropped)
CLOSED_MEMORY = 65536
#: aborts kept for ops that have not started here yet
EARLY_ABORT_MEMORY = 4096


class Mailbox:
    """Every slot of one daemon."""

    def __init__(self, outbox: Outbox) -> None:
        self._outbox = outbox
        self._slots: dict[Key, Slot] = {}
        self._by_op: dict[OpKey, set[Key]] = {}
        self._open: dict[OpKey, OpListener] = {}
        self._named: dict[OpKey, dict[OpKey, OpListener]] = {}  #: open ops by op name, round
        self._early_named: dict[OpKey, set[Key]] = {}  #: slots that held early parts, likewise
        self._held: dict[OpKey, list[Arrival]] = {}
        self._closed: collections.OrderedDict[OpKey, None] = collections.OrderedDict()
        self._early_aborts: collections.OrderedDict[OpKey, tuple[int, pb.Error]] = (
            collections.OrderedDict())
        self._arriving_on: dict[object, list[Key]] = {}
        #: slots a local op waits on, by the peer: what its leaving fails, found without a
        #: scan of every slot (peers' frames make slots; only local ops make waiters)
        self._waiting: dict[int, set[Key]] = {}
        #: messages announced by RTS (the tables are the flow module's, bounded per link)
        self.announced = Announced()
        self._announced, self._cleared = self.announced.waiting, self.announced.cleared
        self._discard = self.announced.discard
        #: workers that left and rounds peers ran without us: nothing waits for them
        self.absences = Absences()
        #: the last round of each of our keys an op started (told to a peer counted out and back)
        self.started = Started()
        #: bytes of parts that arrived before their op asked for them
        self.early_bytes = 0

    def _slot(self, key: Key) -> Slot:
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = Slot(key)
            self._by_op.setdefault((key[1], key[2]), set()).add(key)
        return slot

    # ------------------------------------------------------------------ ops

    def open(self, keys: Iterable[OpKey], listener: OpListener) -> list[tuple[int, pb.Error]]:
        """An op starts with these keys; the aborts its peers sent before it did."""
        aborts = []
        keys = list(keys)
        self.started.note(keys)
        for key in keys:
            self._open[key] = listener
            early = self._early_aborts.pop(key, None)
            if early is not None:
                aborts.append(early)
            named = (op_name(key[0]), key[1])
            self._named.setdefault(named, {})[key] = listener
            for slot_key in self._early_named.get(named, ()):  # came before this op began
                slot = self._slots.get(slot_key)
                if slot is not None and slot.early is not None and slot_key[1] != key[0] \
                        and slot.early.op != pb.AGREEMENT:
                    listener.foreign(slot.early.src, slot.early.op)
        return aborts

    def _siblings(self, key: OpKey) -> list[OpListener]:
        """The ops open here under another key of the same op name and round (a worker's and
        its node's, an op's and its agreement's)."""
        named = self._named.get((op_name(key[0]), key[1]), {})
        return [listener for other, listener in named.items() if other != key]

    @property
    def ran_ops(self) -> bool:
        """Whether ops of this daemon's workers have ended here (a job runs)."""
        return bool(self._closed)

    def is_open(self, key: OpKey) -> bool:
        """Whether an op with this key is running here."""
        return key in self._open

    def closed(self, key: OpKey) -> bool:
        """Whether an op with this key ended here (recently)."""
        return key in self._closed

    def expect(self, src: int, name: str, round_: int, tag: int,
               accepts: Accepts | None = None, progress: Progress | None = None,
               into: tuple[np.ndarray, Accepts] | None = None) -> asyncio.Future[Arrival]:
        """A future for the part ``(name, round, tag)`` from ``src``.

        ``accepts``: a part that arrives with exactly that is acknowledged as soon as its header
        is read (on a saturated link the acknowledgement then travels while the payload still
        does), and one already arriving is acknowledged now. ``progress`` is told how far a part
        that travels alone has arrived. ``into`` (a uint8 buffer and what it accepts): such a
        part of exactly that size is received straight into the buffer.
        """
        slot = self._slot((src, name, round_, tag))
        fut: asyncio.Future[Arrival] = asyncio.get_running_loop().create_future()
        if slot.early is not None:
            arrival, slot.early = slot.early, None
            self.early_bytes -= arrival.data.nbytes
            self._held.setdefault((name, round_), []).append(arrival)
            fut.set_result(arrival)
            return fut
        gone = self.absences.gone(src, name, round_)
        if gone is not None:
            fut.set_exception(gone)
            return fut
        slot.waiter = fut
        self._waiting.setdefault(src, set()).add(slot.key)
        if accepts is not None:
            if slot.arriving is not None and accepts == accepts_of(slot.arriving):
                slot.acked = True
                self._outbox.send_acks(src, [(name, round_)], tag, False)
            else:
                slot.accepts = accepts
        slot.progress = progress
        slot.into = into
        if slot.message is not None and slot.message in self._announced:
            self._clear_to_send(slot.message)
        return fut

    def expect_ack(self, dst: int, name: str, round_: int, tag: int) -> asyncio.Future[None]:
        """A future resolved when ``dst`` acknowledges our part ``(name, round, tag)``."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        gone = self.absences.gone(dst, name, round_)
        if gone is not None:
            fut.set_exception(gone)
        else:
            self._slot((dst, name, round_, tag)).ack_waiter = fut
            self._waiting.setdefault(dst, set()).add((dst, name, round_, tag))
        return fut

    # ------------------------------------------------------------------ workers coming and going

    def worker_left(self, job: str, rank: int, error: Exception) -> None:
        """Worker ``rank`` of ``job`` is gone: whatever waits for it fails with ``error``, now
        and until it is back."""
        self.absences.left(job, rank, error)
        keys = self._waiting.get(rank, set())
        for key in list(keys):
            slot = self._slots.get(key)
            if slot is None or (slot.waiter is None and slot.ack_waiter is None):
                keys.discard(key)  # its op ended
            elif self.absences.departed(rank, key[1]) is not None:
                self._fail_waiters(slot, error)
                keys.discard(key)

    def node_left(self, machine: int, job: str, error: Exception) -> None:
        """Every worker of daemon ``machine`` in ``job`` is gone: the node-level ops of that
        job waiting on that daemon fail with ``error`` (nothing will come for them)."""
        keys = self._waiting.get(machine, set())
        for key in list(keys):
            slot = self._slots.get(key)
            if slot is not None and job_of(key[1]) == job and node_level(key[1]):
                self._fail_waiters(slot, error)
                keys.discard(key)

    def worker_joined(self, job: str, rank: int) -> bool:
        """Worker ``rank`` of ``job`` registered (again); whether it had left."""
        return self.absences.joined(job, rank)

    def gone(self, peer: int, name: str) -> Exception | None:
        """The error for waiting on worker ``peer`` under key ``name`` when it left."""
        return self.absences.departed(peer, name)

    def skipped(self, parts: Iterable[pb.Part], error: Callable[[pb.Part], Exception]) -> None:
        """Their senders ran these rounds without us (their link to us dropped meanwhile):
        what waits on them there fails with ``error(part)``, now or when it starts."""
        for p in parts:
            src, key = int(p.src), (p.name, int(p.round))
            if key in self._closed:
                continue
            self.absences.skipped(src, p.name, int(p.round), error(p))
            for slot_key in self._by_op.get(key, ()):
                if slot_key[0] == src:
                    self._fail_waiters(self._slots[slot_key], error(p))

    def ran_without(self, parts: Iterable[pb.Part], error: Callable[[pb.Part], Exception]
                    ) -> None:
        """Their senders ran every round of these keys up to the part's round without us
        (:mod:`decentd.mailbox.horizons`): what waits on those rounds fails with
        ``error(part)``, now or when it starts."""
        last: dict[tuple[int, str], pb.Part] = {}
        for p in parts:
            self.absences.horizons.ran_without(int(p.src), p.name, int(p.round), error(p))
            last[(int(p.src), p.name)] = p
        for src in {src for src, _ in last}:
            waiting = self._waiting.get(src, set())
            for slot_key in list(waiting):
                p = last.get((src, slot_key[1]))
                slot = self._slots.get(slot_key)
                if p is not None and slot is not None and slot_key[2] <= int(p.round):
                    self._fail_waiters(slot, error(p))
                    waiting.discard(slot_key)

    def restarted(self, rank: int, job: str) -> None:
        """Our worker ``rank`` registered again in ``job``: it counts its rounds from 0."""
        self.started.restarted(rank, job)
        self.absences.horizons.restarted(rank, job)

    @staticmethod
    def _fail_waiters(slot: Slot, error: Exception) -> None:
        for fut in (slot.waiter, slot.ack_waiter):
            if fut is not None and not fut.done():
                fut.set_exception(error)
        slot.waiter = slot.ack_waiter = None

    def close(self, keys: Iterable[OpKey]) -> None:
        """The op of these keys ended: drop its slots and what they hold; later arrivals for
        it are dropped, and a payload it cleared to send is dropped if it still comes."""
        keys = list(keys)
        for key in keys:
            self._closed[key] = None
        while len(self._closed) > CLOSED_MEMORY:
            self._closed.popitem(last=False)
        messages: set[MessageId] = set()
        for key in keys:
            self._open.pop(key, None)
            name = (op_name(key[0]), key[1])
            named = self._named.get(name)
            if named is not None:
                named.pop(key, None)
                if not named:
                    del self._named[name]
                    self._early_named.pop(name, None)
            for slot_key in self._by_op.pop(key, ()):
                messages.update(self._drop(self._slots.pop(slot_key)))
                self._waiting.get(slot_key[0], set()).discard(slot_key)
            for arrival in self._held.pop(key, ()):
                arrival.release()
        for msg in messages:
            self._forget_message(msg)

    def _drop(self, slot: Slot) -> list[MessageId]:
        for fut in (slot.waiter, slot.ack_waiter):
            if fut is not None and not fut.done():
                fut.cancel()
        if slot.early is not None:
            self.early_bytes -= slot.early.data.nbytes
            slot.early.release()
        if slot.landing is not None:
            slot.landing.cancel()
        return [slot.message] if slot.message is not None else []

    def _forget_message(self, msg: MessageId) -> None:
        """A message whose parts' ops all ended here: never cleared, or its payload dropped."""
        header = self._announced.get(msg) or self._cleared.get(msg)
        if header is None or not self._all_closed(header.parts):
            return
        if msg in self._announced:
            self.announced.pop(msg)
        else:
            self.announced.dropping(msg)
            self._discard[msg] = None

    def _all_closed(self, parts: Iterable[pb.Part]) -> bool:
        return all((p.name, int(p.round)) in self._closed for p in parts)

    def forget_history(self) -> None:
        """No local worker is left: a new job may reuse keys from round 0, so nothing of the
        old one may linger (no op is open now)."""
        for slot in self._slots.values():
            self._drop(slot)
        self._slots.clear()
        self._waiting.clear()
        self._by_op.clear()
        self._early_named.clear()
        self._closed.clear()
        self._early_aborts.clear()
        self.announced.forget()
        self.started.clear()
        self.absences.horizons.clear()

    # ------------------------------------------------------------------ what peers send

    def header(self, conn: object, parts: Iterable[pb.Part]) -> None:
        """A frame's header arrived on ``conn`` (its payload follows): acknowledge the parts a
        waiting op accepts, and note the rest as arriving."""
        matched: dict[tuple[int, int], list[OpKey]] = {}
        keys = []
        for p in parts:
            key = key_of(p)
            if (key[1], key[2]) in self._closed:
                continue
            slot = self._slot(key)
            if slot.accepts is not None and slot.accepts == accepts_of(p):
                slot.accepts = None
                slot.acked = True
                matched.setdefault((key[0], key[3]), []).append((key[1], key[2]))
            slot.arriving = p
            keys.append(key)
        self._arriving_on[conn] = keys
        for (src, tag), op_keys in matched.items():
            self._outbox.send_acks(src, op_keys, tag, False)

    def arrived(self, conn: object) -> None:
        """``conn``'s frame is complete (or never will be): its parts are not arriving now."""
        for key in self._arriving_on.pop(conn, ()):
            slot = self._slots.get(key)
            if slot is not None:
                slot.arriving = None

    def landing_target(self, part: pb.Part, nbytes: int) -> np.ndarray | None:
        """Where a lone part of ``nbytes`` may land in a waiting op's memory, or None."""
        slot = self._slots.get(key_of(part))
        if slot is None or slot.into is None or slot.waiter is None or slot.waiter.done():
            return None
        buf, accepts = slot.into
        if buf.nbytes != nbytes or accepts != accepts_of(part):
            return None
        slot.into = None
        return buf

    def landing(self, part: pb.Part, landing: Landing | None) -> None:
        """A lone part's payload started (``landing``) or finished (None) landing in place."""
        slot = self._slots.get(key_of(part))
        if slot is not None:
            slot.landing = landing

    def progress(self, part: pb.Part, dest: np.ndarray, filled: int) -> None:
        """``dest[:filled]`` of a lone part's payload has arrived."""
        slot = self._slots.get(key_of(part))
        if slot is not None and slot.progress is not None:
            slot.progress(dest, filled, float(part.weight), part)

    def deliver(self, part: pb.Part, arrival: Arrival) -> None:
        """A whole part arrived: to the op waiting for it, else kept for it."""
        key = key_of(part)
        op_key = (key[1], key[2])
        if op_key in self._closed:
            arrival.release()
            return
        slot = self._slot(key)
        arrival.acked, slot.acked = slot.acked, False
        waiter = slot.waiter
        if waiter is not None and not waiter.done():
            slot.waiter = None
            self._held.setdefault(op_key, []).append(arrival)
            waiter.set_result(arrival)
            return
        if slot.early is not None:  # a resend of the same key replaces the first copy
            self.early_bytes -= slot.early.data.nbytes
            slot.early.release()
        slot.early = arrival
        self.early_bytes += arrival.data.nbytes
        self._early_named.setdefault((op_name(key[1]), key[2]), set()).add(key)
        listener = self._open.get(op_key)
        if listener is not None:
            listener.stray(key, arrival)
        elif arrival.op != pb.AGREEMENT:
            for other in self._siblings(op_key):
                other.foreign(arrival.src, arrival.op)

    def acked(self, parts: Iterable[pb.Part]) -> None:
        """Their senders acknowledged our parts."""
        for p in parts:
            slot = self._slots.get(key_of(p))
            if slot is not None and slot.ack_waiter is not None:
                if not slot.ack_waiter.done():
                    slot.ack_waiter.set_result(None)
                slot.ack_waiter = None

    def aborted(self, parts: Iterable[pb.Part], error: pb.Error) -> None:
        """Their senders failed the ops of ``parts`` and said why: their data is moot."""
        for p in parts:
            src = int(p.src)
            key = (p.name, int(p.round))
            for slot_key in self._by_op.get(key, ()):
                slot = self._slots[slot_key]
                if slot.early is not None:
                    self.early_bytes -= slot.early.data.nbytes
                    slot.early.release()
                    slot.early = None
            if key in self._closed:
                continue
            listener = self._open.get(key)
            if listener is not None:
                listener.aborted(src, error)
                continue
            for other in self._siblings(key):  # the op of that name failed there
                other.aborted(src, error)
            self._early_aborts[key] = (src, error)
            while len(self._early_aborts) > EARLY_ABORT_MEMORY:
                self._early_aborts.popitem(last=False)

    def peer_lost(self, link: int, reaches: Callable[[Key], bool], error: Exception) -> None:
        """Daemon ``link``'s connection is gone: whatever waits on a peer there (``reaches``
        tells a slot's) fails with ``error``; its messages, and the slots that hold nothing it
        sent, are dropped."""
        self.announced.drop_link(link)
        for key, slot in list(self._slots.items()):
            if not reaches(key):
                continue
            for fut in (slot.waiter, slot.ack_waiter):
                if fut is not None and not fut.done():
                    fut.set_exception(error)
            slot.waiter = slot.ack_waiter = slot.into = slot.message = None
            if slot.early is None and slot.landing is None:
                del self._slots[key]
                self._waiting.get(key[0], set()).discard(key)
                op_slots = self._by_op[(key[1], key[2])]
                op_slots.discard(key)
                if not op_slots:
                    del self._by_op[(key[1], key[2])]

    # ------------------------------------------------------------------ large messages (RTS)

    def announce(self, link: int, message_id: int, header: pb.BulkHeader) -> None:
        """Daemon ``link`` announced a message too large to send eagerly; it is cleared to send
        at once if an op that takes one of its parts runs here, else when one starts."""
        if self._all_closed(header.parts):
            return  # late: its ops ended here (the sender's fail by timeout or ABORT)
        msg = (link, message_id)
        self.announced.hold(msg, header, cleared=False)
        wanted = False
        for p in header.parts:
            slot = self._slot(key_of(p))
            slot.message = msg
            wanted = wanted or slot.waiter is not None or (p.name, int(p.round)) in self._open
        if wanted:
            self._clear_to_send(msg)

    def clear_at_once(self, link: int, message_id: int, header: pb.BulkHeader) -> None:
        """Clear a message nothing local waits for (a one-sided window request) now."""
        self.announced.hold((link, message_id), header, cleared=True)
        self._outbox.send_cts(link, message_id)

    def _clear_to_send(self, msg: MessageId) -> None:
        header = self._announced.pop(msg, None)
        if header is not None:
            self._cleared[msg] = header
            self._outbox.send_cts(*msg)

    # ------------------------------------------------------------------ counters

    @property
    def slot_count(self) -> int:
        """Slots held (for tests and status)."""
        return len(self._slots)

