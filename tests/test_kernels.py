"""Kernels against slow references and an independent Huffman decoder (bitarray)."""

import numpy as np
import pytest
from bitarray import bitarray
from bitarray.util import canonical_decode
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from lcckpt.codec.kernels import buckets as bk
from lcckpt.codec.kernels import floats as fk
from lcckpt.codec.kernels import huffman as hk
from lcckpt.codec.kernels import runs as rk
from lcckpt.codec.quantize import quantize

NOF = np.zeros(1, np.float32)                       # no centroids: store symbols
NOT = np.zeros(0, np.uint64)                        # no multi-item table

from oracles import canonical_code_table, choose_ref, huffman_cost, quantize_ref

counts_st = arrays(np.int64, st.integers(1, 300),
                   elements=st.one_of(st.just(0), st.integers(1, 10**9)))


@settings(max_examples=200, deadline=None)
@given(counts_st)
def test_code_lengths_complete_and_optimal(counts):
    lengths = hk.code_lengths(counts, hk.MAX_CODE_LEN)
    used = counts > 0
    assert np.all((lengths > 0) == used)
    assert lengths.max(initial=0) <= hk.MAX_CODE_LEN
    m = int(used.sum())
    if m >= 2:
        kraft = sum(2.0 ** -int(ln) for ln in lengths[used])
        assert kraft == pytest.approx(1.0)           # complete prefix code
        cost = int(counts @ lengths.astype(np.int64))
        best = huffman_cost(counts)
        assert cost >= best
        if np.ceil(np.log2(counts[used].sum() / counts[used].min())) + 1 < hk.MAX_CODE_LEN:
            assert cost == best                      # the limit cannot bind: plain Huffman
    elif m == 1:
        assert lengths[used][0] == 1


def test_code_lengths_limit_binds_on_fibonacci_counts():
    fib = [1, 1]
    while len(fib) < 30:
        fib.append(fib[-1] + fib[-2])
    counts = np.array(fib, np.int64)                 # unlimited Huffman would go 29 deep
    lengths = hk.code_lengths(counts, 12)
    assert lengths.max() == 12
    assert sum(2.0 ** -int(x) for x in lengths) == pytest.approx(1.0)
    # the limited code stays close to the optimum
    assert counts @ lengths <= 1.05 * huffman_cost(counts)


def _encode(sym, lengths):
    codes = hk.canonical_codes(lengths)
    nbits = int(np.bincount(sym, minlength=lengths.size) @ lengths.astype(np.int64))
    out = np.zeros((nbits + 7) // 8, np.uint8)
    end = hk.encode_symbols(sym, 0, sym.size, codes, lengths, out, 0, NOF, NOF, False)
    assert end == out.size
    return out, nbits


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 256), st.integers(1, 5000), st.integers(0, 2**32 - 1))
def test_huffman_stream_matches_bitarray_oracle(alpha, n, seed):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(alpha, 0.3))
    sym = rng.choice(alpha, size=n, p=p).astype(np.uint8 if alpha <= 256 else np.uint16)
    lengths = hk.code_lengths(np.bincount(sym, minlength=alpha), hk.MAX_CODE_LEN)
    out, nbits = _encode(sym, lengths)
    count, symbol = canonical_code_table(lengths)
    if len(symbol) >= 2:                             # bitarray needs a real code
        a = bitarray(endian="big")
        a.frombytes(out.tobytes())
        oracle = list(canonical_decode(a[:nbits], count, symbol))
        assert oracle == sym.tolist()
    table = hk.decode_table(lengths, int(lengths.max()))
    back = np.empty(n, np.uint8)
    used = hk.decode_symbols(out, 0, out.size, n, table, int(lengths.max()), back, 0, NOF, NOF,
                             False)
    assert used == nbits
    assert np.array_equal(back, sym)


def test_decode_rejects_invalid_code():
    lengths = np.array([1, 0, 0], np.uint8)          # only '0' is a code word
    table = hk.decode_table(lengths, 1)
    buf = np.array([0b01000000], np.uint8)
    out = np.empty(8, np.uint8)
    assert hk.decode_symbols(buf, 0, 1, 8, table, 1, out, 0, NOF, NOF, False) == -1


sym_st = st.tuples(st.integers(1, 4), st.integers(0, 3000), st.floats(0, 1),
                   st.integers(0, 2**32 - 1))


def _symbols(b, n, density, seed):
    rng = np.random.default_rng(seed)
    sym = rng.integers(1, 1 << b, size=n).astype(np.uint8)
    sym[rng.random(n) >= density] = 0
    return sym


