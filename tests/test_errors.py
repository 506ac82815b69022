"""Bad input fails that request with a clear error; nothing else breaks."""

from __future__ import annotations

import pytest
import torch

from cluster import Cluster
from conftest import ClusterFactory
from decent.core import DecentError

pytestmark = pytest.mark.slow


def test_dtype_mismatch_fails_on_both_sides(cluster: ClusterFactory) -> None:
    c = cluster(4, "ring")

    def work(cl):  # type: ignore[no-untyped-def]
        dtype = torch.float32 if cl.rank < 2 else torch.float64
        return cl.neighbor_allreduce(torch.ones(3, dtype=dtype), name="badtype", timeout=20)

    errors = c.run_catching(work)
    for i, err in enumerate(errors):
        assert isinstance(err, DecentError), (i, err)
        assert err.code_name == "MISMATCH", (i, err)
        assert "'badtype'" in err.message and "float32[3]" in err.message
        assert "float64[3]" in err.message and "rank" in err.message
    # the cluster is fine afterwards
    got = c.run(lambda cl: cl.neighbor_allreduce(torch.full((2,), 3.0 * cl.rank), name="after"))
    assert torch.equal(got[0], torch.full((2,), 4.0))  # (9 + 0 + 3) / 3


def test_shape_mismatch_names_tensor_ranks_and_shapes(cluster: ClusterFactory) -> None:
    c = cluster(2, "ring")

    def work(cl):  # type: ignore[no-untyped-def]
        shape = (4, 2) if cl.rank == 0 else (2, 4)
        return cl.neighbor_allreduce(torch.zeros(shape), name="badshape", timeout=20)

    e0, e1 = c.run_catching(work)
    for err in (e0, e1):
        assert isinstance(err, DecentError) and err.code_name == "MISMATCH"
        assert "'badshape'" in err.message
        assert "float32[4, 2]" in err.message and "float32[2, 4]" in err.message
        assert "rank 0" in err.message and "rank 1" in err.message


def test_allreduce_shape_mismatch_fails_everyone(cluster: ClusterFactory) -> None:
    c = cluster(4, "ring")
    for numel in (8, 100_000):  # direct and ring
        def work(cl, m=numel):  # type: ignore[no-untyped-def]
            return cl.allreduce(torch.zeros(m + (cl.rank == 3)), name=f"arbad{m}", timeout=20)

        for err in c.run_catching(work):
            assert isinstance(err, DecentError) and err.code_name == "MISMATCH", err
            assert f"arbad{numel}" in err.message and "rank 3" in err.message


def test_op_kind_mismatch(cluster: ClusterFactory) -> None:
    c = cluster(2, "ring")

    def work(cl):  # type: ignore[no-untyped-def]
        t = torch.zeros(3)
        if cl.rank == 0:
            return cl.allreduce(t, name="kind", timeout=20)
        return cl.broadcast(t, root=1, name="kind", timeout=20)

    for err in c.run_catching(work):
        assert isinstance(err, DecentError) and err.code_name == "MISMATCH"
        assert "allreduce" in err.message and "broadcast" in err.message


def test_invalid_requests_fail_only_that_request(cluster: ClusterFactory) -> None:
    c = cluster(4, "ring")
    cl = c.clients[0]
    with pytest.raises(DecentError, match="self_weight") as info:
        cl.neighbor_allreduce(torch.zeros(2), name="bad1", src_weights={1: 0.5})
    assert info.value.code_name == "INVALID_ARGUMENT"
    with pytest.raises(DecentError, match=r"rank\(s\) \[2\]"):
        cl.neighbor_allreduce(torch.zeros(2), name="bad2", self_weight=0.5, src_weights={2: 0.5})
    with pytest.raises(DecentError, match="names rank 9"):
        cl.neighbor_allreduce(torch.zeros(2), name="bad3", self_weight=0.5, src_weights={9: 0.5},
                              dst_weights=[1])
    with pytest.raises(DecentError, match="root 7"):
        cl.broadcast(torch.zeros(2), root=7, name="bad4")
    with pytest.raises(TypeError, match=r"'cplx'.*complex64"):
        cl.neighbor_allreduce(torch.zeros(2, dtype=torch.complex64), name="cplx")
    with pytest.raises(DecentError, match="arena") as big:
        cl.neighbor_allreduce(torch.zeros(cl.arena.nbytes // 4 + 1), name="huge")
    assert big.value.code_name == "ARENA_ERROR"
    # everyone still works
    got = c.run(lambda x: x.allreduce(torch.ones(2) * x.rank, name="stillok"))
    assert torch.equal(got[3], torch.full((2,), 1.5))


def test_send_without_matching_receive_times_out() -> None:
    c = Cluster(2, "ring")
    try:
        c.connect()
        cl = c.clients[0]
        with pytest.raises(DecentError) as info:
            cl.neighbor_allreduce(torch.zeros(4), name="lonely", self_weight=1.0, src_weights={},
                                  dst_weights=[1], timeout=2)
        assert info.value.code_name == "TIMEOUT"
        assert "timed out after 2s on rank 0" in info.value.message  # its own timeout
        assert "'lonely'" in info.value.message
        assert "rank(s) [1] to match the tensor sent to them" in info.value.message
    finally:
        assert c.stop() == [0, 0]


def test_stall_warning_names_missing_rank() -> None:
    # no per-call timeout: the config's default op timeout applies
    c = Cluster(3, "ring", "--set", "timeouts.stall_warning=0.5", "--set", "timeouts.op=3")
    try:
        c.connect()
        h = c.clients[0].neighbor_allreduce_async(torch.zeros(2), name="stalled")
        c.clients[1].neighbor_allreduce_async(torch.zeros(2), name="stalled")
        with pytest.raises(DecentError, match=r"timed out after 3s.*rank\(s\) \[2\]"):
            h.wait()
        log = c.log(0)
        assert "stall: neighbor_allreduce 'stalled' round 0" in log
        assert "still waiting for rank(s) [2] to send their tensor" in log
    finally:
        c.stop()
