"""Sending a training state to a rank that joined late, and taking it there (framework-neutral:
the adapter supplies its tensors' :class:`~decent.core.training.state.StateKit`).

The state (parameters, the optimizer's state, the algorithm's state and counters) travels as
tensors and plain values (:mod:`decent.core.training.state`), never a pickle, one way with dynamic
neighbor gathers under the names of :mod:`decent.core.surface.rejoin`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast

import numpy as np

from decent.core.surface.client import Client
from decent.core.surface.rejoin import META_NAME, READY_NAME, SIZE_NAME, TENSOR_NAME
from decent.core.training.algorithms import AlgorithmError
from decent.core.training.state import StateFormatError, StateKit, decode, encode

T = TypeVar("T")

log = logging.getLogger("decent.rejoin")

#: the largest state description a joining rank accepts (the tensors travel apart)
MAX_META = 256 << 20

#: (joining rank, where the training thread puts the snapshot for it)
Wanted = tuple[int, "queue.Queue[tuple[bytes, list[T]]]"]


class StateLink(Generic[T]):
    """Sends a training state (tensors and plain values, :mod:`decent.core.training.state`) one way
    between two ranks with dynamic neighbor gathers: its description's size, the description
    (JSON), then each tensor. ``kit``: the framework's tensors."""

    def __init__(self, client: Client[T], kit: StateKit[T]) -> None:
        self.client = client
        self.kit = kit

    def _to(self, to: int, t: T, name: str) -> None:
        self.client.neighbor_allgather(t, name=name, src_ranks=[], dst_ranks=[to])

    def _from(self, src: int, t: T, name: str) -> T:
        got: Any = self.client.neighbor_allgather(t, name=name, src_ranks=[src], dst_ranks=[])
        return cast(T, got[0])  # stacked on a new leading dimension: the one source's

    def snapshot(self, state: Any) -> tuple[bytes, list[T]]:
        """``state`` as a description and host copies of its tensors (training goes on)."""
        meta, tensors = encode(state, self.kit)
        return meta, [self.kit.copied(t) for t in tensors]

    def send(self, to: int, meta: bytes, tensors: list[T]) -> None:
        """Send a :meth:`snapshot` to rank ``to`` (it runs :meth:`receive`)."""
        self._to(to, self.client.tensor(np.array([len(meta)], np.int64)), SIZE_NAME)
        self._to(to, self.client.tensor(np.frombuffer(meta, np.uint8)), META_NAME)
        for i, t in enumerate(tensors):
            self._to(to, t, f"{TENSOR_NAME}{i}")

    def serve_in_background(self, to: int, wanted: queue.Queue[Wanted[T]],
                            patience: float) -> threading.Thread:
        """On a thread of its own (the sender's training goes on): wait until rank ``to`` is
        ready to take the state, ask the training thread for a snapshot at its next step
        boundary (``wanted``), and send it; the state is then at most a step old. A failure
        is logged: the joining rank times out and starts from its own state."""
        def run() -> None:
            try:
                self._from(to, self.client.tensor(np.zeros(1, np.float32)), READY_NAME)
                box: queue.Queue[tuple[bytes, list[T]]] = queue.Queue(1)
                wanted.put((to, box))
                self.send(to, *box.get(timeout=patience))
            except Exception as exc:  # the joining rank died again, or timed out
                log.warning("sending the training state to rank %d failed: %s", to, exc)

        thread = threading.Thread(target=run, name=f"decent-rejoin-{to}", daemon=True)
        thread.start()
        return thread

    def receive(self, src: int) -> Any:
        """The state rank ``src`` sends (checked before use); AlgorithmError when it is not
        well formed."""
        # ready: the donor snapshots its state at its next step from now, not when it saw us
        self._to(src, self.client.tensor(np.ones(1, np.float32)), READY_NAME)
        size_t = self._from(src, self.client.tensor(np.zeros(1, np.int64)), SIZE_NAME)
        size = int(self.client.values(size_t)[0])
        if not 0 <= size <= MAX_META:
            raise AlgorithmError(f"rank {src} announced a state description of {size} bytes "
                                 f"(at most {MAX_META})")
        meta_t = self._from(src, self.client.tensor(np.zeros(size, np.uint8)), META_NAME)
        meta = self.client.values(meta_t).tobytes()
        try:
            return decode(meta, lambda i, wire: self._from(src, wire, f"{TENSOR_NAME}{i}"),
                          self.kit)
        except (StateFormatError, ValueError, KeyError, TypeError) as exc:
            raise AlgorithmError(f"rank {src} sent a training state this rank cannot read: "
                                 f"{exc}") from None


def hand_out(wanted: queue.Queue[Wanted[T]], snapshot: Callable[[], tuple[bytes, list[T]]]
             ) -> None:
    """At a step boundary: give every newcomer that is ready a snapshot of the state now."""
    while not wanted.empty():
        _, box = wanted.get_nowait()
        box.put(snapshot())