@settings(max_examples=150, deadline=None)
@given(sym_st)
def test_grouped_round_trip_and_exact_size(args):
    b, n, density, seed = args
    sym = _symbols(b, n, density, seed)
    g = max(2, 8 // b)
    hist = np.zeros(1 << (b * g), np.int64)
    rk.grouped_histogram(sym, 0, n, g, b, hist)
    assert hist.sum() == -(-n // g)
    lengths = hk.code_lengths(hist, hk.MAX_CODE_LEN)
    nbits = int(hist @ lengths.astype(np.int64))
    out = np.zeros((nbits + 7) // 8, np.uint8)
    assert rk.encode_grouped(sym, 0, n, g, b, hk.canonical_codes(lengths), lengths, out, 0,
                             NOF, NOF, False) == out.size
    if n:
        tb = int(lengths.max())
        back = np.empty(n, np.uint8)
        used = rk.decode_grouped(out, 0, out.size, n, g, b, hk.decode_table(lengths, tb), tb,
                                 back, 0, NOF, NOF, False)
        assert used == nbits and np.array_equal(back, sym)


@settings(max_examples=60, deadline=None)
@given(st.integers(5, 8), st.integers(800, 20000), st.floats(0.01, 0.6), st.integers(0, 2**32 - 1))
def test_runs_of_wide_symbols_decode_with_the_multi_table(b, n, density, seed):
    """The uniform quantizer writes runs streams of up to 8-bit symbols; the multi table's
    items hold them whole (4-bit items once let wider symbols spill into the next item,
    and a default chain of a large model failed to load). Chunks of more than
    ``RUNS_BURST * 768`` symbols also take the adding path's bursts of lookups."""
    sym = _symbols(b, n, density, seed)
    S = 1 << b
    hist = np.zeros(rk.RUN_CLASSES * S, np.int64)
    extra = rk.runs_histogram(sym, 0, n, S, hist)
    lengths = hk.code_lengths(hist, hk.MAX_CODE_LEN)
    nbits = int(hist @ lengths.astype(np.int64)) + extra
    out = np.zeros((nbits + 7) // 8, np.uint8)
    rk.encode_runs(sym, 0, n, S, hk.canonical_codes(lengths), lengths, out, 0, NOF, NOF, False)
    tb = int(lengths.max())
    multi = rk.runs_decode_table(lengths, S)
    back = np.full(n, 99, np.uint8)
    used = rk.decode_runs(out, 0, out.size, n, S, hk.decode_table(lengths, tb), tb, back, 0,
                          NOF, NOF, False, multi)
    assert used == nbits and np.array_equal(back, sym)
    cent = np.arange(S, dtype=np.float32) * np.float32(0.5)
    fout = np.zeros(n, np.float32)
    used = rk.decode_runs(out, 0, out.size, n, S, hk.decode_table(lengths, tb), tb, back, 0,
                          cent, fout, True, multi)
    assert used == nbits and np.array_equal(fout, cent[sym])


def test_runs_multi_table_holds_eight_bit_symbols():
    """A letter of symbol 200 after a short run is an item of the multi table, not a
    trip to the one-letter path (the 12-bit table of 4-bit items left most lookups of a
    fine-tune's moments there)."""
    S = 256
    hist = np.zeros(rk.RUN_CLASSES * S, np.int64)
    hist[2 * S + 200] = 1000                 # run class 2 (2-3 zeros), symbol 200
    hist[1 * S + 17] = 500                   # one zero, symbol 17
    hist[3 * S + 0] = 1                      # the closing letter
    lengths = hk.code_lengths(hist, hk.MAX_CODE_LEN)
    codes = hk.canonical_codes(lengths)
    ln_a, ln_b = int(lengths[2 * S + 200]), int(lengths[1 * S + 17])
    # the window: (class 2, symbol 200) with extra bit 1 (run 3), then (class 1, 17)
    w = ((int(codes[2 * S + 200]) << 1 | 1) << ln_b) | int(codes[1 * S + 17])
    used = ln_a + 1 + ln_b
    w <<= rk.RUNS_WINDOW - used
    e = int(rk.runs_decode_table(lengths, S)[w])
    count = (e >> 5) & 3
    assert count >= 2 and (e & 31) >= used
    assert [(e >> (8 + 16 * k)) & 0xFFFF for k in range(2)] == [3 | 200 << 8, 1 | 17 << 8]


def _listed(sym, lo, hi):
    """The nonzero symbols of ``sym[lo:hi]`` as pass 2 lists them: offset | symbol << 24."""
    i = np.flatnonzero(sym[lo:hi]).astype(np.uint32)
    return i | sym[lo:hi][i].astype(np.uint32) << np.uint32(24)


@settings(max_examples=150, deadline=None)
@given(sym_st)
def test_runs_round_trip_and_exact_size(args):
    b, n, density, seed = args
    sym = _symbols(b, n, density, seed)
    S = 1 << b
    hist = np.zeros(rk.RUN_CLASSES * S, np.int64)
    extra = rk.runs_histogram(sym, 0, n, S, hist)
    assert hist.sum() == np.count_nonzero(sym) + (1 if n and sym[-1] == 0 else 0)
    lengths = hk.code_lengths(hist, hk.MAX_CODE_LEN)
    nbits = int(hist @ lengths.astype(np.int64)) + extra
    out = np.zeros((nbits + 7) // 8, np.uint8)
    assert rk.encode_runs(sym, 0, n, S, hk.canonical_codes(lengths), lengths, out, 0, NOF, NOF,
                          False) == out.size
    listed = np.zeros_like(out)                      # from the nonzero positions: same bits
    nz = _listed(sym, 0, n)
    assert rk.encode_runs_listed(sym, 0, n, nz, S, hk.canonical_codes(lengths), lengths, listed,
                                 0, NOF, NOF, False) == out.size
    assert np.array_equal(listed, out)
    if n:
        tb = int(lengths.max())
        for multi in (NOT, rk.runs_decode_table(lengths, S)):
            back = np.full(n, 99, np.uint8)
            used = rk.decode_runs(out, 0, out.size, n, S, hk.decode_table(lengths, tb), tb, back,
                                  0, NOF, NOF, False, multi)
            assert used == nbits and np.array_equal(back, sym)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 8), st.integers(0, 3000), st.floats(0, 1), st.integers(0, 2**32 - 1),
       st.integers(0, 40))
def test_dense_runs_histogram_counts_what_the_plain_one_does(b, n, density, seed, lo):
    """The runs letters of a mostly nonzero chunk, counted by walking its zeros from the
    symbol counts, are the plain per-symbol count exactly (zero runs at either end, runs
    of every length, any density), over a range that does not start at 0."""
    sym = _symbols(b, n + lo, density, seed)
    S = 1 << b
    plain = np.zeros(rk.RUN_CLASSES * S, np.int64)
    dense = np.zeros_like(plain)
    counts = np.bincount(sym[lo:], minlength=S).astype(np.int64)
    assert rk.runs_histogram_dense(sym, lo, n + lo, S, dense, counts) == \
        rk.runs_histogram(sym, lo, n + lo, S, plain)
    assert np.array_equal(dense, plain)


def test_longest_runs_round_trip():
    """Runs up to a 2**24-symbol chunk: 24 extra bits right after a long code word."""
    rng = np.random.default_rng(1)
    head = rng.integers(1, 4, 200).astype(np.uint8)          # many letters, some long codes
    sym = np.concatenate([head, np.zeros((1 << 24) - 300, np.uint8), [3], head[:50],
                          np.zeros(48, np.uint8)])
    S = 4
    hist = np.zeros(rk.RUN_CLASSES * S, np.int64)
    extra = rk.runs_histogram(sym, 0, sym.size, S, hist)
    hist[hist == 0] = 1                                       # every letter coded: long codes
    lengths = hk.code_lengths(hist, hk.MAX_CODE_LEN)
    out = np.zeros(1 << 16, np.uint8)
    end = rk.encode_runs(sym, 0, sym.size, S, hk.canonical_codes(lengths), lengths, out, 0,
                         NOF, NOF, False)
    listed = np.zeros_like(out)           # long code words and 24 extra bits: two puts
    assert rk.encode_runs_listed(sym, 0, sym.size, _listed(sym, 0, sym.size), S,
                                 hk.canonical_codes(lengths), lengths, listed, 0, NOF, NOF,
                                 False) == end
    assert np.array_equal(listed, out)
    tb = int(lengths.max())
    back = np.full(sym.size, 99, np.uint8)
    used = rk.decode_runs(out, 0, end, sym.size, S, hk.decode_table(lengths, tb), tb, back, 0,
                          NOF, NOF, False, rk.runs_decode_table(lengths, S))
    assert used >= 0 and (used + 7) // 8 == end and extra > 0
    assert np.array_equal(back, sym)


def test_long_zero_run_uses_extra_bits():
    sym = np.zeros(1 << 20, np.uint8)
    sym[-1] = 3
    hist = np.zeros(rk.RUN_CLASSES * 4, np.int64)
    extra = rk.runs_histogram(sym, 0, sym.size, 4, hist)
    # a run of 2**20 - 1 zeros has bit length 20: class 20, 19 extra bits
    assert extra == 19 and hist[20 * 4 + 3] == 1 and hist.sum() == 1


float_st = st.sampled_from([np.float32, np.float64])


@settings(max_examples=60, deadline=None)
@given(float_st, st.integers(1, 4), st.integers(0, 5000), st.integers(0, 2**32 - 1),
       st.booleans(), st.booleans())
def test_quantizer_matches_reference(dtype, bits, n, seed, midpoint, with_ref):
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.uniform(-30, 10)
    u = (rng.standard_normal(n) * scale).astype(dtype)
    u[rng.random(n) < 0.3] = 0
    ref = (u + rng.standard_normal(n).astype(dtype) * dtype(scale / 10)).astype(dtype) \
        if with_ref else None
    delta = u - ref if with_ref else u
    q = quantize(u, ref, bits, 1024, midpoint)       # several chunks
    sym, cent, kept = quantize_ref(delta, bits, midpoint)
    assert q.kept == kept
    assert np.array_equal(q.sym, sym)
    # fp64 sums in another order: equal to a few ulps (fp32 centroids are rounded from them)
    np.testing.assert_allclose(q.centroids, cent, rtol=max(4 * np.finfo(dtype).eps, 1e-12), atol=0)
    counts = np.bincount(sym, minlength=1 << bits)
    assert np.array_equal(q.sym_hist.sum(axis=0), counts)
    want = np.sum((delta.astype(np.float64) - cent[sym].astype(np.float64)) ** 2)
    assert q.residual_sq == pytest.approx(want, rel=1e-6, abs=1e-12 * q.delta_sq)
    assert q.delta_sq == pytest.approx(np.sum(delta.astype(np.float64) ** 2), rel=1e-9)
    assert q.target_sq == pytest.approx(np.sum(u.astype(np.float64) ** 2), rel=1e-9)


def test_apply_symbols_skips_zero_symbol():
    out = np.array([-0.0, 1.0, 2.0], np.float32)
    bk.apply_symbols(np.array([0, 1, 0], np.uint8), 0, 3, np.array([0, 0.5], np.float32), out)
    assert np.signbit(out[0]) and out[1] == 1.5 and out[2] == 2.0


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([np.uint16, np.uint32, np.uint64]), st.integers(0, 3000),
       st.booleans(), st.integers(0, 2**32 - 1))
def test_byte_planes_round_trip(wt, n, rotate, seed):
    rng = np.random.default_rng(seed)
    words = rng.integers(0, np.iinfo(wt).max, size=n, dtype=wt, endpoint=True)
    item = words.itemsize
    width = 8 * item
    planes = np.empty((item, n), np.uint8)
    hist = np.zeros((item, 256), np.int64)
    fk.SPLIT[item](words, 0, n, rotate, planes, hist)
    x = words.astype(np.uint64)
    if rotate:
        x = ((x << np.uint64(1)) | (x >> np.uint64(width - 1))) & np.uint64(2**width - 1)
    for k in range(item):
        expect = ((x >> np.uint64(8 * k)) & np.uint64(255)).astype(np.uint8)
        assert np.array_equal(planes[k], expect)
        counted = expect if k == item - 1 else expect[::fk.SAMPLE]   # top plane exact
        assert np.array_equal(hist[k], np.bincount(counted, minlength=256))
    back = np.empty_like(words)
    fk.MERGE[item](tuple(planes), 0, n, rotate, back)
    assert np.array_equal(back, words)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([2, 5, 16, 40, 256]), st.integers(0, 3000), st.floats(0.05, 5),
       st.integers(0, 2**32 - 1))
def test_multi_symbol_decode_matches_single(alpha, n, conc, seed):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(alpha, conc))
    sym = rng.choice(alpha, size=n, p=p).astype(np.uint8)
    lengths = hk.code_lengths(np.bincount(sym, minlength=alpha), hk.MAX_CODE_LEN)
    if not lengths.any():
        return
    out, nbits = _encode(sym, lengths)
    tb = int(lengths.max())
    single = hk.decode_table(lengths, tb)
    sb = 4 if alpha <= 16 else 8
    multi = hk.multi_decode_table(lengths, sb)
    back = np.full(n + 16, 99, np.uint8)
    used = hk.decode_symbols_multi(out, 0, out.size, n, multi, sb, single, tb, back, 0, NOF, NOF,
                                   False)
    assert used == nbits and np.array_equal(back[:n], sym)
    assert np.all(back[n:] == 99)                    # never writes past its chunk


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([2, 16, 256]), st.integers(0, 255),
       st.lists(st.integers(0, 3000), min_size=1, max_size=12), st.booleans(),
       st.integers(0, 2**32 - 1))
