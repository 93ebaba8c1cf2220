"""Large fresh arrays that the thread pool fills: mapped without transparent huge pages.

numpy asks the kernel to back arrays of 4 MiB and more with transparent huge pages. On
the 2-core virtual machine the benchmarks ran on, first touches of such memory were
bimodal: fast while recently freed huge pages were at hand, and many times slower
otherwise (two threads filling a fresh 82 MB array: 9 to 210 ms; a keyframe restore
spent 0.06 s or 0.2-0.8 s faulting in its buffers, run to run). Ordinary 4 KiB pages,
which torch's allocator uses too, cost the same every time (the same fill: 20-23 ms),
and several threads may fault them at once. Every decode output, section read buffer
and reference copy of a large state is allocated here, from an anonymous mapping
advised against huge pages; it reads as zeros until written.

This module does not pool or reuse memory: an array handed out is the caller's, and
its mapping is released with it.
"""

import mmap

import numpy as np

SMALL = 4 << 20          # below numpy's huge-page threshold: numpy's own allocation


def _mapped(nbytes: int) -> np.ndarray:
    m = mmap.mmap(-1, nbytes)
    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if advice is not None:
        try:
            m.madvise(advice)
        except OSError:                # a kernel without THP: nothing to advise against
            pass
    return np.frombuffer(m, np.uint8)


def empty(shape, dtype) -> np.ndarray:
    """``np.empty(shape, dtype)``, on 4 KiB pages when large (its contents read as 0)."""
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if nbytes < SMALL:
        return np.empty(shape, dt)
    return _mapped(nbytes).view(dt).reshape(shape)


def zeros(shape, dtype) -> np.ndarray:
    """``np.zeros(shape, dtype)``, on 4 KiB pages when large (untouched until written)."""
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if nbytes < SMALL:
        return np.zeros(shape, dt)
    return _mapped(nbytes).view(dt).reshape(shape)
