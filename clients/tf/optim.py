"""Keras adapter of the decentralized algorithms (:mod:`decent.core.training.algorithms`).

    opt = dtf.DecentralizedOptimizer(keras.optimizers.SGD(0.1), algorithm="dsgd")
    model.compile(optimizer=opt, loss=...)       # model.fit works, compiled or eager
    model.fit(x, y, callbacks=[dtf.BroadcastGlobalVariablesCallback(0),
                               dtf.MetricAverageCallback()])
    # or a custom loop: opt.apply_gradients(zip(grads, model.trainable_variables))

The wrapped optimizer's update (SGD, momentum, Adam, ...) is the local update ``d``; the same
algorithm code as the torch adapter turns it into the decentralized one. Inside a compiled train
step the algorithm runs in ``tf.py_function`` nodes (eagerly, in graph order). Adapt-then-combine
algorithms combine the variables where the wrapped optimizer left them; the others run over numpy
buffers kept across steps (:mod:`decent.tf.host`), so no step makes a variable-sized tensor
besides the wrapped optimizer's own (variables on a GPU or in bfloat16 keep TensorFlow
arithmetic, which does).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from decent.core.surface.client import Client
from decent.core.surface.rejoin import JoinWatch, own_donors
from decent.core.training.algorithms import Algorithm, AlgorithmError, State, make_algorithm
from decent.core.training.transfer import StateLink, Taken
from decent.tf.client import default_client
from decent.tf.codec import unwrap
from decent.tf.host import HostSteps, hostable
from decent.tf.state import KIT

TFClientType = Client[Any]

log = logging.getLogger("decent.rejoin")


def _default_client() -> TFClientType:
    return default_client.init()


def follow_learning_rate(wrapper: keras.optimizers.Optimizer,
                         inner: keras.optimizers.Optimizer) -> None:
    """Give ``inner`` the wrapper's learning rate (callbacks and schedulers set the one of
    ``model.optimizer``, the wrapper); an inner schedule keeps its own."""
    rate = inner.learning_rate
    if isinstance(rate, keras.Variable):
        rate.assign(keras.ops.cast(wrapper.learning_rate, rate.dtype))


def initial_learning_rate(optimizer: keras.optimizers.Optimizer) -> float:
    """``optimizer``'s learning rate now, as a float (the start value of a wrapper's)."""
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


class DecentralizedOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras optimizer so that each of its steps becomes one step of ``algorithm``
    (options as in ``decent.torch.DecentralizedOptimizer``).

    ``rejoin``: a rank whose node joined a running job takes the model's variables, the
    wrapped optimizer's variables and the algorithm's state from a live rank when the
    optimizer is built (before its first step); the live ranks send theirs at a step boundary
    (:mod:`decent.core.surface.rejoin`)."""

    def __init__(self, optimizer: keras.optimizers.Optimizer, algorithm: str = "dsgd",
                 client: TFClientType | None = None, rejoin: bool = True,
                 **options: Any) -> None:
        super().__init__(learning_rate=initial_learning_rate(optimizer),
                         name=f"decentralized_{optimizer.name}")
        self.inner = optimizer
        self.client = client if client is not None else _default_client()
        options.setdefault("prefix", self.client.name_prefix("keras.opt"))
        self.algorithm: Algorithm[Any] = make_algorithm(algorithm, self.client, **options)
        self.algorithm.check_optimizer([optimizer.get_config()])
        self._states: list[State] = []
        self._prepared = False
        self._rejoin = rejoin
        #: the algorithm's per-variable state taken from a donor, used when it is prepared
        self._taken: list[State] | None = None
        self._transfer = StateLink(self.client, KIT)
        self._joins = JoinWatch(self.client.rank, self.client.local_size, self.client.membership)
        self._sending: list[threading.Thread] = []
        #: x_k, d_k and the new values' homes of an algorithm that is not adapt-then-combine
        self._host = HostSteps(self.client.shared_or_none)

    def build(self, variables: list[Any]) -> None:
        """Build the wrapped optimizer for ``variables`` too."""
        super().build(variables)
        self.inner.build(variables)
        if self._rejoin and self.client.rejoining:
            with tf.init_scope():  # eagerly, even while a train step is traced
                self._take_state(variables)

    @property
    def algorithm_state(self) -> list[State]:
        """The algorithm's per-variable state (trackers, public copies, ...), one dict per
        variable, that the next step starts from (before the first: empty, or what a joining
        rank took from its donor, as TensorFlow tensors). On host buffers
        (:mod:`decent.tf.host`) the values are numpy arrays the algorithm updates in place,
        some of them buffers it writes again two steps later: copy what you keep."""
        return self._states if self._prepared else list(self._taken or [])

    def close(self) -> None:
        """Free the algorithm's windows (every rank, when training is over)."""
        self.algorithm.close()

    def _prepare(self, xs: list[Any]) -> None:
        """Once, at the first step: the algorithm's windows and per-variable state."""
        if not self._prepared:
            self.algorithm.prepare(xs)
            taken = self._taken if self._taken is not None else [{} for _ in xs]
            on_host = bool(xs) and isinstance(xs[0], np.ndarray)
            self._states = [_on_host(s) for s in taken] if on_host else taken
            self._prepared = True

    def _combine(self, *tensors: tf.Tensor) -> list[tf.Tensor]:
        """The algorithm's combine, eagerly: ``tensors`` are x_k then d_k per variable."""
        k = len(tensors) // 2
        xs, ds = list(tensors[:k]), list(tensors[k:])
        self._prepare(xs)
        new = [tf.convert_to_tensor(n) for n in self.algorithm.finish(xs, ds, self._states)]
        self.algorithm.advance()
        self._serve_joiners(lambda: new)
        return new

    def _snapshot(self, *values: tf.Tensor) -> tf.Tensor:
        """Before the wrapped optimizer's step: ``x_k`` into this step's host buffers."""
        self._host.snapshot(values)
        return tf.constant(True)

    def _combine_on_host(self, *values: tf.Tensor) -> list[tf.Tensor]:
        """The algorithm's combine over the host buffers (``values``: the variables after the
        wrapped optimizer's step); the new values in homes the variables take as they lie."""
        xs = self._host.xs()
        ds = self._host.updates(values)
        self._prepare(xs)
        new = self._host.tensors(self.algorithm.finish(xs, ds, self._states))
        self.algorithm.advance()
        self._serve_joiners(lambda: new)
        return new

    def _combine_in_place(self, variables: list[Any]) -> None:
        """An adapt-then-combine algorithm's combine, eagerly, in the variables themselves
        (they hold ``x - d``, the wrapped optimizer's step): each result is copied once out of
        the arena and assigned."""
        targets = [unwrap(v) for v in variables]
        self._prepare(targets)
        self.algorithm.finish_in_place(targets)
        self.algorithm.advance()
        self._serve_joiners(lambda: [tf.identity(v) for v in targets])

    def _combined(self, variables: list[Any]) -> list[tf.Tensor]:
        """:meth:`_combine_in_place`, then the variables' new values (a compiled step's)."""
        self._combine_in_place(variables)
        return [tf.identity(v) for v in variables]

    def _training_state(self, values: list[tf.Tensor], stepped: bool) -> dict[str, Any]:
        """The state after this step (``stepped``) or before it: the variables' ``values``
        then, the wrapped optimizer's variables, the step count and the algorithm's counters
        and per-variable state."""
        return {"variables": values,
                "optimizer": [tf.convert_to_tensor(v) for v in self.inner.variables],
                "iterations": int(self.iterations.numpy()) + int(stepped),
                "algorithm": {**self.algorithm.counters(),
                              "state": [_as_tensors(s) for s in self._states]}}

    def _serve_joiners(self, values: Callable[[], list[tf.Tensor]],
                       stepped: bool = True) -> None:
        """Send the state to the ranks that joined since the last step, when this rank is
        their donor (in the background: training goes on); ``values`` gives the variables'
        values after this step (or before it: not ``stepped``)."""
        self._sending = [t for t in self._sending if t.is_alive()]
        for to in self._joins.to_serve(self.client.view_epoch):
            self._sending.append(self._transfer.serve_in_background(
                to, self.client.default_timeout))
        self._transfer.hand_out(self.algorithm.iteration,
                                lambda: self._training_state(values(), stepped))

    @property
    def state_taken(self) -> Taken | None:
        """How this rank took its state when it joined late (bytes per donor, time); None
        when it did not."""
        return self._transfer.taken

    def _take_state(self, variables: list[Any]) -> None:
        """This rank joined a running job: the state of its donor, before the first step."""
        donors = own_donors(self.client.membership(), self.client.local_size)
        if not donors or donors[0] == self.client.rank:
            return
        donor = donors[0]
        state = self._transfer.receive(donors)
        algo = state.get("algorithm") if isinstance(state, dict) else None
        if not isinstance(algo, dict) or not isinstance(algo.get("state"), list):
            raise AlgorithmError(f"rank {donor} sent a training state without the algorithm's")
        _assign_all(variables, state.get("variables"), donor, "model variables")
        _assign_all(self.inner.variables, state.get("optimizer"), donor, "optimizer variables")
        self.iterations.assign(int(state["iterations"]))
        self.algorithm.restore(algo)
        self._taken = [dict(s) for s in algo["state"]]
        log.info("rank %d took %s", self.client.rank, self._transfer.taken)

    def apply(self, grads: list[Any], trainable_variables: list[Any] | None = None) -> None:
        """The wrapped optimizer's step, then the algorithm's combine, assigned to the
        variables (for gradient-allreduce: the gradients reduced, then the wrapped step)."""
        variables = list(trainable_variables if trainable_variables is not None
                         else self._trainable_variables)
        if not self.built:
            self.build(variables)
        if self.algorithm.reduces_gradients:
            self._apply_averaged(grads, variables)
            return
        if self.algorithm.in_place:
            self._apply_in_place(grads, variables)
            return
        if hostable([unwrap(v) for v in variables]):
            self._apply_on_host(grads, variables)
            return
        xs = [tf.identity(v) for v in variables]
        follow_learning_rate(self, self.inner)
        self.inner.apply(grads, variables)
        ds = [x - tf.identity(v) for x, v in zip(xs, variables, strict=True)]
        new = _staged(self._combine, [*xs, *ds], xs)
        for v, n in zip(variables, new, strict=True):
            v.assign(n)
        self.iterations.assign_add(1)

    def _apply_in_place(self, grads: list[Any], variables: list[Any]) -> None:
        """:meth:`apply` of an adapt-then-combine algorithm: the wrapped optimizer's step, then
        the combine in the variables (in a compiled step, one ``tf.py_function`` that takes the
        updated values, so it runs after the updates)."""
        follow_learning_rate(self, self.inner)
        self.inner.apply(grads, variables)
        if tf.executing_eagerly():
            self._combine_in_place(variables)
        else:  # in after the updates, out before any later read (assigning shares a buffer)
            new = _staged(lambda *_: self._combined(variables),
                          [tf.identity(v) for v in variables], variables)
            for v, n in zip(variables, new, strict=True):
                v.assign(n)
        self.iterations.assign_add(1)

    def _apply_averaged(self, grads: list[Any], variables: list[Any]) -> None:
        """:meth:`apply` of an algorithm that reduces the gradients (Horovod's data
        parallelism): the gradients reduced over the ranks, then the wrapped optimizer's step on
        them, which is the whole update (in a compiled step the reduction is one
        ``tf.py_function``). Sparse gradients are reduced dense; a missing one stays missing
        (the wrapped optimizer skips its variable, as plain Keras and Horovod do), which every
        rank must agree on. Ranks that joined are served before the reduction, which needs
        them."""
        present = [i for i, g in enumerate(grads) if g is not None]
        dense = [tf.convert_to_tensor(grads[i]) for i in present]
        out = _staged(lambda *gs: self._reduced(variables, present, *gs), dense, dense)
        reduced: list[Any] = [None] * len(grads)
        for i, r in zip(present, out, strict=True):
            reduced[i] = r
        follow_learning_rate(self, self.inner)
        self.inner.apply(reduced, variables)
        self.iterations.assign_add(1)

    def _reduced(self, variables: list[Any], present: list[int],
                 *grads: tf.Tensor) -> list[tf.Tensor]:
        """The gradients of the variables ``present`` reduced over the ranks, eagerly (one
        step of the algorithm), once the ranks that joined have this rank's state."""
        self._prepare(list(grads))
        self._serve_joiners(lambda: [tf.identity(v) for v in variables], stepped=False)
        handles = self.algorithm.average_async(list(grads), [str(i) for i in present])
        reduced = [tf.convert_to_tensor(h.wait()) for h in handles]
        self.algorithm.advance()
        return reduced

    def _apply_on_host(self, grads: list[Any], variables: list[Any]) -> None:
        """:meth:`apply` of the other algorithms, over host buffers: ``x_k`` copied into one,
        the wrapped optimizer's step, then the combine (in a compiled step, two
        ``tf.py_function`` nodes around the step, in graph order)."""
        after: AbstractContextManager[Any]
        if tf.executing_eagerly():  # (the reads are gone before the step writes in place)
            self._host.snapshot([unwrap(v).read_value() for v in variables])
            after = contextlib.nullcontext()
        else:
            after = tf.control_dependencies([tf.py_function(
                self._snapshot, [tf.identity(v) for v in variables], Tout=tf.bool)])
        with after:
            follow_learning_rate(self, self.inner)
            self.inner.apply(grads, variables)
        new = _staged(self._combine_on_host, [tf.identity(v) for v in variables], variables)
        for v, n in zip(variables, new, strict=True):
            v.assign(n)
        self.iterations.assign_add(1)