def test_runs_of_a_one_bit_code(alpha, dom, runs, apply, seed):
    """Runs of a symbol whose code is the one bit '0' are written eight symbols at a time
    and decoded by counting the leading zero bits: the coder's bytes are bitarray's, and
    stored or added (that symbol zero or not) the decoder gives what one symbol at a time
    gives, nothing past the chunk, also where a run reaches its end. (Two symbols: both
    codes one bit, the plain writer.)"""
    rng = np.random.default_rng(seed)
    dom %= alpha
    parts = []
    for r in runs:
        parts.append(np.full(r, dom, np.uint8))
        parts.append(rng.integers(0, alpha, rng.integers(0, 4)).astype(np.uint8))
    sym = np.concatenate(parts)
    n = sym.size
    hist = np.bincount(sym, minlength=alpha)
    hist[dom] = 1000 * hist.sum() + 1                # a one-bit code, the others long
    lengths = hk.code_lengths(hist, hk.MAX_CODE_LEN)
    assert lengths[dom] == 1
    out, nbits = _encode(sym, lengths)
    codes = hk.canonical_codes(lengths)
    a = bitarray(endian="big")
    for v in sym.tolist():
        a.extend(format(int(codes[v]), f"0{lengths[v]}b"))
    a.fill()
    assert out.tobytes() == a.tobytes()
    tb = int(lengths.max())
    sb = 4 if alpha <= 16 else 8
    args = (out, 0, out.size, n, hk.multi_decode_table(lengths, sb), sb,
            hk.decode_table(lengths, tb), tb)
    if not apply:
        back = np.full(n + 16, 99, np.uint8)
        assert hk.decode_symbols_multi(*args, back, 0, NOF, NOF, False) == nbits
        assert np.array_equal(back[:n], sym) and np.all(back[n:] == 99)
        return
    cent = rng.standard_normal(alpha).astype(np.float32)
    want = rng.standard_normal(n + 16).astype(np.float32)
    got = want.copy()
    bk.apply_symbols(sym, 0, n, cent, want)
    assert hk.decode_symbols_multi(*args, NOF.view(np.uint8), 0, cent, got, True) == nbits
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("b", [1, 2, 4])
def test_grouped_multi_decode_with_codes_as_long_as_its_window(b):
    """Rare letters get the longest codes, which fill the whole 12-bit window; stored and
    applied, against the symbols and apply_symbols."""
    rng = np.random.default_rng(b)
    g = max(2, 8 // b)
    # letters 0, 1, 2, ... with probabilities 1/2, 1/4, 1/8, ...: codes of 1, 2, 3, ... bits
    letters = np.minimum(rng.geometric(0.5, size=1 << 16) - 1, (1 << (b * g)) - 1)
    shifts = b * np.arange(g - 1, -1, -1)
    sym = ((letters[:, None] >> shifts) & ((1 << b) - 1)).astype(np.uint8).reshape(-1)
    n = sym.size - 1                                 # a partial last letter
    sym = sym[:n]
    hist = np.zeros(1 << (b * g), np.int64)
    rk.grouped_histogram(sym, 0, n, g, b, hist)
    lengths = hk.code_lengths(hist, hk.MAX_CODE_LEN)
    assert lengths.max() == hk.MAX_CODE_LEN == hk.MULTI_BITS
    out = np.zeros(4 * n, np.uint8)
    end = rk.encode_grouped(sym, 0, n, g, b, hk.canonical_codes(lengths), lengths, out, 0,
                            NOF, NOF, False)
    tb = int(lengths.max())
    table, multi = hk.decode_table(lengths, tb), hk.multi_decode_table(lengths, 8)
    back = np.full(n + 8, 99, np.uint8)
    used = rk.decode_grouped_multi(out, 0, end, n, g, b, multi, table, tb, back, 0, NOF, NOF,
                                   False)
    assert (used + 7) // 8 == end and np.array_equal(back[:n], sym) and np.all(back[n:] == 99)
    cent = rng.standard_normal(1 << b).astype(np.float32)
    want, got = rng.standard_normal((2, n)).astype(np.float32)
    got[:] = want
    bk.apply_symbols(sym, 0, n, cent, want)
    assert rk.decode_grouped_multi(out, 0, end, n, g, b, multi, table, tb, back, 0, cent, got,
                                   True) == used
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("at", [0, 205])            # in the fast loop, in the careful tail
def test_grouped_multi_decode_rejects_invalid_code(at):
    lengths = np.zeros(256, np.uint8)
    lengths[0] = 1                                   # one code word, '0': a '1' is invalid
    table, multi = hk.decode_table(lengths, 1), hk.multi_decode_table(lengths, 8)
    buf = np.zeros(208, np.uint8)
    buf[at] = 0x80
    out = np.empty(2 * 8 * 208 + 8, np.uint8)
    assert rk.decode_grouped_multi(buf, 0, buf.size, 2 * 8 * 208, 2, 4, multi, table, 1, out,
                                   0, NOF, NOF, False) == -1


@pytest.mark.parametrize("b", [2, 4])
@pytest.mark.parametrize("density", [0.01, 0.5])       # one pass below SPARSE_BITS, two above
def test_multi_symbol_decode_applies_like_apply_symbols(b, density):
    rng = np.random.default_rng(b)
    n = 20_000 + 5                                   # + 5: a tail the one-by-one loop decodes
    sym = _symbols(b, n, density, b)
    lengths = hk.code_lengths(np.bincount(sym, minlength=1 << b), hk.MAX_CODE_LEN)
    out = np.zeros(2 * n, np.uint8)
    end = hk.encode_symbols(sym, 0, n, hk.canonical_codes(lengths), lengths, out, 0, NOF, NOF,
                            False)
    assert (8 * end <= hk.SPARSE_BITS * n) == (density < 0.1)
    cent = rng.standard_normal(1 << b).astype(np.float32)
    want = rng.standard_normal(n).astype(np.float32)
    want[::3] = -0.0                                 # zero symbols keep either sign
    got = want.copy()
    bk.apply_symbols(sym, 0, n, cent, want)
    tb = int(lengths.max())
    used = hk.decode_symbols_multi(out, 0, end, n, hk.multi_decode_table(lengths, 4), 4,
                                   hk.decode_table(lengths, tb), tb, NOF.view(np.uint8), 0,
                                   cent, got, True)
    assert (used + 7) // 8 == end and got.tobytes() == want.tobytes()


def test_multi_symbol_decode_rejects_invalid_code():
    lengths = np.array([1, 0, 0], np.uint8)
    multi = hk.multi_decode_table(lengths, 4)
    single = hk.decode_table(lengths, 1)
    buf = np.zeros(8, np.uint8)
    buf[2] = 0x80                                    # a '1' bit: no such code word
    out = np.empty(64, np.uint8)
    assert hk.decode_symbols_multi(buf, 0, 8, 64, multi, 4, single, 1, out, 0, NOF, NOF,
                                   False) == -1


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(["huffman", "multi", "grouped", "gmulti", "runs"]), st.integers(1, 4),
       st.integers(1, 3000), st.floats(0, 1), st.integers(0, 2**32 - 1))
