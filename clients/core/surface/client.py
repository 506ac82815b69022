"""The framework-agnostic client: the op surface every adapter shares (torch, TensorFlow, numpy).

Each op's methods (``x_async``, ``x``, ``x_async_``, ``x_``) come from the op table
(:mod:`decent.core.surface.methods`, generated) and call the op's one hand-written call
(:mod:`~decent.core.surface.op_calls`, :mod:`~decent.core.surface.window_calls`), which hands
the tensor to the :class:`~decent.core.requests.submitter.Submitter`: it places it in the
shared-memory arena and sends a small request without waiting; the caller gets a
:class:`~decent.core.requests.handles.Handle`. One background thread reads the daemon's
completion stream and wakes the handles; ``Handle.wait()`` blocks on an event, it never polls.
Adapters supply a :class:`~decent.core.memory.codec.TensorCodec`.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import networkx as nx
import numpy as np

from decent.core.memory.arena import ClientArena
from decent.core.memory.codec import TensorCodec, tensor_of, values_of
from decent.core.memory.regions import RegionTable
from decent.core.memory.registrar import Registrar
from decent.core.requests.connection import Connection, Registration, default_address
from decent.core.requests.fusion import settings_from_env
from decent.core.requests.handles import Handle
from decent.core.requests.submitter import Submitter
from decent.core.surface.membership import View
from decent.core.surface.methods import OpMethods
from decent.core.surface.op_calls import Cluster, OpCalls
from decent.core.surface.topology_ops import TopologyCalls
from decent.core.surface.window_calls import WindowCalls, WindowState
from decent_wire.errors import DecentError
from decent_wire.ops import USER_OPS
from decent_wire.topology import Topology
from decent_wire.v1 import decent_pb2 as pb

T = TypeVar("T")

#: where a worker finds its local rank: decentrun's, torchrun's, SLURM's, Open MPI's
LOCAL_RANK_VARS = ("DECENT_LOCAL_RANK", "LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")


def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


class Client(OpMethods[T]):
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
        local_rank: int | None = None,
    ) -> None:
        """Register with the daemon at ``address`` ($DECENT_DAEMON by default) as its worker
        ``local_rank`` (default: :data:`LOCAL_RANK_VARS`, else the lowest free one).

        ``fusion_threshold`` (bytes, 0: off) and ``cycle_time`` (seconds) tune the fusion of
        asynchronous requests ($DECENT_FUSION_THRESHOLD / $DECENT_CYCLE_TIME in ms; else 64 MiB
        and 1 ms). ``register`` (default on; $DECENT_REGISTER=0: off) lets in-place ops hand a
        tensor of 64 KiB or more in shared memory (torch: ``share_memory_()``) to the daemon
        once, after which they copy nothing (:mod:`decent.core.memory.regions`).
        """
        env_threshold, env_cycle = settings_from_env()
        self.codec = codec
        #: ops of different jobs never match; decentrun sets $DECENT_JOB fresh for each launch
        self.job = os.environ.get("DECENT_JOB", "") if job is None else job
        self.address = address or default_address()
        #: the links to the daemon (registration, data channel, memory socket)
        self.connection = Connection(self.address, codec.framework, self.job, connect_timeout,
                                     local_rank if local_rank is not None else _env_int(
                                         *LOCAL_RANK_VARS))
        reg = self.connection.registration
        self._identity(reg)
        if register is None:
            register = os.environ.get("DECENT_REGISTER", "1") not in ("0", "false", "no")
        self._registrar = Registrar(codec, self.connection, reg.worker_id,
                                    register and bool(reg.memory_socket))
        self.arena = ClientArena(self.connection.arena_fd(), reg.arena_bytes)
        codec.attach(self.arena)
        self._submitter = Submitter(
            codec, self.arena, self._registrar, self.connection.send,
            env_threshold if fusion_threshold is None else fusion_threshold,
            env_cycle if cycle_time is None else cycle_time, reg.default_timeout,
            self.connection.await_event)
        try:
            self.connection.start(self._submitter.finish, self._submitter.connection_lost)
        except BaseException:
            self.arena.close()
            raise
        #: each op's call, and the window ops' and the topology's
        self.calls = OpCalls(codec, self._submitter, self.connection, self._registrar,
                             Cluster(self.rank, self.size, self.ring_threshold))
        self.windows = WindowCalls(self.calls, self.connection)
        self.topologies = TopologyCalls(self.calls, self.windows, self.size, reg.topology)
        super().__init__({op.name: getattr(self.calls, op.name, None) or
                          getattr(self.windows, op.name) for op in USER_OPS if op.methods})
        self._prefixes: dict[str, itertools.count[int]] = {}
        self._check_rank()

    def _identity(self, reg: Registration) -> None:
        """This worker's place in the job, as the daemon registered it."""
        self.worker_id = reg.worker_id
        #: this worker among all (BlueFog's names): ``machine_rank * local_size + local_rank``
        self.rank, self.size = reg.rank, reg.size
        #: this worker among its daemon's (pick a GPU by it), and how many that daemon serves
        self.local_rank, self.local_size = reg.local_rank, reg.local_size
        #: this worker's daemon (node) among the daemons, and how many there are
        self.machine_rank, self.machine_size = reg.machine_rank, reg.machine_size
        self.cluster_id = reg.cluster_id
        #: the daemons' topology (hierarchical ops)
        self.machine_topology = reg.machine_topology
        self.default_timeout = reg.default_timeout
        self.ring_threshold = reg.ring_threshold

    def _check_rank(self) -> None:
        """DecentError (and the registration undone) when $DECENT_RANK names another rank than
        the daemon gave: the worker was started against the wrong daemon or local rank."""
        want = _env_int("DECENT_RANK")
        if want is None or want == self.rank:
            return
        self.close()
        raise DecentError(pb.INVALID_ARGUMENT, f"$DECENT_RANK is {want}, but daemon "
                          f"{self.machine_rank} of {self.machine_size} made this worker rank "
                          f"{self.rank} (local rank {self.local_rank} of {self.local_size}): "
                          "start worker r on daemon r // workers_per_node with local rank "
                          "r % workers_per_node")

    @property
    def regions(self) -> RegionTable:
        """The worker memory registered with the daemon."""
        return self._registrar.regions

    # ------------------------------------------------------------------ tensors

    def name_prefix(self, kind: str) -> str:
        """``decent.<kind><n>`` for the n-th object of ``kind`` (an optimizer wrapper) this
        client made: the same on every rank that makes its objects in the same order."""
        return f"decent.{kind}{next(self._prefixes.setdefault(kind, itertools.count()))}"

    def tensor(self, values: Any, like: T | None = None) -> T:
        """A tensor of this client's framework holding ``values`` (a numpy array or a list of
        numbers; on ``like``'s device)."""
        return tensor_of(self.codec, values, like)

    def values(self, tensor: T) -> np.ndarray:
        """The values of a tensor of this client's framework, as a numpy array (a copy)."""
        return values_of(self.codec, tensor)

    def assign(self, target: T, value: T) -> T:
        """Copy ``value`` into ``target`` (same dtype and shape); returns ``target``."""
        return self.calls.assign(target, value)

    # ------------------------------------------------------------------ memory and fusion

    def shared(self, tensor: T) -> T:
        """A copy of ``tensor`` that lives in the shared-memory arena (CPU only): ops take it
        without a copy, in-place ops write their result straight into it (as into
        ``model.share_memory()`` tensors). Its arena space is freed when the last tensor using
        it is gone. Do not modify it until an asynchronous op on it is waited for."""
        return self._submitter.shared(tensor)

    def shared_or_none(self, tensor: T) -> T | None:
        """:meth:`shared`, or None when that would leave less than half the arena free."""
        return self._submitter.shared_if_room(tensor)

    def flush(self) -> None:
        """Send every request still waiting in a fusion bucket now."""
        self._submitter.flush()

    @property
    def blocked_seconds(self) -> float:
        """Seconds this client's callers have spent blocked in ``wait()`` or ``join()`` on ops
        that had not finished yet (a timed-out wait included): the communication that compute
        did not hide. A wait on a finished op adds nothing."""
        return self._submitter.blocked_seconds

    def fused(self) -> AbstractContextManager[None]:
        """A block whose requests fuse by size only (as Horovod's grouped ops): the cycle timer
        does not split them while it lasts, and what is left goes out when it ends."""
        return self._submitter.fused()

    # ------------------------------------------------------------------ topology

    @property
    def topology(self) -> pb.TopologyInfo:
        """The workers' topology at step 0 (the daemon's, or the last :meth:`set_topology`)."""
        return self.topologies.info

    def topology_at(self, name: str | None = None) -> pb.TopologyInfo:
        """Neighbors and weights at the step the next call of op ``name`` will use."""
        return self.topologies.topology_at(name)

    def in_neighbors(self, name: str | None = None) -> list[int]:
        """Ranks this worker receives from (at the next step of ``name``)."""
        return list(self.topology_at(name).in_neighbors)

    def out_neighbors(self, name: str | None = None) -> list[int]:
        """Ranks this worker sends to (at the next step of ``name``)."""
        return list(self.topology_at(name).out_neighbors)

    def set_topology(self, topology: str | Topology | nx.Graph | None = None,
                     is_weighted: bool = False) -> bool:
        """Use ``topology`` for this worker's ops from the next one on (see
        :meth:`TopologyCalls.set_topology`); False while windows exist."""
        return self.topologies.set_topology(topology, is_weighted)

    def load_topology(self) -> nx.Graph:
        """The current topology as a networkx graph (BlueFog's ``load_topology``)."""
        return self.topologies.load_topology()

    def is_topo_weighted(self) -> bool:
        """Whether the last :meth:`set_topology` took the graph's weights."""
        return self.topologies.weighted

    # BlueFog's names of the two above (decent.core.surface.compat.METHOD_ALIASES)
    in_neighbor_ranks = in_neighbors
    out_neighbor_ranks = out_neighbors

    # ------------------------------------------------------------------ windows

    def win_free(self, name: str | None = None) -> bool:
        """Free window ``name`` here (None: every window of this client); True. Local (see
        :meth:`WindowCalls.win_free`)."""
        return self.windows.win_free(name)

    def win_mutex(self, name: str, for_self: bool = False,
                  ranks: Iterable[int] | None = None) -> AbstractContextManager[None]:
        """Hold window ``name``'s mutex for the block (BlueFog's ``win_mutex``; see
        :meth:`WindowCalls.win_mutex`)."""
        return self.windows.win_mutex(name, for_self, ranks)

    def window_names(self) -> list[str]:
        """The windows this client created and has not freed, in creation order."""
        return self.windows.window_names()

    def win_info(self, name: str) -> WindowState:
        """What this rank's daemon holds for window ``name``: versions, steps, staleness."""
        return self.windows.win_info(name)

    def win_versions(self, name: str) -> dict[int, int]:
        """Per writer rank: writes into its buffer since :meth:`win_update` last read it."""
        return self.windows.win_versions(name)

    def win_associated_p(self, name: str) -> float:
        """Window ``name``'s associated p (push-sum weight) as this rank's daemon holds it."""
        return self.windows.win_associated_p(name)

    # ------------------------------------------------------------------ queries

    def status(self) -> pb.StatusReply:
        """The daemon's counters and peer health, and this worker's results (worker_results_*)."""
        return self._submitter.results.reported(self.connection.status())

    def membership(self) -> View:
        """The live ranks and the view's epoch, as this worker's daemon sees them now."""
        return View.of(self.connection.status())

    @property
    def view_epoch(self) -> int:
        """The daemon's membership epoch as of the last completed op (cheap: no call)."""
        return self._submitter.view_epoch

    @property
    def rejoining(self) -> bool:
        """Whether this worker joins a running job (its daemon restarted or came late)."""
        return self.connection.registration.rejoining

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (or the client never finished connecting)."""
        return self._submitter.closed

    def close(self) -> None:
        """Disconnect; the daemon fails this worker's in-flight ops and frees its arena.
        Returns once the daemon has dropped this worker (or after 5 s without an answer): a
        job started right after finds the daemon's history of this one forgotten (once the
        ops still in flight, cancelled first, have ended)."""
        if self._submitter.closed:
            return
        self._submitter.close()
        self.codec.close()
        self.connection.close(patience=5)
        self.arena.close()

    def __enter__(self) -> Client[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Client", "Handle", "TensorCodec", "default_address"]
