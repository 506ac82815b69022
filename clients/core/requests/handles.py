"""One request's life on the worker side, and the handle the caller holds.

A :class:`Pending` request moves through explicit states::

    QUEUED --(bucket sent)--> SENT --(completion)--> DONE --(wait() reads it)--> READ
                                \\                     \\
                                 +--(error)--> FAILED   +--(handle dropped)--> RELEASED
                                 +--(handle dropped)--> ABANDONED --(completion)--> RELEASED

Its arena slots are held until READ, FAILED or RELEASED. Transitions happen under the request's
lock: the completion reader, the caller's ``wait()`` and the garbage collector may race.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from decent.core.requests.placement import Delivery
from decent_wire.errors import DecentError
from decent_wire.v1 import decent_pb2 as pb

T = TypeVar("T")


class State(enum.Enum):
    """Where a request is in its life."""

    QUEUED = "waiting in a fusion bucket"
    SENT = "sent; running in the daemon"
    ABANDONED = "sent; its handle is gone, nobody will read it"
    DONE = "finished; the result waits in the arena"
    READ = "finished; the result was read and its slots freed"
    FAILED = "failed; its slots freed"
    RELEASED = "finished unread; its slots freed"


#: states in which the request's arena slots are free again
FREED = frozenset({State.READ, State.FAILED, State.RELEASED})


class Latch:
    """Set once, then open for good: :class:`threading.Event` for one request, as one lock
    held from the start (a wait is one acquire, the set one release: no condition)."""

    __slots__ = ("_lock", "_open")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._open = False

    def set(self) -> None:
        """Open the latch (once; later calls do nothing)."""
        if not self._open:
            self._open = True
            with contextlib.suppress(RuntimeError):  # two setters at once: one released it
                self._lock.release()

    def is_set(self) -> bool:
        """Whether the latch is open."""
        return self._open

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the latch is open (at most ``timeout`` seconds); whether it is."""
        if self._open:
            return True
        if not self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            return self._open
        with contextlib.suppress(RuntimeError):
            self._lock.release()  # open for every other waiter
        return True


@dataclass(eq=False)
class Pending:
    """One request: where its tensor and result lie, and how far it got."""

    request_id: int
    what: tuple[str, str, int]  #: (op, name, round), for messages (:attr:`label`)
    slots: list[tuple[int, int]]  #: (offset, bytes) of arena memory it holds
    dtype: int
    shape: tuple[int, ...]
    nbytes: int
    out_offset: int
    like: Any  #: the input tensor (its device and kind shape the result)
    into: Any = None  #: in-place ops: the tensor the result is written into
    #: how its result reaches the caller (:mod:`decent.core.requests.placement`)
    delivery: Delivery = field(default_factory=Delivery)
    #: bytes of the result copied (or combined) into ``delivery.sink`` so far
    drained: int = 0
    state: State = State.SENT
    #: the result's size and shape are this request's own, not the completion's (fused: one
    #: completion answers several requests)
    own_shape: bool = False
    completion: pb.Completion | None = None
    error: DecentError | None = None
    result: Any = None
    #: someone waited for it (``wait`` or ``join``): Horovod's ``synchronize``
    waited: bool = False
    event: Latch = field(default_factory=Latch)
    #: called once it finished (:meth:`Handle.on_done`), on the thread that settled it
    done_callbacks: list[Callable[[], None]] = field(default_factory=list)
    #: reentrant: the garbage collector may drop a handle while its request is being settled
    lock: threading.RLock = field(default_factory=threading.RLock)

    @property
    def label(self) -> str:
        """``neighbor_allreduce 'w' round 3`` for messages."""
        op, name, round_ = self.what
        return f"{op} '{name}' round {round_}"

    def result_layout(self) -> tuple[int, tuple[int, ...]]:
        """(bytes, shape) of the result in the arena."""
        c = self.completion
        if self.own_shape or c is None:
            return self.nbytes, self.shape
        return int(c.out_nbytes), tuple(c.out_meta.shape)


class Requests(Protocol):
    """What a handle asks of the client that made it."""

    def flush(self) -> None:
        """Send every open fusion bucket now."""

    def collect(self, p: Pending) -> None:
        """Read ``p``'s result out of the arena (once) and free its slots."""

    def abandon(self, p: Pending) -> None:
        """``p``'s handle is gone: free its slots when it finishes."""

    def await_done(self, p: Pending, timeout: float | None) -> bool:
        """Block until ``p`` finished (at most ``timeout`` s); whether it did."""

    def blocked(self, seconds: float) -> None:
        """A caller was blocked ``seconds`` waiting for an op that had not finished."""


class Handle(Generic[T]):
    """The future result of one asynchronous op."""

    def __init__(self, requests: Requests, pending: Pending,
                 post: Callable[[Any], T] | None = None, source: Handle[Any] | None = None
                 ) -> None:
        self._requests = requests
        self.pending = pending
        self._post = post
        #: the handle this one derives from (kept alive: its result is this one's input)
        self._source = source
        if source is None:
            weakref.finalize(self, _abandon, requests.abandon, pending)

    def then(self, fn: Callable[[T], Any]) -> Handle[Any]:
        """A handle whose ``wait()`` gives ``fn`` of this one's result (decompression, a
        scale)."""
        return Handle(self._requests, self.pending, lambda r: fn(self._apply(r)), self)

    def _apply(self, result: Any) -> T:
        return result if self._post is None else self._post(result)

    @property
    def name(self) -> str:
        """The op's label (op, name, round)."""
        return self.pending.label

    def done(self) -> bool:
        """True once the daemon reported the op finished (successfully or not)."""
        return self.pending.event.is_set()

    def on_done(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once the op finished (successfully or not): at once if it has, else
        on the thread that learns it (the completion reader: ``fn`` must not block)."""
        p = self.pending
        with p.lock:
            if not p.event.is_set():
                p.done_callbacks.append(fn)
                return
        fn()

    def _wait(self, timeout: float | None) -> Pending:
        p = self.pending
        if p.state is State.QUEUED:
            self._requests.flush()
        if p.event.is_set():
            return p
        began = time.perf_counter()
        try:
            finished = self._requests.await_done(p, timeout)
        finally:
            self._requests.blocked(time.perf_counter() - began)
        if not finished:
            raise TimeoutError(f"{p.label}: not finished after {timeout}s (still running)")
        return p

    def wait(self, timeout: float | None = None) -> T:
        """Block until the op finishes; its result, or DecentError with the daemon's reason."""
        p = self._wait(timeout)
        p.waited = True
        self._requests.collect(p)
        if p.error is not None:
            raise p.error
        result: T = self._apply(p.result)
        return result

    def join(self, timeout: float | None = None) -> None:
        """Block until the op finishes and raise its error, without reading a result (ops
        whose result is nothing: barrier, win_get, win_free)."""
        p = self._wait(timeout)
        p.waited = True
        self._requests.abandon(p)
        if p.error is not None:
            raise p.error

    @property
    def src_ranks(self) -> list[int]:
        """For allgather: the ranks whose tensors are stacked in the result, in order."""
        c = self._wait(None).completion
        return list(c.src_ranks) if c is not None else []


def _abandon(abandon: Callable[[Pending], None], pending: Pending) -> None:
    abandon(pending)
