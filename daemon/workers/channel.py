"""The worker data channel: submissions in and completions out on a Unix stream socket.

gRPC stays for the worker's control calls (Register, Status, Topology). The per-op traffic is a
stream of length-prefixed protobuf frames with no reply per request: a refused request comes back
as a failed Completion, like any other failure. The worker's first frame is a WorkerHello naming
the session it registered; when this connection ends, the worker is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import mmap
import os
import resource
import socket
from typing import cast

from decent_wire import framing
from decent_wire.errors import DecentError
from decent_wire.v1 import decent_pb2 as pb
from decentd.security.auth import shown
from decentd.security.local_access import LocalAccess
from decentd.workers.arena import Arena
from decentd.workers.sessions import Requests, Sessions, WorkerSession

log = logging.getLogger("decentd.workers.channel")

#: a submission is a few hundred bytes (a fused one a few KiB per tensor)
MAX_FRAME = 64 << 20
#: a MemoryRequest is small; a connection that has not sent one by then is closed
MEMORY_FRAME = 1 << 20
MEMORY_TIMEOUT = 10.0
#: descriptors kept free of worker regions (peer and worker sockets, arenas, logs)
FD_RESERVE = 512


class WorkerChannel(asyncio.Protocol):
    """One worker's data connection."""

    def __init__(self, sessions: Sessions, engine: Requests, open_channels: set[WorkerChannel],
                 access: LocalAccess) -> None:
        self._sessions = sessions
        self._access = access
        self._engine = engine
        self._open = open_channels
        self._reader = framing.FrameReader(MAX_FRAME)
        self.session: WorkerSession | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Remember the transport."""
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._open.add(self)
        refused = self._access.refusal(transport.get_extra_info("socket"))
        if refused is not None:
            self._drop(f"refused: {refused}")

    def data_received(self, data: bytes) -> None:
        """Handle every complete frame received so far."""
        try:
            for body in self._reader.feed(data):
                if self.session is None:
                    self._hello(framing.decode(pb.WorkerHello, body))
                else:
                    self._submit(framing.decode(pb.SubmitRequest, body))
        except ValueError as exc:  # FrameError, or a hello from nobody
            self._drop(str(exc))

    def _hello(self, hello: pb.WorkerHello) -> None:
        session = self._sessions.get(hello.worker_id)
        if session is None or session.attached:
            self.send(pb.Completion(error=pb.Error(
                code=pb.UNKNOWN_WORKER, message=f"unknown worker id {shown(hello.worker_id)}")))
            raise ValueError(f"hello from unknown worker {shown(hello.worker_id)}")
        self.session = session
        session.attached = True
        session.deliver = self.send
        self.send(pb.Completion(request_id=0))  # request ids start at 1: this says "attached"

    def _submit(self, req: pb.SubmitRequest) -> None:
        assert self.session is not None
        try:
            self._engine.submit(self.session, req)
        except DecentError as err:
            self.send(pb.Completion(request_id=req.request_id, error=err.to_pb()))

    def send(self, completion: pb.Completion) -> None:
        """Write one completion (dropped if the worker is gone)."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(framing.encode(completion))

    def _drop(self, reason: str) -> None:
        log.error("worker channel: %s; closing it", reason)
        if self.transport is not None:
            self.transport.close()

    def close(self, goodbye: str | None = None) -> None:
        """Close after pending completions are written; ``goodbye`` (why the daemon stops) goes
        last, so that the worker tells a stop from a daemon that died (killed or crashed)."""
        if goodbye is not None:
            self.send(pb.Completion(error=pb.Error(code=pb.SHUTTING_DOWN, message=goodbye)))
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        """The worker went away (or closed its client)."""
        self.transport = None
        self._open.discard(self)
        if self.session is not None:
            self.session.deliver = None
            self._sessions.drop(self.session)


def _map_and_close(arena: Arena, nbytes: int, fd: int) -> mmap.mmap:
    """Map a worker's memory and close the descriptor it came with (in a worker thread)."""
    try:
        return arena.open_region(nbytes, fd)
    finally:
        os.close(fd)


