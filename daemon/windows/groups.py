"""WAGMA's group sums: a group round is summed once, by its leader's daemon, from every member's
last published copy, and sent to every member's daemon, where the member's op finds it whether it
came before or after.

A round has one outcome: its leader decides it once (the sum, or an error every member gets).
Members whose calls reached it before the decision and disagree on the round's terms (dtype,
shape, group size, rule) fail it for all; a call that disagrees with a round decided before it
came fails alone (the members that have their results keep them: nobody waits for late calls).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from decent_wire import dtypes
from decent_wire.errors import DecentError
from decent_wire.graphs import butterfly_group
from decent_wire.numerics import weighted_sum
from decent_wire.v1 import decent_pb2 as pb
from decentd.concurrency import TaskSet, gather_all
from decentd.errors import PeerLost
from decentd.keys import display_name, owner, part
from decentd.mailbox.arrivals import Arrival
from decentd.mailbox.slots import Mailbox
from decentd.net.links import Links
from decentd.security.auth import shown
from decentd.windows.store import REPLY, REQUEST, WindowStore

log = logging.getLogger("decentd.windows")

#: group rounds remembered (results not yet collected, rounds a leader ran)
GROUP_MEMORY = 4096
#: rounds of the leader's own reads of its members' copies: far above any worker's round
FETCH_BASE = 1 << 62
#: group sums a leader runs at once (each holds a copy of the window)
MAX_SUMS = 256

#: a group round: (window wire name, the member's k-th call)
GroupKey = tuple[str, int]
#: a group sum, the most steps a member's copy in it lagged the round, how many members' copies
#: it sums (the live ones: a group shrinks when members are gone) and the round's terms
GroupSum = tuple[np.ndarray, int, int, str]
RULES = {pb.GROUP_MEAN: "mean", pb.GROUP_WITH_SELF: "with-self"}


def group_terms(dtype: int, shape: tuple[int, ...], group_size: int, rule: int) -> str:
    """What every member of a group round asks alike (compared by the leader and each member)."""
    return (f"{dtypes.describe(dtype, shape)}, group_size {group_size}, "
            f"rule {RULES.get(rule, rule)}")


def late_call(window: str, round_: int, leader: int, decided: str, member: int,
              terms: str) -> DecentError:
    """MISMATCH for a call that disagrees with a group round decided before it came."""
    return DecentError(pb.MISMATCH, f"window '{window}': group round {round_} (leader rank "
                                    f"{leader}) ran as {decided}; rank {member} asks {terms}, so "
                                    "its call fails")


def disagreement(name: str, round_: int, asked: dict[int, str]) -> DecentError:
    """MISMATCH naming which members asked what of one group round."""
    by_terms: dict[str, list[int]] = {}
    for member in sorted(asked):
        by_terms.setdefault(asked[member], []).append(member)
    said = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} "
                     f"{'ask' if len(r) > 1 else 'asks'} {t}" for t, r in by_terms.items())
    return DecentError(pb.MISMATCH, f"group of window '{display_name(name)}' round {round_}: "
                                    f"the members disagree, so none gets a result: {said}")


def _owner(name: str) -> int:
    """The worker whose window (and group round) ``name`` is."""
    who = owner(name)
    if who is None:
        raise DecentError(pb.INVALID_ARGUMENT, f"window '{display_name(name)}' has no worker")
    return who


def _bounded(table: collections.OrderedDict[GroupKey, Any], limit: int) -> None:
    while len(table) > limit:
        table.popitem(last=False)


class GroupSums:
    """The group rounds this daemon leads or waits for."""

    def __init__(self, store: WindowStore, links: Links, mailbox: Mailbox,
                 live: Callable[[int], bool] = lambda _rank: True) -> None:
        """``live(worker rank)``: whether a member takes part (the group of a round is its
        butterfly group's live members, led by the first of them)."""
        self._store = store
        self.live = live
        self._links = links
        self._mailbox = mailbox
        self._tasks = TaskSet()
        #: group sums that came before their member asked
        self._results: collections.OrderedDict[GroupKey, GroupSum] = collections.OrderedDict()
        self._waiters: dict[GroupKey, asyncio.Future[GroupSum]] = {}
        self._leaders: dict[GroupKey, int] = {}  #: the leader each waiter waits for
        self._led: collections.OrderedDict[GroupKey, None] = collections.OrderedDict()
        #: group rounds whose leader failed, for members that have not asked yet
        self._failures: collections.OrderedDict[GroupKey, DecentError] = (
            collections.OrderedDict())
        #: the terms each member's call that reached the leader asked of a round, and the
        #: terms of the rounds decided
        self._asked: collections.OrderedDict[GroupKey, dict[int, str]] = (
            collections.OrderedDict())
        self._decided: collections.OrderedDict[GroupKey, str] = collections.OrderedDict()
        self._fetches = itertools.count(1)
        self.calls_led = 0  #: members' calls of rounds this daemon leads that reached it
        self._running = 0  #: group sums running

    def on_trigger(self, src: int, name: str, round_: int, arrival: Arrival) -> None:
        """A member of a group this rank leads arrived (its group size rides as the weight)."""
        arrival.release()
        try:
            self.lead(name, round_, src, int(arrival.weight), arrival.dtype, arrival.shape,
                      arrival.topology)
        except DecentError as err:
            self._links.outbox.send_abort(src, [(name, round_)], err.to_pb(), pb.GROUP_RESULT)

    def on_result(self, src: int, name: str, round_: int, arrival: Arrival) -> None:
        """The leader's sum of a group round this rank is a member of."""
        total = arrival.data.view(dtypes.STORAGE[arrival.dtype]).copy()
        arrival.release()
        self._arrived((name, round_), (total, arrival.step, max(1, round(arrival.p)),
                                       arrival.topology))

    def lead(self, name: str, round_: int, member: int, group_size: int, dtype: int,
             shape: tuple[int, ...], terms: str) -> None:
        """``member`` of this rank's group at ``round_`` arrived asking ``terms``: sum the
        group once (MISMATCH: the round was decided already, on other terms)."""
        key = (name, round_)
        self.calls_led += 1
        self._asked.setdefault(key, {})[member] = terms
        _bounded(self._asked, GROUP_MEMORY)
        decided = self._decided.get(key)
        if decided is not None and decided != terms:
            raise late_call(display_name(name), round_, _owner(name), decided, member, terms)
        if key in self._led:
            return
        if self._running >= MAX_SUMS:
            raise DecentError(pb.RESOURCE_EXHAUSTED, f"group of window '{display_name(name)}' "
                              f"round {round_}: its leader runs {MAX_SUMS} group sums already")
        self._led[key] = None
        _bounded(self._led, GROUP_MEMORY)
        self._running += 1
        self._tasks.spawn(self._sum_group(name, round_, group_size, dtype, shape, terms))

    async def _sum_group(self, name: str, round_: int, group_size: int, dtype: int,
                         shape: tuple[int, ...], terms: str) -> None:
        try:
            await self._lead_round(name, round_, group_size, dtype, shape, terms)
        finally:
            self._running -= 1

    async def _lead_round(self, name: str, round_: int, group_size: int, dtype: int,
                          shape: tuple[int, ...], terms: str) -> None:
        rank = _owner(name)
        members = self.members(rank, group_size, round_)
        others = [m for m in members if m != rank]
        fetch = FETCH_BASE + next(self._fetches)
        try:
            total, staleness, count = await self._gather(name, round_, fetch, members, dtype,
                                                         shape)
            self._decide((name, round_), terms)
            result = part(name, round_, REQUEST, pb.GROUP_RESULT, dtype, shape, total.nbytes)
            result.step, result.p, result.topology = staleness, float(count), terms
            self._arrived((name, round_), (total, staleness, count, terms))
            payload = [total.view(np.uint8).data]
            await gather_all(*(self._links.outbox.send_parts(m, [result], payload)
                               for m in others))
        except (DecentError, TimeoutError, ConnectionError) as exc:
            err = exc if isinstance(exc, DecentError) else DecentError(
                pb.TIMEOUT if isinstance(exc, TimeoutError) else pb.PEER_UNAVAILABLE,
                f"group of window '{display_name(name)}' round {round_} (leader rank "
                f"{rank}, members {members}): {exc!r}")
            log.warning("%s", shown(str(err), 400))
            for m in others:
                self._links.outbox.send_abort(m, [(name, round_)], err.to_pb(), pb.GROUP_RESULT)
            self.failed(name, round_, err.to_pb())
        finally:
            self._mailbox.close([(name, fetch)])

    async def _gather(self, name: str, round_: int, fetch: int, members: list[int],
                      dtype: int, shape: tuple[int, ...]) -> tuple[np.ndarray, int, int]:
        """Every member's copy as its daemon holds it, summed in rank order."""
        rank, timeout = _owner(name), self._store.timeout
        w = self._store.windows.get(name)
        if w is None or w.own is None:
            raise DecentError(pb.NOT_FOUND, f"window '{display_name(name)}' does not exist on "
                                            f"rank {rank}, the leader of group {members}")
        if (w.dtype, w.shape) != (dtype, shape):
            raise DecentError(pb.MISMATCH, f"window '{w.display}': a member of group {members} "
                              f"has {dtypes.describe(dtype, shape)}, its leader rank "
                              f"{rank} {w.describe()}")
        others = [m for m in members if m != rank]
        copies = {rank: (w.own.copy(), w.step)}
        futs = {m: self._mailbox.expect(m, name, fetch, REPLY) for m in others}
        ask = part(name, fetch, REQUEST, pb.WIN_GET, dtype, shape, 0)
        await asyncio.wait_for(gather_all(
            *(self._links.outbox.send_parts(m, [ask], [memoryview(b"")]) for m in others)), timeout)
        for m, fut in futs.items():
            try:
                a = await asyncio.wait_for(fut, timeout)
            except PeerLost:  # a member gone meanwhile: the group shrinks
                continue
            if (a.dtype, a.shape) != (dtype, shape) or a.data.nbytes != w.nbytes:
                raise DecentError(pb.MISMATCH, f"window '{w.display}': rank {m} holds "
                                  f"{dtypes.describe(a.dtype, a.shape)}, its group leader "
                                  f"rank {rank} {w.describe()}")
            copies[m] = (a.data.view(dtypes.STORAGE[dtype]).copy(), a.step)
            a.release()
        ordered = [copies[m][0] for m in members if m in copies]
        total = np.empty_like(ordered[0])
        weighted_sum(total, ordered[0], 1.0, [(c, 1.0) for c in ordered[1:]], dtype)
        return (total, max(round_ - min(round_, step) for _, step in copies.values()),
                len(ordered))

    def _decide(self, key: GroupKey, terms: str) -> None:
        """The round's sum is ready: its terms are fixed now, unless the calls that reached
        this leader disagree (MISMATCH for every member)."""
        asked = self._asked.pop(key, {})
        if len(set(asked.values())) > 1:
            raise disagreement(*key, asked)
        self._decided[key] = terms
        _bounded(self._decided, GROUP_MEMORY)

    def members(self, rank: int, group_size: int, round_: int) -> list[int]:
        """The live members of ``rank``'s group at ``round_`` (``rank`` always)."""
        return [m for m in butterfly_group(rank, self._store.size, group_size, round_)
                if m == rank or self.live(m)]

    def peer_lost(self, gone: Callable[[int, str], bool]) -> None:
        """Members waiting for a leader that is gone fail (PeerLost): they go on without it."""
        for key, leader in list(self._leaders.items()):
            if gone(leader, key[0]):
                self._leaders.pop(key, None)
                fut = self._waiters.pop(key, None)
                if fut is not None and not fut.done():
                    fut.set_exception(PeerLost(f"group of window '{display_name(key[0])}' "
                                               f"round {key[1]}: its leader rank {leader} is "
                                               "gone"))

    def failed(self, name: str, round_: int, error: pb.Error) -> None:
        """The leader could not sum group round ``round_``: its members' ops fail with why."""
        err = DecentError(error.code or pb.ABORTED, error.message)
        waiter = self._waiters.pop((name, round_), None)
        if waiter is not None and not waiter.done():
            waiter.set_exception(err)
            return
        self._failures[(name, round_)] = err
        _bounded(self._failures, GROUP_MEMORY)

    def _arrived(self, key: GroupKey, result: GroupSum) -> None:
        """The group sum of a round: to the member's waiting op, or kept until it asks."""
        fut = self._waiters.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(result)
            return
        self._results[key] = result
        _bounded(self._results, GROUP_MEMORY)

    def result(self, key: GroupKey) -> GroupSum | None:
        """The group sum of a round if it is here already (its failure raises)."""
        failed = self._failures.pop(key, None)
        if failed is not None:
            raise failed
        return self._results.pop(key, None)

    def wait(self, key: GroupKey, leader: int) -> asyncio.Future[GroupSum]:
        """A future for the group sum of a round that is not here yet (from ``leader``)."""
        fut: asyncio.Future[GroupSum] = asyncio.get_running_loop().create_future()
        self._waiters[key] = fut
        self._leaders[key] = leader
        return fut

    def stop_waiting(self, key: GroupKey) -> None:
        """The member's op ended: a sum that comes later is kept for nobody."""
        self._waiters.pop(key, None)
        self._leaders.pop(key, None)

    def forget(self, name: str) -> None:
        """Window ``name`` was freed: its group rounds may start from 1 again."""
        for table in (self._led, self._results, self._failures, self._asked, self._decided):
            for key in [k for k in table if k[0] == name]:
                del table[key]
