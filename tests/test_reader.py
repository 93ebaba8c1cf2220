"""Lazy reads: keys, metadata, get_tensor and row slices of a file or of a chain step."""

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lcckpt
from lcckpt.format.container import read_container
from lcckpt.errors import BrokenChainError, InvalidArgumentError
from lcckpt.interop import reader as reader_mod
from lcckpt.interop.reader import open as lc_open


def _state():
    torch.manual_seed(0)
    w = torch.randn(120, 9)
    return {
        "model": {"fc.weight": w, "fc.bias": torch.randn(9)},
        "optim": {"state": {0: {"exp_avg": torch.randn(5, 3)}}, "param_groups": [{"lr": 0.1}]},
        "t": w.t(),
        "e": torch.randn(4).expand(6, 4),
        "p": torch.nn.Parameter(torch.randn(3, 2)),
        "np": np.arange(12, dtype=np.int16).reshape(3, 4),
        "seq": [torch.ones(2), (torch.zeros(3),)],
        "step": 7,
    }


def test_keys_are_flat_names_and_tensors_load_like_load(tmp_path):
    path = tmp_path / "a.lc"
    obj = _state()
    lcckpt.save(obj, path)
    full = lcckpt.load(path)
    with lc_open(path) as f:
        assert f.keys() == ["model.fc.weight", "model.fc.bias", "optim.state.0.exp_avg", "t", "e",
                            "p", "np", "seq.0", "seq.1.0"]
        assert f.metadata() == {} and f.header() == {"lcckpt_tree": 2}
        assert len(f) == 9 and "t" in f and "nope" not in f
        for k, want in [("model.fc.weight", full["model"]["fc.weight"]), ("t", full["t"]),
                        ("e", full["e"]), ("p", full["p"]), ("seq.1.0", full["seq"][1][0]),
                        ("optim.state.0.exp_avg", full["optim"]["state"][0]["exp_avg"])]:
            got = f.get_tensor(k)
            assert type(got) is type(want) and got.stride() == want.stride(), k
            assert torch.equal(got.detach(), want.detach()), k
        assert np.array_equal(f.get_tensor("np"), obj["np"])
        assert torch.equal(f.get_tensor('obj["model"]["fc.weight"]'), obj["model"]["fc.weight"])
        with pytest.raises(KeyError, match="no tensor 'model.fc'"):
            f.get_tensor("model.fc")
        with pytest.raises(InvalidArgumentError, match="numpy array"):
            f.get_slice("np")


def test_colliding_flat_names_fall_back_to_key_paths(tmp_path):
    path = tmp_path / "a.lc"
    lcckpt.save({"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}, 0: torch.full((1,), 2.0),
                 "0": torch.full((1,), 3.0), "c": torch.full((1,), 4.0)}, path)
    with lc_open(path) as f:
        assert f.keys() == ['obj["a.b"]', 'obj["a"]["b"]', "obj[0]", 'obj["0"]', "c"]
        assert f.get_tensor("obj[0]").item() == 2.0 and f.get_tensor('obj["0"]').item() == 3.0
        assert "a.b" not in f


_INDEXES = st.one_of(
    st.integers(-12, 11),
    st.builds(slice, st.none() | st.integers(-14, 14), st.none() | st.integers(-14, 14),
              st.none() | st.integers(1, 4) | st.integers(-4, -1)),
    st.tuples(st.builds(slice, st.integers(0, 12), st.integers(0, 12)), st.integers(0, 2)),
)


def _expected(x, index):
    if isinstance(index, slice) and index.step and index.step < 0:
        return x[torch.tensor(list(range(*index.indices(x.shape[0]))), dtype=torch.int64)]
    return x[index]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(index=_INDEXES, codec=st.sampled_from(["raw", "lossless"]))
