"""Curve fitting, termination and failure models, baseline rules, policies."""

import math
import warnings

import numpy as np
import pytest

import lcckpt.schedule as S
from lcckpt.errors import InvalidArgumentError
from lcckpt.schedule.termination import conditional_survival

K = np.arange(1, 601, dtype=float)
TRUE = {
    "exponential": lambda k: 2.0 * np.exp(-k / 150.0) + 0.3,
    "optimus": lambda k: 1.0 / (0.02 * k + 0.5) + 0.2,
    "power": lambda k: 3.0 * (k + 1.0) ** -0.7 + 0.1,
}
BASE = dict(iter_time=1.0, checkpoint_cost=10.0, restart_cost=60.0, mtbf=3600.0)


@pytest.mark.parametrize("family", S.FAMILIES)
def test_fit_recovers_each_family(family):
    rng = np.random.default_rng(0)
    y = TRUE[family](K) * (1 + 0.01 * rng.standard_normal(K.size))
    c = S.fit_curve(K, y)
    assert c.family == family
    kk = np.array([50.0, 300.0, 900.0])
    assert np.allclose(c(kk), TRUE[family](kk), rtol=0.03)
    true_rate = -(TRUE[family](kk + 0.5) - TRUE[family](kk - 0.5))
    assert np.allclose(c.rate(kk), true_rate, rtol=0.15, atol=1e-6)


def test_isotonic_fallback_when_no_family_decays():
    y = 1.0 + 1e-3 * K                                     # a diverging run: loss rises
    c = S.fit_curve(K, y)
    assert c.family == "isotonic"
    assert np.all(c.rate(np.arange(1, 800)) == 0)


def test_losses_logged_at_one_iteration_give_a_finite_rate_without_warnings():
    """Losses logged several times an iteration (micro-batches under gradient
    accumulation) put isotonic knots at one iteration: no division by their zero width."""
    rng = np.random.default_rng(1)
    for k in (np.zeros(40), np.repeat(np.arange(0.0, 50.0, 5.0), 4)):
        y = 1.0 + 0.1 * rng.standard_normal(k.size)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            c = S.fit_curve(k, y, families=())
            r = c.rate(np.arange(0, 80))
        assert c.family == "isotonic" and np.all(np.isfinite(r)) and np.all(r >= 0)


def test_staircase_gives_a_monotone_nonnegative_rate():
    y = np.where(K < 200, 2.0, np.where(K < 400, 1.0, 0.5))     # learning-rate drops
    c = S.fit_curve(K, y)
    assert np.all(np.diff(c(K)) <= 1e-12)
    assert np.all(c.rate(np.arange(1, 800)) >= 0)


def test_fit_errors_and_few_points():
    with pytest.raises(InvalidArgumentError, match="at least"):
        S.fit_curve(K[:5], TRUE["power"](K[:5]))
    with pytest.raises(InvalidArgumentError, match="same length"):
        S.fit_curve(K, K[:-1])
    with pytest.raises(InvalidArgumentError, match="family"):
        S.fit_curve(K, TRUE["power"](K), families=("spline",))
    # Too few points to fit: the plan notes it and treats progress as uniform.
    p = S.solve(2000, curve=(K[:5], TRUE["power"](K[:5])), policy="convergence", **BASE)
    assert p.iterations == S.solve(2000, **BASE).iterations
    assert "uniform" in p.explain(1)
    with pytest.raises(InvalidArgumentError, match="curve"):
        S.solve(100, curve="loss.csv", **BASE)


def test_convergence_policy_is_denser_early():
    y = TRUE["exponential"](K)
    p = S.solve(3000, curve=(K, y), start=600, policy="convergence", **BASE)
    gaps = np.diff([0, *p.iterations])
    assert gaps[0] < 0.5 * gaps[-1]
    assert np.all(np.diff(gaps) >= -2)                    # gaps widen (up to grid rounding)
    young = S.solve(3000, curve=(K, y), start=600, policy="young_daly", **BASE)
    assert young.iterations[0] > p.iterations[0]
    assert p.expected_overhead < young.expected_overhead  # under progress accounting
    assert p.expected_time_overhead > young.expected_time_overhead  # and pays in plain time


def test_termination_models():
    r = S.Rungs((10, 30, 90), 3.0)
    assert r.survival(np.array([1, 10, 11, 30, 31, 91])).tolist() == pytest.approx(
        [1, 1, 1 / 3, 1 / 3, 1 / 9, 1 / 27])
    assert S.Rungs.geometric(10, 3, 100).rungs == (10, 30, 90)
    e = S.Empirical((5, 10, 10, 20))
    assert e.survival(np.array([1, 5, 6, 10, 11, 20, 21])).tolist() == [1, 1, .75, .75, .25, .25, 0]
    x = S.ExponentialTermination(100.0)
    assert x.survival(np.array([1, 101]))[1] == pytest.approx(math.exp(-1))
    s = conditional_survival(r, 20, 100)
    assert s[0] == s[1] == 1 and s[-1] == 0 and s[10] == 1 and s[11] == pytest.approx(1 / 3)
    for bad in (lambda: S.Rungs((5, 3)), lambda: S.Rungs((5,), 1.0), lambda: S.Empirical(()),
                lambda: S.ExponentialTermination(0)):
        with pytest.raises(InvalidArgumentError):
            bad()
    with pytest.raises(InvalidArgumentError, match="termination"):
        S.solve(100, termination=0.5, **BASE)


