"""A Hugging Face Trainer's checkpoint directory (``checkpoint-N``): what it holds.

:func:`lcckpt.interop.convert.read_checkpoint` reads it as one checkpoint, in the layout
that :mod:`lcckpt.training.hf` stores in a chain: ``model`` (the weights, from
``model.safetensors``, ``pytorch_model.bin`` or their shard index), ``trainer_state``
(``trainer_state.json``'s text), and where present ``optimizer``, ``scheduler``,
``scaler`` and ``rng``, and under DDP ``rng_ranks`` (every process's generators). Every
file is read without running code from it; ``training_args.bin``, a pickle of the run's
arguments that the Trainer does not read to resume, is left out. Needs no
``transformers``: the command line reads such directories (``convert``, ``inspect``,
``verify``, ``bench --checkpoint``) on any install.
"""

from __future__ import annotations

import json
import os

from ..errors import CorruptDataError, InvalidArgumentError

__all__ = ["FILES", "RANK_RNG", "STATE", "WEIGHTS", "files", "global_step", "in_step_order",
           "is_trainer_dir", "rank_rng_files", "state_text"]

STATE = "trainer_state.json"
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
           "pytorch_model.bin.index.json")         # as save_pretrained names them
FILES = {"optimizer": "optimizer.pt", "scheduler": "scheduler.pt", "scaler": "scaler.pt",
         "rng": "rng_state.pth"}
RANK_RNG = "rng_state_{}.pth"   # under DDP, each process's generators (process index)
ARGS = "training_args.bin"    # a pickle of the run's arguments, not a checkpoint: never read


def is_trainer_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, STATE))


def state_text(path: str) -> str:
    """``trainer_state.json``'s text."""
    try:
        with open(os.path.join(path, STATE), encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgumentError(f"{path} is not a Trainer checkpoint directory: its "
                                   f"{STATE} cannot be read ({e})") from None


def global_step(path: str) -> int:
    """The step the directory holds, from its ``trainer_state.json``."""
    try:
        step = json.loads(state_text(path))["global_step"]
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptDataError(f"{os.path.join(path, STATE)} names no global_step ({e!r})") from None
    if type(step) is not int or step < 0:
        raise CorruptDataError(f"{os.path.join(path, STATE)}: global_step {step!r} is not a "
                               "step number")
    return step


def in_step_order(paths: list[str]) -> list[str]:
    """``paths`` by global step when every one is a Trainer checkpoint directory (a shell's
    ``checkpoint-*`` puts ``checkpoint-1000`` before ``checkpoint-500``), else as given."""
    if paths and all(is_trainer_dir(p) for p in paths):
        return sorted(paths, key=global_step)
    return list(paths)


def rank_rng_files(path: str) -> dict[str, str]:
    """``{index: file}`` of every process's generators in a run of several processes
    (``rng_state_{i}.pth`` from 0 up, while they exist); empty for one process."""
    found: dict[str, str] = {}
    while os.path.isfile(f := os.path.join(path, RANK_RNG.format(len(found)))):
        found[str(len(found))] = f
    return found


def files(path: str) -> dict[str, str]:
    """``{part: file path}`` of what the directory holds (``model`` required)."""
    found = {}
    weights = next((n for n in WEIGHTS if os.path.isfile(os.path.join(path, n))), None)
    if weights is None:
        raise InvalidArgumentError(f"{path} holds no model weights (none of {', '.join(WEIGHTS)})")
    found["model"] = os.path.join(path, weights)
    for key, name in FILES.items():
        if key == "rng" and not os.path.isfile(os.path.join(path, name)):
            name = RANK_RNG.format(0)      # a run of several processes: the first one's
        if os.path.isfile(os.path.join(path, name)):
            found[key] = os.path.join(path, name)
    return found
