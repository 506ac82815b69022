"""A node restarted mid-training takes the model and optimizer state from a live rank and trains
on with the others, its rounds realigned with theirs (issue 26, docs/faults.md)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
import torch

import decent.tf as dtf
import decent.torch as dt
from cluster import Cluster, delay, until_state

pytestmark = pytest.mark.slow

X = torch.linspace(-1, 1, 32).reshape(8, 4)


class Trainer:
    """One rank's model and decentralized optimizer (SGD with momentum, D-SGD or
    ``algorithm``)."""

    def __init__(self, client: Any, seed: int, algorithm: str = "dsgd",
                 **options: Any) -> None:
        torch.manual_seed(seed)
        self.client = client
        self.model = torch.nn.Linear(4, 1)
        self.opt = dt.DecentralizedOptimizer(
            torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9), self.model,
            algorithm=algorithm, client=client, **options)
        self.y = torch.full((8, 1), float(client.rank))
        #: (parameters, momentum buffers, the algorithm's state) before each step
        self.before: list[tuple[list[torch.Tensor], list[torch.Tensor],
                                list[dict[str, torch.Tensor]]]] = []

    def step(self) -> None:
        delay(self.client.rank)
        params = [p.detach().clone() for p in self.model.parameters()]
        momentum = [self.opt.state[p]["momentum_buffer"].clone()
                    for p in self.model.parameters() if p in self.opt.state]
        self.before.append((params, momentum, self.algorithm_state()))
        self.opt.zero_grad()
        torch.nn.functional.mse_loss(self.model(X), self.y).backward()
        self.opt.step()

    def algorithm_state(self) -> list[dict[str, torch.Tensor]]:
        """A copy of the algorithm's per-parameter state (DiLoCo: anchor, outer momentum)."""
        return [{k: v.clone() for k, v in self.opt.algorithm_state.get(p, {}).items()}
                for p in self.model.parameters()]

    def flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])


def steps(trainers: list[Any], n: int) -> None:
    """``n`` steps on every trainer at once (one thread each)."""
    def run(t: Any) -> None:
        for _ in range(n):
            t.step()
    with ThreadPoolExecutor(len(trainers)) as pool:
        for f in [pool.submit(run, t) for t in trainers]:
            f.result(timeout=120)


def join_while_training(survivors: list[Any], join: Callable[[], Any]) -> Any:
    """The new worker (``join()``) takes its state while the survivors train on (they leave
    it out until it has); its donor (rank 0) sends at a step boundary. The new trainer."""
    with ThreadPoolExecutor(3) as pool:
        joiner = pool.submit(join)

        def train_on() -> None:
            while not joiner.done():
                steps(survivors, 1)

        trained = pool.submit(train_on)
        new = joiner.result(timeout=120)
        trained.result(timeout=120)
    return new


def train_together(survivors: list[Any], rejoined: Any) -> None:
    """Its rounds restarted at 0 and pair with the survivors': they train on together (the
    survivors' steps that started before it joined leave it out, so they may take a step more;
    whoever stops leaves, which ends the others' step under way)."""
    with ThreadPoolExecutor(3) as pool:
        def joiner_steps() -> None:
            for _ in range(6):
                rejoined.step()
            rejoined.client.close()

        joined = pool.submit(joiner_steps)

        def survivor(t: Any) -> None:
            while not joined.done():
                t.step()
            t.client.close()

        ends = [pool.submit(survivor, t) for t in survivors]
        joined.result(timeout=120)
        for f in ends:
            f.result(timeout=120)


def assert_as_close_as_the_others(flats: list[Any]) -> None:
    """The rejoined rank (last) is as close to the mean as any other (within 1.5x)."""
    mean = sum(flats) / len(flats)
    distance = [float(np.linalg.norm(np.asarray(f) - np.asarray(mean))) for f in flats]
    assert distance[-1] <= 1.5 * max(distance[:-1]) + 1e-6, distance


#: D-SGD, and DiLoCo gossiping every 2 steps (its outer state is part of what is taken; an
#: outer step without momentum, so that 6 steps together bring the ranks as close as D-SGD's)
REJOINING: dict[str, dict[str, Any]] = {"dsgd": {}, "diloco": {
    "local_steps": 2, "mix": "neighbor", "outer_lr": 1.0, "outer_momentum": 0.0}}