def test_fused_apply_equals_symbols_then_apply(mode, b, n, density, seed):
    """Decoding straight into the floats gives what decode-then-apply_symbols gives."""
    sym = _symbols(b, n, density, seed)
    S, g = 1 << b, max(2, 8 // b)
    alpha = {"grouped": 1 << (b * g), "gmulti": 1 << (b * g), "runs": rk.RUN_CLASSES * S}.get(mode, S)
    hist = np.zeros(alpha, np.int64)
    if mode in ("grouped", "gmulti"):
        rk.grouped_histogram(sym, 0, n, g, b, hist)
    elif mode == "runs":
        rk.runs_histogram(sym, 0, n, S, hist)
    else:
        hist[:] = np.bincount(sym, minlength=S)
    lengths = hk.code_lengths(hist, hk.MAX_CODE_LEN)
    codes = hk.canonical_codes(lengths)
    out = np.zeros(4 * n + 64, np.uint8)
    if mode in ("grouped", "gmulti"):
        end = rk.encode_grouped(sym, 0, n, g, b, codes, lengths, out, 0, NOF, NOF, False)
    elif mode == "runs":
        end = rk.encode_runs(sym, 0, n, S, codes, lengths, out, 0, NOF, NOF, False)
    else:
        end = hk.encode_symbols(sym, 0, n, codes, lengths, out, 0, NOF, NOF, False)
    rng = np.random.default_rng(seed)
    cent = rng.standard_normal(S).astype(np.float32)
    base = rng.standard_normal(n).astype(np.float32)
    base[::5], base[1::7] = -0.0, 0.0                   # zero symbols must keep either sign
    want = base.copy()
    bk.apply_symbols(sym, 0, n, cent, want)
    enc_ref = base.copy()                               # the encoder's update, while coding
    out2 = np.zeros_like(out)
    if mode in ("grouped", "gmulti"):
        rk.encode_grouped(sym, 0, n, g, b, codes, lengths, out2, 0, cent, enc_ref, True)
    elif mode == "runs":
        rk.encode_runs(sym, 0, n, S, codes, lengths, out2, 0, cent, enc_ref, True)
        listed_ref, out3 = base.copy(), np.zeros_like(out)    # from the nonzero positions
        lo = n // 3                                           # of a sub-range
        nz = _listed(sym, lo, n)
        full = np.zeros_like(out)
        rk.encode_runs(sym, lo, n, S, codes, lengths, full, 0, cent, listed_ref, True)
        listed_ref[:] = base
        rk.encode_runs_listed(sym, lo, n, nz, S, codes, lengths, out3, 0, cent, listed_ref, True)
        bk.apply_symbols(sym, 0, lo, cent, listed_ref)
        assert listed_ref.tobytes() == want.tobytes() and np.array_equal(out3, full)
    else:
        hk.encode_symbols(sym, 0, n, codes, lengths, out2, 0, cent, enc_ref, True)
    assert enc_ref.tobytes() == want.tobytes() and np.array_equal(out2, out)
    got = base.copy()
    tb = int(lengths.max())
    table = hk.decode_table(lengths, tb)
    dummy = np.zeros(1, np.uint8)
    if mode == "multi" and b <= 4:
        used = hk.decode_symbols_multi(out, 0, end, n, hk.multi_decode_table(lengths, 4), 4,
                                       table, tb, dummy, 0, cent, got, True)
    elif mode in ("huffman", "multi"):
        used = hk.decode_symbols(out, 0, end, n, table, tb, dummy, 0, cent, got, True)
    elif mode == "grouped":
        used = rk.decode_grouped(out, 0, end, n, g, b, table, tb, dummy, 0, cent, got, True)
    elif mode == "gmulti":
        used = rk.decode_grouped_multi(out, 0, end, n, g, b, hk.multi_decode_table(lengths, 8),
                                       table, tb, dummy, 0, cent, got, True)
        back = np.full(n + 8, 99, np.uint8)          # and the symbol-storing form
        used2 = rk.decode_grouped_multi(out, 0, end, n, g, b, hk.multi_decode_table(lengths, 8),
                                        table, tb, back, 0, NOF, NOF, False)
        assert used2 == used and np.array_equal(back[:n], sym) and np.all(back[n:] == 99)
    else:
        used = rk.decode_runs(out, 0, end, n, S, table, tb, dummy, 0, cent, got, True,
                              rk.runs_decode_table(lengths, S))
    assert used >= 0 and (used + 7) // 8 == end
    assert got.tobytes() == want.tobytes()


@settings(max_examples=60, deadline=None)
@given(st.tuples(st.integers(1, 4), st.integers(0, 20000), st.sampled_from([0, 1e-3, 0.05, 0.3, 1]),
                 st.integers(0, 2**32 - 1)), st.integers(0, 20000), st.integers(0, 20000))
def test_fused_pass2_runs_statistics(args, a, z):
    """Against runs_histogram on a sub-range: block edges (4,096) and runs past 512."""
    b, n, density, seed = args
    lo, hi = sorted((min(a, n), min(z, n)))
    sym = _symbols(b, n, density, seed)
    S = 1 << b
    keys = sym.astype(np.uint16) * 7                 # any key -> symbol table will do
    lut = np.zeros(7 * S + 1, np.uint8)
    lut[np.arange(S) * 7] = np.arange(S)
    got = np.full(n, 99, np.uint8)
    h1, h2 = np.zeros(rk.RUN_CLASSES * S, np.int64), np.zeros(rk.RUN_CLASSES * S, np.int64)
    nz = np.zeros(np.count_nonzero(sym[lo:hi]), np.uint32)
    e1 = rk.map_symbols_runs(keys, lo, hi, lut, got, S, h1, nz)
    e2 = rk.runs_histogram(sym, lo, hi, S, h2)
    assert np.array_equal(got[lo:hi], sym[lo:hi]) and np.all(got[:lo] == 99) and np.all(got[hi:] == 99)
    assert e1 == e2 and np.array_equal(h1, h2)
    assert np.array_equal(nz, _listed(sym, lo, hi))           # what it lists


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(0, 9000), st.integers(0, 9000), st.integers(0, 9000),
       st.booleans(), st.sampled_from([np.float32, np.float64]), st.sampled_from([0, 0.3, 0.9]),
       st.integers(0, 2**32 - 1))
