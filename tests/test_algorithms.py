"""The decentralized algorithms through real daemons, against numpy runs of their recursions.

Heterogeneous least squares: worker i minimizes 0.5 ||A_i x - b_i||^2 with its own A_i, b_i and
full-batch gradients, through ``DecentralizedOptimizer`` around ``torch.optim.SGD`` on 8
daemons; the same recursion in numpy (``algorithms.md``) must give the same iterates.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

import decent.torch as dt
from cluster import Cluster
from compressors import int8, sign, topk
from decent.core import Client
from decent_wire.topology import Topology, build_topology

N, DIM, ROWS, STEPS = 8, 5, 12, 100
LR, BETA = 0.05, 0.5


def _problem() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    a = rng.normal(size=(N, ROWS, DIM)) / np.sqrt(ROWS)
    b = rng.normal(size=(N, ROWS)) + np.arange(N)[:, None]  # heterogeneous optima
    return a, b


A, B = _problem()
X0 = np.random.default_rng(2).normal(size=(N, DIM))


def grads(x: np.ndarray) -> np.ndarray:
    """Every worker's full-batch gradient, row i at x[i]."""
    return np.einsum("nrd,nr->nd", A, np.einsum("nrd,nd->nr", A, x) - B)


def simulate(name: str, w: np.ndarray, steps: int = STEPS, lr: float = LR, beta: float = BETA,
             x0: np.ndarray = X0, **opt: Any) -> np.ndarray:
    """The numpy recursion of ``name`` (SGD local step: d = lr * grad)."""
    x = x0.copy()
    mean = np.full((N, N), 1.0 / N)
    m: Any = None
    y: Any = None
    prev_x: Any = None
    prev_wx: Any = None
    prev_d: Any = None
    psi: Any = None
    xhat: Any = None
    s_pub: Any = None
    for k in range(steps):
        d = lr * grads(x)
        if name == "dmsgd":
            m = d / lr if m is None else beta * m + d / lr
            x = w @ (x - lr * m)
        elif name == "dsgd":
            x = w @ (x - d)
        elif name == "dsgd-cta":
            x = w @ x - d
        elif name == "allreduce":
            x = mean @ (x - d)
        elif name == "pga":
            x = (mean if (k + 1) % opt["period"] == 0 else w) @ (x - d)
        elif name == "gradient-tracking":
            y = d if y is None else w @ y + d - prev_d
            x, prev_d = w @ x - y, d
        elif name == "extra":
            wx = w @ x
            new = wx - d if prev_x is None else x + wx - (prev_x + prev_wx) / 2 - d + prev_d
            prev_x, prev_wx, prev_d, x = x, wx, d, new
        elif name in ("exact-diffusion", "d2"):
            new_psi = x - d
            phi = new_psi if psi is None else new_psi + x - psi
            psi = new_psi
            x = (phi + w @ phi) / 2 if name == "exact-diffusion" else w @ phi
        elif name == "choco":
            if xhat is None:
                xhat, s_pub = np.zeros_like(x), np.zeros_like(x)
            half = x - d
            q = np.stack([opt["q"](v) for v in half - xhat])
            xhat, s_pub = xhat + q, s_pub + w @ q
            x = half + opt["consensus_step"] * (s_pub - xhat)
        elif name == "decentlam":
            g = x - w @ (x - d)
            m = g if m is None else beta * m + g
            x = x - m
        else:
            raise AssertionError(name)
    return x


@pytest.fixture(scope="module", params=["ring", "hypercube"])
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    c = Cluster(N, request.param)
    try:
        c.connect()
        yield c
    finally:
        assert c.stop() == [0] * N


#: the algorithms whose update is x' = M (x - d), and CTA D-SGD (x' = W x - d with W x taken
#: from the parameters while the gradient is computed): the optimizer flattens their parameters
IN_PLACE = {"dsgd", "dmsgd", "allreduce", "pga", "dsgd-cta"}


