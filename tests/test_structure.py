"""The seams between layers: codec settings, decode into a buffer, the one tracker, leaf hooks."""

import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lcckpt
from lcckpt import CodecConfig, InvalidArgumentError
from lcckpt.format import sections, serialization
from lcckpt.codec.delta import Reconstruction

from helpers import assert_same, same_bits


@given(bits=st.integers(1, 4), coder=st.sampled_from(["auto", "huffman", "grouped", "runs"]),
       eb=st.one_of(st.none(), st.floats(0, 10)), mid=st.booleans(),
       cs=st.one_of(st.none(), st.sampled_from([1024, 1 << 18, 1 << 24])),
       scheme=st.sampled_from(["lc", "uniform", "lossless"]), target=st.floats(0, 0.99))
@settings(max_examples=40, deadline=None)
def test_config_round_trips_through_plain_json(bits, coder, eb, mid, cs, scheme, target):
    import json
    if scheme == "lc":
        cfg = CodecConfig(bits, coder, eb, mid, cs)
    else:                       # bits, error_bound and midpoint are LC's alone
        cfg = CodecConfig(coder=coder, chunk_size=cs, lossless=scheme == "lossless",
                          target=target if scheme == "uniform" else None)
    assert cfg.scheme == scheme
    again = CodecConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and hash(again) == hash(cfg)


@pytest.mark.parametrize("kw, names", [
    ({"lossless": True, "bits": 3}, ["bits=3"]),
    ({"lossless": True, "target": 0.01}, ["target=0.01"]),
    ({"target": 0.01, "error_bound": 0.1, "midpoint": True}, ["error_bound=0.1", "midpoint"]),
    ({"target": 0.0, "bits": 4}, ["bits=4"]),
])
def test_config_refuses_settings_its_codec_does_not_use(kw, names):
    """One config for three codecs: what the chosen codec would ignore raises, naming it;
    ``lcckpt.encode`` passes its keywords through the same check."""
    for call in (lambda: CodecConfig(**kw), lambda: lcckpt.encode(np.ones(8, np.float32), **kw)):
        with pytest.raises(InvalidArgumentError) as e:
            call()
        assert all(n in str(e.value) for n in names), str(e.value)


@pytest.mark.parametrize("kw, match", [
    ({"bits": 0}, "bits"), ({"bits": 5}, "bits"), ({"bits": True}, "bits"), ({"bits": 2.0}, "bits"),
    ({"coder": "bytes"}, "coder"), ({"coder": "zip"}, "coder"),
    ({"error_bound": -1}, "error_bound"), ({"error_bound": float("nan")}, "error_bound"),
    ({"error_bound": "0.1"}, "error_bound"), ({"chunk_size": 1000}, "chunk_size"),
    ({"chunk_size": 1 << 25}, "chunk_size"), ({"midpoint": 1}, "midpoint"),
])
def test_config_refuses_bad_settings_by_name(kw, match):
    with pytest.raises(InvalidArgumentError, match=match):
        CodecConfig(**kw)
    with pytest.raises(InvalidArgumentError, match=match):
        CodecConfig.from_dict(kw)


def test_config_is_frozen_and_refuses_unknown_keys():
    cfg = CodecConfig()
    with pytest.raises(AttributeError):
        cfg.bits = 3
    with pytest.raises(InvalidArgumentError, match="unknown codec settings"):
        CodecConfig.from_dict({"bits": 2, "bitz": 3})


