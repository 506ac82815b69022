"""Who reads a worker's completions (``decent.core.requests.completions``), over a socket pair
standing in for the daemon's data channel: a caller blocked on an op reads them itself, the
background thread sits out its turn and takes over after it, a caller that gives up leaves
reading to the background thread, and the end of the channel is reported once."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from decent.core.requests.completions import CompletionReader
from decent_wire import framing
from decent_wire.errors import DecentError
from decent_wire.v1 import decent_pb2 as pb


def completion(request_id: int, code: int = pb.OK, message: str = "") -> bytes:
    """One completion frame as the daemon writes it."""
    return framing.encode(pb.Completion(request_id=request_id,
                                        error=pb.Error(code=code, message=message)))


def until(check: Callable[[], bool], what: str) -> None:
    """Wait (up to 30 s) for ``check()``: a state another thread reaches, not a time."""
    deadline = time.monotonic() + 30
    while not check():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.001)


@dataclass
class Channel:
    """A reader on one end of a socket pair; the test writes the daemon's frames."""

    daemon: socket.socket
    reader: CompletionReader
    done: dict[int, threading.Event] = field(default_factory=dict)
    #: the thread that delivered each completion
    by: dict[int, str] = field(default_factory=dict)
    gates: dict[int, tuple[threading.Event, threading.Event]] = field(default_factory=dict)
    lost: list[DecentError] = field(default_factory=list)

    def event(self, request_id: int) -> threading.Event:
        """The latch of request ``request_id``."""
        return self.done.setdefault(request_id, threading.Event())

    def gate(self, request_id: int) -> tuple[threading.Event, threading.Event]:
        """Delivering ``request_id`` blocks until the second event is set (the first is set
        when it starts): the reader holds its turn meanwhile."""
        return self.gates.setdefault(request_id, (threading.Event(), threading.Event()))

    def deliver(self, c: pb.Completion) -> None:
        """``on_completion``."""
        if c.request_id in self.gates:
            entered, release = self.gates[c.request_id]
            entered.set()
            assert release.wait(60)
        self.by[c.request_id] = threading.current_thread().name
        self.event(c.request_id).set()

    def on_lost(self, error: DecentError) -> None:
        """``on_lost``: every request still waiting fails."""
        self.lost.append(error)
        for e in self.done.values():
            e.set()


@pytest.fixture
def channel() -> Iterator[Channel]:
    daemon, worker = socket.socketpair()
    holder: list[Channel] = []
    reader = CompletionReader(worker, lambda c: holder[0].deliver(c),
                              lambda e: holder[0].on_lost(e), "unix:///test.sock",
                              lambda: False, "background")
    ch = Channel(daemon, reader)
    holder.append(ch)
    reader.start()
    daemon.sendall(completion(0))  # the daemon takes the channel
    assert reader.attached.wait(30)
    yield ch
    daemon.close()
    assert reader.join(30)
    worker.close()


def wait_in_thread(ch: Channel, request_id: int, timeout: float | None
                   ) -> tuple[threading.Thread, list[bool]]:
    """A caller blocked on ``request_id`` in a thread of its own (named ``caller``)."""
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(
        ch.reader.await_event(ch.event(request_id), timeout)), name="caller")
    t.start()
    return t, got


def test_a_blocked_caller_reads_its_own_completion(channel: Channel) -> None:
    t, got = wait_in_thread(channel, 1, None)
    until(lambda: channel.reader.leading, "the caller reads the channel")
    channel.daemon.sendall(completion(1))
    t.join(30)
    assert got == [True] and channel.by[1] == "caller"
    channel.daemon.sendall(completion(2))  # nobody waits: the background thread delivers it
    assert channel.event(2).wait(30) and channel.by[2] == "background"


def test_the_background_thread_sits_out_a_callers_turn_and_takes_over_after_it(
        channel: Channel) -> None:
    t, got = wait_in_thread(channel, 1, None)
    until(lambda: channel.reader.leading, "the caller reads the channel")
    entered, release = channel.gate(2)
    channel.daemon.sendall(completion(2))
    assert entered.wait(30)  # the caller delivers 2 and holds its turn
    channel.daemon.sendall(completion(3))  # wakes the background thread: not its turn
    until(lambda: channel.reader.sitting_out, "the background thread sits out")
    release.set()
    assert channel.event(3).wait(30) and channel.by[3] == "caller"  # met on the way
    channel.daemon.sendall(completion(1))
    t.join(30)
    assert got == [True]
    channel.daemon.sendall(completion(4))  # after the caller's turn: the background's again
    assert channel.event(4).wait(30), "nobody read the channel after the caller's turn"
    assert channel.by[4] == "background"


def test_a_caller_that_gives_up_leaves_its_completion_to_the_background(
        channel: Channel) -> None:
    assert channel.reader.await_event(channel.event(1), 0.05) is False
    assert not channel.reader.leading
    channel.daemon.sendall(completion(1))
    assert channel.event(1).wait(30) and channel.by[1] == "background"


def test_threads_waiting_together_each_get_theirs(channel: Channel) -> None:
    first, got_first = wait_in_thread(channel, 1, None)
    until(lambda: channel.reader.leading, "the first caller reads the channel")
    others = [wait_in_thread(channel, i, None) for i in (2, 3)]
    channel.daemon.sendall(completion(3) + completion(2))
    for t, got in others:  # theirs came first: they are through while the first still waits
        t.join(30)
        assert got == [True]
    assert first.is_alive() and got_first == []
    channel.daemon.sendall(completion(1))
    first.join(30)
    assert got_first == [True]


@pytest.mark.parametrize("goodbye", [None, "the daemon is stopping"])
def test_the_end_of_the_channel_is_reported_once_while_a_caller_reads(
        channel: Channel, goodbye: str | None) -> None:
    t, got = wait_in_thread(channel, 1, None)
    until(lambda: channel.reader.leading, "the caller reads the channel")
    if goodbye is not None:
        channel.daemon.sendall(completion(0, pb.SHUTTING_DOWN, goodbye))
    channel.daemon.shutdown(socket.SHUT_RDWR)
    t.join(30)
    assert got == [True] and not t.is_alive()  # released by the loss
    assert channel.reader.join(30)
    assert len(channel.lost) == 1
    if goodbye is None:
        assert channel.lost[0].code_name == "PEER_UNAVAILABLE"
        assert "without a goodbye" in channel.lost[0].message
    else:
        assert channel.lost[0].code_name == "SHUTTING_DOWN"
        assert channel.lost[0].message == goodbye
