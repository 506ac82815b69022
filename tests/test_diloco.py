"""DiLoCo and decentralized DiLoCo through real daemons, against numpy runs of their recursions
(``algorithms.md``, "DiLoCo and decentralized DiLoCo"): both mixes, SGD and AdamW inner
optimizers, the compressed forms with their error feedback and public copies, and a
checkpoint that carries the anchor, the outer momentum and the residuals."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch

import decent.torch as dt
from cluster import Cluster
from compressors import int4, int8
from decent.core import Client
from decent.core.training.algorithms import AlgorithmError
from decent.core.training.algorithms.local_updates import fragment_bounds
from decent_wire.topology import build_topology
from least_squares import LR, X0, N, grads, loss, train

H, STEPS = 5, 23  # 4 outer steps, and 3 inner steps after the last one
ALL = slice(None)
ETA, MU = 0.7, 0.9
ADAM_LR, ADAM_BETAS, ADAM_EPS, ADAM_DECAY = 0.02, (0.9, 0.99), 1e-8, 0.01


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(N, "ring")
    try:
        c.connect()
        yield c
    finally:
        assert c.stop() == [0] * N


def sgd_updates() -> Callable[[np.ndarray], np.ndarray]:
    """The inner step's update ``d = lr g`` (plain SGD)."""
    return lambda x: LR * grads(x)


def adamw_updates() -> Callable[[np.ndarray], np.ndarray]:
    """The inner step's update of AdamW (``torch.optim.AdamW``'s rule), one state per rank."""
    m = v = np.zeros_like(X0)
    t = 0
    lr, (b1, b2), eps, wd = ADAM_LR, ADAM_BETAS, ADAM_EPS, ADAM_DECAY

    def update(x: np.ndarray) -> np.ndarray:
        nonlocal m, v, t
        g, t = grads(x), t + 1
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        decayed = x * lr * wd
        step = lr / (1 - b1 ** t) * m / (np.sqrt(v) / np.sqrt(1 - b2 ** t) + eps)
        return decayed + step
    return update


def simulate(w: np.ndarray, update: Callable[[np.ndarray], np.ndarray], steps: int = STEPS,
             eta: float = ETA, mu: float = MU, nesterov: bool = True,
             q: Callable[[np.ndarray], np.ndarray] | None = None, mix: str = "allreduce",
             consensus_step: float = 1.0, h: int = H, fragments: Sequence[slice] = (ALL,),
             overlap: int = 0, alpha: float = 0.0) -> np.ndarray:
    """The recursion of (streaming) DiLoCo (rows: ranks; ``fragments``: their columns); ``q``
    compresses what is sent. A fragment's new anchor is known when its exchange starts: it
    is applied ``overlap`` steps later."""
    x, theta = X0.copy(), X0.copy()
    u, e, zhat, s = (np.zeros_like(X0) for _ in range(4))
    landing: dict[int, np.ndarray] = {}
    per_rank = (lambda a: np.stack([q(r) for r in a])) if q else None
    offsets = [p * h // len(fragments) for p in range(len(fragments))]
    for k in range(steps):
        x, done = x - update(x), k + 1
        for p, c in enumerate(fragments):
            if done % h != offsets[p]:
                continue
            delta = theta[:, c] - x[:, c]
            if per_rank and mix == "allreduce":  # q = Q(delta + e), e' = delta + e - q
                sent = per_rank(delta + e[:, c])
                e[:, c], delta = delta + e[:, c] - sent, np.tile(sent.mean(axis=0), (N, 1))
            u[:, c] = mu * u[:, c] + delta
            z = theta[:, c] - eta * (delta + mu * u[:, c] if nesterov else u[:, c])
            if mix == "allreduce":
                landing[p] = z if per_rank else np.tile(z.mean(axis=0), (N, 1))
            elif per_rank:
                sent = per_rank(z - zhat[:, c])
                zhat[:, c], s[:, c] = zhat[:, c] + sent, s[:, c] + w @ sent
                landing[p] = z + consensus_step * (s[:, c] - zhat[:, c])
            else:
                landing[p] = w @ z
        for p, c in enumerate(fragments):
            if done > overlap and (done - overlap) % h == offsets[p]:
                theta[:, c] = landing.pop(p)
                x[:, c] = alpha * x[:, c] + (1 - alpha) * theta[:, c]
    return x


def ring() -> np.ndarray:
    return build_topology("ring", N).matrix()


def adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=ADAM_LR, betas=ADAM_BETAS, eps=ADAM_EPS,
                             weight_decay=ADAM_DECAY)


