"""The waits of tests scale with the host's measured speed (issue 42 point 5, :mod:`hostspeed`)."""

from __future__ import annotations

import os

import hostspeed
import pytest


def test_the_factor_is_measured_within_its_bounds_and_scales_waits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert 1.0 <= hostspeed.measure() <= hostspeed.MAX_FACTOR
    monkeypatch.setenv(hostspeed.ENV, "2.5")
    assert hostspeed.scaled(4) == 10.0
    monkeypatch.delenv(hostspeed.ENV)
    assert hostspeed.scaled(4) == 4.0


def test_the_session_measured_its_factor_before_any_test() -> None:
    assert hostspeed.factor() >= 1.0 and hostspeed.ENV in os.environ