def test_slices_equal_slicing_the_loaded_tensor(tmp_path, index, codec):
    path = tmp_path / f"s-{codec}.lc"
    m = torch.arange(12 * 3 * 5, dtype=torch.float32).reshape(12, 3, 5)
    obj = {"m": m, "t": m.reshape(12, 15).t()[:12], "e": torch.arange(3.0).expand(12, 3),
           "b": torch.arange(12) % 2 == 0}
    if not path.exists():
        lcckpt.save(obj, path, codec=codec)
    with lc_open(path) as f:
        for k, x in obj.items():
            s = f.get_slice(k)
            assert s.shape == x.shape and s.dtype == x.dtype
            try:
                want = _expected(x, index)
            except IndexError:
                with pytest.raises(IndexError):
                    s[index]
                continue
            assert torch.equal(s[index], want), (k, index)


@pytest.mark.parametrize("rows", [20000, 1000])
def test_a_raw_slice_reads_only_its_rows_and_checks_them(tmp_path, rows):
    """A slice of a large section reads and checks only the windows of its rows, so
    damage elsewhere does not stop it and damage in them is an error; a section of at
    most WINDOWED_ABOVE bytes is read whole and checked; get_tensor checks it all."""
    from lcckpt.format.windows import WINDOWED_ABOVE
    path = tmp_path / "a.lc"
    lcckpt.save({"w": torch.zeros(rows, 16)}, path)
    bad = rows - 100                                    # a row in the last window
    with read_container(path) as c:
        at = c.data_start + c.sections[0]["offset"] + bad * 64
    raw = bytearray(path.read_bytes())
    raw[at] = 0x7F
    path.write_bytes(raw)
    with lc_open(path) as f:
        if rows * 64 > WINDOWED_ABOVE:
            assert torch.equal(f.get_slice("w")[10:20], torch.zeros(10, 16))
        else:
            with pytest.raises(lcckpt.ChecksumError):
                f.get_slice("w")[10:20]
        with pytest.raises(lcckpt.ChecksumError, match="damaged"):
            f.get_slice("w")[bad]
        with pytest.raises(lcckpt.ChecksumError):
            f.get_tensor("w")


def test_chain_steps_read_lazily(tmp_path):
    d = tmp_path / "run"
    ck = lcckpt.DeltaCheckpointer(d, keyframe_every=3, min_delta_elements=64, target=None)  # LC: small tensors whole
    w = torch.randn(100, 40)
    for step in range(6):
        w = w + 0.01 * torch.randn_like(w)
        ck.save(step, {"model": {"w": w.clone(), "b": torch.randn(3)}, "step": step})
    for step in ck.steps():
        full = ck.load(step)
        with lc_open(d, step=step) as f:
            assert f.keys() == ["model.w", "model.b"]
            assert f.header()["lcckpt_chain"]["step"] == step
            assert torch.equal(f.get_tensor("model.w"), full["model"]["w"])
            assert torch.equal(f.get_slice("model.w")[10:20, 3], full["model"]["w"][10:20, 3])
            assert torch.equal(f.get_tensor("model.b"), full["model"]["b"])
    with lc_open(d) as f:                      # the newest step
        assert f.header()["lcckpt_chain"]["step"] == 5
    os.remove(ck.path(3))                      # the keyframe of steps 4 and 5
    with lc_open(d, step=5) as f:
        assert f.get_tensor("model.b").shape == (3,)        # not delta-coded: readable
        with pytest.raises(BrokenChainError, match="missing"):
            f.get_tensor("model.w")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_of_a_chain_step_decode_only_their_chunks(tmp_path, monkeypatch, dtype):
    """A slice of a chain step's fp32 tensor reads and replays only the chunks that hold
    its rows, along the keyframe and every delta (escapes included), bit for bit the rows
    of the whole tensor; a bf16 one (its keyframe widened when read) is rebuilt whole."""
    from lcckpt.codec import delta
    from lcckpt.format.container import Container
    from lcckpt.interop import chainrows
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3000, 512, generator=g)
    ck = lcckpt.DeltaCheckpointer(tmp_path)
    for step in range(6):
        if step:
            w = w + 1e-3 * torch.randn(3000, 512, generator=g)
            w.view(-1)[step * 7::100_003] += 0.01               # escapes
        ck.save(step, {"w": w.to(dtype)})
    spans, whole, read = [], [], []
    real_span, real_value, real_read = chainrows.chain_span, delta.Reconstruction.value, \
        Container.read_part
    monkeypatch.setattr(reader_mod, "chain_span",
                        lambda *a: spans.append(a[2:4]) or real_span(*a))
    monkeypatch.setattr(delta.Reconstruction, "value",
                        lambda self, copy=True: whole.append(1) or real_value(self, copy))
    monkeypatch.setattr(Container, "read_part",
                        lambda self, s, off, out: read.append(len(out)) or
                        real_read(self, s, off, out))
    for step in (1, 5):
        want = ck.load(step)["w"]
        whole.clear()
        for rows in (slice(0, 16), slice(1000, 1001), slice(-5, None), slice(5, 2000, 7)):
            read.clear()
            with lc_open(tmp_path, step=step) as f:
                assert torch.equal(f.get_slice("w")[rows], want[rows]), rows
            if dtype == torch.float32 and rows.step is None:     # a chunk or two a file
                assert sum(read) < 3000 * 512 * 4 / 2, (rows, sum(read))
        if dtype == torch.float32:
            assert not whole and (0, 16 * 512 - 1) in spans
        else:
            assert whole


