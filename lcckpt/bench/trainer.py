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
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from ..chain.checkpointer import DeltaCheckpointer
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


def run(steps: int = 60, save_steps: int = 5, lr: float = 5e-5, directory: str | None = None,
        background: bool = False, replace: bool = False, **options) -> dict:
    """Fine-tune, checkpointing through the Trainer and the callback; returns a JSON-able
    dict (``options``: DeltaCheckpointer keywords for the chain). ``chain_s`` is how long
    the callback held the loop at each save: the whole save, or with ``background`` the
    host copy (and any wait for the previous save). ``replace``: the chain instead of the
    Trainer's directories (their columns then stay empty)."""
    from transformers import BertForSequenceClassification, Trainer, TrainingArguments
    from transformers.utils import logging
    from ..training.hf import ChainCallback
    from .finetune import MODULES, _pretrained, docstring_task

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
        args = TrainingArguments(
            output_dir=os.path.join(d, "out"), max_steps=steps, save_steps=save_steps,
            save_total_limit=1, per_device_train_batch_size=16, learning_rate=lr,
            use_cpu=True, seed=0, report_to=[], disable_tqdm=True, logging_steps=10 ** 6)
        chain = os.path.join(d, "chain")
        t0 = time.perf_counter()
        Timed(model=model, args=args, train_dataset=Data(),
              callbacks=[Chain(chain, background=background, replace=replace,
                               **options)]).train()
        train_s = time.perf_counter() - t0
        for step, obj in DeltaCheckpointer(chain).replay(max_bytes=None):
            model.load_state_dict(obj["model"])
            acc, loss = _score(model, task)
            record[step].update(restored_accuracy=acc, restored_loss=loss)
    rows = [{"step": s, **r} for s, r in sorted(record.items())]
    trainer_total = None if replace else sum(r["trainer_bytes"] for r in rows)
    chain_total = sum(r["chain_bytes"] for r in rows)
    return {
        "environment": environment(), "steps": steps, "save_steps": save_steps, "lr": lr,
        "background": background, "replace": replace, "train_s": train_s,
        "options": {k: repr(v) for k, v in options.items()}, "rows": rows,
        "trainer_bytes": trainer_total, "chain_bytes": chain_total,
        "ratio": None if replace else trainer_total / chain_total,
        "worst_drop_points": max(100 * (r["accuracy"] - r["restored_accuracy"]) for r in rows),
        "worst_loss_change_pct": max(abs(r["restored_loss"] / r["loss"] - 1) * 100 for r in rows),
        "trainer_save_s": None if replace else statistics.median(r["trainer_s"] for r in rows),
        "chain_save_s": statistics.median(r["chain_s"] for r in rows),
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
    ap.add_argument("--dir", default=None, help="where to write the temporary run")
    ap.add_argument("--json", default=None, help="also write the result here")
    a = ap.parse_args(argv)
    res = run(a.steps, a.save_steps, a.lr, a.dir, a.background, a.replace)
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
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0
