"""A try of the step on a sample of a tensor's blocks, without copying the sample.

The sampled step search (:func:`lcckpt.codec.uniform._sampled_step`) quantizes every
``every``-th block of a large floored tensor at a few steps, for the error alone. Each
chunk of the sample is gathered into buffers of its thread as it is quantized, so a try
holds a chunk of the sample per thread (2.3 MB at the default chunk, for the call only)
instead of the whole sample of the state, the reference and the symbols (16-20 MB for a
20M-element second moment, on top of the reference a delta save holds). The blocks reach
the kernel in the same order and at the same offsets within their chunk as from a copy,
so the error is the same bit for bit.
"""

import threading

import numpy as np

from ..util.pool import run_tasks
from .kernels import uniform as uk


def blocks(n: int, block: int, every: int, most: int) -> tuple[int, int]:
    """``(stride, sampled)``: every ``stride``-th whole block of ``block`` elements of a
    tensor of ``n`` (``every`` at least, wider where more than ``most`` elements would be
    sampled), and how many blocks that samples."""
    nb = n // block
    stride = max(every, -(-nb * block // most))
    return stride, len(range(0, nb, stride))


def error_sq(u: np.ndarray, ref: np.ndarray | None, block: int, stride: int, sampled: int,
             chunk_size: int, args: tuple) -> float:
    """``||u - restored||²`` over the sampled blocks of flat ``u`` (against ``ref``; None:
    zeros), quantized with ``args`` (:func:`lcckpt.codec.kernels.uniform.quantize_range`'s
    from ``step`` on), chunk by chunk of ``chunk_size`` sample elements (a multiple of
    ``block``), as the same try of the copied sample would measure it."""
    use_ref = ref is not None
    per = chunk_size // block
    if per * block != chunk_size:
        raise ValueError(f"chunk_size {chunk_size} is not a multiple of the block {block}")
    nch = -(-sampled // per)
    errs = np.zeros(nch)
    nb = u.size // block
    uv = u[:nb * block].reshape(nb, block)[::stride]
    rv = ref[:nb * block].reshape(nb, block)[::stride] if use_ref else None
    bufs: dict[int, tuple] = {}         # per thread, for this call: u, ref, and the symbols
                                        # and escape flags, which the error does not read

    def task(c):
        k0, k1 = c * per, min(sampled, (c + 1) * per)
        m = (k1 - k0) * block
        me = threading.get_ident()
        if me not in bufs:
            bufs[me] = (np.empty(chunk_size, u.dtype), np.empty(chunk_size, u.dtype),
                        np.empty(chunk_size, np.uint8), np.empty(chunk_size // 8 + 1, np.uint8))
        bu, br, sym, esc = bufs[me]
        np.copyto(bu[:m].reshape(-1, block), uv[k0:k1])
        if use_ref:
            np.copyto(br[:m].reshape(-1, block), rv[k0:k1])
        errs[c] = uk.quantize_range(bu, br if use_ref else bu, use_ref, 0, m, *args, sym,
                                    esc, np.zeros(args[4], np.int64))
    run_tasks(task, nch)
    return float(errs.sum())
