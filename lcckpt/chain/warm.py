"""``lcckpt.warmup``: every kernel a checkpoint's save and restore run, loaded up front.

The codec's own warm-up (:func:`lcckpt.codec.delta.warmup`) runs each kernel on a few
thousand elements. A chain's restore also runs kernels that only large tensors reach
(several symbols a table lookup, four bit streams side by side), kernels of its own
buffer types (a file's read-only bytes) and the container's checksums. Loading those
took 17-20 MB in the first restore of each process (the MLP of
``benchmarks/memory.py``: 24-26 MB beyond the state, 5.9-6.8 MB once they were loaded here;
docs/benchmarks.md). A save of a model with its optimizer runs more: the uniform
quantizer's step steered along each weight's first moment, and LC mode's bucket and run
coders. Here a model-and-Adam state of four 1 MB tensors is written as a chain of three
deltas to a temporary directory, at the default targets and in LC mode (``bits=2``), and
restored, as a user's would be.
"""

from __future__ import annotations

import os
import tempfile

import torch

from ..codec.delta import warmup as _codec_warmup
from .checkpointer import DeltaCheckpointer

ELEMENTS = 1 << 18         # eight chunks or more, enough symbols for the multi-symbol tables


def _states(g: torch.Generator):
    """Four states of a model (a weight with escapes, a bias, a sparse tensor) and its
    Adam moments, the first of which stands still every other step."""
    w, s, m, v = (torch.randn(ELEMENTS, generator=g) for _ in range(4))
    v = v.abs()                                  # a second moment: floored, never steered
    for step in range(4):
        if step:
            w = w + 1e-3 * torch.randn(ELEMENTS, generator=g)
            w[step::4099] += 0.1                     # escapes
            s = s.clone()
            s[step::61] += 1e-2                      # sparse: runs of zeros; a dense
            s[:ELEMENTS // 3] += 1e-3 * torch.randn(ELEMENTS // 3, generator=g)  # third
            #   makes its runs stream large enough for the runs' multi-item table
            if step % 2:                             # still every other step: only
                m = m + 1e-3 * torch.randn(ELEMENTS, generator=g)   # its residual
            v = v * 0.999 + 1e-4 * torch.rand(ELEMENTS, generator=g)
        yield {"model": {"w": w, "b": w[:64].clone(), "s": s},
               "optim": {"state": {0: {"step": torch.tensor(float(step)), "exp_avg": m,
                                       "exp_avg_sq": v}},
                         "param_groups": [{"params": [0], "lr": 1e-3}]}}


def warmup() -> None:
    """Load (or compile, on the very first run) every kernel, so later calls are fast.

    Numba caches compiled kernels on disk; the first call in a process still pays for
    loading them. Call this at start-up to move that cost (a second or two, and the
    memory the loaded code takes) out of the first checkpoint and the first restore.
    """
    _codec_warmup()
    with tempfile.TemporaryDirectory(prefix="lcckpt-warmup-") as d:
        for name, settings in (("default", {}), ("lc", {"bits": 2})):
            path = os.path.join(d, name)
            ck = DeltaCheckpointer(path, **settings)
            for step, state in enumerate(_states(torch.Generator().manual_seed(0))):
                ck.save(step, state)
            ck.close()
            ck = DeltaCheckpointer(path)
            ck.load(1)                                   # one delta: no stream beside it
            moments = state["optim"]["state"][0]
            ck.load(into={"model": {k: torch.empty_like(t) for k, t in state["model"].items()},
                          "optim": {"state": {0: {k: torch.empty_like(t)
                                                  for k, t in moments.items()}}}})
