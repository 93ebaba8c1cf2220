"""The compiled blob header parser (codec/kernels/head.py) against the field-by-field
Python parser it replaced (oracles.parse_ref): on blobs of every kind, and on every
truncation and many byte changes of their headers, the same fields or the same error."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import lcckpt
from lcckpt.codec.blob import parse

from oracles import parse_ref

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _blobs() -> list:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(5000) * 0.02).astype(np.float32)
    out = []
    for bits in (1, 2, 3, 4):
        for coder in ("auto", "huffman", "grouped", "runs"):
            out.append(lcckpt.encode(x, bits=bits, coder=coder, chunk_size=1024))
    out.append(lcckpt.encode(x, bits=3, midpoint=True))
    out.append(lcckpt.encode(x.astype(np.float64).reshape(50, 100), bits=2))
    y = x.copy()
    y[[17, 4000]] = 1e3                       # escapes
    for target in (0.001, 0.05):
        out.append(lcckpt.encode(y, target=target, chunk_size=1024))
    out.append(lcckpt.encode(y.astype(np.float64), target=0.01))
    for arr in (x, x.astype(np.float64), x.astype(np.float16), (x * 100).astype(np.int32),
                x > 0, (x + 1j * x).astype(np.complex64), np.zeros((0, 3), np.float32),
                np.float32(1.5)):
        out.append(lcckpt.encode(np.asarray(arr), lossless=True))
    out.append(lcckpt.encode(torch.from_numpy(x).to(torch.bfloat16), lossless=True))
    big = (rng.standard_normal(300_000) * 0.02).astype(np.float32)   # "pairs" chunks
    out.append(lcckpt.encode(big, lossless=True))
    sparse = np.zeros(300_000, np.float32)                # zero-runs chunks (version 4)
    sparse[5_000:9_000] = big[:4_000]
    out.append(lcckpt.encode(sparse, lossless=True, chunk_size=1 << 15))
    assert out[-1][3] == 4
    return [bytes(b) for b in out]


BLOBS = _blobs()


def _outcome(fn, blob, **kw):
    try:
        buf, p = fn(blob, **kw)
    except lcckpt.LcckptError as e:
        return type(e), str(e)
    lay = [(lay.modes.tolist(), lay.consts.tolist(), lay.offsets.tolist(),
            {m: v.tolist() for m, v in lay.lengths.items()}) for lay in p.layouts]
    arrays = [None if a is None else (a.dtype.str, a.tolist())
              for a in (p.centroids, p.esc_idx, p.esc_val)]
    return (p.kind, p.dt, p.shape, p.n, p.log2, p.payload_base, p.bits, p.midpoint,
            p.rotate, p.step, lay, arrays)


def _same(blob, **kw):
    want = _outcome(parse_ref, blob, **kw)
    if isinstance(want[0], type) and " exceeds its limit " in want[1]:
        field, value = want[1].split(" exceeds")[0].rsplit(" = ", 1)
        if int(value) >= 1 << 63:            # past int64: the compiled parser says so
            want = (want[0], want[1].replace(f" = {value}", " of 2**63 or more"))
    got = _outcome(parse, blob, **kw)
    assert got == want, (got, want)
    return want


def test_every_kind_parses_to_the_same_fields():
    kinds, versions = set(), set()
    for blob in BLOBS:
        out = _same(blob)
        assert not isinstance(out[0], type)            # valid blobs parse
        kinds.add(blob[4])
        versions.add(blob[3])
    assert kinds == {1, 2, 3} and versions == {1, 2, 3, 4}


def test_every_truncation_of_a_header_fails_the_same_way():
    for blob in BLOBS:
        for cut in range(0, min(len(blob), 200)):
            _same(blob[:cut])
            if cut >= 4:
                _same(blob[:cut], check_payload=False, size=len(blob))


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(BLOBS) - 1), st.data())
def test_changed_header_bytes_fail_or_parse_the_same_way(which, data):
    blob = bytearray(BLOBS[which])
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, min(len(blob), 120) - 1))
        blob[at] = data.draw(st.integers(0, 255))
    _same(bytes(blob))
    _same(bytes(blob), check_payload=False)


def test_varints_past_64_bits_and_past_their_limits():
    blob = bytearray(BLOBS[0])
    assert blob[6] == 1                                     # ndim 1, then the dimension
    for tail in ([0x80] * 9 + [0x01], [0x80] * 9 + [0x80, 0x01], [0xFF] * 9 + [0x7F],
                 [0x41], [0x80] * 6 + [0x40]):
        _same(bytes(blob[:6]) + bytes(tail) + bytes(blob[7:]))
        _same(bytes(blob[:7]) + bytes(tail) + bytes(blob[8:]))
