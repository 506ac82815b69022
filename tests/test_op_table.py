"""The op table (``decent_wire.ops``) is the one declaration of every op: it covers the wire's
ops exactly, the client's methods and the modules' exports come from it, the daemon has a
function for every op it declares, and a process's first client is its default."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from inprocess import InProcessCluster

import decent.torch as dt
from decent.core import Client
from decent.core.surface.default_client import SHORTCUTS
from decent_wire.errors import DecentError
from decent_wire.ops import BY_NAME, OP_OF_FIELD, OPS, USER_OPS, Kind, Result, result_nbytes
from decent_wire.v1 import decent_pb2 as pb
from decentd.engine.hierarchy import NODE_LEVEL
from decentd.ops import OPS as DAEMON_OPS

REPO = Path(__file__).resolve().parents[1]


def test_the_table_covers_the_wire_exactly() -> None:
    fields = {f.name for f in pb.SubmitRequest.DESCRIPTOR.oneofs_by_name["op"].fields}
    assert {d.name for d in OPS if d.kind is not Kind.PEER} == fields
    op_types = {v for _, v in pb.OpType.items()} - {pb.OP_UNSPECIFIED}
    assert {d.op_type for d in OPS if d.kind is not Kind.NOTE} == op_types
    for d in OPS:
        if d.kind is Kind.PEER:
            assert d.request is None and not d.methods
        else:  # a field carries its own message type
            field = pb.SubmitRequest.DESCRIPTOR.fields_by_name[d.name]
            assert field.message_type is d.request.DESCRIPTOR, d.name
    assert OP_OF_FIELD["set_topology"] == pb.SET_TOPOLOGY and "fill" not in OP_OF_FIELD


def test_the_daemon_runs_every_user_op_of_the_table() -> None:
    """Each user op has its daemon function: an OpSpec, or the node-level path."""
    for d in USER_OPS:
        assert d.op_type in DAEMON_OPS or d.op_type in NODE_LEVEL, d.name
    assert set(DAEMON_OPS) <= {d.op_type for d in USER_OPS}


def test_result_sizes_follow_the_table() -> None:
    f32 = pb.FLOAT32
    assert result_nbytes(BY_NAME["allreduce"].result, f32, (3, 4)) == 48
    assert result_nbytes(BY_NAME["compressed_neighbor_allreduce"].result, f32, (3, 4)) == 96
    assert result_nbytes(Result.STACKED, f32, (3, 4), sources=3) == 144
    assert result_nbytes(BY_NAME["allgather"].result, f32, (3, 4), rows=[3, 1, 2]) == 96
    assert result_nbytes(BY_NAME["barrier"].result, f32, (0,)) == 0


@pytest.mark.slow
def test_the_generated_methods_are_up_to_date() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_surface.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_form_the_table_names_is_a_client_method_and_a_shortcut() -> None:
    for d in USER_OPS:
        for method in d.methods:
            assert callable(getattr(Client, method)), method
            assert method in SHORTCUTS
            assert getattr(dt, method).__doc__ == getattr(Client, method).__doc__
    assert "neighbor_allreduce_async_" in SHORTCUTS and "fused" in SHORTCUTS


@pytest.mark.parametrize("module", ["decent.torch", "decent.tf"])
def test_star_import_works_and_every_exported_name_resolves(module: str) -> None:
    names: dict[str, Any] = {}
    exec(f"import {module} as m\nfrom {module} import *", names)  # a script's module scope
    missing = [n for n in names["m"].__all__ if n not in names]
    assert not missing, missing
    assert callable(names["neighbor_allreduce_async"])
    assert callable(names["fused"]) and callable(names["win_mutex"])
    assert len(names["m"].__all__) >= len(SHORTCUTS)


def test_the_first_client_a_process_connects_is_its_default(tmp_path: Path) -> None:
    """``c = dt.connect()`` then the module functions and an optimizer wrapper: all on ``c``;
    a second connect in the same process is refused with what to do instead."""
    # an open default client of an earlier test in this pytest process stands aside meanwhile
    earlier, dt.default_client.client = dt.default_client.client, None
    try:
        first_client_is_default()
    finally:
        dt.default_client.client = earlier


def first_client_is_default() -> None:
    """The body of the test above, on a process with no default client."""
    with InProcessCluster(1) as local:
        address = f"unix://{local.sockets[0]}"
        c = dt.connect(address, 30, job="default-rule")
        try:
            assert dt.init(address) is c and dt.default_client.get() is c
            model = torch.nn.Linear(2, 1)
            opt = dt.DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            model=model)
            assert opt.client is c
            assert dt.rank() == 0 and dt.size() == 1
            with pytest.raises(DecentError, match=r"this process \(pid \d+\) already has a "
                               r"client of job 'default-rule' .* local rank 0: one process is "
                               r"one worker"):
                dt.connect(address, 30, job="default-rule")
        finally:
            dt.shutdown()
        assert c.closed
        with pytest.raises(RuntimeError, match="not initialized"):
            dt.rank()


def test_every_compatibility_name_exists() -> None:
    """The compatibility block names only what is there: aliases are the same method,
    Horovod's arguments are parameters, and the projects' module names are exported."""
    import inspect

    from decent.core.surface.compat import ARGUMENT_ALIASES, METHOD_ALIASES, MODULE_NAMES

    for alias, method in METHOD_ALIASES.items():
        assert getattr(Client, alias) is getattr(Client, method), alias
        assert alias in SHORTCUTS
    for method, arguments in ARGUMENT_ALIASES.items():
        assert set(arguments) <= set(inspect.signature(getattr(Client, method)).parameters)
    for names in MODULE_NAMES.values():
        assert all(hasattr(dt, n) for n in names), [n for n in names if not hasattr(dt, n)]
