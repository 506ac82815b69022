"""A Keras training script written for Horovod (``horovod.tensorflow.keras``), run by decent: the
only change is the import (``import horovod.tensorflow.keras as hvd`` became
``import decent.tf as hvd``)::

    decentrun -np 2 python examples/horovod_keras.py

Horovod's Keras MNIST example, shrunk to scikit-learn's digits: every worker fits the same model
on its shard with ``hvd.DistributedOptimizer`` (gradients averaged every step) and Horovod's
callbacks: rank 0's initial weights for everyone, metrics averaged over the workers, and a
learning-rate warmup. Rank 0 prints Keras' progress and, at the end, the test accuracy and
whether every replica holds the same weights.
"""

from __future__ import annotations

import argparse

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import decent.tf as hvd  # was: import horovod.tensorflow.keras as hvd


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()

    hvd.init()
    keras.utils.set_random_seed(hvd.rank())  # different initial weights: the callback fixes them
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        (x / 16.0).astype("float32"), y, test_size=0.2, random_state=0, stratify=y)
    # each worker its shard, all of the same length (the same number of steps everywhere)
    per_worker = len(x_train) // hvd.size()
    mine = slice(hvd.rank() * per_worker, (hvd.rank() + 1) * per_worker)
    dataset = tf.data.Dataset.from_tensor_slices((x_train[mine], y_train[mine])).batch(32)

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    scaled_lr = 0.01 * hvd.size()
    opt = keras.optimizers.Adam(scaled_lr)
    opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=1,
                                   average_aggregated_gradients=True)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=opt, metrics=["accuracy"])
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=2,
                                                 verbose=1),
    ]
    verbose = 2 if hvd.rank() == 0 else 0
    model.fit(dataset, callbacks=callbacks, epochs=args.epochs, verbose=verbose)

    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    weights = np.concatenate([w.reshape(-1) for w in model.get_weights()])
    everyone = hvd.allgather(tf.constant(weights[None, :]), name="weights").numpy()
    identical = all(np.array_equal(row, everyone[0]) for row in everyone)
    if hvd.rank() == 0:
        print(f"test accuracy {100 * accuracy:.2f}%; {hvd.size()} replicas identical: "
              f"{identical}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
