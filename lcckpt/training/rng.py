"""Capture and restore the random number generators a training run depends on.

Python's ``random``, numpy's legacy global generator, torch's CPU generator and, when CUDA
is initialized, every CUDA device's generator. Resuming with these restored replays the
same shuffles, dropout masks and augmentations as an uninterrupted run (bit-identical only
where the rest of the computation is deterministic).

It does not capture generators the user created (``torch.Generator``, ``numpy.random.Generator``,
a data loader's sampler): hand those to the manager as objects with ``state_dict()``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from ..util.caller import warn_user


def capture() -> dict[str, Any]:
    """The generators' states as a tree of tuples, arrays and tensors (all storable)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore(state: dict[str, Any]) -> None:
    """Put back what :func:`capture` took; CUDA states only where CUDA is usable."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        np.random.set_state(tuple(state["numpy"]))
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    cuda = state.get("cuda")
    if cuda:
        if not torch.cuda.is_available():
            warn_user("the checkpoint holds CUDA generator states but CUDA is not "
                      "available; they are not restored")
        elif torch.cuda.device_count() < len(cuda):
            warn_user(f"the checkpoint holds {len(cuda)} CUDA generator states but only "
                      f"{torch.cuda.device_count()} devices are visible; restoring the "
                      "first ones")
            torch.cuda.set_rng_state_all([t.cpu() for t in cuda[:torch.cuda.device_count()]])
        else:
            torch.cuda.set_rng_state_all([t.cpu() for t in cuda])
