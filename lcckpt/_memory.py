"""Fresh arrays that the thread pool fills: faulted in by one thread first.

numpy asks the kernel to back arrays of 4 MiB and more with transparent huge pages. When
several threads then take the first-touch faults of one such array at the same time,
some kernels and hypervisors serve them slowly: on the 2-core virtual machine the
benchmarks ran on, two threads filling a fresh 82 MB array took 9 to 210 ms, while one
thread touching every page first took 10-11 ms and the two threads' fill then ran at
memory speed. Every decode output, section read buffer and reference copy of a large
state is such an array, so they are allocated here.

4 KiB pages (an anonymous mapping advised against huge pages) were tried too: steadier
on that machine, but the exact codec's fresh decode took 1.5x as long (decode speed
0.78x ZipNN's instead of 1.20x, fp32), so huge pages stay.

This module does not pool or reuse memory: an array handed to the caller is the
caller's. Lazily read parts of a tensor (lcckpt.reader) are not faulted in ahead:
pages nobody asks for should stay untouched.
"""

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
