"""A blob's header parsed and checked in one compiled call (layout: codec/blob.py).

A restore parses one header per blob of every file of a chain: a transformer's chain of a
keyframe and 10 deltas holds over 3,000 blobs, most of them small tensors, and field by
field in Python each took about 28 us, as long as replaying the blob itself. Every read
here is checked against ``end``; a failure comes back as a code and two details that
blob.py turns into the exception the field-by-field parser raised.
"""

import numpy as np

from ...util.jit import kernel
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
# read_head's int64 output: these fields, then the shape (params[3] entries), then per
# stream its code lengths' bounds in the uint8 output (4 each), then its chunk offsets
NF = 24
(F_END, F_VERSION, F_KIND, F_CODE, F_NDIM, F_LOG2, F_BITS, F_FLAGS, F_KEPT, F_ESCAPES,
 F_PLANES, F_ROTATE, F_HEADER_END, F_CRC, F_PAYLOAD, F_CENTROIDS, F_VARIANT, F_STREAM_BITS,
 F_SYMBOLS, F_ROOM, F_CAP, F_ERR, F_D1, F_D2) = range(NF)


@kernel
def _varint(buf, pos, end, limit, field):
    """``(value, pos, error, detail, detail2)`` of an unsigned LEB128 varint at most
    ``limit``. Truncated: the byte it needed and where; more than 64 bits: malformed,
    where; past ``limit``: its value (-1 from 2**63 on) and which ``field``."""
    v, pos, err = uvar(buf, pos, end, limit)
    if err == L_TRUNCATED:
        return 0, pos, H_TRUNCATED, 1, pos
    if err == L_VARINT:
        return 0, pos, H_VARINT, pos, field
    if err == L_COUNT:
        return v, pos, H_LIMIT, v, field
    return v, pos, H_OK, 0, 0


