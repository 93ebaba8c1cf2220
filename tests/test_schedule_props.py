"""Property tests of the checkpoint solver: monotonicity, unit invariance, optimality."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import lcckpt.schedule as S
from lcckpt.schedule.cost import dp_schedule, evaluate
from lcckpt.schedule.problem import build_problem
from lcckpt.schedule.termination import conditional_survival

horizons = st.integers(20, 1500)
costs = st.floats(0.5, 60.0)
mtbfs = st.floats(200.0, 20000.0)
taus = st.floats(0.2, 5.0)
restarts = st.floats(0.0, 200.0)
curves = st.sampled_from([
    None,
    S.FittedCurve("exponential", {"a": 2.0, "b": 0.004, "c": 0.3}),
    S.FittedCurve("power", {"a": 24.4, "p": 1.15, "c": 0.081}),
])
policies = st.sampled_from(["young_daly", "convergence", "exploratory"])
terms = st.sampled_from([None, S.Rungs((100, 300, 900), 3.0), S.ExponentialTermination(800.0)])

SETTINGS = settings(max_examples=25, deadline=None)


def _solve(h, tau, c, r, m, **kw):
    return S.solve(h, iter_time=tau, checkpoint_cost=c, restart_cost=r, mtbf=m, **kw)


@SETTINGS
@given(h=horizons, tau=taus, c=costs, factor=st.floats(1.01, 10.0), r=restarts, m=mtbfs,
       curve=curves, policy=policies, term=terms)
def test_more_checkpoint_cost_no_more_checkpoints(h, tau, c, factor, r, m, curve, policy, term):
    kw = dict(curve=curve, policy=policy, termination=term)
    a = _solve(h, tau, c, r, m, **kw)
    b = _solve(h, tau, c * factor, r, m, **kw)
    assert len(b.iterations) <= len(a.iterations)


@SETTINGS
@given(h=horizons, tau=taus, c=costs, factor=st.floats(1.01, 10.0), r=restarts, m=mtbfs,
       curve=curves, policy=policies, term=terms)
def test_more_failures_no_fewer_checkpoints(h, tau, c, factor, r, m, curve, policy, term):
    kw = dict(curve=curve, policy=policy, termination=term)
    a = _solve(h, tau, c, r, m, **kw)
    b = _solve(h, tau, c, r, m / factor, **kw)
    assert len(b.iterations) >= len(a.iterations)


@SETTINGS
@given(h=horizons, tau=taus, c=costs, r=restarts, m=mtbfs, d=st.floats(0, 100), p=st.floats(0, 100),
       scale=st.sampled_from([60.0, 1 / 60.0, 3600.0]), curve=curves, policy=policies, term=terms,
       method=st.sampled_from(["dp", "young", "daly", "density", "checkfreq"]))
def test_unit_invariance(h, tau, c, r, m, d, p, scale, curve, policy, term, method):
    kw = dict(curve=curve, policy=policy, termination=term, method=method)
    a = _solve(h, tau, c, r, m, downtime=d, persist_time=p, **kw)
    b = _solve(h, tau * scale, c * scale, r * scale, m * scale, downtime=d * scale,
               persist_time=p * scale, **kw)
    assert a.iterations == b.iterations
    assert np.isclose(b.expected_overhead, a.expected_overhead * scale, rtol=1e-9, atol=1e-12)


@SETTINGS
@given(h=st.integers(20, 800), tau=taus, c=costs, r=restarts, m=mtbfs, p=st.floats(0, 100),
       curve=curves, policy=policies, term=terms)
def test_dp_no_worse_than_any_rule_under_its_own_cost(h, tau, c, r, m, p, curve, policy, term):
    kw = dict(curve=curve, policy=policy, termination=term, persist_time=p)
    dp = _solve(h, tau, c, r, m, **kw)
    for method in ("young", "daly", "density", "checkfreq"):
        other = _solve(h, tau, c, r, m, method=method, **kw)
        assert dp.expected_overhead <= other.expected_overhead * (1 + 1e-9) + 1e-9


@SETTINGS
@given(h=st.integers(5, 600), stride=st.integers(1, 7), tau=taus, c=costs, r=restarts, m=mtbfs,
       p=st.floats(0, 100), curve=curves, policy=policies, term=terms, start=st.integers(0, 500))
def test_dp_recurrence_equals_direct_evaluation(h, stride, tau, c, r, m, p, curve, policy, term, start):
    """The DP's prefix recurrences give the same cost as summing each segment directly."""
    prob = build_problem(h, iter_time=tau, checkpoint_cost=c, restart_cost=r, mtbf=m, persist_time=p)
    s = conditional_survival(term, start, h)
    plan = S.solve(h, iter_time=tau, checkpoint_cost=c, restart_cost=r, mtbf=m, persist_time=p,
                   curve=curve, policy=policy, termination=term, start=start)
    u = plan.weights
    cand = np.concatenate([[0], np.arange(stride, h, stride), [h]])
    its, j = dp_schedule(prob, u, s, cand, float(prob.t[-1]))
    assert np.isclose(j, evaluate(prob, u, s, its)["total"], rtol=1e-9, atol=1e-9)
    assert all(k % stride == 0 for k in its)