def test_split_passes_match_key_histogram(bits, n, a, z, use_ref, dtype, zeros, seed):
    """key_counts + map_symbols_sums (the quantizer's split passes) give the keys, counts,
    norms, symbols, runs statistics and, for every kept bucket, the per-lane sums of
    key_histogram + map_symbols_runs bit for bit; key_sums gives every bucket's sums, on any sub-range (block edges,
    incomplete last groups, both mapping paths: compares and the table gather)."""
    rng = np.random.default_rng(seed)
    lo, hi = sorted((min(a, n), min(z, n)))
    scale = rng.choice([1e-8, 1e-3, 1.0, 1e3], size=n)
    u = (rng.standard_normal(n) * scale).astype(dtype)
    ref = (u + rng.standard_normal(n).astype(dtype) * dtype(1e-3)).astype(dtype)
    same = rng.random(n) < zeros
    ref[same] = u[same]                              # exact zeros of the delta
    if not use_ref:
        u[same] = 0
    utype, shift, nkeys = {np.float32: (np.uint32, np.uint32(23), 512),
                           np.float64: (np.uint64, np.uint64(52), 4096)}[dtype]
    sf = np.empty(bk.BLOCK, dtype)
    su = sf.view(utype)
    r = ref if use_ref else u
    k1, k2 = np.zeros(n, np.uint16), np.zeros(n, np.uint16)
    c1 = np.zeros((bk.LANES, nkeys + 1), np.int64)
    s1 = np.zeros((bk.LANES, nkeys + 1))
    s2 = np.zeros_like(s1)
    nomm = np.zeros(1)
    ub = u.view(utype)
    n1 = bk.key_histogram(u, ub, r, use_ref, lo, hi, sf, su, shift, k1, c1, s1, nomm, nomm,
                          False)
    c2 = np.zeros((bk.COUNT_LANES, nkeys + 1), np.uint32)    # the quantizer's layout
    n2 = bk.key_counts(u, ub, r, use_ref, lo, hi, sf, su, shift, k2, c2)
    assert np.array_equal(k1, k2) and n1 == n2
    assert np.array_equal(c1.sum(axis=0), c2.sum(axis=0, dtype=np.int64))
    s4 = np.zeros_like(s1)                           # the streaming sums: every bucket
    bk.key_sums(u, r, use_ref, lo, hi, k2, s4)
    assert s4.tobytes() == s1.tobytes()
    total = c1.sum(axis=0)[:nkeys]
    cent = np.zeros(1 << bits, dtype)
    lut, kept = bk.promotion_table(total, s1.sum(axis=0)[:nkeys], nomm, nomm, bits, False, cent)
    S = 1 << bits
    sym1, sym2 = np.full(n, 99, np.uint8), np.full(n, 99, np.uint8)
    h1, h2 = np.zeros(rk.RUN_CLASSES * S, np.int64), np.zeros(rk.RUN_CLASSES * S, np.int64)
    nz1 = np.zeros(0, np.uint32)                     # empty: no list kept
    e1 = rk.map_symbols_runs(k1, lo, hi, lut, sym1, S, h1, nz1)
    kept_keys = np.flatnonzero(lut).astype(np.uint16)
    nz2 = np.zeros(int(total[kept_keys].sum()), np.uint32)     # sized as the quantizer does
    e2 = rk.map_symbols_sums(k2, u, r, use_ref, lo, hi, lut, kept_keys, sym2, S, True, h2, s2,
                             nz2, True)
    assert np.array_equal(sym1, sym2) and e1 == e2 and np.array_equal(h1, h2)
    assert np.array_equal(nz2, _listed(sym2, lo, hi))
    sym4, nz4 = np.full(n, 99, np.uint8), np.zeros_like(nz2)   # symbols left in the list
    h4, s4 = np.zeros_like(h2), np.zeros_like(s2)
    assert rk.map_symbols_sums(k2, u, r, use_ref, lo, hi, lut, kept_keys, sym4, S, True, h4, s4,
                               nz4, False) == e2
    assert np.all(sym4 == 99) and np.array_equal(nz4, nz2) and np.array_equal(h4, h2)
    assert s4.tobytes() == s2.tobytes()
    rk.fill_listed(sym4, lo, hi, nz4)                # and written out from it
    assert np.array_equal(sym4[lo:hi], sym1[lo:hi]) and np.all(sym4[:lo] == 99)
    assert np.all(sym4[hi:] == 99)
    for k in kept_keys:                              # the sums of kept buckets, bit for bit
        assert s1[:, k].tobytes() == s2[:, k].tobytes()
    sym3 = np.full(n, 99, np.uint8)
    s3 = np.zeros_like(s1)
    assert rk.map_symbols_sums(k2, u, r, use_ref, lo, hi, lut, kept_keys, sym3, S, False,
                               np.zeros(1, np.int64), s3, np.zeros(0, np.uint32), True) == 0
    assert np.array_equal(sym3, sym1) and s3.tobytes() == s2.tobytes()


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3000), st.booleans(),
       st.sampled_from([np.float32, np.float64]), st.sampled_from([1e-3, 0.5, 3.0]),
       st.integers(0, 2**32 - 1))
