"""What a keyframe held to fewer mantissa bits would save, and what it would cost a
restore (a measurement; the library's keyframes stay exact).

A chain's first keyframe is coded losslessly: about 1.2x smaller than fp32 on a random
init or a pretrained model, a sixth of the digits CNN's whole-run bytes. Here the first
snapshot's fp32 tensors are rounded to ``keep`` mantissa bits (round half up on the bit
pattern) before the default chain stores them, exactly: the low byte planes are then
zero, which the exact codec stores almost for free, and the next delta, taken against
that rounded reference, carries the rounding back to the true state as part of its
update. Every step is restored and scored against the true run (its exact first
snapshot too), as ``benchmarks/quality.py`` does.

    python benchmarks/keyframe_precision.py [--workload cnn-sgd] [--keep none 16 12 10 8]
                                            [--minilm-steps 120]
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from lcckpt import DeltaCheckpointer
from lcckpt.bench.quality import WORKLOADS, _Scores, make_trajectory, torch_bytes


def rounded(t, keep: int):
    """An fp32 tensor's values with ``keep`` mantissa bits; anything else as it is."""
    if not (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() >= 8):
        return t
    drop = 23 - keep
    bits = t.contiguous().view(torch.int32)
    return (((bits + (1 << (drop - 1))) >> drop) << drop).view(torch.float32)


def _walk(obj, keep: int):
    if isinstance(obj, dict):
        return {k: _walk(v, keep) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_walk(v, keep) for v in obj)
    return rounded(obj, keep)


def run(traj, keep: int | None, torch_total: int) -> dict:
    """The default chain of ``traj`` with its keyframe rounded to ``keep`` bits (None:
    exact), every step restored and scored against the true run."""
    scores = _Scores(traj)
    with tempfile.TemporaryDirectory() as d:
        ck, total = DeltaCheckpointer(d, keyframe_every=50), 0
        for i, (step, snap) in enumerate(traj.snapshots):
            ck.save(step, _walk(snap, keep) if i == 0 and keep is not None else snap)
            total += ck.last_save["nbytes"]
        key = traj.snapshots[0][1]
        for step, obj in ck.replay(max_bytes=None):
            scores.add(step, obj, key)
        ck.close()
    return scores.result(1, 0, total, torch_total)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="cnn-sgd", choices=WORKLOADS)
    ap.add_argument("--keep", nargs="+", default=["none", "16", "12", "10", "8"],
                    help="mantissa bits kept in the keyframe ('none': exact)")
    ap.add_argument("--minilm-steps", type=int, default=120)
    args = ap.parse_args(argv)
    traj = make_trajectory(args.workload, args.minilm_steps)
    torch_total = sum(torch_bytes(traj))
    for keep in args.keep:
        r = run(traj, None if keep == "none" else int(keep), torch_total)
        change = [100 * (s["restored_loss"] / s["loss"] - 1) for s in r["per_step"]]
        print(f"{args.workload}, keyframe mantissa {keep:>4} bits: {r['total_bytes']:,} bytes, "
              f"whole run {r['whole_run_ratio']:.2f}x; worst drop "
              f"{r['worst_drop_points']:.2f} points, loss rise {max(change):+.2f}%, change "
              f"either way {max(map(abs, change)):.2f}%", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
