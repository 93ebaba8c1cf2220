"""A Hugging Face ``Trainer`` fine-tune with :class:`lcckpt.training.hf.ChainCallback`:
what the chain costs against the Trainer's own checkpoints, and what its steps restore.

all-MiniLM-L6-v2 (the ``.[finetune]`` extra's real weights) as
``BertForSequenceClassification``, fine-tuned as the Trainer does by default (AdamW, a
linear schedule, dropout on) on the docstring task of :mod:`lcckpt.bench.finetune`, a
checkpoint every ``save_steps``. Each checkpoint directory the Trainer writes is sized
as it is written (``save_total_limit=1`` keeps one on disk), the live model is scored on
the held-out docstrings, and after training every chain step is restored and scored the
same way. Save times: the Trainer's ``_save_checkpoint`` against the callback's save
(with ``--background``, how long the callback held the loop: its host copy).

``--resume 10 30``: after the uninterrupted run, the run is resumed from each of those
chain steps (``export_checkpoint``, then ``train(resume_from_checkpoint=...)``) and
trained to the end; its final held-out accuracy and loss are set against the
uninterrupted run's. A second chain of exact keyframes is kept beside the first, to
resume from as the control and to measure the restored first moment's error as Adam
sees it: ``||(m̃ - m) / (√v + ε)|| / ||m / (√v + ε)||`` (each element's step divides its
first moment by the root of its second), beside its plain relative L2 error.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np
import torch

from ..chain.checkpointer import DeltaCheckpointer
from ..chain.policy import RolePolicy
from ..errors import InvalidArgumentError
from .timing import environment, format_table


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def _score(model, task) -> tuple[float, float]:
    """Held-out (accuracy, mean cross-entropy), in eval mode (no dropout, no RNG drawn)."""
    was = model.training
    model.eval()
    with torch.no_grad():
        out = model(input_ids=task.ids_test, attention_mask=task.mask_test, labels=task.y_test)
    model.train(was)
    return (out.logits.argmax(-1) == task.y_test).float().mean().item(), out.loss.item()


def _resumes(step, folder, make_args, data, chain, exact, d, task) -> dict:
    """The run resumed from ``step`` of ``chain`` and of ``exact``, each trained to the end
    and scored, with the restored first and second moments' errors at ``step``."""
    from transformers import BertForSequenceClassification, Trainer
    from ..training.hf import export_checkpoint
    from .finetune import MODULES
    res = {"step": step, **_moment_errors(DeltaCheckpointer(exact).load(step),
                                          DeltaCheckpointer(chain).load(step))}
    for name, src in (("chain", chain), ("exact", exact)):
        out = os.path.join(d, f"resumed-{name}-{step}")
        torch.manual_seed(0)
        model = BertForSequenceClassification.from_pretrained(folder, num_labels=len(MODULES))
        path = export_checkpoint(src, out + "-from", model, step=step)
        Trainer(model=model, args=make_args(out), train_dataset=data).train(
            resume_from_checkpoint=path)
        acc, loss = _score(model, task)
        res.update({f"{name}_accuracy": acc, f"{name}_loss": loss})
    return res


def _moment_errors(exact: dict, restored: dict) -> dict:
    """The restored ``exp_avg``'s relative L2 error, plainly and divided by √v + ε; and
    the 1st, 50th and 99th percentiles of ``√(ṽ / v)`` over the elements with ``v > 0``
    (a resumed step is ``√(v / ṽ)`` times the true one)."""
    num = den = num_n = den_n = 0.0
    ratios = []
    for k, st in exact["optimizer"]["state"].items():
        m, v = st["exp_avg"].double(), st["exp_avg_sq"].double()
        got = restored["optimizer"]["state"][k]
        d = got["exp_avg"].double() - m
        root = v.sqrt() + 1e-8
        num, den = num + float(d.square().sum()), den + float(m.square().sum())
        num_n += float((d / root).square().sum())
        den_n += float((m / root).square().sum())
        live = v > 0
        ratios.append((got["exp_avg_sq"].double()[live] / v[live]).sqrt().numpy())
    ratios = np.concatenate(ratios) if ratios else np.ones(1)
    p1, p50, p99 = np.percentile(ratios, [1, 50, 99]) if ratios.size else (1.0, 1.0, 1.0)
    return {"m1_err": (num / den) ** 0.5 if den else 0.0,
            "m1_err_adam": (num_n / den_n) ** 0.5 if den_n else 0.0,
            "m2_root_ratio": [float(p1), float(p50), float(p99)]}


