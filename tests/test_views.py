"""Tensors come back as torch.load gives them: Parameters, requires_grad, strides, views of
one storage sharing it, stride-0 expands stored by their storage (format tree v2)."""

import io
import json
import os
import pickle

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lcckpt
from lcckpt.format import serialization as S
from lcckpt.format.container import read_container, write_container
from lcckpt.errors import CorruptDataError, InvalidArgumentError, UnsafeObjectError


def lc_round_trip(obj, **kw):
    f = io.BytesIO()
    lcckpt.save(obj, f, **kw)
    size = f.tell()
    f.seek(0)
    return lcckpt.load(f), size


def torch_round_trip(obj):
    f = io.BytesIO()
    torch.save(obj, f)
    size = f.tell()
    f.seek(0)
    return torch.load(f, weights_only=True), size


def _leaves(obj, path="obj"):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{path}[{i}]")
    elif isinstance(obj, torch.Tensor):
        yield path, obj


def _sharing(leaves):
    """Which leaves share a storage, as a partition of their paths."""
    groups = {}
    for path, t in leaves:
        groups.setdefault(t.untyped_storage().data_ptr(), []).append(path)
    return sorted(sorted(g) for g in groups.values())


def assert_like_torch_load(obj, **kw):
    """lcckpt gives what torch.load gives for the same object: types, requires_grad,
    shapes, strides, values, which tensors share a storage, and the storage offsets
    between views of one storage."""
    ours, _ = lc_round_trip(obj, **kw)
    theirs, _ = torch_round_trip(obj)
    a, b = list(_leaves(ours)), list(_leaves(theirs))
    assert [p for p, _ in a] == [p for p, _ in b]
    for (path, x), (_, y) in zip(a, b):
        assert type(x) is type(y), path
        assert x.requires_grad == y.requires_grad, path
        assert x.shape == y.shape and x.dtype == y.dtype, path
        assert x.stride() == y.stride() or x.numel() == 0, path   # empty: fresh, contiguous
        assert torch.equal(x.detach(), y.detach()), path
    a = [(p, t) for p, t in a if t.numel()]          # empty tensors hold no data to share
    b = [(p, t) for p, t in b if t.numel()]
    assert _sharing(a) == _sharing(b)
    for group in _sharing(a):        # same offsets relative to each other
        xa = {p: t for p, t in a}
        xb = {p: t for p, t in b}
        first = group[0]
        for p in group:
            assert (xa[p].storage_offset() - xa[first].storage_offset()
                    == xb[p].storage_offset() - xb[first].storage_offset()), p
    return ours


def test_parameters_views_expands_and_transposes_match_torch_load():
    base = torch.randn(1000)
    m = torch.arange(24.0).reshape(2, 3, 4)
    obj = {
        "param": torch.nn.Parameter(torch.randn(3, 2)),
        "frozen": torch.nn.Parameter(torch.randn(2), requires_grad=False),
        "grad": torch.randn(4).requires_grad_(),
        "expand": base.expand(100, 1000),
        "base": base,
        "head": base[:10],
        "mid": base[5:25],
        "every3": base[::3],
        "t": m.transpose(0, 2),
        "strided": m[:, ::2, 1:],
        "unsq": torch.randn(3).unsqueeze(1).expand(3, 4),
        "lin": torch.nn.Linear(3, 2).state_dict(),
    }
    ours = assert_like_torch_load(obj)
    ours["base"][7] = 123.0                  # views write through, as torch.load's do
    assert ours["head"][7] == 123.0 and ours["mid"][2] == 123.0 and ours["expand"][50, 7] == 123.0


def test_expand_is_stored_by_its_storage():
    obj = {"e": torch.randn(1000).expand(10000, 1000)}     # 40 MB materialised
    ours, size = lc_round_trip(obj)
    _, torch_size = torch_round_trip(obj)
    assert size < 8000 and size < 2 * torch_size
    assert ours["e"].stride() == (0, 1) and torch.equal(ours["e"], obj["e"])


def test_views_of_a_parameter_and_the_parameter_itself():
    p = torch.nn.Parameter(torch.randn(6, 4))
    obj = {"p": p, "rows": p.detach()[1:3], "t": p.detach().t()}
    ours = assert_like_torch_load(obj)
    assert type(ours["p"]) is torch.nn.Parameter
    with torch.no_grad():
        ours["p"][1, 0] = 5.0
    assert ours["rows"][0, 0] == 5.0 and ours["t"][0, 1] == 5.0


