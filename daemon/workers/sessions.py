"""The workers registered with this daemon: their arenas, their lifetime, their departure."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from decent_wire.errors import DecentError
from decent_wire.topology import Topology
from decent_wire.v1 import decent_pb2 as pb
from decentd.concurrency import TaskSet
from decentd.keys import OpKey
from decentd.security.auth import shown
from decentd.security.local_access import LocalAccess
from decentd.workers.arena import Arena
from decentd.workers.staging import FillState

log = logging.getLogger("decentd.workers.sessions")

#: the names of all arenas (memfds: /proc/PID/fd shows them as /memfd:NAME) start with this
SHM_PREFIX = "decent"
#: registered workers that have not opened their completion stream yet, at once (each holds
#: an arena: registrations cannot fill the node's memory)
MAX_UNATTACHED = 8
#: a worker must open its completion stream this soon after Register, or its arena is freed
ATTACH_TIMEOUT = 30.0


@dataclass
class WorkerSession:
    """One registered local worker: its rank, its arena and the channel its completions go
    out on."""

    worker_id: str
    pid: int
    framework: str
    arena: Arena
    job: str = ""
    rank: int = 0  #: among all workers: machine * workers_per_node + local_rank
    local_rank: int = 0
    in_flight: set[OpKey] = field(default_factory=set)
    gone: bool = False  #: it left: nothing may be written into its arena any more
    attached: bool = False
    #: writes one completion to the worker's data channel (set when the worker attaches)
    deliver: Callable[[pb.Completion], None] | None = None
    #: the worker's topology (``set_topology``); None: the daemon's
    topology: Topology | None = None
    #: peers include it (a worker joining a running job is left out until it took its state)
    joined: bool = False
    #: inputs it is still copying in, by request id (:mod:`decentd.workers.staging`)
    filling: dict[int, FillState] = field(default_factory=dict)

    def complete(self, completion: pb.Completion) -> None:
        """Send a completion to the worker (dropped if it is gone); an op that succeeded while
        the worker shrank its memory under the daemon fails."""
        if completion.error.code == pb.OK and self.arena.faulted():
            err = self.arena.fault_error(f"request {completion.request_id}")
            completion = pb.Completion(request_id=completion.request_id, error=err.to_pb())
        if self.deliver is not None:
            self.deliver(completion)

    def tell_final(self, request_id: int, nbytes: int, combine: pb.Combine | None) -> None:
        """The first ``nbytes`` of a draining request's result are final, or with
        ``combine`` have landed for the worker to combine (a partial completion)."""
        if self.deliver is not None and not self.gone:
            self.deliver(pb.Completion(request_id=request_id, partial=True, final_bytes=nbytes,
                                       combine=combine))

class Requests(Protocol):
    """Who runs the workers' requests (the engine), as the sessions and channels see it."""

    def submit(self, session: WorkerSession, req: pb.SubmitRequest) -> None:
        """A worker's request arrived on its data channel."""

    def joined(self, session: WorkerSession) -> None:
        """``session`` joined its job's ops (peers include it from now on)."""

    def fail_session(self, session: WorkerSession) -> list[asyncio.Task[None]]:
        """``session`` left: fail its ops; the tasks still ending them."""

    def forget_history(self) -> None:
        """No worker is left: forget what ended jobs left behind."""