CASES: list[tuple[str, dict[str, Any]]] = [
    ("allreduce-sgd", {"mix": "allreduce"}),
    ("neighbor-sgd", {"mix": "neighbor"}),
    ("allreduce-adamw", {"mix": "allreduce", "inner": "adamw"}),
    ("neighbor-adamw-plain-momentum", {"mix": "neighbor", "inner": "adamw",
                                       "nesterov": False}),
]


@pytest.mark.slow
@pytest.mark.parametrize(("case", "options"), CASES, ids=[c[0] for c in CASES])
def test_iterates_match_the_recursion(cluster: Cluster, case: str,
                                      options: dict[str, Any]) -> None:
    options = dict(options)
    inner = options.pop("inner", "sgd")
    make_opt = adamw if inner == "adamw" else None
    got = train(cluster, "diloco", STEPS, make_opt=make_opt, local_steps=H, outer_lr=ETA,
                outer_momentum=MU, **options)
    want = simulate(ring(), adamw_updates() if inner == "adamw" else sgd_updates(),
                    mix=options["mix"], nesterov=options.get("nesterov", True))
    np.testing.assert_allclose(got, want, rtol=1e-7, atol=1e-10)
    if options["mix"] == "allreduce":  # right after an outer step the ranks hold one model
        synced = train(cluster, "diloco", STEPS - STEPS % H, make_opt=make_opt,
                       local_steps=H, outer_lr=ETA, outer_momentum=MU,
                       **options)
        np.testing.assert_allclose(synced, np.tile(synced[:1], (N, 1)), rtol=1e-12, atol=0)
        assert not np.allclose(got, np.tile(got[:1], (N, 1)))  # 3 local steps later: not


@pytest.mark.slow
@pytest.mark.parametrize(("mix", "compressor"), [("allreduce", "int8"), ("neighbor", "int8"),
                                                 ("allreduce", "int4")])
def test_quantized_with_error_feedback_or_public_copies_matches_the_recursion(
        cluster: Cluster, mix: str, compressor: str) -> None:
    got = train(cluster, "diloco", STEPS, local_steps=H, outer_lr=ETA, outer_momentum=MU,
                mix=mix, compressor=compressor, consensus_step=0.8)
    want = simulate(ring(), sgd_updates(), q=int8 if compressor == "int8" else int4, mix=mix,
                    consensus_step=0.8)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)


