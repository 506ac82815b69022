"""The TensorFlow client through real daemons: exact values, tf.function, errors, interop with
torch, and the Keras wrapper against the torch wrapper."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
import torch

import decent.tf as dtf
import decent.torch as dt
from cluster import DECENTRUN_ARENA, Cluster, delay
from conftest import ClusterFactory
from decent.core import DecentError

REPO = Path(__file__).resolve().parents[1]
N = 4  # ring
# every rank of a test is a thread of this process, and a blocking op staged in a tf.function
# holds one of TensorFlow's inter-op threads until its neighbors call: enough for all ranks
tf.config.threading.set_inter_op_parallelism_threads(4 * N)


@pytest.fixture
def tfc(cluster: ClusterFactory) -> Iterator[tuple[Cluster, list[dtf.TFClient]]]:
    """The shared 4-rank ring, with one TensorFlow client per rank next to the torch ones (in a
    job of their own: a daemon serves one worker per job)."""
    c = cluster(N, "ring")
    job = c.clients[0].job + ".tf"  # a worker per daemon and job: beside the torch ones
    with ThreadPoolExecutor(N) as pool:
        clients = list(pool.map(lambda s: dtf.connect(f"unix://{s}", 60, job=job), c.sockets))
    yield c, clients
    for cl in clients:
        cl.close()


def run_tf(clients: list[dtf.TFClient], fn: Any) -> list[Any]:
    """``fn(client)`` on every rank at once (a rank started late as $DECENT_TEST_DELAY says)."""
    def late(cl: dtf.TFClient) -> Any:
        delay(cl.rank)
        return fn(cl)

    with ThreadPoolExecutor(len(clients)) as pool:
        return [f.result(timeout=120) for f in [pool.submit(late, cl) for cl in clients]]


def ring(r: int) -> list[int]:
    return [(r - 1) % N, (r + 1) % N]


def x_of(r: int, dtype: Any = tf.float64) -> tf.Tensor:
    return tf.cast(tf.range(6, dtype=tf.float64) + 8.0 * r, dtype)


@pytest.mark.slow
def test_ops_give_exact_values_eagerly_and_in_place(tfc: Any) -> None:
    _, clients = tfc

    def work(cl: dtf.TFClient) -> dict[str, Any]:
        r = cl.rank
        v = tf.Variable(x_of(r, tf.float32))
        out = {
            "nar": cl.neighbor_allreduce(x_of(r), name="tf.nar", self_weight=0.5,
                                         src_weights={j: 0.25 for j in ring(r)}),
            "ar": cl.allreduce_async(x_of(r), name="tf.ar").wait(),
            "bc": cl.broadcast(x_of(r), root=2, name="tf.bc"),
            "ag": cl.neighbor_allgather(x_of(r), name="tf.ag"),
            "bf": cl.allreduce(x_of(r, tf.bfloat16), op="sum", name="tf.bf"),
            "var": cl.allreduce_(v, name="tf.var"),
        }
        return {k: (t.numpy(), t.dtype) for k, t in out.items()} | {"v": v.numpy()}

    got = run_tf(clients, work)
    xs = np.stack([x_of(r).numpy() for r in range(N)])
    for r, g in enumerate(got):
        np.testing.assert_array_equal(g["nar"][0], 0.5 * xs[r] + 0.25 * (xs[(r - 1) % N]
                                                                          + xs[(r + 1) % N]))
        assert g["nar"][1] == tf.float64 and g["var"][1] == tf.float32
        np.testing.assert_array_equal(g["ar"][0], xs.mean(axis=0))
        np.testing.assert_array_equal(g["bc"][0], xs[2])
        np.testing.assert_array_equal(g["ag"][0], xs[sorted(ring(r))])
        assert g["bf"][1] == tf.bfloat16
        np.testing.assert_array_equal(g["bf"][0].astype(np.float64), xs.sum(axis=0))
        np.testing.assert_array_equal(g["v"], xs.mean(axis=0).astype(np.float32))


@pytest.mark.slow
def test_window_ops_on_variables_give_exact_values(tfc: Any) -> None:
    _, clients = tfc

    def work(cl: dtf.TFClient) -> dict[str, Any]:
        r = cl.rank
        v = tf.Variable(x_of(r))
        cl.win_create(v, "tf.win")
        cl.barrier(name="tf.win.b0")
        cl.win_put(x_of(r) * 10.0, "tf.win")  # to both ring neighbors, weight 1
        cl.barrier(name="tf.win.b1")
        versions = cl.win_versions("tf.win")
        out = cl.win_update("tf.win", self_weight=0.5,
                            neighbor_weights={j: 0.25 for j in ring(r)})
        same, first = out is v, out.numpy().copy()  # the next update writes into v again
        cl.barrier(name="tf.win.b2")
        cl.win_get("tf.win", src_weights={j: 1.0 for j in ring(r)})  # their updated copies
        # gets are answered from the own copy at arrival: no neighbor updates again before
        # every get was served (without this, a slow rank reads its neighbors' next update)
        cl.barrier(name="tf.win.b2b")
        got = cl.win_update("tf.win", self_weight=0.0,
                            neighbor_weights={j: 0.5 for j in ring(r)})
        cl.barrier(name="tf.win.b3")
        cl.win_free("tf.win")
        return {"versions": versions, "out": first, "got": got.numpy().copy(), "same": same}

    got = run_tf(clients, work)
    xs = np.stack([x_of(r).numpy() for r in range(N)])
    upd = [0.5 * xs[r] + 0.25 * 10.0 * (xs[(r - 1) % N] + xs[(r + 1) % N]) for r in range(N)]
    for r, g in enumerate(got):
        assert g["versions"] == {j: 1 for j in ring(r)} and g["same"]  # written into v
        np.testing.assert_array_equal(g["out"], upd[r])
        np.testing.assert_array_equal(g["got"], 0.5 * (upd[(r - 1) % N] + upd[(r + 1) % N]))


@pytest.mark.slow
def test_blocking_ops_run_inside_tf_function(tfc: Any) -> None:
    _, clients = tfc

    def work(cl: dtf.TFClient) -> list[np.ndarray]:
        v = tf.Variable(tf.zeros(6, tf.float64))

        @tf.function
        def step(x: tf.Tensor) -> tf.Tensor:
            y = cl.neighbor_allreduce(x, name="tf.fn.nar")  # ring weights: 1/3 each
            v.assign(y)
            cl.allreduce_(v, name="tf.fn.ar")
            cl.barrier(name="tf.fn.barrier")
            return y * 3.0

        r = cl.rank
        return [step(x_of(r)).numpy(), step(x_of(r) * 2.0).numpy(), v.numpy()]

    got = run_tf(clients, work)
    xs = np.stack([x_of(r).numpy() for r in range(N)])
    for r, g in enumerate(got):
        sums = xs[r] + xs[(r - 1) % N] + xs[(r + 1) % N]
        np.testing.assert_allclose(g[0], sums, rtol=1e-15)
        np.testing.assert_allclose(g[1], 2 * sums, rtol=1e-15)  # runs each time the graph runs
        np.testing.assert_allclose(g[2], 2 * xs.mean(axis=0), rtol=1e-15)


@pytest.mark.slow
def test_async_ops_inside_tf_function_are_refused(tfc: Any) -> None:
    cl = tfc[1][0]

    @tf.function
    def bad(x: tf.Tensor) -> tf.Tensor:
        return cl.neighbor_allreduce_async(x, name="tf.bad").wait()

    with pytest.raises(RuntimeError, match=r"inside tf\.function use the blocking ops"):
        bad(tf.zeros(3))


@pytest.mark.slow
def test_mismatch_names_the_tensor_and_both_ranks(tfc: Any) -> None:
    _, clients = tfc

    def work(cl: dtf.TFClient) -> str:
        shape = [5] if cl.rank == 1 else [4]
        try:
            cl.neighbor_allreduce(tf.zeros(shape), name="tf.mis", timeout=20)
        except DecentError as exc:
            return str(exc)
        return "no error"

    got = run_tf(clients, work)
    for r in (0, 2):  # rank 1's ring neighbors
        assert "'tf.mis'" in got[r] and "float32[4]" in got[r] and "float32[5]" in got[r], got[r]
        assert "rank 1" in got[r]


@pytest.mark.slow
def test_torch_and_tensorflow_workers_are_neighbors(cluster: ClusterFactory) -> None:
    c = cluster(2, "ring")
    c.clients[0].close()  # rank 0's worker is a TensorFlow one
    tf_client = dtf.connect(f"unix://{c.sockets[0]}", 60, job=c.clients[1].job)
    torch_client = c.clients[1]
    try:
        with ThreadPoolExecutor(2) as pool:
            a = pool.submit(tf_client.neighbor_allreduce, tf.constant([1.0, 2.0, 3.0]),
                            name="interop")
            b = pool.submit(torch_client.neighbor_allreduce,
                            torch.tensor([3.0, 6.0, 9.0]), name="interop")
            got_tf, got_torch = a.result(timeout=60), b.result(timeout=60)
    finally:
        tf_client.close()
    assert isinstance(got_tf, tf.Tensor) and isinstance(got_torch, torch.Tensor)
    assert got_tf.numpy().tolist() == [2.0, 4.0, 6.0] == got_torch.tolist()


# ------------------------------------------------------------------ the Keras wrapper

DIM, ROWS, STEPS = 3, 8, 40
LR = 0.0625  # exact in float32, the dtype of Keras' learning-rate variable


def _problem(r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(20 + r)
    return (rng.normal(size=(ROWS, DIM)) / np.sqrt(ROWS), rng.normal(size=ROWS) + r,
            np.random.default_rng(5).normal(size=DIM) * (r + 1))


@pytest.mark.slow
@pytest.mark.parametrize(("algorithm", "compiled"), [
    ("dsgd", True), ("dsgd", False), ("gradient-tracking", True), ("gradient-tracking", False),
    ("extra", True), ("exact-diffusion", True), ("decentlam", True), ("choco", False),
    ("push-sum", True), ("win-put", True), ("diloco", True), ("diloco", False)])
def test_keras_wrapper_matches_the_torch_wrapper(tfc: Any, algorithm: str,
                                                 compiled: bool) -> None:
    c, clients = tfc
    # win-put is asynchronous unless every put lands before any rank combines
    by_algorithm: dict[str, dict[str, Any]] = {"win-put": {"barrier": True},
                                               "diloco": {"local_steps": 4, "mix": "neighbor"}}
    options = by_algorithm.get(algorithm, {})

    def with_torch(cl: Any) -> np.ndarray:
        a, b, x0 = (torch.from_numpy(v) for v in _problem(cl.rank))
        x = torch.nn.Parameter(x0.clone())
        opt = dt.DecentralizedOptimizer(torch.optim.SGD([x], lr=LR), algorithm=algorithm,
                                        client=cl, prefix=f"ls.torch.{algorithm}", **options)
        for _ in range(STEPS):
            opt.zero_grad()
            (0.5 * ((a @ x - b) ** 2).sum()).backward()
            opt.step()
        return x.detach().numpy().copy()

    def with_keras(cl: dtf.TFClient) -> np.ndarray:
        a, b, x0 = (tf.constant(v) for v in _problem(cl.rank))
        x = tf.Variable(x0)
        opt = dtf.DecentralizedOptimizer(keras.optimizers.SGD(LR), algorithm=algorithm,
                                         client=cl, prefix=f"ls.keras.{algorithm}", **options)

        def step() -> tf.Tensor:
            with tf.GradientTape() as tape:
                loss = 0.5 * tf.reduce_sum((tf.linalg.matvec(a, x) - b) ** 2)
            opt.apply_gradients(zip(tape.gradient(loss, [x]), [x], strict=True))
            return tf.identity(x)  # read in the same step: the combined value

        run = tf.function(step) if compiled else step
        for _ in range(STEPS):
            read = run()
            np.testing.assert_array_equal(read.numpy(), x.numpy())
        return np.asarray(x.numpy())

    want = np.stack(c.run(with_torch))
    got = np.stack(run_tf(clients, with_keras))
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    assert np.linalg.norm(got - got.mean(axis=0)) < np.linalg.norm(  # the ranks moved together
        np.stack([_problem(r)[2] for r in range(N)]) - np.mean([_problem(r)[2]
                                                                for r in range(N)], axis=0))


#: every algorithm the Keras wrapper runs, by how: in the variables, or over host buffers
KERAS_IN_PLACE = ("dsgd", "allreduce", "pga")
KERAS_ON_HOST = ("dsgd-cta", "gradient-tracking", "extra", "exact-diffusion", "d2", "decentlam",
                 "choco", "push-sum", "win-put", "adpsgd", "wagma", "diloco")
#: and the one that reduces the gradients before the wrapped optimizer's step
KERAS_REDUCING = ("gradient-allreduce",)
#: bytes of the model's larger variable (256 x 256 float32)
LARGE_VARIABLE_BYTES = 256 * 256 * 4


@pytest.mark.slow
def test_a_keras_step_makes_no_model_sized_tensor() -> None:
    # beyond the wrapped optimizer's own ops, a step makes no model-sized tensor (2 variables
    # of >= 2560 elements): adapt-then-combine combines in the variables, which take their
    # results where the daemon wrote them; the others run over numpy buffers kept across steps
    # and hand each new value over in a pooled buffer, so no numpy array of a variable's size
    # is made either, eager or compiled (counted in processes of their own:
    # tests/keras_step_tensors.py; a compiled step's TensorFlow ops are not seen)
    algorithms = (*KERAS_IN_PLACE, *KERAS_ON_HOST, *KERAS_REDUCING)
    proc = subprocess.run(
        [sys.executable, "-m", "decentd.tools.launcher", "-np", "2", *DECENTRUN_ARENA,
         "--topology", "ring", "--",
         sys.executable, str(REPO / "tests" / "keras_step_tensors.py"), ",".join(algorithms)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    counts = [json.loads(line[line.index("{"):]) for line in proc.stdout.splitlines()
              if '"algorithm"' in line]
    assert sorted((c["rank"], c["algorithm"]) for c in counts) == sorted(
        (r, a) for r in (0, 1) for a in algorithms)
    for c in counts:
        assert c["plain"] and c["wrapped"] == c["plain"], c
        assert c["wrapped_python_peak"] < LARGE_VARIABLE_BYTES, c
        assert c["compiled_python_peak"] < LARGE_VARIABLE_BYTES, c


@pytest.mark.slow
def test_model_fit_with_callbacks_keeps_the_replicas_identical(tfc: Any) -> None:
    _, clients = tfc

    def work(cl: dtf.TFClient) -> dict[str, Any]:
        r = cl.rank
        keras.utils.set_random_seed(100 + r)  # different initial weights on every rank
        rng = np.random.default_rng(r)
        x = rng.normal(size=(64, 5)).astype("float32")
        y = (x @ np.arange(5, dtype="float32") + r).reshape(-1, 1)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
        model.compile(optimizer=dtf.DecentralizedOptimizer(
            keras.optimizers.SGD(0.01), algorithm="allreduce", client=cl, prefix="fit"),
            loss="mse")
        hist = model.fit(x, y, epochs=2, batch_size=16, verbose=0, shuffle=False, callbacks=[
            dtf.BroadcastGlobalVariablesCallback(0, client=cl),
            dtf.MetricAverageCallback(client=cl)])
        return {"w": [w.copy() for w in model.get_weights()], "loss": hist.history["loss"]}

    got = run_tf(clients, work)
    for g in got[1:]:
        for w, w0 in zip(g["w"], got[0]["w"], strict=True):
            np.testing.assert_array_equal(w, w0)  # broadcast start + global average each step
        assert g["loss"] == got[0]["loss"]  # averaged over the ranks
    assert got[0]["loss"][1] < got[0]["loss"][0]


@pytest.mark.slow
@pytest.mark.parametrize(("compiled", "op"), [(True, "average"), (False, "sum")])
def test_keras_gradient_allreduce_steps_on_the_reduced_gradients(tfc: Any, compiled: bool,
                                                                  op: str) -> None:
    # Horovod's data parallelism through DecentralizedOptimizer, 2 steps on 4 ranks, SGD with
    # weight decay: rank r's dense gradient is r + 1 everywhere (reduced: 2.5, the mean, or 10,
    # the sum); an embedding's sparse gradient is r + 1 in row r (reduced dense); a missing
    # gradient leaves its variable alone, weight decay included (as plain Keras and Horovod)
    _, clients = tfc

    def work(cl: dtf.TFClient) -> list[np.ndarray]:
        x = tf.Variable(np.zeros(3, np.float32))
        emb = keras.layers.Embedding(N, 2, embeddings_initializer="zeros")
        emb.build((None,))
        unused = tf.Variable(np.ones(2))
        opt = dtf.DecentralizedOptimizer(keras.optimizers.SGD(0.5, weight_decay=0.1),
                                         "gradient-allreduce", client=cl,
                                         prefix=f"ga.{compiled}", op=op)
        variables = [x, emb.embeddings, unused]

        def step() -> None:
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(x) + tf.reduce_sum(emb(tf.constant([cl.rank])))
                loss *= float(cl.rank + 1)
            grads = tape.gradient(loss, [x, emb.embeddings])
            assert isinstance(grads[1], tf.IndexedSlices)
            opt.apply_gradients(zip([*grads, None], variables, strict=True))

        run = tf.function(step) if compiled else step
        for _ in range(2):
            run()
        return [np.asarray(v.numpy()) for v in variables]

    reduced = 1.0 if op == "sum" else 1.0 / N  # of the ranks' gradients' sum
    want_x, want_emb = np.zeros(3), np.zeros((N, 2))
    for _ in range(2):  # Keras: decay (v -= lr * wd * v), then the step (v -= lr * g)
        want_x = want_x - 0.5 * 0.1 * want_x - 0.5 * reduced * 10.0
        want_emb = want_emb - 0.5 * 0.1 * want_emb - 0.5 * reduced * np.arange(1, N + 1)[:, None]
    for x, emb, unused in run_tf(clients, work):
        np.testing.assert_allclose(x, want_x, rtol=1e-6)
        np.testing.assert_allclose(emb, want_emb, rtol=1e-6)
        np.testing.assert_array_equal(unused, np.ones(2))


@pytest.mark.slow
def test_the_tf_client_takes_numpy_arrays_and_gives_numpy_arrays(tfc: Any) -> None:
    # what the Keras optimizer's host buffers rely on: out of place, in place, and in the
    # arena (shared), each exact on a ring of 4 (weights 1/3); a TensorFlow tensor still
    # cannot be shared
    _, clients = tfc

    def work(cl: dtf.TFClient) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
        r = cl.rank
        out = cl.neighbor_allreduce(np.full(5, float(r)), name="np.out")
        private = np.full(3, float(r), np.float32)
        cl.neighbor_allreduce_async_(private, name="np.in").wait()
        shared = cl.shared(np.full(4, float(r), np.float32))
        cl.neighbor_allreduce_async_(shared, name="np.shared").wait()
        with pytest.raises(TypeError) as refused:
            cl.shared(tf.zeros(2))
        assert isinstance(out, np.ndarray) and isinstance(shared, np.ndarray)
        return out, private, shared, str(refused.value)

    for r, (out, private, shared, refused) in enumerate(run_tf(clients, work)):
        want = (r + (r - 1) % N + (r + 1) % N) / 3
        np.testing.assert_array_equal(out, np.full(5, want))
        assert out.dtype == np.float64
        np.testing.assert_array_equal(private, np.full(3, want, np.float32))
        np.testing.assert_array_equal(shared, np.full(4, want, np.float32))
        assert "numpy arrays work" in refused


@pytest.mark.slow
def test_set_topology_and_small_integers_on_the_tf_client(tfc: Any) -> None:
    _, clients = tfc

    def work(cl: dtf.TFClient) -> tuple[np.ndarray, list[int], np.ndarray, np.ndarray]:
        assert cl.set_topology("full")
        full = cl.neighbor_allreduce(tf.fill([3], float(cl.rank)), name="tf.topo")
        neighbors = cl.in_neighbor_ranks()
        assert cl.set_topology(None)
        small = cl.neighbor_allreduce(tf.fill([2], tf.constant(-3 * cl.rank, tf.int8)),
                                      name="tf.int8")
        gathered = cl.allgather(tf.fill([cl.rank, 2], cl.rank), name="tf.gather")
        return full.numpy(), neighbors, small.numpy(), gathered.numpy()

    for r, (full, neighbors, small, gathered) in enumerate(run_tf(clients, work)):
        np.testing.assert_array_equal(full, np.full(3, 1.5, np.float32))
        assert neighbors == [j for j in range(N) if j != r]
        assert small.dtype == np.int8
        np.testing.assert_array_equal(small, np.full(2, -(r + (r - 1) % N + (r + 1) % N), np.int8))
        np.testing.assert_array_equal(gathered, np.repeat(np.arange(N), np.arange(N))[:, None]
                                      * np.ones((1, 2), np.int32))


def test_the_tf_module_has_the_bluefog_and_horovod_names() -> None:
    for name in ("set_topology", "load_topology", "in_neighbor_ranks", "out_neighbor_ranks",
                 "allgather", "win_mutex", "win_associated_p", "window_names",
                 "DistributedOptimizer", "Compression", "callbacks", "local_rank"):
        assert hasattr(dtf, name), name


@pytest.mark.slow
def test_keras_distributed_optimizer_sums_passes_in_a_compiled_fit(tfc: Any) -> None:
    # 4 epochs of one full batch, backward_passes_per_step=2 (averaged): two real updates,
    # each on the ranks' average gradient; the second at the learning rate a callback set
    _, clients = tfc
    rows = np.arange(12, dtype=np.float32).reshape(4, 3) / 10.0

    def data(r: int) -> tuple[np.ndarray, np.ndarray]:
        return rows + r / 10.0, (rows.sum(axis=1, keepdims=True) + r).astype(np.float32)

    class HalveAtEpoch2(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            if epoch == 2:
                self.model.optimizer.learning_rate = 0.05

    def work(cl: dtf.TFClient) -> np.ndarray:
        x, y = data(cl.rank)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(
            1, use_bias=False, kernel_initializer="ones")])
        model.compile(loss="mse", optimizer=dtf.DistributedOptimizer(
            keras.optimizers.SGD(0.1), backward_passes_per_step=2,
            average_aggregated_gradients=True, client=cl))
        model.fit(x, y, epochs=4, batch_size=4, verbose=0, shuffle=False,
                  callbacks=[HalveAtEpoch2()])
        return model.get_weights()[0]

    w = np.ones((3, 1))
    for lr in (0.1, 0.05):
        g = np.mean([2 / 4 * x.T @ (x @ w - y) for x, y in map(data, range(N))], axis=0)
        w = w - lr * g
    for got in run_tf(clients, work):
        np.testing.assert_allclose(got, w, rtol=1e-5)


def test_variables_that_outlive_their_client_leave_its_arena_unmapped() -> None:
    """A decentralized step assigns each result's buffer in the arena to its variable (no
    copy); a variable that outlives its client takes a copy of its value at close, so the
    arena is unmapped (before: every closed client of a compiled Keras step kept its whole
    arena mapped in this process, 4 arenas per test of this file)."""
    def mapped() -> int:
        with open("/proc/self/maps") as f:
            return sum(1 for line in f if "/memfd:" in line)

    c = Cluster(2, "ring")
    kept: list[tf.Variable] = []
    try:
        before = mapped()
        for turn in range(3):
            with ThreadPoolExecutor(2) as pool:
                clients = list(pool.map(
                    lambda s, turn=turn: dtf.connect(f"unix://{s}", 60, job=f"turn{turn}"),
                    c.sockets))

            def train(cl: dtf.TFClient) -> tf.Variable:
                x = tf.Variable(tf.fill((4,), float(cl.rank)))
                opt = dtf.DecentralizedOptimizer(keras.optimizers.SGD(0.0), client=cl,
                                                 prefix="leak")

                @tf.function
                def step() -> None:
                    with tf.GradientTape() as tape:
                        loss = tf.reduce_sum(x * x)
                    opt.apply_gradients(zip(tape.gradient(loss, [x]), [x], strict=True))

                step()
                return x

            kept += run_tf(clients, train)
            assert mapped() == before + 2  # both clients' arenas, while they run
            for cl in clients:
                cl.close()
            assert mapped() == before, turn
        # the variables kept their values: ring of 2, lr 0, each the average of 0 and 1
        assert all(np.array_equal(x.numpy(), np.full(4, 0.5, np.float32)) for x in kept)
    finally:
        c.stop()