def test_damaged_chunks_of_a_chain_slice_are_an_error_or_values_never_a_crash(tmp_path):
    """A chain slice checks the windows of the chunks it reads, along the chain: bytes
    damaged there, or in a blob's header, are an error, never other values or a crash."""
    import random
    import shutil
    from pathlib import Path
    from lcckpt.codec.streamed import read_header
    g = torch.Generator().manual_seed(4)
    w = torch.randn(3000, 512, generator=g)
    ck = lcckpt.DeltaCheckpointer(tmp_path / "ck")
    for step in range(4):
        if step:
            w = w + 1e-3 * torch.randn(3000, 512, generator=g)
            w.view(-1)[step::50_021] += 0.01
        ck.save(step, {"w": w})
    want = ck.load(3)["w"][:16]
    rng, outcomes = random.Random(0), []
    for trial in range(24):
        d = tmp_path / f"t{trial}"
        shutil.copytree(tmp_path / "ck", d)
        step = rng.choice([0, 1, 2, 3])
        path = Path(lcckpt.DeltaCheckpointer(d).path(step))
        with read_container(path) as c:
            i = c.index('obj["w"]')
            p = read_header(lambda off, out: c.read_part(i, off, out), c.sections[i]["length"])
            start = c.data_start + c.sections[i]["offset"]
            end = p.payload_base + int(p.layouts[0].offsets[1])   # the first chunk's bytes
        raw = bytearray(path.read_bytes())
        for _ in range(rng.choice([1, 8])):
            at = start + (rng.randrange(40) if trial % 6 == 0 else rng.randrange(end))
            raw[at] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(raw))
        try:
            with lc_open(d, step=3) as f:
                got = f.get_slice("w")[:16]
            outcomes.append("values" if torch.equal(got, want) else "other values")
        except lcckpt.LcckptError as e:
            outcomes.append(type(e).__name__)
    assert "other values" not in outcomes and "ChecksumError" in outcomes, outcomes


def test_bad_arguments(tmp_path):
    path = tmp_path / "a.lc"
    lcckpt.save({"w": torch.ones(2)}, path)
    with pytest.raises(InvalidArgumentError, match="only for a chain directory"):
        lc_open(path, step=3)
    with pytest.raises(InvalidArgumentError, match="needs a path"):
        lc_open(open(path, "rb"))
    with pytest.raises(FileNotFoundError):
        lc_open(tmp_path, step=1)
    with lc_open(path) as f:
        with pytest.raises(InvalidArgumentError):
            f.get_slice("w")["x"]
        with pytest.raises(IndexError):
            f.get_slice("w")[2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex64, torch.int16])
