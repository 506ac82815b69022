"""PyTorch adapter of the decentralized algorithms (:mod:`decent.core.algorithms`).

    opt = dt.DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    model, algorithm="dsgd")   # DmSGD on the daemon's topology
    for x, y in loader:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

The wrapped optimizer's own step (lr, momentum, weight decay, Adam, ...) is the local update; the
algorithm turns it into the decentralized one. With ``model``, exchanges that need only the
current parameters start in a forward pre-hook and overlap forward and backward.
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from decent.core.algorithms import (
    AdaptThenCombine,
    Algorithm,
    AlgorithmError,
    State,
    consensus_distance,
)
from decent.core.algorithms import make_algorithm as _make
from decent.core.client import Client
from decent.torch.flat import flatten_parameters

TorchClient = Client[torch.Tensor]
_prefixes = itertools.count()


def _default_client() -> TorchClient:
    import decent.torch as dt

    return dt.init()


def _where(params: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """Each parameter's identity and address: a layout stays valid while these do."""
    return [(id(p), p.data_ptr()) for p in params]


class DecentralizedOptimizer:
    """Wraps a torch optimizer so that its step becomes one step of ``algorithm``.

    ``options``: ``topology`` (a kind name, a ``decentd.topology.Topology`` or a networkx graph;
    default: the daemon's), ``communication_interval`` (average every k-th step), and the
    algorithm's own (``period`` for pga, ``beta`` for decentlam). The algorithm's state lives in
    the wrapped optimizer's ``state`` and its counters in :meth:`state_dict`, so checkpoints
    restore both.

    ``flatten`` (default True): for the algorithms whose update is ``x' = M (x - d)`` (dsgd,
    dmsgd, allreduce, pga), CPU parameters move into one shared-memory buffer per dtype
    (:func:`decent.torch.flat.flatten_parameters`) and each step averages those buffers in place,
    with no per-step clone or copy of the model. Numpy views of a parameter taken before no
    longer follow it, and ``torch.save`` of one parameter writes its whole buffer (save
    ``.clone()``s or the model's state dict). When the parameters change (``model.double()``,
    ``add_param_group``), the next step lays them out again. If any parameter cannot be moved
    (not a dense contiguous CPU tensor, tied to another, or among several already in shared
    memory, as after ``model.share_memory()``), every parameter takes the general path, which
    copies; ``flattened`` tells which path the last step took. The path must be the same on
    every rank (the same ``flatten``, the same kind of parameters): otherwise the first exchange
    fails with a mismatch naming the tensor. On the flat path an op that fails leaves the
    parameters partly averaged (the daemon writes results as they arrive): after a DecentError,
    restore them from a checkpoint.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None,
                 algorithm: str = "dsgd", client: TorchClient | None = None,
                 flatten: bool = True, **options: Any) -> None:
        self.optimizer = optimizer
        self.client = client if client is not None else _default_client()
        options.setdefault("prefix", f"decent.opt{next(_prefixes)}")
        self.algorithm: Algorithm[torch.Tensor] = _make(algorithm, self.client, **options)
        if self.algorithm.name == "decentlam":
            moving = [g.get("momentum", 0) for g in optimizer.param_groups if g.get("momentum")]
            if moving:
                raise AlgorithmError("decentlam applies its own momentum (option beta) to the "
                                     "combined update; wrap an optimizer without momentum "
                                     f"(got momentum={moving[0]})")
        self.algorithm.prepare([p.detach() for p in self._params()])
        self._flatten = flatten and isinstance(self.algorithm, AdaptThenCombine)
        #: the flat parameter buffers that :meth:`step` averages in place, or None
        self._flat: list[torch.Tensor] | None = None
        self._layout: list[tuple[int, int]] = []  # (id, data_ptr) of each parameter when laid out
        self._lay_out()
        self._started = False
        self._hook = model.register_forward_pre_hook(self._before_forward) \
            if model is not None else None

    # ------------------------------------------------------------------ what torch expects

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's state (the algorithm's per-parameter state included)."""
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _states(self, params: list[torch.nn.Parameter]) -> list[State]:
        return [self.optimizer.state[p].setdefault("decent", {}) for p in params]

    def _before_forward(self, *_args: Any) -> None:
        if not self._started and torch.is_grad_enabled():
            self._start()

    def _lay_out(self) -> None:
        """Flatten the parameters again if they are not where the last layout left them (a new
        param group, ``model.double()``, a reassigned ``.data``)."""
        if not self._flatten:
            return
        params = self._params()
        if _where(params) == self._layout:
            return
        ours = {f.untyped_storage().data_ptr() for f in self._flat or []}
        self._flat = flatten_parameters(params, ours)
        self._layout = _where(params)  # flattening moved them

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
        if type(self.algorithm).start is not Algorithm.start:  # it starts exchanges of x_k
            params = self._params()
            self.algorithm.start([p.detach().clone() for p in params], self._states(params))
        self._started = True

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One local update by the wrapped optimizer, then the algorithm's combine."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._started:
            self._start()
        self._lay_out()
        if self._flat is not None and isinstance(self.algorithm, AdaptThenCombine):
            self.optimizer.step()  # x - d, written into the flat buffers
            self.algorithm.finish_in_place(self._flat)
            self.algorithm.advance()
            self._started = False
            return loss
        params = self._params()
        xs = [p.detach().clone() for p in params]
        self.optimizer.step()
        ds = [x - p.detach() for x, p in zip(xs, params, strict=True)]
        new = self.algorithm.finish(xs, ds, self._states(params))
        for p, value in zip(params, new, strict=True):
            p.copy_(value)
        self.algorithm.advance()
        self._started = False
        return loss

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict plus the algorithm's counters."""
        out = self.optimizer.state_dict()
        out["decent"] = {"algorithm": self.algorithm.name, "iteration": self.algorithm.iteration,
                         "exchanges": self.algorithm.exchanges}
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
            self.algorithm.iteration = int(counters["iteration"])
            self.algorithm.exchanges = int(counters["exchanges"])

    def close(self) -> None:
        """Remove the forward hook."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                         root: int = 0, client: TorchClient | None = None) -> None:
    """Overwrite every tensor (``model.state_dict()`` or ``named_parameters()``) with ``root``'s,
    in place."""
    client = client if client is not None else _default_client()
    items = sorted(params.items() if isinstance(params, Mapping) else params)
    handles = [client.broadcast_async_(t.data if isinstance(t, torch.nn.Parameter) else t,
                                       root=root, name=f"decent.bcast.{name}")
               for name, t in items]
    for h in handles:
        h.wait()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer | DecentralizedOptimizer,
                              root: int = 0, client: TorchClient | None = None) -> None:
    """Give every rank ``root``'s optimizer state (momentum buffers, steps, the algorithm's
    state and counters), whatever state the others had."""
    client = client if client is not None else _default_client()
    raw = b""
    if client.rank == root:
        buf = io.BytesIO()
        torch.save(optimizer.state_dict(), buf)
        raw = buf.getvalue()
    size = int(client.broadcast(torch.tensor([len(raw)], dtype=torch.int64), root=root,
                                name="decent.optstate.size")[0])
    words = -(-size // 8)  # the bytes travel as int64 words (the wire has no uint8)
    blob = torch.zeros(words, dtype=torch.int64)
    if client.rank == root:
        blob.view(torch.uint8)[:size] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    data = client.broadcast(blob, root=root, name="decent.optstate")
    if client.rank != root:
        state = torch.load(io.BytesIO(data.view(torch.uint8)[:size].numpy().tobytes()),
                           weights_only=False)
        optimizer.load_state_dict(state)


def consensus(params: Iterable[torch.Tensor], client: TorchClient | None = None) -> float:
    """The consensus distance ``sum_i ||x_i - mean||^2`` over the ranks (the same everywhere)."""
    client = client if client is not None else _default_client()
    return consensus_distance(client, [p.detach() for p in params],
                              lambda t: (t.double() ** 2).sum(), lambda t: float(t))
