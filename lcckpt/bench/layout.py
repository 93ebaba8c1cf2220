"""Chain layouts measured on real training runs: the bytes of every delta and the work of
every restore, for three ways of choosing each delta's base (docs/chain.md, "Layouts").

- ``chain``: every delta against the previous step (what a chain writes);
- ``keyframe``: every delta against the keyframe (any step is the keyframe plus one delta);
- ``skip``: delta ``i`` (counted from the keyframe) against step ``i`` with its lowest set
  bit cleared, as Subversion's skip deltas: a restore replays at most log2(n) + 1 deltas.

Each tensor is coded by the chain's own :class:`~lcckpt.DeltaEncoder` at the default
targets (relative to the movement since the keyframe, so the error bound of every step is
the same in the three layouts); the encoder of a base is copied for each delta taken
against it. A restore replays the keyframe and the deltas on its path with
:class:`~lcckpt.codec.delta.Reconstruction` (the fused replay), checked bit for bit
against the encoder's reference, and timed on the pool's threads.
"""

from __future__ import annotations

import copy
import statistics
import time

from ..chain.policy import DEFAULT_POLICY
from ..codec import blob as _blob
from ..codec.delta import DeltaEncoder, Reconstruction
from .quality import _role, make_trajectory, tensors_by_path

LAYOUTS = ("chain", "keyframe", "skip")


def base_of(layout: str, i: int) -> int:
    """The index (from the keyframe, 0) of the base of delta ``i`` >= 1."""
    if layout == "chain":
        return i - 1
    if layout == "keyframe":
        return 0
    return i & (i - 1)


def path_of(layout: str, i: int) -> list[int]:
    """The deltas a restore of ``i`` replays after the keyframe, oldest first."""
    out = []
    while i:
        out.append(i)
        i = base_of(layout, i)
    return out[::-1]


def _tracked(snapshot) -> dict:
    return {k: t for k, t in tensors_by_path(snapshot)
            if t.is_floating_point() and t.numel() >= 8}


def run_layout(states: list[dict], layout: str, repeats: int = 3):
    """Code ``states`` (the keyframe first) in ``layout``; yields, for each delta ``i``,
    its blobs' bytes and its restore time, after checking that the restore rebuilds the
    encoder's reference bit for bit."""
    encoders, blobs = {0: {}}, {0: {}}
    for key, t in states[0].items():
        enc = DeltaEncoder(target=getattr(DEFAULT_POLICY, _role(key)), relative_to="movement")
        blobs[0][key] = enc.encode(t)
        encoders[0][key] = enc
    last_use = {base_of(layout, i): i for i in range(1, len(states))}
    for i in range(1, len(states)):
        b = base_of(layout, i)
        encoders[i], blobs[i] = {}, {}
        for key, t in states[i].items():
            enc = copy.deepcopy(encoders[b][key])
            blobs[i][key] = enc.encode(t)
            encoders[i][key] = enc
        got = restore(blobs, layout, i)
        for key, enc in encoders[i].items():
            if not (got[key] == enc.ref).all():
                raise AssertionError(f"{layout}: delta {i} {key} does not restore bit for bit")
        del got
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            restore(blobs, layout, i)
            times.append(time.perf_counter() - t0)
        yield sum(_blob.nbytes([x]) for x in blobs[i].values()), statistics.median(times)
        for j in [j for j in encoders if last_use.get(j, j) <= i and j != i]:
            del encoders[j]                      # no later delta is taken against j


def restore(blobs: dict, layout: str, i: int) -> dict:
    """Every tracked tensor of step ``i``: the keyframe and the deltas of its path."""
    recs = {}
    for key, kb in blobs[0].items():
        rec = Reconstruction()
        rec.apply(kb)
        for j in path_of(layout, i):
            rec.apply(blobs[j][key])
        recs[key] = rec
    return {k: r.ref for k, r in recs.items()}


def measure(workload: str, repeats: int = 3, log=print) -> dict:
    traj = make_trajectory(workload)
    states = [_tracked(s) for _, s in traj.snapshots]
    first = next(i for i, s in enumerate(states) if s.keys() == states[-1].keys())
    states = states[first:]           # from the first checkpoint that holds every tensor
    fp32 = sum(4 * t.numel() for t in states[0].values())
    out = {}
    for layout in LAYOUTS:
        sizes, times = zip(*run_layout(states, layout, repeats))
        depths = [len(path_of(layout, i)) for i in range(1, len(states))]
        r = out[layout] = {"delta_bytes": sum(sizes), "ratio": len(sizes) * fp32 / sum(sizes),
                           "mean_depth": statistics.mean(depths), "max_depth": max(depths),
                           "mean_restore_s": statistics.mean(times),
                           "max_restore_s": max(times)}
        log(f"{workload:15} {layout:9} deltas {r['ratio']:6.1f}x  depth mean "
            f"{r['mean_depth']:5.2f} max {r['max_depth']:2d}  restore mean "
            f"{1e3 * r['mean_restore_s']:7.1f} ms  max {1e3 * r['max_restore_s']:7.1f} ms")
    return out


def main(argv=None) -> int:
    import argparse
    import json

    from .quality import WORKLOADS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=["cnn-sgd", "cnn-adam"],
                    help="training runs (the MiniLM ones need the finetune extra and ~14 GB)")
    ap.add_argument("--repeats", type=int, default=3, help="timed restores per step (median)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    result = {w: measure(w, args.repeats) for w in args.workloads}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0
