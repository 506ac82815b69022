"""Parameters laid out in one shared-memory buffer per dtype, which the daemon averages in place.

``DecentralizedOptimizer`` uses this for the algorithms whose update is ``x' = M (x - d)``: the
wrapped optimizer writes ``x - d`` into the parameters, so once they live in a buffer the daemon
has mapped, a step is the optimizer's own step and one in-place op per buffer, with no clone and
no copy between the worker and the daemon.

Moving a tensor's memory strands whatever else points at the old memory (numpy views, DLPack
exports), so only memory nobody else should see is moved: a parameter that is the whole of its
own private storage, or a view of a buffer made here before (``ours``). Memory that two
parameters share (tied weights), or that several parameters hold in shared memory already
(``model.share_memory()`` for Hogwild-style sharing across processes), is left alone, and the
caller keeps its copying path. Parameters that tile one storage end to end already (a buffer
made here, or a lone parameter) are used where they lie; a private such storage is put in shared
memory in place, which torch views follow and numpy views do not.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable

import torch

from decent.core.training.algorithms import AlgorithmError


def _dense_cpu(p: torch.Tensor) -> bool:
    return p.device.type == "cpu" and p.layout == torch.strided and p.is_contiguous()


def _storage(p: torch.Tensor) -> int:
    return p.untyped_storage().data_ptr()


def _movable(p: torch.Tensor, ours: Collection[int]) -> bool:
    """Whether ``p`` may be moved: a view of one of ``ours``, or a dense CPU tensor that is the
    whole of its own private storage."""
    if _storage(p) in ours:
        return True
    return (_dense_cpu(p) and not p.is_shared() and p.storage_offset() == 0
            and p.untyped_storage().nbytes() == p.numel() * p.element_size())


def _tiled_buffer(members: list[torch.Tensor]) -> torch.Tensor | None:
    """The storage ``members`` tile in order, end to end, as a flat tensor over it, or None."""
    first = members[0]
    storage, at = first.untyped_storage(), 0
    for p in members:
        if not _dense_cpu(p) or _storage(p) != storage.data_ptr() or p.storage_offset() != at:
            return None
        at += p.numel()
    if at == 0 or at * first.element_size() != storage.nbytes():
        return None
    return torch.empty(0, dtype=first.dtype).set_(storage, 0, (at,), (1,))


def _share(flat: torch.Tensor) -> None:
    """Put ``flat``'s storage in shared memory, in place (every view of it follows)."""
    storage = flat.untyped_storage()
    if storage.is_shared() or not storage.nbytes():
        return
    try:
        storage.share_memory_()
    except RuntimeError as exc:
        raise AlgorithmError(
            f"cannot place {storage.nbytes()} bytes of parameters in shared memory ({exc}): "
            "give the worker more shared memory (docker: --shm-size; Kubernetes: an emptyDir of "
            "medium Memory on /dev/shm) or pass flatten=False on every rank") from None


def flatten_parameters(params: Iterable[torch.Tensor],
                       ours: Collection[int] = ()) -> list[torch.Tensor] | None:
    """Lay ``params`` out in one shared-memory buffer per dtype, in order; the flat buffers.

    Each parameter keeps its identity, shape and values; its ``.data`` becomes a view of its
    dtype's buffer. Parameters that already tile one storage end to end (flattened before, or a
    lone parameter) keep it, and it is put in shared memory in place if it is private. The
    others must all be movable and untied (module docstring; ``ours`` are the storages of buffers
    made here before), else nothing changes and the result is None. AlgorithmError when shared
    memory is too small.
    """
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault(p.dtype, []).append(p)
    if not groups:
        return None
    tiled: dict[torch.dtype, torch.Tensor | None] = {}
    claimed: dict[int, list[tuple[int, int]]] = {}  # storage -> element ranges of parameters
    for dtype, members in groups.items():
        tiled[dtype] = _tiled_buffer(members)
        if tiled[dtype] is not None:
            continue
        for p in members:
            if not _movable(p, ours):
                return None  # memory others may see
            if p.numel():
                at = int(p.storage_offset())
                claimed.setdefault(_storage(p), []).append((at, at + p.numel()))
    for ranges in claimed.values():
        ranges.sort()
        if any(b[0] < a[1] for a, b in itertools.pairwise(ranges)):
            return None  # two parameters on the same memory (tied): moving would untie them
    flats = []
    for dtype, members in groups.items():
        flat = tiled[dtype]
        if flat is None:
            flat = torch.empty(sum(p.numel() for p in members), dtype=dtype)
            _share(flat)
            at = 0
            for p in members:
                view = flat[at:at + p.numel()].view_as(p)
                view.copy_(p.detach())
                p.data = view
                at += p.numel()
        else:
            _share(flat)
        flats.append(flat)
    return flats


def share_in_place(params: Iterable[torch.Tensor]) -> int:
    """Put the private storage of each dense CPU parameter that is the whole of it into shared
    memory in place (as ``model.share_memory()`` does; torch views follow, numpy views do not),
    so that in-place ops have the daemon average it where it lies; the storages moved.

    The general path's counterpart of :func:`flatten_parameters`: parameters keep storages of
    their own (tied ones stay tied: they are one storage). A storage shared memory cannot hold
    stays private, and its parameter is copied to the daemon and back as before.
    """
    moved = 0
    for p in params:
        storage = p.untyped_storage()
        if not _dense_cpu(p) or storage.is_shared() or p.storage_offset() != 0 or \
                storage.nbytes() != p.numel() * p.element_size() or not storage.nbytes():
            continue
        try:
            storage.share_memory_()
        except RuntimeError:
            continue
        moved += 1
    return moved

