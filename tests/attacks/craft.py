"""Builders of hostile inputs: forged blobs, crafted headers, swapped and spliced sections.

Each builder writes what an attacker (or an unlucky copy) could produce, with every
checksum an attacker can recompute made valid, so a test sees the defence that matters.
"""

import io
import json
import struct
import zlib

import numpy as np

from lcckpt.codec import blob as B
from lcckpt.format import container as C
from lcckpt.codec import dtypes, entropy, lossless

CONST = entropy.CONST


def const_blob(shape, dtype="F32", lossy=False, log2=24) -> bytes:
    """A blob of ``shape`` whose every chunk is the constant 0: two bytes per 2**log2
    elements per plane, so a few hundred bytes describe gigabytes."""
    dt = dtypes.BY_NAME[dtype]
    n = int(np.prod(shape, dtype=object)) if shape else 1
    cs = 1 << log2
    w = B._header(B.LOSSY if lossy else B.LOSSLESS, dt, shape, log2)   # every field by hand
    if lossy:
        w.u8(2)        # bits
        w.u8(0)        # flags
        w.u8(0)        # kept buckets: no centroids
        planes, words = 1, n
    else:
        carrier, rotate = lossless.words_of(np.empty(0, dt.numpy), dt.kind)
        planes, words = carrier.dtype.itemsize, B.words_n(n, dt)
        w.u8(planes)
        w.u8(int(rotate))
    for _ in range(planes):
        w.u8(0)                                  # no code tables
        for _ in range(-(-words // cs)):
            w.u8(CONST)
            w.u8(0)
    return b"".join(bytes(p) for p in B.finish(w, []))


def tensor_file(blob: bytes, shape, dtype="F32", codec="lossless", device="cpu",
                meta_shape=None) -> bytes:
    """A valid container whose one tensor section holds ``blob``."""
    meta_shape = list(shape) if meta_shape is None else meta_shape
    itemsize = dtypes.BY_NAME[dtype].numpy.itemsize
    nbytes = int(np.prod(meta_shape, dtype=object)) * itemsize if meta_shape else itemsize
    meta = {"kind": "tensor", "dtype": dtype, "shape": meta_shape, "nbytes": nbytes,
            "codec": codec, "device": device}
    if codec == "delta":
        meta["codec_params"] = {"key": 'obj["t"]'}
    return container([('obj["t"]', meta, blob)], {"$": "dict", "items": [["t", {"$": "tensor", "s": 0}]]})


def container(sections, tree) -> bytes:
    f = io.BytesIO()
    C.write_container(f, sections, {"lcckpt_tree": 1, "tree": tree})
    return f.getvalue()


def raw_header_file(header_bytes: bytes, version=2, data=b"", flags=0) -> bytes:
    """A container whose header is ``header_bytes`` verbatim (stored as is: pass compressed
    bytes with ``flags=1``), with a valid header CRC and the version's padding."""
    head = struct.pack("<6sHQII", C.MAGIC, version, len(header_bytes),
                       zlib.crc32(header_bytes), flags) + header_bytes
    return head + bytes(-len(head) % C.ALIGNMENTS[version]) + data


def _header(c) -> dict:
    """The parsed header of an open container (whether it was stored compressed or not)."""
    return {"version": c.version, "meta": c.meta, "sections": c.sections}


def with_tree(raw: bytes, tree) -> bytes:
    """``raw`` with its object tree replaced (header CRC recomputed)."""
    c = C.read_container(raw)
    header = json.loads(json.dumps(_header(c)))
    header["meta"]["tree"] = tree
    data = raw[c.data_start:]
    return raw_header_file(json.dumps(header).encode(), c.version, data)


def with_section_meta(raw: bytes, index: int, **changes) -> bytes:
    """``raw`` with keys of one section's meta changed (header CRC recomputed)."""
    c = C.read_container(raw)
    header = json.loads(json.dumps(_header(c)))
    header["sections"][index]["meta"].update(changes)
    return raw_header_file(json.dumps(header).encode(), c.version, raw[c.data_start:])


def section_spans(raw: bytes) -> list[tuple[int, int]]:
    """``(start, length)`` of every section in ``raw``."""
    with C.read_container(raw) as c:
        return [(c.data_start + s["offset"], s["length"]) for s in c.sections]


def equal_length_pairs(raw: bytes) -> list[tuple[int, int]]:
    spans = section_spans(raw)
    return [(i, j) for i in range(len(spans)) for j in range(i + 1, len(spans))
            if spans[i][1] == spans[j][1] and spans[i][1] > 0]


def swap(raw: bytes, i: int, j: int) -> bytes:
    """``raw`` with the bytes of sections ``i`` and ``j`` (of equal length) exchanged."""
    spans = section_spans(raw)
    (a, n), (b, m) = spans[i], spans[j]
    assert n == m
    out = bytearray(raw)
    out[a:a + n], out[b:b + n] = raw[b:b + n], raw[a:a + n]
    return bytes(out)


def splice(raw: bytes, i: int, donor: bytes, j: int) -> bytes:
    """``raw`` with section ``i``'s bytes replaced by section ``j`` of ``donor`` (same length)."""
    (a, n), = [section_spans(raw)[i]]
    (b, m), = [section_spans(donor)[j]]
    assert n == m
    out = bytearray(raw)
    out[a:a + n] = donor[b:b + n]
    return bytes(out)


def blob_splice(x: bytes, y: bytes) -> bytes | None:
    """The header of blob ``x`` (with its CRC) followed by the payload of blob ``y``
    (with its CRC): valid inner checksums, wrong content. None if they do not fit."""
    _, px = B.parse(x)
    _, py = B.parse(y)
    if px.payload_base != py.payload_base:
        return None
    return x[:px.payload_base] + y[py.payload_base:]
