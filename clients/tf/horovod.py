"""What Horovod's Keras users' code expects of ``import decent.tf as hvd``: the gradient-averaging
``DistributedOptimizer`` and the learning-rate warmup callback (the broadcast and metric
callbacks are in :mod:`decent.tf.optim`; ``hvd.callbacks`` names them all)."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from decent.core.training.algorithms import GradientAllreduce
from decent.tf.client import default_client
from decent.tf.optim import (
    TFClientType,
    follow_learning_rate,
    initial_learning_rate,
)


class DistributedOptimizer(keras.optimizers.Optimizer):
    """Horovod's Keras ``DistributedOptimizer``: the wrapped optimizer steps on gradients
    averaged over every rank (:class:`decent.core.training.algorithms.GradientAllreduce`).

    ``op``: ``"average"`` or ``"sum"``; ``compression``: ``Compression.none`` or
    ``Compression.fp16``; ``backward_passes_per_step``: gradients are summed locally (in
    variables, so compiled train steps work too) over that many calls before they are reduced
    and applied (``average_aggregated_gradients``: divided by that count). Inside a compiled
    train step the reduction runs as one ``tf.py_function``. The learning rate is the wrapper's
    (``model.optimizer.learning_rate``), handed to the wrapped optimizer at each step.
    """

    def __init__(self, optimizer: keras.optimizers.Optimizer, name: str | None = None,
                 compression: Any = None, op: str = "average",
                 backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                 gradient_predivide_factor: float = 1.0, client: TFClientType | None = None,
                 **_ignored: Any) -> None:
        super().__init__(learning_rate=initial_learning_rate(optimizer),
                         name=name or f"distributed_{optimizer.name}")
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got "
                             f"{backward_passes_per_step}")
        self.inner = optimizer
        self.client = client if client is not None else default_client.init()
        plain = compression is None or getattr(compression, "is_none", False)
        self.algorithm = GradientAllreduce(
            self.client, prefix=self.client.name_prefix("keras.hvd"), op=op,
            gradient_predivide_factor=gradient_predivide_factor,
            compression=None if plain else compression)
        self.passes = backward_passes_per_step
        self.average_aggregated = average_aggregated_gradients
        self._summed: list[tf.Variable] = []
        self._count: tf.Variable | None = None

    def build(self, variables: list[Any]) -> None:
        """Build the wrapped optimizer for ``variables`` too, and the local gradient sums."""
        super().build(variables)
        self.inner.build(variables)
        if self.passes > 1:
            self._summed = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False)
                            for v in variables]
            self._count = tf.Variable(0, dtype=tf.int64, trainable=False)

    def _reduce(self, *grads: tf.Tensor) -> list[tf.Tensor]:
        """The gradients reduced over the ranks (eagerly)."""
        names = [str(i) for i in range(len(grads))]
        with self.client.fused():  # the step's gradients together, as Horovod's grouped ops
            handles = self.algorithm.average_async(list(grads), names)
        return [tf.convert_to_tensor(h.wait()) for h in handles]

    def _reduce_and_apply(self, grads: list[tf.Tensor], variables: list[Any]) -> None:
        if tf.executing_eagerly():
            reduced = self._reduce(*grads)
        else:
            reduced = tf.py_function(self._reduce, grads, Tout=[g.dtype for g in grads])
            for r, g in zip(reduced, grads, strict=True):
                r.set_shape(g.shape)
        follow_learning_rate(self, self.inner)
        self.inner.apply(reduced, variables)

    def apply(self, grads: list[Any], trainable_variables: list[Any] | None = None) -> None:
        """Reduce the gradients over the ranks (after ``backward_passes_per_step`` calls, their
        local sum) and apply them with the wrapped optimizer."""
        variables = list(trainable_variables if trainable_variables is not None
                         else self._trainable_variables)
        if not self.built:
            self.build(variables)
        grads = [tf.convert_to_tensor(g) for g in grads]
        if self.passes == 1:
            self._reduce_and_apply(grads, variables)
        else:
            self._accumulate(grads, variables)
        self.iterations.assign_add(1)

    def _accumulate(self, grads: list[tf.Tensor], variables: list[Any]) -> None:
        assert self._count is not None
        for total, g in zip(self._summed, grads, strict=True):
            total.assign_add(g)
        self._count.assign_add(1)

        def flush() -> tf.Tensor:
            scale = 1.0 / self.passes if self.average_aggregated else 1.0
            self._reduce_and_apply([tf.identity(t) * scale for t in self._summed], variables)
            for total in self._summed:
                total.assign(tf.zeros_like(total))
            return tf.constant(True)

        tf.cond(self._count % self.passes == 0, flush, lambda: tf.constant(False))


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Horovod's warmup: over the first ``warmup_epochs`` the learning rate grows linearly from
    ``initial_lr / size`` to ``initial_lr`` (adjusted every batch; ``steps_per_epoch``: batches
    per epoch, else taken from ``fit``'s parameters). ``momentum_correction`` is accepted and
    has no effect."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0, client: TFClientType | None = None) -> None:
        super().__init__()
        self.initial_lr = float(initial_lr)
        self.warmup_epochs = warmup_epochs
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.client = client
        self._epoch = 0

    def rate(self, epoch: float) -> float:
        """The learning rate at (fractional) ``epoch``."""
        size = (self.client if self.client is not None else default_client.init()).size
        if epoch >= self.warmup_epochs:
            return self.initial_lr
        return self.initial_lr / size * (epoch * (size - 1) / self.warmup_epochs + 1)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Remember the epoch (batches count from it)."""
        self._epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Set the learning rate of this batch."""
        if self._epoch > self.warmup_epochs:
            return
        steps = self.steps_per_epoch or self.params.get("steps") or 1
        self.model.optimizer.learning_rate = self.rate(self._epoch + batch / steps)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Report the end of the warmup (``verbose``, on rank 0)."""
        client = self.client if self.client is not None else default_client.init()
        if epoch == self.warmup_epochs - 1 and self.verbose and client.rank == 0:
            print(f"Epoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{self.initial_lr:g}.")
