"""A directory of checkpoints for ``lcckpt inspect | verify``: what a training run's
output directory holds one level down (``ModelCheckpoint``'s files, a Trainer's
``checkpoint-N`` directories, chains, distributed checkpoints, directories of checkpoint
files such as Accelerate's ``checkpoint_N``), and the one-line summary of each."""

from __future__ import annotations

import os

from ..errors import LcckptError
from ..util.table import count
from . import trainerdir
from .convert import is_checkpoint_file


def entries(path: str, distributed) -> list[tuple[str, str]]:
    """``(path, kind)`` of each checkpoint in ``path``, by name: ``kind`` is "file" (an
    lcckpt, torch.save or safetensors file, or a shard index), "trainer", "chain",
    "distributed" (``distributed(p)``: its report module, or None) or "folder" (a
    directory of checkpoint files, as Accelerate's ``save_state`` writes). Files in no known
    format are left out unless named like checkpoints (``.pt``, ``.ckpt``, ``.lcc``, ...:
    damaged ones, which inspect and verify then name), as are a Trainer's
    ``training_args.bin`` (a pickle of its arguments) and directories that hold no
    checkpoint."""
    from ..chain.directory import ChainDirectory
    out = []
    for name in sorted(os.listdir(path)):
        p = os.path.join(path, name)
        if os.path.isfile(p):
            if is_checkpoint_file(p):
                out.append((p, "file"))
        elif os.path.isdir(p):
            try:
                kind = ("trainer" if trainerdir.is_trainer_dir(p) else "distributed"
                        if distributed(p) else "chain" if ChainDirectory(p).steps() else
                        "folder" if any(is_checkpoint_file(os.path.join(p, n))
                                        for n in sorted(os.listdir(p))) else None)
            except (LcckptError, OSError):       # unlistable: inspect and verify name it
                kind = "chain"
            if kind:
                out.append((p, kind))
    return out


def row(path: str, kind: str, doc: dict) -> dict:
    """The summary row of one checkpoint from its ``lcckpt inspect`` document."""
    out = {"name": os.path.basename(path), "kind": doc.get("format", kind)}
    if kind == "chain":
        steps = [r["step"] for r in doc["steps"]]
        out.update(file_bytes=sum(r.get("file_bytes") or 0 for r in doc["steps"]),
                   holds=f"step {steps[0]}" if len(steps) == 1 else
                   f"{len(steps)} steps, {steps[0]} to {steps[-1]}")
        return out
    out["file_bytes"] = doc.get("file_bytes")
    if "points_at" in doc:
        at = doc["points_at"]
        out["holds"] = f"its state at step {at['step']} of {os.path.relpath(at['chain'])}"
    elif (doc.get("chain") or {}).get("step") is not None:
        out["holds"] = f"chain step {doc['chain']['step']} ({doc['chain'].get('kind')})"
    elif kind == "trainer":
        out["holds"] = f"step {doc['global_step']}, {len(doc['files'])} files"
    elif "entries" in doc:
        out["file_bytes"] = sum(r.get("file_bytes") or 0 for r in doc["entries"])
        out["holds"] = count(len(doc["entries"]), "checkpoint")
    elif "sections" in doc:
        out["holds"] = count(len(doc["sections"]), "tensor")
    elif "tensor_count" in doc or "tensors" in doc:
        out["holds"] = count(doc.get("tensor_count", len(doc.get("tensors") or [])), "tensor")
    return out
