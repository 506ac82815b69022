"""Who reads the completions off the data channel: a caller blocked on an op, or else a
background thread.

The daemon answers each request with a completion frame on the worker's data channel. A
background thread that read every frame and then woke the caller would add a hand-over between
threads to every op (on a VM, a wake-up on another CPU costs tens of microseconds). So the first
caller to block on an op becomes the *leader*: it reads the channel itself until its own op is
done, delivering every other completion it meets on the way; callers that block meanwhile are
*followers* and wait on their requests' latches. The background thread reads only while no caller
does, and sits out while one does and for :data:`LINGER` after, so that a caller waiting op after
op is not interrupted by it. An op nobody waits for is delivered at most :data:`LINGER` late.
"""

from __future__ import annotations

import collections
import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol

from decent_wire import framing
from decent_wire.errors import DecentError
from decent_wire.v1 import decent_pb2 as pb

#: completions are small; a larger frame means a broken stream
MAX_COMPLETION = 16 << 20
#: how long the background reader sits out after a caller last read the completions itself
LINGER = 0.002


class Awaitable(Protocol):
    """What :meth:`CompletionReader.await_event` waits on (a request's latch)."""

    def is_set(self) -> bool:
        """Whether it is set."""

    def wait(self, timeout: float | None = None) -> bool:
        """Block until it is set (at most ``timeout`` s); whether it is."""


class CompletionReader:
    """Reads one data channel's completions and hands each to ``on_completion``; once the
    channel ends, ``on_lost`` gets the reason (once, on the background thread)."""

    def __init__(self, sock: socket.socket, on_completion: Callable[[pb.Completion], None],
                 on_lost: Callable[[DecentError], None], address: str,
                 closing: Callable[[], bool], name: str) -> None:
        """``address`` names the daemon in messages; ``closing()`` says whether this side is
        closing the channel (the loss then reads SHUTTING_DOWN)."""
        self._sock = sock
        self._on_completion = on_completion
        self._on_lost = on_lost
        self._address = address
        self._closing = closing
        #: held by whoever reads the channel: the background thread or the leader
        self._read_lock = threading.Lock()
        #: guards the turn-taking below
        self._turns = threading.Condition()
        self._leader = False
        self._followers = 0
        self._last_led = 0.0
        self._sitting = False  #: the background thread waits for the leader to wake it
        self._frames = framing.FrameReader(MAX_COMPLETION)
        #: whole frames read but not yet handed over (an interrupted reader leaves them)
        self._bodies: collections.deque[bytes] = collections.deque()
        #: why the channel ended (code, reason), as the thread that found out saw it
        self._ended: tuple[int, str] | None = None
        #: the daemon's last word before it closed the channel (a daemon that stops says why)
        self._last_word: tuple[int, str] | None = None
        #: set once the daemon took the channel (its first, empty completion) or it ended
        self.attached = threading.Event()
        self.lost: DecentError | None = None
        self._thread = threading.Thread(target=self._background, daemon=True, name=name)

    @property
    def leading(self) -> bool:
        """Whether a caller is reading the completions now."""
        with self._turns:
            return self._leader

    @property
    def sitting_out(self) -> bool:
        """Whether the background thread is waiting for a reading caller to finish."""
        with self._turns:
            return self._sitting

    def start(self) -> None:
        """Start the background thread."""
        self._thread.start()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the background thread to end; whether it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def await_event(self, event: Awaitable, timeout: float | None) -> bool:
        """Block until ``event`` is set (at most ``timeout`` s); whether it is. The first
        caller reads the completions itself, so that its own wakes it directly."""
        with self._turns:
            lead = not self._leader and self._ended is None
            if lead:
                self._leader = True
            else:
                self._followers += 1
                self._turns.notify_all()  # the background thread delivers from now on
        try:
            if lead:
                began = time.monotonic()
                self._read_until(event.is_set, timeout)
                if timeout is not None:
                    timeout = max(0.0, timeout - (time.monotonic() - began))
            return event.wait(timeout)
        finally:
            with self._turns:
                if lead:
                    self._leader, self._last_led = False, time.monotonic()
                else:
                    self._followers -= 1
                if self._followers or self._sitting:
                    self._turns.notify_all()

    # ------------------------------------------------------------------ the two readers

    def _background(self) -> None:
        """Take the completions whenever no caller reads them; once the channel ends, say
        why."""
        ready = select.poll()
        ready.register(self._sock, select.POLLIN)
        while self._ended is None:
            self._sit_out()
            if self._ended is not None:
                break
            ready.poll()
            with self._turns:
                if self._leader:  # the leader reads what woke this thread
                    continue
            with self._read_lock:
                self._take(block=False)
        code, reason = self._ended
        if self._closing():
            code, reason = pb.SHUTTING_DOWN, "this client was closed"
        self.lost = DecentError(code, reason)
        self.attached.set()
        self._on_lost(self.lost)

    def _sit_out(self) -> None:
        """Wait while a caller reads the channel (it delivers every completion meanwhile), and
        for :data:`LINGER` after one did unless other callers wait for this thread."""
        with self._turns:
            while self._ended is None and (self._leader or (
                    not self._followers and time.monotonic() - self._last_led < LINGER)):
                self._sitting = self._leader  # until it is done: it wakes this thread then
                self._turns.wait(None if self._leader else LINGER)
                self._sitting = False

    def _read_until(self, done: Callable[[], bool], timeout: float | None) -> None:
        """The leader: read completions until ``done()``, ``timeout`` s passed or the channel
        ended."""
        deadline = None if timeout is None else time.monotonic() + timeout
        ready = select.poll()
        ready.register(self._sock, select.POLLIN)
        with self._read_lock:
            while not done() and self._ended is None:
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0 or not ready.poll(left * 1000):
                        return
                self._take(block=deadline is None)

    def _take(self, block: bool) -> None:
        """One read of the channel (the caller holds the read lock), unless frames an
        interrupted reader left are still to go: every whole completion is handed over; the
        end of the channel is noted."""
        try:
            if not self._bodies:
                chunk = self._sock.recv(1 << 16, 0 if block else socket.MSG_DONTWAIT)
                if not chunk:
                    # no goodbye before the end: the daemon died
                    self._end(self._last_word or (pb.PEER_UNAVAILABLE, (
                        f"lost the daemon at {self._address}: it closed the data channel "
                        "without a goodbye (killed or crashed; its log or its supervisor says "
                        "why)")))
                    return
                self._bodies.extend(self._frames.feed(chunk))
            while self._bodies:
                completion = framing.decode(pb.Completion, self._bodies.popleft())
                if completion.request_id != 0:
                    self._on_completion(completion)
                elif completion.error.code != pb.OK:  # the daemon's last word
                    self._last_word = (completion.error.code, completion.error.message)
                else:
                    self.attached.set()
        except BlockingIOError:
            return  # the leader took what woke the background thread
        except (OSError, framing.FrameError) as exc:
            self._end((pb.PEER_UNAVAILABLE, f"lost the daemon at {self._address}: {exc}"))

    def _end(self, why: tuple[int, str]) -> None:
        """The channel is over: keep the first reason and wake the background thread (it
        reports the loss) wherever it waits."""
        with self._turns:
            if self._ended is None:
                self._ended = why
            self._turns.notify_all()  # it may be sitting out a caller's read
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
