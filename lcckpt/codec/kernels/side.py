"""Four Huffman streams of byte letters decoded side by side, each from its own buffer and
with its own tables: one chunk of four deltas of a chain (each its own blob and code), so
that a replay decodes the deltas of a chunk together and adds them in order.

The loop is ``planes.decode_top4``'s (the exact codec's, four streams sharing one table):
independent chains of table lookups keep the core busy while one waits, four lookups per
8-byte load. Its letters are stored to ``out`` at each stream's offset, eight bytes per
lookup (``ROOM`` bytes past a stream's letters are written over); the careful reader of
:mod:`lcckpt.codec.kernels.bits` finishes each stream's last bytes.
"""

import numpy as np
from numba import njit

from .bits import load64
from .planes import _fast, _put_entry, _tail


@njit(cache=True, nogil=True)
def decode4(bufs, s, e, n, multis, singles, tbs, out, o, used):
    """Decode stream ``j`` (``bufs[j][s[j]:e[j]]``, ``n[j]`` letters, multi table
    ``multis[j]``, single table ``singles[j]`` of ``tbs[j]`` bits) into ``out[o[j]:]``;
    ``used[j]`` gets the bits it consumed, -1 if invalid. ``o`` keeps ``n[j] + 8`` bytes
    of ``out`` apart per stream."""
    buf0, buf1, buf2, buf3 = bufs
    m0, m1, m2, m3 = multis
    b0 = np.uint64(8 * s[0])
    b1 = np.uint64(8 * s[1])
    b2 = np.uint64(8 * s[2])
    b3 = np.uint64(8 * s[3])
    ok = True
    for j in range(4):
        if e[j] < 8:
            ok = False
    l0 = np.uint64(max(e[0], 8) - 8) << np.uint64(3)
    l1 = np.uint64(max(e[1], 8) - 8) << np.uint64(3)
    l2 = np.uint64(max(e[2], 8) - 8) << np.uint64(3)
    l3 = np.uint64(max(e[3], 8) - 8) << np.uint64(3)
    i0 = 0
    i1 = 0
    i2 = 0
    i3 = 0
    o0, o1, o2, o3 = o[0], o[1], o[2], o[3]
    f4 = np.uint64(15)
    bad = False
    while ok:
        room = min(min(n[0] - i0, n[1] - i1), min(n[2] - i2, n[3] - i3)) - 26
        bits = min(min(np.int64(l0) - np.int64(b0), np.int64(l1) - np.int64(b1)),
                   min(np.int64(l2) - np.int64(b2), np.int64(l3) - np.int64(b3)))
        if room < 0 or bits < 0:
            break
        before = i0 + i1 + i2 + i3
        for _ in range(min(room // 24, bits // 48) + 1):
            w0 = load64(buf0, b0 >> np.uint64(3)) << (b0 & np.uint64(7))
            w1 = load64(buf1, b1 >> np.uint64(3)) << (b1 & np.uint64(7))
            w2 = load64(buf2, b2 >> np.uint64(3)) << (b2 & np.uint64(7))
            w3 = load64(buf3, b3 >> np.uint64(3)) << (b3 & np.uint64(7))
            for _k in range(4):
                x0 = _put_entry(w0, m0, out, o0 + i0)
                x1 = _put_entry(w1, m1, out, o1 + i1)
                x2 = _put_entry(w2, m2, out, o2 + i2)
                x3 = _put_entry(w3, m3, out, o3 + i3)
                w0 <<= x0 & f4
                w1 <<= x1 & f4
                w2 <<= x2 & f4
                w3 <<= x3 & f4
                b0 += x0 & f4
                b1 += x1 & f4
                b2 += x2 & f4
                b3 += x3 & f4
                i0 += np.int64((x0 >> np.uint64(4)) & f4)
                i1 += np.int64((x1 >> np.uint64(4)) & f4)
                i2 += np.int64((x2 >> np.uint64(4)) & f4)
                i3 += np.int64((x3 >> np.uint64(4)) & f4)
        if i0 + i1 + i2 + i3 == before:              # every stream stalled
            bad = True
            break
    for j in range(4):
        used[j] = -1
    if bad:
        return
    t0, t1, t2, t3 = singles             # unpacked, as the buffers: they need not share a
    used[0] = _finish(buf0, s[0], b0, e[0], i0, n[0], m0, t0, tbs[0], out, o0)   # type
    used[1] = _finish(buf1, s[1], b1, e[1], i1, n[1], m1, t1, tbs[1], out, o1)
    used[2] = _finish(buf2, s[2], b2, e[2], i2, n[2], m2, t2, tbs[2], out, o2)
    used[3] = _finish(buf3, s[3], b3, e[3], i3, n[3], m3, t3, tbs[3], out, o3)


@njit(cache=True, nogil=True, inline="always")
def _finish(buf, start, bp, end, i, n, multi, single, tb, out, o):
    """One stream's rest: fast lookups while eight bytes can be loaded, then the careful
    reader; the bits consumed in all, or -1."""
    bp, i = _fast(buf, bp, end, i, n, multi, out, o)
    if i < 0:
        return -1
    return _tail(buf, start, bp, end, i, n, single, tb, out, o)