@pytest.mark.parametrize("algorithm", list(REJOINING))
def test_a_restarted_node_takes_the_state_of_a_live_rank_and_trains_on(algorithm: str) -> None:
    options = REJOINING[algorithm]
    c = Cluster(3, "ring")
    try:
        c.connect()
        trainers = [Trainer(c.clients[r], seed=r, algorithm=algorithm, **options)
                    for r in range(3)]
        steps(trainers, 3)
        c.kill_node(2)
        steps(trainers[:2], 2)  # without rank 2: reweighted
        c.procs[2] = c.spawn(2, "ring")
        for i in (0, 1):
            until_state(c, i, 2, "up")
        trainers[2] = join_while_training(
            trainers[:2], lambda: Trainer(dt.connect(f"unix://{c.sockets[2]}", 60), seed=99,
                                          algorithm=algorithm, **options))
        rejoined = trainers[2]
        assert rejoined.client.rejoining
        taken = [p.detach() for p in rejoined.model.parameters()]
        # exactly rank 0's parameters and momentum as they were before one of its steps
        match = [k for k, (params, _, _) in enumerate(trainers[0].before)
                 if all(torch.equal(a, b) for a, b in zip(params, taken, strict=True))]
        assert match, "the rejoined rank's parameters are none of its donor's"
        momentum = [rejoined.opt.state[p]["momentum_buffer"] for p in rejoined.model.parameters()]
        donor_momentum = trainers[0].before[match[-1]][1]
        assert all(torch.equal(a, b) for a, b in zip(donor_momentum, momentum, strict=True))
        # the step counters too: as many steps as the donor had made
        assert rejoined.opt.algorithm.counters()["iteration"] == match[-1]
        # and the algorithm's state (DiLoCo: the anchor and the outer momentum)
        donor_state, taken_state = trainers[0].before[match[-1]][2], rejoined.algorithm_state()
        assert [sorted(s) for s in taken_state] == [sorted(s) for s in donor_state]
        assert algorithm == "dsgd" or sorted(taken_state[0]) == ["anchor", "momentum"]
        for mine, theirs in zip(taken_state, donor_state, strict=True):
            assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
        train_together(trainers[:2], rejoined)
        assert_as_close_as_the_others([t.flat().numpy() for t in trainers])
    finally:
        c.stop()


class KerasTrainer:
    """One rank's Keras model and decentralized optimizer (SGD with momentum, ``algorithm``)."""

    def __init__(self, client: Any, seed: int, algorithm: str = "dsgd") -> None:
        keras.utils.set_random_seed(seed)
        self.client = client
        self.model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        self.opt = dtf.DecentralizedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                              algorithm=algorithm, client=client)
        self.x = tf.constant(X.numpy())
        self.y = tf.fill((8, 1), float(client.rank))
        #: (variables, optimizer variables) after each step
        self.after: list[tuple[list[np.ndarray], list[np.ndarray]]] = []
        #: the algorithm's per-variable state after each step
        self.states: list[list[dict[str, np.ndarray]]] = []

    def state(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        return ([v.numpy() for v in self.model.trainable_variables],
                [v.numpy() for v in self.opt.inner.variables])

    def step(self) -> None:
        delay(self.client.rank)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((self.model(self.x) - self.y) ** 2)
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.opt.apply_gradients(zip(grads, self.model.trainable_variables, strict=True))
        self.after.append(self.state())
        self.states.append(self.algorithm_state())

    def algorithm_state(self) -> list[dict[str, np.ndarray]]:
        return [{k: np.array(v) for k, v in s.items()} for s in self.opt.algorithm_state]

    def flat(self) -> np.ndarray:
        return np.concatenate([v.numpy().reshape(-1) for v in self.model.trainable_variables])


@pytest.mark.parametrize("algorithm", ["dsgd", "gradient-tracking"])  # in place; on the host
def test_a_restarted_keras_rank_takes_the_state_of_a_live_rank_and_trains_on(
        algorithm: str) -> None:
    c = Cluster(3, "ring")
    clients: list[Any] = []
    try:
        with ThreadPoolExecutor(3) as pool:
            clients = list(pool.map(lambda s: dtf.connect(f"unix://{s}", 60), c.sockets))
        trainers = [KerasTrainer(clients[r], seed=r, algorithm=algorithm) for r in range(3)]
        steps(trainers, 3)
        c.kill_node(2)
        clients[2].close()
        steps(trainers[:2], 2)
        c.procs[2] = c.spawn(2, "ring")
        for i in (0, 1):
            until_state(c, i, 2, "up")
        def join() -> KerasTrainer:  # building the optimizer takes the donor's state
            t = KerasTrainer(dtf.connect(f"unix://{c.sockets[2]}", 60), seed=99,
                             algorithm=algorithm)
            t.opt.build(t.model.trainable_variables)
            return t

        trainers[2] = join_while_training(trainers[:2], join)
        rejoined = trainers[2]
        clients[2] = rejoined.client
        assert rejoined.client.rejoining
        taken, taken_opt = rejoined.state()
        # exactly rank 0's variables and momentum as they were after one of its steps
        match = [k for k, (values, _) in enumerate(trainers[0].after)
                 if all(np.array_equal(a, b) for a, b in zip(values, taken, strict=True))]
        assert match, "the rejoined rank's variables are none of its donor's"
        donor_opt = trainers[0].after[match[-1]][1]
        assert len(donor_opt) == len(taken_opt) >= 3  # iterations, learning rate, momenta
        assert all(np.array_equal(a, b) for a, b in zip(donor_opt, taken_opt, strict=True))
        assert int(rejoined.opt.iterations.numpy()) == match[-1] + 1
        assert rejoined.opt.algorithm.counters()["iteration"] == match[-1] + 1
        # and the algorithm's state (gradient tracking: y and d per variable)
        taken_state = rejoined.algorithm_state()
        donor_state = trainers[0].states[match[-1]]
        assert [sorted(s) for s in taken_state] == [sorted(s) for s in donor_state]
        assert all(np.array_equal(s[k], d[k]) for s, d in zip(taken_state, donor_state,
                                                               strict=True) for k in s)
        train_together(trainers[:2], rejoined)
        if algorithm == "dsgd":  # gradient tracking's sum of trackers changed with the join
            assert_as_close_as_the_others([t.flat() for t in trainers])
    finally:
        for cl in clients:
            cl.close()
        c.stop()
