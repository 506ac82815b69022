"""The framework-agnostic client: one connection to the local daemon, shared by every op.

A request is: allocate a slot in the shared-memory arena, let the framework codec copy the tensor
into it, send a small Submit (offsets, dtype, shape, weights) without waiting for the answer, and
hand back a :class:`Handle`. One background thread reads the daemon's completion stream and wakes
the handles; ``Handle.wait()`` blocks on an event, it never polls. Framework adapters
(``decent.torch``, ``decent.tf``) supply a :class:`TensorCodec`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import socket
import tempfile
import threading
import time
import weakref
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import grpc
import numpy as np

from decent.core.arena import ClientArena
from decent.core.errors import DecentError
from decent.core.fusion import Fusion, settings_from_env
from decent.core.regions import Region, RegionTable, SharedStorage
from decent.v1 import decent_pb2 as pb
from decent.v1 import decent_pb2_grpc as pb_grpc

PROTOCOL_VERSION = 1
#: in-place ops register shared-memory tensors this large instead of copying them
REGISTER_MIN_BYTES = 64 << 10
MEMORY_CALL_TIMEOUT = 30.0
ITEMSIZE = {pb.FLOAT16: 2, pb.BFLOAT16: 2, pb.FLOAT32: 4, pb.FLOAT64: 8, pb.INT32: 4, pb.INT64: 8}

T = TypeVar("T")
log = logging.getLogger("decent")


class TensorCodec(Protocol[T]):
    """How a framework's tensors go into and come out of the arena."""

    framework: str

    def describe(self, tensor: T) -> tuple[int, tuple[int, ...]]:
        """(wire dtype, shape) of ``tensor``; raise TypeError for an unsupported dtype."""

    def write(self, tensor: T, dst: memoryview) -> None:
        """Copy ``tensor``'s bytes into ``dst`` (exactly its size), finished on return."""

    def read(self, src: memoryview, dtype: int, shape: tuple[int, ...], like: T) -> T:
        """A new tensor of ``dtype``/``shape`` from ``src``, on ``like``'s device."""

    def read_into(self, src: memoryview, into: T) -> T:
        """Copy ``src`` (``into``'s dtype and shape) into ``into``, finished on return."""

    def address(self, tensor: T) -> int | None:
        """The host address of ``tensor``'s bytes if they are contiguous in host memory."""

    def wrap(self, owner: Any, dtype: int, shape: tuple[int, ...]) -> T:
        """A tensor over the bytes of buffer ``owner``, keeping ``owner`` alive as long as it."""

    def attach(self, arena: ClientArena) -> None:
        """Called once the arena is mapped (e.g. to pin it for GPU copies)."""

    def shared_storage(self, tensor: T) -> SharedStorage | None:
        """The memory block holding a contiguous host ``tensor`` if that block is fd-backed
        shared memory (never moving it there); None otherwise, cheaply for private memory."""


def _frame(message: pb.SubmitRequest | pb.WorkerHello) -> bytes:
    body = message.SerializeToString()
    return len(body).to_bytes(4, "little") + body


def default_address() -> str:
    """$DECENT_DAEMON, else the daemon's default socket."""
    env = os.environ.get("DECENT_DAEMON")
    if env:
        return env if "://" in env or ":" in env else f"unix://{env}"
    return f"unix://{os.path.join(tempfile.gettempdir(), 'decentd.sock')}"


#: how long a client waits for the daemon's Unix socket to appear before saying there is none
SOCKET_WAIT = 30.0


def _wait_for_socket(address: str, timeout: float) -> None:
    if not address.startswith("unix://"):
        return
    path = address[len("unix://"):]
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() >= deadline:
            raise DecentError(
                pb.PEER_UNAVAILABLE,
                f"no decentd socket at {path} after {timeout:g}s: start decentd (or run under "
                "decentrun), or point $DECENT_DAEMON at the daemon's socket",
            )
        time.sleep(0.05)


@dataclass
class _Pending:
    request_id: int
    label: str
    slots: list[tuple[int, int]]
    dtype: int
    like: Any
    event: threading.Event = field(default_factory=threading.Event)
    completion: pb.Completion | None = None
    error: DecentError | None = None
    abandoned: bool = False
    freed: bool = False
    collected: bool = False
    result: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    out_offset: int = 0
    shape: tuple[int, ...] = ()
    nbytes: int = 0  # the result's size when the daemon's completion covers several tensors
    into: Any = None  # in-place ops: the tensor the result is copied into
    fused: bool = False  # completed as part of a fused request
    resident: bool = False  # in place on a shared() tensor: the daemon wrote into it
    bucketed: bool = False  # waits in a fusion bucket (not sent yet)


class Handle(Generic[T]):
    """The future result of one asynchronous op."""

    def __init__(self, client: Client[T], pending: _Pending) -> None:
        self._client = client
        self._pending = pending
        weakref.finalize(self, client._abandon, pending)

    @property
    def name(self) -> str:
        """The op's label (op, name, round)."""
        return self._pending.label

    def done(self) -> bool:
        """True once the daemon reported the op finished (successfully or not)."""
        return self._pending.event.is_set()

    def wait(self, timeout: float | None = None) -> T:
        """Block until the op finishes; its result, or DecentError with the daemon's reason."""
        p = self._pending
        if p.bucketed:
            self._client._fusion.flush()
        if not p.event.wait(timeout):
            raise TimeoutError(f"{p.label}: not finished after {timeout}s (still running)")
        if p.error is not None:
            self._client._release(p)
            raise p.error
        self._client._collect(p)
        if p.error is not None:
            raise p.error
        result: T = p.result
        return result

    @property
    def src_ranks(self) -> list[int]:
        """For allgather: the ranks whose tensors are stacked in the result, in order."""
        if self._pending.bucketed:
            self._client._fusion.flush()
        self._pending.event.wait()
        c = self._pending.completion
        return list(c.src_ranks) if c is not None else []