def test_lossless_slices_across_chunks(tmp_path, dtype):
    """Rows spanning several 2**18-word chunks of a lossless section, and a transposed view."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(1200, 500, generator=g) * 100).to(dtype) if dtype != torch.complex64 else \
        torch.complex(torch.randn(1200, 500, generator=g), torch.randn(1200, 500, generator=g))
    obj = {"x": x, "xt": x[:, :300].t()}
    path = tmp_path / "l.lc"
    lcckpt.save(obj, path, codec="lossless")
    with lc_open(path) as f:
        s = f.get_slice("x")
        for index in (slice(0, 3), slice(520, 1100, 7), 1199, (slice(600, 610), slice(2, 9))):
            assert torch.equal(s[index], x[index]), index
        assert torch.equal(f.get_slice("xt")[250:260], obj["xt"][250:260])


def test_a_lossless_slice_reads_only_its_chunks(tmp_path, monkeypatch):
    """The slice reads the blob's header and its chunks' bytes: damage in another chunk
    does not stop it, damage in its own chunks' windows or in the header is caught, and
    a header longer than the first read is read whole."""
    from lcckpt.codec import blob as _blob, streamed

    g = torch.Generator().manual_seed(2)
    x = torch.randn(4096, 256, generator=g)                     # four 2**18-word chunks
    path = tmp_path / "l.lc"
    lcckpt.save({"x": x}, path, codec="lossless")
    with read_container(path) as c:
        start = c.data_start + c.sections[0]["offset"]
        _, p = _blob.parse(c.data(0))
    last = p.payload_base + int(p.layouts[0].offsets[2]) + 1000  # plane 0, third chunk
    raw = bytearray(path.read_bytes())
    raw[start + last] ^= 0xFF
    path.write_bytes(raw)
    monkeypatch.setattr(streamed, "HEADER_PREFIX", 64)         # the header takes several reads
    with lc_open(path) as f:
        assert torch.equal(f.get_slice("x")[:16], x[:16])
        with pytest.raises(lcckpt.ChecksumError):                  # its window is checked
            f.get_slice("x")[2048:2064]
        with pytest.raises(lcckpt.ChecksumError):
            f.get_tensor("x")
    raw[start + last] ^= 0xFF
    raw[start + 12] ^= 0x01                                     # inside the blob's header
    path.write_bytes(raw)
    with lc_open(path) as f, pytest.raises(lcckpt.CorruptDataError):
        f.get_slice("x")[:16]


def test_files_that_hold_no_object_or_a_newer_tree_are_named(tmp_path):
    from lcckpt.format.container import write_container
    from lcckpt.errors import CorruptDataError, UnsupportedVersionError

    for meta, err, match in (({"x": 1}, CorruptDataError, "no saved object"),
                             ({"lcckpt_tree": 99, "tree": None}, UnsupportedVersionError, "upgrade")):
        path = tmp_path / "m.lc"
        write_container(path, [], meta)
        with pytest.raises(err, match=match):
            lc_open(path)
    path.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CorruptDataError, match="not an lcckpt file"):
        lc_open(path)


def test_map_location_and_hostile_slice_nodes(tmp_path):
    from lcckpt.format import serialization as S
    from lcckpt.format.container import write_container
    from lcckpt.errors import CorruptDataError

    x = torch.randn(10, 4)
    path = tmp_path / "a.lc"
    lcckpt.save({"x": x, "t": x.t()}, path)
    with lc_open(path, map_location={"cpu": "cpu"}) as f:
        assert torch.equal(f.get_slice("t")[1:3], x.t()[1:3])
        assert torch.equal(f.get_tensor("x"), x)
    meta, sections = S.pack({"x": x, "t": x.t()})
    meta["tree"]["items"][1][1]["offset"] = 10**6
    write_container(path, sections, meta)
    with lc_open(path) as f:
        with pytest.raises(CorruptDataError, match="reaches past"):
            f.get_slice("t")[0:2]
        with pytest.raises(CorruptDataError, match="reaches past"):
            f.get_tensor("t")


def test_slices_of_a_delta_tensor_decode_it_once(tmp_path, monkeypatch):
    """A chain's delta section decodes whole; the reader keeps the newest such tensor, so
    a loop of row reads does not replay the chain each time, and hands out copies."""
    from lcckpt.interop.reader import Reader
    ck = lcckpt.DeltaCheckpointer(tmp_path / "ck")
    w = torch.randn(64, 100)
    for step in range(3):
        w = w + 0.01 * torch.randn_like(w)
        ck.save(step, {"w": w.clone()})
    calls = []
    real = Reader.get_tensor
    monkeypatch.setattr(Reader, "get_tensor", lambda self, k: calls.append(k) or real(self, k))
    full = ck.load(2)["w"]
    with lc_open(tmp_path / "ck", step=2) as f:
        sl = f.get_slice("w")
        rows = [sl[i:i + 8] for i in range(0, 64, 8)]
        assert len(calls) == 1
        assert torch.equal(torch.cat(rows), full)
        rows[0].zero_()                               # a copy: the next read is intact
        assert torch.equal(sl[0:8], full[0:8])


def test_open_reads_torch_and_safetensors_files_lazily_and_names_what_it_cannot(tmp_path):
    """A torch.save file (zip or legacy) or a safetensors file opens with the same
    methods, its tensors mapped, not read; a    missing step of a directory is a NotFoundError, an LcckptError (it was a bare
    FileNotFoundError)."""
    from lcckpt.format.safetensors_io import save_safetensors
    state = {"model": {"w": torch.arange(12.0).reshape(4, 3), "b": torch.ones(3)}, "n": 5}
    torch.save(state, tmp_path / "m.pt")
    torch.save({**state, "sparse": torch.eye(3).to_sparse()}, tmp_path / "s.pt")
    with lc_open(tmp_path / "s.pt") as f:                # no rows to map: left to load
        assert f.keys() == ["model.w", "model.b"]
    torch.save(state, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    save_safetensors({"w": torch.arange(12.0).reshape(4, 3)}, tmp_path / "m.safetensors",
                     metadata={"step": "7"})
    for name, key in (("m.pt", "model.w"), ("old.pt", 'obj["model"]["w"]'),
                      ("m.safetensors", "w")):
        with lc_open(tmp_path / name, "pt", device="cpu") as f:
            assert key in f and len(f) == (1 if "safetensors" in name else 2)
            w = f.get_tensor(key)
            w += 1                                     # a copy: the file is untouched
            assert torch.equal(f.get_slice(key)[1:3, ::-1], state["model"]["w"][1:3].flip(1))
            assert f.get_slice(key).get_dtype() == "F32"
            assert f.metadata() == ({"step": "7"} if "safetensors" in name else {})
            with pytest.raises(KeyError, match="no tensor 'x'"):
                f.get_tensor("x")
    head = json.dumps({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                       "b": {"dtype": "F32", "shape": [3], "data_offsets": [1, 13]}}).encode()
    head += b" " * (-len(head) % 8)                    # b at an odd offset: read, not mapped
    (tmp_path / "odd.safetensors").write_bytes(
        struct.pack("<Q", len(head)) + head + b"\x07" + np.arange(3, dtype="<f4").tobytes())
    with lc_open(tmp_path / "odd.safetensors") as f:
        assert torch.equal(f.get_slice("b")[1:], torch.tensor([1.0, 2.0]))
        assert f.get_tensor("a").tolist() == [7]
    if os.path.exists("/proc/self/maps"):              # views of the mapped files
        with lc_open(tmp_path / "m.pt") as f:
            assert all(_mapped_from(t, tmp_path / "m.pt") for _, t in f._index.values())
        mapped = lcckpt.load(tmp_path / "m.safetensors", mmap=True)   # as torch.load's mmap
        assert _mapped_from(mapped["w"], tmp_path / "m.safetensors")
        assert torch.equal(mapped["w"], state["model"]["w"])
    (tmp_path / "ck").mkdir()
    with pytest.raises(lcckpt.NotFoundError):
        lc_open(tmp_path / "ck")
    lcckpt.DeltaCheckpointer(tmp_path / "ck").save(0, {"w": torch.ones(3)})
    with pytest.raises(lcckpt.NotFoundError, match="no checkpoint for step 5; stored: 0"):
        lc_open(tmp_path / "ck", step=5)


def _mapped_from(t: torch.Tensor, path) -> bool:
    """Whether ``t``'s data lies in a mapping of the file ``path`` (Linux)."""
    at = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == str(path):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if lo <= at < hi:
                    return True
    return False


