"""Restore quality of delta chains: rate against the accuracy of every restored model.

On the digits CNN trajectories (SGD with momentum and Adam; model and optimizer state
saved together, a checkpoint every 10 steps, one keyframe then deltas) every setting is
written as a real :class:`~lcckpt.DeltaCheckpointer` chain, every step is restored, and
the restored model's held-out accuracy is compared with the true model's. Reported per
setting: compression of the delta files against the fp32 bytes of the state they hold,
the worst accuracy drop over all restores, and the worst restored-state error (relative
L2, per tensor, max over tensors and steps).

The resume experiment trains once without interruption and then again restoring model
and optimizer from the lossy chain 1, 5 and 10 times (same minibatches), and reports the
final accuracies. Timing is not measured here (see lcckpt/bench/codec.py).
"""

from __future__ import annotations

import argparse
import json
import tempfile

import numpy as np
import torch
from torch.nn import functional as F

from ..chain import DeltaCheckpointer
from ..policy import RolePolicy
from .timing import format_table
from .trajectory import SmallCNN, digits_data, train_trajectory

SETTINGS = {            # name -> DeltaCheckpointer keywords
    "lc b=1": dict(bits=1, target=None),
    "lc b=2 (LC default)": dict(bits=2, target=None),
    "lc b=3": dict(bits=3, target=None),
    "lc b=4": dict(bits=4, target=None),
    "lc b=2 huffman": dict(bits=2, coder="huffman", target=None),
    "lc b=2 eb=0.03": dict(bits=2, error_bound=0.03, target=None),
    "uniform 0.05": dict(target=0.05),
    "uniform 0.02": dict(target=0.02),
    "default (role targets 0.01/0.8/0.1)": dict(),
    "role targets 0.01/0.5/0.05": dict(target=RolePolicy(0.01, 0.5, 0.05)),
    "uniform 0.005": dict(target=0.005),
    "uniform 0.002": dict(target=0.002),
    "lossless (every save a keyframe)": dict(keyframe_every=1),
}


