"""The Work objects of torch.distributed's ``decent`` backend, and the thread that ends them
(:mod:`decent.torch.distributed`)."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from decent.core import DecentError, Handle


@dataclass(frozen=True)
class Ending:
    """How an op ends: ``run()`` waits for the client's ``handle``, puts its result where
    torch wants it and gives its outputs. With a handle, the completer thread is woken by the
    op's completion, and only if no caller has ended the op by then (a blocking op is ended by
    the thread that waits for it: no thread is woken for it)."""

    run: Callable[[], list[torch.Tensor]]
    handle: Handle[Any] | None = None


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


class DrivenFuture(torch.futures.Future[Any]):
    """An op's future (or one chained on it) whose callbacks always run on its group's
    completer thread, in the order of the ops: a callback chained on an op that already ended
    runs there next, not in the caller's thread, so the ops callbacks start (PowerSGD's) are
    started in the same order on every rank. Waited for on that thread (by a callback, for an
    op it started), it ends that op there itself instead of waiting for the thread it runs
    on."""

    def __init__(self, completer: Completer) -> None:
        super().__init__()
        self._completer = completer

    def wait(self) -> Any:
        """The op's outputs, once it ends (its error raised)."""
        self._completer.run_until(self)
        return super().wait()

    def then(self, callback: Callable[[torch.futures.Future[Any]], Any]
             ) -> torch.futures.Future[Any]:
        """A future of ``callback(self)``, run on the completer thread once this one ended."""
        chained = DrivenFuture(self._completer)

        def run(done: torch.futures.Future[Any]) -> None:
            try:
                chained.set_result(callback(done))
            except Exception as exc:
                chained.set_exception(exc)
        self._completer.after(self, run)
        return chained


#: what the completer thread runs: the future an op completes (None: a callback), and how
Item = tuple["torch.futures.Future[Any] | None", Callable[[], None]]


class Completer:
    """Ends the ops of one process group on a thread of its own, in the order they were
    started, and completes each op's future there: a Work completes without anyone waiting
    on it (DDP's hooks chain on ``get_future()``). The callbacks chained on the futures run on
    this thread, one op's after another's in the order of the ops; a callback that waits for
    an op it started has that op ended out of turn. So the ops callbacks start (PowerSGD's) are
    started in the same order on every rank, however the training thread runs ahead."""

    def __init__(self) -> None:
        self._items: collections.deque[Item | None] = collections.deque()
        #: the futures whose op is queued (read without the lock by :meth:`_due`)
        self._queued: set[torch.futures.Future[Any]] = set()
        self._lock = threading.RLock()  # held while a future completes and runs callbacks
        #: set when there is work for the thread (its own lock: set from any thread)
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decent-process-group",
                                        daemon=True)
        self._thread.start()

    def submit(self, ending: Ending) -> dist.Work:
        """A Work completed with ``ending.run()``'s outputs (or failed with its error)."""
        future = DrivenFuture(self)
        item = (future, lambda: self._end(ending.run, future))
        if ending.handle is None:
            self._put(item)
        else:
            with self._lock:
                self._items.append(item)
                self._queued.add(future)
            ending.handle.on_done(lambda: self._due(future))
        return DecentWork(future)

    def _due(self, future: torch.futures.Future[Any]) -> None:
        """``future``'s op finished: wake the thread unless a caller has taken it (called on
        the thread that learnt it, which must not wait for this group's lock)."""
        if future in self._queued:
            self._wake.set()

    def after(self, future: torch.futures.Future[Any],
              callback: Callable[[torch.futures.Future[Any]], None]) -> None:
        """Run ``callback(future)`` on this thread once ``future`` is done: when it completes,
        or next if it has already."""
        with self._lock:
            if future.done():
                self._put((None, lambda: callback(future)))
            else:
                future.add_done_callback(callback)

    def in_callback(self) -> bool:
        """Whether the caller is a callback chained on one of this group's ops."""
        return threading.current_thread() is self._thread

    def run_until(self, future: torch.futures.Future[Any]) -> None:
        """End ``future``'s op now, out of turn, in the waiting thread (a blocking op: no
        hand-over between threads; on this group's thread: the callback that waits for it
        started it); on this group's thread, a chained future: run what is due until it is
        done."""
        if not self.in_callback():
            item = self._take(future, in_turn=False)
            if item is not None:
                item[1]()
            return
        while not future.done():
            item = self._take(future, in_turn=True)
            if item is None:
                return
            item[1]()

    def _take(self, future: torch.futures.Future[Any], in_turn: bool) -> Item | None:
        """``future``'s op out of the queue, if it is there; else, ``in_turn``, the next item
        (None at the closing mark or when nothing is queued)."""
        with self._lock:
            item = next((i for i in self._items if i is not None and i[0] is future), None)
            if item is not None:
                self._items.remove(item)
            elif in_turn and self._items and self._items[0] is not None:
                item = self._items.popleft()
            if item is not None:
                self._queued.discard(item[0])
            return item

    def close(self) -> None:
        """End the ops submitted so far, then the thread."""
        self._put(None)
        self._thread.join()

    def _put(self, item: Item | None) -> None:
        """Queue ``item`` and wake the thread for it."""
        with self._lock:
            self._items.append(item)
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            while True:  # everything queued, in order (an op not done yet is waited for)
                with self._lock:
                    if not self._items:
                        break
                    item = self._items.popleft()
                    if item is not None:
                        self._queued.discard(item[0])
                if item is None:
                    return
                item[1]()

    def _end(self, ending: Callable[[], list[torch.Tensor]],
             future: torch.futures.Future[Any]) -> None:
        try:
            outputs = ending()
        except DecentError as exc:
            with self._lock:
                future.set_exception(dist.DistBackendError(str(exc)))
        except Exception as exc:  # a bug here fails that op, not the thread
            with self._lock:
                future.set_exception(exc)
        else:
            with self._lock:
                future.set_result(outputs)