class Sessions:
    """Every worker of this daemon, by worker id."""

    def __init__(self, engine: Requests, machine: int, per_node: int, arena_bytes: int,
                 max_regions: int, access: LocalAccess | None = None,
                 max_arenas: int | None = None) -> None:
        self._engine = engine
        #: workers (of any jobs) that may hold an arena at once
        self._max_arenas = max_arenas if max_arenas is not None else 4 * per_node
        self._access = access or LocalAccess()
        self._machine = machine
        self._per_node = per_node
        self._arena_bytes = arena_bytes
        self._max_regions = max_regions
        self._tasks = TaskSet()
        self.by_id: dict[str, WorkerSession] = {}
        #: (job, local rank) -> pid of workers whose arena is being made (off the event loop)
        self._reserving: dict[tuple[str, int], int] = {}

    def __len__(self) -> int:
        return len(self.by_id)

    def _local_rank(self, job: str, asked: int | None, pid: int) -> int:
        """The local rank a new worker of ``job`` gets: the one it asked for, else the lowest
        free one (DecentError when it is taken or out of range)."""
        taken = {s.local_rank: s.pid for s in self.by_id.values() if s.job == job}
        taken.update({r: p for (j, r), p in self._reserving.items() if j == job})
        own = [r for r, p in taken.items() if p == pid]
        if own and (asked is None or asked == own[0]):
            raise DecentError(pb.INVALID_ARGUMENT, f"this process (pid {pid}) already has a "
                              f"client of job {shown(job)} on daemon rank {self._machine}, as "
                              f"local rank {own[0]}: one process is one worker. Use "
                              "that client (the module functions and optimizer wrappers of "
                              "decent.torch and decent.tf use the first one a process "
                              "connects), or close it before connecting again")
        if asked is None:
            free = [r for r in range(self._per_node) if r not in taken]
            if not free:
                raise DecentError(pb.RESOURCE_EXHAUSTED, f"daemon rank {self._machine} already "
                                  f"serves {self._per_node} workers of job {shown(job)} "
                                  "(workers_per_node)")
            return free[0]
        if not 0 <= asked < self._per_node:
            raise DecentError(pb.INVALID_ARGUMENT, f"local rank {asked} is outside 0.."
                              f"{self._per_node - 1} (daemon rank {self._machine} serves "
                              f"{self._per_node} workers per node)")
        if asked in taken:
            raise DecentError(pb.INVALID_ARGUMENT, f"local rank {asked} of job {shown(job)} is "
                              f"already taken by the worker with pid {taken[asked]}")
        return asked

    async def register(self, pid: int, framework: str, job: str,
                       local_rank: int | None = None, joining: bool = False) -> WorkerSession:
        """A new worker with its own arena and its rank (DecentError when its local rank is
        taken or no arena can be made); dropped if it does not attach within
        :data:`ATTACH_TIMEOUT`. ``joining``: it joins a running job, and peers include it
        only once it says so (:meth:`joined`), after it took its state. The arena is reserved
        in a thread (seconds for GiBs): the daemon's loop, heartbeats included, runs on."""
        local = self._local_rank(job, local_rank, pid)
        waiting = sum(not s.attached for s in self.by_id.values()) + len(self._reserving)
        if waiting >= MAX_UNATTACHED:
            raise DecentError(pb.RESOURCE_EXHAUSTED, f"{waiting} registered workers have not "
                              "attached yet; register again once they have (or are dropped)")
        self._check_room(job)
        self._reserving[(job, local)] = pid
        try:
            arena = await asyncio.to_thread(
                Arena, self._arena_bytes, f"{SHM_PREFIX}-{self._machine}-{os.getpid()}",
                self._max_regions, self._access.protect_fd)
        finally:
            del self._reserving[(job, local)]
        rank = self._machine * self._per_node + local
        session = WorkerSession(secrets.token_hex(8), pid, framework, arena, job, rank, local)
        self.by_id[session.worker_id] = session
        if not joining:
            self.joined(session)
        self._tasks.spawn(self._expire_unattached(session))
        log.info("worker %s (rank %d, local rank %d, pid %d, %s, job %s) registered",
                 session.worker_id, rank, local, pid, shown(framework), shown(job))
        return session

    def _check_room(self, job: str) -> None:
        """DecentError (RESOURCE_EXHAUSTED) when :attr:`_max_arenas` arenas are held or being
        made already."""
        held = [s.job for s in self.by_id.values()] + [j for j, _ in self._reserving]
        if len(held) < self._max_arenas:
            return
        jobs = ", ".join(f"{shown(j)} ({held.count(j)})" for j in sorted(set(held)))
        raise DecentError(pb.RESOURCE_EXHAUSTED, f"daemon rank {self._machine} holds "
                          f"{len(held)} workers' arenas of {self._arena_bytes >> 20} MiB each "
                          f"(memory.max_arenas={self._max_arenas}; jobs {jobs}): a worker of "
                          f"job {shown(job)} is refused until one of them closes its client")

    def joined(self, session: WorkerSession) -> None:
        """The worker takes part in the node's ops from now on (told to every peer)."""
        if not session.joined:
            session.joined = True
            self._engine.joined(session)

    def get(self, worker_id: str) -> WorkerSession | None:
        """The worker registered under ``worker_id``, if it is still here."""
        return self.by_id.get(worker_id)

    async def _expire_unattached(self, session: WorkerSession) -> None:
        await asyncio.sleep(ATTACH_TIMEOUT)
        if not session.attached:
            log.warning("worker %s registered but never opened its completion stream; dropped",
                        session.worker_id)
            self.drop(session)

    def drop(self, session: WorkerSession) -> None:
        """Forget a worker: fail its in-flight ops, then release its arena."""
        if self.by_id.pop(session.worker_id, None) is None:
            return
        tasks = self._engine.fail_session(session)
        log.info("worker %s left", session.worker_id)
        self._tasks.spawn(self._retire(session, tasks))

    async def _retire(self, session: WorkerSession, tasks: list[asyncio.Task[None]]) -> None:
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        session.arena.close()
        if not self.by_id:
            # a later job starts its (name, round) keys at 0 again: nothing of this one may linger
            self._engine.forget_history()

    def drop_all(self) -> None:
        """At shutdown (ops are done): drop every worker and release its arena now."""
        left = list(self.by_id.values())
        for session in left:
            self.drop(session)
        for session in left:
            session.arena.close()

    @property
    def region_count(self) -> int:
        """Worker memory regions mapped, over all workers."""
        return sum(s.arena.region_count for s in self.by_id.values())

    @property
    def spills(self) -> tuple[int, int]:
        """Requests that went to memory of their own (arena full) since their workers came,
        and the bytes of such memory mapped now, over all workers."""
        arenas = [s.arena for s in self.by_id.values()]
        return sum(a.spills for a in arenas), sum(a.spill_bytes for a in arenas)

    @property
    def registered_bytes(self) -> int:
        """Bytes of worker memory mapped, over all workers."""
        return sum(s.arena.region_bytes for s in self.by_id.values())

