"""Hugging Face ``Trainer``: every checkpoint it saves also kept in a delta chain, and any
step of that chain written back as a checkpoint directory ``train()`` resumes from;
an existing run's ``checkpoint-N`` directories stored as such a chain.

    from lcckpt.training.hf import ChainCallback, export_checkpoint

    trainer = Trainer(..., args=TrainingArguments(..., save_steps=500, save_total_limit=1),
                      callbacks=[ChainCallback("run/chain")])
    trainer.train()                      # run/chain: every checkpoint, ~20x smaller
    export_checkpoint("run/chain", "run/checkpoint-1500", trainer.model, step=1500)
    trainer.train(resume_from_checkpoint="run/checkpoint-1500")

The callback saves when the Trainer does (``on_save``, after the Trainer's own
checkpoint directory is written), through a :class:`~lcckpt.DeltaCheckpointer`: the
model's and the optimizer's state, the LR scheduler's, the AMP scaler's where the Trainer
wrote one, the random generators the Trainer saves and its ``TrainerState``. The
Trainer's ``save_total_limit`` then bounds the full-size directories, while the chain
keeps every step. Beside the Trainer's own save by default, since ``load_best_model_at_end``
and the Trainer's resume read its directories (:func:`export_checkpoint` writes one);
``replace=True`` writes the chain instead.

Sharded training (FSDP, DeepSpeed) is refused: each rank holds only part of the state
there (``lcckpt.distributed`` stores such state). Under DDP the process that saves
(``args.should_save``) writes the chain, with every process's random generators, and an
exported directory holds them as the Trainer writes them (``rng_state_{i}.pth``), so
each process resumes its own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback
from transformers.training_args import ParallelMode

from ..chain.checkpointer import DeltaCheckpointer
from ..chain.lock import check_free
from ..chain.policy import RESUMABLE   # with replace=True the chain is all a resume reads
from ..errors import InvalidArgumentError
from ..format.serialization import load
from ..interop import trainerdir
from ..interop.convert import read_checkpoint
from ..util.durable import fsync_dir
from .background import Writer
from .hostcopy import HostBuffers

__all__ = ["ChainCallback", "RESUMABLE", "export_checkpoint", "import_checkpoints"]

_SCALER = trainerdir.FILES["scaler"]



class ChainCallback(TrainerCallback):
    """Saves every checkpoint of a ``Trainer`` run as a step of a chain in ``directory``
    (``options``: :class:`~lcckpt.DeltaCheckpointer`'s keywords; ``keyframe_every=1``
    keeps every step exact). ``last_save`` is the checkpointer's record of the newest
    finished save (kind, path, bytes).

    ``background=True``: ``on_save`` copies the state into host buffers (reused from one
    save to the next: memory of one state) and returns; a thread encodes and writes it
    while training goes on. The next save, and the end of training, wait for it and
    raise its error if it failed. The files are those a save in ``on_save`` writes.
    Where the memory left could not hold the copy beside the save, ``on_save`` writes in
    the loop instead, with one warning (``stats["foreground"]`` counts those saves).

    ``replace=True``: the chain instead of the Trainer's ``checkpoint-N`` directories.
    When the Trainer is due to save (``control.should_save`` at the end of a step or an
    epoch) the callback saves and clears the flag, so the Trainer writes nothing;
    :func:`export_checkpoint` writes a directory to resume from. The trainer state keeps
    the Trainer's own flags as its save would. Two things the Trainer adds up only when it
    saves or logs stay as of then: ``total_flos``, and other stateful callbacks (an early
    stopping's patience). Refused with ``load_best_model_at_end`` or ``save_strategy="best"``, which
    need the Trainer's directories. Since a resume reads the chain then, its default target
    is :data:`RESUMABLE` (first moments held to 0.3 of their movement, not 0.8), and the
    Trainer's ``save_total_limit`` is the chain's ``keep_last`` unless ``options`` give
    one (each kept step keeps the steps back to its keyframe)."""

    def __init__(self, directory: str | os.PathLike, *, background: bool = False,
                 replace: bool = False, **options: Any) -> None:
        self.directory = os.fspath(directory)
        self.background = background
        self.replace = replace
        self.options = options
        if replace and not {"target", "bits", "error_bound"} & options.keys():
            self.options = {**options, "target": RESUMABLE}
        self.last_save: dict | None = None
        self._ck: DeltaCheckpointer | None = None
        self._step: int | None = None          # the newest step handed to a save
        self._buffers = HostBuffers() if background else None
        self.stats = {"foreground": 0}          # background saves the memory left could not hold
        self._writer = Writer("lcckpt-chain-callback")

    def on_train_begin(self, args, state, control, **kwargs):
        if getattr(args, "fsdp", None) or getattr(args, "deepspeed", None):
            raise InvalidArgumentError(
                "ChainCallback stores one process's whole state, and under FSDP or DeepSpeed "
                "each rank holds only part of it; save such a run with lcckpt.distributed")
        strategy = getattr(args, "save_strategy", None)
        if self.replace and (getattr(args, "load_best_model_at_end", False)
                             or getattr(strategy, "value", strategy) == "best"):
            raise InvalidArgumentError(
                "ChainCallback(replace=True) stops the Trainer's own checkpoint directories, "
                "and load_best_model_at_end or save_strategy='best' reads them: use "
                "replace=False (the chain beside the directories) or turn those off")
        if not args.should_save:
            return
        limit = getattr(args, "save_total_limit", None)     # the chain is the checkpoints
        if self.replace and limit and self._ck is None and "keep_last" not in self.options:
            self.options = {**self.options, "keep_last": int(limit)}
        self._open()
        steps = self._ck.steps()
        if steps and steps[-1] > state.global_step:
            raise InvalidArgumentError(
                f"{self.directory} holds steps up to {steps[-1]}, after step "
                f"{state.global_step} that this run resumes from; a chain's steps only "
                "increase: resume from its newest step or give the resumed run another "
                "directory")

    def on_save(self, args, state, control, model=None, optimizer=None, lr_scheduler=None,
                **kwargs):
        every = _every_process_rng(args)    # every process takes part, the saver keeps it
        if not args.should_save or self._step == state.global_step:
            return                          # not this process's, or this step is stored
        if model is None:
            raise InvalidArgumentError("the Trainer passed no model to on_save; nothing to store")
        self.wait()
        self._open()
        obj = _snapshot(args, state, model, optimizer, lr_scheduler)
        if every is not None:
            obj["rng_ranks"] = every
        self._step = state.global_step
        if not self.background or not self._buffers.fits(obj, self.last_save is None, self.stats):
            self._write(self._ck, state.global_step, obj)
            return
        self._writer.start(self._write, self._ck, state.global_step,
                           self._buffers.snapshot(obj))

    def on_step_end(self, args, state, control, **kwargs):
        self._save_instead(args, state, control, **kwargs)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._save_instead(args, state, control, **kwargs)

    def _save_instead(self, args, state, control, **kwargs):
        if self.replace and control.should_save:
            held = getattr(state, "stateful_callbacks", None)
            if isinstance(held, dict) and isinstance(held.get("TrainerControl"), dict):
                held["TrainerControl"] = control.state()    # as the Trainer's save records it
            self.on_save(args, state, control, **kwargs)
            control.should_save = False         # the Trainer's own save is skipped

    def on_train_end(self, args, state, control, **kwargs):
        ck, self._ck = self._ck, None
        self._writer.finish(ck)

    def wait(self) -> None:
        """Wait for a background save in flight; raise its error if it failed."""
        self._writer.wait()

    def _write(self, ck: DeltaCheckpointer, step: int, obj: dict) -> None:
        ck.save(step, obj)             # the checkpointer handed over: the run's end may
        self.last_save = ck.last_save  # detach it from self while this thread writes

    def _open(self) -> None:
        if self._ck is None:
            check_free(self.directory)  # another run writing this chain: told now, not at a save
            self._ck = DeltaCheckpointer(self.directory, **self.options)


def _snapshot(args, state, model, optimizer, lr_scheduler) -> dict:
    """What the Trainer's own checkpoint directory holds, as one object (the model and
    the trainer state alone under ``save_only_model``, as the Trainer saves them)."""
    obj: dict[str, Any] = {"model": model.state_dict(), "trainer_state": _state_json(state)}
    if getattr(args, "save_only_model", False):
        return obj
    obj["rng"] = _rng_states(args)
    if optimizer is not None:
        obj["optimizer"] = optimizer.state_dict()
    if lr_scheduler is not None:
        obj["scheduler"] = lr_scheduler.state_dict()
    scaler = os.path.join(args.output_dir, f"checkpoint-{state.global_step}", _SCALER)
    if os.path.isfile(scaler):       # fp16 on a GPU: only the Trainer's accelerator holds it
        obj["scaler"] = load(scaler, map_location="cpu")
    return obj


def _state_json(state) -> str:
    """``trainer_state.json``'s text, as ``TrainerState.save_to_json`` writes it."""
    return json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"


