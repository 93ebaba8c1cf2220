"""The per-step columns of ``lcckpt inspect DIR`` on a chain: each role's worst error
against its movement, the tensors that missed their update, the tensors stored exactly
instead, and the legends that explain them; whether each step's links restore, and the
files set aside beside the chain."""

import os
import re

from ..chain.retention import DAMAGED, ROLLED_BACK

SET_ASIDE = re.compile(rf"step-\d+\.lcc({re.escape(DAMAGED)}|{re.escape(ROLLED_BACK)})(\.\d+)?")

ROLE_COLUMNS = {"weight": "w_err/move", "first_moment": "m1_err/move",
                "second_moment": "m2_err/move"}
MOVEMENT_LEGEND = (
    "w_err/move, m1_err/move, m2_err/move: the worst restored error of the weights, first "
    "and second moments, as a share of their movement since the keyframe (each is held "
    "to its target, the role's share or a share of the update its delta sends: "
    "DeltaCheckpointer.info(step)['tensors']); max_rel_error: the worst error as a "
    "share of the tensor's norm; missed: tensors whose update was mostly not kept")
FALLBACK_LEGEND = (
    "stored_exact: tensors of a delta stored exactly instead (NaN/Inf in the tensor or in "
    "the step before it, or a delta that would not meet its bound; "
    "DeltaCheckpointer.info(step)['tensors'][name]['fallback'] says why)")


def fallback_column(info: dict) -> dict:
    """How many tensors of a delta step fell back to an exact copy (shown where any did)."""
    n = sum(1 for t in info.get("tensors", {}).values() if isinstance(t, dict) and t.get("fallback"))
    return {"stored_exact": n} if n and info.get("kind") == "delta" else {}


def movement_columns(tensors: dict) -> dict:
    """Per role, the worst ``error_vs_movement`` of a step's tensors, and how many
    tensors missed their update (an error past half the movement and the target, beyond
    what the stats' rounding explains: 0.8001 of the movement against a target of 0.8 is
    two rounded stats' ratio, not a miss)."""
    from ..chain.session import MISSED, STATS_ROUNDING
    from ..chain.policy import role_of
    out, missed, seen = {}, 0, False
    for key, t in tensors.items():
        r = t.get("error_vs_movement")
        if r is None:
            continue
        seen = True
        col = ROLE_COLUMNS[role_of(key)]
        out[col] = max(out.get(col, 0.0), r)
        missed += r > max(t.get("target") or 0.0, MISSED) * (1 + STATS_ROUNDING)
    if seen:
        out["missed"] = missed
    return out


def judge_links(rows: list, infos: dict, problems: list) -> dict:
    """Whether each step (``rows``, oldest first, their headers' ``infos``; a damaged
    one has none) restores: a keyframe does, a delta if its base does and is the version
    it was made against. Sets each row's ``restorable``; a broken link's problem goes to
    ``problems``."""
    ok: dict[int, bool] = {}
    for row in rows:                    # oldest first: a base is judged before its deltas
        step, info = row["step"], infos.get(row["step"])
        if info is None:
            ok[step] = False
        elif info.get("kind") == "keyframe":
            ok[step] = True
        else:
            base = info["base"]["step"]
            if base not in ok:
                ok[step] = False
                problems.append(f"step {step} is a delta on step {base}, which is missing")
            elif ok[base] and infos.get(base, {}).get("state_id") != info["base"].get("state_id"):
                ok[step] = False
                problems.append(f"step {step} was made against another version of step {base}")
            else:
                ok[step] = ok[base]
        row["restorable"] = ok[step]
    return ok


def set_aside_files(directory: str) -> list[str]:
    """The step files set aside in a chain's directory, by name: ``*.damaged`` (a
    manager's restore, training/newest.py) and ``*.rolledback`` (chain/retention.py)."""
    return sorted(n for n in os.listdir(directory) if SET_ASIDE.fullmatch(n))