def _train(c: Cluster, algorithm: str, make_sgd: Callable[[list[torch.Tensor]], Any],
           steps: int = STEPS, x0: np.ndarray = X0, **options: Any) -> np.ndarray:
    def run(cl: Client[torch.Tensor]) -> np.ndarray:
        r = cl.rank
        x = torch.nn.Parameter(torch.tensor(x0[r]))
        a, b = torch.tensor(A[r]), torch.tensor(B[r])
        opt = dt.DecentralizedOptimizer(make_sgd([x]), algorithm=algorithm, client=cl,
                                        prefix=f"ls.{algorithm}", **options)
        # the path under test: flat buffers averaged in place, or the general finish()
        assert opt.flattened == (algorithm in IN_PLACE and options.get("flatten", True))
        for _ in range(steps):
            opt.zero_grad()
            (0.5 * ((a @ x - b) ** 2).sum()).backward()
            opt.step()
        return x.detach().numpy().copy()
    return np.stack(c.run(run, timeout=600))


def _sgd(params: list[torch.Tensor], lr: float = LR) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=lr)


XSTAR = np.linalg.solve(np.einsum("nrd,nre->de", A, A), np.einsum("nrd,nr->d", A, B))
#: the lazy ring (1/2 self, 1/4 each neighbor): lambda_min(W) = 0 > -1/3, so D2 may run on it
LAZY: Topology = build_topology("ring", N, weights={
    i: {i: 0.5, (i - 1) % N: 0.25, (i + 1) % N: 0.25} for i in range(N)})


CASES: list[tuple[str, dict[str, Any]]] = [
    ("dsgd", {}), ("dsgd-cta", {}), ("allreduce", {}), ("pga", {"period": 4}),
    ("gradient-tracking", {}), ("extra", {}), ("exact-diffusion", {}),
    ("decentlam", {"beta": BETA}),
]


@pytest.mark.slow
@pytest.mark.parametrize(("algorithm", "options"), CASES, ids=[c[0] for c in CASES])
def test_iterates_match_the_numpy_recursion(cluster: Cluster, algorithm: str,
                                            options: dict[str, Any]) -> None:
    kind = cluster.clients[0].topology.kind
    w = build_topology(kind, N).matrix()
    got = _train(cluster, algorithm, _sgd, **options)
    want = simulate(algorithm, w, **options)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize(("algorithm", "options"),
                         [c for c in CASES if c[0] in IN_PLACE],
                         ids=[c[0] for c in CASES if c[0] in IN_PLACE])
def test_adapt_then_combine_without_flattening_gives_the_same_iterates(
        cluster: Cluster, algorithm: str, options: dict[str, Any]) -> None:
    w = build_topology(cluster.clients[0].topology.kind, N).matrix()
    got = _train(cluster, algorithm, _sgd, flatten=False, **options)
    np.testing.assert_allclose(got, simulate(algorithm, w, **options), rtol=1e-6, atol=1e-9)


