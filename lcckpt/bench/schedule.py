"""Checkpoint-schedule comparison: which rule wastes least when failures happen?

Every rule (Young, Daly, CheckFreq-style fixed frequency, COCI's code rule in
minutes and in seconds, the first-order density rule, and the DP solver) is
scored by the same Monte-Carlo simulator (:func:`lcckpt.schedule.simulate`, which
does not use the solver's cost model) under three accountings: plain time,
progress (lost work weighted by the loss curve's progress rate), and
progress + termination (ASHA-style rungs stop most jobs early). Two settings:
serial (one GPU) and data-parallel (overhead in GPU-seconds, the job's failure
rate the sum of its GPUs'). The loss curve is real: held-out loss of the digits
CNN trained with Adam (:mod:`lcckpt.bench.trajectory`); the time scale (seconds
per iteration, costs, MTBFs) is a stated assumption of each scenario.

Run as ``python benchmarks/schedule.py [--quick] [--json out.json] [--plot out.png]``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np

from .. import schedule as S
from ..errors import InvalidArgumentError
from .timing import environment, format_table

METHODS = ("young", "daly", "checkfreq", "coci_code[min]", "coci_code[s]", "density", "dp")
ACCOUNTINGS = {  # name -> (policy, with termination)
    "time": ("young_daly", False),
    "progress": ("convergence", False),
    "progress+termination": ("exploratory", True),
}


def real_loss_curve(steps: int = 400, every: int = 5, seed: int = 0) -> tuple[list[int], list[float]]:
    """Held-out cross-entropy of the digits CNN (Adam) every ``every`` steps."""
    from .trajectory import train_trajectory

    traj = train_trajectory(model="cnn", optimizer="adam", steps=steps, snapshot_every=every, seed=seed)
    return [int(k) for k, _ in traj.snapshots], [traj.loss(s["model"]) for _, s in traj.snapshots]


def scenarios(horizon: int) -> list[dict]:
    """Serial and data-parallel settings (seconds); the loss curve is shared."""
    return [
        dict(name="serial", gpus=1, horizon=horizon, iter_time=45.0, checkpoint_cost=60.0,
             persist_time=30.0, restart_cost=120.0, downtime=0.0, mtbf=4 * 3600.0),
        dict(name="data-parallel", gpus=64, horizon=horizon, iter_time=45.0, checkpoint_cost=30.0,
             persist_time=60.0, restart_cost=300.0, downtime=60.0, mtbf=128 * 3600.0 / 64),
        # The regime of COCI's experiments: a 30-minute job failing every 10 minutes.
        dict(name="short-job", gpus=1, horizon=horizon, iter_time=4.5, checkpoint_cost=5.0,
             persist_time=5.0, restart_cost=20.0, downtime=0.0, mtbf=600.0),
        # Same as serial, but failures are Weibull renewals (shape 0.7); every rule,
        # the solver included, plans with the mean rate 1/MTBF.
        dict(name="serial-weibull", gpus=1, horizon=horizon, iter_time=45.0, checkpoint_cost=60.0,
             persist_time=30.0, restart_cost=120.0, downtime=0.0, mtbf=4 * 3600.0, weibull_shape=0.7),
    ]


def _plan(sc: dict, method: str, policy: str, curve, termination):
    kw = {k: sc[k] for k in ("iter_time", "checkpoint_cost", "persist_time", "restart_cost",
                             "downtime", "mtbf")}
    if "weibull_shape" in sc:
        kw["mtbf"] = S.Weibull(sc["weibull_shape"], sc["mtbf"])
    m, unit = method, 60.0
    if method.startswith("coci_code"):
        m, unit = "coci_code", (60.0 if method.endswith("[min]") else 1.0)
    t0 = time.perf_counter()
    plan = S.solve(sc["horizon"], curve=curve, termination=termination, policy=policy, method=m,
                   coci_time_unit=unit, **kw)
    return plan, time.perf_counter() - t0


def run(*, steps: int = 400, every: int = 5, trials: int = 4000, seed: int = 0,
        losses: tuple[list[int], list[float]] | None = None) -> dict:
    """Score every method under every accounting and scenario; a JSON-able dict."""
    if trials < 100:
        raise InvalidArgumentError(f"trials must be >= 100 for meaningful standard errors, got {trials}")
    if losses is None:
        t0 = time.perf_counter()
        losses = real_loss_curve(steps, every, seed)
        train_s = time.perf_counter() - t0
    else:
        train_s = None
    iters, values = np.asarray(losses[0], dtype=float), np.asarray(losses[1], dtype=float)
    horizon = int(iters[-1])
    curve = S.fit_curve(iters, values)
    rungs = S.Rungs.geometric(max(1, round(horizon / 27)), 3.0, horizon)
    cells = []
    for sc in scenarios(horizon):
        for acc, (policy, with_term) in ACCOUNTINGS.items():
            term = rungs if with_term else None
            for method in METHODS:
                plan, solve_s = _plan(sc, method, policy, curve, term)
                sim = S.simulate(plan, accountings={acc: plan.weights}, trials=trials, seed=seed)
                st = sim["accountings"][acc]
                g = sc["gpus"]
                pred = plan.expected_overhead
                agree = abs(pred - st["total"]["mean"]) <= max(0.02 * st["total"]["mean"],
                                                               3 * st["total"]["se"])
                cells.append(dict(
                    scenario=sc["name"], accounting=acc, method=method, policy=policy,
                    checkpoints=len(plan.iterations), iterations=list(plan.iterations),
                    predicted=pred * g, simulated=st["total"]["mean"] * g, se=st["total"]["se"] * g,
                    controllable=st["controllable"]["mean"] * g,
                    controllable_se=st["controllable"]["se"] * g,
                    failures=sim["failures"]["mean"], agrees=bool(agree), solve_s=solve_s))
    for c in cells:  # relative to Young in the same scenario and accounting
        ref = next(r for r in cells if r["scenario"] == c["scenario"]
                   and r["accounting"] == c["accounting"] and r["method"] == "young")
        c["vs_young_pct"] = 100.0 * (c["simulated"] / ref["simulated"] - 1.0)
        c["vs_young_se_pct"] = 100.0 * math.hypot(c["se"], ref["se"]) / ref["simulated"]
    return dict(
        benchmark="schedule", environment=environment(), trials=trials, seed=seed,
        loss_curve=dict(source=f"digits CNN, Adam, held-out loss every {every} steps",
                        iterations=iters.tolist(), losses=values.tolist(), train_s=train_s,
                        fit=dict(family=curve.family, params=curve.params, rmse=curve.rmse)),
        rungs=list(rungs.rungs), eta=rungs.eta, scenarios=scenarios(horizon), cells=cells)


def format_report(doc: dict) -> str:
    out = [f"loss curve: {doc['loss_curve']['source']}; fit {doc['loss_curve']['fit']['family']}; "
           f"ASHA rungs {doc['rungs']} (eta {doc['eta']:g}); {doc['trials']} trials per cell"]
    for sc in doc["scenarios"]:
        unit = "GPU-s" if sc["gpus"] > 1 else "s"
        out.append("")
        out.append(f"{sc['name']}: {sc['gpus']} GPU(s), {sc['horizon']} iterations x {sc['iter_time']:g} s, "
                   f"C={sc['checkpoint_cost']:g} s, P={sc['persist_time']:g} s, R={sc['restart_cost']:g} s, "
                   f"D={sc['downtime']:g} s, job MTBF={sc['mtbf'] / 3600:.3g} h"
                   + (f" (Weibull shape {sc['weibull_shape']:g})" if "weibull_shape" in sc else "")
                   + f"; overhead in {unit}")
        rows = []
        for c in doc["cells"]:
            if c["scenario"] != sc["name"]:
                continue
            rows.append({"accounting": c["accounting"], "method": c["method"], "ckpts": c["checkpoints"],
                         "simulated": c["simulated"], "+-se": c["se"],
                         "vs young %": c["vs_young_pct"], "+-%": c["vs_young_se_pct"],
                         "controllable": c["controllable"], "predicted": c["predicted"],
                         "agrees": "yes" if c["agrees"] else "NO"})
        out.append(format_table(rows, list(rows[0])))
    return "\n".join(out)


def plot(doc: dict, path: str) -> None:
    """Loss curve with the checkpoints each method places (serial scenario)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("plotting needs matplotlib: pip install 'lcckpt[plot]'") from exc
    lc = doc["loss_curve"]
    fit = S.FittedCurve(lc["fit"]["family"], lc["fit"]["params"])
    shown = [("time", "young"), ("time", "daly"), ("time", "checkfreq"), ("time", "coci_code[min]"),
             ("time", "dp"), ("progress", "density"), ("progress", "dp"),
             ("progress+termination", "dp")]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True,
                                 gridspec_kw={"height_ratios": [2, 3]})
    k = np.asarray(lc["iterations"])
    ax.plot(k, lc["losses"], "o", ms=3, color="0.4", label="held-out loss (digits CNN, Adam)")
    kk = np.linspace(1, k[-1], 400)
    ax.plot(kk, fit(kk), "-", color="C0", label=f"{lc['fit']['family']} fit")
    for r in doc["rungs"]:
        ax.axvline(r, color="C3", ls=":", lw=1)
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.legend(loc="upper right", fontsize=8)
    for row, (acc, method) in enumerate(shown):
        cell = next(c for c in doc["cells"] if c["scenario"] == "serial"
                    and c["accounting"] == acc and c["method"] == method)
        y = len(shown) - row
        bx.plot(cell["iterations"], [y] * len(cell["iterations"]), "|", ms=12, mew=2)
        bx.text(k[-1] * 1.01, y, f"{method} / {acc}: {cell['simulated']:.0f} s", va="center", fontsize=8)
    bx.set_yticks([])
    bx.set_ylim(0.3, len(shown) + 0.7)
    bx.set_xlabel("iteration (rungs dotted)")
    for r in doc["rungs"]:
        bx.axvline(r, color="C3", ls=":", lw=1)
    bx.set_title("checkpoints placed (serial scenario); simulated overhead under that accounting",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer trials, shorter training")
    ap.add_argument("--trials", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--losses", help="JSON with 'iterations' and 'losses' to use instead of training")
    ap.add_argument("--json", help="write the JSON document here")
    ap.add_argument("--plot", help="draw checkpoint placement over the loss curve (PNG)")
    args = ap.parse_args(argv)
    losses = None
    if args.losses:
        with open(args.losses) as f:
            d = json.load(f)
        d = d.get("loss_curve", d)
        losses = (d["iterations"], d["losses"])
    trials = args.trials or (1000 if args.quick else 4000)
    doc = run(steps=200 if args.quick else 400, trials=trials, seed=args.seed, losses=losses)
    print(format_report(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.plot:
        plot(doc, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
