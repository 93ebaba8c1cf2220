"""Restore time of a default chain's newest step against ``torch.load`` of the same state.

    python benchmarks/restore.py [--model mlp|minilm] [--deltas 10] [--rounds 5] [--json OUT]

The state is ``benchmarks/save.py``'s: the ~20M-parameter MLP under Adam (or the MiniLM-L6
fine-tune under AdamW), a keyframe and ``--deltas`` deltas written by a default
``DeltaCheckpointer``, and ``torch.save`` of the last state. Then ``--rounds`` rounds in
which ``DeltaCheckpointer.load()`` and ``torch.load`` take turns, files in the page cache;
medians, and the median of the per-round ratios. To compare two versions of lcckpt, write
the chain once (``--dir D --keep``) and time it with each (``--dir D --reuse``, the
other version first on ``PYTHONPATH``), taking turns.
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
    """The chain (keyframe + ``deltas`` deltas) and ``last.pt`` into ``d``."""
    snaps, _, _ = _trajectory(model, deltas)
    snaps = snaps[1: deltas + 2]             # the optimizer's state exists from here on
    with lcckpt.DeltaCheckpointer(os.path.join(d, "chain")) as ck:
        for step, state in snaps:
            ck.save(step, state)
    torch.save(snaps[-1][1], os.path.join(d, "last.pt"))


def measure(d: str, rounds: int) -> dict:
    ck = lcckpt.DeltaCheckpointer(os.path.join(d, "chain"))
    ck.load()                                # the files into the page cache, kernels loaded
    torch.load(os.path.join(d, "last.pt"), weights_only=True)
    times = {"restore": [], "torch.load": []}
    for _ in range(rounds):
        for k, fn in (("restore", ck.load),
                      ("torch.load", lambda: torch.load(os.path.join(d, "last.pt"),
                                                        weights_only=True))):
            t = time.perf_counter()
            out = fn()
            times[k].append(time.perf_counter() - t)
            del out
    ratios = [a / b for a, b in zip(times["restore"], times["torch.load"])]
    return {"steps": ck.steps(), "restore_s": statistics.median(times["restore"]),
            "torch_load_s": statistics.median(times["torch.load"]),
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
        res = measure(d, a.rounds)
    finally:
        if not (a.keep or a.reuse):
            shutil.rmtree(d, ignore_errors=True)
    print(f"{a.model}: restore of step {res['steps'][-1]} (keyframe + {len(res['steps']) - 1} "
          f"deltas) {res['restore_s']:.3f} s, torch.load {res['torch_load_s']:.3f} s; per round "
          f"{res['ratio_median']:.2f}x ({res['ratio_min']:.2f}-{res['ratio_max']:.2f}x), "
          f"median of {a.rounds}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"environment": environment(), "model": a.model, **res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
