"""Registering a worker does not stop its daemon: the arena (a memfd of ``memory.arena_bytes``,
reserved with fallocate: seconds for GiBs) is made in a thread, so the daemon's loop answers its
peers and other callers meanwhile (issue 42, defects 3 and 11: peers once declared a daemon dead
while a 4 GiB arena was made on its loop). In-process: the daemon runs in this process, whose
descriptors show when the arena's memfd exists."""

from __future__ import annotations

import contextlib
import os
import threading

from inprocess import InProcessCluster, NumpyClient, wait_for

from decent.core import Client, NumpyCodec

ARENA = 2 << 30  #: large enough that reserving it outlasts a status call by far


def arenas_being_made() -> int:
    """This process's memfds of decent arenas."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:decent")
    return count


def test_the_daemon_answers_while_a_large_arena_is_reserved() -> None:
    with InProcessCluster(1, settings={"memory.arena_bytes": ARENA}) as cluster:
        daemon = cluster.daemons[0]
        before = arenas_being_made()
        registered: list[str] = []
        clients: list[NumpyClient] = []

        def connect() -> None:
            clients.append(Client(NumpyCodec(), f"unix://{cluster.sockets[0]}", 60,
                                  job="registration"))
            registered.append("done")

        worker = threading.Thread(target=connect)
        worker.start()
        try:
            wait_for(lambda: arenas_being_made() > before, "the arena's memfd")
            # the memfd exists: the arena is being reserved; the loop answers meanwhile
            status = cluster.status(0)
            made = len(daemon.sessions)
            assert status.rank == 0 and made == 0, (made, registered)
        finally:
            worker.join(60)
            for c in clients:
                c.close()
        assert registered == ["done"]
