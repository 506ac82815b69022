"""The Work objects of torch.distributed's ``decent`` backend, and the thread that ends them
(:mod:`decent.torch.distributed`)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from decent.core import DecentError

#: an op's ending: wait for it, copy its result where torch wants it, give its outputs
Ending = Callable[[], list[torch.Tensor]]


class DecentWork(dist.Work):
    """An op of the process group: done when its future is (the op's error, raised by
    ``wait()``, is a ``DistBackendError`` with decent's message)."""

    def __init__(self, future: torch.futures.Future[Any]) -> None:
        super().__init__()
        self.future = future

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the op ends (the op's own timeout, the process group's, bounds it);
        True, or its error."""
        del timeout  # every op already carries the process group's timeout
        self.future.wait()
        return True

    def is_completed(self) -> bool:
        """Whether the op ended (successfully or not)."""
        return self.future.done()

    def get_future(self) -> torch.futures.Future[Any]:
        """The op's outputs, once it ends."""
        return self.future


class Completer:
    """Ends the ops of one process group on a thread of its own, in the order they were
    started, and completes each op's future: a Work completes without anyone waiting on it
    (DDP's hooks chain on ``get_future()``)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Ending, torch.futures.Future[Any]] | None] = (
            queue.SimpleQueue())
        self._thread = threading.Thread(target=self._run, name="decent-process-group",
                                        daemon=True)
        self._thread.start()

    def submit(self, ending: Ending) -> dist.Work:
        """A Work completed with ``ending()``'s outputs (or failed with its error)."""
        future: torch.futures.Future[Any] = torch.futures.Future()
        self._queue.put((ending, future))
        return DecentWork(future)

    def close(self) -> None:
        """End the ops submitted so far, then the thread."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            ending, future = item
            try:
                future.set_result(ending())
            except DecentError as exc:
                future.set_exception(dist.DistBackendError(str(exc)))
            except Exception as exc:  # a bug here fails that op, not the thread
                future.set_exception(exc)
