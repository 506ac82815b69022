"""The worker data channel: submissions in and completions out on a Unix stream socket.

gRPC stays for the worker's control calls (Register, Status, Topology). The per-op traffic is a
stream of length-prefixed protobuf frames with no reply per request: a refused request comes back
as a failed Completion, like any other failure. The worker's first frame is a WorkerHello naming
the session it registered; when this connection ends, the worker is gone.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, cast

from decentd.errors import OpError
from decentd.wire import pb

if TYPE_CHECKING:
    from decentd.engine import WorkerSession
    from decentd.server import Daemon

log = logging.getLogger("decentd.workers")

LENGTH = 4
#: a submission is a few hundred bytes (a fused one a few KiB per tensor)
MAX_FRAME = 64 << 20


def frame(message: pb.Completion) -> bytes:
    """A length-prefixed message."""
    body = message.SerializeToString()
    return len(body).to_bytes(LENGTH, "little") + body


class WorkerChannel(asyncio.Protocol):
    """One worker's data connection."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.session: WorkerSession | None = None
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Remember the transport."""
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        """Handle every complete frame received so far."""
        buf = self._buf
        buf += data
        start = 0
        while len(buf) - start >= LENGTH:
            size = int.from_bytes(buf[start:start + LENGTH], "little")
            if size > MAX_FRAME:
                self._drop(f"a {size}-byte frame")
                return
            if len(buf) - start - LENGTH < size:
                break
            body = bytes(buf[start + LENGTH:start + LENGTH + size])
            start += LENGTH + size
            try:
                if self.session is None:
                    self._hello(body)
                else:
                    self._submit(body)
            except ValueError as exc:
                self._drop(str(exc))
                return
        del buf[:start]

    def _hello(self, body: bytes) -> None:
        hello = pb.WorkerHello.FromString(body)
        session = self.daemon.sessions.get(hello.worker_id)
        if session is None or session.attached:
            self.send(pb.Completion(error=pb.Error(
                code=pb.UNKNOWN_WORKER, message=f"unknown worker id {hello.worker_id!r}")))
            raise ValueError(f"hello from unknown worker {hello.worker_id!r}")
        self.session = session
        session.arena.unlink()  # the worker has attached: nothing needs the name any more
        session.attached = True
        session.deliver = self.send
        self.send(pb.Completion(request_id=0))  # request ids start at 1: this says "attached"

    def _submit(self, body: bytes) -> None:
        assert self.session is not None
        try:
            req = pb.SubmitRequest.FromString(body)
        except Exception as exc:  # protobuf's DecodeError
            raise ValueError(f"undecodable request ({exc})") from None
        try:
            self.daemon.engine.submit(self.session, req)
        except OpError as err:
            self.send(pb.Completion(request_id=req.request_id, error=err.to_pb()))

    def send(self, completion: pb.Completion) -> None:
        """Write one completion (dropped if the worker is gone)."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(frame(completion))

    def _drop(self, reason: str) -> None:
        log.error("worker channel: %s; closing it", reason)
        if self.transport is not None:
            self.transport.close()

    def close(self) -> None:
        """Close after pending completions are written."""
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        """The worker went away (or closed its client)."""
        self.transport = None
        self.daemon.channels.discard(self)
        if self.session is not None:
            self.session.deliver = None
            self.daemon.drop_session(self.session)
