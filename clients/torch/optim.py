"""PyTorch adapter of the decentralized algorithms (:mod:`decent.core.training.algorithms`).

    opt = dt.DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    model, algorithm="dsgd")   # DmSGD on the daemon's topology
    for x, y in loader:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

The wrapped optimizer's own step (lr, momentum, weight decay, Adam, ...) is the local update; the
algorithm turns it into the decentralized one. With ``model``, exchanges that need only the
current parameters start in a forward pre-hook and overlap forward and backward.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from decent.core import Client
from decent.core.surface.rejoin import JoinWatch, own_donors
from decent.core.training.algorithms import (
    Algorithm,
    AlgorithmError,
    State,
    consensus_distance,
    make_algorithm,
)
from decent.core.training.transfer import StateLink, Taken
from decent.torch import rejoin
from decent.torch.client import TorchClient, default_client
from decent.torch.flat import flatten_parameters, share_in_place
from decent.torch.state import KIT

log = logging.getLogger("decent.optim")


def _default_client() -> TorchClient:
    return default_client.init()


def _versions(params: Sequence[torch.Tensor]) -> list[int]:
    """Each parameter's count of in-place writes (torch's version counter): a write between
    forward and step shows as a change."""
    return [p._version for p in params]


def _where(params: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """Each parameter's identity and address: a layout stays valid while these do."""
    return [(id(p), p.data_ptr()) for p in params]


#: the algorithms that take BlueFog's per-step weights (their exchanges are one neighbor
#: averaging of the parameters)
STEP_WEIGHTED = frozenset({"dsgd", "dsgd-cta"})
#: BlueFog's per-step attributes of its optimizers
STEP_ATTRIBUTES = ("self_weight", "src_weights", "dst_weights", "enable_topo_check")


