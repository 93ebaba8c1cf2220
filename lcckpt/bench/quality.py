"""Restore quality of delta chains: bytes against the accuracy and loss of every restore.

Six training runs, model and optimizer state checkpointed together, 41 checkpoints each:

- ``cnn-sgd`` / ``cnn-adam``: the digits CNN from scratch (SGD with momentum, Adam), a
  checkpoint every 5 of 200 steps;
- ``minilm-finetune``: all-MiniLM-L6-v2 (22.7M parameters, real pretrained weights) plus a
  linear head, fine-tuned with AdamW on a docstring-classification task
  (lcckpt/bench/finetune.py), a checkpoint every 3 of 120 steps;
- ``minilm-scratch``: the same network from random weights with a 10x learning rate;
- ``minilm-bf16``: the fine-tune with its weights and AdamW's moments in bf16 (no fp32
  master copy), as pure low-precision fine-tunes run;
- ``minilm-lora``: the fine-tune through rank-8 LoRA adapters on a frozen encoder, the
  whole model (frozen weights included) in every checkpoint.

Every setting is written as a real :class:`~lcckpt.DeltaCheckpointer` chain (the
"distributed" settings as a ``lcckpt.distributed.DistributedCheckpointer`` chain in one
process, or the ExCP-style baseline, lcckpt/bench/excp.py, on the AdamW/Adam runs), every
step is restored, and the restored model's held-out accuracy and loss are compared with
the true model's. Reported per setting: the delta files against the fp32 bytes of the
state they hold, the whole run (keyframes included) against ``torch.save`` of every
checkpoint, the worst accuracy drop, the worst loss change, and the worst restored error
against the movement since the keyframe (the default's bound), per role; and every
restore's accuracy and loss beside the true model's (``per_step`` in the JSON, printed
with ``--steps``).

The resume experiment trains once without interruption and again restoring model and
optimizer from the default chain 10 times, for 5 seeds, and reports the final held-out
accuracies. Sizes and accuracies are deterministic on one machine; no timing here.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import sys
import tempfile

import numpy as np
import torch

from ..chain.checkpointer import DeltaCheckpointer
from ..chain.policy import RolePolicy, role_of
from .checkpoint import trim_heap
from .timing import format_table

SETTINGS = {            # name -> DeltaCheckpointer keywords (keyframe_every=50 unless given)
    "default": dict(),
    "default, keyframe_every=20": dict(keyframe_every=20),
    "default, keyframe_every=10": dict(keyframe_every=10),
    "default, update 0.1": dict(target=RolePolicy(update=0.1)),
    "weights 0.003 (the default before)": dict(target=RolePolicy(weight=0.003)),
    # the family below is held to its movement alone (no update share)
    "movement alone (update 0)": dict(target=RolePolicy(update=0.0)),
    "weights 0.001 of movement": dict(target=RolePolicy(weight=0.001, update=0.0)),
    "weights 0.005 of movement": dict(target=RolePolicy(weight=0.005, update=0.0)),
    "weights 0.01 of movement": dict(target=RolePolicy(weight=0.01, update=0.0)),
    "weights 0.02 of movement": dict(target=RolePolicy(weight=0.02, update=0.0)),
    "weights 0.05 of movement": dict(target=RolePolicy(weight=0.05, update=0.0)),
    "0.01 of the norm (first default)": dict(target=RolePolicy(0.01, relative_to="norm")),
    "lc b=2": dict(bits=2, target=None),
    "lc b=3": dict(bits=3, target=None),
    "lc b=4": dict(bits=4, target=None),
    "lossless (every save a keyframe)": dict(keyframe_every=1),
    # the same run through lcckpt.distributed's chain on DCP (one process)
    "distributed default": dict(distributed=True),
    "distributed lc b=2": dict(distributed=True, bits=2),
}
QUICK_SETTINGS = ("default", "0.01 of the norm (first default)", "lc b=2", "lc b=4",
                  "lossless (every save a keyframe)")
EXCP = {"excp a=5e-5 b=2 (paper)": (5e-5, 2.0), "excp a=5e-4 b=1": (5e-4, 1.0),
        "excp a=5e-3 b=1": (5e-3, 1.0), "excp a=5e-6 b=0.5": (5e-6, 0.5)}
WORKLOADS = ("cnn-sgd", "cnn-adam", "minilm-finetune", "minilm-scratch", "minilm-bf16",
             "minilm-lora")
_NO_RESUME = ("minilm-scratch", "minilm-bf16")     # not in the default resume experiment


def _minilm(workload: str) -> dict:
    """``finetune`` keywords of a MiniLM workload."""
    return {"pretrained": workload != "minilm-scratch",
            "dtype": torch.bfloat16 if workload == "minilm-bf16" else None,
            "lora": 8 if workload == "minilm-lora" else 0}


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


def _role(path: str) -> str:
    last = path.rsplit("/", 1)[-1]
    return role_of(f'["{last}"]')


def _errors(true, restored, key) -> dict:
    """Per role: the worst ``||u - ũ|| / ||u||`` and ``||u - ũ|| / ||u - k||`` (``k``
    the keyframe's tensor, zeros for one absent there)."""
    got, base = dict(tensors_by_path(restored)), dict(tensors_by_path(key))
    out = {}
    for k, u in tensors_by_path(true):
        if not u.is_floating_point() or u.numel() == 0:
            continue
        u64, r64 = u.double(), got[k].double()
        e = float(torch.linalg.vector_norm(u64 - r64))
        nu = float(torch.linalg.vector_norm(u64))
        kk = base.get(k)
        moved = float(torch.linalg.vector_norm(u64 - kk.double())) if kk is not None \
            and kk.shape == u.shape else nu
        r = out.setdefault(_role(k), {"norm": 0.0, "movement": 0.0})
        r["norm"] = max(r["norm"], e / nu if nu else (0.0 if e == 0 else float("inf")))
        r["movement"] = max(r["movement"], e / moved if moved else (0.0 if e == 0 else float("inf")))
    return out


def _fp32_bytes(state) -> int:
    return sum(4 * t.numel() for _, t in tensors_by_path(state) if t.is_floating_point())


def torch_bytes(traj) -> list[int]:
    """``torch.save`` size of every checkpoint of ``traj``."""
    out = []
    for _, snap in traj.snapshots:
        buf = io.BytesIO()
        torch.save(snap, buf)
        out.append(buf.tell())
    return out


_TRUTH: dict = {}      # id(trajectory) -> (trajectory, {step: (accuracy, loss)})


class _Scores:
    """What the restores of one setting measured, folded into the reported numbers."""

    def __init__(self, traj):
        self.traj = traj
        self.truth = _TRUTH.setdefault(id(traj), (traj, {}))[1]   # shared by the settings
        self.drops, self.loss_changes, self.errors, self.steps = [], [], {}, []

    def add(self, step, restored, key):
        true = dict(self.traj.snapshots)[step]
        if step not in self.truth:
            self.truth[step] = _evaluate(self.traj, true["model"])
        acc, loss = self.truth[step]
        racc, rloss = _evaluate(self.traj, restored["model"])
        rec = {"step": step, "accuracy": float(acc), "restored_accuracy": float(racc),
               "loss": float(loss), "restored_loss": float(rloss)}
        self.steps.append(rec)
        self.drops.append(100 * (acc - racc))
        self.loss_changes.append(_change(rec))
        for role, e in _errors(true, restored, key).items():
            r = self.errors.setdefault(role, {"norm": 0.0, "movement": 0.0})
            for k in r:
                r[k] = max(r[k], e[k])

    def result(self, delta_bytes, fp32_bytes, total_bytes, torch_total) -> dict:
        return {"ratio": fp32_bytes / delta_bytes if delta_bytes else None,
                "whole_run_ratio": torch_total / total_bytes,
                "delta_bytes": delta_bytes, "total_bytes": total_bytes,
                "worst_drop_points": float(max(self.drops)),
                "worst_loss_rise_pct": float(max(self.loss_changes)),
                "worst_abs_loss_change_pct": float(max(np.abs(self.loss_changes))),
                "worst_error": self.errors,
                "per_step": self.steps}


def _evaluate(traj, model_state) -> tuple[float, float]:
    if hasattr(traj, "evaluate"):
        return traj.evaluate(model_state)
    return traj.accuracy(model_state), traj.loss(model_state)


def chain_quality(traj, settings: dict, torch_sizes: list[int] | None = None,
                  keyframe_every: int = 50) -> dict:
    """Write ``traj`` as one chain with ``settings``; restore every step and measure."""
    kw = dict(keyframe_every=keyframe_every)
    kw.update(settings)
    torch_sizes = torch_sizes or torch_bytes(traj)
    if kw.pop("distributed", False):
        return _distributed_quality(traj, kw, torch_sizes)
    scores = _Scores(traj)
    with tempfile.TemporaryDirectory() as d:
        ck = DeltaCheckpointer(d, **kw)
        delta_bytes = fp32_bytes = total = 0
        for step, snap in traj.snapshots:
            ck.save(step, snap)
            total += ck.last_save["nbytes"]
            if ck.last_save["kind"] == "delta" or (kw["keyframe_every"] == 1 and step):
                delta_bytes += ck.last_save["nbytes"]
                fp32_bytes += _fp32_bytes(snap)
        key = None
        for step, obj in ck.replay(max_bytes=None):     # the chain this run just wrote
            if ck.info(step)["kind"] == "keyframe":
                key = dict(traj.snapshots)[step]
            scores.add(step, obj, key)
    return scores.result(delta_bytes, fp32_bytes, total, sum(torch_sizes))


def _distributed_quality(traj, kw: dict, torch_sizes: list[int]) -> dict:
    """:func:`chain_quality` through ``lcckpt.distributed.DistributedCheckpointer`` (no
    process group: one rank writes every piece), each step loaded into a zeroed copy."""
    import warnings
    import lcckpt.distributed as ld
    scores = _Scores(traj)
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process")    # DCP's, each call
        ck = ld.DistributedCheckpointer(d, **kw)
        delta_bytes = fp32_bytes = total = 0
        for i, (step, snap) in enumerate(traj.snapshots):
            ck.save(step, snap)
            where = ck.path(step)
            nbytes = sum(os.path.getsize(os.path.join(where, f)) for f in os.listdir(where))
            total += nbytes
            if i % kw["keyframe_every"]:
                delta_bytes += nbytes
                fp32_bytes += _fp32_bytes(snap)
        key = None
        for i, (step, snap) in enumerate(traj.snapshots):
            back = zeroed(snap)
            ck.load(back, step=step)
            key = snap if i % kw["keyframe_every"] == 0 else key
            scores.add(step, back, key)
    return scores.result(delta_bytes, fp32_bytes, total, sum(torch_sizes))


def zeroed(v):
    """The state ``v`` with every tensor zeroed, other values kept (what a load fills in)."""
    if isinstance(v, torch.Tensor):
        return torch.zeros_like(v)
    if isinstance(v, dict):
        return {k: zeroed(x) for k, x in v.items()}
    if isinstance(v, list):
        return [zeroed(x) for x in v]
    return v


def excp_quality(traj, alpha: float, beta: float, names: list[str],
                 torch_sizes: list[int] | None = None) -> dict:
    """The ExCP-style baseline on ``traj`` (its first checkpoint stored exactly)."""
    from .excp import ExcpChain
    torch_sizes = torch_sizes or torch_bytes(traj)
    chain = ExcpChain(names, alpha, beta)
    scores = _Scores(traj)
    delta_bytes = fp32_bytes = total = 0
    key = traj.snapshots[0][1]
    for i, (step, snap) in enumerate(traj.snapshots):
        restored, nbytes = chain.save(snap)
        total += nbytes
        if i:
            delta_bytes += nbytes
            fp32_bytes += _fp32_bytes(snap)
        scores.add(step, restored, key)
    return scores.result(delta_bytes, fp32_bytes, total, sum(torch_sizes))


def make_trajectory(workload: str, minilm_steps: int = 120):
    """The run behind ``workload`` (one of :data:`WORKLOADS`), with 41 checkpoints (a
    MiniLM run cut to ``minilm_steps``: a checkpoint every 3)."""
    if workload.startswith("cnn-"):
        from .trajectory import train_trajectory
        return train_trajectory(model="cnn", optimizer=workload[4:], steps=200,
                                snapshot_every=5)
    from .finetune import finetune_trajectory
    return finetune_trajectory(steps=minilm_steps, snapshot_every=3, **_minilm(workload))


def _param_names(workload: str) -> list[str]:
    if workload.startswith("cnn-"):
        from .trajectory import SmallCNN
        return [n for n, _ in SmallCNN().named_parameters()]
    from .finetune import Classifier
    net = Classifier(False, _minilm(workload)["lora"])
    return [n for n, p in net.named_parameters() if p.requires_grad]   # what AdamW steps


def workload_quality(workload: str, settings: dict, excp: dict, log=None) -> dict:
    traj = make_trajectory(workload)
    sizes = torch_bytes(traj)
    rows = {}
    for name, kw in settings.items():
        rows[name] = chain_quality(traj, kw, sizes)
        if log:
            log(workload, name, rows[name])
    if "sgd" not in workload:
        names = _param_names(workload)
        for name, (a, b) in excp.items():
            rows[name] = excp_quality(traj, a, b, names, sizes)
            if log:
                log(workload, name, rows[name])
    return rows


def resume(workload: str, restarts: int = 10, seeds=(0, 1, 2, 3, 4), ck_kw=None) -> dict:
    """Final held-out accuracy after resuming from the chain ``restarts`` times, against
    an uninterrupted run, per seed (each seed its own initialisation and minibatches, the
    same in both runs): any perturbation sends training down another path, so the mean
    over seeds is what says whether restores cost accuracy."""
    runs = {}
    for seed in seeds:
        base = _train(workload, seed, (), ck_kw)
        steps, every = _schedule(workload)
        at = sorted({int(round(steps * (i + 1) / (restarts + 1) / every)) * every
                     for i in range(restarts)})
        runs[str(seed)] = {"uninterrupted": base, f"{restarts} restores": _train(
            workload, seed, at, ck_kw)}
    d = [100 * (r[f"{restarts} restores"] - r["uninterrupted"]) for r in runs.values()]
    return {"runs": runs, "mean_diff_points": float(np.mean(d)),
            "diff_range_points": [float(min(d)), float(max(d))]}


def _schedule(workload: str) -> tuple[int, int]:
    return (400, 10) if workload.startswith("cnn-") else (120, 3)


def _train(workload: str, seed: int, interrupt_at, ck_kw) -> float:
    """Train ``workload``, checkpointing into a default chain and restoring from it after
    each step in ``interrupt_at``; the final held-out accuracy."""
    steps, every = _schedule(workload)
    with tempfile.TemporaryDirectory() as d:
        ck = DeltaCheckpointer(d, **(ck_kw or {}))
        if workload.startswith("cnn-"):
            from .trajectory import train_with_restores
            return train_with_restores(steps, seed, workload[4:], interrupt_at,
                                       save=ck.save, restore=ck.load, save_every=every)
        from .finetune import train
        return train(steps, seed, interrupt_at=interrupt_at, restore=ck.load, save=ck.save,
                     save_every=every, **_minilm(workload))[0]


def run(workloads=WORKLOADS, quick: bool = False, plot: str | None = None,
        settings: dict | None = None, resume_workloads=None, log=None,
        excp: dict | None = None) -> dict:
    """Every setting on every workload, then the resume experiment."""
    if settings is None:
        settings = {k: SETTINGS[k] for k in QUICK_SETTINGS} if quick else SETTINGS
    if excp is None:
        excp = {} if quick else EXCP
    result = {"workloads": {}, "resume": {}}
    for w in workloads if settings or excp else ():     # none: the resume experiment only
        result["workloads"][w] = workload_quality(w, settings, excp, log)
        # the run's snapshots are freed, but the C heap keeps most of their pages (a
        # MiniLM run's 41 snapshots are 11 GB): give them back before the next run
        gc.collect()
        trim_heap()
    for w in (resume_workloads if resume_workloads is not None else
              ([] if quick else [w for w in workloads if w not in _NO_RESUME])):
        result["resume"][w] = resume(w)
    if plot:
        _plot(result, plot)
    return result


def merge(paths) -> dict:
    """The results of several runs in one: later files add settings and resumes."""
    out = {"workloads": {}, "resume": {}}
    for p in paths:
        with open(p) as f:
            r = json.load(f)
        for w, rows in r["workloads"].items():
            out["workloads"].setdefault(w, {}).update(rows)
        out["resume"].update(r["resume"])
    return out


def table(result: dict) -> str:
    out = []
    if not result["workloads"] and not result["resume"]:
        return "nothing measured"
    for w, rows in result["workloads"].items():
        lines = []
        for name, r in rows.items():
            err = r["worst_error"]
            lines.append({
                "setting": name,
                "deltas vs fp32": "-" if r["ratio"] is None else f"{r['ratio']:.1f}",
                "whole run vs torch.save": f"{r['whole_run_ratio']:.1f}",
                "worst acc. drop": f"{r['worst_drop_points']:.2f}",
                "worst loss rise %": f"{r['worst_loss_rise_pct']:+.2f}",
                "worst |loss change| %": f"{r['worst_abs_loss_change_pct']:.2f}",
                "weights err/movement": f"{err.get('weight', {}).get('movement', 0):.4f}"})
        out.append(f"{w}\n" + format_table(lines, list(lines[0])))
    for w, r in result["resume"].items():
        for seed, row in r["runs"].items():
            out.append(f"resume {w} seed {seed}: " + ", ".join(
                f"{k} {100 * v:.2f}%" for k, v in row.items()))
        lo, hi = r["diff_range_points"]
        out.append(f"resume {w}: final accuracy minus the uninterrupted run's, mean over "
                   f"{len(r['runs'])} seeds {r['mean_diff_points']:+.2f} points "
                   f"(range {lo:+.2f}..{hi:+.2f})")
    return "\n".join(out)


def step_table(result: dict, names) -> str:
    """Every restore of the settings ``names``: the true and the restored model's held-out
    accuracy and loss, step by step (runs written before these were kept have none)."""
    out = []
    for w, rows in result["workloads"].items():
        for name in names:
            steps = rows.get(name, {}).get("per_step")
            if not steps:
                continue
            lines = [{"step": r["step"], "accuracy %": f"{100 * r['accuracy']:.2f}",
                      "restored %": f"{100 * r['restored_accuracy']:.2f}",
                      "drop (points)": f"{100 * (r['accuracy'] - r['restored_accuracy']):.2f}",
                      "loss": f"{r['loss']:.4f}", "restored loss": f"{r['restored_loss']:.4f}",
                      "loss change %": f"{_change(r):+.2f}"} for r in steps]
            lost = sum(r["restored_accuracy"] < r["accuracy"] for r in steps)
            gained = sum(r["restored_accuracy"] > r["accuracy"] for r in steps)
            out.append(f"{w}, {name}: {len(steps)} restores, {lost} below the true model's "
                       f"accuracy, {gained} above\n" + format_table(lines, list(lines[0])))
    return "\n".join(out) if out else "no per-step results for those settings"


def _change(r: dict) -> float:
    return 100 * (r["restored_loss"] - r["loss"]) / r["loss"] if r["loss"] else 0.0


def _plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ws = list(result["workloads"])
    cols = min(2, len(ws))
    rows_n = -(-len(ws) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(6.2 * cols, 4.6 * rows_n), squeeze=False)
    for ax, w in zip(axes.flat, ws):
        top = 1.0
        for name, r in result["workloads"][w].items():
            if "keyframe_every" in name or name.startswith("distributed"):
                continue
            mk = "o" if name.startswith("lc") else "s" if "lossless" in name else \
                "D" if name.startswith("excp") else "*" if name == "default" else "^"
            x, y = r["whole_run_ratio"], max(r["worst_drop_points"], 0.0)
            top = max(top, y)
            ax.scatter(x, y, marker=mk, s=90 if name == "default" else 30)
            ax.annotate(name.replace(" of movement", "").replace(" (every save a keyframe)", "")
                        .replace("0.01 of the norm (first default)", "1% of norm"), (x, y),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.axhline(0.5, color="grey", lw=0.6, ls="--")
        ax.set_xscale("log")
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_ylim(bottom=-0.05, top=2.5 * top)     # room for the top point's name
        ax.margins(x=0.12)
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("whole run vs torch.save (x, log)")
        ax.set_ylabel("worst accuracy drop (points)")
        ax.set_title(w)
    for ax in list(axes.flat)[len(ws):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Restore quality of delta chains (bytes vs "
                                 "accuracy and loss, resume); see lcckpt/bench/quality.py.")
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    ap.add_argument("--quick", action="store_true",
                    help="five settings, no ExCP baseline, no resume experiment")
    ap.add_argument("--resume", nargs="*", choices=WORKLOADS, default=None,
                    help="the workloads of the resume experiment (default: all but "
                         "minilm-scratch and minilm-bf16; none with --quick)")
    ap.add_argument("--settings", nargs="*", choices=list(SETTINGS), metavar="NAME",
                    help="only these chain settings (names as in the table; none: only "
                         "the resume experiment)")
    ap.add_argument("--excp", nargs="*", choices=list(EXCP), metavar="NAME",
                    help="only these ExCP-style settings (none: skip the baseline)")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="measure nothing: print (and --plot) the results of earlier runs "
                         "(their --json files) together")
    ap.add_argument("--steps", nargs="+", metavar="NAME",
                    help="also print every restore of these settings (true and restored "
                         "accuracy and loss, step by step)")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--plot", help="write the bytes-vs-drop plot here (png)")
    args = ap.parse_args(argv)

    def log(w, name, r):
        print(f"{w:16s} {name:38s} deltas {r['ratio'] or 0:6.1f}x  whole "
              f"{r['whole_run_ratio']:5.1f}x  drop {r['worst_drop_points']:5.2f}  loss "
              f"{r['worst_loss_rise_pct']:+6.2f}%", file=sys.stderr, flush=True)
    if args.merge:
        result = merge(args.merge)
        if args.plot:
            _plot(result, args.plot)
        print(table(result))
        if args.steps:
            print(step_table(result, args.steps))
        return 0
    settings = None if args.settings is None else {k: SETTINGS[k] for k in args.settings}
    excp = None if args.excp is None else {k: EXCP[k] for k in args.excp}
    result = run(args.workloads, args.quick, args.plot, settings, args.resume, log, excp)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(table(result))
    if args.steps:
        print(step_table(result, args.steps))
    return 0
