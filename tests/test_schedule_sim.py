"""The solver's expected costs against the independent Monte-Carlo simulator."""

import inspect

import numpy as np
import pytest

import lcckpt.schedule as S
from lcckpt.bench.schedule import ACCOUNTINGS, scenarios
from lcckpt.errors import InvalidArgumentError
from lcckpt.schedule import simulate as sim_module

H = 400
K = np.arange(1, H + 1)
# A front-loaded curve shaped like the digits CNN's held-out loss.
CURVE = S.FittedCurve("power", {"a": 24.4, "p": 1.15, "c": 0.081})
RUNGS = S.Rungs.geometric(15, 3.0, H)
TRIALS = 3000


def _agree(pred, stat):
    return abs(pred - stat["mean"]) <= max(0.02 * stat["mean"], 3 * stat["se"])


def _kw(sc):
    kw = {k: sc[k] for k in ("iter_time", "checkpoint_cost", "persist_time", "restart_cost",
                             "downtime", "mtbf")}
    if "weibull_shape" in sc:
        kw["mtbf"] = S.Weibull(sc["weibull_shape"], sc["mtbf"])
    return kw


@pytest.mark.parametrize("sc", [s for s in scenarios(H) if "weibull_shape" not in s],
                         ids=lambda s: s["name"])
@pytest.mark.parametrize("acc", list(ACCOUNTINGS))
@pytest.mark.parametrize("method", ["dp", "young"])
def test_solver_matches_simulator_on_benchmark_scenarios(sc, acc, method):
    policy, with_term = ACCOUNTINGS[acc]
    plan = S.solve(H, curve=CURVE, termination=RUNGS if with_term else None, policy=policy,
                   method=method, **_kw(sc))
    r = S.simulate(plan, accountings={acc: plan.weights, "time": "young_daly"}, trials=TRIALS, seed=1)
    assert _agree(plan.expected_overhead, r["accountings"][acc]["total"])
    assert _agree(plan.expected_time_overhead, r["accountings"]["time"]["total"])
    assert abs(plan.expected_failures - r["failures"]["mean"]) <= max(
        0.02 * r["failures"]["mean"], 3 * r["failures"]["se"])


def test_components_match_simulator():
    plan = S.solve(5000, iter_time=1.0, checkpoint_cost=10.0, restart_cost=60.0, mtbf=3600.0,
                   downtime=20.0)
    r = S.simulate(plan, trials=20000, seed=3)["accountings"]["time"]
    c = plan.components
    for key in ("stall", "restart", "downtime"):
        assert _agree(c[key], r[key]), key
    assert _agree(c["lost"] + c["lag"], r["lost"])
    assert _agree(plan.controllable_overhead, r["controllable"])


def test_nhpp_failures_match():
    # Infant mortality: six times the failure rate in the first hour of work.
    model = S.Piecewise((0.0, 3600.0), (6 / 3600.0, 1 / 3600.0))
    plan = S.solve(5000, iter_time=1.0, checkpoint_cost=10.0, restart_cost=60.0, mtbf=model)
    gaps = np.diff([0, *plan.iterations])
    assert gaps[0] < 0.6 * gaps[-1]          # denser while failures are frequent
    r = S.simulate(plan, trials=8000, seed=2)["accountings"]["time"]["total"]
    assert _agree(plan.expected_overhead, r)


def test_persist_backpressure_and_lag_match():
    for persist in (50.0, 200.0):
        plan = S.solve(5000, iter_time=1.0, checkpoint_cost=10.0, restart_cost=60.0, mtbf=3600.0,
                       persist_time=persist)
        r = S.simulate(plan, trials=20000, seed=4)["accountings"]["time"]["total"]
        assert _agree(plan.expected_overhead, r)
        assert plan.components["lag"] > 0