WeightsArg = Mapping[int, float] | Iterable[int] | None
#: compressors of :meth:`Client.compressed_neighbor_allreduce_async` (see decentd.compression)
COMPRESSORS = {"topk": pb.TOPK, "sign": pb.SIGN, "int8": pb.INT8}
#: averaging rules of :meth:`Client.group_allreduce_async`
GROUP_RULES = {"mean": pb.GROUP_MEAN, "with-self": pb.GROUP_WITH_SELF}


def _weights(arg: WeightsArg) -> dict[int, float] | None:
    if arg is None:
        return None
    if isinstance(arg, Mapping):
        return {int(k): float(v) for k, v in arg.items()}
    return {int(k): 1.0 for k in arg}


@dataclass(frozen=True)
class WindowState:
    """A window as this rank's daemon holds it (:meth:`Client.win_info`)."""

    step: int  #: the own copy's step
    versions: dict[int, int]  #: per writer: writes since win_update last read its buffer
    steps: dict[int, int]  #: per writer: the writer's step of what its buffer holds
    served: int  #: peers' gets answered from the own copy
    max_staleness: int  #: most steps a buffer win_update read lagged the own copy


class Client(Generic[T]):
    """A worker's connection to its daemon. Thread-safe; one per process is typical."""

    def __init__(
        self,
        codec: TensorCodec[T],
        address: str | None = None,
        connect_timeout: float = 120.0,
        job: str | None = None,
        fusion_threshold: int | None = None,
        cycle_time: float | None = None,
        register: bool | None = None,
    ) -> None:
        """Register with the daemon at ``address`` ($DECENT_DAEMON by default).

        ``fusion_threshold`` (bytes, 0: off) and ``cycle_time`` (seconds) control tensor fusion
        of asynchronous requests; defaults from $DECENT_FUSION_THRESHOLD / $DECENT_CYCLE_TIME
        (ms), else 64 MiB and 1 ms. ``register`` (default on; $DECENT_REGISTER=0 turns it off)
        lets in-place ops hand a tensor of 64 KiB or more that already lives in shared memory
        (torch: ``t.share_memory_()``, ``model.share_memory()``) to the daemon once, after which
        they copy nothing (see :mod:`decent.core.regions`).
        """
        env_threshold, env_cycle = settings_from_env()
        self.codec = codec
        #: ops of different jobs never match; decentrun sets $DECENT_JOB fresh for each launch
        self.job = os.environ.get("DECENT_JOB", "") if job is None else job
        self.address = address or default_address()
        _wait_for_socket(self.address, min(connect_timeout, SOCKET_WAIT))
        self._channel = grpc.insecure_channel(
            self.address,
            options=[("grpc.max_receive_message_length", 64 << 20),
                     ("grpc.max_send_message_length", 64 << 20)],
        )
        self._stub = pb_grpc.WorkerStub(self._channel)
        try:
            reply = self._stub.Register(
                pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, pid=os.getpid(),
                                   framework=codec.framework, job=self.job),
                timeout=connect_timeout, wait_for_ready=True,
            )
        except grpc.RpcError as exc:
            self._channel.close()
            raise DecentError(pb.PEER_UNAVAILABLE,
                              f"cannot reach the daemon at {self.address}: {exc.details()}"
                              ) from None
        if reply.error.code != pb.OK:
            self._channel.close()
            raise DecentError.from_pb(reply.error)
        self.worker_id = reply.worker_id
        self.rank = int(reply.rank)
        self.size = int(reply.size)
        self.cluster_id = reply.cluster_id
        self.topology = reply.topology
        self.default_timeout = reply.default_timeout_s
        self.ring_threshold = int(reply.ring_threshold_bytes)
        self._memory_socket = reply.memory_socket
        self._register = (os.environ.get("DECENT_REGISTER", "1") not in ("0", "false", "no")
                          if register is None else register) and bool(reply.memory_socket)
        self.regions = RegionTable()
        self._register_lock = threading.Lock()
        self.arena = ClientArena(reply.arena_name, reply.arena_bytes)
        codec.attach(self.arena)
        # reentrant: a Handle finalizer (which takes it) may run during GC while it is held
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._rounds: dict[str, int] = {}
        #: windows this worker created: the tensor win_update writes into
        self._windows: dict[str, T] = {}
        #: group_allreduce calls per window (their count picks the butterfly group)
        self._group_rounds: dict[str, int] = {}
        self._pending: dict[int, list[_Pending]] = {}
        self._fusion: Fusion[tuple[pb.SubmitRequest, _Pending]] = Fusion(
            env_threshold if fusion_threshold is None else fusion_threshold,
            env_cycle if cycle_time is None else cycle_time, self._send_group)
        self._unread: dict[int, _Pending] = {}  # finished, result still in the arena
        self._closed = False
        self._lost: DecentError | None = None
        self._send_lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(connect_timeout)
            self._sock.connect(reply.data_socket)
            self._sock.settimeout(None)
            self._sock.sendall(_frame(pb.WorkerHello(worker_id=self.worker_id)))
        except OSError as exc:
            self._sock.close()
            self._channel.close()
            self.arena.close()
            raise DecentError(pb.PEER_UNAVAILABLE, f"cannot open the daemon's data channel at "
                              f"{reply.data_socket}: {exc}") from None
        self._reader = threading.Thread(target=self._read_completions, daemon=True,
                                        name=f"decent-completions-{self.rank}")
        self._attached = threading.Event()
        self._reader.start()
        if not self._attached.wait(connect_timeout) or self._lost is not None:
            lost = self._lost
            self._close(patience=0)  # the daemon did not answer: no point waiting for it again
            raise lost or DecentError(pb.PEER_UNAVAILABLE, f"daemon at {self.address} did not "
                                      "answer on its data channel")

    # ------------------------------------------------------------------ completions

    def _read_completions(self) -> None:
        reason = "the daemon closed the data channel (shutting down)"
        buf = bytearray()
        try:
            while True:
                chunk = self._sock.recv(1 << 16)
                if not chunk:
                    break
                buf += chunk
                start = 0
                while len(buf) - start >= 4:
                    size = int.from_bytes(buf[start:start + 4], "little")
                    if len(buf) - start - 4 < size:
                        break
                    completion = pb.Completion.FromString(bytes(buf[start + 4:start + 4 + size]))
                    start += 4 + size
                    if completion.request_id == 0:
                        if completion.error.code != pb.OK:
                            reason = completion.error.message
                            raise ConnectionError(reason)
                        self._attached.set()
                        continue
                    self._finish(completion.request_id, completion)
                del buf[:start]
        except OSError as exc:
            if not self._closed:
                reason = f"lost the daemon at {self.address}: {exc}"
        lost = DecentError(pb.SHUTTING_DOWN, reason)
        with self._lock:
            self._lost = lost
            pending = [p for group in self._pending.values() for p in group]
            self._pending.clear()
        self._attached.set()
        for p in pending:
            self._settle(p, None, lost)

    def _finish(self, request_id: int, completion: pb.Completion) -> None:
        with self._lock:
            group = self._pending.pop(request_id, None)
        if group is None:
            return
        error = DecentError.from_pb(completion.error) if completion.error.code != pb.OK else None
        for p in group:
            self._settle(p, completion, error)

    def _settle(self, p: _Pending, completion: pb.Completion | None,
                error: DecentError | None) -> None:
        p.completion = completion
        p.error = error
        if error is None and completion is not None:
            with self._lock:
                self._unread[p.request_id] = p
        p.event.set()
        if p.abandoned or error is not None:  # nothing left to read: the slots are free now
            self._release(p)
        self.arena.notify()

    def _abandon(self, p: _Pending) -> None:
        p.abandoned = True
        if p.event.is_set():
            self._release(p)

    def _collect(self, p: _Pending) -> None:
        """Copy ``p``'s result out of the arena (once) and free its slots."""
        with p.lock:
            if not p.collected:
                c = p.completion
                if c is not None and not p.abandoned and not self._closed:
                    if p.fused:
                        nbytes, shape = p.nbytes, p.shape
                    else:
                        nbytes, shape = int(c.out_nbytes), tuple(c.out_meta.shape)
                    view = self.arena.view(p.out_offset, nbytes)
                    if p.resident:
                        p.result = p.into
                    elif p.into is not None:
                        p.result = self.codec.read_into(view, p.into)
                    else:
                        p.result = self.codec.read(view, p.dtype, shape, p.like)
                    del view
                elif c is not None and not p.abandoned:  # closed: the arena may be gone
                    p.error = DecentError(pb.SHUTTING_DOWN, f"{p.label}: the client was closed "
                                                            "before its result was read")
                p.collected = True
        self._release(p)

    def _reclaim(self) -> bool:
        """Arena full: copy finished-but-unread results out to free their slots."""
        if self._lost is not None:
            raise self._lost
        with self._lock:
            unread = list(self._unread.values())
        for p in unread:
            self._collect(p)
        return bool(unread)

    def _release(self, p: _Pending) -> None:
        with self._lock:
            self._unread.pop(p.request_id, None)
            if p.freed:
                return
            p.freed = True
        if not self._closed:
            for off, n in p.slots:
                self.arena.free(off, n)

    # ------------------------------------------------------------------ submission

    def _next_round(self, name: str) -> int:
        with self._lock:
            r = self._rounds.get(name, 0)
            self._rounds[name] = r + 1
            return r

    def _submit(
        self,
        op: int,
        tensor: T | None,
        name: str | None,
        timeout: float | None,
        out_factor: int = 1,
        into: T | None = None,
        fuse: Hashable | None = None,
        fuse_limit: int | None = None,
        **fields: Any,
    ) -> Handle[T]:
        if self._closed:
            raise DecentError(pb.SHUTTING_DOWN, "client is closed")
        if self._lost is not None:
            raise self._lost
        if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
        label = str(pb.OpType.Name(op)).lower()
        name = name or f"{label}.unnamed"
        dtype: int
        shape: tuple[int, ...]
        if tensor is None:
            dtype, shape = pb.FLOAT32, (0,)
        else:
            try:
                dtype, shape = self.codec.describe(tensor)
            except TypeError as exc:
                raise TypeError(f"tensor '{name}': {exc}") from None
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        try:  # the request (weights, ranks) must be well formed before anything is spent on it
            req = pb.SubmitRequest(
                worker_id=self.worker_id, op=op, name=name,
                meta=pb.TensorMeta(dtype=dtype, shape=shape), nbytes=nbytes,
                timeout_s=timeout or 0.0, **fields,
            )
        except (ValueError, TypeError) as exc:
            raise ValueError(f"tensor '{name}': bad argument: {exc}") from None
        slots: list[tuple[int, int]] = []
        # a shared() tensor is already in the arena: no copy in, and in place no copy out
        at = None if tensor is None or not nbytes else self.codec.address(tensor)
        resident = None if at is None else self.arena.offset_of(at, nbytes)
        wants_in_place = tensor is not None and into is tensor and out_factor == 1
        if resident is None and wants_in_place and at is not None:
            assert tensor is not None
            resident = self._registered(tensor, at, nbytes)
        in_place = resident is not None and wants_in_place
        try:
            if resident is None:
                slots.append((self.arena.alloc(nbytes, f"tensor '{name}'", self._reclaim),
                              nbytes))
            # the daemon writes a result over its input once the input is sent, so one slot
            # serves both; a shared() tensor gets its own result slot unless the op is in place
            if out_factor != 1 or (resident is not None and not in_place):
                out_bytes = nbytes * out_factor
                slots.append((self.arena.alloc(out_bytes, f"tensor '{name}' output",
                                               self._reclaim), out_bytes))
            if tensor is not None and nbytes and resident is None:
                self.codec.write(tensor, self.arena.view(slots[0][0], nbytes))
        except BaseException:
            for s in slots:
                self.arena.free(*s)
            raise
        in_offset = slots[0][0] if resident is None else resident
        out_offset, out_capacity = (in_offset, nbytes) if in_place else (
            slots[-1] if slots else (in_offset, nbytes))
        # from here on nothing can fail before the request is sent: the round is spent only now,
        # so a refused argument above does not put this name's rounds out of step with the peers
        req.round = self._next_round(name)
        req.request_id = rid = next(self._ids)
        req.offset = in_offset
        req.out_offset, req.out_capacity = out_offset, out_capacity
        p = _Pending(rid, f"{label} '{name}' round {req.round}", slots, dtype, tensor,
                     out_offset=req.out_offset, shape=shape, nbytes=nbytes, into=into,
                     resident=in_place)
        if fuse is not None and self._fusion.enabled:
            p.bucketed = True
            self._fusion.add((fuse, req.round, req.timeout_s), (req, p), nbytes, fuse_limit)
        else:
            with self._lock:
                self._pending[rid] = [p]
            self._send(req, [rid])
        return Handle(self, p)

    def _registered(self, tensor: T, at: int, nbytes: int) -> int | None:
        """The daemon offset of an in-place op's tensor if its memory is registered, registering
        it now if it lives in shared memory; None: copy it through the arena."""
        offset = self.regions.offset_of(at, nbytes)
        if offset is not None or not self._register or nbytes < REGISTER_MIN_BYTES:
            return offset
        # private memory is copied: moving it would strand its other aliases (numpy views)
        found = self.codec.shared_storage(tensor)
        if found is None:
            return None
        with self._register_lock:
            offset = self.regions.offset_of(at, nbytes)  # another thread may have just done it
            if offset is not None:
                return offset
            address, size, alive, fd = found
            if self.regions.refused(address):
                return None
            base = self.regions.reserve(size)
            released = self.regions.sweep()
            ok = False
            try:
                self._memory_call(pb.MemoryRequest(worker_id=self.worker_id, base=base,
                                                   nbytes=size, release=released), fd)
                ok = True
            except DecentError as exc:
                if exc.code_name == "RESOURCE_EXHAUSTED":  # a bound: this storage is copied
                    self.regions.refuse(address, alive)
                else:
                    self._register = False
                    log.warning("in-place ops go on copying tensors through the arena: the "
                                "daemon cannot map this worker's shared memory (%s)", exc)
                return None
            finally:
                if not ok:
                    # the daemon may have mapped it before the answer was lost: release it
                    # too (an unknown base is a no-op there)
                    self.regions.requeue([*released, base])
            self.regions.add(Region(address, size, base, alive))
            return self.regions.offset_of(at, nbytes)

    def _release_dead_regions(self) -> None:
        """Tell the daemon to unmap registered memory whose tensors are all gone."""
        released = self.regions.sweep()
        if released:
            try:
                self._memory_call(pb.MemoryRequest(worker_id=self.worker_id, release=released),
                                  None)
            except DecentError:
                self.regions.requeue(released)

    def _memory_call(self, req: pb.MemoryRequest, fd: int | None) -> None:
        """One request on the daemon's memory socket (``fd`` rides along); raises its error."""
        body = req.SerializeToString()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(MEMORY_CALL_TIMEOUT)
                sock.connect(self._memory_socket)
                frame = len(body).to_bytes(4, "little") + body
                sent = socket.send_fds(sock, [frame], [] if fd is None else [fd])
                if sent < len(frame):  # the daemon answers and closes once it has all of it
                    sock.sendall(frame[sent:])
                reply = b""
                while len(reply) < 4 or len(reply) < 4 + int.from_bytes(reply[:4], "little"):
                    chunk = sock.recv(4096)
                    if not chunk:
                        break
                    reply += chunk
        except OSError as exc:
            raise DecentError(pb.PEER_UNAVAILABLE, f"memory socket {self._memory_socket}: "
                              f"{exc}") from None
        if len(reply) < 4:
            raise DecentError(pb.PEER_UNAVAILABLE, f"memory socket {self._memory_socket} closed "
                              "without an answer")
        error = pb.Error.FromString(reply[4:4 + int.from_bytes(reply[:4], "little")])
        if error.code != pb.OK:
            raise DecentError.from_pb(error)

    def _send_group(self, members: list[tuple[pb.SubmitRequest, _Pending]]) -> None:
        """Send a closed fusion bucket: one request whose parts are the members' tensors."""
        if len(members) == 1:
            req, p = members[0]
        else:
            first = members[0][0]
            req = pb.SubmitRequest()
            req.CopyFrom(first)
            req.request_id = next(self._ids)
            req.offset = req.nbytes = req.out_offset = req.out_capacity = 0
            req.ClearField("meta")
            for member, p in members:
                req.parts.add(name=member.name, round=member.round, meta=member.meta,
                              offset=member.offset, nbytes=member.nbytes,
                              out_offset=member.out_offset)
                p.fused = True
        with self._lock:
            self._pending[req.request_id] = [p for _, p in members]
        for _, p in members:
            p.bucketed = False
        self._send(req, [req.request_id])

    def _send(self, req: pb.SubmitRequest, rids: list[int]) -> None:
        """Write one request to the data channel (no reply: the completion answers it)."""
        try:
            with self._send_lock:
                self._sock.sendall(_frame(req))
        except OSError as exc:
            error = DecentError(pb.PEER_UNAVAILABLE, f"cannot reach the daemon: {exc}")
            for rid in rids:
                with self._lock:
                    group = self._pending.pop(rid, [])
                for p in group:
                    self._settle(p, None, error)

    # ------------------------------------------------------------------ public ops

    def neighbor_allreduce_async(
        self,
        tensor: T,
        name: str | None = None,
        self_weight: float | None = None,
        src_weights: Mapping[int, float] | None = None,
        dst_weights: WeightsArg = None,
        timeout: float | None = None,
        _into: T | None = None,
        _fuse: bool = True,
    ) -> Handle[T]:
        """Start ``self_weight*x + sum_j src_weights[j] * d_j * x_j``; returns at once.

        No weights: the topology's at this step. ``dst_weights`` (dict or list of ranks) makes the
        call dynamic: it sends to exactly those ranks and receives from the ``src_weights`` keys.
        Requests with the same weights are fused (see the class docs).
        """
        src = _weights(src_weights)
        dst = _weights(dst_weights)
        key = (pb.NEIGHBOR_ALLREDUCE, self_weight,
               None if src is None else tuple(sorted(src.items())),
               None if dst is None else tuple(sorted(dst.items())))
        return self._submit(
            pb.NEIGHBOR_ALLREDUCE, tensor, name, timeout, into=_into, fuse=key if _fuse else None,
            has_self_weight=self_weight is not None, self_weight=self_weight or 0.0,
            has_src_weights=src is not None, src_weights=src or {},
            has_dst_weights=dst is not None, dst_weights=dst or {},
        )

    def neighbor_allreduce(self, tensor: T, **kwargs: Any) -> T:
        """Blocking :meth:`neighbor_allreduce_async`."""
        return self.neighbor_allreduce_async(tensor, _fuse=False, **kwargs).wait()

    def neighbor_allreduce_async_(self, tensor: T, **kwargs: Any) -> Handle[T]:
        """In-place :meth:`neighbor_allreduce_async`: ``wait()`` writes the result into
        ``tensor`` and returns it (no new tensor is allocated). A tensor in shared memory
        (torch: ``share_memory_()``) is registered with the daemon and never copied; leave it
        alone until the handle is waited for."""
        return self.neighbor_allreduce_async(tensor, _into=tensor, **kwargs)

    def neighbor_allreduce_(self, tensor: T, **kwargs: Any) -> T:
        """Blocking in-place :meth:`neighbor_allreduce_async`."""
        return self.neighbor_allreduce_async_(tensor, _fuse=False, **kwargs).wait()

    def compressed_neighbor_allreduce_async(
        self,
        tensor: T,
        compressor: str,
        ratio: float | None = None,
        name: str | None = None,
        self_weight: float | None = None,
        src_weights: Mapping[int, float] | None = None,
        dst_weights: WeightsArg = None,
        timeout: float | None = None,
    ) -> Handle[T]:
        """Start a neighbor_allreduce of ``Q(x)``, the tensor compressed by ``compressor``.

        ``compressor``: ``"topk"`` (with ``ratio``, the fraction of entries kept), ``"sign"`` or
        ``"int8"``. The daemon compresses, sends only the compressed bytes and decodes what
        arrives. The result has shape ``[2, *shape]``: row 0 is
        ``self_weight * Q(x) + sum_j src_weights[j] * d_j * Q(x_j)`` (weights as in
        :meth:`neighbor_allreduce_async`), row 1 is ``Q(x)`` exactly as the neighbors decoded it::

            mixed, own = client.compressed_neighbor_allreduce(t, "topk", ratio=0.01)
        """
        kind = COMPRESSORS.get(compressor)
        if kind is None:
            raise ValueError(f"tensor '{name}': unknown compressor {compressor!r}; known: "
                             f"{', '.join(sorted(COMPRESSORS))}")
        if kind == pb.TOPK and ratio is None:
            raise ValueError(f"tensor '{name}': compressor 'topk' needs a ratio (0 < ratio <= 1)")
        src = _weights(src_weights)
        dst = _weights(dst_weights)
        return self._submit(
            pb.COMPRESSED_NEIGHBOR_ALLREDUCE, tensor, name, timeout, out_factor=2,
            compression=pb.Compression(kind=kind, ratio=float(ratio or 0.0)),
            has_self_weight=self_weight is not None, self_weight=self_weight or 0.0,
            has_src_weights=src is not None, src_weights=src or {},
            has_dst_weights=dst is not None, dst_weights=dst or {},
        )

    def compressed_neighbor_allreduce(self, tensor: T, compressor: str, **kwargs: Any) -> T:
        """Blocking :meth:`compressed_neighbor_allreduce_async`."""
        return self.compressed_neighbor_allreduce_async(tensor, compressor, **kwargs).wait()

    def neighbor_allgather_async(
        self,
        tensor: T,
        name: str | None = None,
        src_ranks: Iterable[int] | None = None,
        dst_ranks: Iterable[int] | None = None,
        timeout: float | None = None,
    ) -> Handle[T]:
        """Start gathering the in-neighbors' tensors, stacked on a new leading dim (rank order)."""
        src = _weights(src_ranks)
        dst = _weights(dst_ranks)
        if src is not None:
            factor = len(src)
        else:  # the output holds one tensor per in-neighbor at the step this call will use
            factor = len(self.topology_at(name or "neighbor_allgather.unnamed").in_neighbors)
        return self._submit(
            pb.NEIGHBOR_ALLGATHER, tensor, name, timeout, out_factor=factor,
            has_src_weights=src is not None, src_weights=src or {},
            has_dst_weights=dst is not None, dst_weights=dst or {},
        )

    def neighbor_allgather(self, tensor: T, **kwargs: Any) -> T:
        """Blocking :meth:`neighbor_allgather_async`."""
        return self.neighbor_allgather_async(tensor, **kwargs).wait()

    def allreduce_async(
        self, tensor: T, op: str = "average", name: str | None = None,
        timeout: float | None = None, _into: T | None = None, _fuse: bool = True,
    ) -> Handle[T]:
        """Start an average (or ``op="sum"``) over all ranks.

        Tensors below the daemon's ring threshold are fused (up to that many bytes per bucket:
        a fused allreduce is a direct exchange); larger ones run alone as a ring.
        """
        if op not in ("average", "sum"):
            raise ValueError(f"allreduce op must be 'average' or 'sum', not {op!r}")
        reduce_op = pb.AVERAGE if op == "average" else pb.SUM
        small = _fuse and self._nbytes(tensor) < self.ring_threshold
        return self._submit(pb.ALLREDUCE, tensor, name, timeout, reduce_op=reduce_op,
                            into=_into, fuse=(pb.ALLREDUCE, reduce_op) if small else None,
                            fuse_limit=self.ring_threshold)

    def allreduce(self, tensor: T, **kwargs: Any) -> T:
        """Blocking :meth:`allreduce_async`."""
        return self.allreduce_async(tensor, _fuse=False, **kwargs).wait()

    def allreduce_async_(self, tensor: T, **kwargs: Any) -> Handle[T]:
        """In-place :meth:`allreduce_async` (the result is written into ``tensor``)."""
        return self.allreduce_async(tensor, _into=tensor, **kwargs)

    def allreduce_(self, tensor: T, **kwargs: Any) -> T:
        """Blocking in-place :meth:`allreduce_async`."""
        return self.allreduce_async_(tensor, _fuse=False, **kwargs).wait()

    def broadcast_async(
        self, tensor: T, root: int = 0, name: str | None = None, timeout: float | None = None,
        _into: T | None = None, _fuse: bool = True,
    ) -> Handle[T]:
        """Start copying ``root``'s tensor to every rank (fused with other broadcasts)."""
        return self._submit(pb.BROADCAST, tensor, name, timeout, root=root, into=_into,
                            fuse=(pb.BROADCAST, root) if _fuse else None)

    def broadcast(self, tensor: T, **kwargs: Any) -> T:
        """Blocking :meth:`broadcast_async`."""
        return self.broadcast_async(tensor, _fuse=False, **kwargs).wait()

    def broadcast_async_(self, tensor: T, **kwargs: Any) -> Handle[T]:
        """In-place :meth:`broadcast_async` (root's tensor is written into ``tensor``)."""
        return self.broadcast_async(tensor, _into=tensor, **kwargs)

    def broadcast_(self, tensor: T, **kwargs: Any) -> T:
        """Blocking in-place :meth:`broadcast_async`."""
        return self.broadcast_async_(tensor, _fuse=False, **kwargs).wait()

    def shared(self, tensor: T) -> T:
        """A copy of ``tensor`` that lives in the shared-memory arena (CPU only).

        Ops take such a tensor without copying it to the daemon, and in-place ops
        (``neighbor_allreduce_`` and co.) have the daemon write the result straight into it: no
        copy either way. Keep model parameters there (``p.data = client.shared(p.data)``) for the
        cheapest steps, or in torch's shared memory (``model.share_memory()``), which in-place ops
        register with the daemon to the same effect. Its arena space is freed when the last
        tensor using it is gone. As with any asynchronous in-place op, do not modify it until the
        op's handle is waited for.
        """
        dtype, shape = self.codec.describe(tensor)
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        offset = self.arena.alloc(nbytes, "shared tensor", self._reclaim)
        owner = np.frombuffer(self.arena.buf, np.uint8, count=nbytes, offset=offset)
        weakref.finalize(owner, self._free_shared, offset, nbytes)
        out = self.codec.wrap(owner, dtype, shape)
        if nbytes:
            self.codec.write(tensor, self.arena.view(offset, nbytes))
        return out

    def _free_shared(self, offset: int, nbytes: int) -> None:
        if not self._closed:
            self.arena.free(offset, nbytes)

    def flush(self) -> None:
        """Send every request still waiting in a fusion bucket now."""
        self._fusion.flush()

    def _nbytes(self, tensor: T) -> int:
        try:
            dtype, shape = self.codec.describe(tensor)
        except TypeError:
            return 0  # _submit reports it with the tensor's name
        return math.prod(shape) * ITEMSIZE[dtype]

    def barrier(self, name: str | None = None, timeout: float | None = None) -> None:
        """Return once every rank has reached a barrier of the same name and round."""
        self._fusion.flush()
        self._release_dead_regions()
        h = self._submit(pb.BARRIER, None, name, timeout)
        p = h._pending
        p.event.wait()
        self._release(p)
        if p.error is not None:
            raise p.error

    # ------------------------------------------------------------------ windows (one-sided)

    def win_create(self, tensor: T, name: str, zero_init: bool = False) -> bool:
        """Create window ``name`` holding ``tensor`` (BlueFog's ``win_create``).

        The daemon keeps a copy (the *own copy*, what peers' :meth:`win_get_async` read) and one
        buffer per in-neighbor of a static topology, starting as a copy of ``tensor`` (zeros with
        ``zero_init``); other ranks get a buffer when they first write. Local: no other rank
        needs to take part, and ranks may create windows in any order. :meth:`win_update` writes
        its result into ``tensor``.
        """
        if name in self._windows:
            raise ValueError(f"window '{name}' already exists in this client (win_free it first)")
        self._submit(pb.WIN_CREATE, tensor, name, None, zero_init=zero_init).wait()
        self._windows[name] = tensor
        return True

    def _window(self, name: str) -> T:
        try:
            return self._windows[name]
        except KeyError:
            raise ValueError(f"window '{name}' was not created by this client "
                             f"(windows: {sorted(self._windows)})") from None

    def win_put_async(self, tensor: T, name: str, dst_weights: WeightsArg = None,
                      step: int = 0, timeout: float | None = None) -> Handle[T]:
        """Write ``d_j * tensor`` into window ``name``'s buffer for this rank on each
        destination ``j`` (default: the static topology's out-neighbors, weight 1), replacing
        what was there, and make ``tensor`` the own copy. The destinations' workers do nothing:
        their daemons apply the write. ``wait()`` returns once every destination applied it and
        gives ``tensor``'s value back. ``step``: the worker's step of ``tensor`` (0: one more
        than the own copy's)."""
        return self._win_write(pb.WIN_PUT, tensor, name, dst_weights, step, timeout)

    def _win_write(self, op: int, tensor: T, name: str, dst_weights: WeightsArg, step: int,
                   timeout: float | None) -> Handle[T]:
        self._window(name)
        dst = _weights(dst_weights)
        return self._submit(op, tensor, name, timeout, step=step,
                            has_dst_weights=dst is not None, dst_weights=dst or {})

    def win_put(self, tensor: T, name: str, **kwargs: Any) -> T:
        """Blocking :meth:`win_put_async`."""
        return self.win_put_async(tensor, name, **kwargs).wait()

    def win_accumulate_async(self, tensor: T, name: str, dst_weights: WeightsArg = None,
                             step: int = 0, timeout: float | None = None) -> Handle[T]:
        """Like :meth:`win_put_async`, but each destination *adds* ``d_j * tensor`` to its
        buffer for this rank (concurrent writers from several ranks all land)."""
        return self._win_write(pb.WIN_ACCUMULATE, tensor, name, dst_weights, step, timeout)

    def win_accumulate(self, tensor: T, name: str, **kwargs: Any) -> T:
        """Blocking :meth:`win_accumulate_async`."""
        return self.win_accumulate_async(tensor, name, **kwargs).wait()

    def win_get_async(self, name: str, src_weights: WeightsArg = None,
                      timeout: float | None = None) -> Handle[T]:
        """Fetch ``w_j * (j's own copy)`` into this rank's buffer for each source ``j`` (default:
        the static topology's in-neighbors, weight 1). The sources' daemons answer from their
        last own copy without waiting for their workers. ``wait()`` returns an empty tensor once
        every buffer is filled; :meth:`win_update` combines them."""
        self._window(name)
        src = _weights(src_weights)
        return self._submit(pb.WIN_GET, None, name, timeout,
                            has_src_weights=src is not None, src_weights=src or {})

    def win_get(self, name: str, **kwargs: Any) -> None:
        """Blocking :meth:`win_get_async`."""
        self.win_get_async(name, **kwargs).wait()

    def win_update(self, name: str, self_weight: float | None = None,
                   neighbor_weights: Mapping[int, float] | None = None, reset: bool = False,
                   step: int = 0, timeout: float | None = None) -> T:
        """``self_weight * t + sum_j neighbor_weights[j] * buffer[j]``, where ``t`` is the
        tensor given to :meth:`win_create` (its current value): written into ``t``, returned,
        and made the own copy. Defaults: the static topology's weights. The buffers read get
        version 0 again, and with ``reset`` they are zeroed (for accumulate-style use)."""
        tensor = self._window(name)
        src = _weights(neighbor_weights)
        return self._submit(pb.WIN_UPDATE, tensor, name, timeout, into=tensor, step=step,
                            reset=reset, has_self_weight=self_weight is not None,
                            self_weight=self_weight or 0.0, has_src_weights=src is not None,
                            src_weights=src or {}).wait()

    def win_publish(self, tensor: T, name: str, step: int = 0) -> None:
        """Make ``tensor`` window ``name``'s own copy (what peers' gets are served from) at
        ``step`` (0: one more than before). Local and cheap: one copy into the daemon."""
        self._window(name)
        self._submit(pb.WIN_PUBLISH, tensor, name, None, step=step).wait()

    def win_free(self, name: str) -> None:
        """Free window ``name`` here; later writes to it from peers fail with NOT_FOUND."""
        self._window(name)
        self._submit(pb.WIN_FREE, None, name, None).wait()
        del self._windows[name]
        self._group_rounds.pop(name, None)

    def win_exchange_async(self, tensor: T, name: str, peer: int, step: int = 0,
                           timeout: float | None = None) -> Handle[T]:
        """Atomically average ``tensor`` with ``peer``'s own copy of window ``name``: the peer's
        daemon sets its own copy to ``(own + tensor) / 2`` and answers with it, without its
        worker (AD-PSGD's pairwise averaging). ``wait()`` gives that average, which is also this
        rank's own copy now."""
        self._window(name)
        return self._submit(pb.WIN_EXCHANGE, tensor, name, timeout, step=step,
                            has_dst_weights=True, dst_weights={int(peer): 0.5})

    def win_exchange(self, tensor: T, name: str, peer: int, **kwargs: Any) -> T:
        """Blocking :meth:`win_exchange_async`."""
        return self.win_exchange_async(tensor, name, peer, **kwargs).wait()

    def win_add(self, tensor: T, name: str, step: int = 0, timeout: float | None = None) -> T:
        """Own copy of window ``name`` += ``tensor``, atomically with peers' exchanges; the new
        own copy is written into ``tensor`` and returned (AD-PSGD: a gradient step applied to
        the current model)."""
        self._window(name)
        return self._submit(pb.WIN_ADD, tensor, name, timeout, into=tensor, step=step).wait()

    def group_allreduce_async(self, tensor: T, name: str, group_size: int,
                              rule: str = "mean", timeout: float | None = None) -> Handle[T]:
        """Wait-avoiding average over this call's butterfly group of ``group_size`` ranks
        (WAGMA). ``tensor`` becomes window ``name``'s own copy (``win_create`` it on every rank
        first). The first member to arrive triggers the group; members not there yet
        contribute their last own copy, and find the result ready when they call. ``rule``:
        ``"mean"`` (group sum / S) or ``"with-self"`` ((group sum + tensor) / (S + 1), the
        reference code's)."""
        self._window(name)
        if rule not in GROUP_RULES:
            raise ValueError(f"tensor '{name}': rule must be one of {sorted(GROUP_RULES)}, "
                             f"not {rule!r}")
        with self._lock:
            group_round = self._group_rounds[name] = self._group_rounds.get(name, 0) + 1
        return self._submit(pb.GROUP_ALLREDUCE, tensor, name, timeout,
                            group_size=int(group_size), group_rule=GROUP_RULES[rule],
                            group_round=group_round)

    def group_allreduce(self, tensor: T, name: str, group_size: int, **kwargs: Any) -> T:
        """Blocking :meth:`group_allreduce_async`."""
        return self.group_allreduce_async(tensor, name, group_size, **kwargs).wait()

    def win_info(self, name: str) -> WindowState:
        """What this rank's daemon holds for window ``name``: versions, steps, staleness."""
        info: pb.WindowInfo = self._stub.Window(pb.WindowRequest(worker_id=self.worker_id,
                                                                 name=name))
        if info.error.code:
            raise DecentError(info.error.code, info.error.message)
        return WindowState(step=int(info.step), versions=dict(info.versions),
                           steps=dict(info.steps), served=int(info.served),
                           max_staleness=int(info.max_staleness))

    def win_versions(self, name: str) -> dict[int, int]:
        """Per writer rank: writes into its buffer since :meth:`win_update` last read it."""
        return self.win_info(name).versions

    # ------------------------------------------------------------------ queries

    def topology_at(self, name: str | None = None) -> pb.TopologyInfo:
        """Neighbors and weights at the step the next call of op ``name`` will use."""
        round_ = self._rounds.get(name, 0) if name else 0
        info: pb.TopologyInfo = self._stub.Topology(pb.TopologyRequest(name=name or "",
                                                                       round=round_))
        return info

    def in_neighbors(self, name: str | None = None) -> list[int]:
        """Ranks this worker receives from (at the next step of ``name``)."""
        return list(self.topology_at(name).in_neighbors)

    def out_neighbors(self, name: str | None = None) -> list[int]:
        """Ranks this worker sends to (at the next step of ``name``)."""
        return list(self.topology_at(name).out_neighbors)

    def status(self) -> pb.StatusReply:
        """The daemon's counters and peer health."""
        reply: pb.StatusReply = self._stub.Status(pb.StatusRequest())
        return reply

    def close(self) -> None:
        """Disconnect; the daemon fails this worker's in-flight ops and frees its arena.

        Returns once the daemon has dropped this worker (it closes its end of the data channel
        after that), or after 5 s if it does not answer. With no op in flight, a job started
        right after finds the daemon's history of this one forgotten; ops still in flight are
        cancelled first, and the history is forgotten once they have ended.
        """
        self._close(patience=5)

    def _close(self, patience: float) -> None:
        if self._closed:
            return
        self._fusion.close()
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)
        self._reader.join(timeout=patience)
        if self._reader.is_alive():  # the daemon does not answer: stop reading anyway
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._reader.join(timeout=5)
        self._sock.close()
        self._channel.close()
        self.arena.close()

    def __enter__(self) -> Client[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
