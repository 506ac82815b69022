"""CUDA tensors through the pinned arena, without stalling the GPU.

A CUDA tensor reaches the daemon as its bytes in the worker's arena, which the codec pins
(``cudaHostRegister``). The copies run on a side stream of the tensor's device:

- **Out (device to host).** The side stream waits for an event recorded on the producer's
  current stream (never for the whole device), then copies the tensor into its arena slot in
  chunks, recording an event after each. :meth:`Staging.to_host` returns the events, so the
  caller can tell the daemon how much is in as each chunk lands (``SubmitRequest.filling``: the
  daemon starts sending after the first chunk).
- **Back (host to device).** A result is copied from its slot into a device tensor on the side
  stream; the caller's current stream waits for that copy's event, so the tensor ``wait()``
  returns is ready for whatever the caller queues next, without the CPU waiting. The slot is
  freed once the copy is done (:class:`Releases`, a thread that waits on the events).
- **Results without allocations.** An out-of-place result needs a device tensor; they come from
  a pool of tensors whose earlier results were garbage-collected (:class:`DevicePool`), so a
  training step that keeps no result longer than a step allocates nothing model-sized.
"""

from __future__ import annotations

import collections
import queue
import threading
import weakref
from collections.abc import Callable

import torch

#: a large tensor is staged in chunks of this many bytes (the daemon starts on the first)
STAGE_CHUNK = 4 << 20


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor (no copy)."""
    return t.reshape(-1).view(torch.uint8)


class Staging:
    """The side stream of each device, and the copies through it."""

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def side(self, device: torch.device) -> torch.cuda.Stream:
        """The side stream of ``device`` (made once)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = torch.cuda.Stream(device=index)
            return stream

    def to_host(self, src: torch.Tensor, host: torch.Tensor,
                chunk: int = STAGE_CHUNK) -> list[tuple[torch.cuda.Event, int]]:
        """Copy CUDA tensor ``src`` into ``host`` (pinned uint8, its size) on the side stream,
        after what the producer's stream queued so far: (event, bytes in once it fired) per
        chunk. Non-contiguous tensors are made contiguous on the producer's stream first."""
        producer = torch.cuda.current_stream(src.device)
        if not src.is_contiguous():
            src = src.contiguous()
        ready = torch.cuda.Event()
        ready.record(producer)
        side = self.side(src.device)
        side.wait_event(ready)
        flat = _flat_bytes(src)
        nbytes = flat.numel()
        events = []
        with torch.cuda.stream(side):
            for lo in range(0, nbytes, chunk):
                hi = min(nbytes, lo + chunk)
                host[lo:hi].copy_(flat[lo:hi], non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
                events.append((done, hi))
        src.record_stream(side)  # its memory stays the copy's until the side stream is past it
        return events

    def to_device(self, host: torch.Tensor, out: torch.Tensor) -> torch.cuda.Event:
        """Copy ``host`` (pinned, ``out``'s dtype and shape) into CUDA tensor ``out`` on the side
        stream, after what the caller's stream queued so far (which may still read ``out``);
        the caller's stream waits for the copy. The copy's event."""
        caller = torch.cuda.current_stream(out.device)
        before = torch.cuda.Event()
        before.record(caller)
        side = self.side(out.device)
        side.wait_event(before)
        with torch.cuda.stream(side):
            out.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        caller.wait_event(done)
        out.record_stream(side)
        return done


class Releases:
    """Runs each release once its copy's event has fired (on a thread of its own, so that
    neither the caller nor the completion reader waits for the GPU)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[torch.cuda.Event, Callable[[], None]] | None] = \
            queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def after(self, event: torch.cuda.Event, release: Callable[[], None]) -> None:
        """Run ``release`` once ``event`` has fired."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="decent-cuda-releases",
                                                daemon=True)
                self._thread.start()
        self._queue.put((event, release))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            event, release = item
            event.synchronize()
            release()

    def close(self) -> None:
        """Run every pending release (their copies done) and stop the thread."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()


class DevicePool:
    """Device tensors for out-of-place results, reused once the result that held one is
    garbage-collected (by shape, dtype and device)."""

    def __init__(self, limit_bytes: int = 4 << 30) -> None:
        self._free: dict[tuple[tuple[int, ...], torch.dtype, torch.device],
                         collections.deque[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._limit = limit_bytes
        self._held = 0
        self.made = 0  #: tensors this pool allocated
        self.reused = 0  #: results given a tensor an earlier result had

    def take(self, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        """A device tensor of ``shape`` and ``dtype`` (uninitialized); back in the pool once the
        returned tensor (and every view of it) is gone."""
        key = (tuple(shape), dtype, device)
        with self._lock:
            free = self._free.get(key)
            buf = free.popleft() if free else None
            if buf is not None:
                self._held -= buf.numel() * buf.element_size()
                self.reused += 1
        if buf is None:
            buf = torch.empty(shape, dtype=dtype, device=device)
            self.made += 1
        out = buf.view(shape)  # a new tensor object over the kept storage
        weakref.finalize(out, self._give_back, key, buf)
        return out

    def _give_back(self, key: tuple[tuple[int, ...], torch.dtype, torch.device],
                   buf: torch.Tensor) -> None:
        nbytes = buf.numel() * buf.element_size()
        with self._lock:
            if self._held + nbytes > self._limit:
                return  # dropped: the caching allocator keeps it
            self._free.setdefault(key, collections.deque()).append(buf)
            self._held += nbytes
