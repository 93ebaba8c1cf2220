"""How often a restored step's movement misses its target, over many seeds.

The property behind ``tests/test_movement.py::test_no_update_is_dropped_silently``, run on
a range of seeds instead of a search (``python benchmarks/movement.py``): a chain of one
tensor (a keyframe, then ``--steps`` deltas of ``--rel`` of its norm each), written with
weights held to ``--target`` of their movement (and ``--update`` of each delta's update:
0, the movement alone, by default), every step restored and
``||(restored - k) - (u - k)||`` compared with
``max(target * ||u - k||, update * ||u - restored previous step||)``. A large tensor's
movement is estimated from a sketch after the first delta (lcckpt/codec/movement.py);
this counts the steps that the estimate let pass the target, and by how much.
"""

import argparse
import sys
import tempfile
import warnings

import numpy as np
import torch

from lcckpt import DeltaCheckpointer, RolePolicy


def states(n, rel, count, seed, kind):
    """The keyframe and ``count`` states of one tensor moving by ``rel`` of its norm per
    step: a ``"drift"``, a random ``"walk"``, or a few ``"rows"`` (an embedding)."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal(n).astype(np.float32)
    scale = rel * np.linalg.norm(k.astype(np.float64)) / np.sqrt(n)
    u, drift, out = k.copy(), rng.standard_normal(n), []
    for _ in range(count):
        if kind == "drift":
            step = drift
        elif kind == "walk":
            step = rng.standard_normal(n)
        else:
            step = np.zeros(n)
            r = rng.integers(0, n // 64)
            step[r * 64:(r + 1) * 64] = rng.standard_normal(64) * np.sqrt(n / 64)
        u = (u + scale * step).astype(np.float32)
        out.append(u.copy())
    return k, out


def misses(n, rel, kind, target, update, seed, count):
    """``[(step, restored error / allowed error)]`` of the steps above their target."""
    k, us = states(n, rel, count, seed, kind)
    k64, out = k.astype(np.float64), []
    prev = k64
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ck = DeltaCheckpointer(d, keyframe_every=None,
                               target=RolePolicy(weight=target, update=update))
        ck.save(0, {"w": torch.from_numpy(k)})
        for s, u in enumerate(us, 1):
            ck.save(s, {"w": torch.from_numpy(u)})
        for s, u in enumerate(us, 1):
            true, r = u.astype(np.float64) - k64, ck.load(s)["w"].numpy().astype(np.float64)
            allowed = max(target * np.linalg.norm(true),
                          update * np.linalg.norm(u.astype(np.float64) - prev))
            q = float(np.linalg.norm((r - k64) - true) / allowed)
            prev = r
            if q > 1 + 1e-6:
                out.append((s, q))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] + " See "
                                 "lcckpt/bench/movement.py.")
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--rel", type=float, default=1e-4)
    ap.add_argument("--kind", choices=["rows", "walk", "drift"], default="rows")
    ap.add_argument("--target", type=float, default=0.01)
    ap.add_argument("--update", type=float, default=0.0, help="the update share (0: none)")
    ap.add_argument("--seeds", default="0:1600", help="first:last (last excluded)")
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args(argv)
    lo, hi = (int(v) for v in a.seeds.split(":"))
    found = []
    for seed in range(lo, hi):
        found += [(seed, s, q) for s, q in misses(a.n, a.rel, a.kind, a.target, a.update,
                                                  seed, a.steps)]
        if (seed - lo + 1) % 100 == 0:
            print(f"  {seed - lo + 1}/{hi - lo} seeds, {len(found)} steps above target",
                  file=sys.stderr, flush=True)
    seeds = sorted({f[0] for f in found})
    print(f"{hi - lo} seeds x {a.steps} steps ({a.kind}, n={a.n}, rel={a.rel:g}, "
          f"target={a.target:g}, update={a.update:g}): {len(found)} steps of "
          f"{len(seeds)} seeds above the target")
    for seed, s, q in found:
        print(f"  seed {seed} step {s}: {q:.5f} x the allowed error")
    return 0
