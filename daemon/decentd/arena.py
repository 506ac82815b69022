"""The shared-memory arena of one local worker: created, pre-touched and mapped once by the daemon.

The worker attaches by name and writes tensors at offsets it allocates; requests carry offsets.
The name is unlinked as soon as the worker has attached (both mappings stay valid), so nothing is
left in /dev/shm even if a process is killed.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from multiprocessing import shared_memory

import numpy as np

from decentd.errors import OpError
from decentd.wire import pb

PAGE = 4096


class Arena:
    """A daemon-owned shared-memory segment for one worker."""

    def __init__(self, nbytes: int, prefix: str) -> None:
        self.name = f"{prefix}-{secrets.token_hex(4)}"
        # the stdlib resource tracker stays registered: if this process is killed, it unlinks
        self._shm = shared_memory.SharedMemory(name=self.name, create=True, size=nbytes)
        try:
            # reserve the pages now: on a full /dev/shm this fails here (ENOSPC) instead of
            # killing the daemon with SIGBUS at the first touch
            if hasattr(os, "posix_fallocate"):  # not on macOS
                os.posix_fallocate(self._shm._fd, 0, nbytes)  # type: ignore[attr-defined]
        except OSError as exc:
            self._shm.close()
            self._shm.unlink()
            free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
            raise OpError(
                pb.RESOURCE_EXHAUSTED,
                f"cannot reserve a {nbytes}-byte shared-memory arena ({exc.strerror}; "
                f"/dev/shm has {free} bytes free): lower memory.arena_bytes or give the "
                "node more shared memory (docker: --shm-size)",
            ) from None
        self.nbytes = nbytes
        buf = self._shm.buf
        assert buf is not None
        self.buf: memoryview = buf
        pages = np.frombuffer(self.buf, np.uint8)
        pages[::PAGE] = 0  # first touch now, not on the hot path
        del pages
        self._unlinked = False

    def unlink(self) -> None:
        """Remove the name from /dev/shm (mappings stay valid)."""
        if not self._unlinked:
            self._unlinked = True
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()

    def close(self) -> None:
        """Unlink and unmap; views still held elsewhere keep the mapping until released."""
        self.unlink()
        self.buf = memoryview(b"")
        with contextlib.suppress(BufferError):
            self._shm.close()

    def view(self, offset: int, nbytes: int, what: str) -> memoryview:
        """Bytes ``[offset, offset + nbytes)``; ARENA_ERROR when outside the arena."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise OpError(
                pb.ARENA_ERROR,
                f"{what}: bytes [{offset}, {offset + nbytes}) are outside the "
                f"{self.nbytes}-byte arena",
            )
        return self.buf[offset:offset + nbytes]