class DecentralizedOptimizer:
    """Wraps a torch optimizer so that its step becomes one step of ``algorithm``.

    As Horovod's and BlueFog's wrappers, the object is an instance of the wrapped optimizer's
    class too (``isinstance``, learning-rate schedulers); ``.optimizer`` is the wrapped one.
    BlueFog's per-step attributes ``self_weight``, ``src_weights``, ``dst_weights`` (and
    ``enable_topo_check``), set on it before a step's forward pass (before ``step()`` when no
    model is given), are that step's neighbor weights (for ``dsgd`` and ``dsgd-cta``, whose
    averaging may start with the forward pass; other algorithms refuse them); None: the
    topology's.

    ``options``: ``topology`` (a kind name, a ``decent_wire.topology.Topology`` or a networkx graph;
    default: the daemon's), ``communication_interval`` (average every k-th step), and the
    algorithm's own (``period`` for pga, ``beta`` for decentlam). The algorithm's per-parameter
    state lives beside the wrapped optimizer's (never inside it: Adam and co. create theirs on
    their first step only when it is empty), and :meth:`state_dict` carries both, with the
    algorithm's counters, so checkpoints restore everything.

    ``flatten`` (default True): for the algorithms whose update is ``x' = M (x - d)`` (dsgd,
    dmsgd, allreduce, pga), CPU parameters move into one shared-memory buffer per dtype
    (:func:`decent.torch.flat.flatten_parameters`) and each step averages those buffers in place,
    with no per-step clone or copy of the model; dsgd-cta (``x' = W x - d``) starts ``W x``
    from them before forward and adds ``W x - x`` to what the optimizer's step wrote (a
    parameter written between forward and step, as by a checkpoint load, makes the step
    exchange them again as they are). Numpy views of a parameter taken before no
    longer follow it, and ``torch.save`` of one parameter writes its whole buffer (save
    ``.clone()``s or the model's state dict). When the parameters change (``model.double()``,
    ``add_param_group``), the next step lays them out again. If any parameter cannot be moved
    (not a dense contiguous CPU tensor, tied to another, or among several already in shared
    memory, as after ``model.share_memory()``), every parameter takes the general path, where
    these algorithms put each parameter's private storage in shared memory in place
    (:func:`decent.torch.flat.share_in_place`) and average the parameters in one fused request;
    ``flattened`` tells which path the last step took. The path must be the same on
    every rank (the same ``flatten``, the same kind of parameters): otherwise the first exchange
    fails with a mismatch naming the tensor. On the flat path an op that fails leaves the
    parameters partly averaged (the daemon writes results as they arrive): after a DecentError,
    restore them from a checkpoint.
    """

    #: BlueFog's per-step attributes (above; None: not set)
    self_weight: float | None
    src_weights: Mapping[int, float] | None
    dst_weights: Any
    enable_topo_check: bool | None

    def __new__(cls, optimizer: torch.optim.Optimizer, *_args: Any, **_kwargs: Any
                ) -> DecentralizedOptimizer:
        """An object of a class made of this one and ``optimizer``'s (made once per pair)."""
        mixed = _mixed_class(cls, type(optimizer)) if isinstance(
            optimizer, torch.optim.Optimizer) and not issubclass(cls, torch.optim.Optimizer) \
            else cls
        made: DecentralizedOptimizer = object.__new__(mixed)
        return made

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None,
                 algorithm: str = "dsgd", client: Client[torch.Tensor] | None = None,
                 flatten: bool = True, rejoin: bool = True, **options: Any) -> None:
        if isinstance(self, torch.optim.Optimizer):  # torch's attributes, the wrapped one's
            self.__dict__.update({k: v for k, v in vars(optimizer).items()
                                  if k not in ("param_groups", "state")})
        for name in STEP_ATTRIBUTES:
            setattr(self, name, None)
        self.optimizer = optimizer
        self.client = client if client is not None else _default_client()
        #: the algorithm's per-parameter state (trackers, public copies, ...)
        self.algorithm_state: dict[torch.nn.Parameter, State] = {}
        options.setdefault("prefix", self.client.name_prefix("opt"))
        self.algorithm: Algorithm[torch.Tensor] = make_algorithm(algorithm, self.client,
                                                                 **options)
        self.algorithm.check_optimizer(optimizer.param_groups)
        self.algorithm.prepare([p.detach() for p in self._params()])
        self._flatten = flatten and (self.algorithm.in_place
                                     or self.algorithm.overlaps_in_place)
        #: the flat parameter buffers that :meth:`step` averages in place, or None
        self._flat: list[torch.Tensor] | None = None
        self._layout: list[tuple[int, int]] = []  # (id, data_ptr) of each parameter when laid out
        self._lay_out()
        self._started = False
        #: x_k and d_k of the general path, kept across steps (in the arena when they fit, so
        #: the algorithms' exchanges of them copy nothing to the daemon)
        self._buffers = StepBuffers(self.client.shared_or_none)
        self._xs: list[torch.Tensor] | None = None  #: this step's x_k, once taken
        #: the parameters' version counters when an exchange started from them in place
        self._versions: list[int] = []
        self._hook = model.register_forward_pre_hook(self._before_forward) \
            if model is not None else None
        #: ranks that joined late and get this rank's state (the donor's sends, in flight)
        self._joins = JoinWatch(self.client.rank, self.client.local_size, self.client.membership)
        self._sending: list[threading.Thread] = []
        self._transfer = StateLink(self.client, KIT)
        if rejoin and self.client.rejoining:
            self._take_state()

    # ------------------------------------------------------------------ what torch expects

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's state (the algorithm's is :attr:`algorithm_state`)."""
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _states(self, params: list[torch.nn.Parameter]) -> list[State]:
        return [self.algorithm_state.setdefault(p, {}) for p in params]

    def _before_forward(self, *_args: Any) -> None:
        if not self._started and torch.is_grad_enabled():
            self._start()

    def _lay_out(self) -> None:
        """Flatten the parameters again if they are not where the last layout left them (a new
        param group, ``model.double()``, a reassigned ``.data``); on the general path of an
        in-place algorithm, put their storages in shared memory instead."""
        params = self._params()
        if _where(params) == self._layout:
            return
        if self._flatten:
            ours = {f.untyped_storage().data_ptr() for f in self._flat or []}
            self._flat = flatten_parameters(params, ours)
        if self._flat is None and self.algorithm.in_place:  # the general path, in place
            share_in_place(params)
        self._layout = _where(params)  # flattening or sharing moved them

    @property
    def flattened(self) -> bool:
        """Whether the parameters live in flat shared buffers averaged in place."""
        return self._flat is not None

    @property
    def flat_buffers(self) -> list[torch.Tensor]:
        """The flat shared buffers the parameters are views of, one per dtype (none unless
        :attr:`flattened`)."""
        return list(self._flat or [])

    def _start(self) -> None:
        """The step's first hook (before forward, or in step()): the exchanges that start
        before forward, with the per-step weights as set now."""
        if self.algorithm.starts_early:  # its averaging starts here: so do its weights
            self.algorithm.step_weights = self._step_weights()
        if self.algorithm.overlaps_in_place and self._flatten:
            self._lay_out()
        if self._flat is not None and self.algorithm.overlaps_in_place:
            self.algorithm.start_in_place(self._flat)  # from the parameters themselves
            self._versions = _versions(self._params())
        elif self.algorithm.starts_early:
            params = self._params()
            self._xs = self._buffers.copies(params)
            self.algorithm.start(self._xs, self._states(params))
        self._started = True

    def _step_weights(self) -> dict[str, Any] | None:
        """BlueFog's per-step weights set on this object, checked (None: none set)."""
        given = {k: getattr(self, k) for k in STEP_ATTRIBUTES[:3]
                 if getattr(self, k) is not None}
        if not given:
            return None
        if self.algorithm.name not in STEP_WEIGHTED:
            raise AlgorithmError(f"algorithm {self.algorithm.name!r} does not take per-step "
                                 f"weights ({', '.join(sorted(given))} set); they apply to "
                                 f"{', '.join(sorted(STEP_WEIGHTED))}")
        if self.enable_topo_check and "src_weights" in given and "dst_weights" in given:
            check_step_topology(self.client, given["src_weights"], given["dst_weights"])
        return given

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One local update by the wrapped optimizer, then the algorithm's combine."""
        loss = None
        if not self.algorithm.starts_early:  # its averaging starts in this step
            self.algorithm.step_weights = self._step_weights()
        self._serve_joiners()
        try:
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            if not self._started:
                self._start()
            self._restart_if_moved()
            if self._flat is not None:
                if self.algorithm.overlaps_in_place:  # W x - x, before the step writes x - d
                    self.algorithm.settle_in_place(self._flat)
                self.optimizer.step()  # x - d, written into the flat buffers
                self.algorithm.finish_in_place(self._flat)
            else:
                self._step_general()
            self.algorithm.advance()
        finally:
            self._started = False
        return loss

    def _restart_if_moved(self) -> None:
        """Lay the parameters out again if they changed, and drop an exchange started before
        forward whose input is no longer the parameters: they were laid out again, or written
        since (a checkpoint loaded, a broadcast); the step starts it again from them as they
        are."""
        started_on = self._flat
        self._lay_out()
        if not self.algorithm.overlaps_in_place:
            return
        if started_on is not self._flat or (
                self._flat is not None and self._versions != _versions(self._params())):
            self.algorithm.discard_started()
            self._xs = None

    def _step_general(self) -> None:
        """:meth:`step` for parameters that are not flattened."""
        params = self._params()
        if self.algorithm.reduces_gradients:  # the step on the reduced gradients is the update
            average_gradients(self.algorithm, params)
            self.optimizer.step()
        elif self.algorithm.in_place:  # x' = M (x - d): the optimizer's step wrote x - d
            self.optimizer.step()
            self.algorithm.finish_in_place([p.detach() for p in params])
        elif self.algorithm.local_step():  # x' = x - d: the optimizer's step is all of it
            self.optimizer.step()
        else:
            xs = self._xs if self._xs is not None else self._buffers.copies(params)
            self._xs = None
            self.optimizer.step()
            ds = self._buffers.updates(xs, params)
            new = self.algorithm.finish(xs, ds, self._states(params))
            for p, value in zip(params, new, strict=True):
                p.copy_(value)

    def _take_state(self) -> None:
        """This rank joined a running job: the parameters and the optimizer's state from its
        donor (:mod:`decent.core.surface.rejoin`), before the first step."""
        donors = own_donors(self.client.membership(), self.client.local_size)
        if not donors or donors[0] == self.client.rank:
            return
        donor = donors[0]
        params, state = rejoin.receive(self._transfer, donors)
        mine = self._params()
        if [tuple(p.shape) for p in params] != [tuple(p.shape) for p in mine]:
            raise AlgorithmError(f"rank {donor} sent parameters of shapes "
                                 f"{[tuple(p.shape) for p in params]}, this model has "
                                 f"{[tuple(p.shape) for p in mine]}")
        with torch.no_grad():
            for p, value in zip(mine, params, strict=True):
                p.copy_(value)
        self.load_state_dict(state)
        log.info("rank %d took %s", self.client.rank, self._transfer.taken)

    def _serve_joiners(self) -> None:
        """Send this rank's state to the ranks that joined since the last step, when it is
        their donor (in the background: training goes on)."""
        self._sending = [t for t in self._sending if t.is_alive()]
        for to in self._joins.to_serve(self.client.view_epoch):
            self._sending.append(self._transfer.serve_in_background(
                to, self.client.default_timeout))
        self._transfer.hand_out(self.algorithm.iteration,
                                lambda: rejoin.state_of(self._params(), self.state_dict()))

    @property
    def state_taken(self) -> Taken | None:
        """How this rank took its state when it joined late (bytes per donor, time); None
        when it did not."""
        return self._transfer.taken

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict plus, under ``"decent"``, the algorithm's name,
        counters and per-parameter state (keyed by the parameter's index, as torch keys its
        own state)."""
        out = self.optimizer.state_dict()
        index = {id(p): i for i, p in enumerate(self._params())}
        out["decent"] = {"algorithm": self.algorithm.name, **self.algorithm.counters(),
                         "state": {index[id(p)]: dict(s) for p, s in self.algorithm_state.items()
                                   if id(p) in index}}
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (the algorithm must be the same)."""
        state = dict(state)
        counters = state.pop("decent", None)
        if counters is not None and counters.get("algorithm") != self.algorithm.name:
            raise AlgorithmError(f"checkpoint was written by algorithm "
                                 f"{counters.get('algorithm')!r}, this optimizer runs "
                                 f"{self.algorithm.name!r}")
        self.optimizer.load_state_dict(state)
        if counters is not None:
            self.algorithm.restore(counters)
            params = self._params()
            self.algorithm_state = {params[int(i)]: dict(s)
                                    for i, s in counters.get("state", {}).items()}

    def close(self) -> None:
        """Remove the forward hook and free the algorithm's windows (every rank, when training
        is over)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.algorithm.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


def _mixed_class(wrapper: type, optimizer_class: type) -> type:
    """``wrapper`` with ``optimizer_class`` mixed in (its methods first), cached."""
    key = (wrapper, optimizer_class)
    made = _MIXED.get(key)
    if made is None:
        made = type(optimizer_class.__name__, (wrapper, optimizer_class), {})
        _MIXED[key] = made
    return made


_MIXED: dict[tuple[type, type], type] = {}


def check_step_topology(client: Client[torch.Tensor], src_weights: Any,
                        dst_weights: Any) -> None:
    """BlueFog's ``enable_topo_check``: every rank's sources must be exactly the ranks that
    name it as a destination (collective); ValueError naming the difference."""
    from decent.core.surface.topology_ops import infer_peers

    destinations = sorted(int(r) for r in dst_weights)
    inferred: Any = infer_peers(client, destinations, "dst")
    sent_here = {int(r) for r in inferred}
    sources = {int(r) for r in src_weights}
    if sent_here != sources:
        raise ValueError(f"rank {client.rank}: src_weights names ranks {sorted(sources)}, "
                         f"but ranks {sorted(sent_here)} name it in their dst_weights "
                         "(enable_topo_check)")


class StepBuffers:
    """``x_k`` (the parameters before the optimizer's step) and ``d_k`` (its update) in
    tensors allocated once and reused: two sets, used in turn, since an algorithm may keep
    the previous step's ``x`` and ``d`` in its state for one step (EXTRA, gradient tracking)."""

    def __init__(self, shared: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
        """``shared(t)``: a copy of ``t`` in the arena, or None when it has no room."""
        self._shared = shared
        self._sets: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        self._turn = 0

    def copies(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``x_k``: the parameters' values now (this step's set)."""
        layout = [(p.shape, p.dtype, p.device) for p in params]
        if not self._sets or [(b.shape, b.dtype, b.device) for b in self._sets[0][0]] != layout:
            self._sets = [self._allocate(params), self._allocate(params)]
        self._turn ^= 1
        xs = self._sets[self._turn][0]
        for b, p in zip(xs, params, strict=True):
            b.copy_(p.detach())
        return list(xs)

    def _allocate(self, params: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor],
                                                                 list[torch.Tensor]]:
        xs = [self._buffer(p) for p in params]
        return xs, [self._buffer(x) for x in xs]

    def _buffer(self, like: torch.Tensor) -> torch.Tensor:
        """An uninitialized tensor like ``like``: in the arena if it is on the host and fits."""
        empty = torch.empty_like(like, memory_format=torch.contiguous_format)
        if like.device.type != "cpu":
            return empty
        shared = self._shared(empty)
        return empty if shared is None else shared

    def updates(self, xs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
                ) -> list[torch.Tensor]:
        """``d_k = x_k - x_k'``: the optimizer's update, after its step."""
        ds = self._sets[self._turn][1]
        for d, x, p in zip(ds, xs, params, strict=True):
            torch.sub(x, p.detach(), out=d)
        return list(ds)


def average_gradients(algorithm: Algorithm[torch.Tensor], params: Sequence[torch.Tensor],
                      names: Sequence[str] | None = None) -> None:
    """Replace every parameter's gradient by its reduction over the ranks (a missing gradient
    counts as zeros, so that every rank reduces the same tensors)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    keys = names if names is not None else [str(i) for i in range(len(grads))]
    handles = algorithm.average_async(grads, keys)
    for p, h in zip(params, handles, strict=True):
        reduced = h.wait()
        if p.grad is None:
            p.grad = reduced
        elif reduced is not p.grad:
            p.grad.copy_(reduced)


def consensus(params: Iterable[torch.Tensor], client: Client[torch.Tensor] | None = None) -> float:
    """The consensus distance ``sum_i ||x_i - mean||^2`` over the ranks (the same everywhere)."""
    client = client if client is not None else _default_client()
    return consensus_distance(client, [p.detach() for p in params],
                              lambda t: (t.double() ** 2).sum(), lambda t: float(t))
