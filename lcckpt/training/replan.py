"""Turn the manager's measurements into the gap to its next checkpoint.

Receding horizon: every decision plans from the last checkpoint over the rest of the job
(``total_steps``) or, when the job's length is unknown, over a window of several Young/Daly
intervals. The manager follows the plan's gaps while its inputs hold and re-plans from the
newest checkpoint as soon as the costs, the iteration time or the loss curve move (or the
trustworthy part of the plan is used up). Long horizons are planned on a
coarser grid (blocks of iterations) so that one plan stays cheap.

It does not measure anything, run threads or touch checkpoints: the manager does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


MAX_CANDIDATES = 600       # plan over at most this many blocks of iterations
WINDOW_INTERVALS = 16      # unknown job length: plan over this many Young/Daly intervals
KEEP_FRACTION = 0.5        # ... and keep the gaps of its first half (the end distorts the rest)
MIN_BLOCKS_PER_INTERVAL = 40   # grid step at most 1/40 of Young/Daly's interval
MIN_CURVE_POINTS = 20      # fewer loss bins: plan by time alone (Young/Daly)


@dataclass(frozen=True)
class Inputs:
    """What one decision is based on (seconds and iterations)."""

    anchor: int                 # iteration of the last checkpoint (the plan starts after it)
    iter_time: float            # seconds per iteration, as measured
    checkpoint_cost: float      # blocking snapshot, seconds
    persist_time: float         # background encode + write, seconds
    restart_cost: float         # load + apply, seconds
    downtime: float
    mtbf: float
    policy: str
    total_steps: int | None
    curve: tuple[np.ndarray, np.ndarray] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Decision:
    """The gap (iterations after ``anchor``) to the next checkpoint, and why."""

    gap: int | None             # None: no further checkpoint is worth taking
    later: tuple[int, ...]      # the gaps after that one, while the plan stays trustworthy
    policy_used: str
    young_daly_gap: int
    block: int                  # iterations per planning step
    horizon: int                # iterations planned over
    plan: object = field(default=None, compare=False, repr=False)
    note: str = ""


def moved(b: Inputs | None, now: Inputs, decision: Decision | None) -> bool:
    """Whether the inputs ``now`` have moved enough from ``b``, those of the current plan
    (``decision``), to plan again.

    The expected overhead is flat near the optimum (a cost off by half moves the best
    interval by about a fifth and the overhead by about 2%), and every plan costs tens
    of milliseconds of CPU, so only large moves count: a cost or the iteration time
    off by half (the persist time only once it exceeds a quarter of the gap), or a loss
    curve that has doubled its points.
    """
    if b is None:
        return True
    def far(x, y):
        return abs(x - y) > 0.5 * max(abs(y), 1e-9)
    grown = (now.policy != "young_daly" and now.curve is not None
             and (b.curve is None or len(now.curve[0]) >= 2 * max(len(b.curve[0]), 16)))
    # the persist time matters only when it nears the gap (backpressure, durability lag)
    gap_s = (decision.gap or 0) * now.iter_time if decision else 0.0
    persist = (far(now.persist_time, b.persist_time)
               and max(now.persist_time, b.persist_time) > 0.25 * gap_s)
    return (far(now.iter_time, b.iter_time) or far(now.checkpoint_cost, b.checkpoint_cost)
            or far(now.restart_cost, b.restart_cost) or grown or persist)


def young_daly_gap(inp: Inputs) -> int:
    """Young/Daly's interval in iterations (at least 1)."""
    from .. import schedule
    seconds = schedule.young_daly(inp.checkpoint_cost, inp.mtbf)
    if not math.isfinite(seconds):
        return 1 << 62
    return max(1, int(round(seconds / max(inp.iter_time, 1e-12))))


def decide(inp: Inputs) -> Decision:
    """Plan from ``inp.anchor`` and return the first checkpoint of the plan."""
    from .. import schedule
    yd = young_daly_gap(inp)
    windowed = inp.total_steps is None
    if not windowed:
        horizon = inp.total_steps - inp.anchor
        if horizon <= 0:
            return Decision(None, (), inp.policy, yd, 1, 0, note="the job's last step is reached")
    else:
        horizon = min(WINDOW_INTERVALS * yd, 1 << 40)
    # a grid fine enough to place checkpoints within ~2% of Young/Daly's interval ...
    block = max(1, min(math.ceil(horizon / MAX_CANDIDATES), yd // MIN_BLOCKS_PER_INTERVAL))
    if horizon > MAX_CANDIDATES * block:    # ... and a window of the job if it is too long
        horizon, windowed = MAX_CANDIDATES * block, True
    blocks = max(1, horizon // block)
    policy, note = inp.policy, ""
    curve = None
    if policy != "young_daly":
        curve = _curve_in_blocks(inp, block)
        if curve is None:
            policy, note = "young_daly", (f"fewer than {MIN_CURVE_POINTS} loss points recorded: "
                                          "planning by time alone until the curve can be fitted")
    def plan_with(policy, curve):
        # flat stretches of a fitted curve give zero weights and infinite local intervals,
        # which the solver handles; numpy's warnings about them are noise in a training log
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            return schedule.solve(
                blocks, iter_time=inp.iter_time * block, checkpoint_cost=inp.checkpoint_cost,
                restart_cost=inp.restart_cost, mtbf=inp.mtbf, downtime=inp.downtime,
                persist_time=inp.persist_time, curve=curve, policy=policy,
                start=inp.anchor // block)
    try:
        plan = plan_with(policy, curve)
    except Exception as e:  # a fit or solver failure must not stop training
        if policy == "young_daly":
            raise
        note = f"the {policy} plan failed ({type(e).__name__}: {e}); planning by time alone"
        policy = "young_daly"
        plan = plan_with(policy, None)
    its = [int(k) * block for k in plan.iterations]
    later: tuple[int, ...] = ()
    if its:
        gap = its[0]
        keep = [k for k in its if k <= KEEP_FRACTION * horizon] if windowed else its
        later = tuple(b - a for a, b in zip(keep, keep[1:]))
    elif windowed:
        gap = blocks * block          # nothing worth it in this window: look again after it
        note = note or "no checkpoint pays off within the planning window"
    else:
        gap = None
        note = note or "no further checkpoint pays off before the job's last step"
    return Decision(gap, later, policy, yd, block, blocks * block, plan, note)


def _curve_in_blocks(inp: Inputs, block: int):
    """The loss curve with iterations counted in blocks (absolute, like the plan's ``start``)."""
    if inp.curve is None:
        return None
    its, losses = inp.curve
    if len(its) < MIN_CURVE_POINTS:
        return None
    return np.asarray(its, dtype=np.float64) / block, np.asarray(losses, dtype=np.float64)
