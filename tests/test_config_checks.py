"""Configs that would break a cluster are refused at start, naming the key and what is wrong, as
config errors (``decentd`` exits 2 for them: systemd does not restart a daemon that would fail the
same way again). In-process: the config model and the daemon's own checks at construction;
``test_lifecycle.py`` runs the ``decentd`` command for the exit codes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from decentd.errors import ConfigError, StartupError
from decentd.service.config import load_config
from decentd.service.server import Daemon

TWO = {"peers": ["127.0.0.1:7001", "127.0.0.1:7002"]}


@pytest.mark.parametrize(("overrides", "words"), [
    ({"timeouts.op": float("inf")}, ["timeouts.op", "86400", "inf"]),
    ({"timeouts.start": float("nan")}, ["timeouts.start", "nan"]),
    ({"timeouts.start": 1e9}, ["timeouts.start", "86400"]),
    ({"timeouts.auth": 0.001}, ["timeouts.auth", "greater than or equal to 1", "0.001"]),
    ({**TWO, "faults.min_nodes": 3}, ["faults.min_nodes 3", "2 daemon(s)"]),
    ({"security.mode": "secret"}, ["security", "mode secret needs secret_file"]),
])
def test_the_config_model_refuses_values_that_break_a_cluster(overrides: dict[str, Any],
                                                              words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert message.startswith("config error: ") and "Value error" not in message, message
    for word in words:
        assert word in message, (word, message)


@pytest.mark.parametrize(("weights", "words"), [
    ({0: {0: float("nan"), 1: 0.5}}, ["W[0,0] = nan", "rank 0's weight of rank 0"]),
    ({0: {0: 1.5, 1: -0.5}}, ["W[0,1] = -0.5"]),
    ({1: {1: 1.0, 0: 1.0}}, ["row 1 sums to 2"]),
])
def test_topology_weights_that_do_not_average_are_refused(weights: dict[int, dict[int, float]],
                                                          words: list[str]) -> None:
    # NaN, negative or not summing to 1 for a receiver: results would come out NaN or scaled
    cfg = load_config(None, {**TWO, "topology.weights": weights})
    with pytest.raises(ConfigError) as info:
        Daemon(cfg)
    message = str(info.value)
    assert message.startswith("config error: topology: ") and "row-stochastic" in message
    for word in words:
        assert word in message, (word, message)


def test_weights_that_average_are_taken() -> None:
    cfg = load_config(None, {**TWO, "topology.weights": {0: {0: 0.75, 1: 0.25}}})
    topology = Daemon(cfg).services.topology
    assert topology.matrix().tolist() == [[0.75, 0.25], [0.5, 0.5]]


def _secret_file(tmp_path: Path, mode: int) -> Path:
    path = tmp_path / "secret"
    path.write_bytes(os.urandom(32))
    path.chmod(mode)
    return path


@pytest.mark.parametrize(("security", "words"), [
    (lambda tmp: {"security.mode": "secret", "security.secret_file": str(tmp / "missing")},
     ["security.secret_file", "missing"]),
    (lambda tmp: {"security.mode": "secret",
                  "security.secret_file": str(_secret_file(tmp, 0o644))},
     ["security.secret_file", "secret"]),
    (lambda tmp: {"security.worker_group": "no-such-group-of-decent"},
     ["security.worker_group", "no-such-group-of-decent"]),
    (lambda tmp: {"peers": ["10.9.8.7:7001", "10.9.8.6:7001"]},
     ["off loopback", "security.mode"]),
])
def test_what_the_daemon_checks_at_start_is_a_config_error(tmp_path: Path, security: Any,
                                                           words: list[str]) -> None:
    # each once exited 1 (retried by systemd's Restart=on-failure, in a loop)
    cfg = load_config(None, {"socket": str(tmp_path / "d.sock"), **security(tmp_path)})
    with pytest.raises(StartupError) as info:
        Daemon(cfg)
    assert isinstance(info.value, ConfigError), info.value
    for word in words:
        assert word in str(info.value), (word, str(info.value))
