"""Keras adapter of the decentralized algorithms (:mod:`decent.core.algorithms`).

    opt = dtf.DecentralizedOptimizer(keras.optimizers.SGD(0.1), algorithm="dsgd")
    model.compile(optimizer=opt, loss=...)       # model.fit works, compiled or eager
    model.fit(x, y, callbacks=[dtf.BroadcastGlobalVariablesCallback(0),
                               dtf.MetricAverageCallback()])
    # or a custom loop: opt.apply_gradients(zip(grads, model.trainable_variables))

The wrapped optimizer's update (SGD, momentum, Adam, ...) is the local update ``d``; the same
algorithm code as the torch adapter turns it into the decentralized one. Inside a compiled train
step the algorithm runs as one ``tf.py_function`` per step (eagerly, in graph order).
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from decent.core.algorithms import Algorithm, GradientAllreduce, State, make_algorithm
from decent.core.client import Client
from decent.tf.client import default_client

TFClientType = Client[Any]


def _default_client() -> TFClientType:
    return default_client.init()


class DecentralizedOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras optimizer so that each of its steps becomes one step of ``algorithm``
    (options as in ``decent.torch.DecentralizedOptimizer``)."""

    def __init__(self, optimizer: keras.optimizers.Optimizer, algorithm: str = "dsgd",
                 client: TFClientType | None = None, **options: Any) -> None:
        super().__init__(learning_rate=float(keras.ops.convert_to_numpy(
            optimizer.learning_rate)), name=f"decentralized_{optimizer.name}")
        self.inner = optimizer
        self.client = client if client is not None else _default_client()
        options.setdefault("prefix", f"decent.keras.{id(self):x}")
        self.algorithm: Algorithm[Any] = make_algorithm(algorithm, self.client, **options)
        self.algorithm.check_optimizer([optimizer.get_config()])
        self._states: list[State] = []
        self._prepared = False

    def build(self, variables: list[Any]) -> None:
        """Build the wrapped optimizer for ``variables`` too."""
        super().build(variables)
        self.inner.build(variables)

    def _combine(self, *tensors: tf.Tensor) -> list[tf.Tensor]:
        """The algorithm's combine, eagerly: ``tensors`` are x_k then d_k per variable."""
        k = len(tensors) // 2
        xs, ds = list(tensors[:k]), list(tensors[k:])
        if not self._prepared:
            self.algorithm.prepare(xs)
            self._states = [{} for _ in xs]
            self._prepared = True
        new = self.algorithm.finish(xs, ds, self._states)
        self.algorithm.advance()
        return [tf.convert_to_tensor(n) for n in new]

    def apply(self, grads: list[Any], trainable_variables: list[Any] | None = None) -> None:
        """The wrapped optimizer's step, then the algorithm's combine, assigned to the
        variables."""
        variables = list(trainable_variables if trainable_variables is not None
                         else self._trainable_variables)
        if not self.built:
            self.build(variables)
        xs = [tf.identity(v) for v in variables]
        self.inner.apply(grads, variables)
        ds = [x - tf.identity(v) for x, v in zip(xs, variables, strict=True)]
        if tf.executing_eagerly():
            new = self._combine(*xs, *ds)
        else:
            new = tf.py_function(self._combine, [*xs, *ds], Tout=[x.dtype for x in xs])
            for n, x in zip(new, xs, strict=True):
                n.set_shape(x.shape)
        for v, n in zip(variables, new, strict=True):
            v.assign(n)
        self.iterations.assign_add(1)


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


class DistributedOptimizer(keras.optimizers.Optimizer):
    """Horovod's Keras ``DistributedOptimizer``: the wrapped optimizer steps on gradients
    averaged over every rank (:class:`decent.core.algorithms.GradientAllreduce`).

    ``op``: ``"average"`` or ``"sum"``; ``compression``: ``Compression.none`` or
    ``Compression.fp16``; ``backward_passes_per_step``: gradients are summed locally over that
    many calls before they are reduced and applied (``average_aggregated_gradients``: divided by
    that count). Inside a compiled train step the reduction runs as one ``tf.py_function``.
    """

    def __init__(self, optimizer: keras.optimizers.Optimizer, name: str | None = None,
                 compression: Any = None, op: str = "average",
                 backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                 gradient_predivide_factor: float = 1.0, client: TFClientType | None = None,
                 **_ignored: Any) -> None:
        super().__init__(learning_rate=float(keras.ops.convert_to_numpy(
            optimizer.learning_rate)), name=name or f"distributed_{optimizer.name}")
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got "
                             f"{backward_passes_per_step}")
        self.inner = optimizer
        self.client = client if client is not None else _default_client()
        plain = compression is None or getattr(compression, "is_none", False)
        self.algorithm = GradientAllreduce(
            self.client, prefix=f"decent.keras.hvd.{id(self):x}", op=op,
            gradient_predivide_factor=gradient_predivide_factor,
            compression=None if plain else compression)
        self._passes = backward_passes_per_step
        self._average_aggregated = average_aggregated_gradients
        self._summed: list[Any] | None = None
        self._count = 0

    def build(self, variables: list[Any]) -> None:
        """Build the wrapped optimizer for ``variables`` too."""
        super().build(variables)
        self.inner.build(variables)

    def _reduce(self, *grads: tf.Tensor) -> list[tf.Tensor]:
        """The gradients reduced over the ranks (eagerly)."""
        names = [str(i) for i in range(len(grads))]
        handles = self.algorithm.average_async(list(grads), names)
        return [tf.convert_to_tensor(h.wait()) for h in handles]

    def apply(self, grads: list[Any], trainable_variables: list[Any] | None = None) -> None:
        """Sum the gradients over ``backward_passes_per_step`` calls, then reduce them over the
        ranks and apply them with the wrapped optimizer."""
        variables = list(trainable_variables if trainable_variables is not None
                         else self._trainable_variables)
        if not self.built:
            self.build(variables)
        grads = [tf.convert_to_tensor(g) for g in grads]
        if self._passes > 1:
            self._summed = grads if self._summed is None else \
                [a + g for a, g in zip(self._summed, grads, strict=True)]
            self._count += 1
            if self._count < self._passes:
                return
            grads = self._summed if not self._average_aggregated else \
                [g / float(self._passes) for g in self._summed]
            self._summed, self._count = None, 0
        if tf.executing_eagerly():
            reduced = self._reduce(*grads)
        else:
            reduced = tf.py_function(self._reduce, grads, Tout=[g.dtype for g in grads])
            for r, g in zip(reduced, grads, strict=True):
                r.set_shape(g.shape)
        self.inner.apply(reduced, variables)
        self.iterations.assign_add(1)
