"""Topology library: mixing matrices from the definitions."""

from __future__ import annotations

from pathlib import Path

import networkx as nx
import numpy as np
import pytest

from decent_wire.topology import TopologyError, build_topology, from_graph, kinds
from decentd.service.config import NodeConfig
from decentd.tools import ctl


@pytest.mark.parametrize("kind", ["ring", "exponential", "full", "star", "one-peer-exponential"])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_rows_are_stochastic(kind: str, n: int) -> None:
    topo = build_topology(kind, n)
    for step in range(topo.period):
        w = topo.matrix(step)
        np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=1e-15)
        assert (w >= 0).all()


def test_known_rho_values() -> None:
    # algorithms.md: exponential and hypercube at n=8 have rho 0.5; ring (w=1/3) 0.80
    assert build_topology("exponential", 8).rho() == pytest.approx(0.5, abs=1e-12)
    assert build_topology("hypercube", 8).rho() == pytest.approx(0.5, abs=1e-12)
    assert build_topology("ring", 8).rho() == pytest.approx((1 + 2 * np.cos(2 * np.pi / 8)) / 3)
    assert build_topology("full", 8).rho() == pytest.approx(0.0, abs=1e-12)


def test_one_peer_exponential_product_is_exact_average() -> None:
    topo = build_topology("one-peer-exponential", 16)
    assert topo.period == 4 and topo.dynamic
    prod = np.eye(16)
    for step in range(4):
        prod = topo.matrix(step) @ prod
    np.testing.assert_allclose(prod, np.full((16, 16), 1 / 16), atol=1e-15)
    s = topo.step(5, 2)
    assert s.in_neighbors == [1] and s.out_neighbors == [9] and s.self_weight == 0.5


def test_explicit_weights_override() -> None:
    topo = build_topology("ring", 4, weights={0: {0: 0.5, 1: 0.25, 3: 0.25}, 1: {0: 1.0}})
    w = topo.matrix()
    assert w[0].tolist() == [0.5, 0.25, 0.0, 0.25]
    assert w[1].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert topo.step(1).src_weights == {0: 1.0} and topo.step(1).self_weight == 0.0
    assert 1 not in topo.step(2).dst_ranks  # rank 1 no longer listens to 2


def test_errors_say_what_to_use() -> None:
    with pytest.raises(TopologyError, match=r"power-of-two.*use 'symmetric-exponential'"):
        build_topology("hypercube", 6)
    with pytest.raises(TopologyError, match="unknown topology 'torus3d'"):
        build_topology("torus3d", 4)
    with pytest.raises(TopologyError, match="outside"):
        build_topology("ring", 4, weights={0: {7: 1.0}})
    assert {"ring", "exponential", "hypercube", "full", "star",
            "one-peer-exponential"} <= set(kinds())


# ---------------------------------------------------------------- the library of issue 4

ALL_STATIC = ["ring", "exponential", "symmetric-exponential", "hypercube", "torus", "star",
              "full"]
DYNAMIC = ["one-peer-exponential", "shift-one", "random-matching", "wagma"]


def _valid(kind: str, n: int) -> bool:
    if kind in ("hypercube", "wagma"):
        return n & (n - 1) == 0
    return not (kind == "shift-one" and n % 2)


@pytest.mark.parametrize("kind", ALL_STATIC + DYNAMIC)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 8, 16])
def test_every_kind_is_doubly_stochastic_with_its_default_weights(kind: str, n: int) -> None:
    if not _valid(kind, n):
        with pytest.raises(TopologyError, match=r"use|power of two|power-of-two"):
            build_topology(kind, n)
        return
    topo = build_topology(kind, n)
    for step in list(topo.phases())[:40]:
        w = topo.matrix(step)
        assert (w >= 0).all()
        np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=0, atol=1e-12)
        if kind != "star" or n <= 2:
            np.testing.assert_allclose(w.sum(axis=0), 1.0, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("n", "want"), [(8, 0.50), (16, 0.60), (64, 1 - 2 / 7)])
def test_rho_of_exponential_and_hypercube(n: int, want: float) -> None:
    # algorithms.md: rho = 1 - 2/(1 + log2 n) for both
    assert build_topology("exponential", n).rho() == pytest.approx(want, abs=1e-12)
    assert build_topology("hypercube", n).rho() == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("n", [8, 16, 64])
