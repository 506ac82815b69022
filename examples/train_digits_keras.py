"""Decentralized training of a Keras MLP on scikit-learn's digits: D-SGD beside allreduce.

Run it on a local 4-worker cluster::

    decentrun -np 4 --topology exponential python examples/train_digits_keras.py

Every worker makes the same stratified 80/20 split of the 1797 digit images and trains on its own
iid shard with ``model.fit``: a ``dtf.DecentralizedOptimizer`` around ``keras.optimizers.SGD``
(momentum 0.9) runs ``dsgd`` (each step averages the parameters with the neighbors of the
daemons' topology) and then, from the same initial weights, ``allreduce`` (the global average);
``--algorithms`` names others (``gradient-tracking``, ``exact-diffusion``, ...).
``dtf.BroadcastGlobalVariablesCallback(0)`` starts every worker from rank 0's weights and
``dtf.MetricAverageCallback()`` averages the logged loss and accuracy over the workers, so
rank 0's progress bar shows the cluster's. At the end rank 0 prints each worker's test accuracy
and the accuracy of the averaged model.
"""

from __future__ import annotations

import argparse
import time

import keras
import numpy as np
import tensorflow as tf
from rich.console import Console
from rich.table import Table
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import decent.tf as dtf


def shard(rank: int, size: int, seed: int) -> tuple[np.ndarray, ...]:
    """(x_train shard, y_train shard, x_test, y_test), identical splits on every rank."""
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    x_tr, x_te, y_tr, y_te = train_test_split(x, digits.target, test_size=0.2,
                                              stratify=digits.target, random_state=seed)
    # every shard as long as the smallest: the same number of steps on every rank (a rank
    # that stepped more often would wait for partners that have stopped)
    mine = np.random.default_rng(seed).permutation(len(x_tr))[rank::size][:len(x_tr) // size]
    return x_tr[mine], y_tr[mine], x_te, y_te


def train(client: dtf.TFClient, algorithm: str, data: tuple[np.ndarray, ...],
          args: argparse.Namespace) -> tuple[list[float], float, float]:
    """Fit one model with ``algorithm``; every worker's test accuracy, the averaged model's,
    and the wall time."""
    x_tr, y_tr, x_te, y_te = data
    keras.utils.set_random_seed(args.seed + client.rank)  # rank 0's weights are broadcast
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    opt = dtf.DecentralizedOptimizer(keras.optimizers.SGD(args.lr, momentum=0.9),
                                     algorithm=algorithm, client=client,
                                     prefix=f"keras.{algorithm}")
    model.compile(optimizer=opt, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    start = time.perf_counter()
    model.fit(x_tr, y_tr, epochs=args.epochs, batch_size=args.batch_size, shuffle=False,
              verbose=2 if client.rank == 0 else 0, callbacks=[
                  dtf.BroadcastGlobalVariablesCallback(0, client=client),
                  dtf.MetricAverageCallback(client=client)])
    wall = time.perf_counter() - start
    own = float(model.evaluate(x_te, y_te, verbose=0)[1]) * 100
    workers = client.allreduce(tf.one_hot(client.rank, client.size, on_value=own,
                                          dtype=tf.float64), op="sum",
                               name=f"{algorithm}.acc").numpy().tolist()
    for i, v in enumerate(model.trainable_variables):
        v.assign(client.allreduce(tf.identity(v), name=f"{algorithm}.avg.{i}"))
    averaged = float(model.evaluate(x_te, y_te, verbose=0)[1]) * 100
    return workers, averaged, wall


def main() -> None:
    """Train each algorithm (D-SGD and allreduce by default) one after the other; rank 0 prints
    the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--algorithms", default="dsgd,allreduce",
                   help="comma-separated, run one after the other")
    args = p.parse_args()
    client = dtf.init()
    data = shard(client.rank, client.size, args.seed)
    results = {algo: train(client, algo, data, args) for algo in args.algorithms.split(",")}
    if client.rank == 0:
        table = Table(title=f"digits, {client.size} Keras workers, {args.epochs} epochs")
        table.add_column("algorithm")
        table.add_column("workers' test accuracy (%)")
        table.add_column("averaged model (%)", justify="right")
        table.add_column("wall time", justify="right")
        for algo, (workers, averaged, wall) in results.items():
            table.add_row(algo, " ".join(f"{a:.2f}" for a in workers), f"{averaged:.2f}",
                          f"{wall:.1f} s")
        Console().print(table)
    dtf.shutdown()


if __name__ == "__main__":
    main()
