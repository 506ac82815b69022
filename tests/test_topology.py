"""Topology library: mixing matrices from the definitions."""

from __future__ import annotations

import numpy as np
import pytest

from decentd.topology import TopologyError, build_topology, kinds


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
    with pytest.raises(TopologyError, match=r"power-of-two.*use 'exponential'"):
        build_topology("hypercube", 6)
    with pytest.raises(TopologyError, match="unknown topology 'torus3d'"):
        build_topology("torus3d", 4)
    with pytest.raises(TopologyError, match="outside"):
        build_topology("ring", 4, weights={0: {7: 1.0}})
    assert {"ring", "exponential", "hypercube", "full", "star",
            "one-peer-exponential"} <= set(kinds())
