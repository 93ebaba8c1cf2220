"""``lcckpt.warmup``: every kernel a checkpoint's save and restore run, loaded up front.

The codec's own warm-up (:func:`lcckpt.codec.delta.warmup`) runs each kernel on a few
thousand elements. A chain's restore also runs kernels that only large tensors reach
(several symbols a table lookup, four bit streams side by side), kernels of its own
buffer types (a file's read-only bytes) and the container's checksums. Loading those
took 17-20 MB in the first restore of each process (the MLP of
``benchmarks/memory.py``: 24-26 MB beyond the state, 5.9-6.8 MB once they were loaded here;
docs/benchmarks.md). Here a three-delta chain of three 1 MB tensors is written to a
temporary directory and restored, as a user's would be.
"""

from __future__ import annotations

import tempfile

import torch

from ..codec.delta import warmup as _codec_warmup
from .checkpointer import DeltaCheckpointer

ELEMENTS = 1 << 18         # eight chunks or more, enough symbols for the multi-symbol tables


def warmup() -> None:
    """Load (or compile, on the very first run) every kernel, so later calls are fast.

    Numba caches compiled kernels on disk; the first call in a process still pays for
    loading them. Call this at start-up to move that cost (under a second, and the
    memory the loaded code takes) out of the first checkpoint and the first restore.
    """
    _codec_warmup()
    g = torch.Generator().manual_seed(0)
    w, s, m = (torch.randn(ELEMENTS, generator=g) for _ in range(3))
    with tempfile.TemporaryDirectory(prefix="lcckpt-warmup-") as d:
        ck = DeltaCheckpointer(d)
        for step in range(4):
            if step:
                w = w + 1e-3 * torch.randn(ELEMENTS, generator=g)
                w[step::4099] += 0.1                     # escapes
                s = s.clone()
                s[step::61] += 1e-2                      # sparse: runs of zeros
                if step % 2:                             # still every other step: only
                    m = m + 1e-3 * torch.randn(ELEMENTS, generator=g)   # its residual
            ck.save(step, {"w": w, "s": s, "m": m, "b": w[:64].clone()})
        ck.close()
        ck = DeltaCheckpointer(d)
        ck.load(1)                                       # one delta: no stream beside it
        ck.load(into={k: torch.empty(ELEMENTS) for k in "wsm"} | {"b": torch.empty(64)})
