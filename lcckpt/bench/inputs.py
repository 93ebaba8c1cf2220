"""What ``lcckpt bench --checkpoint`` reads: any checkpoint lcckpt reads, distributed ones
too (lcckpt.distributed is imported only for those: it imports torch.distributed)."""

from __future__ import annotations

import os
from typing import Any

from lcckpt.interop.convert import read_checkpoint
from lcckpt.util.paths import distributed_hint


def read_any(path) -> tuple[Any, str]:
    """``(object, format)`` of a file, a chain's step, a Trainer's directory, or a
    distributed checkpoint (a DistributedCheckpointer directory: its newest step), read
    whole."""
    if os.path.isdir(path) and distributed_hint(path):
        from lcckpt.distributed import report
        return report.read(report.checkpoint_dir(os.fspath(path))), "distributed"
    obj, _, fmt = read_checkpoint(path)
    return obj, fmt