@pytest.mark.slow
def test_flattened_parameters_are_averaged_in_place_in_shared_memory(cluster: Cluster) -> None:
    # mixed dtypes, an empty parameter, one large enough to be registered with the daemon; and
    # a transposed (non-contiguous) parameter, which keeps the general path
    w = build_topology(cluster.clients[0].topology.kind, N).matrix()
    shapes = [((200, 100), torch.float32), ((100,), torch.float32), ((17,), torch.float64),
              ((0,), torch.float32), ((3, 4), torch.float64)]

    def run(cl: Client[torch.Tensor]) -> dict[str, Any]:
        r = cl.rank
        params: list[torch.Tensor] = [torch.nn.Parameter(torch.full(s, float(r), dtype=t))
                                      for s, t in shapes]
        ids = [id(p) for p in params]
        opt = dt.DecentralizedOptimizer(_sgd(params, lr=0.5), algorithm="dsgd", client=cl,
                                        prefix="flat")
        moved = [torch.equal(p.detach(), torch.full(s, float(r), dtype=t))
                 for p, (s, t) in zip(params, shapes, strict=True)]
        bound = [id(p) for p in opt.param_groups[0]["params"]] == ids
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        # wrapped again (a new optimizer on the same model): the buffers stay where they are
        again = dt.DecentralizedOptimizer(_sgd(params, lr=0.5), algorithm="dsgd", client=cl,
                                          prefix="flat.again")
        kept = again.flattened and [f.data_ptr() for f in again.flat_buffers] == \
            [f.data_ptr() for f in opt.flat_buffers]
        odd = torch.nn.Parameter(torch.full((4, 3), float(r)).t())  # a view over (4, 3)
        other = dt.DecentralizedOptimizer(_sgd([odd], lr=0.5), algorithm="dsgd", client=cl,
                                          prefix="flat.odd")
        odd.grad = torch.ones_like(odd)
        other.step()
        return {"flattened": opt.flattened, "flats": [(f.dtype, f.numel(), f.is_shared())
                                                       for f in opt.flat_buffers],
                "moved": moved, "bound": bound, "kept": kept,
                "shared": [p.is_shared() for p in params],
                "registered": cl.regions.nbytes, "values": [p.detach().clone() for p in params],
                "odd": (other.flattened, odd.detach().clone())}

    out = cluster.run(run)
    want = w @ (np.arange(N, dtype=np.float64) - 0.5)
    for r, o in enumerate(out):
        assert o["flattened"] and all(o["moved"]) and o["bound"] and all(o["shared"])
        assert o["kept"]
        assert o["flats"] == [(torch.float32, 20100, True), (torch.float64, 29, True)]
        assert o["registered"] >= 200 * 100 * 4  # averaged where it lies, never copied
        for got, (s, t) in zip(o["values"], shapes, strict=True):
            assert got.shape == s and got.dtype == t
            np.testing.assert_allclose(got.numpy(), np.full(s, want[r]),
                                       rtol=1e-6 if t == torch.float32 else 1e-13)
        flat_odd, odd = o["odd"]
        assert not flat_odd and odd.shape == (3, 4)
        np.testing.assert_allclose(odd.numpy(), np.full((3, 4), want[r]), rtol=1e-6)


