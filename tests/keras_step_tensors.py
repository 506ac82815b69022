"""Counts the model-sized tensors one Keras optimizer step makes, per rank, under decentrun.

    decentrun -np 2 -- python tests/keras_step_tensors.py dsgd,allreduce,pga

Each rank is a process of its own with one thread running TensorFlow eagerly (TensorFlow's op
callbacks, which do the counting, are kept per thread and miss ops when several threads of one
process run TensorFlow). For every algorithm it takes three steps of the plain Keras optimizer
and three of ``decent.tf.DecentralizedOptimizer`` around it, on the same model, and prints one
JSON line: by op type, the tensors of >= 2560 elements each step's last run made, that share
no buffer with what they read (reads of a variable and identities are left out), and the most
memory the allocations Python made during that step (numpy's arrays among them) held at once
(``tracemalloc``'s peak, which counts only what it saw allocated since it started), also for
the third step of the wrapped optimizer compiled.
"""

from __future__ import annotations

import json
import os
import sys
import tracemalloc
from collections import Counter
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import tensorflow as tf
from tensorflow.python.framework import op_callbacks

import decent.tf as dtf

MIN_ELEMENTS = 2560  # the smaller of the model's two large variables (256 x 10)
ALIASING = frozenset({"ReadVariableOp", "Identity"})


class LargeOutputs:
    """Counts, by op type, the ops this thread runs eagerly that give a new tensor of
    :data:`MIN_ELEMENTS` elements or more."""

    def __init__(self) -> None:
        self.made: Counter[str] = Counter()

    def __call__(self, op_type: Any, inputs: Any, attrs: Any, outputs: Any,
                 op_name: Any = None, graph: Any = None) -> None:
        name = str(op_type, "ascii") if isinstance(op_type, bytes) else str(op_type)
        if graph is None and name not in ALIASING:
            self.made.update(name for t in outputs or () if t is not None
                             and (t.shape.num_elements() or 0) >= MIN_ELEMENTS)

    def __enter__(self) -> LargeOutputs:
        op_callbacks.add_op_callback(self)
        return self

    def __exit__(self, *exc: object) -> None:
        op_callbacks.remove_op_callback(self)


def last_step(client: Any, algorithm: str, wrapped: bool,
              compiled: bool = False) -> tuple[dict[str, int], int]:
    """What the third step of ``algorithm`` (not ``wrapped``: the plain optimizer it wraps;
    ``compiled``: in a ``tf.function``, whose ops the callbacks do not see) made: the tensors by
    op type, and the peak of the Python allocations it made (bytes)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(256),
                              keras.layers.Dense(10)])
    opt = keras.optimizers.SGD(0.1, momentum=0.0 if algorithm == "decentlam" else 0.9)
    if wrapped:
        opt = dtf.DecentralizedOptimizer(opt, algorithm=algorithm, client=client,
                                         prefix=f"tensors.{algorithm}.{compiled}")
    grads = [tf.ones_like(v) / 64 for v in model.trainable_variables]

    def step() -> None:
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    run = tf.function(step) if compiled else step
    for k in range(3):
        if k == 2:
            tracemalloc.start()
        with LargeOutputs() as watch:
            run()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return dict(watch.made), peak


def main() -> int:
    """Count for each algorithm of ``argv[1]`` (comma-separated)."""
    client = dtf.init()
    for algorithm in sys.argv[1].split(","):
        plain, plain_peak = last_step(client, algorithm, False)
        wrapped, wrapped_peak = last_step(client, algorithm, True)
        _, compiled_peak = last_step(client, algorithm, True, compiled=True)
        print(json.dumps({"rank": client.rank, "algorithm": algorithm, "plain": plain,
                          "wrapped": wrapped, "plain_python_peak": plain_peak,
                          "wrapped_python_peak": wrapped_peak,
                          "compiled_python_peak": compiled_peak}), flush=True)
    dtf.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
