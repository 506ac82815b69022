"""Keeping the links alive: heartbeats, death detection, reconnecting, and the view they give.

One :class:`Supervisor` per daemon. It reaches every peer at start and again whenever a link
drops, with backoff, for as long as the daemon runs; it declares a peer dead after
``faults.peer_dead_after`` seconds of silence on both connections, or at once when its link
dropped and reopening it failed. A link is up when both connections work (ours to the peer,
and the peer's to us, proven by its HELLO).

Dropping a link fails whatever waits on that peer with :class:`~decentd.errors.PeerLost` (a
neighbor op under ``reweight`` goes on without it), drops the peer's pending messages and
window state, and starts flow control afresh: nothing sent before the drop is applied after
it, and nothing is resent, so every part is applied at most once. A peer that comes back with
a new incarnation (restarted) is a new member: the old one's state is gone with its link.

Every change of the live set raises the epoch and is told to the live peers (a VIEW frame),
and every heartbeat carries the view, so the live daemons converge on one view
(:mod:`decentd.membership.view`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import grpc

from decent_wire.v1 import decent_pb2 as pb
from decentd.errors import PeerLost, StartupError
from decentd.mailbox.parking import ParkedFrames
from decentd.mailbox.slots import Mailbox
from decentd.membership.view import Member, Membership, PeerState
from decentd.net.dial import connect_peer
from decentd.net.links import Links
from decentd.net.outbound import Sender
from decentd.net.peer import PeerLink

log = logging.getLogger("decentd.net.links")

#: the first wait before reaching a peer again; doubled up to ``faults.reconnect_max_delay``
FIRST_DELAY = 0.05
#: one attempt to reach a peer gives up after this long: a refused connection fails it at once
#: (the peer is dead), a slow handshake is retried within it
ATTEMPT_TIMEOUT = 1.0


class Supervisor:
    """Connects, watches and reconnects the links of one daemon; keeps its membership view."""

    def __init__(self, links: Links, members: Membership, mailbox: Mailbox,
                 parking: ParkedFrames,
                 windows_lost: Callable[[Callable[[int, str], bool]], None],
                 heartbeat: float, dead_after: float, max_delay: float) -> None:
        self.links = links
        self.members = members
        self.mailbox = mailbox
        self.parking = parking
        self._windows_lost = windows_lost
        self.heartbeat = heartbeat
        self.dead_after = dead_after
        self.max_delay = max_delay
        #: a peer's reconnect task, while it is not up
        self._reaching: dict[int, asyncio.Task[None]] = {}
        self._kick: dict[int, asyncio.Event] = {r: asyncio.Event() for r in links.links}
        self._heard_bytes: dict[int, int] = {}
        #: the wait before reaching a peer whose link keeps dropping soon after it came up
        self._drop_delay: dict[int, float] = {}
        self.changed = asyncio.Event()  #: set on every state change (start waits on it)
        self.closing = False  #: the daemon stops: links that drop stay down
        members.listen(lambda _rank, _state: self.changed.set())

    # ------------------------------------------------------------------ start

    async def start(self, timeout: float, needed: int) -> None:
        """Reach every peer; return once ``needed`` daemons (this one included) are up, or
        raise StartupError naming those missing at ``timeout``."""
        for rank in self.links.links:
            self._reach(rank)
        deadline = time.monotonic() + timeout
        while len(self.members.live_daemons()) < needed:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in self.links.links if not self.members.is_up(r)]
                where = ", ".join(f"{r} ({self.links.links[r].address})" + (
                    f" [{self.members.members[r].refusal}]" if self.members.members[r].refusal
                    else "") for r in missing)
                raise StartupError(f"peers not reachable after {timeout:.0f}s start timeout: "
                                   f"rank(s) {where}")
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(left, 0.5))

    def _reach(self, rank: int, wait: float = 0.0) -> None:
        """Keep trying to reach ``rank`` until it is up (one task per peer), the first time
        after ``wait`` seconds."""
        if self.closing:
            return
        task = self._reaching.get(rank)
        if task is not None and not task.done():
            self._kick[rank].set()
            return
        self._reaching[rank] = asyncio.get_running_loop().create_task(
            self._reconnect(rank, wait))

    async def _reconnect(self, rank: int, wait: float) -> None:
        """Reach ``rank`` until the link is up both ways: our connection opened, and the peer's
        to us proven by its HELLO (which our handshake prompts). When the peer's does not come
        within :meth:`_half_open_grace`, ours goes and the handshake is made again."""
        link = self.links.links[rank]
        if wait:
            await asyncio.sleep(wait)
        delay = FIRST_DELAY
        half_open = self._half_open_grace()
        while not self.members.is_up(rank) and not self.closing:
            if link.connected:
                opened = time.monotonic()
                while not self.members.is_up(rank) and time.monotonic() - opened < half_open:
                    await self._changed_or(rank, half_open - (time.monotonic() - opened))
                if self.members.is_up(rank) or self.closing:
                    return
                log.info("rank %d: our connection is up but its connection to us did not "
                         "come in %gs; handshaking again", rank, half_open,
                         extra={"peer": rank})
                self._drop(rank, "its connection to us did not come", self._idle_state(rank))
                half_open = min(2 * half_open, max(self.dead_after, half_open))
            if await self._attempt(link):
                delay = FIRST_DELAY
                continue
            delay = FIRST_DELAY if await self._changed_or(rank, delay) else \
                min(2 * delay, self.max_delay)

    async def _attempt(self, link: PeerLink) -> bool:
        """One try at opening our connection to ``link``'s peer; whether it opened."""
        rank = link.rank
        try:
            reply = await asyncio.wait_for(
                connect_peer(self.links, link, time.monotonic() + ATTEMPT_TIMEOUT,
                             self.members.members[rank].declared_down,
                             self._sender_broken, self.mailbox.ran_ops),
                ATTEMPT_TIMEOUT + 1)
        except StartupError as exc:  # refused: another cluster, topology, secret...
            # not fatal: a misconfigured or hostile process at a peer's address must not
            # stop us; the real peer may still come (the start timeout names this reason)
            if str(exc) != self.members.members[rank].refusal:
                log.error("%s", exc)
            self.members.members[rank].refusal = str(exc)
            self._failed_attempt(link, str(exc))
        except (ConnectionError, OSError, TimeoutError, grpc.aio.AioRpcError) as exc:
            self._failed_attempt(link, f"unreachable ({exc or type(exc).__name__})")
        else:
            if not self.closing:
                self._connected(link, reply)
            return True
        return False

    async def _changed_or(self, rank: int, timeout: float) -> bool:
        """Wait for news of ``rank`` (its handshake, its HELLO) or ``timeout`` seconds; whether
        news came."""
        kick = self._kick[rank]
        try:
            await asyncio.wait_for(kick.wait(), max(0.0, timeout))
            return True
        except TimeoutError:
            return False
        finally:
            kick.clear()

    def _half_open_grace(self) -> float:
        """How long our open connection waits for the peer's before we handshake again: a few
        attempts' time (the peer is reaching us too, prompted by our handshake)."""
        return max(3 * ATTEMPT_TIMEOUT, 2 * self.heartbeat)

    def _idle_state(self, rank: int) -> PeerState:
        """The state a peer that is not up stays in while we reach it again."""
        return PeerState.DOWN if self.members.state(rank) is PeerState.DOWN \
            else PeerState.RECONNECTING

    def _failed_attempt(self, link: PeerLink, reason: str) -> None:
        """Reaching ``link``'s peer failed: a peer we had is dead now (unless it reached us
        meanwhile: then it is alive, and we try again)."""
        if link.channel is not None:  # a fresh channel next time: no gRPC backoff of its own
            asyncio.get_running_loop().create_task(link.channel.close(grace=None))
            link.channel = None
        if self.members.state(link.rank) is PeerState.RECONNECTING and link.inbound is None:
            self._declare_down(link.rank, reason)

    def _sender_broken(self, sender: Sender, error: BaseException) -> None:
        """A write to a peer failed: its link drops, and we reach it again."""
        link = self.links.links.get(sender.peer)
        if link is not None and link.sender is sender:
            self.link_lost(sender.peer, f"sending failed: {type(error).__name__}: {error}")

    def _connected(self, link: PeerLink, reply: pb.HandshakeReply) -> None:
        """Our connection to ``link``'s peer is open: up once its connection to us is too
        (its reply: its incarnation, whether a job runs there, whether it counted us out)."""
        incarnation = int(reply.incarnation)
        member = self.members.members[link.rank]
        self.members.joined_running |= reply.serving
        member.serving = reply.serving
        if not self.members.is_up(link.rank):
            member.peer_declared_down |= reply.was_down
        known = self.members.incarnation_of(link.rank)
        if known and incarnation != known:
            log.info("rank %d restarted (incarnation %d, was %d)", link.rank, incarnation, known)
        member.incarnation = incarnation
        self._afresh_if_apart(link.rank)
        self._check_up(link.rank)

    def _afresh_if_apart(self, rank: int) -> None:
        """Count daemon ``rank`` afresh if it is not up and it and we ran rounds apart."""
        if not self.members.is_up(rank) and self._apart(self.members.members[rank]):
            self._count_afresh(rank, "it counted this daemon out, or restarted")

    def _apart(self, member: Member) -> bool:
        """Whether ``member`` and this daemon ran rounds without each other since it was last
        up here: either counted the other out, or it is another process (a restart, or a
        late start while a job runs here)."""
        return member.declared_down or member.peer_declared_down or self._new_process(member)

    def _new_process(self, member: Member) -> bool:
        """Whether ``member`` is another process than when it was last up here (a restart, or
        a late start while a job runs here): it counts its rounds from 0."""
        return member.up_incarnation != member.incarnation and self.links.rounds.ready

    def _count_afresh(self, rank: int, reason: str) -> None:
        """Daemon ``rank`` and this one ran rounds without each other: what waits on it fails
        now (it will not send those rounds) and ops leave it out until it is up. The same
        process keeps its numbering: once its link is up, each tells the other the rounds it
        ran without it (:mod:`decentd.mailbox.horizons`). A new process counts from 0: its
        rounds are placed afresh from our first op with it (:mod:`decentd.net.late_rounds`; it
        does the same with ours), before any frame of its new rounds can arrive."""
        member = self.members.members[rank]
        if self._new_process(member) and not member.placed_afresh:
            member.placed_afresh = True
            per = self.links.per_node
            self.links.rounds.joined([-(rank + 1), *range(rank * per, (rank + 1) * per)])
        if member.afresh:
            return
        member.afresh = True
        if self.members.state(rank) is not PeerState.DOWN:  # down: forgotten already
            self._forget(rank, reason)

    def _check_up(self, rank: int) -> None:
        link = self.links.links[rank]
        if link.connected and link.inbound is not None and not self.members.is_up(rank):
            link.last_heartbeat = time.monotonic()
            member = self.members.members[rank]
            restarted = member.up_incarnation != member.incarnation
            known = member.up_incarnation != 0  # it was up here before, as another process
            self._afresh_if_apart(rank)  # both ran rounds alone: placed afresh
            fresh = member.afresh
            member.up_incarnation = member.incarnation
            member.declared_down = member.peer_declared_down = member.afresh = False
            member.placed_afresh = False
            member.refusal = ""
            if restarted and (known or not member.serving):
                self._new_workers(rank)
            self.links.reopened(rank, flush=not fresh)
            if fresh and not restarted:  # the same process: one numbering, rounds told
                self.links.outbox.send_ran_without(rank, self.mailbox.started.last())
            self.members.set_state(rank, PeerState.UP, "connected")
            log.info("rank %d is up (both connections; epoch %d, live %s)", rank,
                     self.members.epoch, self.members.live_daemons(), extra={"peer": rank})
            self._tell_view()
            self._kick[rank].set()  # its reconnect task ends

    # ------------------------------------------------------------------ events (PeerEvents)

    def link_bound(self, src: int) -> None:
        """The peer's connection to us said a valid HELLO."""
        self._check_up(src)

    def link_lost(self, src: int, reason: str) -> None:
        """The peer's connection to us ended: drop the link and reach the peer again (dead
        at once when that fails)."""
        if self.closing:
            return
        if self.members.state(src) is PeerState.DOWN and not self.links.links[src].connected:
            self._forget(src, f"its connection ended ({reason})")  # what it left here goes
            return
        orderly = reason == "stream closed"
        (log.info if orderly else log.warning)(
            "rank %d: link dropped (%s); reconnecting", src, reason,
            extra={"peer": src})
        up_for = time.monotonic() - self.members.members[src].since
        self._drop(src, f"its connection ended ({reason})", PeerState.RECONNECTING)
        # a link that drops again and again right after it came up (a peer that keeps sending
        # what we refuse) is reopened with backoff, not in a tight loop
        delay = 0.0 if up_for >= 1.0 else min(2 * self._drop_delay.get(src, FIRST_DELAY / 2),
                                               self.max_delay)
        self._drop_delay[src] = delay
        self._reach(src, delay)

    def view(self, src: int, epoch: int, live: list[int]) -> None:
        """A live peer's membership view."""
        if self.members.is_up(src) and self.members.heard(epoch, live):
            log.debug("epoch %d adopted from rank %d", epoch, src)

    def worker_news(self, job: str, rank: int, joined: bool) -> None:
        """A worker registered (it takes part again; one that left counts from round 0) or
        left (what waits for it fails, and reweighted ops leave it out)."""
        if not joined:
            error = PeerLost(f"rank {rank} left (its worker ended or closed its client)")
            self.mailbox.worker_left(job, rank, error)
            per, absences = self.links.per_node, self.mailbox.absences
            machine = rank // per
            if all(absences.has_left(job, w) for w in range(machine * per, (machine + 1) * per)):
                self.mailbox.node_left(machine, job, error)
            return
        self.members.absent.discard(rank)
        if self.mailbox.worker_joined(job, rank):  # it counts from round 0 in that job only
            self.links.rounds.joined([rank], job)

    def handshake_from(self, src: int, incarnation: int, was_down: bool,
                       serving: bool = False) -> bool:
        """Daemon ``src`` handshakes with us: after a drop or a restart, or at start. What we
        hold of its old connections goes (it is reconnecting them), and we reach it now.
        ``was_down``: it counted us out meanwhile. Whether we counted it out."""
        link = self.links.links.get(src)
        if link is None:
            return False
        member = self.members.members[src]
        member.serving = serving
        if not self.members.is_up(src):  # a late copy of an old attempt's says nothing now
            member.peer_declared_down |= was_down
        # a restart: its old connections are dead even if we have not noticed yet (a peer
        # that only reconnects closed them itself: we see them end)
        if not incarnation:  # says nothing of a restart (a tool, or an impostor)
            return member.declared_down
        if self.members.incarnation_of(src) not in (0, incarnation):
            self._drop(src, "it restarted", PeerState.RECONNECTING)
            self._new_workers(src)  # left out from now on, not only once it is up
        elif link.inbound is not None:  # it handshakes only after tearing its side down
            self._drop(src, "it reconnects", self._idle_state(src))
        member.incarnation = incarnation
        self._afresh_if_apart(src)
        self._reach(src)
        return member.declared_down

    def _new_workers(self, rank: int) -> None:
        """Daemon ``rank`` is a new process in a running job: its workers are new (not the
        ones that left), and ops leave them out until they join."""
        if not self.links.rounds.ready:
            return
        per = self.links.per_node
        for w in range(rank * per, (rank + 1) * per):
            self.members.absent.add(w)
            self.mailbox.absences.forget(w)

    # ------------------------------------------------------------------ dropping

    def _drop(self, rank: int, reason: str, state: PeerState) -> None:
        """Tear the link to ``rank`` down and fail what waits on it (what starts while it is
        reopened waits, until the peer is up again or declared down)."""
        old = self.links.teardown(rank)
        if state is PeerState.RECONNECTING:
            self.links.reopening(rank)
        else:
            self.links.given_up(rank)
        if old is not None:
            asyncio.get_running_loop().run_in_executor(None, old.close)
        self.members.set_state(rank, state, reason)
        self._forget(rank, reason)
        self._tell_view()

    def _forget(self, rank: int, reason: str) -> None:
        """What waits on daemon ``rank`` fails (PeerLost); its messages, parked frames,
        parked window reads and window locks go."""
        err = PeerLost(f"rank {rank} is unreachable: {reason}")
        links = self.links
        self.mailbox.peer_lost(rank, lambda key: links.machine_of(key[0], key[1]) == rank, err)
        self.parking.drop_from(rank)
        self._windows_lost(lambda peer, name: links.machine_of(peer, name) == rank)

    def _declare_down(self, rank: int, reason: str) -> None:
        if self.members.state(rank) is PeerState.DOWN:
            return
        self.members.members[rank].declared_down = True
        self._drop(rank, reason, PeerState.DOWN)
        self._count_afresh(rank, reason)
        log.warning("rank %d is down: %s (epoch %d, live %s)", rank, reason,
                    self.members.epoch, self.members.live_daemons(), extra={"peer": rank})
        self._reach(rank)  # for as long as we run, with backoff: a partition heals

    def _tell_view(self) -> None:
        self.links.outbox.tell_all(self.view_frame())

    def view_frame(self) -> pb.BulkHeader:
        """This daemon's view as a frame (also its heartbeat)."""
        return pb.BulkHeader(kind=pb.VIEW, view_epoch=self.members.epoch,
                             view_live=self.members.live_daemons())

    # ------------------------------------------------------------------ watching

    async def watch(self) -> None:
        """Every heartbeat: send heartbeats, and declare dead the peers silent too long."""
        tick = min(self.heartbeat, self.dead_after / 2)
        last = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            if now - last > self.dead_after:
                self.forgive_own_stall(now - last, now)
            last = now
            self.links.heartbeat(self.view_frame())
            self.check_silence(now)

    def forgive_own_stall(self, gap: float, now: float) -> None:
        """This daemon did not run for ``gap`` s (stopped, or starved of CPU): its peers were
        not heard meanwhile because it was not listening, so each gets a whole ``dead_after``
        from now to be heard before it is judged silent (before: a daemon resumed after a 5 s
        SIGSTOP declared every peer dead at once)."""
        log.warning("this daemon did not run for %.1fs (stopped or starved of CPU): its peers "
                    "get %gs to be heard again before any is declared down", gap,
                    self.dead_after)
        for link in self.links.links.values():
            link.last_heartbeat = max(link.last_heartbeat, now)

    def check_silence(self, now: float) -> None:
        """Declare dead every up peer we have not heard from (no frame, no byte) for
        ``dead_after`` seconds, and every peer reconnecting that long."""
        for rank, link in self.links.links.items():
            state = self.members.state(rank)
            got = link.bytes_received
            if got != self._heard_bytes.get(rank):  # a long payload still arriving counts
                self._heard_bytes[rank] = got
                link.last_heartbeat = max(link.last_heartbeat, now)
            if state is PeerState.UP and now - link.last_heartbeat > self.dead_after:
                self._declare_down(rank, f"silent for {now - link.last_heartbeat:.1f}s")
            elif state is PeerState.RECONNECTING and \
                    now - self.members.members[rank].since > self.dead_after:
                self._declare_down(rank, f"not reachable for {self.dead_after:g}s")

    async def close(self) -> None:
        """Stop reconnecting (the daemon stops)."""
        self.closing = True
        tasks = [t for t in self._reaching.values() if not t.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
