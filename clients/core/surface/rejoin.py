"""Who brings a rank that joined late up to date, and when (framework-neutral).

A rank whose daemon restarted (or came up after the job started) takes the model and the
optimizer state before its first step from its *donors*: the lowest worker ranks of the first
:data:`DONORS` daemons that already ran the job. It takes the first donor's state (the
*primary*'s) byte for byte, in checksummed chunks fetched in parallel from every donor that holds
the same bytes (:mod:`decent.core.training.chunks`). The survivors see the join as a new daemon
(or a new incarnation of one) in their membership view, checked whenever a completion carries a
new epoch; the donors among them serve it in the background, the others go on. Both sides pick
the same donors from the same view. The newcomer asks each donor for its step count and names a
step a little ahead of the furthest; each donor snapshots at that step boundary (or at once when
already past it), so that donors in step hold the same bytes and the state is at most a few
steps old.
"""

from __future__ import annotations

from collections.abc import Callable

from decent.core.surface.membership import View

#: the names the state travels under (their rounds are realigned like any other name's); the
#: first op under another name tells the daemon that this rank takes part from now on
REJOIN_PREFIX = "decent.rejoin."
READY_NAME, STEP_NAME, TARGET_NAME = (f"{REJOIN_PREFIX}ready", f"{REJOIN_PREFIX}step",
                                       f"{REJOIN_PREFIX}target")
SIZE_NAME, META_NAME, DIGESTS_NAME = (f"{REJOIN_PREFIX}size", f"{REJOIN_PREFIX}meta",
                                      f"{REJOIN_PREFIX}digests")
#: a round's chunk requests and its chunks (the round and chunk numbers follow)
ASSIGN_NAME, CHUNK_NAME = f"{REJOIN_PREFIX}assign", f"{REJOIN_PREFIX}chunk"


def pair_name(name: str, donor: int, joiner: int) -> str:
    """``name`` for the ops between one donor and one newcomer: a rank's rounds of a name are
    its own, so every pair's names are apart (a donor may serve two newcomers at once)."""
    return f"{name}.{donor}.{joiner}"


#: how many daemons' ranks serve one newcomer (the first is its primary)
DONORS = 3


def donors_among(view: View, newcomers: set[int], per_node: int) -> list[int]:
    """The lowest worker ranks of the first :data:`DONORS` live daemons not among
    ``newcomers`` (daemon ranks)."""
    return [d * per_node for d in view.daemons if d not in newcomers][:DONORS]


def own_donors(view: View, per_node: int) -> list[int]:
    """The donors of a rank that joined late, its primary first: the lowest workers of the
    first :data:`DONORS` daemons that were serving when its daemon reached them."""
    return [d * per_node for d in view.serving[:DONORS]]


class JoinWatch:
    """Tells a survivor which ranks joined since it last looked, and which of them it is a
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
        if first:  # a daemon down now but reached before comes back as the same process
            self._known.update(view.known)
        joined = [] if first else [
            d * self.per_node + k for d, inc in view.incarnations
            if self._known.get(d) != inc for k in range(self.per_node)]
        self._known.update(view.incarnations)
        if not joined:
            return []
        newcomers = {r // self.per_node for r in joined}
        if self.rank not in donors_among(view, newcomers, self.per_node):
            return []
        return [r for r in joined if r != self.rank]