def _basic_indices(ndim: int):
    """numpy basic indices for an ``ndim``-d tensor: ints, slices of any step (out of
    range bounds too), ``None`` and at most one ``...``."""
    part = st.one_of(st.integers(-6, 5), st.none(),
                     st.builds(slice, st.none() | st.integers(-9, 9), st.none() | st.integers(-9, 9),
                               st.sampled_from([None, 1, 2, 3, -1, -2])))
    return st.lists(part, max_size=ndim + 1).flatmap(
        lambda items: st.integers(0, len(items)).map(
            lambda k: tuple(items[:k]) + (Ellipsis,) + tuple(items[k:]))
        | st.just(tuple(items)) | st.just(items[0] if items else ()))


@pytest.fixture(scope="module")
def sliced_files(tmp_path_factory):
    """One state written raw, compressed and as step 2 of a chain; what each loads as."""
    d = tmp_path_factory.mktemp("sliced")
    torch.manual_seed(0)
    state = {"a": torch.randn(7, 5, 3), "h": torch.randn(6, 4).half(),
             "i": torch.arange(40).reshape(4, 10), "z": torch.tensor(2.5), "e": torch.empty(0, 4)}
    lcckpt.save(state, d / "raw.lcc")
    lcckpt.save(state, d / "packed.lcc", compress=True)
    torch.save(state, d / "t.pt")
    from lcckpt.format.safetensors_io import save_safetensors
    save_safetensors(state, d / "t.safetensors")
    ck = lcckpt.DeltaCheckpointer(d / "chain")
    for step in range(3):
        ck.save(step, {k: v + step if v.is_floating_point() else v for k, v in state.items()})
    ck.close()
    return {"raw": (d / "raw.lcc", None, state), "packed": (d / "packed.lcc", None, state),
            "chain": (d / "chain", 2, ck.load(2)), "torch": (d / "t.pt", None, state),
            "safetensors": (d / "t.safetensors", None, state)}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), kind=st.sampled_from(["raw", "packed", "chain", "torch", "safetensors"]),
       key=st.sampled_from(["a", "h", "i", "z", "e"]))
