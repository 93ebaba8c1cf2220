"""Restore time of a default chain's steps against ``torch.load`` of the same state.

    python benchmarks/restore.py [--model mlp|minilm] [--deltas 10] [--rounds 5]
                                 [--every-step | --restart] [--json OUT]

The state is ``benchmarks/save.py``'s: the ~20M-parameter MLP under Adam (or the MiniLM-L6
fine-tune under AdamW), a keyframe and ``--deltas`` deltas written by a default
``DeltaCheckpointer``, and ``torch.save`` of each step's state. Then ``--rounds`` rounds in
which ``DeltaCheckpointer.load()`` of the newest step and ``torch.load`` of its state take
turns, files in the page cache; medians, and the median of the per-round ratios. With
``--every-step``, every step of the chain so (the keyframe and each delta), then the
median over the steps of their ratios and the worst step. With ``--restart``, a
restart instead: a new writer loads the newest step and saves the next one, once with
``load(resume=True)`` (the writer keeps the references the load decoded) and once with a
plain load (its first save replays the chain again), taking turns. To compare two versions of
lcckpt, write the chain once (``--dir D --keep``) and time it with each (``--dir D
--reuse``, the other version first on ``PYTHONPATH``), taking turns.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lcckpt  # noqa: E402
from lcckpt.bench.timing import environment  # noqa: E402
from save import _trajectory  # noqa: E402


def write(d: str, model: str, deltas: int) -> None:
    """The chain (keyframe + ``deltas`` deltas) and ``torch.save`` of each step's state
    (``torch-<step>.pt``) into ``d``."""
    snaps, _, _ = _trajectory(model, deltas + 1)
    snaps = snaps[1: deltas + 3]             # the optimizer's state exists from here on
    with lcckpt.DeltaCheckpointer(os.path.join(d, "chain")) as ck:
        for step, state in snaps[:-1]:
            ck.save(step, state)
            torch.save(state, _torch_file(d, step))
    torch.save(snaps[-1], os.path.join(d, "next.pt"))     # what a restart saves next


def _torch_file(d: str, step: int) -> str:
    return os.path.join(d, f"torch-{step}.pt")


def measure_step(ck, path: str, step: int, rounds: int) -> dict:
    """``ck.load(step)`` and ``torch.load(path)`` taking turns, after one untimed each
    (the files into the page cache, kernels loaded)."""
    load = lambda: torch.load(path, weights_only=True)      # noqa: E731
    ck.load(step)
    load()
    times = {"restore": [], "torch.load": []}
    for _ in range(rounds):
        for k, fn in (("restore", lambda: ck.load(step)), ("torch.load", load)):
            t = time.perf_counter()
            out = fn()
            times[k].append(time.perf_counter() - t)
            del out
    ratios = [a / b for a, b in zip(times["restore"], times["torch.load"])]
    return {"step": step, "restore_s": statistics.median(times["restore"]),
            "torch_load_s": statistics.median(times["torch.load"]),
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "rounds": times}


def measure(d: str, rounds: int, every_step: bool = False) -> dict:
    ck = lcckpt.DeltaCheckpointer(os.path.join(d, "chain"))
    steps = ck.steps()
    rows = [measure_step(ck, _torch_file(d, s), s, rounds)
            for s in (steps if every_step else steps[-1:])]
    out = {"steps": steps, **rows[-1], "per_step": rows}
    if every_step:
        worst = max(rows, key=lambda r: r["ratio_median"])
        out.update(ratio_over_steps=statistics.median(r["ratio_median"] for r in rows),
                   worst_step=worst["step"], worst_ratio=worst["ratio_median"])
    return out


def measure_restart(d: str, rounds: int) -> dict:
    """A restart, ``rounds`` times after an untimed one: a new writer loads the newest step
    and saves the next, with ``load(resume=True)`` and with a plain load, taking turns."""
    chain = os.path.join(d, "chain")
    step, state = torch.load(os.path.join(d, "next.pt"), weights_only=True)
    times = {m: {"load": [], "save": [], "total": []} for m in ("plain", "resume")}
    for r in range(rounds + 1):
        for mode, t in times.items():
            w = lcckpt.DeltaCheckpointer(chain)
            t0 = time.perf_counter()
            obj = w.load(resume=mode == "resume")
            t1 = time.perf_counter()
            w.save(step, state)
            t2 = time.perf_counter()
            w.close()
            os.remove(w.path(step))
            del obj, w
            if r:
                for k, v in (("load", t1 - t0), ("save", t2 - t1), ("total", t2 - t0)):
                    t[k].append(v)
    ratios = [a / b for a, b in zip(times["resume"]["total"], times["plain"]["total"])]
    return {"restart": {m: {k: statistics.median(v) for k, v in t.items()}
                        for m, t in times.items()},
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "rounds": times}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("mlp", "minilm"), default="mlp")
    ap.add_argument("--deltas", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where the chain is written (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep --dir afterwards")
    ap.add_argument("--reuse", action="store_true", help="time the chain already in --dir")
    ap.add_argument("--every-step", action="store_true",
                    help="time every step of the chain, not only the newest")
    ap.add_argument("--restart", action="store_true",
                    help="time a restart (load, then the next save) with and without resume")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.reuse and a.dir is None:
        ap.error("--reuse needs --dir")
    d = a.dir or tempfile.mkdtemp(prefix="lcckpt-bench-")
    try:
        if not a.reuse:
            os.makedirs(d, exist_ok=True)
            write(d, a.model, a.deltas)
        lcckpt.warmup()
        torch.set_num_threads(max(1, torch.get_num_threads()))
        res = measure_restart(d, a.rounds) if a.restart else measure(d, a.rounds, a.every_step)
    finally:
        if not (a.keep or a.reuse):
            shutil.rmtree(d, ignore_errors=True)
    if a.restart:
        for m, r in res["restart"].items():
            print(f"{a.model}: restart with a {m} load: load {r['load']:.3f} s, next save "
                  f"{r['save']:.3f} s, together {r['total']:.3f} s (median of {a.rounds})")
        print(f"{a.model}: resume / plain per round {res['ratio_median']:.2f}x "
              f"({res['ratio_min']:.2f}-{res['ratio_max']:.2f}x)")
        _dump(a, res)
        return 0
    steps = res["steps"]
    for r in res["per_step"]:
        depth = steps.index(r["step"])
        print(f"{a.model}: restore of step {r['step']} (keyframe + {depth} deltas) "
              f"{r['restore_s']:.3f} s, torch.load {r['torch_load_s']:.3f} s; per round "
              f"{r['ratio_median']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}x), "
              f"median of {a.rounds}")
    if a.every_step:
        print(f"{a.model}: over the {len(steps)} steps, median {res['ratio_over_steps']:.2f}x "
              f"torch.load; worst step {res['worst_step']}, {res['worst_ratio']:.2f}x")
    _dump(a, res)
    return 0


def _dump(a, res: dict) -> None:
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"environment": environment(), "model": a.model, **res}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