def test_rho_of_ring_and_metropolis_star(n: int) -> None:
    assert build_topology("ring", n).rho() == pytest.approx((1 + 2 * np.cos(2 * np.pi / n)) / 3)
    star = build_topology("star", n, scheme="metropolis")
    w = star.matrix()
    assert w[0, 0] == pytest.approx(1 / n) and w[0, 1] == pytest.approx(1 / n)
    assert w[1, 1] == pytest.approx(1 - 1 / n)
    assert star.rho() == pytest.approx(1 - 1 / n, abs=1e-12)
    star.check(["doubly-stochastic", "symmetric"])


def test_symmetric_exponential_and_torus() -> None:
    se = build_topology("symmetric-exponential", 8)  # +-1, +-2, 4: five neighbors
    assert se.degree() == (5, 5)
    se.check(["doubly-stochastic", "symmetric"])
    t = build_topology("torus", 16)  # 4 x 4
    assert t.degree() == (4, 4)
    assert sorted(t.step(5).in_neighbors) == [1, 4, 6, 9]
    t.check(["doubly-stochastic", "symmetric"])
    assert sorted(build_topology("torus", 12, rows=3).step(0).in_neighbors) == [1, 3, 4, 8]
    with pytest.raises(TopologyError, match=r"5 rows do not divide 12.*\[1, 2, 3, 4, 6, 12\]"):
        build_topology("torus", 12, rows=5)