def test_a_slice_indexes_as_numpy_does(sliced_files, data, kind, key):
    """Ellipsis, new axes and negative steps in any dimension read as numpy reads them
    (safetensors' slices take the first two; torch has no negative steps, so those
    raised a bare ValueError), and an index numpy refuses raises IndexError."""
    path, step, state = sliced_files[kind]
    want_from = state[key].numpy()
    index = data.draw(_basic_indices(want_from.ndim))
    try:
        want = want_from[index]
    except IndexError:
        with lc_open(path, step=step) as f, pytest.raises(IndexError):
            f.get_slice(key)[index]
        return
    with lc_open(path, step=step) as f:
        got = f.get_slice(key)[index]
    assert isinstance(got, torch.Tensor) and got.dtype == state[key].dtype
    assert got.shape == want.shape and np.array_equal(got.numpy(), want), index


def test_a_slice_refuses_what_is_not_basic_indexing(tmp_path):
    lcckpt.save({"w": torch.ones(4, 3)}, tmp_path / "a.lcc")
    with lc_open(tmp_path / "a.lcc") as f:
        for bad in ([0, 1], torch.tensor([True, False, True, True]), (0, 1.5), True):
            with pytest.raises(InvalidArgumentError, match="ints, slices, None and"):
                f.get_slice("w")[bad]
        with pytest.raises(IndexError, match="single ellipsis"):
            f.get_slice("w")[..., 0, ...]
        with pytest.raises(IndexError, match="too many indices"):
            f.get_slice("w")[0, 0, 0]