def run(steps: int = 60, save_steps: int = 5, lr: float = 5e-5, directory: str | None = None,
        background: bool = False, replace: bool = False, resume: tuple[int, ...] = (),
        **options) -> dict:
    """Fine-tune, checkpointing through the Trainer and the callback; returns a JSON-able
    dict (``options``: DeltaCheckpointer keywords for the chain). ``chain_s`` is how long
    the callback held the loop at each save: the whole save, or with ``background`` the
    host copy (and any wait for the previous save). ``replace``: the chain instead of the
    Trainer's directories (their columns then stay empty). ``resume``: chain steps to
    resume the run from (see the module's docstring)."""
    from transformers import BertForSequenceClassification, Trainer, TrainingArguments
    from transformers.utils import logging
    from ..training.hf import ChainCallback
    from .finetune import MODULES, _pretrained, docstring_task

    if resume and replace:
        raise InvalidArgumentError("resume needs the Trainer's own saves beside the chain's "
                                   "(for the exact control chain): drop replace")
    logging.set_verbosity_error()
    task = docstring_task(0)
    folder = str(_pretrained()[2])
    record: dict[int, dict] = {}

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return len(task.y_train)

        def __getitem__(self, i):
            return {"input_ids": task.ids_train[i], "attention_mask": task.mask_train[i],
                    "labels": task.y_train[i]}

    class Timed(Trainer):
        def _save_checkpoint(self, model, trial):
            t0 = time.perf_counter()
            super()._save_checkpoint(model, trial)
            path = os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
            record[self.state.global_step] = {
                "trainer_s": time.perf_counter() - t0, "trainer_bytes": _dir_bytes(path)}

    class Chain(ChainCallback):
        def on_save(self, args, state, control, model=None, **kw):
            acc, loss = _score(model, task)
            record.setdefault(state.global_step, {"trainer_s": None, "trainer_bytes": None})
            t0 = time.perf_counter()
            super().on_save(args, state, control, model=model, **kw)
            record[state.global_step].update(chain_s=time.perf_counter() - t0,
                                             accuracy=acc, loss=loss)

        def _write(self, step, obj):
            super()._write(step, obj)
            record[step].update(chain_bytes=self.last_save["nbytes"],
                                kind=self.last_save["kind"])

    with tempfile.TemporaryDirectory(dir=directory) as d:
        torch.manual_seed(0)
        model = BertForSequenceClassification.from_pretrained(folder, num_labels=len(MODULES))
        def make_args(out):
            return TrainingArguments(
                output_dir=out, max_steps=steps, save_steps=save_steps, save_total_limit=1,
                per_device_train_batch_size=16, learning_rate=lr, use_cpu=True, seed=0,
                report_to=[], disable_tqdm=True, logging_steps=10 ** 6)
        chain, exact = os.path.join(d, "chain"), os.path.join(d, "exact")
        callbacks = [Chain(chain, background=background, replace=replace, **options)]
        if resume:              # exact copies: the control to resume from, and the oracle
            callbacks.append(ChainCallback(exact, keyframe_every=1))
        t0 = time.perf_counter()
        Timed(model=model, args=make_args(os.path.join(d, "out")), train_dataset=Data(),
              callbacks=callbacks).train()
        train_s = time.perf_counter() - t0
        for step, obj in DeltaCheckpointer(chain).replay(max_bytes=None):
            model.load_state_dict(obj["model"])
            acc, loss = _score(model, task)
            record[step].update(restored_accuracy=acc, restored_loss=loss)
        resumed = [_resumes(step, folder, make_args, Data(), chain, exact, d, task)
                   for step in resume]
    rows = [{"step": s, **r} for s, r in sorted(record.items())]
    return {"environment": environment(), "steps": steps, "save_steps": save_steps, "lr": lr,
            "background": background, "replace": replace, "train_s": train_s,
            "options": {k: repr(v) for k, v in options.items()}, "rows": rows,
            **_summary(rows, replace), "resumed": resumed}