@pytest.mark.slow
def test_the_flat_layout_follows_the_parameters(cluster: Cluster) -> None:
    # communication every 2nd step; a param group added, then the model made float64, between
    # steps: each step averages what the parameters are now. Tied or already-shared parameters
    # are not moved (the general path).
    w = build_topology(cluster.clients[0].topology.kind, N).matrix()

    def sgd_step(opt: dt.DecentralizedOptimizer, params: list[torch.Tensor]) -> None:
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()

    def run(cl: Client[torch.Tensor]) -> dict[str, Any]:
        r = float(cl.rank)
        a = torch.nn.Parameter(torch.full((300, 100), r))
        e = torch.nn.Parameter(torch.zeros(0))
        b = torch.nn.Parameter(torch.full((5,), r))
        opt = dt.DecentralizedOptimizer(_sgd([a, e, b], lr=0.5), algorithm="dsgd", client=cl,
                                        prefix="lay", communication_interval=2)
        sgd_step(opt, [a, b])  # local only
        local = (a[0, 0].item(), b[0].item())
        c = torch.nn.Parameter(torch.full((7,), r))
        opt.add_param_group({"params": [c]})
        sgd_step(opt, [a, b, c])  # averaged, c included
        after_group = [(f.dtype, f.numel()) for f in opt.flat_buffers]
        two = (a[0, 0].item(), b[0].item(), c[0].item())
        for p in (a, e, b, c):  # what model.double() does to each parameter
            p.data = p.data.double()
        sgd_step(opt, [a, b, c])
        third = [f.data_ptr() for f in opt.flat_buffers]
        sgd_step(opt, [a, b, c])
        stayed = [f.data_ptr() for f in opt.flat_buffers] == third  # nothing changed: no re-layout
        after_double = [(f.dtype, f.numel()) for f in opt.flat_buffers]
        four = (a.detach().clone(), b.detach().clone(), c.detach().clone())
        opt.add_param_group({"params": [torch.nn.Parameter(a.data)]})  # tied to a, in our buffer
        sgd_step(opt, [a])
        tied_in_ours = (opt.flattened, opt.param_groups[-1]["params"][0].data_ptr() == a.data_ptr())
        tied = torch.nn.Parameter(torch.full((4,), r))
        twin = torch.nn.Parameter(tied.data)  # one storage, two parameters
        shared: list[torch.Tensor] = [torch.nn.Parameter(torch.full((3,), r).share_memory_())
                                      for _ in range(2)]
        where = [p.data_ptr() for p in shared]
        others = [dt.DecentralizedOptimizer(_sgd(ps, lr=0.5), algorithm="dsgd", client=cl,
                                            prefix=f"lay.{i}")
                  for i, ps in enumerate((list[torch.Tensor]([tied, twin]), shared))]
        sgd_step(others[1], shared)
        return {"local": local, "two": two, "four": four, "after_group": after_group,
                "stayed": stayed, "tied_in_ours": tied_in_ours,
                "after_double": after_double, "flat": [o.flattened for o in others],
                "kept": [p.data_ptr() for p in shared] == where,
                "same_tie": tied.data_ptr() == twin.data_ptr(),
                "shared": [p.detach().clone() for p in shared]}

    out = cluster.run(run)
    ranks = np.arange(N, dtype=np.float64)
    two_ab, two_c = w @ (ranks - 1.0), w @ (ranks - 0.5)
    for r, o in enumerate(out):
        assert o["local"] == (r - 0.5, r - 0.5)
        np.testing.assert_allclose(o["two"], [two_ab[r], two_ab[r], two_c[r]], rtol=1e-6)
        assert o["after_group"] == [(torch.float32, 30000 + 5 + 7)]
        assert o["after_double"] == [(torch.float64, 30000 + 5 + 7)] and o["stayed"]
        assert o["tied_in_ours"] == (False, True)  # the general path keeps the tie
        a, b, c = o["four"]
        assert a.dtype == b.dtype == c.dtype == torch.float64
        for got, want in ((a, w @ (two_ab - 1.0)), (b, w @ (two_ab - 1.0)),
                          (c, w @ (two_c - 1.0))):
            np.testing.assert_allclose(got.numpy(), np.full(got.shape, want[r]), rtol=1e-6)
        assert o["flat"] == [False, False] and o["kept"] and o["same_tie"]
        for got in o["shared"]:
            np.testing.assert_allclose(got.numpy(), np.full(3, (w @ (ranks - 0.5))[r]),
                                       rtol=1e-6)


@pytest.mark.slow
def test_dmsgd_is_dsgd_around_a_momentum_optimizer(cluster: Cluster) -> None:
    w = build_topology(cluster.clients[0].topology.kind, N).matrix()
    got = _train(cluster, "dmsgd",
                 lambda ps: torch.optim.SGD(ps, lr=LR, momentum=BETA))
    np.testing.assert_allclose(got, simulate("dmsgd", w), rtol=1e-6, atol=1e-9)


@pytest.mark.slow
def test_own_topology_with_explicit_weights_runs_d2(cluster: Cluster) -> None:
    # D2 needs lambda_min(W) > -1/3: ring 8 and hypercube 8 with uniform weights are refused;
    # the lazy ring (1/2 self, 1/4 each neighbor) is fine, and the optimizer passes its weights
    # with every exchange whatever the daemons' topology
    lazy = LAZY
    with pytest.raises(dt.AlgorithmError, match=r"lambda_min\(W\) > -1/3.*exact-diffusion"):
        dt.DecentralizedOptimizer(_sgd([torch.nn.Parameter(torch.zeros(1))]), algorithm="d2",
                                  client=cluster.clients[0], topology="ring")
    got = _train(cluster, "d2", _sgd, topology=lazy)
    np.testing.assert_allclose(got, simulate("d2", lazy.matrix()), rtol=1e-6, atol=1e-9)


