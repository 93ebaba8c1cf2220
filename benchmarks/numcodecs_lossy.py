"""The lossy numcodecs codec on ordinary arrays: bytes and error at each target.

    python benchmarks/numcodecs_lossy.py [--targets 1e-2 3e-3 1e-3 1e-4 1e-5] [--json]

Arrays: the digits CNN's weights after 200 SGD steps (lcckpt.bench.trajectory, all its
floating tensors joined) and, with the ``finetune`` extra, all-MiniLM-L6-v2's pretrained
fp32 weights joined. For each target, ``LcckptLossy(target=t)``'s blob (the smaller of the
uniform quantizer's and the exact blob of the array rounded to fewer mantissa bits) against
the uniform quantizer's alone (``lcckpt.encode(x, target=t)``, which stores an array
exactly when most of its elements would be escapes) and the exact blob: fp32 bytes over
blob bytes, the restored relative L2 error, and encode MB/s of fp32 input (the median of
``--reps``; the codec codes both blobs and keeps the smaller). Sizes are deterministic.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lcckpt  # noqa: E402
from lcckpt.bench.timing import format_table, median_time  # noqa: E402
from lcckpt.numcodecs import LcckptLossy  # noqa: E402


def arrays() -> dict:
    from lcckpt.bench.trajectory import train_trajectory
    run = train_trajectory(model="cnn", optimizer="sgd", steps=200, snapshot_every=200)
    snap = run.snapshots[-1][1]
    out = {"digits CNN (SGD, 200 steps)": np.concatenate(
        [v.detach().reshape(-1).float().numpy() for v in snap["model"].values()
         if v.is_floating_point()])}
    try:
        from lcckpt.bench.finetune import load_encoder
    except ImportError:
        return out
    try:
        model, _ = load_encoder()
    except ImportError as e:
        print(f"(MiniLM left out: {e})", file=sys.stderr)
        return out
    out["all-MiniLM-L6-v2 (pretrained)"] = np.concatenate(
        [v.reshape(-1).numpy() for v in model.state_dict().values() if v.is_floating_point()])
    return out


def _err(x: np.ndarray, y: np.ndarray) -> float:
    x64 = x.astype(np.float64)
    return float(np.linalg.norm(y.astype(np.float64) - x64) / np.linalg.norm(x64))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", type=float, nargs="+", default=[1e-2, 3e-3, 1e-3, 1e-4, 1e-5])
    ap.add_argument("--reps", type=int, default=3, help="timed encodes of each (median)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)
    rows = []
    for name, x in arrays().items():
        exact = len(lcckpt.encode(x, lossless=True))
        for t in args.targets:
            codec = LcckptLossy(target=t)
            blob = codec.encode(x)
            alone = lcckpt.encode(x, target=t)
            rows.append({"array": name, "elements": int(x.size), "target": t,
                         "codec_x": round(x.nbytes / len(blob), 3),
                         "codec_err": _err(x, codec.decode(blob)),
                         "uniform_x": round(x.nbytes / len(alone), 3),
                         "uniform_err": _err(x, lcckpt.decode(alone)),
                         "exact_x": round(x.nbytes / exact, 3),
                         "codec_MBps": round(x.nbytes / 1e6 / median_time(
                             lambda: codec.encode(x), args.reps), 1),
                         "uniform_MBps": round(x.nbytes / 1e6 / median_time(
                             lambda: lcckpt.encode(x, target=t), args.reps), 1)})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(format_table(rows, ["array", "target", "codec_x", "codec_err", "uniform_x",
                              "uniform_err", "exact_x", "codec_MBps", "uniform_MBps"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