def _summary(rows: list[dict], replace: bool) -> dict:
    """The whole run's bytes, worst restore and median save times."""
    trainer_total = None if replace else sum(r["trainer_bytes"] for r in rows)
    chain_total = sum(r["chain_bytes"] for r in rows)
    return {
        "trainer_bytes": trainer_total, "chain_bytes": chain_total,
        "ratio": None if replace else trainer_total / chain_total,
        "worst_drop_points": max(100 * (r["accuracy"] - r["restored_accuracy"]) for r in rows),
        "worst_loss_change_pct": max(abs(r["restored_loss"] / r["loss"] - 1) * 100 for r in rows),
        "trainer_save_s": None if replace else statistics.median(r["trainer_s"] for r in rows),
        "chain_save_s": statistics.median(r["chain_s"] for r in rows),
        "final_accuracy": rows[-1]["accuracy"], "final_loss": rows[-1]["loss"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    ap.add_argument("--save-steps", type=int, default=5, help="steps between checkpoints")
    ap.add_argument("--lr", type=float, default=5e-5, help="learning rate (the Trainer's default)")
    ap.add_argument("--background", action="store_true",
                    help="ChainCallback(background=True): saves written while training goes on")
    ap.add_argument("--replace", action="store_true",
                    help="ChainCallback(replace=True): the chain instead of checkpoint-N directories")
    ap.add_argument("--resume", type=int, nargs="*", default=(), metavar="STEP",
                    help="resume the run from these chain steps and from exact copies of them, "
                         "and report where each resumed run ends")
    ap.add_argument("--first-moment", type=float, default=None, metavar="T",
                    help="the chain's first-moment target (RolePolicy(first_moment=T); "
                         f"default {RolePolicy().first_moment:g}; with --replace, 0.3: "
                         "lcckpt.training.hf.RESUMABLE)")
    ap.add_argument("--dir", default=None, help="where to write the temporary run")
    ap.add_argument("--json", default=None, help="also write the result here")
    a = ap.parse_args(argv)
    if a.resume and a.replace:
        ap.error("--resume needs the Trainer's own saves: drop --replace")
    options = {} if a.first_moment is None else {
        "target": RolePolicy(first_moment=a.first_moment)}
    res = run(a.steps, a.save_steps, a.lr, a.dir, a.background, a.replace, tuple(a.resume),
              **options)
    mb = (lambda n: None if n is None else n / 1e6)
    table = [{"step": r["step"], "kind": r["kind"], "trainer_MB": mb(r["trainer_bytes"]),
              "chain_MB": r["chain_bytes"] / 1e6, "acc": 100 * r["accuracy"],
              "restored_acc": 100 * r["restored_accuracy"], "loss": r["loss"],
              "restored_loss": r["restored_loss"], "trainer_s": r["trainer_s"],
              "chain_s": r["chain_s"]} for r in res["rows"]]
    print(format_table(table, list(table[0])))
    trainer = "the Trainer wrote no directories" if a.replace else (
        f"Trainer checkpoints {res['trainer_bytes'] / 1e6:.0f} MB")
    ratio = "" if a.replace else f" ({res['ratio']:.1f}x smaller)"
    saves = "" if a.replace else f"{res['trainer_save_s']:.2f} s (Trainer) and "
    print(f"\nwhole run: {trainer}, chain {res['chain_bytes'] / 1e6:.1f} MB{ratio}; worst "
          f"restore {res['worst_drop_points']:+.2f} accuracy points below the true model, "
          f"held-out loss within {res['worst_loss_change_pct']:.2f}%; median save {saves}"
          f"{res['chain_save_s']:.2f} s (chain{', in the background' if a.background else ''}"
          f"); training took {res['train_s']:.1f} s, saves and scoring included")
    if res["resumed"]:
        acc, loss = 100 * res["final_accuracy"], res["final_loss"]
        table = [{"from_step": r["step"], "m1_err": r["m1_err"], "m1_err_adam": r["m1_err_adam"],
                  "m2_root_p1": r["m2_root_ratio"][0], "m2_root_p99": r["m2_root_ratio"][2],
                  "acc_pts": 100 * r["chain_accuracy"] - acc,
                  "loss_pct": 100 * (r["chain_loss"] / loss - 1),
                  "exact_acc_pts": 100 * r["exact_accuracy"] - acc,
                  "exact_loss_pct": 100 * (r["exact_loss"] / loss - 1)} for r in res["resumed"]]
        print(f"\nresumed runs against the uninterrupted one ({acc:.2f}% held-out accuracy, "
              f"loss {loss:.4f}), from the chain and from exact copies of the same steps:")
        print(format_table(table, list(table[0])))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0