CHOCO: list[tuple[str, dict[str, Any], Callable[[np.ndarray], np.ndarray]]] = [
    ("topk", {"ratio": 0.4, "consensus_step": 0.3}, lambda v: topk(v, 0.4)),
    ("sign", {"consensus_step": 0.2}, sign),
    ("int8", {"consensus_step": 0.8}, int8),
]


@pytest.mark.slow
@pytest.mark.parametrize(("compressor", "options", "q"), CHOCO, ids=[c[0] for c in CHOCO])
def test_choco_matches_its_recursion_with_each_compressor(
        cluster: Cluster, compressor: str, options: dict[str, Any],
        q: Callable[[np.ndarray], np.ndarray]) -> None:
    w = build_topology(cluster.clients[0].topology.kind, N).matrix()
    got = _train(cluster, "choco", _sgd, compressor=compressor, **options)
    want = simulate("choco", w, q=q, consensus_step=options["consensus_step"])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)


@pytest.mark.slow
def test_choco_uncompressed_with_full_step_is_dsgd(cluster: Cluster) -> None:
    w = build_topology(cluster.clients[0].topology.kind, N).matrix()
    got = _train(cluster, "choco", _sgd, steps=50, compressor="topk", ratio=1.0,
                 consensus_step=1.0)
    np.testing.assert_allclose(got, simulate("dsgd", w, steps=50), rtol=1e-9, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize(("algorithm", "options"), [
    ("gradient-tracking", {}), ("extra", {}), ("decentlam", {"beta": BETA}),
    ("choco", {"compressor": "topk", "ratio": 0.4, "consensus_step": 0.3})])
def test_a_checkpoint_resumes_the_same_iterates(cluster: Cluster, algorithm: str,
                                                options: dict[str, Any]) -> None:
    # 20 steps in one go == 10 steps, state_dict through torch.save/load into a fresh
    # optimizer, 10 more: trackers, previous iterates, public copies and counters come back
    def run(cl: Client[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
        r = cl.rank
        a, b = torch.tensor(A[r]), torch.tensor(B[r])

        def steps(x: torch.nn.Parameter, opt: dt.DecentralizedOptimizer, k: int) -> None:
            for _ in range(k):
                opt.zero_grad()
                (0.5 * ((a @ x - b) ** 2).sum()).backward()
                opt.step()

        def fresh(tag: str) -> tuple[torch.nn.Parameter, dt.DecentralizedOptimizer]:
            x = torch.nn.Parameter(torch.tensor(X0[r]))
            return x, dt.DecentralizedOptimizer(_sgd([x]), algorithm=algorithm, client=cl,
                                                prefix=f"ck.{algorithm}.{tag}", **options)

        x, opt = fresh("whole")
        steps(x, opt, 20)
        whole = x.detach().numpy().copy()
        x, opt = fresh("part")
        steps(x, opt, 10)
        buf = io.BytesIO()
        torch.save({"x": x.detach().clone(), "opt": opt.state_dict()}, buf)
        buf.seek(0)
        saved = torch.load(buf, weights_only=False)
        y = torch.nn.Parameter(saved["x"])
        resumed = dt.DecentralizedOptimizer(_sgd([y]), algorithm=algorithm, client=cl,
                                            prefix=f"ck.{algorithm}.part", **options)
        resumed.load_state_dict(saved["opt"])
        assert resumed.algorithm.iteration == 10
        steps(y, resumed, 10)
        return whole, y.detach().numpy().copy()

    for whole, resumed in cluster.run(run, timeout=300):
        np.testing.assert_allclose(resumed, whole, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_symmetric_algorithms_refuse_a_directed_graph(cluster: Cluster) -> None:
    cl = cluster.clients[0]
    for name in ("decentlam", "extra", "exact-diffusion"):
        with pytest.raises(dt.AlgorithmError, match=r"needs a symmetric mixing matrix.*"
                                                    r"'exponential'.*use an undirected graph"):
            dt.DecentralizedOptimizer(_sgd([torch.nn.Parameter(torch.zeros(1))]),
                                      algorithm=name, client=cl, topology="exponential")
    with pytest.raises(dt.AlgorithmError, match=r"'choco' needs a static mixing matrix.*"
                                                r"'random-matching'.*changes from step"):
        dt.DecentralizedOptimizer(_sgd([torch.nn.Parameter(torch.zeros(1))]),
                                  algorithm="choco", client=cl, topology="random-matching")
    with pytest.raises(dt.AlgorithmError, match="choco: unknown compressor 'zip'"):
        dt.DecentralizedOptimizer(_sgd([torch.nn.Parameter(torch.zeros(1))]),
                                  algorithm="choco", client=cl, compressor="zip")
    with pytest.raises(dt.AlgorithmError, match="without momentum"):
        dt.DecentralizedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1,
                                                  momentum=0.9), algorithm="decentlam", client=cl)
    with pytest.raises(dt.AlgorithmError, match="unknown algorithm 'adam-gossip'; known:"):
        dt.DecentralizedOptimizer(_sgd([torch.nn.Parameter(torch.zeros(1))]),
                                  algorithm="adam-gossip", client=cl)
    with pytest.raises(dt.AlgorithmError, match=r"has no option\(s\) \['period'\]"):
        dt.DecentralizedOptimizer(_sgd([torch.nn.Parameter(torch.zeros(1))]), algorithm="dsgd",
                                  client=cl, period=3)


#: (learning rate, steps) that bring each exact algorithm to x* within float64 rounding (found
#: with the numpy recursion: the error then stays at 1e-15..1e-14 of |x*|)
EXACT: dict[str, dict[str, tuple[float, int]]] = {
    "ring": {"gradient-tracking": (0.1, 600), "extra": (0.3, 300),
             "exact-diffusion": (0.3, 300), "d2": (0.3, 300)},
    "hypercube": {"gradient-tracking": (0.08, 900), "extra": (0.3, 300),
                  "exact-diffusion": (0.25, 300), "d2": (0.3, 300)},
}


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["gradient-tracking", "extra", "exact-diffusion", "d2"])
# one topology through the daemons (300-600 steps each): on the hypercube the iterates equal the
# recursion's (test_iterates_match_the_numpy_recursion), which reaches x* (the simulation below)
@pytest.mark.parametrize("cluster", ["ring"], indirect=True)
def test_exact_algorithms_reach_the_optimum_through_the_daemons(cluster: Cluster,
                                                                 algorithm: str) -> None:
    lr, steps = EXACT[cluster.clients[0].topology.kind][algorithm]
    options: dict[str, Any] = {"topology": LAZY} if algorithm == "d2" else {}
    got = _train(cluster, algorithm, lambda ps: _sgd(ps, lr), steps=steps, **options)
    err = np.abs(got - XSTAR).max() / np.abs(XSTAR).max()
    assert err < 1e-12, err


@pytest.mark.slow
@pytest.mark.parametrize("cluster", ["hypercube"], indirect=True)
def test_momentum_bias_dmsgd_against_dsgd_and_decentlam(cluster: Cluster) -> None:
    # from consensus at x*, small steps: each method settles at its fixed point. DmSGD's
    # sum_i ||x_i - x*||^2 approaches 1/(1-beta)^2 = 4 times D-SGD's as the step shrinks (3.76 on
    # the ring, 3.94 on the hypercube at lr 0.01); DecentLaM has D-SGD's fixed point. One
    # topology only, through 8 daemons for the first 150 steps of the three (they follow the
    # recursion), and the recursion on to 500 steps for the fixed points; the numpy-only test
    # below covers both topologies
    lr, beta, steps, settled = 0.01, 0.5, 150, 500
    w = build_topology(cluster.clients[0].topology.kind, N).matrix()
    start = np.tile(XSTAR, (N, 1))
    runs = {
        "dsgd": _train(cluster, "dsgd", lambda ps: _sgd(ps, lr), steps=steps, x0=start),
        "dmsgd": _train(cluster, "dmsgd", lambda ps: torch.optim.SGD(ps, lr=lr, momentum=beta),
                        steps=steps, x0=start),
        "decentlam": _train(cluster, "decentlam", lambda ps: _sgd(ps, lr), steps=steps,
                            x0=start, beta=beta),
    }
    for name, got in runs.items():
        want = simulate(name, w, steps=steps, lr=lr, beta=beta, x0=start)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)
    ends = {name: simulate(name, w, steps=settled, lr=lr, beta=beta, x0=start) for name in runs}
    err = {name: float(((got - XSTAR) ** 2).sum()) for name, got in ends.items()}
    assert err["dsgd"] > 1e-3  # D-SGD is biased: there is something to compare
    assert abs(err["dmsgd"] / err["dsgd"] / (1 / (1 - beta) ** 2) - 1) < 0.1, err
    assert abs(err["decentlam"] / err["dsgd"] - 1) < 0.01, err


