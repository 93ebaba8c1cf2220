"""The exact codec's fused float path: exact round trips, the same format as the general
path (each decodes the other's blobs), damage detected, and the benchmark's plumbing."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lcckpt
from lcckpt.codec import tensor as codec, dtypes, floatread, lossless
from lcckpt.codec.blob import parse
from lcckpt.errors import ChecksumError, CorruptDataError, LcckptError
from helpers import same_bits

N = lossless.FAST_MIN_WORDS


def _weights(n, seed, kind):
    """Weight-like values with the awkward ones mixed in: zeros, runs of one value,
    NaN, infinities, subnormals, negative zero."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 0.02).astype(np.float32)
    if kind == "special":
        idx = rng.integers(0, n, n // 50)
        x[idx] = rng.choice(np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-40], np.float32),
                            idx.size)
    elif kind == "runs":
        x[: n // 3] = 0.5                    # whole chunks of one exponent (const chunks)
    return torch.from_numpy(x)


def _as(t, name):
    return t.to({"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name])


@settings(max_examples=12, deadline=None)
@given(name=st.sampled_from(["fp32", "bf16", "fp16"]), extra=st.integers(0, 3000),
       log2=st.integers(10, 18), kind=st.sampled_from(["plain", "special", "runs"]),
       seed=st.integers(0, 2**16))
def test_fast_path_round_trips_exactly(name, extra, log2, kind, seed):
    t = _as(_weights(N + extra, seed, kind), name).reshape(-1, 1)
    blob = lcckpt.encode(t, lossless=True, chunk_size=1 << log2)
    assert same_bits(lcckpt.decode(blob), t)
    out = torch.empty_like(t)
    lcckpt.decode(blob, out=out)
    assert same_bits(out, t)


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16"])
def test_fast_and_general_paths_read_each_others_blobs(name):
    t = _as(_weights(3 * N + 17, 1, "special"), name)
    a, dt = dtypes.to_numpy(t)
    words, rotate = lossless.words_of(a, dt.kind)
    log2 = 14
    fast = b"".join(codec.encode_exact(a, dt, log2))
    general = b"".join(codec._exact_blob(a, dt, log2, rotate,
                                         lossless.encode_planes(words, rotate, 1 << log2)))
    assert floatread.FastDecoder.applies(parse(fast)[1].layouts, words.size, rotate,
                                        words.dtype.itemsize)
    for blob in (fast, general):
        buf, p = parse(blob)
        into = np.empty_like(a)
        w, _ = lossless.words_of(into, dt.kind)
        task = lossless.plane_decoder(buf, p.payload_base, p.layouts, w.size, 1 << log2,
                                      rotate, w, "test")
        for c in range(-(-w.size // (1 << log2))):
            task(c)
        assert into.tobytes() == a.tobytes()                    # the general reader
        assert same_bits(lcckpt.decode(blob), t)                # the fast reader


@settings(max_examples=12, deadline=None)
@given(name=st.sampled_from(["fp32", "bf16", "fp16"]),
       n=st.integers(lossless.FAST_DECODE_MIN_WORDS, N - 1), log2=st.integers(10, 18),
       kind=st.sampled_from(["plain", "special", "runs"]), seed=st.integers(0, 2**16))
def test_smaller_blobs_of_the_general_writer_decode_on_the_fast_reader(name, n, log2, kind,
                                                                       seed):
    t = _as(_weights(n, seed, kind), name)
    a, dt = dtypes.to_numpy(t)
    words, rotate = lossless.words_of(a, dt.kind)
    blob = lcckpt.encode(t, lossless=True, chunk_size=1 << log2)
    layouts = parse(blob)[1].layouts
    if kind == "plain":                       # weights' lower planes are not worth coding
        assert floatread.FastDecoder.applies(layouts, words.size, rotate, words.dtype.itemsize)
    assert same_bits(lcckpt.decode(blob), t)
    out = torch.empty_like(t)
    lcckpt.decode(blob, out=out)
    assert same_bits(out, t)


def test_blob_is_an_ordinary_bytes_object():
    t = _weights(N, 2, "plain")
    blob = lcckpt.encode(t, lossless=True)
    assert type(blob) is bytes
    assert hash(blob) == hash(bytes(bytearray(blob)))
    assert blob == lcckpt.encode(t, lossless=True)              # deterministic


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_damage_is_detected(name):
    t = _as(_weights(2 * N, 3, "plain"), name)
    blob = lcckpt.encode(t, lossless=True, chunk_size=1 << 12)
    _flips_are_detected(blob, 20, seed=0)


def _flips_are_detected(blob, count, seed):
    """``count`` payload bits flipped one at a time: a checksum error each time, and
    without the checksum a named error or values (a flipped padding bit changes nothing)."""
    rng = np.random.default_rng(seed)
    for pos in rng.integers(parse(blob)[1].payload_base, len(blob) - 4, count):
        bad = bytearray(blob)
        bad[pos] ^= 1 << int(rng.integers(8))
        with pytest.raises(ChecksumError):
            lcckpt.decode(bytes(bad))
        try:
            lcckpt.decode(bytes(bad), check_payload=False)
        except LcckptError as e:
            assert isinstance(e, CorruptDataError)


def test_a_lower_plane_worth_coding_is_coded_and_the_exponents_keep_their_pairs():
    # fp32 values with only a few distinct mantissas: every chunk of the lower planes is
    # worth coding, and the exponents are still coded by the fast path's planner
    x = np.random.default_rng(0).choice(np.float32([0.1, 0.2, 0.3, -0.7]), 2 * N)
    words, _ = lossless.words_of(x, "float")
    encs = lossless.plan_floats(words, 1 << 14)
    assert all((e.modes != lossless.entropy.RAW).all() for e in encs[:-1])
    blob = lcckpt.encode(x, lossless=True, chunk_size=1 << 14)
    assert len(blob) < x.nbytes / 4
    assert lossless.entropy.PAIRS in parse(blob)[1].layouts[-1].modes
    assert np.array_equal(lcckpt.decode(blob).view(np.uint32), x.view(np.uint32))


def test_exponents_repeating_with_the_sampling_period_take_one_shared_code():
    # every 32nd exponent is the same: the sample sees one value where there are four,
    # and coding the rest as escapes would cost most of the raw plane
    x = np.tile(np.float32([0.1, 0.2, 0.3, -0.7]), N // 2)
    blob = lcckpt.encode(x, lossless=True, chunk_size=1 << 14)
    top = parse(blob)[1].layouts[-1]
    assert lossless.entropy.PAIRS not in top.modes
    assert top.offsets[-1] <= x.size * 2.1 / 8                 # two bits an exponent
    assert np.array_equal(lcckpt.decode(blob).view(np.uint32), x.view(np.uint32))


def _embedding_like(n, structured, seed=0):
    """Trained-looking weights whose first ``structured`` elements hold few distinct low
    mantissa bytes (a pretrained embedding's rows that training never touched)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 0.05).astype(np.float32)
    w = x[:structured].view(np.uint32)
    w &= ~np.uint32(0xFFFF)
    w |= rng.choice(np.uint32([0, 0x1000, 0x2000, 0x8000]), structured)
    return x


@pytest.mark.parametrize("log2", [15, 16])
def test_chunks_of_a_lower_plane_worth_coding_are_coded_where_the_plane_is_not(log2, monkeypatch):
    cs = 1 << log2
    x = _embedding_like(12 * cs + 123, 2 * cs + 77)
    blob = lcckpt.encode(x, lossless=True, chunk_size=cs)
    buf, p = parse(blob)
    for lay in p.layouts[:2]:                # the two lowest planes: the structured chunks
        assert (lay.modes[:2] != lossless.entropy.RAW).all()
        assert (lay.modes[2:] == lossless.entropy.RAW).all()
    assert lossless.entropy.PAIRS in p.layouts[-1].modes
    assert np.array_equal(lcckpt.decode(blob).view(np.uint32), x.view(np.uint32))
    words, _ = lossless.words_of(x, "float")
    for c in range(0, 13, 2):                # chunk by chunk, and a few chunks alone
        part = codec.decode_exact_chunks(p, c, min(13, c + 2), np.concatenate(
            [np.frombuffer(blob, np.uint8)[o:o + m] for o, m in codec.chunk_spans(p, c, min(13, c + 2))]))
        assert np.array_equal(part.view(np.uint32), words[c * cs:(c + 2) * cs])
    monkeypatch.setattr(lossless, "codeable_chunks", lambda s: np.zeros(len(s), bool))
    assert len(lcckpt.encode(x, lossless=True, chunk_size=cs)) > len(blob) + cs // 2


def test_damage_to_a_blob_with_coded_lower_chunks_is_detected():
    x = _embedding_like(6 * (1 << 15) + 5, 2 * (1 << 15))
    blob = lcckpt.encode(x, lossless=True, chunk_size=1 << 15)
    assert floatread.MixedDecoder.applies(parse(blob)[1].layouts, x.size, True, 4)
    _flips_are_detected(blob, 25, seed=1)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(N, 3 * N), at=st.integers(0, 3 * N), m=st.integers(1, N),
       name=st.sampled_from(["fp32", "bf16", "fp16"]), seed=st.integers(0, 2**16))
def test_structured_chunks_round_trip_on_every_reader(n, at, m, name, seed):
    x = _embedding_like(n, 0, seed)
    lo = min(at, n)
    x[lo:lo + m] = _embedding_like(min(m, n - lo), min(m, n - lo), seed + 1)
    t = _as(torch.from_numpy(x), name)
    a, dt = dtypes.to_numpy(t)
    blob = lcckpt.encode(t, lossless=True, chunk_size=1 << 15)
    assert same_bits(lcckpt.decode(blob), t)
    buf, p = parse(blob)
    into = np.empty_like(a)
    w, rotate = lossless.words_of(into, dt.kind)
    task = codec.exact_chunk_decoder(buf, p, into)           # a chain replay's reader
    for c in range(-(-w.size // (1 << 15))):
        task(c)
    assert into.tobytes() == a.tobytes()


def _sparse_rows(n, rows, seed=0, width=384):
    """A fine-tune's AdamW moment of a word embedding: the rows of tokens that no batch
    used exact zeros, ``rows`` scattered rows of ``width`` dense (second-moment-like)."""
    rng = np.random.default_rng(seed)
    x = np.zeros(n, np.float32)
    for r in rng.choice(max(1, n // width), size=min(rows, max(1, n // width)), replace=False):
        x[r * width:(r + 1) * width] = rng.standard_normal(width) ** 2 * 1e-7
    return x


def _reads_on_every_reader(blob, a, cs):
    """``blob`` decodes to ``a`` (its numpy form) chunk by chunk as a chain replay reads
    a keyframe, and two chunks at a time from their bytes alone (a lazy read)."""
    buf, p = parse(blob)
    into = np.empty_like(a)
    words, _ = lossless.words_of(into, "float")
    nch = -(-words.size // cs)
    task = codec.exact_chunk_decoder(buf, p, into)
    for c in range(nch):
        task(c)
    assert into.tobytes() == a.tobytes()
    want, _ = lossless.words_of(a, "float")
    for c in range(0, nch, 2):
        part = codec.decode_exact_chunks(p, c, min(nch, c + 2), np.concatenate(
            [np.frombuffer(blob, np.uint8)[o:o + m]
             for o, m in codec.chunk_spans(p, c, min(nch, c + 2))]))
        assert part.tobytes() == want[c * cs:(c + 2) * cs].tobytes()


def test_mostly_zero_chunks_take_zero_runs_in_a_version_4_blob(monkeypatch):
    """An embedding's moments, 98% exact zeros: their lower planes are coded as zero runs
    (a Huffman code spends a bit a byte at least), read back exactly by every reader, in
    a version-4 blob; without runs the blob is over twice the size."""
    cs = 1 << 15
    x = _sparse_rows(8 * cs + 77, 12)
    blob = lcckpt.encode(x, lossless=True, chunk_size=cs)
    assert blob[3] == _blob.RUNS_VERSION
    _, p = parse(blob)
    assert all((lay.modes == entropy.RUNS).sum() >= 4 for lay in p.layouts[:-1])
    assert lcckpt.decode(blob).tobytes() == x.tobytes()
    _reads_on_every_reader(blob, x, cs)
    monkeypatch.setattr(lossless, "RUNS_MIN_ZEROS", 2.0)        # no chunk is sized as runs
    without = lcckpt.encode(x, lossless=True, chunk_size=cs)
    assert without[3] < _blob.RUNS_VERSION and len(without) > 2 * len(blob)
    assert lcckpt.decode(without).tobytes() == x.tobytes()


@settings(max_examples=15, deadline=None)
@given(n=st.integers(N, 3 * N), rows=st.integers(0, 120), dense=st.integers(0, N),
       name=st.sampled_from(["fp32", "bf16", "fp16"]), seed=st.integers(0, 2**16))
def test_zero_runs_round_trip_on_every_reader(n, rows, dense, name, seed):
    """Zero rows, dense rows and a dense stretch (whose chunks stay Huffman-coded or raw),
    in every float width: exact on every reader."""
    x = _sparse_rows(n, rows, seed)
    x[n // 3:n // 3 + dense] = np.random.default_rng(seed).standard_normal(
        min(dense, n - n // 3)).astype(np.float32)
    t = _as(torch.from_numpy(x), name)
    a, _ = dtypes.to_numpy(t)
    blob = lcckpt.encode(t, lossless=True, chunk_size=1 << 14)
    assert same_bits(lcckpt.decode(blob), t)
    _reads_on_every_reader(blob, a, 1 << 14)


def test_zero_runs_are_not_sized_with_more_letters_than_codes():
    """A plane whose chunks use more runs letters than 12-bit codes can number gets no
    runs code (its chunks keep Huffman or raw); one within the limit gets a complete one."""
    rng = np.random.default_rng(0)
    many = np.arange(5000)
    few = np.arange(300)
    letters = {0: [(many, rng.integers(1, 50, many.size), 7), (few, rng.integers(1, 50, few.size), 3)]}
    lengths, nbytes = lossless._runs_sizes(letters, 2, 2)
    assert not lengths[0].any() and nbytes[0, 0] == lossless.NOT_CODED
    assert (lengths[1][few] > 0).all() and (2.0 ** -lengths[1][few].astype(float)).sum() == 1.0
    assert nbytes[0, 1] < lossless.NOT_CODED and nbytes[1, 1] == lossless.NOT_CODED


def test_zero_runs_are_refused_outside_version_4_and_damage_is_detected():
    """A version 1 or 3 lossless blob may not hold zero-runs chunks (older readers would
    call them damage; this one says so too); a later version asks for an upgrade."""
    import zlib
    blob = lcckpt.encode(_sparse_rows(4 * (1 << 15), 6), lossless=True, chunk_size=1 << 15)
    hdr_end = parse(blob)[1].payload_base - 4
    for version in (1, 3):
        bad = bytearray(blob)
        bad[3] = version
        bad[hdr_end:hdr_end + 4] = zlib.crc32(bytes(bad[:hdr_end])).to_bytes(4, "little")
        with pytest.raises(CorruptDataError, match="cannot use"):
            lcckpt.decode(bytes(bad))
    bad = bytearray(blob)
    bad[3] = 5
    with pytest.raises(LcckptError, match="upgrade"):
        lcckpt.decode(bytes(bad))
    _flips_are_detected(blob, 25, seed=2)


def test_crc_pieces_combine_to_zlibs_crc():
    import zlib

    from lcckpt.util import crc as _crc
    data = np.random.default_rng(5).integers(0, 256, 3 * N + 11, dtype=np.uint8)
    assert _crc.piece_crc32(data, 77) == zlib.crc32(data, 77)       # ISA-L or zlib: one CRC
    sizes = [[N, N + 11], [N]]
    pieces = [data[:N], data[N:2 * N + 11], data[2 * N + 11:]]
    crcs = np.array([[zlib.crc32(pieces[0]), zlib.crc32(pieces[1])], [zlib.crc32(pieces[2]), 0]])
    sizes[1].append(0)
    assert _crc.combine_all(crcs, sizes) == zlib.crc32(data)


def test_benchmark_reports_every_codec():
    pytest.importorskip("sklearn")
    from lcckpt.bench.exact import bench_dtype
    res = bench_dtype(_weights(N, 4, "plain").to(torch.bfloat16), "bf16", reps=1, threads=1,
                      log=lambda *_: None)
    names = [r["codec"] for r in res["rows"]]
    assert names[0] == "lcckpt" and all(r["roundtrip_ok"] for r in res["rows"])
    lc = res["rows"][0]
    assert lc["encode_bytes_per_element"] == pytest.approx(4 + 2 / lc["ratio"])


# --- per-chunk pair codes ------------------------------------------------------------

from lcckpt.codec import blob as _blob, entropy  # noqa: E402
from lcckpt.codec.kernels import planes as pk  # noqa: E402

_WORD = {"fp32": np.uint32, "bf16": np.uint16, "fp16": np.uint16, "fp64": np.uint64}
_FLOAT = {"fp32": np.float32, "fp16": np.float16, "fp64": np.float64}


def _tensor_from_bits(bits, name):
    """A tensor of dtype ``name`` holding exactly ``bits`` (NaN payloads included)."""
    if name == "bf16":
        return torch.from_numpy(bits.astype(np.uint16).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(bits.view(_FLOAT[name]))


def _weight_bits(n, seed, name, specials):
    """Weight-like element bits (std 0.02), with a share of awkward patterns: NaNs with
    payloads and either sign, infinities, subnormals, zeros of both signs, huge values."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 0.02).astype(np.float32)
    if name == "bf16":
        bits = (x.view(np.uint32) >> 16).astype(np.uint16)
        nan, inf, sub, top = 0x7F81, 0x7F80, 0x0003, 0x7F7F
    elif name == "fp16":
        bits = x.astype(np.float16).view(np.uint16)
        nan, inf, sub, top = 0x7C01, 0x7C00, 0x0003, 0x7BFF
    elif name == "fp32":
        bits = x.view(np.uint32).copy()
        nan, inf, sub, top = 0x7F800001, 0x7F800000, 0x00000003, 0x7F7FFFFF
    else:
        bits = x.astype(np.float64).view(np.uint64).copy()
        nan, inf, sub, top = 0x7FF0000000000001, 0x7FF0000000000000, 3, 0x7FEFFFFFFFFFFFFF
    w = bits.dtype.type
    if specials and n:
        sign = w(1) << w(8 * bits.itemsize - 1)
        pats = np.array([nan, nan | 0x5A, inf, sub, 0, top], dtype=bits.dtype)
        pats = np.concatenate([pats, pats | sign])
        idx = rng.integers(0, n, max(1, int(n * specials)))
        bits[idx] = rng.choice(pats, idx.size)
    return bits


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(["fp32", "bf16", "fp16", "fp64"]),
       n=st.sampled_from([1, 7, 1000, N - 1, N + 1, 2 * N + 333]),
       log2=st.sampled_from([10, 13, 16]), specials=st.sampled_from([0.0, 0.001, 0.05]),
       seed=st.integers(0, 2**16))
def test_exact_round_trip_is_bit_exact(name, n, log2, specials, seed):
    bits = _weight_bits(n, seed, name, specials)
    t = _tensor_from_bits(bits, name)
    blob = lcckpt.encode(t, lossless=True, chunk_size=1 << log2)
    back = lcckpt.decode(blob)
    back = torch.from_numpy(back) if isinstance(back, np.ndarray) else back
    assert same_bits(back, t)


def _pairs_blob(name="bf16", n=3 * N + 5, log2=14, seed=0):
    t = _tensor_from_bits(_weight_bits(n, seed, name, 0.001), name)
    blob = lcckpt.encode(t, lossless=True, chunk_size=1 << log2)
    return t, blob


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_weights_take_pairs_chunks_in_a_version_3_blob(name):
    t, blob = _pairs_blob(name)
    _, p = parse(blob)
    assert blob[3] == _blob.PAIRS_VERSION
    modes = p.layouts[-1].modes
    assert np.all(modes[:-1] == entropy.PAIRS)
    assert modes[-1] == entropy.RAW              # 5 exponents: a code table would not pay
    assert all(np.all(lay.modes == entropy.RAW) for lay in p.layouts[:-1])
    assert same_bits(lcckpt.decode(blob), t)


def test_spread_top_bytes_keep_the_shared_code_and_version_1():
    # fp16's top byte holds 3 mantissa bits: too many distinct values for 15 ranks
    t = torch.from_numpy(np.random.default_rng(1).standard_normal(2 * N).astype(np.float16))
    blob = lcckpt.encode(t, lossless=True)
    _, p = parse(blob)
    assert blob[3] == _blob.VERSION
    assert not np.any(p.layouts[-1].modes == entropy.PAIRS)
    assert same_bits(lcckpt.decode(blob), t)


def test_pairs_beat_one_shared_code_where_tensors_differ():
    # two halves with different exponent ranges: a code per chunk fits each
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.standard_normal(2 * N) * 1e-3, rng.standard_normal(2 * N) * 10])
    t = torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
    a, dt = dtypes.to_numpy(t)
    words, rotate = lossless.words_of(a, dt.kind)
    paired = len(lcckpt.encode(t, lossless=True, chunk_size=1 << 14))
    general = sum(len(bytes(memoryview(x).cast("B"))) for x in codec._exact_blob(
        a, dt, 14, rotate, lossless.encode_planes(words, rotate, 1 << 14)))
    assert paired < 0.99 * general


def test_a_constant_chunk_costs_nothing():
    x = (np.random.default_rng(3).standard_normal(2 * N) * 0.02).astype(np.float32)
    x[:1 << 13] = 0.25                       # one chunk of 16 (more would make the
    blob = lcckpt.encode(x, lossless=True, chunk_size=1 << 13)   # mantissas codeable)
    _, p = parse(blob)
    modes = p.layouts[-1].modes
    assert modes[0] == entropy.CONST and np.all(modes[1:] == entropy.PAIRS)
    assert np.array_equal(lcckpt.decode(blob).view(np.uint32), x.view(np.uint32))


def _chunk_bytes(m=5000, width=2, seed=4, specials=0.01):
    bits = _weight_bits(m, seed, "bf16" if width == 2 else "fp32", specials)
    esc = np.empty(m, np.uint8)
    out = np.empty(pk.pairs_bound(m), np.uint8)
    hist = np.zeros((width, 256), np.int64)
    size = pk.pairs_encode(bits, 0, m, width, esc, out, hist, m)
    rot = (bits.astype(np.uint64) << np.uint64(1)) >> np.uint64(8 * width - 8)
    return out[:size].copy(), (rot & np.uint64(0xFF)).astype(np.uint8)


@pytest.mark.parametrize("m", [1, 2, 3, 8, 25, 4097])
def test_pairs_kernel_round_trips_odd_lengths_in_place(m):
    data, top = _chunk_bytes(m)
    out = np.full(m + 20, 0xA5, np.uint8)
    assert pk.pairs_decode(data, 0, data.size, m, out, 10) == pk.PAIRS_OK
    assert np.array_equal(out[10:10 + m], top)
    assert np.all(out[:10] == 0xA5) and np.all(out[10 + m:] == 0xA5)


@settings(max_examples=60, deadline=None)
@given(pos=st.integers(0, 10**6), bit=st.integers(0, 7), cut=st.integers(0, 10**6),
       truncate=st.booleans())
def test_pairs_kernel_survives_damage(pos, bit, cut, truncate):
    """A damaged chunk decodes to garbage or reports an error; it never reads or
    writes outside its bytes and its output range."""
    data, top = _chunk_bytes(3001)
    bad = data.copy()
    bad[pos % bad.size] ^= np.uint8(1 << bit)
    if truncate:
        bad = bad[:cut % bad.size]
    m = top.size
    out = np.full(m + 64, 0x5A, np.uint8)
    err = pk.pairs_decode(bad, 0, bad.size, m, out, 32)
    assert err in (pk.PAIRS_OK, *pk.PAIRS_ERRORS)
    assert np.all(out[:32] == 0x5A) and np.all(out[32 + m:] == 0x5A)


def _one_code_chunk(streams, nesc=0):
    """A hand-made "pairs" chunk whose one letter (ranks 0, 0: exponent 0x7E twice)
    has the code ``00``; the other three quarters of the code space are invalid, so a
    stream of 0xFF bytes holds only invalid codes."""
    head = [1, 0x7E, 0x20] + [0] * 127
    sizes = [nesc] + [len(b) for b in streams[:3]]
    for v in sizes:
        head += list(int(v).to_bytes(4, "little"))
    return np.frombuffer(bytes(head) + b"".join(streams), np.uint8).copy()


M_HAND = 8000                        # 1000 pairs per stream: 250 bytes of ``00`` codes


@pytest.mark.parametrize("bad", [(), (2,), (0, 1, 2, 3), (3,)])
def test_pairs_kernel_reports_streams_of_invalid_codes(bad):
    """Invalid codes stall the stream that meets them in the unchecked loop; a stream
    stalled alone, or all four at once (no stream left to bound the loop), must end in
    PAIRS_BAD_CODE, and a valid chunk built the same way must decode."""
    streams = [(b"\xff" if j in bad else b"\x00") * 250 for j in range(4)]
    data = _one_code_chunk(streams)
    out = np.full(M_HAND + 64, 0x5A, np.uint8)
    err = pk.pairs_decode(data, 0, data.size, M_HAND, out, 32)
    assert err == (pk.PAIRS_BAD_CODE if bad else pk.PAIRS_OK)
    if not bad:
        assert np.all(out[32:32 + M_HAND] == 0x7E)
    assert np.all(out[:32] == 0x5A) and np.all(out[32 + M_HAND:] == 0x5A)


def test_pairs_kernel_reports_a_stream_of_the_wrong_size():
    streams = [b"\x00" * 250, b"\x00" * 251, b"\x00" * 250, b"\x00" * 250]
    data = _one_code_chunk(streams)
    out = np.empty(M_HAND, np.uint8)
    assert pk.pairs_decode(data, 0, data.size, M_HAND, out, 0) == pk.PAIRS_BAD_SIZE


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 40000), width=st.sampled_from([2, 4]), seed=st.integers(0, 2**16),
       specials=st.sampled_from([0.0, 0.01, 0.2]), at=st.integers(0, 9))
def test_pairs_kernel_round_trips_and_stays_in_its_range(m, width, seed, specials, at):
    """Every length (the fast loop, each stream's loop and the careful tail share the
    work differently) decodes exactly, and the 8-byte stores never touch a byte
    outside ``out[at:at + m]``."""
    data, top = _chunk_bytes(m, width, seed, specials)
    out = np.full(m + at + 16, 0xA5, np.uint8)
    assert pk.pairs_decode(data, 0, data.size, m, out, at) == pk.PAIRS_OK
    assert np.array_equal(out[at:at + m], top)
    assert np.all(out[:at] == 0xA5) and np.all(out[at + m:] == 0xA5)


@pytest.mark.parametrize("bad", [(), (1,), (0, 1, 2, 3), (0, 3)])
def test_four_chunk_huffman_kernel_reports_stalled_chunks(bad):
    """Four Huffman chunks decoded side by side: a chunk of invalid codes (it stalls in
    the unchecked loop) gets -1, all four at once end the loop, the others decode, and
    nothing is written outside the four chunks' outputs."""
    from lcckpt.codec.kernels import huffman as hk
    lengths = np.zeros(256, np.uint8)
    lengths[0x7E] = 2                        # code ``00``; 0xFF bytes hold invalid codes
    multi, single = hk.multi_decode_table(lengths, 8), hk.decode_table(lengths, 2)
    n, size = 4000, 1000                     # 4000 two-bit codes per chunk
    buf = np.concatenate([np.full(size, 0xFF if j in bad else 0, np.uint8) for j in range(4)])
    s = np.arange(4, dtype=np.int64) * size
    o = 32 + np.arange(4, dtype=np.int64) * n
    out = np.full(4 * n + 64, 0x5A, np.uint8)
    used = np.zeros(4, np.int64)
    pk.decode_top4(buf, s, s + size, np.full(4, n, np.int64), multi, single, 2, out, o, used)
    for j in range(4):
        if j in bad:
            assert used[j] == -1
        else:
            assert used[j] == 2 * n and np.all(out[o[j]:o[j] + n] == 0x7E)
    assert np.all(out[:32] == 0x5A) and np.all(out[32 + 4 * n:] == 0x5A)


def test_damaged_pairs_blobs_raise_lcckpt_errors():
    t, blob = _pairs_blob("bf16", n=N + 3, log2=12)
    _, p = parse(blob)
    rng = np.random.default_rng(6)
    for pos in rng.integers(0, len(blob), 60):
        bad = bytearray(blob)
        bad[pos] ^= 1 << int(rng.integers(8))
        for check in (True, False):
            try:
                lcckpt.decode(bytes(bad), check_payload=check)
            except LcckptError:
                pass
    for cut in rng.integers(0, len(blob), 20):
        with pytest.raises(LcckptError):
            lcckpt.decode(blob[:cut])


def test_pairs_chunks_are_refused_outside_version_3():
    """A version-1 lossless blob (what older writers made) may not hold pairs chunks,
    and version 3 is only for lossless blobs."""
    import zlib
    t, blob = _pairs_blob("bf16", n=N, log2=14)
    _, p = parse(blob)
    hdr_end = p.payload_base - 4
    for version, kind in ((1, 2), (3, 1)):
        bad = bytearray(blob)
        bad[3], bad[4] = version, kind
        bad[hdr_end:hdr_end + 4] = zlib.crc32(bytes(bad[:hdr_end])).to_bytes(4, "little")
        with pytest.raises(CorruptDataError):
            lcckpt.decode(bytes(bad))
    bad = bytearray(blob)
    bad[3] = 5
    with pytest.raises(LcckptError, match="upgrade"):
        lcckpt.decode(bytes(bad))


def test_delta_replay_reads_pairs_keyframes_chunk_by_chunk():
    t, blob = _pairs_blob("fp32", n=2 * N + 9, log2=13)
    buf, p = parse(blob)
    a = np.empty(t.numel(), np.float32)
    task = codec.exact_chunk_decoder(buf, p, a)
    for c in range(-(-a.size // (1 << 13))):
        task(c)
    assert np.array_equal(a.view(np.uint32), t.numpy().view(np.uint32))


# ----------------------------------------------------------- one-chunk planes (small tensors)

def _same_stream(a, b) -> None:
    """Two entropy.Encoded describe the same stream, field by field and byte by byte."""
    assert np.array_equal(a.modes, b.modes) and np.array_equal(a.consts, b.consts)
    assert np.array_equal(a.nbytes, b.nbytes)
    assert a.lengths.keys() == b.lengths.keys()
    assert all(np.array_equal(a.lengths[m], b.lengths[m]) for m in a.lengths)
    assert list(a.mode_bits.items()) == list(b.mode_bits.items())
    joined = [b"".join(np.ascontiguousarray(p).tobytes() for p in e.parts) for e in (a, b)]
    assert joined[0] == joined[1]


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 5000), spread=st.sampled_from([1, 2, 3, 16, 200, 256]),
       skew=st.floats(0.0, 3.0), seed=st.integers(0, 2**16))
def test_a_one_chunk_plane_is_coded_as_the_general_coder_codes_it(n, spread, skew, seed):
    """encode_bytes_chunk (small tensors' planes) against entropy.encode, the oracle: one
    symbol (CONST), a few, skewed (Huffman), near-uniform bytes (raw)."""
    from lcckpt.codec import entropy
    rng = np.random.default_rng(seed)
    p = np.exp(-skew * np.arange(spread))
    sym = (rng.choice(spread, n, p=p / p.sum()) * (256 // spread)).astype(np.uint8)
    counts = np.bincount(sym, minlength=256).astype(np.int64)
    an = entropy.Analysis(n, 1 << 16, 8, {entropy.HUFFMAN: counts[None, :].copy()}, None)
    fast = entropy.encode_bytes_chunk(sym, counts)
    _same_stream(fast, entropy.encode(sym, an, entropy.modes_for("bytes", 8)))


@pytest.mark.parametrize("skew, mode", [(1.4, "RAW"), (1.9, "HUFFMAN")])
def test_a_one_chunk_plane_codes_only_when_it_saves_the_margin(skew, mode):
    """Huffman 1.5% under raw is not worth its slower decode (RAW_MARGIN): stored raw, as
    the general coder stores it; far under raw, coded."""
    from lcckpt.codec import entropy
    n = 1 << 16
    p = np.r_[np.full(128, skew), np.full(128, 2 - skew)]
    sym = np.random.default_rng(0).choice(256, n, p=p / p.sum()).astype(np.uint8)
    counts = np.bincount(sym, minlength=256).astype(np.int64)
    an = entropy.Analysis(n, 1 << 16, 8, {entropy.HUFFMAN: counts[None, :].copy()}, None)
    fast = entropy.encode_bytes_chunk(sym, counts)
    _same_stream(fast, entropy.encode(sym, an, entropy.modes_for("bytes", 8)))
    assert int(fast.modes[0]) == getattr(entropy, mode)


def test_small_tensors_blobs_are_those_of_the_general_coder(monkeypatch):
    """A small tensor's exact blob is the same bytes with the one-chunk coder as with
    entropy.encode for every plane, and decodes exactly."""
    from lcckpt.codec import entropy
    rng = np.random.default_rng(3)
    arrays = [np.ones(384, np.float32) + rng.standard_normal(384).astype(np.float32) * 1e-3,
              np.zeros(1536, np.float32), (rng.standard_normal(2304) * 0.02).astype(np.float32),
              rng.random(700).astype(np.float64)]
    dts = [dtypes.BY_NAME["F32"]] * 3 + [dtypes.BY_NAME["F64"]]
    one_chunk, calls = entropy.encode_bytes_chunk, []
    monkeypatch.setattr(entropy, "encode_bytes_chunk",
                        lambda sym, counts: calls.append(sym.size) or one_chunk(sym, counts))
    fast = [b"".join(bytes(memoryview(p).cast("B")) for p in codec.encode_exact(a, d, 16))
            for a, d in zip(arrays, dts)]
    assert len(calls) >= len(arrays)        # every array had a plane coded by it
    monkeypatch.setattr(entropy, "encode_bytes_chunk", lambda sym, counts: entropy.encode(
        sym, entropy.Analysis(sym.size, 1 << 16, 8, {entropy.HUFFMAN: counts[None, :].copy()},
                              None), entropy.modes_for("bytes", 8)))
    general = [b"".join(bytes(memoryview(p).cast("B")) for p in codec.encode_exact(a, d, 16))
               for a, d in zip(arrays, dts)]
    assert fast == general
    for blob, a in zip(fast, arrays):
        assert np.array_equal(codec.decode(blob).view(np.uint8), a.view(np.uint8))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([2, 4]), st.integers(1, 3000), st.floats(0, 1), st.integers(0, 2**32 - 1))
def test_lower_plane_counts_with_zero_words_counted_apart(width, n, zeros, seed):
    """The exact lower-plane counts, zero words counted apart, against numpy."""
    from lcckpt.codec.kernels import planes as pk
    rng = np.random.default_rng(seed)
    dt = np.uint32 if width == 4 else np.uint16
    words = rng.integers(0, np.iinfo(dt).max, n, dtype=dt, endpoint=True)
    words[rng.random(n) < zeros] = 0
    start = int(rng.integers(0, n))
    hist = np.zeros((width, 256), np.int64)
    pk.lower_histogram(words, start, n, width, hist)
    w = words[start:].astype(np.uint64)
    rot = ((w << 1) | (w >> (8 * width - 1))) & ((1 << 8 * width) - 1)
    for k in range(width - 1):
        assert np.array_equal(hist[k], np.bincount((rot >> (8 * k)) & 255, minlength=256))
    assert not hist[width - 1].any()