def test_one_view_of_a_large_storage_stores_only_its_span():
    big = torch.randn(1 << 20)
    _, size = lc_round_trip({"a": big[100:200].view(10, 10).t()})
    assert size < 4096


def test_plain_files_stay_tree_v1():
    meta, _ = S.pack({"w": torch.randn(3, 4), "tied": [torch.ones(2)] * 2,
                      "sd": torch.nn.Linear(2, 2).state_dict()})
    assert meta["lcckpt_tree"] == 1
    assert S.pack({"t": torch.randn(3, 4).t()})[0]["lcckpt_tree"] == 2
    assert S.pack({"p": torch.nn.Parameter(torch.randn(2))})[0]["lcckpt_tree"] == 2


def test_views_with_the_lossless_codec_and_map_location():
    base = torch.randn(64, 64)
    obj = {"b": base, "t": base.t(), "col": base[:, 3]}
    assert_like_torch_load(obj, codec="lossless")
    f = io.BytesIO()
    lcckpt.save(obj, f)
    for ml in ("cpu", {"cpu": "cpu"}, lambda s, loc: s):
        f.seek(0)
        out = lcckpt.load(f, map_location=ml)
        assert out["t"].stride() == (1, 64)
        assert out["t"].untyped_storage().data_ptr() == out["b"].untyped_storage().data_ptr()


_DTYPES = [torch.float32, torch.float16, torch.int64, torch.bool]


@st.composite
def _views(draw):
    dtype = draw(st.sampled_from(_DTYPES))
    n = draw(st.integers(1, 60))
    base = (torch.arange(n) % 7).to(dtype)
    out = {"base": base} if draw(st.booleans()) else {}
    for i in range(draw(st.integers(1, 4))):
        rows = draw(st.integers(1, 5))
        cols = draw(st.integers(0, 5))
        s0 = draw(st.integers(0, 6))
        s1 = draw(st.integers(0, 3))
        last = (rows - 1) * s0 + max(cols - 1, 0) * s1
        if last >= n:
            continue
        off = draw(st.integers(0, n - 1 - last))
        out[f"v{i}"] = base.as_strided((rows, cols), (s0, s1), off)
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_views())
def test_random_views_of_one_storage_match_torch_load(obj):
    assert_like_torch_load(obj)


# ---- hostile or damaged view nodes


def _with_tree(obj, edit):
    meta, sections = S.pack(obj)
    edit(meta["tree"])
    f = io.BytesIO()
    write_container(f, sections, meta)
    f.seek(0)
    return f


@pytest.mark.parametrize("edit, match", [
    (lambda n: n.update(offset=10**6), "reaches past"),
    (lambda n: n.update(stride=[10**6, 1]), "reaches past"),
    (lambda n: n.pop("stride"), "offset, shape and stride together"),
    (lambda n: n.update(shape=[-1, 2]), "non-negative"),
    (lambda n: n.update(shape=[2**40, 2**40]), "too many elements"),
    (lambda n: n.update(param="yes"), "booleans"),
])
def test_bad_view_nodes_are_refused(edit, match):
    obj = {"t": torch.randn(4, 3).t()}

    def apply(tree):
        edit(tree["items"][0][1])

    with pytest.raises(CorruptDataError, match=match):
        lcckpt.load(_with_tree(obj, apply))


def test_requires_grad_on_an_integer_tensor_is_refused():
    def apply(tree):
        tree["items"][0][1]["grad"] = True

    with pytest.raises(CorruptDataError, match="cannot require grad"):
        lcckpt.load(_with_tree({"i": torch.arange(3)}, apply))


# ---- torch.load's keywords


