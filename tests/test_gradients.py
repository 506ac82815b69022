"""Collectives are differentiable (issue 28, point 2): the gradient through ``allreduce``,
``broadcast``, ``allgather`` and ``neighbor_allreduce`` on 4 ranks equals the gradient of the
sum of every rank's loss, computed independently with numpy (W transposed for the neighbor op).

Every rank's loss is ``sum(c_r * y_r)`` with its own random ``c_r``, so the gradient of the
total loss at rank j is a known linear map of all the ``c``: exact in float64.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorflow as tf
import torch

from cluster import Cluster, delay, run_each, tf_cluster
from decent_wire.topology import build_topology

pytestmark = pytest.mark.slow

N = 4
SHAPE = (3, 5)
# every rank of a TensorFlow test is a thread of this process, and a blocking op staged in a
# tf.function holds one of TensorFlow's inter-op threads until the other ranks call
tf.config.threading.set_inter_op_parallelism_threads(4 * N)


def coefficients(rank: int, shape: tuple[int, ...] = SHAPE) -> np.ndarray:
    return np.random.default_rng(100 + rank).standard_normal(shape)


def inputs(rank: int, shape: tuple[int, ...] = SHAPE) -> np.ndarray:
    return np.random.default_rng(200 + rank).standard_normal(shape)


@pytest.fixture(scope="module")
def four() -> Any:
    c = Cluster(N, "exponential")
    c.connect()
    yield c
    c.stop()


def torch_grad(cl: Any, method: str, x: np.ndarray, c: np.ndarray, **kwargs: Any
               ) -> np.ndarray:
    """Rank ``cl.rank``'s gradient of the total loss through ``method`` (torch autograd)."""
    t = torch.tensor(x, requires_grad=True)
    y = getattr(cl, method)(t, **kwargs)
    (y * torch.tensor(c)).sum().backward()
    assert t.grad is not None
    return t.grad.numpy()


W = build_topology("exponential", N).matrix(0)
ONE_PEER = np.array([[0.5, 0.0, 0.0, 0.5], [0.5, 0.5, 0.0, 0.0],  # rank i hears rank i-1 with
                     [0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 0.5, 0.5]])  # weight 0.5, sender scale 2
CASES: dict[str, tuple[str, Any, Any]] = {
    # (op, kwargs on rank r (a function of r), the expected gradient at rank j)
    "allreduce-average": ("allreduce", {}, lambda cs, j: sum(cs) / N),
    "allreduce-sum-scaled": ("allreduce", {"op": "sum", "prescale_factor": 2.0,
                                           "postscale_factor": 0.25},
                             lambda cs, j: sum(cs) * 0.5),
    "broadcast-root-1": ("broadcast", {"root": 1},
                         lambda cs, j: sum(cs) if j == 1 else np.zeros(SHAPE)),
    "neighbor-allreduce-topology": ("neighbor_allreduce", {},
                                    lambda cs, j: sum(W[i, j] * cs[i] for i in range(N))),
    "neighbor-allreduce-explicit": (
        "neighbor_allreduce", "one-peer",
        lambda cs, j: sum(ONE_PEER[i, j] * (2.0 if i != j else 1.0) * cs[i] for i in range(N))),
}


def kwargs_for(spec: Any, rank: int) -> dict[str, Any]:
    if spec != "one-peer":
        return dict(spec)
    return {"self_weight": 0.5, "src_weights": {(rank - 1) % N: 0.5},
            "dst_weights": {(rank + 1) % N: 2.0}}


@pytest.mark.parametrize("case", list(CASES))
def test_torch_gradients_are_the_adjoint_collectives(four: Any, case: str) -> None:
    op, spec, want = CASES[case]

    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        return torch_grad(cl, op, inputs(cl.rank), coefficients(cl.rank), name=case,
                          **kwargs_for(spec, cl.rank))

    cs = [coefficients(r) for r in range(N)]
    for j, got in enumerate(four.run(work)):
        np.testing.assert_allclose(got, want(cs, j), rtol=1e-12, atol=1e-12, err_msg=f"rank {j}")


def test_torch_allgather_gradient_is_each_ranks_rows_of_the_summed_gradient(four: Any) -> None:
    rows = [r + 1 for r in range(N)]
    total = (sum(rows), 5)

    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        t = torch.tensor(inputs(cl.rank, (rows[cl.rank], 5)), requires_grad=True)
        y = cl.allgather(t, name="ag.grad")
        assert y.shape == total
        (y * torch.tensor(coefficients(cl.rank, total))).sum().backward()
        return t.grad.numpy()

    summed = np.sum([coefficients(r, total) for r in range(N)], axis=0)
    start = 0
    for j, got in enumerate(four.run(work)):
        np.testing.assert_allclose(got, summed[start:start + rows[j]], rtol=1e-12, atol=1e-12)
        start += rows[j]


def test_a_tensor_without_grad_takes_the_plain_path(four: Any) -> None:
    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        y = cl.allreduce(torch.full((2,), float(cl.rank)), name="plain")
        return y.requires_grad, y

    for requires_grad, y in four.run(work):
        assert not requires_grad and torch.equal(y, torch.full((2,), 1.5))


@pytest.mark.parametrize("case", ["allreduce-average", "broadcast-root-1",
                                  "neighbor-allreduce-topology", "neighbor-allreduce-explicit"])
def test_tensorflow_gradients_are_the_adjoint_collectives(case: str) -> None:
    op, spec, want = CASES[case]

    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        x = tf.constant(inputs(cl.rank))
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = getattr(cl, op)(x, name=case, **kwargs_for(spec, cl.rank))
            loss = tf.reduce_sum(y * tf.constant(coefficients(cl.rank)))
        return tape.gradient(loss, x).numpy()

    with tf_cluster(N, "exponential") as clients:
        got = run_each(clients, work)
    cs = [coefficients(r) for r in range(N)]
    for j, g in enumerate(got):
        np.testing.assert_allclose(g, want(cs, j), rtol=1e-12, atol=1e-12, err_msg=f"rank {j}")


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_tensorflow_allgather_gradient_is_each_ranks_rows_of_the_summed_gradient(
        graph: bool) -> None:
    rows = [r + 1 for r in range(N)]
    total = (sum(rows), 5)

    def work(cl):  # type: ignore[no-untyped-def]
        delay(cl.rank)
        x = tf.constant(inputs(cl.rank, (rows[cl.rank], 5)))
        c = tf.constant(coefficients(cl.rank, total))

        def grad(v: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            with tf.GradientTape() as tape:
                tape.watch(v)
                y = cl.allgather(v, name="tf.ag")
                loss = tf.reduce_sum(y * c)
            return tf.shape(y), tape.gradient(loss, v)

        shape, g = (tf.function(grad) if graph else grad)(x)
        return tuple(shape.numpy()), g.numpy()

    with tf_cluster(N, "exponential") as clients:
        got = run_each(clients, work)
    summed = np.sum([coefficients(r, total) for r in range(N)], axis=0)
    start = 0
    for j, (shape, g) in enumerate(got):
        assert shape == total, j
        np.testing.assert_allclose(g, summed[start:start + rows[j]], rtol=1e-12, atol=1e-12,
                                   err_msg=f"rank {j}")
        start += rows[j]