def test_dp_beats_young_daly_under_time_within_noise():
    for sc in scenarios(H)[:3]:
        dp = S.solve(H, **_kw(sc))
        for m in ("young", "daly"):
            other = S.solve(H, method=m, **_kw(sc))
            assert dp.expected_overhead <= other.expected_overhead * (1 + 1e-9)
            a = S.simulate(dp, trials=TRIALS, seed=5)["accountings"]["time"]["total"]
            b = S.simulate(other, trials=TRIALS, seed=6)["accountings"]["time"]["total"]
            assert a["mean"] <= b["mean"] + 3 * np.hypot(a["se"], b["se"])


def test_exploratory_dp_cuts_overhead_against_young():
    sc = scenarios(H)[0]
    young = S.solve(H, curve=CURVE, termination=RUNGS, policy="exploratory", method="young", **_kw(sc))
    dp = S.solve(H, curve=CURVE, termination=RUNGS, policy="exploratory", **_kw(sc))
    a = S.simulate(dp, trials=TRIALS, seed=7)["accountings"]["exploratory"]["total"]["mean"]
    b = S.simulate(young, trials=TRIALS, seed=8)["accountings"]["exploratory"]["total"]["mean"]
    assert a <= 0.85 * b


def test_termination_sampling_follows_survival():
    # With no failures the only overhead is the stall of checkpoints actually reached.
    its = [100, 200, 300]
    r = S.simulate(its, horizon=H, iter_time=1.0, checkpoint_cost=1.0, restart_cost=0.0,
                   mtbf=np.inf, termination=S.Rungs((150, 250), 2.0), trials=20000, seed=9)
    # P(reach 100) = 1, P(K > 200) = 1/2, P(K > 300) = 1/4.
    assert r["accountings"]["time"]["stall"]["mean"] == pytest.approx(1.75, abs=0.03)
    assert r["failures"]["mean"] == 0.0


def test_weibull_simulation_counts_infant_mortality():
    # A fresh Weibull clock with shape < 1 fails more often early than its mean rate says:
    # over t << MTBF the expected count is about (t / scale) ** shape, not t / MTBF.
    model = S.Weibull(0.7, 1e6)
    r = S.simulate([], horizon=1000, iter_time=10.0, checkpoint_cost=0.0, restart_cost=0.0,
                   mtbf=model, trials=20000, seed=10)
    first = (1e4 / model.scale) ** 0.7
    assert r["failures"]["mean"] == pytest.approx(first, abs=4 * r["failures"]["se"] + first ** 2)
    assert r["failures"]["mean"] > 3 * 1e4 / 1e6


def test_weibull_plan_predicts_the_failure_count():
    # The solver plans with the renewal density (expected failures exact); the overhead
    # is an approximation there (failures right after a restart lose little work).
    plan = S.solve(400, iter_time=45.0, checkpoint_cost=60.0, restart_cost=120.0,
                   mtbf=S.Weibull(0.7, 4 * 3600.0))
    r = S.simulate(plan, trials=TRIALS, seed=11)
    assert _agree(plan.expected_failures, r["failures"])


def test_simulator_does_not_use_the_solver_cost_code():
    src = inspect.getsource(sim_module)
    assert "from .cost" not in src and "import cost" not in src
    assert "solver" not in [m.split(".")[-1] for m in vars(sim_module)]


def test_simulate_bad_inputs():
    with pytest.raises(InvalidArgumentError, match="horizon"):
        S.simulate([1, 2])
    with pytest.raises(InvalidArgumentError, match="trials"):
        S.simulate([1], horizon=10, iter_time=1, checkpoint_cost=1, restart_cost=1, mtbf=10, trials=0)
    with pytest.raises(InvalidArgumentError, match="1..10"):
        S.simulate([11], horizon=10, iter_time=1, checkpoint_cost=1, restart_cost=1, mtbf=10)
    with pytest.raises(InvalidArgumentError, match="weights"):
        S.simulate([1], horizon=10, iter_time=1, checkpoint_cost=1, restart_cost=1, mtbf=10,
                   accountings={"x": np.ones(3)})
