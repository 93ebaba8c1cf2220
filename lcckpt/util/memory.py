"""Fresh arrays that the thread pool fills: faulted in by one thread first.

numpy asks the kernel to back arrays of 4 MiB and more with transparent huge pages. When
several threads then take the first-touch faults of one such array at the same time,
some kernels and hypervisors serve them slowly: on the 2-core virtual machine the
benchmarks ran on, two threads filling a fresh 82 MB array took 9 to 210 ms, while one
thread touching every page first took 10-11 ms and the two threads' fill then ran at
memory speed. Every decode output, section read buffer and reference copy of a large
state is such an array, so they are allocated here.

The chain's bulk memory is the exception (:func:`bulk_empty`, :func:`bulk_zeros`): the
references a save copies the state into and the buffers a restore reads sections into,
hundreds of MB at once. On that machine huge pages for those were often slow to come by
(in the save benchmark a first keyframe took 0.89 s on huge pages and 0.43 s on 4 KiB
pages, medians of 5; a keyframe restore's buffers took 0.2-0.8 s to fault in instead of
0.06 s in 3 of 5 loads), while 4 KiB pages cost the same every time. A single
decode output keeps huge pages: on 4 KiB pages the exact codec's fresh decode took 1.5x
as long (0.78x ZipNN's speed instead of 1.20x, fp32).

(:func:`read_only` gives the decode kernels one buffer type.) This module does not pool
or reuse memory: an array handed to the caller is the
caller's. Lazily read parts of a tensor (lcckpt.interop.reader) are not faulted in ahead:
pages nobody asks for should stay untouched.
"""

import math
import mmap

import numpy as np

PREFAULT_MIN = 4 << 20          # numpy's own threshold for the huge-page advice
PAGE = 4096


def prefault(a: np.ndarray) -> np.ndarray:
    """Touch one byte per page of the contiguous array ``a`` (which the caller is about
    to overwrite completely, or which holds zeros) from this thread; returns ``a``."""
    if a.nbytes >= PREFAULT_MIN:
        a.reshape(-1).view(np.uint8)[::PAGE] = 0
    return a


def empty(shape, dtype) -> np.ndarray:
    """``np.empty`` whose pages are already mapped; the caller fills every element."""
    return prefault(np.empty(shape, dtype))


def zeros(shape, dtype) -> np.ndarray:
    """``np.zeros`` whose pages are already mapped."""
    return prefault(np.zeros(shape, dtype))


def _small_pages(nbytes: int) -> np.ndarray:
    """``nbytes`` of zeros from an anonymous mapping advised against huge pages."""
    m = mmap.mmap(-1, nbytes)
    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if advice is not None:
        try:
            m.madvise(advice)
        except OSError:                # a kernel without huge pages: nothing to advise
            pass
    return np.frombuffer(m, np.uint8)


def bulk_zeros(shape, dtype) -> np.ndarray:
    """Zeros on 4 KiB pages when large, faulted in by whichever thread writes them first
    (several at once are fine on small pages); also :func:`bulk_empty`."""
    dt = np.dtype(dtype)
    nbytes = (math.prod(shape) if isinstance(shape, (tuple, list)) else int(shape)) * dt.itemsize
    if nbytes < PREFAULT_MIN:
        return np.zeros(shape, dt)
    return _small_pages(nbytes).view(dt).reshape(shape)


bulk_empty = bulk_zeros


def read_only(a: np.ndarray) -> np.ndarray:
    """``a``, or a read-only view of it: bytes handed to the decode kernels are read-only
    always, so each kernel is compiled once, not again for writable buffers (a chunk read
    into a reused array, a blob in a bytearray), which cost a fresh install's first
    restore seconds per large kernel."""
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a