def test_load_takes_torch_load_keywords(tmp_path):
    obj = {"w": torch.randn(30, 20).t(), "i": torch.arange(5), "p": torch.nn.Parameter(torch.ones(2))}
    path = tmp_path / "a.lc"
    lcckpt.save(obj, path)
    for kw in ({}, {"weights_only": True}, {"weights_only": False}, {"mmap": False},
               {"mmap": True}, {"mmap": True, "map_location": "cpu"}):
        out = lcckpt.load(path, **kw)
        assert out["w"].stride() == (1, 20) and torch.equal(out["w"], obj["w"]), kw
        assert type(out["p"]) is torch.nn.Parameter
    mapped = lcckpt.load(path, mmap=True)
    mapped["i"].add_(1)                           # copy-on-write: the file is unchanged
    assert torch.equal(lcckpt.load(path)["i"], torch.arange(5))
    with pytest.raises(InvalidArgumentError, match="needs a path"):
        lcckpt.load(io.BytesIO(path.read_bytes()), mmap=True)
    with pytest.raises(InvalidArgumentError, match="pickle_module"):
        lcckpt.load(path, pickle_module=pickle)
    with pytest.raises(InvalidArgumentError, match="unknown arguments"):
        lcckpt.load(path, mmap_mode="r")
    with pytest.raises(InvalidArgumentError, match="weights_only"):
        lcckpt.load(path, weights_only="yes")


def test_mmap_load_checks_checksums(tmp_path):
    path = tmp_path / "a.lc"
    lcckpt.save({"w": torch.zeros(1000)}, path)
    with read_container(path) as c:
        at = c.data_start + c.sections[0]["offset"] + 100
    raw = bytearray(path.read_bytes())
    raw[at] ^= 1
    path.write_bytes(raw)
    with pytest.raises(lcckpt.ChecksumError):
        lcckpt.load(path, mmap=True)


def test_torch_files_weights_only_false_is_refused_and_mmap_passes_through(tmp_path):
    path = tmp_path / "t.pt"
    torch.save({"x": torch.arange(4.0), "p": torch.nn.Parameter(torch.ones(2))}, path)
    out = lcckpt.load(path, mmap=True, weights_only=True)
    assert torch.equal(out["x"], torch.arange(4.0)) and type(out["p"]) is torch.nn.Parameter
    with pytest.raises(UnsafeObjectError, match="torch.load"):
        lcckpt.load(path, weights_only=False)


# ---- golden files of tree v2 (tests/fixtures/v2, written by make_golden.py)

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


def test_v2_golden_files_keep_their_layout(tmp_path):
    import shutil

    from fixtures.make_golden import layout, views_state

    with open(os.path.join(FIXTURES, "v2", "manifest.json")) as f:
        m = json.load(f)
    theirs, _ = torch_round_trip(views_state(3))
    assert m["layout"]["views.lcc"] == layout(theirs)       # what torch.load gives
    for name in ("views.lcc", "views-compressed.lcc"):
        assert layout(lcckpt.load(os.path.join(FIXTURES, "v2", name))) == m["layout"][name], name
    d = tmp_path / "chain"
    shutil.copytree(os.path.join(FIXTURES, "v2", "chain"), d)
    ck = lcckpt.DeltaCheckpointer(d)
    for step in ck.steps():
        assert layout(ck.load(step)) == m["layout"][f"chain/{step}"], step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_views_match_torch_load_and_map_to_cpu():
    base = torch.randn(8, 6, device="cuda")
    obj = {"b": base, "t": base.t(), "e": base[0].expand(3, 6), "p": torch.nn.Parameter(base[1])}
    assert_like_torch_load(obj)
    f = io.BytesIO()
    lcckpt.save(obj, f)
    f.seek(0)
    out = lcckpt.load(f, map_location="cpu")
    assert out["t"].device.type == "cpu" and out["t"].stride() == (1, 6)
    assert out["t"].untyped_storage().data_ptr() == out["b"].untyped_storage().data_ptr()


def test_safetensors_files_take_the_same_keywords(tmp_path):
    from lcckpt.format.safetensors_io import save_safetensors

    path = tmp_path / "m.safetensors"
    save_safetensors({"w": torch.arange(6.0).reshape(2, 3)}, path)
    for kw in ({}, {"weights_only": True}, {"weights_only": False}, {"map_location": "cpu"},
               {"mmap": True}, {"mmap": True, "map_location": {"cpu": "cpu"}}):
        assert torch.equal(lcckpt.load(path, **kw)["w"], torch.arange(6.0).reshape(2, 3)), kw
    with open(path, "rb") as f, pytest.raises(InvalidArgumentError, match="needs a path"):
        lcckpt.load(f, mmap=True)