def test_shift_one_is_a_perfect_matching_meeting_every_peer_once() -> None:
    n = 8
    topo = build_topology("shift-one", n)
    assert topo.period == n // 2
    met: dict[int, set[int]] = {i: set() for i in range(n)}
    for step in range(topo.period):
        for i in range(n):
            s = topo.step(i, step)
            (j,) = s.in_neighbors
            assert s.out_neighbors == [j] and topo.step(j, step).in_neighbors == [i]
            assert s.self_weight == 0.5 and (j < n // 2) != (i < n // 2)
            met[i].add(j)
    assert all(len(peers) == n // 2 for peers in met.values())
    with pytest.raises(TopologyError, match=r"even number of ranks.*random-matching"):
        build_topology("shift-one", 5)


def test_random_matching_is_seeded_and_the_same_everywhere() -> None:
    a, b = build_topology("random-matching", 7, seed=3), build_topology("random-matching", 7,
                                                                        seed=3)
    other = build_topology("random-matching", 7, seed=4)
    assert all(np.array_equal(a.matrix(t), b.matrix(t)) for t in range(20))
    assert any(not np.array_equal(a.matrix(t), other.matrix(t)) for t in range(20))
    for t in range(20):
        w = a.matrix(t)
        assert sorted(np.diag(w).tolist()) == [0.5] * 6 + [1.0]  # one rank idles (n odd)
        np.testing.assert_array_equal(w, w.T)


@pytest.mark.parametrize(("n", "group", "phases"), [(64, 8, 2), (16, 8, 2), (8, 2, 3), (4, 8, 1)])
def test_wagma_groups_reach_the_global_average(n: int, group: int, phases: int) -> None:
    topo = build_topology("wagma", n, group_size=group)
    assert topo.period == phases
    prod = np.eye(n)
    for step in range(phases):
        prod = topo.matrix(step) @ prod
    np.testing.assert_allclose(prod, np.full((n, n), 1 / n), atol=1e-14)
    if n == 64:  # phase 0 varies bits 0-2, phase 1 bits 3-5
        assert sorted([5, *topo.step(5, 0).in_neighbors]) == list(range(8))
        assert sorted([5, *topo.step(5, 1).in_neighbors]) == [5 + 8 * k for k in range(8)]


def test_wagma_reference_mean() -> None:
    topo = build_topology("wagma", 16, group_size=4, mean="reference")
    s = topo.step(0, 0)
    assert s.self_weight == pytest.approx(2 / 5)
    assert s.src_weights == {1: pytest.approx(0.2), 2: pytest.approx(0.2), 3: pytest.approx(0.2)}
    with pytest.raises(TopologyError, match="group_size must be a power of two"):
        build_topology("wagma", 16, group_size=3)


def test_custom_edges_and_networkx_graphs() -> None:
    ring5 = build_topology("ring", 5).matrix()
    np.testing.assert_array_equal(from_graph(nx.cycle_graph(5)).matrix(), ring5)
    edges = [[i, (i + 1) % 5] for i in range(5)] + [[(i + 1) % 5, i] for i in range(5)]
    np.testing.assert_array_equal(build_topology("custom", 5, edges=edges).matrix(), ring5)
    weighted = build_topology("custom", 3, edges=[[1, 0, 0.25], [2, 0, 0.25], [0, 1, 1.0]],
                              self_weights={2: 1.0})
    assert weighted.matrix().tolist() == [[0.5, 0.25, 0.25], [1.0, 0.0, 0.0], [0, 0, 1.0]]
    with pytest.raises(TopologyError, match="every edge"):
        build_topology("custom", 3, edges=[[1, 0, 0.5], [0, 1]])
    with pytest.raises(TopologyError, match=r"edge \[0, 7\] needs two different ranks in 0..2"):
        build_topology("custom", 3, edges=[[0, 7]])
    with pytest.raises(TopologyError, match=r"nodes 0\.\.n-1"):
        from_graph(nx.path_graph([1, 2, 3]))


def test_checks_say_what_fails_and_what_to_use() -> None:
    with pytest.raises(TopologyError, match=r"DecentLaM needs a symmetric mixing matrix, but "
                       r"topology 'exponential' on 8 ranks .* is not: W\[0,1\] = 0 but "
                       r"W\[1,0\] = 0.25; "
                       r"use an undirected graph: 'hypercube'"):
        build_topology("exponential", 8).check(["symmetric"], "DecentLaM")
    build_topology("exponential", 8).check(["doubly-stochastic"], "D-SGD")
    build_topology("hypercube", 8).check(["doubly-stochastic", "symmetric"], "DecentLaM")
    with pytest.raises(TopologyError, match=r"doubly-stochastic mixing matrix, but topology "
                       r"'star' .* is not: column 0 sums to 1\.75"):
        build_topology("star", 4).check(["doubly-stochastic"], "D-SGD")
    with pytest.raises(TopologyError, match="not at step 0"):
        build_topology("one-peer-exponential", 8).check(["symmetric"], "EXTRA")
    with pytest.raises(TopologyError, match="Metropolis-Hastings weights need an undirected"):
        build_topology("exponential", 8, scheme="metropolis").matrix()
    with pytest.raises(TopologyError, match=r"has no option\(s\) \['rows'\]; it takes none"):
        build_topology("ring", 4, rows=2)


def test_node_yaml_describes_any_topology() -> None:
    cfg = NodeConfig.model_validate({"topology": {
        "kind": "custom", "edges": [[0, 1], [1, 0], [1, 2], [2, 1]], "scheme": "metropolis"}})
    w = cfg.topology.build(3).matrix()
    np.testing.assert_allclose(w, [[2 / 3, 1 / 3, 0], [1 / 3, 1 / 3, 1 / 3], [0, 1 / 3, 2 / 3]],
                               rtol=0, atol=1e-15)
    cfg = NodeConfig.model_validate({"topology": {"kind": "wagma",
                                                  "options": {"group_size": 4}}})
    assert cfg.topology.build(16).period == 2


def test_decentctl_topology_prints_and_draws(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "g.png"
    assert ctl.main(["topology", "exponential", "-n", "8", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "rho = 0.5000" in out and "degree: in 3, out 3" in out
    assert "symmetric: no (W[0,1] = 0 but W[1,0] = 0.25)" in out and "doubly-stochastic: yes" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert ctl.main(["topology", "torus", "-n", "12", "--option", "rows=5"]) == 2
    assert "5 rows do not divide 12" in capsys.readouterr().out


def test_decentctl_shows_a_node_yaml_edge_list(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    conf = tmp_path / "node.yaml"
    conf.write_text("peers: [10.0.0.1:7700, 10.0.0.2:7700, 10.0.0.3:7700]\n"
                    "topology:\n  kind: custom\n"
                    "  edges: [[0, 1, 0.5], [1, 0, 0.5], [1, 2, 0.25], [2, 1, 0.25]]\n")
    assert ctl.main(["topology", "--config", str(conf)]) == 0
    out = capsys.readouterr().out
    assert "custom, n=3" in out and "degree: in 2, out 2" in out  # rank 1 hears 0 and 2
    assert "[[0.5  0.5  0.  ]\n [0.5  0.25 0.25]\n [0.   0.25 0.75]]" in out
    assert "symmetric: yes" in out and "static: yes" in out
    conf.write_text("topology:\n  kind: custom\n  edges: [[0, 5]]\n")
    assert ctl.main(["topology", "--config", str(conf), "-n", "3"]) == 2
    assert "5" in capsys.readouterr().out
