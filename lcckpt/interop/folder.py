"""A directory of checkpoints for ``lcckpt inspect | verify``: what a training run's
output directory holds one level down (``ModelCheckpoint``'s files, a Trainer's
``checkpoint-N`` directories, chains, distributed checkpoints), and the one-line summary
of each."""

from __future__ import annotations

import os

from ..errors import CorruptDataError, LcckptError
from . import trainerdir
from .convert import detect_format, format_for_path


def entries(path: str, distributed) -> list[tuple[str, str]]:
    """``(path, kind)`` of each checkpoint in ``path``, by name: ``kind`` is "file" (an
    lcckpt, torch.save or safetensors file, or a shard index), "trainer", "chain" or
    "distributed" (``distributed(p)``: its report module, or None). Files in no known
    format are left out unless named like checkpoints (``.pt``, ``.ckpt``, ``.lcc``, ...:
    damaged ones, which inspect and verify then name), as are a Trainer's
    ``training_args.bin`` (a pickle of its arguments) and directories that hold no
    checkpoint."""
    from ..chain.directory import ChainDirectory
    out = []
    for name in sorted(os.listdir(path)):
        p = os.path.join(path, name)
        if os.path.isfile(p):
            if name == trainerdir.ARGS:
                continue
            try:
                detect_format(p)
            except (CorruptDataError, OSError):
                if format_for_path(p) is None:
                    continue
            out.append((p, "file"))
        elif os.path.isdir(p):
            try:
                kind = ("trainer" if trainerdir.is_trainer_dir(p) else "distributed"
                        if distributed(p) else "chain" if ChainDirectory(p).steps() else None)
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
    elif "sections" in doc:
        out["holds"] = _tensors(len(doc["sections"]))
    elif "tensor_count" in doc or "tensors" in doc:
        out["holds"] = _tensors(doc.get("tensor_count", len(doc.get("tensors") or [])))
    return out


def _tensors(n: int) -> str:
    return f"{n} tensor{'' if n == 1 else 's'}"
