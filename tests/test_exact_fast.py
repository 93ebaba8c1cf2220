"""The exact codec's fused float path: exact round trips, the same format as the general
path (each decodes the other's blobs), damage detected, and the benchmark's plumbing."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lcckpt
from lcckpt import codec, dtypes, lossless
from lcckpt.blob import parse
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
    assert lossless.FastDecoder.applies(parse(fast)[1].layouts, words.size, rotate,
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
    _, p = parse(blob)
    rng = np.random.default_rng(0)
    for pos in rng.integers(p.payload_base, len(blob) - 4, 20):
        bad = bytearray(blob)
        bad[pos] ^= 1 << int(rng.integers(8))
        with pytest.raises(ChecksumError):
            lcckpt.decode(bytes(bad))
        try:                                 # without the checksum: a named error or values
            lcckpt.decode(bytes(bad), check_payload=False)     # (a flipped padding bit
        except LcckptError as e:                               # changes nothing)
            assert isinstance(e, CorruptDataError)


def test_a_lower_plane_worth_coding_takes_the_general_path():
    # fp32 values with only a few distinct mantissas: the planner must decline
    x = np.repeat(np.float32([0.1, 0.2, 0.3, -0.7]), N // 2)
    words, _ = lossless.words_of(x, "float")
    assert lossless.plan_floats(words, 1 << 14) is None
    blob = lcckpt.encode(x, lossless=True)
    assert len(blob) < x.nbytes / 4
    assert np.array_equal(lcckpt.decode(blob).view(np.uint32), x.view(np.uint32))


def test_crc_pieces_combine_to_zlibs_crc():
    import zlib

    from lcckpt import _crc
    data = np.random.default_rng(5).integers(0, 256, 3 * N + 11, dtype=np.uint8)
    assert _crc.piece_crc32(data, 77) == zlib.crc32(data, 77)       # ISA-L or zlib: one CRC
    sizes = [[N, N + 11], [N]]
    pieces = [data[:N], data[N:2 * N + 11], data[2 * N + 11:]]
    crcs = np.array([[zlib.crc32(pieces[0]), zlib.crc32(pieces[1])], [zlib.crc32(pieces[2]), 0]])
    sizes[1].append(0)
    assert lossless.combine_crcs(crcs, sizes) == zlib.crc32(data)


def test_benchmark_reports_every_codec():
    pytest.importorskip("sklearn")
    from lcckpt.bench.exact import bench_dtype
    res = bench_dtype(_weights(N, 4, "plain").to(torch.bfloat16), "bf16", reps=1, threads=1,
                      log=lambda *_: None)
    names = [r["codec"] for r in res["rows"]]
    assert names[0] == "lcckpt" and all(r["roundtrip_ok"] for r in res["rows"])
    lc = res["rows"][0]
    assert lc["encode_bytes_per_element"] == pytest.approx(4 + 2 / lc["ratio"])
