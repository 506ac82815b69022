"""Tensor fusion: many small asynchronous requests go to the daemon as one.

Horovod's two knobs: a request waits in a bucket of compatible requests (same op, arguments and
round) until the bucket holds ``threshold`` bytes, ``cycle_time`` has passed since its first
request, or someone waits for a result (``flush``). The daemon then runs the bucket as one op: one
message per peer, its tensors gathered straight from their arena slots. Each tensor keeps its own
(name, round) on the wire, so ranks whose buckets close at different moments still match.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

M = TypeVar("M")

#: Horovod's defaults: 64 MiB buckets, closed at the latest 1 ms after their first tensor
DEFAULT_THRESHOLD = 64 << 20
DEFAULT_CYCLE_TIME = 0.001


def settings_from_env() -> tuple[int, float]:
    """(threshold bytes, cycle time seconds) from $DECENT_FUSION_THRESHOLD and
    $DECENT_CYCLE_TIME (milliseconds), else the defaults; threshold 0 turns fusion off."""
    threshold = int(os.environ.get("DECENT_FUSION_THRESHOLD", DEFAULT_THRESHOLD))
    cycle_ms = float(os.environ.get("DECENT_CYCLE_TIME", DEFAULT_CYCLE_TIME * 1e3))
    if threshold < 0 or cycle_ms < 0:
        raise ValueError("DECENT_FUSION_THRESHOLD and DECENT_CYCLE_TIME must not be negative")
    return threshold, cycle_ms / 1e3


@dataclass
class _Bucket(Generic[M]):
    limit: int
    deadline: float
    members: list[M] = field(default_factory=list)
    nbytes: int = 0


class Fusion(Generic[M]):
    """Buckets of pending requests, closed by size, by age (a timer thread) or on demand."""

    def __init__(self, threshold: int, cycle_time: float,
                 send: Callable[[list[M]], None]) -> None:
        self.threshold = threshold
        self.cycle_time = cycle_time
        self._send = send
        self._cv = threading.Condition()
        self._buckets: dict[Hashable, _Bucket[M]] = {}
        self._closed = False
        self._idle = False
        self._holds = 0  # blocks of held(): while any is open, only size closes a bucket
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        """Whether requests are fused at all."""
        return self.threshold > 0

    def add(self, key: Hashable, member: M, nbytes: int, limit: int | None = None) -> None:
        """Put ``member`` in the bucket of ``key``; a bucket reaching ``limit`` bytes (default
        the threshold) is sent at once."""
        full = None
        with self._cv:
            bucket = self._buckets.get(key)
            if bucket is None:
                cap = self.threshold if limit is None else min(limit, self.threshold)
                bucket = self._buckets[key] = _Bucket(cap, time.monotonic() + self.cycle_time)
                if self._idle:  # the timer sleeps without a deadline: give it one
                    self._cv.notify()
            bucket.members.append(member)
            bucket.nbytes += nbytes
            if bucket.nbytes >= bucket.limit:
                full = self._buckets.pop(key)
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="decent-fusion")
                self._thread.start()
        if full is not None:
            self._send(full.members)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """A block in which buckets close only by size; when the last such block ends, every
        open bucket is sent."""
        with self._cv:
            self._holds += 1
        try:
            yield
        finally:
            with self._cv:
                self._holds -= 1
                last = self._holds == 0
            if last:
                self.flush()

    def flush(self) -> None:
        """Send every open bucket now."""
        with self._cv:
            buckets = list(self._buckets.values())
            self._buckets.clear()
        for bucket in buckets:
            self._send(bucket.members)

    def close(self) -> None:
        """Send what is left and stop the timer."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self.flush()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        while True:
            with self._cv:
                if self._closed:
                    return
                now = time.monotonic()
                due = [] if self._holds else [k for k, b in self._buckets.items()
                                              if b.deadline <= now]
                ready = [self._buckets.pop(k) for k in due]
                if not ready:
                    soonest = None if self._holds else min(
                        (b.deadline for b in self._buckets.values()), default=None)
                    self._idle = soonest is None
                    self._cv.wait(None if soonest is None else max(0.0, soonest - now))
                    self._idle = False
                    continue
            for bucket in ready:
                self._send(bucket.members)
            del ready, bucket  # the timer sleeps next: it must not keep the tensors alive
