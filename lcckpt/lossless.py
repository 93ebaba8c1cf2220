"""Exact coding of any fixed-width array: byte planes, each Huffman-coded or raw.

Floats are rotated left by one bit first so their exponent fills one plane (ZipNN's
observation: the exponent carries ~2.6 bits of entropy in 8, the mantissa is near
random). Every plane then goes through :mod:`lcckpt.entropy` in the ``bytes`` modes:
per chunk the cheapest of Huffman, raw, or constant. Integers and bools use the same
path without rotation, so step counters and masks shrink too.
"""

import threading

import numpy as np

from . import entropy
from ._pool import run_tasks
from .errors import CorruptDataError
from .kernels import floats as fk

_WORD = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def words_of(a: np.ndarray, kind: str) -> tuple[np.ndarray, bool]:
    """Flat unsigned-integer view of the element bits, and whether to rotate."""
    flat = a.reshape(-1)
    if kind == "complex":                 # a pair of floats per element
        flat = flat.view(np.float32 if a.dtype.itemsize == 8 else np.float64)
    item = flat.dtype.itemsize
    return flat.view(_WORD[item]), kind in ("float", "complex") and item > 1


CODE_IF_BELOW = 0.8     # code a mantissa plane only if it promises to save 20%: a 256-letter
                        # code decodes at ~4 ns per byte, a raw plane is read in place


def encode_planes(words: np.ndarray, rotate: bool, chunk_size: int):
    """Split into planes and code each; returns the list of :class:`entropy.Encoded`.

    The top plane of a float (its exponent) is counted exactly during the split; the
    other planes are sampled, recounted exactly only when the sample says coding pays,
    and otherwise stored raw as views of the plane.
    """
    n = words.size
    item = words.dtype.itemsize
    nch = -(-n // chunk_size)
    modes = entropy.modes_for("bytes", 8)
    if item == 1:
        planes = words.view(np.uint8).reshape(1, n)
        hist = np.zeros((nch, 1, 256), np.int64)
        sampled = [0]
    else:
        planes, hist = _split(words, rotate, chunk_size)
        sampled = list(range(item - 1)) + ([] if rotate else [item - 1])
    out = []
    for k in range(item):
        plane = planes[k]
        if k in sampled:
            if item > 1:
                sample = hist[:, k, :].sum(axis=0)
                total = int(sample.sum())
                if total == 0 or _sample_entropy(sample, total) > 8 * CODE_IF_BELOW:
                    out.append(entropy.raw_stream(plane, chunk_size))
                    continue
                hist[:, k, :] = 0

            def count(c, plane=plane, k=k):
                lo, hi = c * chunk_size, min(n, (c + 1) * chunk_size)
                fk.byte_histogram(plane, lo, hi, hist[c, k])
            run_tasks(count, nch)
        an = entropy.Analysis(n, chunk_size, 8, {entropy.HUFFMAN: hist[:, k, :]}, None)
        out.append(entropy.encode(plane, an, modes))
    return out


def _sample_entropy(sample: np.ndarray, total: int) -> float:
    """Bits per byte estimated from a sample, with the Miller-Madow correction: a small
    sample of a near-random plane looks skewed (80 draws from 256 values cannot show more
    than 6.3 bits), and coding it would cost a table for nothing."""
    used = int(np.count_nonzero(sample))
    return entropy.entropy_bits(sample) / total + (used - 1) / (2 * total * np.log(2))


def _split(words: np.ndarray, rotate: bool, chunk_size: int):
    """Planes and per-chunk histograms (top plane exact, the others sampled), chunk-parallel."""
    n = words.size
    item = words.dtype.itemsize
    nch = -(-n // chunk_size)
    planes = np.empty((item, n), np.uint8)
    hist = np.zeros((nch, item, 256), np.int64)
    split = fk.SPLIT[item]

    def task(c):
        lo, hi = c * chunk_size, min(n, (c + 1) * chunk_size)
        split(words, lo, hi, rotate, planes, hist[c])
    run_tasks(task, nch)
    return planes, hist


def raw_planes(words: np.ndarray, rotate: bool, chunk_size: int):
    """Every plane stored raw (still split, so the blob layout stays the same)."""
    if words.dtype.itemsize == 1:
        return [entropy.raw_stream(words.view(np.uint8), chunk_size)]
    planes, _ = _split(words, rotate, chunk_size)
    return [entropy.raw_stream(plane, chunk_size) for plane in planes]


def _readonly(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v


def plane_decoder(buf: np.ndarray, base: int, layouts, n: int, chunk_size: int,
                  rotate: bool, words: np.ndarray, what: str):
    """``task(c)`` that decodes chunk ``c`` of every plane and interleaves it into ``words``.

    A plane stored raw throughout is read in place from ``buf``; a coded plane is decoded
    into a small per-thread buffer and merged right away, while it is in cache. The
    caller runs the task for every chunk, alone or as the first step of a larger
    per-chunk task (a keyframe followed by its deltas).
    """
    item = words.dtype.itemsize
    if item == 1:
        return entropy.StreamDecoder(buf, base, layouts[0], n, chunk_size, 8,
                                     words.view(np.uint8), what).chunk
    raw, coded = {}, {}                  # plane -> its bytes in buf / its decoder
    for k, layout in enumerate(layouts):
        size = int(layout.offsets[-1])
        if base + size > buf.size:
            raise CorruptDataError(f"{what}: chunk table points past the end of the data")
        if np.all(layout.modes == entropy.RAW):      # read_tables checked every raw size
            raw[k] = _readonly(buf[base:base + n])
        else:
            coded[k] = entropy.StreamDecoder(buf, base, layout, n, chunk_size, 8, None, what)
        base += size
    merge = fk.MERGE[item]

    def task(c):
        lo, hi = c * chunk_size, min(n, (c + 1) * chunk_size)
        planes = []
        for k in range(item):
            if k in raw:
                planes.append(raw[k][lo:hi])
            else:
                block = _block(k, chunk_size)
                coded[k].chunk(c, block, lo)
                planes.append(_readonly(block[:hi - lo]))
        merge(tuple(planes), 0, hi - lo, rotate, words[lo:hi])
    return task


_blocks = threading.local()


def _block(k: int, size: int) -> np.ndarray:
    """A per-thread buffer for decoded plane ``k`` of one chunk: small, reused, in cache,
    instead of a whole decoded plane in fresh memory."""
    bufs = getattr(_blocks, "bufs", None)
    if bufs is None:
        bufs = _blocks.bufs = {}
    b = bufs.get(k)
    if b is None or b.size < size:
        b = bufs[k] = np.empty(size, np.uint8)
    return b
