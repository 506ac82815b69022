"""One numbering of rounds across a count-out: where this daemon's rounds stand, and up to which
round each peer ran a key without us.

Every op's rounds count the calls of its name, on every rank alike, so a rank's n-th call pairs
with its peers' n-th. When a peer daemon and this one counted each other out (a link down, a
stopped process) and the link comes back between the same two processes, both keep that
numbering. Each tells the other the last round of every key it started (:class:`Started`): all
of them ran without the other (ops leave a counted-out peer out, and what waited for it failed
when it was counted out), and every later round includes it again. A round at or below the
peer's horizon (:class:`Horizons`) does not wait for the peer, on either side, whichever of the
two got ahead while they were apart; so every pair of ranks agrees on which rounds it shares,
and no cycle of neighbours can wait on itself.

A restarted (or late) daemon is another process counting from round 0: its rounds are placed
per peer instead (:mod:`decentd.net.late_rounds`).
"""

from __future__ import annotations

import collections

from decentd.keys import OpKey, job_of, owner

#: keys remembered per table; the oldest go first (a name used once is not kept for ever)
MEMORY = 4096


def _owned_by(key: str, rank: int, job: str) -> bool:
    """Whether wire key ``key`` is worker ``rank``'s in ``job``."""
    try:
        return owner(key) == rank and job_of(key) == job
    except ValueError:
        return False


class Started:
    """The last round of each of this daemon's keys that an op started here."""

    def __init__(self) -> None:
        self._last: collections.OrderedDict[str, int] = collections.OrderedDict()

    def note(self, keys: list[OpKey]) -> None:
        """An op started with these keys (name, round)."""
        for name, round_ in keys:
            if round_ >= self._last.get(name, -1):
                self._last[name] = round_
                self._last.move_to_end(name)
        while len(self._last) > MEMORY:
            self._last.popitem(last=False)

    def last(self) -> list[OpKey]:
        """Every key remembered, with the last round started."""
        return list(self._last.items())

    def restarted(self, rank: int, job: str) -> None:
        """Our worker ``rank`` registered again in ``job``: its rounds count from 0."""
        for key in [k for k in self._last if _owned_by(k, rank, job)]:
            del self._last[key]

    def clear(self) -> None:
        """A new job may reuse every key from round 0."""
        self._last.clear()


class Horizons:
    """Per (peer, our key): the last round the peer ran without us, and why (the error a wait
    on those rounds fails with)."""

    def __init__(self) -> None:
        self._until: collections.OrderedDict[tuple[int, str], tuple[int, Exception]] = (
            collections.OrderedDict())

    def ran_without(self, peer: int, name: str, last: int, error: Exception) -> None:
        """``peer`` ran every round of our key ``name`` up to ``last`` without us."""
        held = self._until.get((peer, name))
        if held is None or last > held[0]:
            self._until[(peer, name)] = (last, error)
            self._until.move_to_end((peer, name))
        while len(self._until) > MEMORY:
            self._until.popitem(last=False)

    def gone(self, peer: int, name: str, round_: int) -> Exception | None:
        """The error for waiting on ``peer`` for round ``round_`` of ``name``, if it ran that
        round without us."""
        if not self._until:
            return None
        held = self._until.get((peer, name))
        return held[1] if held is not None and round_ <= held[0] else None

    def restarted(self, rank: int, job: str) -> None:
        """Our worker ``rank`` registered again in ``job``: its rounds count from 0, what the
        peers ran without its predecessor says nothing of them."""
        for key in [k for k in self._until if _owned_by(k[1], rank, job)]:
            del self._until[key]

    def clear(self) -> None:
        """A new job may reuse every key from round 0."""
        self._until.clear()
