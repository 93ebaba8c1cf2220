"""Verification cases of the checkpoint scheduler (known answers)."""

import math

import numpy as np
import pytest

import lcckpt.schedule as S
from lcckpt.errors import InvalidArgumentError

BASE = dict(iter_time=1.0, checkpoint_cost=10.0, restart_cost=60.0, mtbf=3600.0)


@pytest.mark.parametrize("mtbf,daly,exact", [(1440, 116.69, 116.690), (360, 56.71, 56.714),
                                             (15, 9.141, 9.1665)])
def test_daly_series_and_exact_optimum(mtbf, daly, exact):
    assert S.young_daly(5, mtbf, order=2) == pytest.approx(daly, abs=0.005)
    assert S.young_daly(5, mtbf, order="exact") == pytest.approx(exact, abs=0.0005)


def test_young_daly_exact_seconds():
    assert S.young_daly(10, 3600) == pytest.approx(268.328, abs=5e-4)
    assert S.young_daly(10, 3600, order=2) == pytest.approx(261.703, abs=5e-4)
    assert S.young_daly(10, 3600, order="exact") == pytest.approx(261.703, abs=5e-4)
    assert S.young_daly(0, 3600, order="exact") == 0.0
    assert math.isinf(S.young_daly(10, math.inf))


@pytest.mark.parametrize("x,w", [(0.01, -0.865165248933166), (0.1, -0.616816831791705),
                                 (1.0, -0.158594339563039)])
def test_lambert_w_branch(x, w):
    assert S.lambert_w0_branch(x) == pytest.approx(w, abs=1e-14)
    assert S.lambert_w0(-math.exp(-1 - x)) == pytest.approx(w, abs=1e-12)


def test_lambert_w_identity():
    for z in (-0.3, -0.01, 0.5, 1.0, 7.0, 1e6):
        w = S.lambert_w0(z)
        assert w * math.exp(w) == pytest.approx(z, rel=1e-13)


def test_dp_h5000():
    p = S.solve(5000, **BASE)
    gaps = np.diff([0, *p.iterations])
    assert len(p.iterations) == 18
    assert gaps.min() >= 262 and gaps.max() <= 263
    assert p.expected_overhead == pytest.approx(471.6, abs=0.1)
    assert p.expected_time_overhead == p.expected_overhead


def test_dp_h20000_grid5():
    p = S.solve(20000, candidates=np.arange(5, 20000, 5), **BASE)
    gaps = np.diff([0, *p.iterations])
    assert len(p.iterations) == 76
    assert gaps.min() >= 255 and gaps.max() <= 260
    assert p.expected_overhead == pytest.approx(1919, abs=1)


def test_short_job_and_no_failures_need_no_checkpoint():
    assert S.solve(200, **BASE).iterations == ()
    assert S.solve(5000, **{**BASE, "mtbf": 1e15}).iterations == ()
    assert S.solve(5000, **{**BASE, "mtbf": math.inf}).iterations == ()


def test_free_checkpoints_go_everywhere():
    p = S.solve(300, **{**BASE, "checkpoint_cost": 0.0})
    assert p.iterations == tuple(range(1, 300))


def test_unit_invariance_minutes():
    a = S.solve(5000, **BASE)
    b = S.solve(5000, iter_time=1 / 60, checkpoint_cost=10 / 60, restart_cost=1.0, mtbf=60.0)
    assert a.iterations == b.iterations
    assert b.expected_overhead * 60 == pytest.approx(a.expected_overhead, rel=1e-9)


def test_plan_explain_and_invalid():
    p = S.solve(5000, **BASE)
    text = p.explain(100)
    assert "Young interval" in text and "segment 0 -> 262" in text or "segment 0 -> 263" in text
    with pytest.raises(InvalidArgumentError):
        p.explain(0)
    with pytest.raises(InvalidArgumentError, match="horizon"):
        S.solve(0, **BASE)
    with pytest.raises(InvalidArgumentError, match="checkpoint_cost"):
        S.solve(10, **{**BASE, "checkpoint_cost": -1})
    with pytest.raises(InvalidArgumentError, match="iter_time"):
        S.solve(10, **{**BASE, "iter_time": np.ones(9)})
    with pytest.raises(InvalidArgumentError, match="mtbf"):
        S.solve(10, **{**BASE, "mtbf": 0})
    with pytest.raises(InvalidArgumentError, match="policy"):
        S.solve(10, policy="fast", **BASE)
    with pytest.raises(InvalidArgumentError, match="method"):
        S.solve(10, method="best", **BASE)
    with pytest.raises(InvalidArgumentError, match="order"):
        S.young_daly(1, 10, order=3)
    for bad in (dict(start=True), dict(start=-1), dict(window=0.5), dict(max_pairs=0),
                dict(max_candidates=0), dict(candidates=[0, 3])):
        with pytest.raises(InvalidArgumentError, match=next(iter(bad))):
            S.solve(50, **bad, **BASE)
    with pytest.raises(InvalidArgumentError, match="horizon"):
        S.solve(50.0, **BASE)
    assert S.solve(np.int64(50), window=np.int64(4), **BASE).horizon == 50


@pytest.mark.parametrize("mtbf", [1e-3, 0.3, 1.0])
def test_a_job_that_cannot_finish_is_refused_not_planned_as_nan(mtbf):
    """An MTBF far below a restart's cost gave expected overheads of 3e25 s (1 s) and
    5e79 s (0.3 s), and at 1 ms NaN beside an arbitrary plan."""
    kw = dict(iter_time=0.35, checkpoint_cost=2.0, persist_time=6.0, restart_cost=40.0)
    with pytest.raises(InvalidArgumentError, match=rf"mtbf {mtbf:.3g} s is too short.*"
                       r"never finish; mtbf is in seconds"):
        S.solve(2000, mtbf=mtbf, **kw)
    with pytest.raises(InvalidArgumentError, match="too short"):
        S.score([10, 20], 2000, mtbf=mtbf, **kw)
    plan = S.solve(2000, mtbf=10.0, **kw)            # a hard job, but one that finishes
    assert math.isfinite(plan.expected_overhead) and plan.iterations
