"""Restore time against a step's depth in its chain, for a state of many tensors.

    python benchmarks/depth.py [--tensors 300] [--rows 256] [--depth 49] [--at 1,10,25,49]

A synthetic state (``--tensors`` fp32 matrices of ``--rows`` x 256, N(0, 1)) moves by a
random walk (N(0, 1e-3) per element per step) and is saved by a default
``DeltaCheckpointer`` at every step, a keyframe and ``--depth`` deltas; then each step of
``--at`` is restored (median of 3, a new checkpointer each time, files in the page cache)
and compared with ``torch.load`` of the same state. The point is the cost per step of
depth and per tensor (every delta of every tensor is parsed and replayed); random walks
are not training, so the bytes are not the point.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lcckpt  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=300)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--depth", type=int, default=49)
    ap.add_argument("--at", default="1,10,25,49")
    a = ap.parse_args()
    at = [int(x) for x in a.at.split(",") if int(x) <= a.depth]
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(a.rows, 256, generator=g) for i in range(a.tensors)}
    with tempfile.TemporaryDirectory() as d:
        ck = lcckpt.DeltaCheckpointer(os.path.join(d, "run"))
        for step in range(a.depth + 1):
            if step:
                for v in state.values():
                    v.add_(torch.randn(v.shape, generator=g).mul_(1e-3))
            ck.save(step, state)
        torch.save(state, os.path.join(d, "state.pt"))

        def median(fn):
            times = []
            for _ in range(3):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return statistics.median(times)
        base = median(lambda: torch.load(os.path.join(d, "state.pt")))
        mb = sum(v.numel() * 4 for v in state.values()) / 1e6
        print(f"{a.tensors} tensors, {mb:.0f} MB; torch.load {base:.3f} s")
        for step in at:
            t = median(lambda: lcckpt.DeltaCheckpointer(os.path.join(d, "run")).load(step))
            print(f"  step {step:3d} (depth {step}): {t:.3f} s, {t / base:.1f}x torch.load")
    return 0


if __name__ == "__main__":
    sys.exit(main())
