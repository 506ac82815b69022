"""Rounds of peers that joined late: a restarted or late node counts its rounds from 0 again.

Every name's rounds count the calls of that name, so two ranks that ran side by side pair their
n-th calls. A peer that joins while this daemon is running (it restarted, or it was not up at
start) begins at round 0 while our workers are at round R. From our first op of a name that
involves such a peer, its round 0 is our round R: we keep that offset per (peer, name) and
translate what goes to and comes from the peer; the peer translates nothing (its own peers were
all up when it started). A part that arrives before our first op of its name involves the peer
waits, whole frame and payload, until that op starts and its offset is known
(:mod:`decentd.mailbox.parking`: this map only says which frames can be placed).

Peers are ids of their level: a worker rank, or ``-(daemon rank + 1)`` for a node-level key.
A peer whose daemon restarted or came late is late in every job; a worker that registered again
in its job is late in that job only (in a later job it is a new worker, at round 0 with
everyone). When one of our own workers registers again in a job, it is the late one: the peers
translate for it, and for its keys nothing here does, except for peers that come back after it.
"""

from __future__ import annotations

from decent_wire.v1 import decent_pb2 as pb
from decentd.keys import job_of, owner

#: window requests, which arrive without a local op to match them, and their answers: no
#: round of theirs pairs with one of the target's
ONE_SIDED = frozenset({pb.WIN_PUT, pb.WIN_ACCUMULATE, pb.WIN_GET, pb.WIN_EXCHANGE,
                       pb.GROUP_TRIGGER, pb.GROUP_RESULT, pb.WIN_LOCK, pb.WIN_UNLOCK})


def peer_id(rank: int, name: str) -> int:
    """The id of the peer ``rank`` (of the level of the key ``name``)."""
    return rank if owner(name) is not None else -(rank + 1)


class RoundMap:
    """Round offsets of the peers that joined after this daemon was ready."""

    def __init__(self) -> None:
        #: set once the daemon is ready: peers that come up later are late
        self.ready = False
        #: when each late peer came back (a sequence number), in every job or in one
        self._late: dict[int, int] = {}
        self._late_in: dict[tuple[int, str], int] = {}  #: (peer, job)
        #: when each of our workers (rank, job) registered again: peers late before are not
        #: late for its keys
        self._restarted: dict[tuple[int, str], int] = {}
        self._seq = 0
        self._offsets: dict[tuple[int, str], int] = {}

    @property
    def any_late(self) -> bool:
        """Whether any peer is late (else nothing is translated)."""
        return bool(self._late or self._late_in)

    def joined(self, peers: list[int], job: str | None = None) -> None:
        """These peers (ids) came up after this daemon was ready: they count from 0 again, in
        ``job`` only (a worker that registered again in it), or in every job (None)."""
        if not self.ready:
            return
        self._seq += 1
        for peer in peers:
            if job is None:
                self._late[peer] = self._seq
            else:
                self._late_in[(peer, job)] = self._seq
            for key in [k for k in self._offsets
                        if k[0] == peer and job in (None, job_of(k[1]))]:
                del self._offsets[key]

    def restarted_here(self, rank: int, job: str) -> None:
        """Our worker ``rank`` registered (again) in ``job``: it counts from round 0, the peers
        translate for it; what we placed for its keys goes."""
        self._seq += 1
        self._restarted[(rank, job)] = self._seq
        for key in [k for k in self._offsets if owner(k[1]) == rank and job_of(k[1]) == job]:
            del self._offsets[key]

    def is_late(self, peer: int, name: str) -> bool:
        """Whether ``peer`` (an id) joined late for the key ``name`` (its job's), after the
        worker whose key it is registered."""
        job = job_of(name)
        came = max(self._late.get(peer, 0), self._late_in.get((peer, job), 0))
        if not came:
            return False
        mine = owner(name)
        return mine is None or came > self._restarted.get((mine, job), 0)

    def establish(self, peer: int, name: str, round_: int) -> bool:
        """Our op of ``name`` at ``round_`` involves late ``peer``: its round 0 is ``round_``,
        unless an earlier op placed it. Whether this placed it (frames kept for it may be
        placeable now)."""
        if not self.is_late(peer, name) or (peer, name) in self._offsets:
            return False
        self._offsets[(peer, name)] = round_
        return True

    def unplaced(self, peer: int, p: pb.Part) -> bool:
        """Whether ``peer`` is late and none of our ops of ``p``'s name has placed it yet:
        what an op that started before it came back would send it names a round it never
        ran (window messages pair with no round)."""
        return self.is_late(peer, p.name) and p.op not in ONE_SIDED and p.op != pb.WIN_REPLY \
            and (peer, p.name) not in self._offsets

    def outgoing(self, peer: int, name: str, round_: int) -> int:
        """The round the late ``peer`` knows our round ``round_`` of ``name`` by."""
        off = self._offsets.get((peer, name))
        return round_ if off is None else round_ - off

    def incoming(self, peer: int, name: str, round_: int) -> int | None:
        """Our round for ``peer``'s round ``round_`` of ``name``; None when the peer is late
        and no op of ours placed it yet (none of its rounds so far pairs with one of ours)."""
        if not self.is_late(peer, name):
            return round_
        off = self._offsets.get((peer, name))
        return None if off is None else round_ + off

    def placeable(self, src: int, header: pb.BulkHeader) -> bool:
        """Whether every part of ``header`` (from daemon ``src``) that pairs with a round has
        a known round here (window messages pair with none: a late peer's answer to our
        window request is placed at once)."""
        del src
        for p in header.parts:
            if p.op in ONE_SIDED or p.op == pb.WIN_REPLY:
                continue
            peer = peer_id(int(p.src), p.name)
            if self.is_late(peer, p.name) and (peer, p.name) not in self._offsets:
                return False
        return True

    def translate(self, header: pb.BulkHeader) -> None:
        """Rewrite the rounds of ``header``'s parts into ours (call once per frame, after
        :meth:`placeable`)."""
        for p in header.parts:
            off = self._offsets.get((peer_id(int(p.src), p.name), p.name))
            if off is not None:
                p.round = int(p.round) + off