@pytest.mark.parametrize("where", ["lossless", "chain"])
def test_a_slice_of_a_small_coded_tensor_is_checked(tmp_path, where):
    """A lossless or chain-delta section of at most WINDOWED_ABOVE bytes is read whole by a
    slice, so damage anywhere in it is a ChecksumError, not other values."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(500, 64, generator=g)                    # 128 KB
    if where == "lossless":
        path = tmp_path / "l.lc"
        lcckpt.save({"w": w}, path, codec="lossless")
        opened = lambda: lc_open(path)  # noqa: E731
    else:
        ck = lcckpt.DeltaCheckpointer(tmp_path / "ck")
        for step in range(3):
            ck.save(step, {"w": w + 0.01 * step})
        path = Path(ck.path(2))
        opened = lambda: lc_open(tmp_path / "ck", step=2)  # noqa: E731
    with read_container(path) as c:
        i = next(k for k, s in enumerate(c.sections) if s["meta"].get("shape") == [500, 64])
        assert c.sections[i]["meta"]["codec"] == ("lossless" if where == "lossless" else "delta")
        at = c.data_start + c.sections[i]["offset"] + c.sections[i]["length"] - 9
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x10                                          # the payload's last bytes
    path.write_bytes(raw)
    with opened() as f, pytest.raises(lcckpt.ChecksumError):
        f.get_slice("w")[:4]


def test_code_written_for_safe_open_runs_on_an_lcckpt_file(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file
    state = {"w": torch.randn(20, 7), "h": torch.randn(9, 3).bfloat16(), "i": torch.arange(5)}
    save_file(state, tmp_path / "a.safetensors", metadata={"format": "pt"})
    lcckpt.save(state, tmp_path / "a.lcc", compress=True, metadata={"format": "pt"})
    ck = lcckpt.DeltaCheckpointer(tmp_path / "run")
    ck.save(0, state)

    def read(f) -> dict:      # what a user's safe_open loop does
        out = {"metadata": f.metadata()}     # was the lcckpt header's own entries
        for k in f.keys():
            s = f.get_slice(k)
            out[k] = (s.get_shape(), s.get_dtype(), s[2:4], f.get_tensor(k))
        return out

    with safe_open(tmp_path / "a.safetensors", "pt", device="cpu") as f:
        want = read(f)
    for path in (tmp_path / "a.lcc", tmp_path / "run"):
        with lc_open(path, "pt", device="cpu") as f:
            got = read(f)
        assert sorted(got) == sorted(want)
        assert got.pop("metadata") == (want["metadata"] if path.suffix else {})
        for k, (shape, dtype, rows, whole) in list(want.items())[1:]:
            assert got[k][:2] == (shape, dtype), k
            assert torch.equal(got[k][2], rows) and torch.equal(got[k][3], whole), k
            assert got[k][3].device == torch.device("cpu")


def test_a_safetensors_file_lists_its_keys_as_safe_open_does(tmp_path):
    """safe_open's keys() are sorted and its offset_keys() in the file's order (by dtype
    alignment, then name); lcckpt.open gives both the same on that file, and on its own
    files the order of the save for both."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    state = {"z": torch.ones(2, dtype=torch.int8), "a": torch.ones(4),
             "m": torch.ones(3, dtype=torch.int64), "b": torch.ones(1)}
    save_file(state, tmp_path / "a.safetensors")
    with safe_open(tmp_path / "a.safetensors", "pt") as want, \
            lc_open(tmp_path / "a.safetensors", "pt") as got:
        assert want.keys() != want.offset_keys()       # the case that tells them apart
        assert got.keys() == want.keys() and got.offset_keys() == want.offset_keys()
    lcckpt.save(state, tmp_path / "a.lcc")
    with lc_open(tmp_path / "a.lcc") as f:
        assert f.keys() == f.offset_keys() == list(state)


