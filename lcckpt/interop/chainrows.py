"""Rows of a chain step's tensor, read and decoded chunk by chunk along its chain.

A lazy slice of a delta-coded tensor used to rebuild the whole tensor: every blob of its
chain read and checked, every chunk of each replayed. Here only the chunks holding the
rows are read, from the keyframe and from every delta after it, and replayed in order:
the rows come out bit for bit as the whole tensor's, at the cost of a few chunks per
file. Like a raw or lossless slice of a single file, those bytes are checked by the
windows that hold them (lcckpt/format/windows.py); the chunk tables bound every decode,
and escapes are validated before they are set (docs/interop.md).
"""

from __future__ import annotations

import numpy as np

from .. import limits
from ..codec import blob as _blob
from ..codec.replay import replay_window
from ..codec.streamed import read_header
from ..codec.streams import StreamDecoder
from ..codec.tensor import chunk_spans, decode_exact_chunks
from ..format import sections as _sections


def chain_span(chain: list, meta: dict, first: int, last: int, max_bytes, what: str):
    """Elements ``first..last`` of the flat tensor that the blobs of ``chain`` give
    (``(container, section)`` pairs, oldest first, the step's own last), as an array of
    its dtype; None where only a whole replay gives them: a tensor not in its working
    precision (a bf16 keyframe is widened when read), blobs of another shape or chunking,
    no keyframe to start from (the whole replay names the fault)."""
    name = meta.get("dtype")
    if name not in ("F32", "F64") or type(meta.get("shape")) is not list:
        return None
    heads = [_header(c, s) for c, s in chain]
    starts = [k for k, ((c, s), p) in enumerate(zip(chain, heads))
              if p.kind == _blob.LOSSLESS or _sections.section_zero_base(c.sections[s]["meta"])]
    if not starts:
        return None
    chain, heads = chain[starts[-1]:], heads[starts[-1]:]
    p0 = heads[0]
    deltas = heads[1:] if p0.kind == _blob.LOSSLESS else heads
    if any(p.dt.name != name or list(p.shape) != meta["shape"] or p.log2 != p0.log2
           for p in heads) or any(p.kind == _blob.LOSSLESS or len(p.layouts) != 1
                                  for p in deltas) or not 0 <= first <= last < p0.n:
        return None
    cs = 1 << p0.log2
    k0, k1 = first // cs, last // cs + 1
    lo, hi = k0 * cs, min(p0.n, k1 * cs)
    stored = sum(int(p.layouts[0].offsets[k1]) - int(p.layouts[0].offsets[k0]) for p in deltas)
    limits.check(stored + len(chain) * (hi - lo) * p0.dt.itemsize,
                 sum(c.size for c, _ in chain), max_bytes, what)
    ref = np.empty(p0.n, p0.dt.numpy)             # only the pages of those chunks are touched
    if p0.kind == _blob.LOSSLESS:
        (c, s), spans = chain[0], chunk_spans(p0, k0, k1)
        data, pos = np.empty(sum(n for _, n in spans), np.uint8), 0
        for off, n in spans:
            c.read_part(s, off, data[pos:pos + n])
            pos += n
        decode_exact_chunks(p0, k0, k1, data, out=ref[lo:hi])
        chain = chain[1:]
    else:                                          # a delta against zeros starts it
        ref[lo:hi] = 0
    decoders = [(_window(c, s, p, ref, k0, k1, what), p) for (c, s), p in zip(chain, deltas)]
    replay_window(decoders, ref, k0, k1)
    return ref[first:last + 1].copy()


def _header(c, s: int) -> _blob.Parsed:
    return read_header(lambda off, out: c.read_part(s, off, out), c.sections[s]["length"])


def _window(c, s: int, p: _blob.Parsed, ref: np.ndarray, k0: int, k1: int, what: str):
    """A decoder of delta ``p`` (section ``s`` of ``c``) over chunks ``k0..k1-1`` alone,
    adding into ``ref``; its escapes read (and checked) whole."""
    off = p.layouts[0].offsets
    data = np.empty(int(off[k1]) - int(off[k0]), np.uint8)
    c.read_part(s, p.payload_base + int(off[k0]), data)
    if p.kind == _blob.UNIFORM and p.esc_idx.size:
        at = p.payload_base + int(off[-1])
        tail = np.empty(c.sections[s]["length"] - at, np.uint8)
        c.read_part(s, at, tail)
        _blob.read_escapes(tail, 0, p)
    dec = StreamDecoder(None, p.payload_base, p.layouts[0], p.n, 1 << p.log2, p.bits, None,
                        what, apply=(p.centroids, ref))
    dec.window(data, k0, k1)
    return dec