@pytest.mark.slow
def test_one_local_step_without_outer_momentum_is_dsgd(cluster: Cluster) -> None:
    got = train(cluster, "diloco", 12, local_steps=1, outer_lr=1.0, outer_momentum=0.0,
                mix="neighbor")
    np.testing.assert_allclose(got, train(cluster, "dsgd", 12),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_a_checkpoint_carries_the_outer_state(cluster: Cluster) -> None:
    # 23 steps in one go == 12 steps, state_dict through torch.save/load into a fresh optimizer
    # (and a fresh AdamW), 11 more: anchor, outer momentum, residuals and counters come back
    options: dict[str, Any] = {"local_steps": H, "mix": "allreduce", "compressor": "int8"}

    def run(cl: Client[torch.Tensor]) -> tuple[np.ndarray, np.ndarray, list[str]]:
        def fresh(tag: str, x0: torch.Tensor) -> tuple[torch.nn.Parameter, Any]:
            x = torch.nn.Parameter(x0.clone())
            return x, dt.DecentralizedOptimizer(adamw([x]), algorithm="diloco", client=cl,
                                                prefix=f"ck.{tag}", **options)

        def steps(x: torch.nn.Parameter, opt: Any, k: int) -> None:
            for _ in range(k):
                opt.zero_grad()
                loss(cl.rank, x).backward()
                opt.step()

        x, opt = fresh("whole", torch.tensor(X0[cl.rank]))
        steps(x, opt, STEPS)
        whole = x.detach().numpy().copy()
        x, opt = fresh("part", torch.tensor(X0[cl.rank]))
        steps(x, opt, 12)
        buf = io.BytesIO()
        torch.save({"x": x.detach().clone(), "opt": opt.state_dict()}, buf)
        buf.seek(0)
        saved = torch.load(buf, weights_only=False)
        y, resumed = fresh("part", saved["x"])
        resumed.load_state_dict(saved["opt"])
        steps(y, resumed, STEPS - 12)
        kept = sorted(resumed.algorithm_state[y])
        return whole, y.detach().numpy().copy(), kept

    for whole, resumed, kept in cluster.run(run, timeout=300):
        np.testing.assert_allclose(resumed, whole, rtol=1e-12, atol=1e-12)
        assert kept == ["anchor", "momentum", "residual"]


@pytest.mark.slow
def test_wrong_options_are_refused_with_what_is_wrong(cluster: Cluster) -> None:
    cl = cluster.clients[0]
    x = torch.nn.Parameter(torch.zeros(3))
    cases: list[tuple[dict[str, Any], str]] = [({"mix": "everyone"}, "mix must be one of"),
                           ({"local_steps": 0}, "local_steps must be >= 1"),
                           ({"outer_momentum": 1.0}, "0 <= outer_momentum < 1"),
                           ({"compressor": "zip"}, "unknown compressor 'zip'"),
                           ({"communication_interval": 4}, "its interval is local_steps"),
                           ({"mix": "neighbor", "compressor": "int8",
                             "topology": build_topology("exponential", N)}, "symmetric")]
    for options, words in cases:
        with pytest.raises(AlgorithmError, match=words):
            dt.DecentralizedOptimizer(torch.optim.SGD([x], lr=0.1), algorithm="diloco",
                                      client=cl, **options)


#: two parameters (the model's first 2 and last 3 coordinates): two fragments
SPLIT = (slice(0, 2), slice(2, None))
STREAMS: list[tuple[str, dict[str, Any]]] = [
    ("neighbor-overlap-1", {"mix": "neighbor", "overlap": 1}),
    ("allreduce-overlap-2-alpha-0.3", {"mix": "allreduce", "overlap": 2, "alpha": 0.3}),
    ("allreduce-int8-overlap-1", {"mix": "allreduce", "overlap": 1, "compressor": "int8"}),
    ("neighbor-int8-overlap-3", {"mix": "neighbor", "overlap": 3, "compressor": "int8",
                                 "consensus_step": 0.8}),
    ("neighbor-no-overlap", {"mix": "neighbor"}),
]


def train_split(c: Cluster, steps: int, **options: Any) -> np.ndarray:
    """Every rank's iterate after ``steps`` steps, its coordinates in two parameters."""
    def run(cl: Client[torch.Tensor]) -> np.ndarray:
        parts = [torch.nn.Parameter(torch.tensor(X0[cl.rank][cols])) for cols in SPLIT]
        opt = dt.DecentralizedOptimizer(torch.optim.SGD(parts, lr=LR), algorithm="diloco",
                                        client=cl, prefix="split", **options)
        for _ in range(steps):
            opt.zero_grad()
            loss(cl.rank, torch.cat(list[torch.Tensor](parts))).backward()
            opt.step()
        return torch.cat([p.detach() for p in parts]).numpy().copy()
    return np.stack(c.run(run, timeout=600))


@pytest.mark.slow
@pytest.mark.parametrize(("case", "options"), STREAMS, ids=[c[0] for c in STREAMS])
def test_streaming_fragments_match_the_recursion(cluster: Cluster, case: str,
                                                 options: dict[str, Any]) -> None:
    # H = 6, two fragments: the first syncs after steps 6, 12, ..., the second after 3, 9, ...;
    # each exchange lands `overlap` steps later, merged as alpha x + (1 - alpha) theta'
    got = train_split(cluster, 26, local_steps=6, fragments=2, outer_lr=ETA, outer_momentum=MU,
                      **options)
    overlap = options.get("overlap", 0)
    want = simulate(ring(), sgd_updates(), steps=26, h=6, fragments=SPLIT, overlap=overlap,
                    alpha=options.get("alpha", 0.5 if overlap else 0.0), mix=options["mix"],
                    q=int8 if options.get("compressor") else None,
                    consensus_step=options.get("consensus_step", 1.0))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)


def test_fragments_are_contiguous_and_about_equal() -> None:
    assert fragment_bounds([2, 3], 2) == [0, 1, 2]
    assert fragment_bounds([10, 100, 1, 1], 3) == [0, 1, 2, 4]
    assert fragment_bounds([1, 1, 100], 3) == [0, 1, 2, 3]
    assert fragment_bounds([5] * 8, 4) == [0, 2, 4, 6, 8]
    assert fragment_bounds([7, 1, 1, 1, 1, 1, 1, 1], 2) == [0, 1, 8]
    assert fragment_bounds([4], 1) == [0, 1]