def fd_budget() -> int:
    """Worker regions the daemon may map at once: each holds a descriptor (Python's mmap keeps
    one), and a reserve stays for sockets, shared-memory arenas and the like."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(0, soft - FD_RESERVE)


class MemorySocket:
    """Serves memory registration: one MemoryRequest (plus its fd) per connection.

    asyncio's stream transports drop the file descriptors that come with a message, so this
    socket is read with ``recvmsg`` from a plain reader callback. Each request is answered with
    an ``Error`` frame (code OK on success) and the connection is closed.
    """

    def __init__(self, sessions: Sessions, path: str, access: LocalAccess) -> None:
        self._sessions = sessions
        self.path = path
        self._access = access
        self._sock: socket.socket | None = None
        self._conns: dict[socket.socket, tuple[framing.FrameReader, list[int],
                                                asyncio.TimerHandle]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._serving: set[socket.socket] = set()  # requests being handled (fds in use)
        self.fd_budget = fd_budget()  # after the daemon raised its limit (cli.raise_fd_limit)

    def start(self) -> None:
        """Listen on ``path``."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.path)
        sock.listen(64)
        sock.setblocking(False)
        self._sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._accept)

    def _accept(self) -> None:
        assert self._sock is not None
        try:
            conn, _ = self._sock.accept()
        except OSError as exc:  # BlockingIOError, or a connection that vanished
            if exc.errno in (errno.EMFILE, errno.ENFILE):  # out of fds: back off, do not spin
                loop = asyncio.get_running_loop()
                loop.remove_reader(self._sock.fileno())
                loop.call_later(0.5, self._resume)
            return
        refused = self._access.refusal(conn)
        if refused is not None:
            log.error("memory socket: refused: %s", refused)
            conn.close()
            return
        conn.setblocking(False)
        loop = asyncio.get_running_loop()
        timer = loop.call_later(MEMORY_TIMEOUT, self._finish, conn, None)
        self._conns[conn] = (framing.FrameReader(MEMORY_FRAME), [], timer)
        loop.add_reader(conn.fileno(), self._readable, conn)

    def _resume(self) -> None:
        if self._sock is not None:
            asyncio.get_running_loop().add_reader(self._sock.fileno(), self._accept)

    def _readable(self, conn: socket.socket) -> None:
        reader, fds, _ = self._conns[conn]
        try:
            data, got, flags, _ = socket.recv_fds(conn, 1 << 16, 2)
        except BlockingIOError:
            return
        except OSError:
            data, got, flags = b"", [], 0
        fds.extend(got)
        if len(fds) > 1:  # one request takes one descriptor: more would pile up unbounded
            self._finish(conn, pb.Error(code=pb.INVALID_ARGUMENT, message="memory request: "
                                        f"{len(fds)} file descriptors sent, at most 1 is taken"))
            return
        if flags & socket.MSG_CTRUNC:  # the kernel dropped descriptors: we are out of fds
            self._finish(conn, pb.Error(code=pb.RESOURCE_EXHAUSTED, message="the daemon has no "
                                        "file descriptors left to take this memory"))
            return
        try:
            bodies = reader.feed(data)
        except framing.FrameError as exc:
            self._finish(conn, pb.Error(code=pb.INVALID_ARGUMENT, message=f"memory request: {exc}"))
            return
        if bodies:
            asyncio.get_running_loop().remove_reader(conn.fileno())
            self._conns[conn][2].cancel()  # from here on only _serve finishes it
            self._serving.add(conn)
            task = asyncio.get_running_loop().create_task(self._serve(conn, bodies[0], fds))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        if not data:
            self._finish(conn, None)

    async def _serve(self, conn: socket.socket, body: bytes, fds: list[int]) -> None:
        reply: pb.Error | None = None
        given: int | None = None
        try:
            reply, given = await self._answer(body, fds)
        except Exception as exc:  # a bug must not take the loop down: the worker is told
            log.exception("memory request failed")
            reply = pb.Error(code=pb.INTERNAL, message=f"memory request: {exc!r}")
        finally:
            self._serving.discard(conn)
            self._finish(conn, reply, given)

    async def _answer(self, body: bytes, fds: list[int]) -> tuple[pb.Error, int | None]:
        """The reply to one request, and the descriptor that goes with it (the arena's)."""
        try:
            req = framing.decode(pb.MemoryRequest, body)
        except framing.FrameError as exc:
            return pb.Error(code=pb.INVALID_ARGUMENT, message=str(exc)), None
        session = self._sessions.get(req.worker_id)
        if session is None:
            return pb.Error(code=pb.UNKNOWN_WORKER,
                            message=f"unknown worker id {shown(req.worker_id)}"), None
        if req.arena:
            fd = session.arena.take_fd()
            if fd is None:
                return pb.Error(code=pb.INVALID_ARGUMENT, message="the arena was handed over "
                                "already"), None
            return pb.Error(code=pb.OK), fd
        return await self._register(req, session, fds), None

    async def _register(self, req: pb.MemoryRequest, session: WorkerSession,
                        fds: list[int]) -> pb.Error:
        """Release what ``req`` lets go of, and map the memory it registers."""
        for base in req.release:
            session.arena.release_region(base)
        if req.nbytes == 0:
            return pb.Error(code=pb.OK)
        what = f"cannot register {req.nbytes} bytes at {req.base}"
        if len(fds) != 1:
            return pb.Error(code=pb.INVALID_ARGUMENT, message=f"{what}: it needs one file "
                            f"descriptor, got {len(fds)}")
        arena = session.arena
        try:
            if self._sessions.region_count >= self.fd_budget:
                raise OverflowError(f"the daemon maps {self.fd_budget} worker regions, as many "
                                    "as its open-file limit leaves room for")
            arena.check_region(req.base, req.nbytes)
            fd = fds.pop()  # the mapping thread owns it now (and closes it)
            region = await asyncio.get_running_loop().run_in_executor(
                None, _map_and_close, arena, req.nbytes, fd)
        except OverflowError as exc:
            return pb.Error(code=pb.RESOURCE_EXHAUSTED, message=f"{what}: {exc}")
        except OSError as exc:
            code = pb.RESOURCE_EXHAUSTED if exc.errno in (errno.EMFILE, errno.ENFILE,
                                                          errno.ENOMEM) else pb.INVALID_ARGUMENT
            return pb.Error(code=code, message=f"{what}: {exc}")
        except ValueError as exc:
            return pb.Error(code=pb.INVALID_ARGUMENT, message=f"{what}: {exc}")
        if self._sessions.get(req.worker_id) is not session:  # it left meanwhile
            region.close()
            return pb.Error(code=pb.UNKNOWN_WORKER, message=f"worker {req.worker_id!r} left")
        try:
            arena.add_region(req.base, region, req.spill)
        except (ValueError, OverflowError) as exc:
            region.close()
            code = pb.RESOURCE_EXHAUSTED if isinstance(exc, OverflowError) else \
                pb.INVALID_ARGUMENT
            return pb.Error(code=code, message=f"{what}: {exc}")
        return pb.Error(code=pb.OK)

    def _finish(self, conn: socket.socket, reply: pb.Error | None, given: int | None = None
                ) -> None:
        """Answer (``given`` rides along, and is closed here) and close the connection."""
        entry = self._conns.pop(conn, None)
        if entry is None:
            if given is not None:
                os.close(given)
            return
        _, fds, timer = entry
        timer.cancel()
        for fd in fds:  # the daemon's mapping keeps its own reference
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(Exception):  # not watched any more once a request is served
            asyncio.get_running_loop().remove_reader(conn.fileno())
        if reply is not None:
            with contextlib.suppress(OSError):  # a few bytes into an empty socket buffer
                socket.send_fds(conn, [framing.encode(reply)], [] if given is None else [given])
        if given is not None:
            os.close(given)
        conn.close()

    def close(self) -> None:
        """Stop listening and drop open connections (requests being served finish on their own)."""
        for conn in list(self._conns):
            if conn not in self._serving:
                self._finish(conn, None)
        if self._sock is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