def test_quantizer_layouts_agree(bits, n, use_ref, dtype, spread, seed):
    """The three pass layouts (sums in pass 1; kept sums at the nonzero symbols; a
    streaming sum after counting) give the same quantization bit for bit, on sparse and
    on dense symbols, with chunks cut mid-array (chunk size 1,024)."""
    rng = np.random.default_rng(seed)
    u = (rng.standard_normal(n) * np.exp(spread * rng.standard_normal(n))).astype(dtype)
    ref = (u - rng.standard_normal(n).astype(dtype) * dtype(0.1)) if use_ref else None
    a = quantize(u, ref, bits, 1024, runs_stats=True, split=False)
    a_sym = a.sym.copy()
    a.sym_buf[:] = 99                    # what the sparse layout leaves unwritten: garbage
    b = quantize(u, ref, bits, 1024, runs_stats=True, split=True)
    assert np.array_equal(a_sym, b.sym) and a.centroids.tobytes() == b.centroids.tobytes()
    assert a.kept == b.kept and np.array_equal(a.sym_hist, b.sym_hist)
    assert np.array_equal(a.runs_hist, b.runs_hist) and np.array_equal(a.runs_extra, b.runs_extra)
    assert a.residual_sq == b.residual_sq and a.delta_sq == b.delta_sq


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 10**8), min_size=1, max_size=16))
def test_the_benchmarks_ideal_huffman_is_the_oracles(counts):
    """``lcckpt bench`` reports the coder's payload against an optimal Huffman code; it
    computes that from the library's code lengths with a limit that cannot bind."""
    from lcckpt.bench.codec import _optimal_huffman_bits
    assert _optimal_huffman_bits(np.array(counts)) == huffman_cost(counts)


