"""Who brings a rank that joined late up to date, and when (framework-neutral).

A rank whose daemon restarted (or came up after the job started) takes the model and the
optimizer state from one live rank before its first step: its *donor*, the lowest rank among the
daemons that already ran the job. The survivors see the join as a new daemon (or a new
incarnation of one) in their membership view, checked whenever a completion carries a new
epoch; the donor among them sends its state at its next step boundary, the others go on.
Both sides pick the same donor from the same view. The newcomer first says it is ready, and
the donor snapshots at its next step boundary after that: the state is at most a step old.
"""

from __future__ import annotations

from collections.abc import Callable

from decent.core.surface.membership import View

#: the names the state travels under (their rounds are realigned like any other name's); the
#: first op under another name tells the daemon that this rank takes part from now on
REJOIN_PREFIX = "decent.rejoin."
SIZE_NAME, META_NAME, TENSOR_NAME = (f"{REJOIN_PREFIX}size", f"{REJOIN_PREFIX}meta",
                                     f"{REJOIN_PREFIX}t")
READY_NAME = f"{REJOIN_PREFIX}ready"


def donor_among(view: View, newcomers: set[int], per_node: int) -> int | None:
    """The lowest worker rank of a live daemon not among ``newcomers`` (daemon ranks)."""
    donors = [d for d in view.daemons if d not in newcomers]
    return donors[0] * per_node if donors else None


def own_donor(view: View, per_node: int) -> int | None:
    """The donor of a rank that joined late: the lowest worker of a daemon that was serving
    when its daemon reached it."""
    return view.serving[0] * per_node if view.serving else None


class JoinWatch:
    """Tells a survivor which ranks joined since it last looked, and which of them it is the
    donor of. ``membership``: the daemon's view, asked only when the epoch moved."""

    def __init__(self, rank: int, per_node: int, membership: Callable[[], View]) -> None:
        self.rank = rank
        self.per_node = per_node
        self._membership = membership
        self._view: View | None = None
        self._epoch = -1
        #: every daemon's incarnation as last seen: one that drops out and comes back as the
        #: same process (a flapping link) has not joined; a new process, or a new daemon, has
        self._known: dict[int, int] = {}

    def to_serve(self, epoch: int) -> list[int]:
        """The worker ranks this rank must send its state to now (``epoch``: the latest one a
        completion carried)."""
        if epoch == self._epoch:
            return []
        view = self._membership()
        first, self._view, self._epoch = self._view is None, view, epoch
        joined = [] if first else [
            d * self.per_node + k for d, inc in view.incarnations
            if self._known.get(d) != inc for k in range(self.per_node)]
        self._known.update(view.incarnations)
        if not joined:
            return []
        newcomers = {r // self.per_node for r in joined}
        if donor_among(view, newcomers, self.per_node) != self.rank:
            return []
        return [r for r in joined if r != self.rank]
