"""The numcodecs codecs: round trips, config round trips, golden files, zarr.

The helpers mirror numcodecs' own test helpers (check_encode_decode, check_config,
check_backwards_compatibility) so the codecs are held to what numcodecs expects of its own.
"""

import glob
import hashlib
import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lcckpt
from lcckpt.codec.config import CodecConfig
from lcckpt.codec.rounding import rounded
from lcckpt.errors import InvalidArgumentError
from lcckpt.numcodecs import LcckptLossless, LcckptLossy

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "numcodecs")
CLASSES = {"lcckpt_lossy": LcckptLossy, "lcckpt_lossless": LcckptLossless}


def _delta(n, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * np.exp2(rng.integers(-12, -2, n))
    x[rng.random(n) < 0.3] = 0
    return x.astype(dtype)


def check_encode_decode(arr, codec, lossy: bool):
    """numcodecs' check_encode_decode: from an array, from bytes-like views, into out."""
    enc = codec.encode(arr)
    dec = codec.decode(enc)
    assert dec.dtype == arr.dtype and dec.shape == arr.shape
    if lossy:               # exactly what lcckpt's own codec gives with these settings,
        settings = {k: v for k, v in codec.get_config().items() if k != "id"}
        want = [lcckpt.decode(lcckpt.encode(arr, config=CodecConfig(**settings)))]
        if settings.get("target"):      # or, where its blob is smaller, the rounded array
            want.append(rounded(arr, settings["target"]))
        assert any(w is not None and np.array_equal(dec, w) for w in want)
    else:
        assert dec.tobytes() == arr.tobytes()
    f = np.asfortranarray(arr)                 # Fortran order: values in memory order
    back = codec.decode(codec.encode(f))
    if not lossy:
        assert back.tobytes() == f.tobytes(order="A")
    for buf in (bytearray(enc), memoryview(enc), np.frombuffer(enc, np.uint8)):
        assert np.array_equal(codec.decode(buf), dec)
    out = np.empty_like(arr)
    assert codec.decode(enc, out=out) is out and np.array_equal(out, dec)
    out_bytes = bytearray(arr.nbytes)               # what zarr passes: a byte buffer
    codec.decode(enc, out=out_bytes)
    assert bytes(out_bytes) == np.ascontiguousarray(dec).tobytes()
    strided = np.empty(arr.size * 2, arr.dtype)[::2]   # non-contiguous out: copied into
    codec.decode(enc, out=strided)
    assert np.array_equal(strided, dec.reshape(-1))
    return enc


def check_config(codec):
    """numcodecs' check_config: JSON round trip to an equal codec."""
    config = json.loads(json.dumps(codec.get_config()))
    assert config["id"] == codec.codec_id
    again = type(codec).from_config({k: v for k, v in config.items() if k != "id"})
    assert again == codec and again.get_config() == codec.get_config()
    assert type(codec).from_config(config) == codec
    assert repr(codec).startswith(type(codec).__name__)


@pytest.mark.parametrize("codec", [LcckptLossy(), LcckptLossy(bits=1, coder="huffman"),
                                   LcckptLossy(bits=4, coder="runs", chunk_size=1024)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_lossy_round_trip(codec, dtype):
    check_encode_decode(_delta(3000, dtype).reshape(30, 100), codec, lossy=True)
    check_config(codec)


@pytest.mark.parametrize("arr", [_delta(3000, np.float64), np.arange(-9, 1000, dtype=np.int64),
                                 np.arange(255, dtype=np.uint8).reshape(15, 17),
                                 np.array([True, False] * 40), np.zeros((0, 3), np.float32)])
def test_lossless_round_trip(arr):
    check_encode_decode(arr, LcckptLossless(), lossy=False)
    check_config(LcckptLossless(chunk_size=2048))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=300),
       st.integers(1, 4), st.sampled_from(["auto", "huffman", "grouped", "runs"]),
       st.sampled_from([0.0, 0.05, 0.3]))
def test_lossy_error_bound_holds_for_any_values(values, bits, coder, bound):
    a = np.array(values, np.float32)
    codec = LcckptLossy(bits=bits, coder=coder, error_bound=bound)
    d = codec.decode(codec.encode(a)).astype(np.float64)
    err, norm = np.linalg.norm(d - a), np.linalg.norm(a.astype(np.float64))
    assert err <= bound * norm * (1 + 1e-4) + 1e-6 * norm


def test_bad_settings_and_inputs_are_named():
    with pytest.raises(InvalidArgumentError, match="bits"):
        LcckptLossy(bits=9)
    with pytest.raises(InvalidArgumentError, match="unknown lcckpt_lossy settings"):
        LcckptLossy.from_config({"id": "lcckpt_lossy", "level": 3})
    with pytest.raises(InvalidArgumentError, match="given to 'lcckpt_lossless'"):
        LcckptLossless.from_config({"id": "lcckpt_lossy"})
    with pytest.raises(InvalidArgumentError, match="one or the other"):
        LcckptLossy(target=0.01, bits=3)
    ints = np.arange(5)                         # not floating: stored exactly
    assert np.array_equal(LcckptLossy().decode(LcckptLossy().encode(ints)), ints)
    with pytest.raises(InvalidArgumentError, match="out holds"):
        LcckptLossless().decode(LcckptLossless().encode(np.arange(5.0)), out=np.empty(7)[::2])
    with pytest.raises(InvalidArgumentError, match="out holds"):
        LcckptLossless().decode(LcckptLossless().encode(np.arange(5.0)), out=bytearray(41))
    with pytest.raises(TypeError):
        LcckptLossless().encode(np.array(["a"], dtype=object))
    with pytest.raises(InvalidArgumentError, match="typed buffer"):
        LcckptLossless().encode(object())


@pytest.mark.parametrize("cid", sorted(CLASSES))
def test_golden_files_decode_and_encode_the_same(cid):
    base = os.path.join(GOLDEN, cid)
    codec_dirs = sorted(glob.glob(os.path.join(base, "codec.*")))
    arrays = sorted(glob.glob(os.path.join(base, "array.*.npy")))
    assert len(codec_dirs) >= 2 and len(arrays) >= 3
    for d in codec_dirs:
        with open(os.path.join(d, "config.json")) as f:
            config = json.load(f)
        codec = CLASSES[cid].from_config(config)
        assert codec.get_config() == config
        for fn in arrays:
            i = fn.split(".")[-2]
            arr = np.load(fn)
            with open(os.path.join(d, f"encoded.{i}.dat"), "rb") as f:
                enc = f.read()
            with open(os.path.join(d, f"decoded.{i}.sha256")) as f:
                want = f.read().strip()
            dec = codec.decode(enc)
            assert hashlib.sha256(np.ascontiguousarray(dec).tobytes()).hexdigest() == want, (d, i)
            assert dec.shape == arr.shape and dec.dtype == arr.dtype
            if cid == "lcckpt_lossless":
                assert np.array_equal(dec, arr)
            assert codec.encode(arr) == enc, (d, i)       # the encoder is stable too


def test_registered_with_numcodecs():
    numcodecs = pytest.importorskip("numcodecs")
    from lcckpt.numcodecs import register
    register()
    for codec in (LcckptLossy(bits=3), LcckptLossless(chunk_size=1024)):
        assert numcodecs.get_codec(codec.get_config()) == codec


@pytest.mark.parametrize("codec", [LcckptLossless(), LcckptLossy(bits=4)])
def test_inside_a_zarr_array(codec, tmp_path):
    zarr = pytest.importorskip("zarr")
    pytest.importorskip("numcodecs")
    from lcckpt.numcodecs import register
    register()
    x = _delta(12000).reshape(300, 40)
    z = zarr.create_array(store=str(tmp_path / "a"), shape=x.shape, chunks=(128, 40),
                          dtype="f4", zarr_format=2, filters=[codec], compressors=None)
    z[:] = x
    back = zarr.open_array(str(tmp_path / "a"), mode="r")
    assert back.metadata.filters == (codec,)
    y = back[:]
    if isinstance(codec, LcckptLossless):
        assert np.array_equal(y, x)
    else:                                  # the chunk-wise codec's own result, chunk by chunk
        for r in range(0, 300, 128):
            assert np.array_equal(y[r:r + 128], codec.decode(codec.encode(x[r:r + 128])))
    assert np.array_equal(back[5:9, 3], y[5:9, 3])


# --------------------------------------------------------------------------- numcodecs' own helpers

def _usual_arrays():
    """The kinds of arrays numcodecs' own codec tests use: integers, floats of every
    width around an offset and around zero, C and Fortran order, empty."""
    rng = np.random.default_rng(42)
    return [
        np.arange(1000, dtype="i4"),
        np.linspace(1000, 1001, 1000, dtype="f8"),
        rng.normal(loc=1000, scale=1, size=(100, 10)).astype("f4"),
        rng.normal(loc=0, scale=1, size=(100, 10)).astype("f2"),
        rng.normal(loc=0, scale=1, size=(10, 10, 10)),
        np.asfortranarray(rng.normal(loc=0, scale=1, size=(10, 10, 10)).astype("f4")),
        np.asfortranarray(rng.integers(0, 2**31, size=(100, 10), dtype="i8")),
        np.zeros(0, "f4"),
    ]


def _bound_decimals(arr, target):
    """Decimals that the lossy codec's bound guarantees for every element: no element's
    error exceeds the error's L2 norm, at most target·||x||₂."""
    if arr.dtype.kind != "f" or not arr.size:
        return None
    worst = target * float(np.linalg.norm(arr.astype(np.float64)))
    return int(np.floor(-np.log10(worst / 1.5))) if worst > 0 else None


@pytest.mark.parametrize("i", range(len(_usual_arrays())))
def test_numcodecs_own_helpers_pass(i):
    common = pytest.importorskip("numcodecs.tests.common")
    from lcckpt.numcodecs import DEFAULT_TARGET, register
    register()
    arr = _usual_arrays()[i]
    common.check_encode_decode(arr, LcckptLossless())
    common.check_encode_decode_array(arr, LcckptLossless())
    lossy = LcckptLossy()
    common.check_encode_decode(arr, lossy, precision=_bound_decimals(arr, DEFAULT_TARGET))
    if arr.dtype.kind != "f":                   # stored exactly by the lossy codec too
        common.check_encode_decode_array(arr, lossy)
    for codec in (LcckptLossless(), LcckptLossless(chunk_size=1024), lossy,
                  LcckptLossy(target=0.01, coder="runs"), LcckptLossy(bits=3)):
        common.check_config(codec)
        common.check_err_decode_object_buffer(codec)


def test_numcodecs_backwards_compatibility(monkeypatch):
    """numcodecs' own check against committed fixtures (tests/fixtures/numcodecs_compat):
    today's decoder reads the bytes an earlier version wrote, to the same values."""
    common = pytest.importorskip("numcodecs.tests.common")
    from lcckpt.numcodecs import DEFAULT_TARGET, register
    register()
    monkeypatch.chdir(os.path.join(os.path.dirname(GOLDEN), "numcodecs_compat"))
    arrays = _usual_arrays()
    common.check_backwards_compatibility("lcckpt_lossless", arrays,
                                         [LcckptLossless(), LcckptLossless(chunk_size=1024)])
    floats = [a for a in arrays if a.dtype.kind == "f" and a.size]
    worst = min(_bound_decimals(a, DEFAULT_TARGET) for a in floats)
    common.check_backwards_compatibility("lcckpt_lossy", floats,
                                         [LcckptLossy(), LcckptLossy(bits=4)],
                                         precision=[worst, -1])   # LC: octave-wide buckets