@settings(max_examples=80, deadline=None)
@given(arrays(np.uint8, st.integers(0, 300)), st.data())
def test_list_bits_lists_the_escape_bitmap(bitmap, data):
    """The uniform quantizer's escape flags are a bitmap (bit i % 8 of byte i // 8);
    count_bits counts them, list_bits lists them in order, stopping at n (numpy's
    unpackbits as the oracle), into the blob's uint32 indices."""
    from lcckpt.codec.kernels import uniform as uk

    n = data.draw(st.integers(0, 8 * bitmap.size))
    bits = np.unpackbits(bitmap, bitorder="little")
    want = np.flatnonzero(bits[:n])
    assert uk.count_bits(bitmap) == int(bits.sum())
    out = np.zeros(uk.count_bits(bitmap), np.uint32)
    k = uk.list_bits(bitmap, n, out)
    assert out[:k].tolist() == want.tolist()


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 300), st.lists(st.integers(0, 2000), min_size=1, max_size=300),
       st.binary(max_size=8), st.integers(0, 2**32 - 1), st.sampled_from(["as is", "flip",
                                                                          "cut", "random"]))
def test_code_length_tables_parse_like_the_reference(size, counts, tail, seed, how):
    """The compiled code-length parser agrees with a numpy/Python oracle on tables of
    every layout (from real code lengths), damaged ones and random bytes: the same
    lengths and end, or the same kind of error."""
    from lcckpt.codec import streams
    from lcckpt.errors import CorruptDataError, TruncatedError
    from lcckpt.util.wire import Writer
    from oracles import Reader, read_lengths_py, read_lengths_ref

    rng = np.random.default_rng(seed)
    c = np.zeros(size, np.int64)
    c[:min(size, len(counts))] = counts[:size]
    if not c.any():
        c[0] = 1
    w = Writer()
    streams._write_lengths(w, hk.code_lengths(c, hk.MAX_CODE_LEN))
    data = bytearray(bytes(w.buf))
    if how == "flip":
        data[rng.integers(len(data))] ^= 1 << int(rng.integers(8))
    elif how == "cut":
        data = data[:rng.integers(len(data))]
    elif how == "random":
        data = bytearray(rng.integers(0, 256, rng.integers(0, 64), dtype=np.uint8).tobytes())
    data += tail
    want = read_lengths_ref(bytes(data), size, hk.MAX_CODE_LEN)
    r = Reader(bytes(data), what="t")
    try:
        got = read_lengths_py(r, size)
    except TruncatedError:
        assert want == "truncated"
        return
    except CorruptDataError:
        assert want == "corrupt"
        return
    assert not isinstance(want, str), want
    assert got.tolist() == want[0].tolist() and r.pos == want[1]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 300), st.integers(1, 300), st.integers(0, 2**32 - 1))
def test_each_code_table_layout_is_as_long_as_its_size_says(size, used, seed):
    """The compiled size of each code-table layout is the length of that layout written
    (every layout forced in turn, and read back), and the chosen one is the smallest: the
    entropy coder plans chunk modes with these sizes."""
    from lcckpt.codec import entropy, streams
    from lcckpt.codec.kernels import tables as tk
    from lcckpt.util.wire import Writer
    from oracles import Reader, read_lengths_py

    rng = np.random.default_rng(seed)
    counts = np.zeros(size, np.int64)
    k = min(used, size)
    counts[rng.choice(size, k, replace=False)] = rng.integers(1, 10**6, k)
    lengths = hk.code_lengths(counts, hk.MAX_CODE_LEN)
    sizes = tk.layout_sizes(lengths)
    for kind in range(3):
        w = Writer()
        streams._write_lengths(w, lengths, kind)
        assert len(w.buf) == 1 + sizes[kind]
        assert np.array_equal(read_lengths_py(Reader(bytes(w.buf), what="t"), size),
                              lengths)
    w = Writer()
    streams._write_lengths(w, lengths)
    assert len(w.buf) == entropy.lengths_size(lengths) == 1 + min(sizes)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5), st.integers(1, 40), st.integers(0, 2**31), st.integers(0, 3))
def test_compiled_mode_choice_matches_numpys(m, nch, seed, kind):
    """The per-chunk mode choice (``entropy._choose``) runs compiled; it must pick what
    the numpy version picked: the same ties (few distinct sizes), infinite and huge
    entries (a constant mode that does not apply), and fractional scores (raw chunks
    weighted by their margin), summed in numpy's order."""
    from lcckpt.codec.kernels.sums import choose_modes
    rng = np.random.default_rng(seed)
    score = rng.integers(0, 4 if kind == 0 else 10**6, (m, nch)).astype(np.float64)
    if kind == 1:
        score[rng.random((m, nch)) < 0.3] = np.iinfo(np.int64).max // 4
    if kind == 2:
        score *= rng.choice([1.0, 0.97], (m, 1))
    if kind == 3:
        score[rng.random((m, nch)) < 0.2] = np.inf
    coded = sorted(rng.choice(m, rng.integers(0, min(m, 3) + 1), replace=False).tolist())
    table = {i: int(rng.integers(0, 60)) for i in coded}
    want = choose_ref(score, coded, table)
    got = np.empty(nch, np.int64)
    tab = np.zeros(m, np.int64)
    for i, t in table.items():
        tab[i] = t
    if not choose_modes(score, np.array(coded, np.int64), tab, got):
        got = np.argmin(score, axis=0)
    assert np.array_equal(got, want)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3000), st.integers(1, 700), st.integers(0, 2**31),
       st.sampled_from(["fresh", "near", "far", "gap", "size"]))
