"""A try of the step on a sample of a tensor's blocks, without copying the sample.

The sampled step search (:func:`lcckpt.codec.uniform._sampled_step`) quantizes every
``every``-th block of a large floored tensor at a few steps, for the error alone. Each
chunk of the sample is gathered into buffers of its thread as it is quantized, so a try
holds a chunk of the sample per thread instead of the whole sample of the state, the
reference and the symbols (16-20 MB for a 20M-element second moment, on top of the
reference a delta save holds). The blocks reach the kernel in the same order and at the
same offsets within their chunk as from a copy, so the error is the same bit for bit.
"""

import threading

import numpy as np

from ..util.pool import run_tasks
from .kernels import uniform as uk

_local = threading.local()


def blocks(n: int, block: int, every: int, most: int) -> tuple[int, int]:
    """``(stride, sampled)``: every ``stride``-th whole block of ``block`` elements of a
    tensor of ``n`` (``every`` at least, wider where more than ``most`` elements would be
    sampled), and how many blocks that samples."""
    nb = n // block
    stride = max(every, -(-nb * block // most))
    return stride, len(range(0, nb, stride))


def _buffers(n: int, dtype, use_ref: bool) -> tuple:
    """This thread's chunk buffers: ``u``, ``ref`` (or None), and the symbols and escape
    flags the kernel writes, which the error does not read (so never cleared)."""
    key = (n, np.dtype(dtype).str, use_ref)
    if getattr(_local, "key", None) != key:
        _local.key = key
        _local.bufs = (np.empty(n, dtype), np.empty(n, dtype) if use_ref else None,
                       np.empty(n, np.uint8), np.empty(-(-n // 8), np.uint8))
    return _local.bufs


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
    S = args[4]
    errs = np.zeros(nch)

    nb = u.size // block

    def views(a):
        return a[:nb * block].reshape(nb, block)[::stride]
    uv = views(u)
    rv = views(ref) if use_ref else None

    def task(c):
        k0, k1 = c * per, min(sampled, (c + 1) * per)
        m = (k1 - k0) * block
        bu, br, sym, esc = _buffers(chunk_size, u.dtype, use_ref)
        np.copyto(bu[:m].reshape(-1, block), uv[k0:k1])
        if use_ref:
            np.copyto(br[:m].reshape(-1, block), rv[k0:k1])
        errs[c] = uk.quantize_range(bu, br if use_ref else bu, use_ref, 0, m, *args, sym,
                                    esc, np.zeros(S, np.int64))
    run_tasks(task, nch)
    return float(errs.sum())
