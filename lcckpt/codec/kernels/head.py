"""A blob's header parsed and checked in one compiled call (layout: codec/blob.py).

A restore parses one header per blob of every file of a chain: a transformer's chain of a
keyframe and 10 deltas holds over 3,000 blobs, most of them small tensors, and field by
field in Python each took about 28 us, as long as replaying the blob itself. Every read
here is checked against ``end``; a failure comes back as a code and two details that
blob.py turns into the exception the field-by-field parser raised.
"""

import numpy as np
from numba import njit

from .tables import (
    L_COUNT, L_TRUNCATED, L_VARINT, MODE_NO_TABLE, MODE_OK, OK as T_OK, read_chunk_table,
    read_lengths, uvar,
)

(H_OK, H_MAGIC, H_TRUNCATED, H_VERSION, H_KIND, H_CODE, H_VARINT, H_LIMIT, H_LOG2, H_SHAPE,
 H_WORK, H_BITS, H_FLAGS, H_KEPT, H_CENTROID, H_STEP, H_OVERFLOW, H_PLANES, H_ROTATE,
 H_NOT_ALLOWED, H_LENGTHS, H_MASK, H_ROOM, H_CHUNKS) = range(24)
# which field a varint was (H_VARINT, H_LIMIT details)
V_NDIM, V_DIM, V_ESCAPES = range(3)
HUFFMAN, GROUPED, RUNS = 0, 1, 2     # the coded modes (entropy.CODED_MODES), in that order
MAX_DIM = 1 << 48
_BIG = 1 << 62                        # elements counted past this are "too many" anyway


@njit(cache=True, nogil=True, inline="always")
def _uvar(buf, pos, end, limit):
    """(value, pos, error, detail) of an unsigned LEB128 varint at most ``limit``: a
    varint of more than 64 bits is malformed (detail: the offset), a value of 2**63 or
    more exceeds any limit (its value then reads as -1)."""
    v, pos, err = uvar(buf, pos, end, limit)
    if err == L_TRUNCATED:
        return 0, pos, H_TRUNCATED, 1
    if err == L_VARINT:
        return 0, pos, H_VARINT, pos
    if err == L_COUNT:
        return v, pos, H_LIMIT, 0
    return v, pos, H_OK, 0


@njit(cache=True, nogil=True, inline="always")
def _f64(buf, pos):
    return buf[pos:pos + 8].copy().view(np.float64)[0]


