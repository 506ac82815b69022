"""Optimizer state travels as tensors and plain values (never a pickle) and comes back whole."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from decent.core.training import state as core_state
from decent.torch import state as state_format
from decent.torch.state import KIT


def roundtrip(state: Any) -> Any:
    tensors: list[torch.Tensor] = []
    skeleton = core_state.flatten(state, tensors, KIT.is_tensor)
    meta = json.loads(json.dumps({"skeleton": skeleton,
                                  "tensors": [KIT.describe(t) for t in tensors]}))
    received = []
    for desc, t in zip(meta["tensors"], tensors, strict=True):
        dtype, wire = KIT.receiving(desc)
        wire.copy_(KIT.on_wire(t))  # what the broadcast writes
        received.append(KIT.from_wire(dtype, wire))
    return core_state.unflatten(meta["skeleton"], received)


def test_an_adam_state_comes_back_with_its_types() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sent = opt.state_dict()
    sent["decent"] = {"algorithm": "dsgd", "iteration": 3, "flags": torch.tensor([True, False]),
                      "z": torch.tensor([1 + 2j]), "none": None, "inf": float("inf")}
    got = roundtrip(sent)
    assert got["param_groups"][0]["betas"] == (0.8, 0.9)  # a tuple again
    assert set(got["state"]) == {0, 1}  # int keys again
    for k, v in sent["state"][0].items():
        assert torch.equal(got["state"][0][k], v) and got["state"][0][k].dtype == v.dtype
    extra = got["decent"]
    assert extra["flags"].dtype == torch.bool and extra["flags"].tolist() == [True, False]
    assert extra["z"].dtype == torch.complex64 and extra["z"].item() == 1 + 2j
    assert extra["none"] is None and extra["inf"] == float("inf") and extra["iteration"] == 3
    fresh = torch.optim.Adam(torch.nn.Linear(3, 2).parameters())
    fresh.load_state_dict(got)
    assert fresh.param_groups[0]["betas"] == (0.8, 0.9)


def test_anything_but_tensors_and_plain_values_is_refused_by_the_sender() -> None:
    with pytest.raises(state_format.StateFormatError, match=r"state\['f'\] is a builtin"):
        core_state.flatten({"f": len}, [], KIT.is_tensor)


@pytest.mark.parametrize("bad", [
    ["float32", [-1]], ["os.system", [1]], ["float32", [1 << 40]], "float32", ["float32", 3]])
def test_a_bad_tensor_description_is_refused_before_allocating(bad: Any) -> None:
    with pytest.raises(state_format.StateFormatError):
        KIT.receiving(bad)


@pytest.mark.parametrize("bad", [{"t": 5}, {"x": []}, {"d": [[1]]}, {"l": 3}, {"t": 0, "l": []}])
def test_a_malformed_skeleton_is_refused(bad: Any) -> None:
    with pytest.raises(state_format.StateFormatError):
        core_state.unflatten(bad, [torch.zeros(1)])