def test_termination_puts_checkpoints_at_rungs():
    """A checkpoint right at a rung is paid only by the jobs that go on."""
    rungs = S.Rungs((1000, 2000), 10.0)
    p = S.solve(3000, termination=rungs, **BASE)
    plain = S.solve(3000, **BASE)
    assert 1000 in p.iterations and 2000 in p.iterations
    assert S.score(plain.iterations, 3000, termination=rungs, **BASE).expected_overhead \
        >= p.expected_overhead
    assert S.score(p.iterations, 3000, termination=rungs, **BASE).expected_overhead \
        == pytest.approx(p.expected_overhead, rel=1e-12)
    a = S.simulate(p, trials=4000, seed=1)["accountings"]["time"]["total"]
    assert a["mean"] == pytest.approx(p.expected_overhead, rel=0.02, abs=3 * a["se"])
    with pytest.raises(InvalidArgumentError, match="1..3000"):
        S.score([0, 5], 3000, **BASE)


def test_failure_models():
    w = S.Weibull(0.7, 3600.0)
    assert w.scale * math.gamma(1 + 1 / 0.7) == pytest.approx(3600.0)
    assert S.solve(5000, **{**BASE, "mtbf": S.Weibull(1.0, 3600.0)}).iterations == \
        S.solve(5000, **BASE).iterations
    # Shape < 1: failures crowd the start of a fresh clock, so checkpoints do too.
    gaps = np.diff([0, *S.solve(5000, **{**BASE, "mtbf": w}).iterations])
    assert gaps[0] < 0.8 * gaps[-1]
    edges = np.linspace(0, 50 * 3600.0, 11)
    assert w.expected_failures(edges)[-1] == pytest.approx(5 * 3600.0 / 3600.0, rel=0.01)
    for bad in (lambda: S.Weibull(0, 1), lambda: S.Exponential(-1),
                lambda: S.Piecewise((1.0,), (1.0,)), lambda: S.Piecewise((0.0, 5.0), (1.0, -1.0))):
        with pytest.raises(InvalidArgumentError):
            bad()
    # Per-iteration arrays for every cost.
    h = 1000
    p = S.solve(h, iter_time=np.full(h, 1.0), checkpoint_cost=np.linspace(5, 15, h),
                restart_cost=np.full(h + 1, 60.0), mtbf=np.full(h, 3600.0), persist_time=np.ones(h))
    assert p.horizon == h and p.expected_overhead > 0


def test_rules():
    young = S.solve(5000, method="young", **BASE)
    assert np.diff([0, *young.iterations]).tolist() == [268] * 18 or \
        set(np.diff([0, *young.iterations])) <= {268, 269}
    daly = S.solve(5000, method="daly", **BASE)
    assert set(np.diff([0, *daly.iterations])) <= {261, 262}
    cf = S.solve(5000, method="checkfreq", **BASE)
    assert set(np.diff([0, *cf.iterations])) == {200}     # 10 s stall <= 5% of 200 s
    dens = S.solve(5000, method="density", **BASE)
    assert dens.iterations == young.iterations             # u = 1: the density rule is Young's
    with pytest.raises(InvalidArgumentError, match="curve"):
        S.solve(5000, method="coci_code", **BASE)
    with pytest.raises(InvalidArgumentError, match="checkfreq_overhead"):
        S.solve(5000, method="checkfreq", checkfreq_overhead=2.0, **BASE)


def test_coci_code_rule_depends_on_the_time_unit():
    """COCI's decrement mixes loss and time units: kept as a baseline, documented as such."""
    y = TRUE["exponential"](K)
    kw = dict(iter_time=4.5, checkpoint_cost=5.0, restart_cost=20.0, mtbf=600.0, curve=(K, y),
              method="coci_code")
    minutes = S.solve(600, coci_time_unit=60.0, **kw)
    seconds = S.solve(600, coci_time_unit=1.0, **kw)
    assert len(minutes.iterations) > 0
    assert minutes.iterations != seconds.iterations
    gaps = np.diff([0, *minutes.iterations])
    assert gaps[0] < gaps[-1]                              # equal loss decrements: dense early


def test_policies_and_accounting():
    assert S.POLICIES["young_daly"] == S.Accounting(0.0, 0.0)
    custom = S.solve(2000, policy=S.Accounting(0.5, 0.0), curve=(K, TRUE["power"](K)), **BASE)
    assert custom.policy.startswith("omega=0.5")
    assert np.isclose(np.dot(custom.weights, custom.problem.tau), 2000.0)  # mean-1 weights
    with pytest.raises(InvalidArgumentError):
        S.Accounting(2.0, 0.0)


def test_plan_helpers():
    p = S.solve(5000, **BASE)
    assert p.next_checkpoint(1) == p.iterations[0]
    assert p.next_checkpoint(p.iterations[-1] + 1) is None
    assert "no checkpoint after" in p.explain(5000)
    d = p.to_dict()
    assert d["iterations"] == list(p.iterations) and d["method"] == "dp"
    assert p.controllable_overhead == pytest.approx(p.components["stall"] + p.components["lost"])
