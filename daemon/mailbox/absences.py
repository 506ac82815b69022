"""Whom an op must not wait for: workers that left (until they register again), rounds a peer
told us it ran without us (its link to us dropped meanwhile: a SKIP), and every round up to the
one a peer ran without us while one of us counted the other out (:mod:`.horizons`)."""

from __future__ import annotations

import collections

from decentd.keys import job_of, owner
from decentd.mailbox.horizons import Horizons

#: workers remembered as gone (what waits for them fails at once)
DEPARTED_MEMORY = 4096
#: rounds peers ran without us, remembered for ops that have not started here yet
SKIPPED_MEMORY = 4096


class Absences:
    """Departed workers by (job, rank), skipped rounds by (peer, name, round), and the rounds
    peers ran without us while apart (``horizons``)."""

    def __init__(self) -> None:
        self._departed: collections.OrderedDict[tuple[str, int], Exception] = (
            collections.OrderedDict())
        self._skipped: collections.OrderedDict[tuple[int, str, int], Exception] = (
            collections.OrderedDict())
        #: per (peer, name): the last round the peer ran without us while we were apart
        self.horizons = Horizons()

    def left(self, job: str, rank: int, error: Exception) -> None:
        """Worker ``rank`` of ``job`` is gone: waiting for it fails with ``error``."""
        self._departed[(job, rank)] = error
        while len(self._departed) > DEPARTED_MEMORY:
            self._departed.popitem(last=False)

    def has_left(self, job: str, rank: int) -> bool:
        """Whether worker ``rank`` of ``job`` left (and has not come back)."""
        return (job, rank) in self._departed

    def joined(self, job: str, rank: int) -> bool:
        """Worker ``rank`` of ``job`` registered (again); whether it had left."""
        return self._departed.pop((job, rank), None) is not None

    def forget(self, rank: int) -> None:
        """Worker ``rank`` is a new one (its daemon restarted): it has not left."""
        for key in [k for k in self._departed if k[1] == rank]:
            del self._departed[key]

    def skipped(self, peer: int, name: str, round_: int, error: Exception) -> None:
        """``peer`` ran round ``round_`` of ``name`` without us."""
        self._skipped[(peer, name, round_)] = error
        while len(self._skipped) > SKIPPED_MEMORY:
            self._skipped.popitem(last=False)

    def departed(self, peer: int, name: str) -> Exception | None:
        """The error for waiting on worker ``peer`` under key ``name`` when it left."""
        try:
            worker_level = bool(self._departed) and owner(name) is not None
        except ValueError:  # no owner: nobody to have left
            return None
        return self._departed.get((job_of(name), peer)) if worker_level else None

    def gone(self, peer: int, name: str, round_: int) -> Exception | None:
        """The error for waiting on ``peer`` for round ``round_`` of ``name``, if any."""
        if self._skipped:
            skipped = self._skipped.get((peer, name, round_))
            if skipped is not None:
                return skipped
        apart = self.horizons.gone(peer, name, round_)
        return apart if apart is not None else self.departed(peer, name)