def test_safe_open_arguments_that_cannot_hold_are_refused(tmp_path):
    path = tmp_path / "a.lcc"
    lcckpt.save({"w": torch.ones(2)}, path)
    with pytest.raises(InvalidArgumentError, match="framework='np'"):
        lc_open(path, "np")
    with pytest.raises(InvalidArgumentError, match="not both"):
        lc_open(path, device="cpu", map_location="cpu")
    with pytest.raises(InvalidArgumentError, match="not a device"):
        lc_open(path, device="gpu7")
    with lc_open(path, device="meta") as f:          # device= is a map_location
        assert f.get_tensor("w").device == torch.device("meta")


def test_a_shard_index_opens_each_shard_when_one_of_its_tensors_is_read(tmp_path):
    from lcckpt.errors import CorruptDataError
    from lcckpt.format.safetensors_io import save_safetensors
    first = {"l0.w": torch.randn(4, 3), "l0.b": torch.ones(3)}
    save_safetensors(first, tmp_path / "model-1.safetensors")
    torch.save({"l1.w": torch.randn(5, 2)}, tmp_path / "model-2.bin")   # shards of any format
    lcckpt.save({"l2.w": torch.arange(6.0)}, tmp_path / "model-3.lcc")
    wmap = {"l0.w": "model-1.safetensors", "l0.b": "model-1.safetensors",
            "l1.w": "model-2.bin", "l2.w": "model-3.lcc"}
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": wmap}))
    whole = lcckpt.load(index)
    with lc_open(index) as f:
        assert f.keys() == list(wmap) and f.metadata() == {"weight_map": wmap}
        assert torch.equal(f.get_slice("l0.w")[1:3], first["l0.w"][1:3])
        assert list(f._shards) == ["model-1.safetensors"]          # the others unopened
        for key in wmap:
            assert torch.equal(f.get_tensor(key), whole[key]), key
        assert f.get_slice("l2.w").get_dtype() == "F32"
        with pytest.raises(KeyError, match="no tensor 'x'"):
            f.get_tensor("x")
    wmap["l3.w"] = "model-3.lcc"                                    # not in its shard
    wmap["l4.w"] = "model-4.safetensors"                            # a shard that is gone
    index.write_text(json.dumps({"weight_map": wmap}))
    with lc_open(index) as f:
        assert torch.equal(f.get_tensor("l1.w"), whole["l1.w"])
        with pytest.raises(CorruptDataError, match="has no tensor 'l3.w'"):
            f.get_tensor("l3.w")
        with pytest.raises(lcckpt.NotFoundError, match="a shard the index"):
            f.get_tensor("l4.w")
    index.write_text(json.dumps({"weight_map": {"w": "../model-1.safetensors"}}))
    with pytest.raises(CorruptDataError, match="not a file name beside the index"):
        lc_open(index)


@pytest.mark.parametrize("fmt", ["raw", "compressed", "torch", "safetensors"])
def test_a_read_after_close_says_the_file_is_closed(tmp_path, fmt):
    """After the ``with`` block an lcckpt file's reads said the file was corrupt ("could
    not decode ...: I/O operation on closed file") and a torch.save or safetensors file's
    that the tensor was missing; both now say it is closed."""
    from safetensors.torch import save_file
    state = {"w": torch.randn(40, 30)}
    path = tmp_path / ("f." + {"torch": "pt", "safetensors": "safetensors"}.get(fmt, "lcc"))
    if fmt == "torch":
        torch.save(state, path)
    elif fmt == "safetensors":
        save_file(state, str(path))
    else:
        lcckpt.save(state, path, compress=fmt == "compressed")
    with lc_open(path) as f:
        rows = f.get_slice("w")
        assert torch.equal(f.get_tensor("w"), state["w"])
    with pytest.raises(InvalidArgumentError, match="is closed: read its tensors inside"):
        f.get_tensor("w")
    if fmt in ("raw", "compressed"):
        with pytest.raises(InvalidArgumentError, match="is closed"):
            rows[:5]
    else:                                       # a mapped file's slice stays valid
        assert torch.equal(rows[:5], state["w"][:5])