def test_exact_algorithms_reach_the_optimum_in_the_simulation() -> None:
    # the recursions checked above: gradient tracking, EXTRA and exact diffusion converge to
    # x* = argmin sum_i f_i exactly; D-SGD keeps a bias
    xstar = np.linalg.solve(np.einsum("nrd,nre->de", A, A), np.einsum("nrd,nr->d", A, B))
    scale = np.abs(xstar).max()
    for kind, exact in EXACT.items():  # at the daemon test's step sizes and step counts
        for name in ("gradient-tracking", "extra", "exact-diffusion"):
            lr, steps = exact[name]
            err = np.abs(simulate(name, build_topology(kind, N).matrix(), steps=steps, lr=lr)
                         - xstar).max()
            assert err < 1e-11 * scale, (kind, name, err)  # float64 rounding, accumulated
    w = build_topology("ring", N).matrix()
    assert np.abs(simulate("dsgd", w, steps=2000) - xstar).max() > 1e-2 * scale
    # DmSGD's limit is D-SGD's with step lr/(1-beta) (algorithms.md), DecentLaM's D-SGD's
    dmsgd = simulate("dmsgd", w, steps=3000, lr=0.02, beta=0.5)
    np.testing.assert_allclose(dmsgd, simulate("dsgd", w, steps=3000, lr=0.04),
                               rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(simulate("decentlam", w, steps=3000, lr=0.02, beta=0.5),
                               simulate("dsgd", w, steps=3000, lr=0.02), rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_helpers_broadcast_state_and_consensus() -> None:
    c = Cluster(3, "ring")
    try:
        c.connect()

        def run(cl: Client[torch.Tensor]) -> tuple[Any, ...]:
            torch.manual_seed(cl.rank)
            model = torch.nn.Linear(4, 2)
            before = dt.consensus(model.parameters(), client=cl)
            dt.broadcast_parameters(model.state_dict(), root=1, client=cl)
            after = dt.consensus(model.parameters(), client=cl)
            opt = dt.DecentralizedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
                algorithm="dsgd", client=cl, prefix="helpers", communication_interval=10)
            for _ in range(cl.rank + 1):  # local steps only: different momentum and counters
                opt.zero_grad()
                model(torch.ones(3, 4) * (cl.rank + 1)).sum().backward()
                opt.step()
            dt.broadcast_optimizer_state(opt, root=2, client=cl)
            bufs = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
            return before, after, bufs, opt.algorithm.iteration, opt.state_dict()["decent"]

        out = c.run(run)
        assert all(o[0] > 1e-3 for o in out)  # three different random models
        assert all(o[1] < 1e-12 for o in out), [o[1] for o in out]  # one model (up to the
        # rounding of a float32 average of equal values)
        for before, _, bufs, iteration, counters in out:
            assert before == out[0][0]  # every rank computes the same distance
            assert iteration == 3 and counters["iteration"] == 3
            for got, want in zip(bufs, out[2][2], strict=True):
                assert torch.equal(got, want)
    finally:
        assert c.stop() == [0, 0, 0]