def test_encode_with_a_config_is_encode_with_its_keywords():
    x = np.random.default_rng(0).standard_normal(5000).astype(np.float32)
    cfg = CodecConfig(bits=3, coder="runs", chunk_size=2048)
    assert lcckpt.encode(x, config=cfg) == lcckpt.encode(x, bits=3, coder="runs", chunk_size=2048)
    assert lcckpt.encode(x, config=CodecConfig(lossless=True)) == lcckpt.encode(x, lossless=True)
    with pytest.raises(InvalidArgumentError, match="bits would be ignored"):
        lcckpt.encode(x, bits=4, config=cfg)         # not silently the config's 3 bits


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, "bf16"])
@pytest.mark.parametrize("lossless", [False, True])
def test_decode_into_a_buffer_equals_decode(dtype, lossless):
    x = np.random.default_rng(1).standard_normal((40, 50)).astype(np.float32)
    x = torch.from_numpy(x).to(torch.bfloat16) if dtype == "bf16" else x.astype(dtype)
    blob = lcckpt.encode(x, lossless=lossless)
    want = lcckpt.decode(blob)
    out = torch.empty(2000, dtype=torch.bfloat16) if dtype == "bf16" else np.full(2000, 7, dtype)
    got = lcckpt.decode(blob, out=out)
    assert got is out
    assert same_bits(out.reshape(40, 50), want)


def test_decode_into_refuses_a_wrong_buffer():
    blob = lcckpt.encode(np.ones(100, np.float32))
    for bad in (np.empty(99, np.float32), np.empty(100, np.float64), np.empty(200, np.float32)[::2],
                np.empty(100, np.int32)):
        with pytest.raises(InvalidArgumentError, match="out"):
            lcckpt.decode(blob, out=bad)


def test_reconstruction_tracks_the_encoder_and_resumes_it():
    rng = np.random.default_rng(2)
    u = rng.standard_normal(3000).astype(np.float32)
    enc, rec = lcckpt.DeltaEncoder(bits=2), Reconstruction()
    for t in range(6):
        u = u + 0.01 * rng.standard_normal(3000).astype(np.float32)
        rec.apply(enc.encode(u))
    assert len(rec.pending) == 5                      # lazy: nothing applied yet
    assert same_bits(rec.value(), enc.reference())
    resumed = lcckpt.DeltaEncoder(bits=2)
    resumed.resume(rec)                               # a chain reopened from disk
    u2 = u + 0.01
    assert enc.encode(u2) == resumed.encode(u2)       # the same delta, byte for byte


def test_leaf_hooks_are_arguments_and_import_registers_nothing():
    assert sections._registered == {}                 # importing lcckpt added no codec
    seen = []

    def encode_leaf(path, t):
        seen.append(path)
        return sections.encode_with("lossless", path, t)

    obj = {"a": torch.arange(1000.0), "b": [torch.ones(300, dtype=torch.int64)], "c": 1}
    meta, secs = serialization.pack(obj, encode_leaf=encode_leaf)
    assert seen == ['obj["a"]', 'obj["b"][0]']
    assert [m["codec"] for _, m, _ in secs] == ["lossless", "lossless"]
    f = io.BytesIO()
    from lcckpt.format.container import read_container, write_container
    write_container(f, secs, meta)
    decoded = []

    def decode_leaf(path, c, i, m):
        decoded.append(path)
        return sections.decode_leaf(path, c, i, m)

    with read_container(io.BytesIO(f.getvalue())) as c:
        assert_same(serialization.unpack(c, decode_leaf=decode_leaf), obj)
    assert decoded == seen


def test_the_delta_codec_is_written_by_the_chain_only():
    with pytest.raises(InvalidArgumentError, match="delta"):
        lcckpt.save({"a": torch.ones(3)}, io.BytesIO(), codec="delta")


def test_stale_temps_of_any_name_are_removed(tmp_path):
    import os
    import subprocess
    import sys
    from lcckpt.util import durable as _durable
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True).stdout)
    host = _durable._host_tag()
    stale = [tmp_path / f".{n}.{host}-{dead}-0123abcd.lcckpt-tmp" for n in ("a.lcc", "b.x.lcc")]
    keep = [tmp_path / f".a.lcc.{host}-{os.getpid()}-0123abcd.lcckpt-tmp",
            tmp_path / f".a.lcc.zzzzzzzz-{dead}-0123abcd.lcckpt-tmp",
            tmp_path / ".a.lcc.lcckpt-tmp", tmp_path / "user-file.lcckpt-tmp"]
    for p in stale + keep:
        p.write_bytes(b"x")
    _durable.remove_stale_temps(str(tmp_path))
    assert not any(p.exists() for p in stale) and all(p.exists() for p in keep)
