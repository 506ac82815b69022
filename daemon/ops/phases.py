"""An op's phase marks, kept while a timeline records (:mod:`decentd.service.timeline`)."""

from __future__ import annotations

import time


class Phases:
    """An op's marks (``time.monotonic_ns``, 0: not reached) while a timeline records: opened,
    sends (first began, last returned), data (first awaited, last came), ran, done (the
    completion handed over); error."""

    __slots__ = ("done_ns", "error", "ran_ns", "received_ns", "recv_ns", "send_ns", "sent_ns",
                 "started_ns")

    def __init__(self) -> None:
        self.started_ns, self.error = time.monotonic_ns(), ""
        self.send_ns = self.sent_ns = self.recv_ns = self.received_ns = 0
        self.ran_ns = self.done_ns = 0

    def sending(self) -> None:
        """A send begins."""
        self.send_ns = self.send_ns or time.monotonic_ns()

    def sent(self) -> None:
        """A send returned."""
        self.sent_ns = time.monotonic_ns()

    def receiving(self) -> None:
        """The op waits for a peer's data."""
        self.recv_ns = self.recv_ns or time.monotonic_ns()

    def received(self, _: object = None) -> None:
        """A peer's data is there (also a future's done-callback)."""
        self.received_ns = time.monotonic_ns()
