"""Exact coding of any fixed-width array: byte planes, each Huffman-coded or raw.

Floats are rotated left by one bit first so their exponent fills one plane (ZipNN's
observation: the exponent carries ~2.6 bits of entropy in 8, the mantissa is near
random). Every plane then goes through :mod:`lcckpt.entropy` in the ``bytes`` modes:
per chunk the cheapest of Huffman, raw, or constant. Integers and bools use the same
path without rotation, so step counters and masks shrink too.
"""

import numpy as np

from . import entropy
from ._pool import run_tasks
from .kernels import floats as fk

_WORD = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def words_of(a: np.ndarray, kind: str) -> tuple[np.ndarray, bool]:
    """Flat unsigned-integer view of the element bits, and whether to rotate."""
    flat = a.reshape(-1)
    if kind == "complex":                 # a pair of floats per element
        flat = flat.view(np.float32 if a.dtype.itemsize == 8 else np.float64)
    item = flat.dtype.itemsize
    return flat.view(_WORD[item]), kind in ("float", "complex") and item > 1


def encode_planes(words: np.ndarray, rotate: bool, chunk_size: int):
    """Split into planes and code each; returns the list of :class:`entropy.Encoded`."""
    n = words.size
    width = 8 * words.dtype.itemsize
    nplanes = width // 8
    nch = -(-n // chunk_size)
    planes = np.empty((nplanes, n), np.uint8)
    hist = np.zeros((nch, nplanes, 256), np.int64)

    def task(c):
        lo, hi = c * chunk_size, min(n, (c + 1) * chunk_size)
        fk.split_planes(words, lo, hi, width, rotate, planes, hist[c])
    run_tasks(task, nch)
    modes = entropy.modes_for("bytes", 8)
    out = []
    for k in range(nplanes):
        an = entropy.Analysis(n, chunk_size, 8, {entropy.HUFFMAN: hist[:, k, :]}, None)
        out.append(entropy.encode(planes[k], an, modes))
    return out


def decode_planes(buf: np.ndarray, base: int, layouts, n: int, chunk_size: int,
                  rotate: bool, words: np.ndarray, what: str):
    """Decode every plane, then interleave them back into ``words``."""
    width = 8 * words.dtype.itemsize
    planes = np.empty((len(layouts), n), np.uint8)
    for k, layout in enumerate(layouts):
        entropy.decode(buf, base, layout, n, chunk_size, 8, planes[k], what)
        base += int(layout.offsets[-1])

    def task(c):
        lo, hi = c * chunk_size, min(n, (c + 1) * chunk_size)
        fk.merge_planes(planes, lo, hi, width, rotate, words)
    run_tasks(task, -(-n // chunk_size))
