"""compressed_neighbor_allreduce through real daemons: the values, the bytes, the errors.

The expected ``Q(x)`` of each compressor is computed here from its definition in numpy (not with
``decentd.ops.gossip_compressors``); the bytes come from the daemons' per-peer counters.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from compressors import int4, int8, sign, topk
from conftest import ClusterFactory
from decent.core import DecentError
from decent_wire.v1 import decent_pb2 as pb

pytestmark = pytest.mark.slow

COMPRESSORS: dict[str, tuple[Any, dict[str, Any]]] = {
    "topk": (lambda v: topk(v, 0.25), {"ratio": 0.25}),
    "sign": (sign, {}),
    "int8": (int8, {}),
    "int4": (int4, {}),
}


def _inputs(n: int, size: int, dtype: np.dtype) -> list[np.ndarray]:
    rng = np.random.default_rng(size)
    return [rng.standard_normal(size).astype(dtype) * (r + 1) for r in range(n)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("compressor", sorted(COMPRESSORS))
def test_values_are_the_weighted_sum_of_the_compressed_tensors(
        cluster: ClusterFactory, compressor: str, dtype: type) -> None:
    n = 4
    c = cluster(n, "ring")
    xs = _inputs(n, 37, np.dtype(dtype))
    q, kwargs = COMPRESSORS[compressor]
    got = c.run(lambda cl: cl.compressed_neighbor_allreduce(
        torch.from_numpy(xs[cl.rank]), compressor, name=f"cq.{compressor}", **kwargs))
    qs = [q(x) for x in xs]
    for r in range(n):
        out = got[r].numpy()
        assert out.shape == (2, 37) and out.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(out[1], qs[r])  # what the neighbors decoded: exact
        left, right = (r - 1) % n, (r + 1) % n
        want = (qs[r] + qs[left] + qs[right]) / 3  # ring, uniform weights
        np.testing.assert_allclose(out[0], want, rtol=2e-6 if dtype == np.float32 else 1e-14)


def test_explicit_weights_and_16_bit_floats(cluster: ClusterFactory) -> None:
    c = cluster(4, "ring")

    def run(cl: Any) -> torch.Tensor:
        t = torch.arange(8, dtype=torch.float32).to(torch.bfloat16) * (cl.rank + 1)
        left = (cl.rank - 1) % 4
        return cl.compressed_neighbor_allreduce(t, "topk", ratio=0.5, name="cq.bf16",
                                                self_weight=0.5, src_weights={left: 0.5})

    got = c.run(run)
    for r in range(4):
        own = np.where(np.arange(8) >= 4, np.arange(8) * (r + 1), 0).astype(np.float32)
        theirs = np.where(np.arange(8) >= 4, np.arange(8) * ((r - 1) % 4 + 1), 0)
        assert got[r].dtype == torch.bfloat16 and got[r].shape == (2, 8)
        np.testing.assert_array_equal(got[r][1].float().numpy(), own)
        np.testing.assert_array_equal(got[r][0].float().numpy(),
                                      torch.tensor(0.5 * own + 0.5 * theirs)
                                      .to(torch.bfloat16).float().numpy())


def test_compression_shrinks_the_bytes_each_daemon_sends(cluster: ClusterFactory) -> None:
    n, size = 2, 1 << 20  # 4 MiB of float32
    c = cluster(n, "ring")
    raw = size * 4

    def sent(cl: Any) -> int:
        return sum(p.bytes_sent for p in cl.status().peers)

    def run(cl: Any) -> dict[str, int]:
        t = torch.from_numpy(_inputs(n, size, np.dtype(np.float32))[cl.rank])
        out = {}
        for label, call in (
            ("plain", lambda: cl.neighbor_allreduce(t, name="cb.plain")),
            ("topk", lambda: cl.compressed_neighbor_allreduce(t, "topk", ratio=0.01,
                                                              name="cb.topk")),
            ("sign", lambda: cl.compressed_neighbor_allreduce(t, "sign", name="cb.sign")),
            ("int8", lambda: cl.compressed_neighbor_allreduce(t, "int8", name="cb.int8")),
            ("int4", lambda: cl.compressed_neighbor_allreduce(t, "int4", name="cb.int4")),
        ):
            cl.barrier(name="cb")
            before = sent(cl)
            call()
            cl.barrier(name="cb")  # the peer has everything, barrier messages are tiny
            out[label] = sent(cl) - before
        return out

    for counts in c.run(run):
        assert raw <= counts["plain"] < raw + 4096
        payload = {"topk": int(np.ceil(0.01 * size)) * 8, "sign": size // 8, "int8": size,
                   "int4": size // 2}
        for name, want in payload.items():
            assert want <= counts[name] < want + 4096, (name, counts)
        assert counts["plain"] / counts["topk"] > 45
        assert counts["plain"] / counts["sign"] > 30
        assert counts["plain"] / counts["int8"] > 3.9
        assert counts["plain"] / counts["int4"] > 7.8


def test_different_compressors_fail_both_sides_and_the_daemons_go_on(
        cluster: ClusterFactory) -> None:
    c = cluster(2, "ring")
    t = torch.ones(16)

    def run(cl: Any) -> torch.Tensor:
        if cl.rank == 0:
            return cl.compressed_neighbor_allreduce(t, "topk", ratio=0.5, name="cm.w")
        return cl.compressed_neighbor_allreduce(t, "sign", name="cm.w")

    errors = c.run_catching(run)
    for e in errors:
        assert isinstance(e, DecentError) and e.code in (pb.MISMATCH, pb.ABORTED), e
        assert "cm.w" in str(e) and "topk(ratio=0.5)" in str(e) and "sign" in str(e), e
    got = c.run(lambda cl: cl.compressed_neighbor_allreduce(t * (cl.rank + 1), "sign",
                                                            name="cm.after"))
    for g in got:
        np.testing.assert_array_equal(g[0].numpy(), np.full(16, 1.5, np.float32))


def test_bad_arguments_name_the_tensor(cluster: ClusterFactory) -> None:
    c = cluster(2, "ring")
    cl = c.clients[0]
    with pytest.raises(ValueError, match=r"tensor 'cx.a': unknown compressor 'zip'; known: "
                                         r"int4, int8, sign, topk"):
        cl.compressed_neighbor_allreduce(torch.ones(4), "zip", name="cx.a")
    with pytest.raises(ValueError, match=r"tensor 'cx\.b': compressor 'topk' needs a ratio"):
        cl.compressed_neighbor_allreduce(torch.ones(4), "topk", name="cx.b")

    def run(cl: Any) -> Any:
        if cl.rank == 0:
            return cl.compressed_neighbor_allreduce(torch.ones(4, dtype=torch.int64), "int8",
                                                    name="cx.int")
        return cl.compressed_neighbor_allreduce(torch.ones(4), "topk", ratio=1.5, name="cx.r")

    first, second = c.run_catching(run)
    assert isinstance(first, DecentError) and first.code == pb.INVALID_ARGUMENT
    assert "'cx.int'" in str(first) and "floating-point tensors, not int64" in str(first)
    assert isinstance(second, DecentError) and second.code == pb.INVALID_ARGUMENT
    assert "'cx.r'" in str(second) and "0 < ratio <= 1, got 1.5" in str(second)
    got = c.run(lambda cl: cl.compressed_neighbor_allreduce(torch.ones(4), "int8",
                                                            name="cx.after"))
    assert all(bool((g == 1).all()) for g in got)