def test_compiled_plan_matches_numpys(b, n, chunk_size, seed, cached):
    """The plan (each coded mode's code, every chunk's bytes in every mode) runs
    compiled; it must give numpy's integers: the same code kept or rebuilt (a cached code
    near the fresh one, far from it, missing a used letter, of another alphabet), the
    same bytes per chunk, constant chunks and raw extra bits included."""
    from lcckpt.codec import entropy as en
    from oracles import plan_ref
    rng = np.random.default_rng(seed)
    nch = -(-n // chunk_size)
    sizes = np.minimum(chunk_size, n - np.arange(nch) * chunk_size)
    S = 1 << b
    sym_hist = np.zeros((nch, S), np.int64)
    for c, size in enumerate(sizes):
        if rng.random() < 0.3:
            sym_hist[c, rng.integers(S)] = size                 # a constant chunk
        else:
            sym_hist[c] = rng.multinomial(size, rng.dirichlet(np.full(S, 0.3)))
    hist = {en.HUFFMAN: sym_hist}
    for m in (en.GROUPED, en.RUNS):
        a = en.alphabet(m, b)
        h = rng.integers(0, 50, (nch, a)).astype(en.LETTERS)
        h[:, rng.random(a) < 0.5] = 0
        hist[m] = h
    extra = rng.integers(0, 10**4, nch).astype(np.int64)
    modes = [m for m in (en.HUFFMAN, en.GROUPED, en.RUNS, en.RAW, en.CONST)
             if rng.random() < 0.6] or [en.HUFFMAN]
    old = {}
    for m in en.CODED_MODES:
        lengths = hk.code_lengths(hist[m].sum(axis=0), hk.MAX_CODE_LEN)
        if cached == "near":            # the code of slightly other counts
            counts = hist[m].sum(axis=0)
            counts = counts + (counts > 0) * rng.integers(0, 3, lengths.size)
            lengths = hk.code_lengths(counts, hk.MAX_CODE_LEN)
        elif cached == "far":           # a flat code: far from skewed counts
            flat = max(1, int(np.ceil(np.log2(max(2, (lengths > 0).sum())))))
            lengths = np.where(lengths > 0, flat, 0).astype(np.uint8)
        elif cached == "gap" and (lengths > 0).any():
            lengths[np.flatnonzero(lengths)[0]] = 0
        elif cached == "size":
            lengths = np.append(lengths, np.uint8(1))
        old[m] = lengths
    an = en.Analysis(n, chunk_size, b, hist, extra)
    cache = en.CodeCache(lengths=dict(old)) if cached != "fresh" else None
    want_lengths, kept, want_bytes, want_bits = plan_ref(
        hist, extra, n, chunk_size, modes, old if cache else {}, en.CACHE_SLACK,
        hk.MAX_CODE_LEN)
    got = en._code_lengths(an, modes, cache)
    assert got.keys() == want_lengths.keys()
    for m in want_lengths:
        assert np.array_equal(got[m], want_lengths[m])
        if cache is not None:
            assert (got[m] is old[m]) == kept[m]
            assert np.array_equal(cache.lengths[m], got[m])
    if cache is not None:
        assert (cache.hits, cache.misses) == (sum(kept.values()), len(kept) - sum(kept.values()))
    got_bytes, got_bits = en._chunk_bytes(an, modes, got)
    assert np.array_equal(got_bytes, want_bytes)
    assert got_bits == want_bits


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 5000), st.floats(0.0, 1.0), st.integers(0, 2**31),
       st.sampled_from([np.uint32, np.uint64]), st.sampled_from([np.float32, np.float64]),
       st.integers(6, 12))
def test_escapes_are_set_as_numpys_fancy_assignment_sets_them(n, density, seed, it, ft, log2):
    """A uniform blob's escapes are set (and an encoder's taken) by compiled loops: the
    same elements as ``out[idx] = val`` and ``src[idx]``, chunk by chunk through the
    binary search, at every density (the chunk edges included); an index past the array
    is counted, not written."""
    from lcckpt.codec.kernels import uniform as uk
    rng = np.random.default_rng(seed)
    idx = np.flatnonzero(rng.random(n) < density).astype(it)
    val = rng.standard_normal(idx.size).astype(ft)
    base = rng.standard_normal(n).astype(ft)
    want = base.copy()
    want[idx] = val
    got = base.copy()
    assert uk.set_escapes(got, idx, val) == 0 and np.array_equal(got, want)
    got = base.copy()
    cs = 1 << log2
    for c in range(-(-n // cs)):
        assert uk.set_range_escapes(got, idx, val, c * cs, (c + 1) * cs) == 0
    assert np.array_equal(got, want)
    taken = np.empty(idx.size, ft)
    assert uk.take(want, idx, taken) == 0 and np.array_equal(taken, want[idx])
    past = np.array([n, n + 7], it)
    assert uk.set_escapes(got, past, np.zeros(2, ft)) == 2 and np.array_equal(got, want)
    assert uk.take(want, past, np.zeros(2, ft)) == 2


def test_a_runs_stream_builds_its_multi_table_only_where_it_pays(monkeypatch):
    """The runs coder's multi-item table (about 50 us to build) is built for a stream of
    ``RUNS_MULTI_MIN_BYTES`` or more, not for a smaller one, which decodes a letter at a
    time faster; the values are the same either way."""
    import lcckpt
    from lcckpt.codec import streams
    from lcckpt.codec.blob import parse

    rng = np.random.default_rng(5)
    made = {}
    for name, share, bits in (("sparse", 0.002, 2), ("dense", 0.9, 4)):
        x = np.zeros(200_000, np.float32)
        hit = rng.random(x.size) < share
        x[hit] = rng.standard_normal(int(hit.sum())).astype(np.float32)
        blob = lcckpt.encode(x, bits=bits, coder="runs")
        buf, p = parse(blob)
        decoders = {}
        for th in (streams.RUNS_MULTI_MIN_BYTES, 0):
            monkeypatch.setattr(streams, "RUNS_MULTI_MIN_BYTES", th)
            out = np.zeros(p.n, np.uint8)
            dec = streams.StreamDecoder(buf, p.payload_base, p.layouts[0], p.n, 1 << p.log2,
                                        p.bits, out)
            for c in range(-(-p.n // (1 << p.log2))):
                dec.chunk(c)
            decoders[th] = (dec.rmulti.size, out)
        monkeypatch.undo()
        (kept, got), (forced, want) = decoders.values()
        assert forced > 0 and np.array_equal(got, want)
        made[name] = (int(p.layouts[0].offsets[-1]), kept)
    assert made["sparse"][0] < streams.RUNS_MULTI_MIN_BYTES and made["sparse"][1] == 0
    assert made["dense"][0] >= streams.RUNS_MULTI_MIN_BYTES and made["dense"][1] > 0
