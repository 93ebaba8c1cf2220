"""The tensor API: round trips, the reference quantizer, stats, the guard, bad input."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

import lcckpt
from lcckpt.codec import entropy, streams
from lcckpt.codec.blob import parse

from oracles import quantize_ref

CODERS = ["huffman", "grouped", "runs", "auto"]


def _floats(dtype, shape, seed, sparsity=0.5, scale_exp=(-8, 3)):
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    x = rng.standard_normal(n) * 10.0 ** rng.uniform(*scale_exp, size=n)
    x[rng.random(n) < sparsity] = 0
    return x.astype(dtype).reshape(shape)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([np.float32, np.float64, np.float16]),
       array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40),
       st.integers(1, 4), st.sampled_from(CODERS), st.integers(0, 2**32 - 1),
       st.floats(0, 1))
def test_lossy_round_trip_equals_reference_quantizer(dtype, shape, bits, coder, seed, sparsity):
    x = _floats(dtype, shape, seed, sparsity)
    blob, stats = lcckpt.encode(x, bits=bits, coder=coder, chunk_size=1024, report=True)
    y = lcckpt.decode(blob)
    assert y.shape == x.shape and y.dtype == x.dtype
    work = x.astype(np.float64 if dtype == np.float64 else np.float32)
    sym, cent, _ = quantize_ref(work, bits)
    # same symbols; centroids may differ in the last bit only through summation order
    np.testing.assert_allclose(y.reshape(-1), cent[sym].astype(dtype),
                               rtol=max(2 * np.finfo(dtype).eps, 1e-12), atol=0)
    assert np.array_equal(y.reshape(-1) == 0, sym == 0)
    assert stats.nbytes == len(blob)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 4))
def test_every_coder_decodes_the_same_values(seed, bits):
    x = _floats(np.float32, (3000,), seed, 0.9)
    outs = [lcckpt.decode(lcckpt.encode(x, bits=bits, coder=c, chunk_size=1024)) for c in CODERS]
    for y in outs[1:]:
        assert np.array_equal(outs[0], y)


def test_faithful_size_is_the_exact_huffman_size():
    x = _floats(np.float32, (200_000,), 1, 0.3)
    blob, stats = lcckpt.encode(x, bits=2, coder="huffman", report=True)
    buf, p = parse(blob)
    payload = len(buf) - p.payload_base - 4
    lengths = p.layouts[0].lengths[entropy.HUFFMAN]
    counts = np.bincount(quantize_ref(x, 2)[0], minlength=4)
    assert payload == (counts @ lengths.astype(np.int64) + 7) // 8   # one chunk
    assert stats.mode_bits["huffman"] * x.size == pytest.approx(counts @ lengths)
    assert len(blob) - payload < 64                                 # small fixed header


@pytest.mark.parametrize("n", [7, 100, 3000, 300_000])
def test_auto_never_larger_than_any_single_coder(n):
    """Whole blobs, tables included: small tensors must not pay for a big table."""
    rng = np.random.default_rng(3)
    for bits in (1, 2, 4):
        for density in (1.0, 0.5, 0.05, 0.001, 0.0):
            x = rng.standard_normal(n).astype(np.float32)
            x[rng.random(x.size) >= density] = 0
            sizes = {c: len(lcckpt.encode(x, bits=bits, coder=c, chunk_size=1 << 16))
                     for c in CODERS}
            assert sizes["auto"] <= min(sizes[c] for c in ("huffman", "grouped", "runs"))


def test_bf16_tensor_in_tensor_out():
    t = torch.randn(1000, dtype=torch.bfloat16)
    y = lcckpt.decode(lcckpt.encode(t, bits=3))
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and y.shape == t.shape
    sym, cent, _ = quantize_ref(t.float().numpy(), 3)
    assert torch.equal(y, torch.from_numpy(cent[sym]).to(torch.bfloat16))


def test_midpoint_representative():
    x = np.array([1.0, 1.5, 1.75, -3.0, 0.0], np.float32)
    y = lcckpt.decode(lcckpt.encode(x, bits=2, midpoint=True))
    assert y[0] == y[1] == y[2] == np.float32((1.0 + 1.75) / 2) and y[3] == -3 and y[4] == 0


def test_stats_report_stages():
    x = _floats(np.float32, (100_000,), 5, 0.7)
    _, s = lcckpt.encode(x, bits=2, report=True)
    assert s.kind == "lossy" and s.bits == 2 and s.kept_buckets == 3
    assert s.bucket_entropy >= s.symbol_entropy > 0
    assert {"huffman", "runs"} <= set(s.mode_bits) <= {"huffman", "grouped", "runs"}
    assert s.bits_per_element <= min(s.mode_bits.values()) + 0.01
    assert 0 < s.rel_error < 1


@pytest.mark.parametrize("bound", [0.9, 0.5, 0.2, 0.01, 1e-9])
def test_error_bound_is_honoured(bound):
    x = _floats(np.float32, (20_000,), 7, 0.2, (-2, 1))
    blob, s = lcckpt.encode(x, bits=1, error_bound=bound, report=True)
    y = lcckpt.decode(blob)
    err = np.linalg.norm(x.astype(np.float64) - y) / np.linalg.norm(x.astype(np.float64))
    assert err <= bound
    if s.kind == "lossless":
        assert s.fallback and err == 0 and s.tried_bits == [1, 2, 3, 4]
    else:
        assert s.rel_error == pytest.approx(err, rel=1e-6, abs=1e-12)


def test_lossless_adversarial_floats_are_exact():
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1e-38,
                         3.4e38, -3.4e38, 1.0, -1.0], np.float32)
    payloads = np.array([0x7FC00001, 0xFFFFFFFF, 0x7F800001, 0x00000001], np.uint32).view(np.float32)
    rng = np.random.default_rng(0)
    x = np.concatenate([specials, payloads,
                        rng.integers(0, 2**32, 5000, dtype=np.uint32).view(np.float32)])
    for dt, carrier in ((np.float32, np.uint32), (np.float64, np.uint64), (np.float16, np.uint16)):
        with np.errstate(all="ignore"):
            a = x.astype(dt) if dt != np.float32 else x
        if dt == np.float64:
            a = np.concatenate([a, rng.integers(0, 2**63, 999, dtype=np.uint64).view(np.float64)])
        y = lcckpt.decode(lcckpt.encode(a, lossless=True, chunk_size=1024))
        assert y.dtype == a.dtype and np.array_equal(y.view(carrier), a.view(carrier))
    t = torch.from_numpy(rng.integers(0, 2**16, 3000, dtype=np.uint16).view(np.int16)) \
        .view(torch.bfloat16)
    assert torch.equal(lcckpt.decode(lcckpt.encode(t, lossless=True)).view(torch.int16),
                       t.view(torch.int16))


@settings(max_examples=60, deadline=None)
@given(arrays(st.sampled_from([np.int8, np.uint8, np.int16, np.int32, np.int64, np.bool_,
                               np.complex64, np.complex128, np.float32]),
              array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=30)))
def test_lossless_any_dtype(a):
    y = lcckpt.decode(lcckpt.encode(a, lossless=True))
    assert y.dtype == a.dtype and y.shape == a.shape
    assert y.tobytes() == a.tobytes()


def test_lossless_compresses_real_exponents():
    x = (np.random.default_rng(0).standard_normal(500_000) * 0.02).astype(np.float32)
    assert len(lcckpt.encode(x, lossless=True)) < 0.9 * x.nbytes


def test_all_zero_and_constant_tensors_are_tiny():
    z = np.zeros(1_000_000, np.float32)
    assert len(lcckpt.encode(z)) < 100
    assert np.array_equal(lcckpt.decode(lcckpt.encode(z)), z)
    assert len(lcckpt.encode(z, lossless=True)) < 100


def test_bad_input_raises_named_errors():
    with pytest.raises(lcckpt.NonFiniteError, match="array holds 1 NaN/Inf.*lossless=True"):
        lcckpt.encode(np.array([1.0, np.nan], np.float32))
    with pytest.raises(lcckpt.NonFiniteError, match="array holds 1 NaN/Inf"):
        lcckpt.encode(np.array([1.0, -np.inf]))
    with pytest.raises(lcckpt.NonFiniteError, match="array holds 2 NaN/Inf"):
        lcckpt.encode(np.array([np.inf, -np.inf, 3.0]), target=0.01)
    with pytest.raises(lcckpt.UnsupportedDtypeError):
        lcckpt.encode(np.arange(10))
    with pytest.raises(lcckpt.UnsupportedDtypeError):
        lcckpt.encode(np.array(["a"]), lossless=True)
    swapped = np.arange(5, dtype=np.dtype(np.int64).newbyteorder())       # not native
    with pytest.raises(lcckpt.UnsupportedDtypeError, match="byte order; convert it first"):
        lcckpt.encode(swapped, lossless=True)
    with pytest.raises(lcckpt.InvalidArgumentError):
        lcckpt.encode(np.ones(3, np.float32), bits=5)
    with pytest.raises(lcckpt.InvalidArgumentError):
        lcckpt.encode(np.ones(3, np.float32), coder="zip")
    with pytest.raises(lcckpt.InvalidArgumentError):
        lcckpt.encode(np.ones(3, np.float32), chunk_size=1000)


def _blobs():
    x = _floats(np.float32, (5000,), 11, 0.5)
    out = [lcckpt.encode(x, bits=b, coder=c, chunk_size=1024) for b in (1, 3) for c in CODERS]
    out.append(lcckpt.encode(x, lossless=True, chunk_size=1024))
    out.append(lcckpt.encode(np.arange(777, dtype=np.int64), lossless=True, chunk_size=1024))
    return out


def test_every_truncation_is_rejected():
    for blob in _blobs():
        for cut in range(len(blob)):
            with pytest.raises(lcckpt.LcckptError):
                lcckpt.decode(blob[:cut])


def test_bit_flips_are_rejected():
    rng = np.random.default_rng(0)
    for blob in _blobs():
        for _ in range(150):
            b = bytearray(blob)
            pos = int(rng.integers(len(b)))
            b[pos] ^= 1 << int(rng.integers(8))
            with pytest.raises(lcckpt.LcckptError):
                lcckpt.decode(bytes(b))


def test_wrong_magic_and_version():
    blob = lcckpt.encode(np.ones(10, np.float32))
    with pytest.raises(lcckpt.CorruptDataError, match="magic"):
        lcckpt.decode(b"XYZ" + blob[3:])
    with pytest.raises(lcckpt.UnsupportedVersionError):
        lcckpt.decode(blob[:3] + bytes([9]) + blob[4:])
    with pytest.raises(lcckpt.CorruptDataError):
        lcckpt.decode(blob + b"\0")


def test_code_table_size_is_what_is_written():
    from lcckpt.util.wire import Writer
    rng = np.random.default_rng(5)
    for size in (4, 16, 104, 256):
        for used in (1, 2, 3, 10, size):
            lengths = np.zeros(size, np.uint8)
            lengths[rng.choice(size, min(used, size), replace=False)] = rng.integers(1, 13, min(used, size))
            w = Writer()
            streams._write_lengths(w, lengths)
            assert len(w.buf) == entropy.lengths_size(lengths)


def test_damaged_payload_without_checksum_never_crashes():
    """With the payload checksum skipped (a container checked it already), damaged codes
    must still only raise or decode to something: the kernels bound every read and write."""
    rng = np.random.default_rng(7)
    x = _floats(np.float32, (300_000,), 12, 0.9)
    blobs = [lcckpt.encode(x, bits=b, coder=c, chunk_size=1 << 16) for b in (1, 2, 4)
             for c in CODERS]
    blobs.append(lcckpt.encode(x, lossless=True, chunk_size=1 << 16))
    outcomes = {"raised": 0, "decoded": 0}
    for blob in blobs:
        base = parse(blob)[1].payload_base
        for _ in range(40):
            b = bytearray(blob)
            for _ in range(int(rng.integers(1, 8))):
                pos = int(rng.integers(base, len(b) - 4))
                b[pos] = int(rng.integers(256))
            try:
                y = lcckpt.decode(bytes(b), check_payload=False)
                assert y.shape == x.shape
                outcomes["decoded"] += 1
            except lcckpt.LcckptError:
                outcomes["raised"] += 1
    assert outcomes["raised"] > 0              # damage is noticed where the code breaks


def test_array_likes_and_directories():
    y = lcckpt.decode(lcckpt.encode([1.0, -2.0, 0.0], bits=2))
    assert y.dtype == np.float64 and y.shape == (3,)
    assert lcckpt.decode(lcckpt.encode([[1, 2], [3, 4]], lossless=True)).tolist() == [[1, 2], [3, 4]]
    with pytest.raises(lcckpt.UnsupportedDtypeError):
        lcckpt.encode(["a", "b"], lossless=True)


def test_load_of_a_directory_says_what_to_do(tmp_path):
    with pytest.raises(lcckpt.InvalidArgumentError, match="DeltaCheckpointer"):
        lcckpt.load(tmp_path)


# ---- chunk tables: every malformed entry is refused before any kernel reads the payload

def _table_bytes(entries, huffman_table=False, tail=b""):
    from lcckpt.util.wire import Writer
    w = Writer()
    w.u8(1 << entropy.HUFFMAN if huffman_table else 0)
    if huffman_table:
        lengths = np.zeros(256, np.uint8)
        lengths[:2] = 1
        streams._write_lengths(w, lengths)
    for mode, value in entries:
        w.u8(mode)
        if mode == entropy.CONST:
            w.u8(value)
        else:
            w.uvar(value)
    return bytes(w.buf) + tail


def _read(data, n=10, cs=4, b=8, allowed=(entropy.HUFFMAN, entropy.RAW, entropy.CONST)):
    from oracles import Reader, read_tables_py
    return read_tables_py(Reader(data, what="t"), n, cs, b, allowed)


def test_chunk_table_round_trip():
    R, C, H = entropy.RAW, entropy.CONST, entropy.HUFFMAN
    data = _table_bytes([(R, 4), (C, 7), (H, 300)], huffman_table=True, tail=bytes(300))
    lay = _read(data)
    assert lay.modes.tolist() == [R, C, H] and lay.consts.tolist() == [0, 7, 0]
    assert lay.offsets.tolist() == [0, 4, 4, 304]


@pytest.mark.parametrize("entries, table, kw, match", [
    ([(entropy.GROUPED, 1)], False, {}, "mode not allowed"),
    ([(entropy.HUFFMAN, 1)], False, {}, "no code table"),
    ([(entropy.CONST, 4)], False, dict(b=2, allowed=entropy.modes_for("auto", 2)), "constant wider"),
    ([(entropy.RAW, 5)], False, {}, "raw with the wrong size"),
    ([(entropy.RAW, 4), (entropy.HUFFMAN, 10**6)], True, {}, "past the end"),
    ([(entropy.HUFFMAN, 2**62)], True, {}, "past the end"),
    ([(99, 1)], False, {}, "mode not allowed"),
])
def test_chunk_table_errors(entries, table, kw, match):
    data = _table_bytes(entries + [(entropy.CONST, 0)] * 3, huffman_table=table, tail=bytes(64))
    with pytest.raises(lcckpt.CorruptDataError, match=match):
        _read(data, **kw)


def test_chunk_table_overlong_varint_and_truncation():
    head = _table_bytes([])
    with pytest.raises(lcckpt.CorruptDataError, match="past the end"):
        _read(head + bytes([entropy.RAW]) + b"\xff" * 12 + b"\x01" + bytes(40))
    good = _table_bytes([(entropy.RAW, 4), (entropy.CONST, 7), (entropy.RAW, 2)])
    for cut in range(len(good)):
        with pytest.raises(lcckpt.TruncatedError):
            _read(good[:cut])
    with pytest.raises(lcckpt.TruncatedError, match="no room"):    # nothing allocated
        _read(good, n=10**15, cs=1)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([np.float32, np.float16, np.float64, np.int16, np.complex64, np.uint8]),
       st.integers(1, 9000), st.integers(0, 2**32 - 1), st.data())
def test_a_run_of_lossless_chunks_decodes_alone(dtype, n, seed, data):
    """decode_exact_chunks (what a lazy slice decodes) gives exactly the full decode's
    elements of chunks k0..k1-1, from those chunks' bytes only; a header parse of a
    prefix (parse(size=)) agrees with the full parse."""
    from lcckpt.codec.tensor import chunk_spans, decode_exact_chunks

    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 50).astype(dtype) if dtype != np.complex64 else \
        (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dtype)
    blob = lcckpt.encode(x, lossless=True, chunk_size=1024)
    buf, p = parse(blob)
    head, q = parse(bytes(blob[:p.payload_base]), check_payload=False, size=len(blob))
    assert (q.payload_base, q.shape, q.dt, [lay.offsets.tolist() for lay in q.layouts]) == \
        (p.payload_base, p.shape, p.dt, [lay.offsets.tolist() for lay in p.layouts])
    with pytest.raises(lcckpt.TruncatedError):
        parse(bytes(blob[:p.payload_base - 5]), check_payload=False, size=len(blob))
    per = 2 if dtype == np.complex64 else 1
    nch = -(-n * per // 1024)
    k0 = data.draw(st.integers(0, nch - 1))
    k1 = data.draw(st.integers(k0 + 1, nch))
    part = np.concatenate([np.frombuffer(blob, np.uint8)[o:o + m] for o, m in chunk_spans(p, k0, k1)])
    got = decode_exact_chunks(p, k0, k1, part)
    lo, hi = k0 * 1024 // per, min(n, k1 * 1024 // per)
    assert got.tobytes() == x[lo:hi].tobytes()


def test_a_stream_with_more_runs_letters_than_codes_is_not_coded_as_runs():
    """8-bit symbols after zero runs of seventeen lengths classes use 4,097 runs letters,
    more than codes of at most 12 bits can number: the runs mode is left out, and every
    code the stream uses is a complete prefix code (an over-subscribed one, which a
    reader refuses, came out before)."""
    from lcckpt.codec import entropy
    from lcckpt.codec.kernels import huffman as hk
    parts = []
    for c in range(17):                                   # class c: runs of 2**(c-1) zeros
        for s in range(1, 256 if c < 16 else 18):
            parts += [np.zeros((1 << c) >> 1, np.uint8), np.array([s], np.uint8)]
    sym = np.concatenate(parts)
    cs = 1 << 24                                          # one chunk: no run cut in two
    hist = np.stack([np.bincount(sym[i:i + cs], minlength=256) for i in range(0, sym.size, cs)])
    modes = entropy.uniform_modes("auto", 8)
    an = entropy.analyze(sym, hist.astype(np.int64), cs, 8, modes)
    assert np.count_nonzero(an.hist[entropy.RUNS].sum(axis=0)) > 1 << hk.MAX_CODE_LEN
    enc = entropy.encode(sym, an, modes)
    assert entropy.RUNS not in enc.lengths and entropy.RUNS not in enc.modes
    for lengths in enc.lengths.values():
        used = lengths[lengths > 0].astype(np.float64)
        assert used.max() <= hk.MAX_CODE_LEN and (2.0 ** -used).sum() <= 1.0
