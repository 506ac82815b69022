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

from decent.core.algorithms import Algorithm, State, make_algorithm
from decent.core.client import Client
from decent.tf.client import default_client

TFClientType = Client[Any]



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
    (options as in ``decent.torch.DecentralizedOptimizer``)."""

    def __init__(self, optimizer: keras.optimizers.Optimizer, algorithm: str = "dsgd",
                 client: TFClientType | None = None, **options: Any) -> None:
        super().__init__(learning_rate=initial_learning_rate(optimizer),
                         name=f"decentralized_{optimizer.name}")
        self.inner = optimizer
        self.client = client if client is not None else _default_client()
        options.setdefault("prefix", self.client.name_prefix("keras.opt"))
        self.algorithm: Algorithm[Any] = make_algorithm(algorithm, self.client, **options)
        self.algorithm.check_optimizer([optimizer.get_config()])
        self._states: list[State] = []
        self._prepared = False

    def build(self, variables: list[Any]) -> None:
        """Build the wrapped optimizer for ``variables`` too."""
        super().build(variables)
        self.inner.build(variables)

    def close(self) -> None:
        """Free the algorithm's windows (every rank, when training is over)."""
        self.algorithm.close()

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
        follow_learning_rate(self, self.inner)
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
