"""The tests' time limits come from one place and grow with the machine's load (issue 38)."""

import os

import pytest

import limits


def test_a_limit_scales_with_the_load_per_core_and_the_user_scale(monkeypatch):
    monkeypatch.delenv(limits.SCALE_VARIABLE, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.0, 0.0))
    assert limits.limit(60) == 60  # an idle machine: the limit as written
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 0.0, 0.0))
    assert limits.limit(60) == pytest.approx(270)  # 4.5 runnable per core
    monkeypatch.setenv(limits.SCALE_VARIABLE, "2")
    assert limits.limit(60) == pytest.approx(540) and limits.whole(1.01) == 10


@pytest.mark.parametrize("bad", ["fast", "0", "-1"])
def test_a_bad_scale_is_refused_by_name(monkeypatch, bad):
    monkeypatch.setenv(limits.SCALE_VARIABLE, bad)
    with pytest.raises(ValueError, match=limits.SCALE_VARIABLE):
        limits.limit(1)
