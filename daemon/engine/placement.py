"""The placement layer: a request's tensors as the ops see them, each with its input and its
result sink (:class:`~decentd.ops.parts.Input`, :class:`~decentd.ops.parts.Sink`).

Here, and only here, the worker's choices about its memory become what an op works with:
views of the arena (checked), an input still being copied in (``SubmitRequest.filling``), an
input left out (``TensorRef.blank``), an output the result is written over the input in
(``offset == out_offset``), one a payload may land in (the sealed arena), a result copied out
as it becomes final (``draining``) and one the worker combines itself (``combining``). The ops
ask their context for the input and the sink and never see these flags.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from functools import partial

import numpy as np

from decent_wire import dtypes
from decent_wire.errors import DecentError
from decent_wire.ops import op_types
from decent_wire.v1 import decent_pb2 as pb
from decentd.keys import RESERVED, qualify
from decentd.ops.parts import Input, PartSpec, Sink
from decentd.workers.sessions import WorkerSession
from decentd.workers.staging import Drain, FillState

#: a name may not contain the separators of wire keys
_RESERVED = re.compile(f"[{re.escape(RESERVED)}]")
#: ops that start while their worker still copies their tensor in (the op table's ``streams``)
STREAMED = op_types(streams=True)


def tensor_part(session: WorkerSession, t: pb.TensorRef, filling: bool = False,
                tell: Callable[[int, pb.Combine | None], None] | None = None,
                combining: bool = False) -> PartSpec:
    """One tensor of a request, validated, with views of the worker's arena: its input still
    being copied in (``filling``), its result told to the worker as it becomes final
    (``tell``), which may combine it itself (``combining``, not in place)."""
    name = t.name
    if not name:
        raise DecentError(pb.INVALID_ARGUMENT, "request has an empty name")
    if _RESERVED.search(name):
        raise DecentError(pb.INVALID_ARGUMENT, f"op name {name!r} contains one of {RESERVED!r}")
    meta = t.meta
    if meta.dtype not in dtypes.STORAGE:
        raise DecentError(pb.INVALID_ARGUMENT, f"tensor '{name}': unsupported dtype "
                                               f"{meta.dtype}")
    shape = tuple(meta.shape)
    if min(shape, default=0) < 0:
        raise DecentError(pb.INVALID_ARGUMENT, f"tensor '{name}': negative dimension in shape "
                                               f"{list(shape)}")
    x_bytes = session.arena.view(t.offset, t.nbytes, f"tensor '{name}' input")
    out_bytes = session.arena.view(t.out_offset, t.out_capacity, f"tensor '{name}' output")
    want = dtypes.nbytes(meta.dtype, shape)
    if want != len(x_bytes):
        raise DecentError(pb.INVALID_ARGUMENT, f"tensor '{name}': "
                          f"{dtypes.describe(meta.dtype, shape)} is {want} bytes but the "
                          f"request says {len(x_bytes)}")
    x = np.frombuffer(x_bytes, dtypes.STORAGE[meta.dtype])
    in_place = t.offset == t.out_offset
    fill = FillState(want, asyncio.get_running_loop()) if filling else None
    drain = None if tell is None else Drain(tell, want)
    sink = Sink(out_bytes, session.arena.holds(t.out_offset, t.out_capacity), in_place, drain,
                combining and drain is not None and not in_place)
    return PartSpec(qualify(session.job, name), name, int(t.round), int(meta.dtype), shape,
                    Input(x, x_bytes, fill, t.blank), sink)


def request_parts(session: WorkerSession, req: pb.SubmitRequest, op: int) -> list[PartSpec]:
    """Every tensor of request ``req`` (of op ``op``), placed: how its input comes in and where
    its result goes. DecentError when the request asks for a placement its op cannot take."""
    alone = len(req.tensors) == 1
    if req.filling and (op not in STREAMED or not alone):
        raise DecentError(pb.INVALID_ARGUMENT, f"tensor '{req.tensors[0].name}': only a "
                          "single-tensor neighbor_allreduce may be sent while it is copied in")
    draining = req.draining and op in STREAMED and alone
    tell = partial(session.tell_final, req.request_id) if draining else None
    parts = [tensor_part(session, t, req.filling, tell, req.combining) for t in req.tensors]
    first = parts[0]
    if any(p.input.blank for p in parts) and op != pb.NEIGHBOR_ALLREDUCE:
        raise DecentError(pb.INVALID_ARGUMENT, f"tensor '{first.display}': only a "
                          "neighbor_allreduce may leave its input out (TensorRef.blank), not "
                          f"{pb.OpType.Name(op)}")
    if len({p.round for p in parts}) != 1:
        raise DecentError(pb.INVALID_ARGUMENT, f"fused request '{first.display}' mixes rounds "
                          f"{sorted({p.round for p in parts})}; fuse one step's tensors")
    if first.input.fill is not None:  # the worker's Fill notes advance it
        session.filling[req.request_id] = first.input.fill
    return parts