@njit(cache=True, nogil=True)
def _alphabet(m, b, run_classes):
    if m == HUFFMAN:
        return 1 << b
    if m == GROUPED:
        return 1 << (b * max(2, 8 // b))
    return run_classes << b


@njit(cache=True, nogil=True)
def _tables(buf, pos, end, size, n, log2, b, allowed, run_classes, max_len, const_mode,
            raw_mode, lengths, lo, modes, consts, offsets, plane):
    """One stream's code tables and chunk table into row ``plane`` of the outputs
    (``lengths[lo[plane, m]:lo[plane, m + 1]]``: mode ``m``'s code lengths, empty if
    none). Returns ``(pos, error, detail, detail2)``."""
    cs = np.int64(1) << log2
    nchunks = (n + cs - 1) // cs
    if pos >= end:
        return pos, H_TRUNCATED, 1, pos
    mask = np.int64(buf[pos])
    pos += 1
    at = lo[plane, 0]
    for m in range(3):
        lo[plane, m] = at
        if mask & (1 << m):
            if allowed[m] == 0:
                return pos, H_NOT_ALLOWED, 0, 0
            got, after, err, _ = read_lengths(buf, pos, end, _alphabet(m, b, run_classes),
                                              max_len)
            if err != 0:
                return pos, H_LENGTHS, err, pos
            pos = after
            lengths[at:at + got.size] = got      # sized for every mode allowed
            at += got.size
    lo[plane, 3] = at
    if mask & ~np.int64(7):
        return pos, H_MASK, mask, 0
    if 2 * nchunks > end - pos or modes.shape[1] < nchunks:    # (the second: never)
        return pos, H_ROOM, nchunks, 0
    state = np.zeros(8, np.uint8)
    for m in range(8):
        if allowed[m]:
            state[m] = MODE_NO_TABLE if m < 3 and not mask & (1 << m) else MODE_OK
    nbytes = np.zeros(nchunks, np.int64)
    pos, err, c = read_chunk_table(buf, pos, end, nchunks, n, cs, b, state, const_mode,
                                   raw_mode, size, modes[plane, :nchunks],
                                   consts[plane, :nchunks], nbytes)
    if err != T_OK:
        return pos, H_CHUNKS, err, c
    total = np.int64(0)
    offsets[plane, 0] = 0
    for c in range(nchunks):
        total += nbytes[c]
        offsets[plane, c + 1] = total
    return pos, H_OK, 0, 0


@njit(cache=True, nogil=True)
def _fail(err, d1, d2, fields, shape, floats):
    """A failed parse's result: the error, and no tables."""
    empty = np.zeros((1, 0), np.uint8)
    return (err, d1, d2, fields, shape, floats, np.zeros(0, np.uint8), np.zeros((1, 4), np.int64),
            empty, empty, np.zeros((1, 1), np.int64))


@njit(cache=True, nogil=True)
def read_head(buf, size, codes, allowed, params):
    """Parse a blob's header from ``buf`` (the blob, or its beginning; ``size``: the
    whole blob's bytes). Per version or dtype code (``codes``, 5 x 256): the kinds a
    version's blob may have (a bit per kind); the dtype's kind (0 no such code, 1 float,
    2 other, 3 complex); a float's work itemsize (4, 8); its lossless planes; whether
    they rotate. ``allowed[variant, bits, mode]``: the modes a stream may use (variants:
    lossy, uniform, lossless, lossless with pairs). ``params``: the magic's 3 bytes, the
    largest ndim, the chunk sizes' log2 bounds, the const and raw modes, the pairs
    version, the uniform and lossless kinds, the runs classes, the longest code.

    Returns ``(err, detail, detail2, fields, shape, floats, lengths, lo, modes, consts,
    offsets)``; ``fields``: pos after the header checksum, version, kind, code, ndim,
    log2, bits, flags, kept, escapes, planes, rotate, header end, stored header CRC,
    payload bytes, centroids' offset; ``floats``: the uniform step."""
    versions, code_kind, work_size, planes_of, rotate_of = codes[0], codes[1], codes[2], \
        codes[3], codes[4]
    max_ndim, min_log2, max_log2, const_mode, raw_mode = params[3], params[4], params[5], \
        params[6], params[7]
    pairs_version, uniform_kind, lossless_kind = params[8], params[9], params[10]
    run_classes, max_len = params[11], params[12]
    fields = np.zeros(16, np.int64)
    shape = np.zeros(max_ndim, np.int64)
    floats = np.zeros(1, np.float64)
    end = buf.size
    if end < 4 or buf[0] != params[0] or buf[1] != params[1] or buf[2] != params[2]:
        return _fail(H_MAGIC, 0, 0, fields, shape, floats)
    version = np.int64(buf[3])
    fields[1] = version
    if version >= versions.size or versions[version] == 0:
        return _fail(H_VERSION, version, 0, fields, shape, floats)
    pos = 4
    if pos >= end:
        return _fail(H_TRUNCATED, 1, pos, fields, shape, floats)
    kind = np.int64(buf[pos])
    pos += 1
    fields[2] = kind
    if kind > 7 or not (versions[version] >> kind) & 1:
        return _fail(H_KIND, kind, version, fields, shape, floats)
    if pos >= end:
        return _fail(H_TRUNCATED, 1, pos, fields, shape, floats)
    code = np.int64(buf[pos])
    pos += 1
    fields[3] = code
    if code_kind[code] == 0:
        return _fail(H_CODE, code, 0, fields, shape, floats)
    ndim, pos, err, d = _uvar(buf, pos, end, max_ndim)
    if err != H_OK:
        return _fail(err, d if err != H_LIMIT else ndim, V_NDIM if err != H_TRUNCATED else pos,
                     fields, shape, floats)
    fields[4] = ndim
    n = np.int64(1)
    for k in range(ndim):
        dim, pos, err, d = _uvar(buf, pos, end, MAX_DIM)
        if err != H_OK:
            return _fail(err, d if err != H_LIMIT else dim, V_DIM if err != H_TRUNCATED else pos,
                         fields, shape, floats)
        shape[k] = dim
        if n != 0 and dim > _BIG // n:
            n = _BIG
        else:
            n = min(n * dim, _BIG)
    if pos >= end:
        return _fail(H_TRUNCATED, 1, pos, fields, shape, floats)
    log2 = np.int64(buf[pos])
    pos += 1
    fields[5] = log2
    if log2 < min_log2 or log2 > max_log2:
        return _fail(H_LOG2, log2, 0, fields, shape, floats)
    cs = np.int64(1) << log2
    if (n + cs - 1) // cs > size:
        return _fail(H_SHAPE, 0, 0, fields, shape, floats)
    # the kind's own fields
    variant = 0
    bits = 8
    nsym = n
    nplanes = 1
    if kind != lossless_kind:
        wsz = work_size[code]
        if code_kind[code] != 1:
            return _fail(H_WORK, kind, 0, fields, shape, floats)
        if pos >= end:
            return _fail(H_TRUNCATED, 1, pos, fields, shape, floats)
        bits = np.int64(buf[pos])
        pos += 1
        fields[6] = bits
        if kind == uniform_kind:
            variant = 1
            if bits < 2 or bits > 8:
                return _fail(H_BITS, bits, 0, fields, shape, floats)
            if pos + 8 > end:
                return _fail(H_TRUNCATED, 8, pos, fields, shape, floats)
            step = _f64(buf, pos)
            pos += 8
            floats[0] = step
            if not (np.isfinite(step) and step >= 0):
                return _fail(H_STEP, 0, 0, fields, shape, floats)
            nesc, pos, err, d = _uvar(buf, pos, end, n)
            if err != H_OK:
                return _fail(err, d if err != H_LIMIT else nesc,
                             V_ESCAPES if err != H_TRUNCATED else pos, fields, shape, floats)
            fields[9] = nesc
            top = step * np.float64(1 << (bits - 1))   # the table's largest level
            if not np.isfinite(top if wsz == 8 else np.float64(np.float32(top))):
                return _fail(H_OVERFLOW, 0, 0, fields, shape, floats)
        else:
            if bits < 1 or bits > 4:
                return _fail(H_BITS, bits, 0, fields, shape, floats)
            if pos >= end:
                return _fail(H_TRUNCATED, 1, pos, fields, shape, floats)
            flags = np.int64(buf[pos])
            pos += 1
            fields[7] = flags
            if flags & ~np.int64(1):
                return _fail(H_FLAGS, flags, 0, fields, shape, floats)
            if pos >= end:
                return _fail(H_TRUNCATED, 1, pos, fields, shape, floats)
            kept = np.int64(buf[pos])
            pos += 1
            fields[8] = kept
            if kept > (1 << bits) - 1:
                return _fail(H_KEPT, kept, bits, fields, shape, floats)
            if pos + kept * wsz > end:
                return _fail(H_TRUNCATED, kept * wsz, pos, fields, shape, floats)
            fields[15] = pos
            raw = buf[pos:pos + kept * wsz].copy()
            pos += kept * wsz
            if wsz == 8:
                vals = raw.view(np.float64)
                for k in range(kept):
                    if not np.isfinite(vals[k]):
                        return _fail(H_CENTROID, 0, 0, fields, shape, floats)
            else:
                vals4 = raw.view(np.float32)
                for k in range(kept):
                    if not np.isfinite(vals4[k]):
                        return _fail(H_CENTROID, 0, 0, fields, shape, floats)
    else:
        variant = 3 if version == pairs_version else 2
        if pos >= end:
            return _fail(H_TRUNCATED, 1, pos, fields, shape, floats)
        nplanes = np.int64(buf[pos])
        pos += 1
        fields[10] = nplanes
        if nplanes != planes_of[code]:
            return _fail(H_PLANES, nplanes, code, fields, shape, floats)
        if pos >= end:
            return _fail(H_TRUNCATED, 1, pos, fields, shape, floats)
        rot = np.int64(buf[pos])
        pos += 1
        fields[11] = rot
        if rot != rotate_of[code]:
            return _fail(H_ROTATE, 0, 0, fields, shape, floats)
        if code_kind[code] == 3:
            nsym = 2 * n
    # the streams' tables
    cs_bits = bits if bits <= 8 else 8
    nchunks = (nsym + cs - 1) // cs
    room = 0
    for m in range(3):
        if allowed[variant, cs_bits, m]:
            room += _alphabet(m, cs_bits, run_classes)
    # every chunk's entry takes two bytes or more: where the bytes left cannot hold one
    # plane's, the parse fails before its chunk table (the size may be a partial read's)
    cap = nchunks if 2 * nchunks <= end - pos else 0
    lengths = np.zeros(nplanes * room, np.uint8)
    lo = np.zeros((nplanes, 4), np.int64)
    modes = np.zeros((nplanes, cap), np.uint8)
    consts = np.zeros((nplanes, cap), np.uint8)
    offsets = np.zeros((nplanes, cap + 1), np.int64)
    payload = np.int64(0)
    for plane in range(nplanes):
        lo[plane, 0] = plane * room
        pos, err, d1, d2 = _tables(buf, pos, end, size, nsym, log2, cs_bits,
                                      allowed[variant, cs_bits], run_classes, max_len,
                                      const_mode, raw_mode, lengths, lo, modes, consts,
                                      offsets, plane)
        if err != H_OK:
            return (err, d1, d2, fields, shape, floats,
                    lengths, lo, modes, consts, offsets)
        payload += offsets[plane, nchunks]
    fields[12] = pos
    if pos + 4 > end:
        return (H_TRUNCATED, 4, pos, fields, shape, floats, lengths, lo, modes, consts,
                offsets)
    fields[13] = (np.int64(buf[pos]) | (np.int64(buf[pos + 1]) << 8)
                  | (np.int64(buf[pos + 2]) << 16) | (np.int64(buf[pos + 3]) << 24))
    fields[0] = pos + 4
    fields[14] = payload
    return (H_OK, 0, 0, fields, shape, floats, lengths, lo, modes, consts, offsets)