@kernel
def _alphabet(m, b, run_classes):
    """Letters of mode ``m``'s code for ``b``-bit symbols (entropy.alphabet)."""
    if m == HUFFMAN:
        return 1 << b
    if m == GROUPED:
        return 1 << (b * max(2, 8 // b))
    return run_classes << b


@kernel
def _tables(buf, pos, size, n, log2, b, allowed, params, ints, u8, at, lo, mo, co, of):
    """One stream's code tables and chunk table: its code lengths into ``u8`` from
    ``at`` (mode ``m``'s from ``ints[lo + m]`` to ``ints[lo + m + 1]``, empty if none),
    its chunks' modes and constants into ``u8`` from ``mo`` and ``co``, their offsets
    into ``ints`` from ``of``. Returns ``(pos, error, detail, detail2)``."""
    end = buf.size
    cs = np.int64(1) << log2
    nchunks = (n + cs - 1) // cs
    if pos >= end:
        return pos, H_TRUNCATED, 1, pos
    mask = np.int64(buf[pos])
    pos += 1
    for m in range(3):
        ints[lo + m] = at
        if mask & (1 << m):
            if allowed[m] == 0:
                return pos, H_NOT_ALLOWED, 0, 0
            got, after, err, _ = read_lengths(buf, pos, end, _alphabet(m, b, params[11]),
                                              params[12])
            if err != 0:
                return pos, H_LENGTHS, err, pos
            pos = after
            dst = u8[at:at + got.size]           # room for every mode allowed
            if dst.size != got.size:             # (never: a table longer than its alphabet)
                return pos, H_LENGTHS, -1, pos
            for k in range(got.size):            # a loop: a slice assignment's shape
                dst[k] = got[k]                  # error took seconds to compile
            at += got.size
    ints[lo + 3] = at
    if mask & ~np.int64(7):
        return pos, H_MASK, mask, 0
    if 2 * nchunks > end - pos or ints[F_CAP] < nchunks:    # (the second: never)
        return pos, H_ROOM, nchunks, 0
    state = np.zeros(8, np.uint8)
    for m in range(8):
        if allowed[m]:
            state[m] = MODE_NO_TABLE if m < 3 and not mask & (1 << m) else MODE_OK
    nbytes = np.zeros(nchunks, np.int64)
    pos, err, c = read_chunk_table(buf, pos, end, nchunks, n, cs, b, state, params[6],
                                   params[7], size, u8[mo:mo + nchunks], u8[co:co + nchunks],
                                   nbytes)
    if err != T_OK:
        return pos, H_CHUNKS, err, c
    total = np.int64(0)
    ints[of] = 0
    for c in range(nchunks):
        total += nbytes[c]
        ints[of + c + 1] = total
    return pos, H_OK, 0, 0


@kernel
def read_head(buf, size, codes, allowed, params):
    """Parse a blob's header from ``buf`` (the blob, or its beginning; ``size``: the
    whole blob's bytes). Per version or dtype code (``codes``, 5 x 256): the kinds a
    version's blob may have (a bit per kind); the dtype's kind (0 no such code, 1 float,
    2 other, 3 complex); a float's work itemsize (4, 8); its lossless planes; whether
    they rotate. ``allowed[variant, bits, mode]``: the modes a stream may use (variants:
    lossy, uniform, lossless, lossless with pairs, with zero runs). ``params``: the
    magic's 3 bytes, the largest ndim, the chunk sizes' log2 bounds, the const and raw
    modes, the pairs version, the uniform and lossless kinds, the runs classes, the
    longest code.

    Returns ``(ints, u8, step)``: ``ints`` the fields ``F_*`` (the error and its two
    details among them), the shape, and each stream's code-length bounds and chunk
    offsets; ``u8`` each stream's code lengths, then every stream's chunk modes, then
    their constants (``F_ROOM`` lengths and ``F_CAP`` chunks a stream); ``step`` the
    uniform step. Few outputs and scalar-returning helpers: each array returned costs
    compile time, and this compiles on a fresh install's first restore."""
    max_ndim = params[3]
    floats = np.zeros(1, np.float64)
    fields = np.zeros(NF + max_ndim, np.int64)
    err, d1, d2, pos = _fixed(buf, size, codes, params, fields, floats)
    if err != H_OK:
        fields[F_ERR], fields[F_D1], fields[F_D2] = err, d1, d2
        return fields, np.zeros(0, np.uint8), floats[0]
    end = buf.size
    variant, bits, nsym = fields[F_VARIANT], fields[F_STREAM_BITS], fields[F_SYMBOLS]
    nplanes = max(fields[F_PLANES], 1)
    cs = np.int64(1) << fields[F_LOG2]
    nchunks = (nsym + cs - 1) // cs
    room = 0
    for m in range(3):
        if allowed[variant, bits, m]:
            room += _alphabet(m, bits, params[11])
    # every chunk's entry takes two bytes or more: where the bytes left cannot hold one
    # plane's, the parse fails before its chunk table (the size may be a partial read's)
    cap = nchunks if 2 * nchunks <= end - pos else 0
    lo0 = NF + max_ndim
    of0 = lo0 + 4 * nplanes
    ints = np.zeros(of0 + nplanes * (cap + 1), np.int64)
    for k in range(lo0):                  # not ``ints[:lo0] = fields``: its shape check's
        ints[k] = fields[k]               # error took seconds to compile
    ints[F_ROOM], ints[F_CAP] = room, cap
    u8 = np.zeros(nplanes * (room + 2 * cap), np.uint8)
    mo0 = nplanes * room
    payload = np.int64(0)
    for plane in range(nplanes):
        pos, err, d1, d2 = _tables(buf, pos, size, nsym, fields[F_LOG2], bits,
                                   allowed[variant, bits], params, ints, u8, plane * room,
                                   lo0 + 4 * plane, mo0 + plane * cap,
                                   mo0 + (nplanes + plane) * cap, of0 + plane * (cap + 1))
        if err != H_OK:
            break
        payload += ints[of0 + plane * (cap + 1) + nchunks]
    if err == H_OK:
        ints[F_HEADER_END] = pos
        if pos + 4 > end:
            err, d1, d2 = H_TRUNCATED, np.int64(4), pos
        else:
            ints[F_CRC] = (np.int64(buf[pos]) | (np.int64(buf[pos + 1]) << 8)
                           | (np.int64(buf[pos + 2]) << 16) | (np.int64(buf[pos + 3]) << 24))
            ints[F_END] = pos + 4
            ints[F_PAYLOAD] = payload
    ints[F_ERR], ints[F_D1], ints[F_D2] = err, d1, d2
    return ints, u8, floats[0]


@kernel
def _fixed(buf, size, codes, params, fields, floats):
    """The header's fields up to its stream tables into ``fields`` (its shape from
    ``NF`` on) and ``floats`` (see :func:`read_head`). Returns ``(error, detail,
    detail2, pos)``."""
    shape = fields[NF:]
    versions, code_kind, work_size, planes_of, rotate_of = codes[0], codes[1], codes[2], \
        codes[3], codes[4]
    max_ndim, min_log2, max_log2 = params[3], params[4], params[5]
    pairs_version, uniform_kind, lossless_kind = params[8], params[9], params[10]
    end = buf.size
    if end < 4 or buf[0] != params[0] or buf[1] != params[1] or buf[2] != params[2]:
        return H_MAGIC, 0, 0, 0
    version = np.int64(buf[3])
    fields[F_VERSION] = version
    if version >= versions.size or versions[version] == 0:
        return H_VERSION, version, 0, 3
    pos = 4
    if pos >= end:
        return H_TRUNCATED, 1, pos, pos
    kind = np.int64(buf[pos])
    pos += 1
    fields[F_KIND] = kind
    if kind > 7 or not (versions[version] >> kind) & 1:
        return H_KIND, kind, version, pos
    if pos >= end:
        return H_TRUNCATED, 1, pos, pos
    code = np.int64(buf[pos])
    pos += 1
    fields[F_CODE] = code
    if code_kind[code] == 0:
        return H_CODE, code, 0, pos
    ndim, pos, err, d1, d2 = _varint(buf, pos, end, max_ndim, V_NDIM)
    if err != H_OK:
        return err, d1, d2, pos
    fields[F_NDIM] = ndim
    n = np.int64(1)
    for k in range(ndim):
        dim, pos, err, d1, d2 = _varint(buf, pos, end, MAX_DIM, V_DIM)
        if err != H_OK:
            return err, d1, d2, pos
        shape[k] = dim
        if n != 0 and dim > _BIG // n:
            n = _BIG
        else:
            n = min(n * dim, _BIG)
    if pos >= end:
        return H_TRUNCATED, 1, pos, pos
    log2 = np.int64(buf[pos])
    pos += 1
    fields[F_LOG2] = log2
    if log2 < min_log2 or log2 > max_log2:
        return H_LOG2, log2, 0, pos
    cs = np.int64(1) << log2
    if (n + cs - 1) // cs > size:
        return H_SHAPE, 0, 0, pos
    # the kind's own fields
    variant = 0
    bits = 8
    nsym = n
    nplanes = 1
    if kind != lossless_kind:
        wsz = work_size[code]
        if code_kind[code] != 1:
            return H_WORK, kind, 0, pos
        if pos >= end:
            return H_TRUNCATED, 1, pos, pos
        bits = np.int64(buf[pos])
        pos += 1
        fields[F_BITS] = bits
        if kind == uniform_kind:
            variant = 1
            if bits < 2 or bits > 8:
                return H_BITS, bits, 0, pos
            if pos + 8 > end:
                return H_TRUNCATED, 8, pos, pos
            step = buf[pos:pos + 8].copy().view(np.float64)[0]
            pos += 8
            floats[0] = step
            if not (np.isfinite(step) and step >= 0):
                return H_STEP, 0, 0, pos
            nesc, pos, err, d1, d2 = _varint(buf, pos, end, n, V_ESCAPES)
            if err != H_OK:
                return err, d1, d2, pos
            fields[F_ESCAPES] = nesc
            top = step * np.float64(1 << (bits - 1))   # the table's largest level
            if not np.isfinite(top if wsz == 8 else np.float64(np.float32(top))):
                return H_OVERFLOW, 0, 0, pos
        else:
            if bits < 1 or bits > 4:
                return H_BITS, bits, 0, pos
            if pos >= end:
                return H_TRUNCATED, 1, pos, pos
            flags = np.int64(buf[pos])
            pos += 1
            fields[F_FLAGS] = flags
            if flags & ~np.int64(1):
                return H_FLAGS, flags, 0, pos
            if pos >= end:
                return H_TRUNCATED, 1, pos, pos
            kept = np.int64(buf[pos])
            pos += 1
            fields[F_KEPT] = kept
            if kept > (1 << bits) - 1:
                return H_KEPT, kept, bits, pos
            if pos + kept * wsz > end:
                return H_TRUNCATED, kept * wsz, pos, pos
            fields[F_CENTROIDS] = pos
            raw = buf[pos:pos + kept * wsz].copy()
            pos += kept * wsz
            if wsz == 8:
                vals = raw.view(np.float64)
                for k in range(kept):
                    if not np.isfinite(vals[k]):
                        return H_CENTROID, 0, 0, pos
            else:
                vals4 = raw.view(np.float32)
                for k in range(kept):
                    if not np.isfinite(vals4[k]):
                        return H_CENTROID, 0, 0, pos
    else:
        variant = 2 if version < pairs_version else 3 if version == pairs_version else 4
        if pos >= end:
            return H_TRUNCATED, 1, pos, pos
        nplanes = np.int64(buf[pos])
        pos += 1
        fields[F_PLANES] = nplanes
        if nplanes != planes_of[code]:
            return H_PLANES, nplanes, code, pos
        if pos >= end:
            return H_TRUNCATED, 1, pos, pos
        rot = np.int64(buf[pos])
        pos += 1
        fields[F_ROTATE] = rot
        if rot != rotate_of[code]:
            return H_ROTATE, 0, 0, pos
        if code_kind[code] == 3:
            nsym = 2 * n
    fields[F_VARIANT], fields[F_STREAM_BITS], fields[F_SYMBOLS] = variant, bits, nsym
    return H_OK, 0, 0, pos