def _staged(run: Callable[..., list[tf.Tensor]], inputs: list[Any],
            like: list[Any]) -> list[tf.Tensor]:
    """``run(*inputs)`` now when eager; in a compiled step one ``tf.py_function`` node (run
    each time the graph runs, in graph order) whose outputs have ``like``'s dtypes and static
    shapes."""
    if tf.executing_eagerly():
        return run(*inputs)
    out = tf.py_function(run, inputs, Tout=[t.dtype for t in like])
    for o, t in zip(out, like, strict=True):
        o.set_shape(t.shape)
    return list(out)


def _on_host(state: State) -> State:
    """A state taken from a donor, its tensors as numpy arrays (the host path updates them in
    place)."""
    return {k: np.array(v) if isinstance(v, tf.Tensor) else v for k, v in state.items()}


def _as_tensors(state: State) -> State:
    """A state to send, its numpy arrays as tensors of their own copies (the algorithm writes
    into its arrays while the state is sent in the background)."""
    return {k: tf.convert_to_tensor(v.copy()) if isinstance(v, np.ndarray) else v
            for k, v in state.items()}


def _assign_all(variables: list[Any], values: Any, donor: int, what: str) -> None:
    """Assign ``values`` (received from rank ``donor``) to ``variables``, checked first."""
    if not isinstance(values, list) or \
            [tuple(v.shape) for v in values] != [tuple(v.shape) for v in variables]:
        got = [tuple(v.shape) for v in values] if isinstance(values, list) else values
        raise AlgorithmError(f"rank {donor} sent {what} of shapes {got}, this rank has "
                             f"{[tuple(v.shape) for v in variables]}")
    for v, value in zip(variables, values, strict=True):
        v.assign(tf.cast(value, v.dtype))


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of training, every rank takes ``root_rank``'s model variables."""

    def __init__(self, root_rank: int = 0, client: TFClientType | None = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.client = client

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Broadcast every variable of the model (in place)."""
        client = self.client if self.client is not None else _default_client()
        for i, v in enumerate(self.model.variables):
            value = client.broadcast(tf.identity(v), root=self.root_rank,
                                     name=f"decent.keras.broadcast.{i}")
            v.assign(value)


class MetricAverageCallback(keras.callbacks.Callback):
    """At the end of each epoch, the logged metrics become their average over the ranks."""

    def __init__(self, client: TFClientType | None = None) -> None:
        super().__init__()
        self.client = client
        self._epochs = 0

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Average every metric in ``logs`` (in place)."""
        if not logs:
            return
        client = self.client if self.client is not None else _default_client()
        keys = sorted(logs)
        values = tf.constant([float(logs[k]) for k in keys], dtype=tf.float64)
        mean = client.allreduce(values, name=f"decent.keras.metrics.{self._epochs}").numpy()
        self._epochs += 1
        for key, value in zip(keys, mean, strict=True):
            logs[key] = float(value)
