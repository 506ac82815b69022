"""One-sided window ops through real daemons: exact values, versions, races, no waiting."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

from conftest import ClusterFactory
from decent.core import DecentError
from decent_wire.v1 import decent_pb2 as pb

pytestmark = pytest.mark.slow

N = 4  # ring: rank r's neighbors are r - 1 and r + 1


def ring_neighbors(r: int) -> list[int]:
    return sorted({(r - 1) % N, (r + 1) % N})


def vec(r: int, scale: float = 1.0, k: int = 5) -> np.ndarray:
    return scale * (np.arange(k, dtype=np.float64) + 8.0 * r)


def test_put_then_update_gives_the_weighted_sum_exactly(cluster: ClusterFactory) -> None:
    c = cluster(N, "ring")

    def work(cl: Any) -> dict[str, Any]:
        r = cl.rank
        x = torch.from_numpy(vec(r))
        cl.win_create(x, "wput")
        start = cl.win_info("wput")
        first = cl.win_update("wput", self_weight=0.5,
                              neighbor_weights={j: 0.25 for j in ring_neighbors(r)}).clone()
        cl.barrier(name="wput.b0")
        cl.win_put(torch.from_numpy(vec(r, 10.0)), "wput")  # to both ring neighbors, weight 1
        cl.barrier(name="wput.b1")
        before = cl.win_versions("wput")
        out = cl.win_update("wput", self_weight=0.5,
                            neighbor_weights={j: 0.25 for j in ring_neighbors(r)})
        after = cl.win_versions("wput")
        cl.barrier(name="wput.b2")
        cl.win_free("wput")
        return {"start": start, "first": first.numpy(), "out": out.numpy(), "x": x.numpy(),
                "before": before, "after": after}

    got = c.run(work)
    for r, g in enumerate(got):
        nb = ring_neighbors(r)
        # buffers start as copies of the rank's own tensor: the first update changes nothing
        assert g["start"].versions == {j: 0 for j in nb}
        np.testing.assert_array_equal(g["first"], vec(r))
        want = 0.5 * vec(r) + sum(0.25 * vec(j, 10.0) for j in nb)
        np.testing.assert_array_equal(g["out"], want)
        np.testing.assert_array_equal(g["x"], want)  # written into the win_create tensor
        assert g["before"] == {j: 1 for j in nb} and g["after"] == {j: 0 for j in nb}


def test_get_reads_published_copies_with_their_steps(cluster: ClusterFactory) -> None:
    c = cluster(N, "ring")

    def work(cl: Any) -> dict[str, Any]:
        r = cl.rank
        cl.win_create(torch.zeros(5, dtype=torch.float64), "wget", zero_init=True)
        cl.win_publish(torch.from_numpy(vec(r, 3.0)), "wget", step=7 + r)
        cl.barrier(name="wget.b0")
        assert cl.win_get_async("wget", src_weights={j: 0.5 for j in ring_neighbors(r)}) \
            .wait(timeout=30).numel() == 0
        info = cl.win_info("wget")
        cl.barrier(name="wget.b0b")  # every get served before any own copy changes again
        out = cl.win_update("wget", self_weight=0.0,
                            neighbor_weights={j: 1.0 for j in ring_neighbors(r)}, step=20)
        cl.barrier(name="wget.b1")
        served = cl.win_info("wget").served
        cl.barrier(name="wget.b2")
        cl.win_free("wget")
        return {"info": info, "out": out.numpy(), "served": served}

    got = c.run(work)
    for r, g in enumerate(got):
        nb = ring_neighbors(r)
        np.testing.assert_array_equal(g["out"], sum(0.5 * vec(j, 3.0) for j in nb))
        assert g["info"].steps == {j: 7 + j for j in nb}
        assert g["info"].versions == {j: 1 for j in nb}
        assert g["info"].step == 7 + r
        assert g["served"] == 2  # both ring neighbors read this rank's copy once


def test_concurrent_accumulates_lose_no_update(cluster: ClusterFactory) -> None:
    c = cluster(N, "ring")
    rounds = 40

    def work(cl: Any) -> dict[str, Any]:
        r = cl.rank
        cl.win_create(torch.zeros(1000, dtype=torch.float64), "wacc", zero_init=True)
        cl.barrier(name="wacc.b0")
        if r != 0:  # every other rank hammers rank 0, many writes in flight at once
            one = torch.full((1000,), float(r), dtype=torch.float64)
            handles = [cl.win_accumulate_async(one, "wacc", dst_weights={0: 1.0})
                       for _ in range(rounds)]
            for h in handles:
                h.wait(timeout=60)
        cl.barrier(name="wacc.b1")
        result: dict[str, Any] = {}
        if r == 0:
            result["versions"] = cl.win_versions("wacc")
            result["out"] = cl.win_update("wacc", self_weight=0.0,
                                          neighbor_weights={j: 1.0 for j in range(1, N)},
                                          reset=True).numpy().copy()
            result["again"] = cl.win_update("wacc", self_weight=0.0,
                                            neighbor_weights={j: 1.0 for j in range(1, N)}
                                            ).numpy().copy()
        cl.barrier(name="wacc.b2")
        cl.win_free("wacc")
        return result

    got = c.run(work)[0]
    assert {j: got["versions"][j] for j in range(1, N)} == {j: rounds for j in range(1, N)}
    np.testing.assert_array_equal(got["out"], np.full(1000, rounds * sum(range(1, N)), float))
    np.testing.assert_array_equal(got["again"], np.zeros(1000))  # reset zeroed the buffers


def test_a_worker_that_stops_does_not_block_its_neighbors(cluster: ClusterFactory) -> None:
    c = cluster(N, "ring")
    writers_done = threading.Event()
    finished: list[int] = []
    lock = threading.Lock()

    def work(cl: Any) -> dict[str, Any]:
        r = cl.rank
        cl.win_create(torch.from_numpy(vec(r)), "wbusy")
        cl.barrier(name="wbusy.b0")
        res: dict[str, Any] = {}
        if r == 1:  # "computing": no call into the client until its neighbors are through
            res["released"] = writers_done.wait(timeout=60)
            res["info"] = cl.win_info("wbusy")
        elif r in (0, 2):  # 20 writes into rank 1 and 20 reads of it, while it computes
            for k in range(20):
                cl.win_put(torch.from_numpy(vec(r, float(k + 1))), "wbusy", dst_weights={1: 1.0})
                cl.win_get("wbusy", src_weights={1: 1.0})
            with lock:
                finished.append(r)
                if len(finished) == 2:
                    writers_done.set()
        cl.barrier(name="wbusy.b1")
        cl.win_free("wbusy")
        return res

    got = c.run(work)
    assert got[1]["released"], "ranks 0 and 2 did not get through while rank 1 computed"
    info = got[1]["info"]
    assert info.versions == {0: 20, 2: 20} and info.served == 40
    assert info.steps == {0: 20, 2: 20}  # each put stamped its writer's next step


def test_writes_before_create_are_kept_and_adopted(cluster: ClusterFactory) -> None:
    c = cluster(N, "ring")

    def work(cl: Any) -> Any:
        r, res = cl.rank, None
        if r == 0:
            cl.win_create(torch.zeros(3), "wlate")
            cl.win_put(torch.tensor([1.0, 2.0, 3.0]), "wlate", dst_weights={1: 2.0})
        cl.barrier(name="wlate.b0")  # rank 0's put was applied on rank 1 before it creates
        if r == 1:
            cl.win_create(torch.zeros(3), "wlate", zero_init=True)
            versions = cl.win_versions("wlate")
            out = cl.win_update("wlate", self_weight=1.0, neighbor_weights={0: 1.0, 2: 1.0})
            res = versions, out.tolist()
        cl.barrier(name="wlate.b1")
        if r in (0, 1):
            cl.win_free("wlate")
        return res

    versions, out = c.run(work)[1]
    assert versions == {0: 1, 2: 0}
    assert out == [2.0, 4.0, 6.0]


def test_window_errors_fail_the_request_only(cluster: ClusterFactory) -> None:
    c = cluster(N, "ring")

    def work(cl: Any) -> dict[str, Any]:
        r = cl.rank
        errors: dict[str, str] = {}
        cl.win_create(torch.zeros(4, dtype=torch.float32) if r != 1
                      else torch.zeros(2, 2, dtype=torch.float64), "werr")
        cl.barrier(name="werr.b0")
        if r == 0:
            try:  # rank 1 holds float64[2, 2]
                cl.win_put(torch.ones(4), "werr", dst_weights={1: 1.0})
            except DecentError as exc:
                errors["put"] = f"{pb.ErrorCode.Name(exc.code)}: {exc}"
            try:  # rank 1's window has another dtype and shape
                cl.win_get("werr", src_weights={1: 1.0})
            except DecentError as exc:
                errors["get"] = f"{pb.ErrorCode.Name(exc.code)}: {exc}"
            with pytest.raises(ValueError, match="was not created"):
                cl.win_update("nowindow")
            with pytest.raises(DecentError, match="dst_weights names rank"):
                cl.win_put(torch.ones(4), "werr", dst_weights={9: 1.0})
        cl.barrier(name="werr.b1")
        if r == 3:
            cl.win_free("werr")
        cl.barrier(name="werr.b2")
        if r == 2:
            try:
                cl.win_accumulate(torch.ones(4), "werr", dst_weights={3: 1.0})
            except DecentError as exc:
                errors["freed"] = f"{pb.ErrorCode.Name(exc.code)}: {exc}"
            try:
                cl.win_get("werr", src_weights={3: 1.0})
            except DecentError as exc:
                errors["gone"] = f"{pb.ErrorCode.Name(exc.code)}: {exc}"
        cl.barrier(name="werr.b3")
        # every daemon still works, and so does every window left
        ok = cl.allreduce(torch.full((3,), float(r)), name="werr.after").tolist()
        if r != 3:
            cl.win_free("werr")
        return {"errors": errors, "ok": ok}

    got = c.run(work)
    put, get = got[0]["errors"]["put"], got[0]["errors"]["get"]
    assert put.startswith("MISMATCH") and "'werr'" in put and "rank 0" in put \
        and "float32[4]" in put and "float64[2, 2]" in put and "rank 1" in put
    assert get.startswith("MISMATCH") and "float64[2, 2]" in get
    freed = got[2]["errors"]["freed"]
    assert freed.startswith("NOT_FOUND") and "freed" in freed and "rank 3" in freed
    gone = got[2]["errors"]["gone"]
    assert gone.startswith("NOT_FOUND") and "does not exist on rank 3" in gone
    for g in got:
        assert g["ok"] == [1.5, 1.5, 1.5]


def test_large_windows_in_any_order_both_ways(cluster: ClusterFactory) -> None:
    """Tensors above the eager window (RTS/CTS path), every rank writing and reading its
    neighbors at once, windows visited in a different order on every rank: no deadlock, and
    every buffer holds exactly what its writer put."""
    c = cluster(N, "ring")
    k, names = 3 << 20, ["wbig0", "wbig1", "wbig2"]  # 12 MiB of float32 each

    def work(cl: Any) -> dict[str, Any]:
        r = cl.rank
        for name in names:
            cl.win_create(torch.zeros(k), name, zero_init=True)
        order = names[r % 3:] + names[:r % 3]
        handles = [cl.win_put_async(torch.full((k,), float(10 * r + i)), name)
                   for i, name in enumerate(order)]
        for h in handles:
            h.wait(timeout=120)
        cl.barrier(name="wbig.b0")
        gets = [cl.win_get_async(name, src_weights={j: 0.5 for j in ring_neighbors(r)})
                for name in reversed(order)]
        for h in gets:
            h.wait(timeout=120)
        cl.barrier(name="wbig.b0b")  # every get served before any own copy changes again
        out = {}
        for name in names:
            res = cl.win_update(name, self_weight=0.0,
                                neighbor_weights={j: 1.0 for j in ring_neighbors(r)})
            out[name] = (float(res.min()), float(res.max()))
        cl.barrier(name="wbig.b1")
        for name in names:
            cl.win_free(name)
        return {"order": order, "out": out}

    got = c.run(work)
    for r, g in enumerate(got):
        for name in names:
            # what each neighbor put is its own copy; the get fetched it again at weight 1/2
            want = sum(0.5 * (10 * j + got[j]["order"].index(name)) for j in ring_neighbors(r))
            assert g["out"][name] == (want, want), (r, name)
