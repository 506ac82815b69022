"""How the ``decent`` process group's ops end (:mod:`decent.torch.distributed`): the tensors
torch hands over, flattened, and each op's ending, which waits for the client's handle and
puts its result where torch wants it; and :class:`Resharer`, which moves DDP's reused gradient
buckets into shared memory."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any, TypeVar

import torch

from decent.core import DecentError, Handle
from decent.torch.distributed.work import Ending
from decent_wire.v1 import decent_pb2 as pb

#: a tensor, or a list of them (torch passes one per device)
One = TypeVar("One")


#: a tensor reduced again whose storage takes at least this much moves to shared memory
SHARE_FROM_BYTES = 1 << 20
#: storages remembered as reduced once
SEEN = 256


class Resharer:
    """Moves the storage of a tensor reduced a second time (DDP's gradient buckets, reused
    every step) into shared memory, in place (as ``share_memory_()`` does: its views follow),
    so that from then on the daemon reads and writes it where it lies, with no copy in or out.
    Only whole storages of at least :data:`SHARE_FROM_BYTES`: a tensor used once is copied."""

    def __init__(self) -> None:
        self._seen: collections.OrderedDict[tuple[int, int], None] = collections.OrderedDict()

    def note(self, t: torch.Tensor) -> None:
        """``t`` is about to be reduced in place."""
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if t.device.type != "cpu" or nbytes < SHARE_FROM_BYTES or storage.is_shared() or \
                nbytes != t.numel() * t.element_size():
            return
        key = (storage.data_ptr(), nbytes)
        if key in self._seen:
            del self._seen[key]
            t.share_memory_()
            return
        self._seen[key] = None
        while len(self._seen) > SEEN:
            self._seen.popitem(last=False)


def single(tensors: Sequence[One], what: str) -> One:
    """The one tensor of a per-device list (one device per process)."""
    if len(tensors) != 1:
        raise NotImplementedError(f"the decent backend's {what} takes one tensor per process, "
                                  f"not {len(tensors)}")
    return tensors[0]


def flattened(t: torch.Tensor) -> torch.Tensor:
    """``t`` as one contiguous row per element (a copy only when it is not contiguous)."""
    return t.contiguous().reshape(-1)


def whole(handle: Handle[Any], ranks: Sequence[int]) -> Handle[Any]:
    """``handle``, failed unless its op covered every rank of ``ranks`` (a collective over
    the live ranks leaves out a rank that left: torch's process groups fail instead)."""
    covered = handle.src_ranks
    if covered and set(covered) != set(ranks):
        lost = sorted(set(ranks) - set(covered))
        raise DecentError(pb.PEER_UNAVAILABLE, f"{handle.name}: rank "
                          f"{', '.join(map(str, lost))} of the process group left; a collective "
                          "of torch.distributed needs every rank")
    return handle


def waited(handle: Handle[torch.Tensor], t: torch.Tensor, ranks: Sequence[int]) -> Ending:
    """The ending of an in-place op on ``t`` (every rank of ``ranks`` covered)."""
    def end() -> list[torch.Tensor]:
        handle.wait()
        whole(handle, ranks)
        return [t]
    return Ending(end, handle)


def copied_back(handle: Handle[torch.Tensor], into: torch.Tensor,
                 ranks: Sequence[int] = ()) -> Ending:
    """The ending of an op whose result goes into ``into`` (``ranks``: all of them must be
    covered)."""
    def end() -> list[torch.Tensor]:
        into.copy_(handle.wait().reshape(into.shape))
        if ranks:
            whole(handle, ranks)
        return [into]
    return Ending(end, handle)


def split_into(handle: Handle[torch.Tensor], outputs: Sequence[torch.Tensor]) -> Ending:
    """The ending of an op whose result is ``outputs`` one after the other."""
    def end() -> list[torch.Tensor]:
        got, at = handle.wait().reshape(-1), 0
        for out in outputs:
            out.copy_(got[at:at + out.numel()].reshape(out.shape))
            at += out.numel()
        return list(outputs)
    return Ending(end, handle)