def _rng_states(args) -> dict:
    """The generators ``Trainer._save_rng_state`` saves, in its layout."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(),
              "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = (torch.cuda.random.get_rng_state_all()
                          if getattr(args, "parallel_mode", None) == ParallelMode.DISTRIBUTED
                          else torch.cuda.random.get_rng_state())
    return states


def _every_process_rng(args) -> dict | None:
    """Under DDP, every process's generators (:func:`_rng_states`) by process index as a
    string, as the Trainer saves each in ``rng_state_{index}.pth`` (an all-gather that
    every process makes in each ``on_save``); None in one process or without them."""
    import torch.distributed as dist
    from .ranks import in_group
    if getattr(args, "save_only_model", False) or not in_group():
        return None
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, _rng_states(args))
    return {str(i): g for i, g in enumerate(got)}


def export_checkpoint(directory: str | os.PathLike, out_dir: str | os.PathLike,
                      model: torch.nn.Module, step: int | None = None) -> str:
    """Write ``step`` of the chain in ``directory`` (default: the newest) as a Trainer
    checkpoint directory ``out_dir`` (which must not exist yet), for
    ``trainer.train(resume_from_checkpoint=out_dir)``; returns ``out_dir``.

    ``model`` is a model of the run's architecture (the Trainer's own will do): its
    ``save_pretrained`` writes the step's weights with its config, so tied weights are
    stored once, as the Trainer stores them. ``model`` itself is not changed. The
    directory is assembled beside ``out_dir`` and renamed into place, so a crash leaves
    no half-written checkpoint that the Trainer would resume from."""
    out_dir = os.fspath(out_dir)
    if os.path.lexists(out_dir):
        raise InvalidArgumentError(f"{out_dir} exists; export_checkpoint writes a new "
                                   "directory (remove it first, or choose another name)")
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    obj = DeltaCheckpointer(directory).load(step)
    missing = [k for k in ("model", "trainer_state") if k not in obj] \
        if isinstance(obj, dict) else ["model"]
    if missing:
        raise InvalidArgumentError(
            f"step {step if step is not None else 'newest'} of {os.fspath(directory)} was "
            f"not written by ChainCallback or import_checkpoints: it lacks {', '.join(missing)}")
    json.loads(obj["trainer_state"])                 # the Trainer parses it on resume
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, state_dict=obj["model"])
        for key, name in trainerdir.FILES.items():
            if obj.get(key) is not None:
                torch.save(obj[key], os.path.join(tmp, name))
        for i, rng in (obj.get("rng_ranks") or {}).items():     # each process its own
            torch.save(rng, os.path.join(tmp, trainerdir.RANK_RNG.format(int(i))))
        with open(os.path.join(tmp, trainerdir.STATE), "w", encoding="utf-8") as f:
            f.write(obj["trainer_state"])
        for name in os.listdir(tmp):
            with open(os.path.join(tmp, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(tmp)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(parent)
    return out_dir


def import_checkpoints(paths, directory: str | os.PathLike, **options: Any) -> list[int]:
    """Store Trainer checkpoint directories (``checkpoint-N``, in any order) as the steps
    of a chain in ``directory``, oldest first, as :class:`ChainCallback` stores them;
    returns the steps. ``options``: :class:`~lcckpt.DeltaCheckpointer`'s keywords.

    An existing run's history shrinks this way, and :func:`export_checkpoint` writes any
    step back. Each file is read without running code from it (``training_args.bin``,
    a pickle of the run's arguments, is left out: the Trainer does not read it to
    resume). The step is the directory's ``global_step``."""
    found = {}
    for path in map(os.fspath, paths):
        if not trainerdir.is_trainer_dir(path):
            raise InvalidArgumentError(f"{path} is not a Trainer checkpoint directory: it "
                                       f"holds no {trainerdir.STATE}")
        step = trainerdir.global_step(path)
        if step in found:
            raise InvalidArgumentError(f"{found[step]} and {path} are both step {step}")
        found[step] = path
    ck = DeltaCheckpointer(directory, **options)
    try:
        for step in sorted(found):
            ck.save(step, read_checkpoint(found[step])[0])
    finally:
        ck.close()
    return sorted(found)
