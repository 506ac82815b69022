"""The workers registered with this daemon: their arenas, their lifetime, their departure."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets

from decentd.arena import Arena
from decentd.engine import Engine, WorkerSession
from decentd.tasks import TaskSet

log = logging.getLogger("decentd.sessions")

#: /dev/shm names of all arenas start with this (tests and the before-stop hook look for it)
SHM_PREFIX = "decent"
#: a worker must open its completion stream this soon after Register, or its arena is freed
ATTACH_TIMEOUT = 30.0


class Sessions:
    """Every worker of this daemon, by worker id."""

    def __init__(self, engine: Engine, rank: int, arena_bytes: int, max_regions: int) -> None:
        self._engine = engine
        self._rank = rank
        self._arena_bytes = arena_bytes
        self._max_regions = max_regions
        self._tasks = TaskSet()
        self.by_id: dict[str, WorkerSession] = {}

    def __len__(self) -> int:
        return len(self.by_id)

    def register(self, pid: int, framework: str, job: str) -> WorkerSession:
        """A new worker with its own arena (DecentError when no arena can be made); dropped
        if it does not attach within :data:`ATTACH_TIMEOUT`."""
        arena = Arena(self._arena_bytes, f"{SHM_PREFIX}-{self._rank}-{os.getpid()}",
                      self._max_regions)
        session = WorkerSession(secrets.token_hex(8), pid, framework, arena, job)
        self.by_id[session.worker_id] = session
        self._tasks.spawn(self._expire_unattached(session))
        log.info("worker %s (pid %d, %s, job %r) registered", session.worker_id, pid,
                 framework, job)
        return session

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
    def registered_bytes(self) -> int:
        """Bytes of worker memory mapped, over all workers."""
        return sum(s.arena.region_bytes for s in self.by_id.values())

