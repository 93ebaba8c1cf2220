"""A manager's account of itself: what it measured, what it plans and why."""

from __future__ import annotations

import math

from .costs import Costs


def explain(*, every, iteration, last_checkpoint, durable_step, next_at, costs: Costs,
            downtime, mtbf, decision, stats: dict, backpressure) -> str:
    """Why a manager checkpoints at its current rate, in a few lines (its state, passed
    by :meth:`CheckpointManager.explain`)."""
    lines = []
    if every is not None:
        lines.append(f"fixed interval: a checkpoint every {every} iterations (every=)")
    d = decision
    cost = costs.cost
    tau, c, p, r = costs.iter_time(), cost("snapshot"), cost("persist"), costs.restart()
    slow = max(0.0, cost("interference"))
    lines.append(
        f"iteration {iteration}; last checkpoint {last_checkpoint}, durable "
        f"{durable_step}; next due at {next_at if next_at < (1 << 62) else 'never'}")
    lines.append(
        "measured: iteration " + _fmt(tau) + ", checkpoint " + _fmt(c + slow) + " (snapshot "
        + _fmt(c) + " + training slowed by the write " + _fmt(slow) + "), persist "
        "(background) " + _fmt(p) + ", restart " + _fmt(r) + f" + downtime {downtime:g} s")
    if d is None:
        if every is None:
            lines.append(f"no plan yet: the first checkpoint at iteration {next_at} "
                         "measures the costs")
    else:
        gap = "none" if d.gap is None else f"{d.gap} iterations (~{d.gap * tau:.3g} s)"
        lines.append(f"plan ({d.policy_used}, MTBF {mtbf:g} s, horizon {d.horizon} "
                     f"iterations in blocks of {d.block}): next gap {gap}; Young/Daly "
                     f"alone would give {d.young_daly_gap} iterations")
        if d.note:
            lines.append(d.note)
        plan_explain = getattr(d.plan, "explain", None)
        if plan_explain is not None and d.plan.iterations:
            if d.block > 1:
                lines.append(f"the solver's lines below count blocks of {d.block} iterations:")
            try:
                lines.append(str(plan_explain(d.plan.iterations[0])))
            except Exception as e:        # explanation is best effort
                lines.append(f"(the plan could not explain itself: {e!r})")
    s = stats
    # the stall: host copies, writes in step() (background=False), and the optimizer's
    # waits for a write from the live state (background="overlap")
    lines.append(f"{s['checkpoints']} checkpoints, stalled {s['stall_s']:.3g} s taking them, "
                 f"{s['deferred']} deferred and {s['waited_s']:.3g} s waited for a busy writer "
                 f"(backpressure={backpressure!r})")
    return "\n".join(lines)


def _fmt(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "(not measured)"
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"