def tensors_by_path(obj, prefix=""):
    """Every tensor of a nested state, by key path."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors_by_path(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors_by_path(v, f"{prefix}/{i}")


def _state_error(true, restored) -> float:
    """Max over floating tensors of ||u - ũ||₂ / ||u||₂."""
    worst = 0.0
    got = dict(tensors_by_path(restored))
    for k, u in tensors_by_path(true):
        if not u.is_floating_point() or u.numel() == 0:
            continue
        u64, r64 = u.double(), got[k].double()
        nu = float(torch.linalg.vector_norm(u64))
        e = float(torch.linalg.vector_norm(u64 - r64))
        worst = max(worst, e / nu if nu else (0.0 if e == 0 else float("inf")))
    return worst


def chain_quality(traj, settings: dict, keyframe_every: int = 50) -> dict:
    """Write ``traj`` as one chain with ``settings``; restore every step and measure."""
    kw = dict(keyframe_every=keyframe_every)
    kw.update(settings)
    with tempfile.TemporaryDirectory() as d:
        ck = DeltaCheckpointer(d, **kw)
        delta_bytes = fp32_bytes = 0
        for step, snap in traj.snapshots:
            ck.save(step, snap)
            if ck.last_save["kind"] == "delta" or kw["keyframe_every"] == 1:
                if step == traj.snapshots[0][0] and kw["keyframe_every"] == 1:
                    continue                          # the first save is a keyframe anyway
                delta_bytes += ck.last_save["nbytes"]
                fp32_bytes += sum(4 * t.numel() for _, t in tensors_by_path(snap)
                                  if t.is_floating_point())
        drops, errors = [], []
        snaps = dict(traj.snapshots)
        for step, obj in ck.replay():
            true = snaps[step]
            drops.append(100 * (traj.accuracy(true["model"]) - traj.accuracy(obj["model"])))
            errors.append(_state_error(true, obj))
    return {"ratio": fp32_bytes / delta_bytes if delta_bytes else None,
            "delta_bytes": delta_bytes,
            "worst_drop_points": float(max(drops)),
            "mean_abs_drop_points": float(np.mean(np.abs(drops))),
            "worst_state_error": float(max(errors))}


def _train(steps, seed, optimizer, lr, interrupt_at=(), ck_kw=None, save_every=10):
    """Train the CNN; at each step in ``interrupt_at`` replace model and optimizer by
    what the chain restores of the newest save. Returns the final test accuracy."""
    x_tr, y_tr, x_te, y_te = digits_data()
    torch.manual_seed(seed)
    net = SmallCNN()

    def make_opt(params):
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=0.9)
        return torch.optim.Adam(params, lr=lr)

    opt = make_opt(net.parameters())
    gen = torch.Generator().manual_seed(seed)
    order = torch.empty(0, dtype=torch.long)
    with tempfile.TemporaryDirectory() as d:
        ck = DeltaCheckpointer(d, keyframe_every=50, **(ck_kw or {}))
        for step in range(1, steps + 1):
            if len(order) < 64:
                order = torch.randperm(len(x_tr), generator=gen)
            idx, order = order[:64], order[64:]
            net.train()
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(x_tr[idx]), y_tr[idx]).backward()
            opt.step()
            if step % save_every == 0:
                ck.save(step, {"model": net.state_dict(), "optim": opt.state_dict()})
            if step in interrupt_at:
                state = ck.load()
                net = SmallCNN()
                net.load_state_dict(state["model"])
                opt = make_opt(net.parameters())
                opt.load_state_dict(state["optim"])
    net.eval()
    with torch.no_grad():
        return float((net(x_te).argmax(1) == y_te).float().mean())


def resume(optimizer: str, steps: int = 400, restarts=(1, 5, 10), ck_kw=None,
           seeds=(0, 1, 2, 3, 4)) -> dict:
    """Final accuracy after resuming from lossy restores ``k`` times, against none.

    One seed's difference is mostly chance: any perturbation of the state, however
    small, sends training down another path, and on 450 test images one image is 0.22
    points. ``mean_diff_points`` therefore averages over ``seeds`` (each seed its own
    initialisation and minibatch order, the same in the interrupted runs)."""
    lr = 0.05 if optimizer == "sgd" else 1e-3
    out = {"steps": steps, "runs": {}, "mean_diff_points": {}, "diff_range_points": {}}
    for seed in seeds:
        base = _train(steps, seed, optimizer, lr, ck_kw=ck_kw)
        row = {"uninterrupted": base}
        for k in restarts:
            at = {int(round(steps * (i + 1) / (k + 1) / 10)) * 10 for i in range(k)}
            acc = _train(steps, seed, optimizer, lr, interrupt_at=at, ck_kw=ck_kw)
            row[f"{k} restores"] = acc
        out["runs"][str(seed)] = row
    for k in restarts:
        d = [100 * (r[f"{k} restores"] - r["uninterrupted"]) for r in out["runs"].values()]
        out["mean_diff_points"][f"{k} restores"] = float(np.mean(d))
        out["diff_range_points"][f"{k} restores"] = [float(min(d)), float(max(d))]
    return out


def run(quick: bool = False, plot: str | None = None, settings: dict | None = None,
        resume_steps: int = 400) -> dict:
    """Every setting on both trajectories, then the resume experiment."""
    settings = SETTINGS if settings is None else settings
    result = {"trajectories": {}, "resume": {}}
    for optimizer in ("sgd", "adam"):
        traj = train_trajectory(model="cnn", optimizer=optimizer, steps=200, snapshot_every=10)
        rows = {name: chain_quality(traj, kw) for name, kw in settings.items()}
        for name in [n for n in rows if n.startswith("lc b=") and "eb" not in n]:
            # the uniform quantizer held to the worst restored error LC reached
            t = min(rows[name]["worst_state_error"], 0.99)
            rows[f"uniform at {name}'s error"] = r = chain_quality(traj, dict(target=t))
            r["target"] = t
        result["trajectories"][optimizer] = rows
        if not quick:
            result["resume"][optimizer] = resume(optimizer, resume_steps)
    if plot:
        _plot(result, plot)
    return result


def table(result: dict) -> str:
    rows = []
    names = list(next(iter(result["trajectories"].values())))
    for name in names:
        s, a = result["trajectories"]["sgd"][name], result["trajectories"]["adam"][name]
        rows.append({"setting": name,
                     "deltas vs fp32 (SGD / Adam)": f"{s['ratio']:.1f} / {a['ratio']:.1f}",
                     "worst acc. drop, points": f"{s['worst_drop_points']:.2f} / "
                                                f"{a['worst_drop_points']:.2f}",
                     "worst state error": f"{s['worst_state_error']:.4f} / "
                                          f"{a['worst_state_error']:.4f}"})
    out = format_table(rows, list(rows[0]))
    for opt, r in result["resume"].items():
        for seed, row in r["runs"].items():
            out += f"\nresume {opt} seed {seed}: " + ", ".join(
                f"{k} {100 * v:.2f}%" for k, v in row.items())
        out += f"\nresume {opt}, final accuracy minus the uninterrupted run's, mean over " \
               f"{len(r['runs'])} seeds (range): " + ", ".join(
                   f"{k} {v:+.2f} ({r['diff_range_points'][k][0]:+.2f}..{r['diff_range_points'][k][1]:+.2f})"
                   for k, v in r["mean_diff_points"].items())
    return out


def _plot(result: dict, path: str) -> None:
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for col, opt in enumerate(("sgd", "adam")):
        rows = result["trajectories"][opt]
        for name, r in rows.items():
            if r["ratio"] is None or name.startswith("uniform at") or "huffman" in name:
                continue                  # the table has them; they crowd the plot
            mk = "o" if name.startswith("lc") else ("s" if "lossless" in name else "^")
            for row, (key, label) in enumerate((("worst_drop_points", "worst accuracy drop (points)"),
                                                ("worst_state_error", "worst restored-state error"))):
                ax = axes[row][col]
                ax.scatter(r["ratio"], max(r[key], 1e-4 if row else -1), marker=mk)
                ax.annotate(name, (r["ratio"], max(r[key], 1e-4 if row else -1)), fontsize=7)
                ax.set_xlabel("deltas vs fp32 (x)")
                ax.set_ylabel(label)
                ax.set_title(f"CNN, {opt}")
                ax.set_xscale("log")
                ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
                if row:
                    ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Restore quality of delta chains (rate vs accuracy, resume); see lcckpt/bench/quality.py.")
    ap.add_argument("--quick", action="store_true", help="skip the resume experiment")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--plot", help="write the rate-distortion plot here (png)")
    args = ap.parse_args(argv)
    result = run(quick=args.quick, plot=args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(table(result))
    return 0
