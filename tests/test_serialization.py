"""save/load: exact round trips, refusal of unsafe values, torch.save interop, codec hook."""

import argparse
import collections
import datetime
import io
import math
import os
import pathlib
import pickle
import re
import warnings
import zlib

import numpy as np
import pytest
from helpers import NonSeekableStream, assert_same, sparse_parts, train_steps
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lcckpt
from lcckpt.format import sections, tree
from lcckpt.format import serialization as S
from lcckpt.format.container import read_container, write_container
from lcckpt.errors import (
    CorruptDataError, InvalidArgumentError, ResourceLimitError, UnsafeObjectError,
    UnsupportedDtypeError, UnsupportedVersionError,
)

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")


def round_trip(obj, **kw):
    f = io.BytesIO()
    S.save(obj, f, **kw)
    f.seek(0)
    return S.load(f)


# ---- a real model and optimizer


def _cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 16, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(16, 10),
    )  # fmt: skip


def _train(model, opt, steps, seed=1):
    train_steps(model, opt, steps, seed)


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
}


@pytest.mark.parametrize("opt_name", OPTIMIZERS)
def test_model_and_optimizer_state_round_trip_and_resume(tmp_path, opt_name):
    model = _cnn()
    opt = OPTIMIZERS[opt_name](model.parameters())
    _train(model, opt, 3)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3, "loss": 1.25}
    path = tmp_path / "ck.lc"
    S.save(state, path)
    loaded = S.load(path)
    assert_same(state, loaded)
    assert type(loaded["model"]) is collections.OrderedDict

    # resuming from the loaded state continues exactly like the original run
    model2 = _cnn()
    opt2 = OPTIMIZERS[opt_name](model2.parameters())
    model2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["optim"])
    _train(model, opt, 2, seed=7)
    _train(model2, opt2, 2, seed=7)
    assert_same(model.state_dict(), model2.state_dict())


# ---- tensors


@pytest.mark.parametrize("dtype", list(lcckpt.codec.dtypes.TORCH_NAME), ids=str)
def test_every_dtype_bit_exact(dtype):
    size = dtype.itemsize
    g = torch.Generator().manual_seed(3)
    raw = torch.randint(0, 256, (6 * 4 * size,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    t = raw.view(dtype).reshape(6, 4)
    out = round_trip({"t": t, "scalar": t[1, 2].clone(), "empty": t[:0]})
    assert_same({"t": t, "scalar": t[1, 2].clone(), "empty": t[:0]}, out)
    assert out["scalar"].dim() == 0


def test_special_floats_and_views():
    x = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45])
    m = torch.arange(24.0).reshape(2, 3, 4)
    z = torch.complex(torch.randn(5), torch.randn(5))
    cases = {
        "specials": x,
        "transposed": m.transpose(0, 2),
        "strided": m[:, ::2, 1:],
        "expanded": torch.tensor([1, 2]).expand(3, 2),
        "offset": m.reshape(-1)[5:9],
        "conj": z.conj(),
        "neg": z.conj().imag,
        "zero_d": torch.tensor(7, dtype=torch.int64),
        "empty_2d": torch.empty(0, 5),
        "empty_0": torch.empty(3, 0, 2, dtype=torch.bfloat16),
    }
    out = round_trip(cases)
    for k, v in cases.items():
        if k in ("conj", "neg"):      # lazy conjugate/negative bits: stored resolved
            assert out[k].is_contiguous() and not out[k].is_conj() and not out[k].is_neg()
        else:                         # strides kept, as torch.load keeps them
            assert out[k].stride() == v.stride(), k
        assert_same(v.resolve_conj().resolve_neg().contiguous(), out[k].contiguous(), k)
    assert torch.equal(out["conj"], z.conj())


def test_shared_tensors_stay_shared():
    a = torch.randn(3, 4)
    lin = torch.nn.Linear(4, 4)
    tied = torch.nn.ModuleDict({"enc": lin, "dec": lin})
    sd = tied.state_dict()  # two distinct tensor objects viewing the same storage
    obj = {"a": a, "again": a, "list": [a, (a,)], "sd": sd, "other": a.clone()}
    out = round_trip(obj)
    assert out["a"] is out["again"] is out["list"][0] is out["list"][1][0]
    assert out["other"] is not out["a"]
    w1, w2 = out["sd"]["enc.weight"], out["sd"]["dec.weight"]
    assert w1 is not w2 and w1.data_ptr() == w2.data_ptr()
    w1.add_(1)
    assert torch.equal(w1, w2)
    # stored once
    meta, sections = S.pack(obj)
    assert len(sections) == 4  # a, other, enc.weight, enc.bias


def test_parameters_come_back_as_parameters_like_torch_load():
    p = torch.nn.Parameter(torch.randn(3))
    out = round_trip({"p": p})["p"]
    assert type(out) is torch.nn.Parameter and out.requires_grad
    assert torch.equal(out.detach(), p.detach())


# ---- Python values and containers


def test_nested_values_round_trip():
    od = collections.OrderedDict([("z", 1), ("a", [1, 2]), (3, None)])
    obj = {
        "none": None, "t": True, "f": False, "i": -5, "big": 2**200, "neg_big": -(2**64),
        "fl": 0.1, "negzero": -0.0, "nan": float("nan"), "inf": float("inf"), "ninf": -float("inf"),
        "s": "", "uni": "naïve ✓ \ud800", "by": b"\x00\xff", "empty_bytes": b"",
        "list": [], "tuple": (), "nested": [(1, [2, {"x": (3,)}])], "od": od,
        7: "int key", 2.5: "float key", (1, "a"): "tuple key", None: "none key", True: "bool key",
        "dtype": torch.bfloat16, "size": torch.Size([2, 3]), "device": torch.device("cpu"),
        "np": np.arange(6, dtype=np.int16).reshape(2, 3), "np0": np.array(2.5),
        "npf": np.float32(1.5), "npi": np.int64(-3), "npb": np.bool_(True),
        "3": "str three", 3: "int three",
    }  # fmt: skip
    out = round_trip(obj)
    assert_same(obj, out)
    assert list(out) == list(obj)
    assert type(out["od"]) is collections.OrderedDict



_SPELLED = [np.array(["cat", "dög", "", "🎉"]), np.array([b"a\x00b", b""]),
            np.zeros((2, 3), "U1"), np.zeros(4, "S2"), np.array([], "U5"), np.array(["x"], ">U1"),
            np.array(["2020-01-01T00:00:01.5", "NaT"], "M8[ms]"), np.array([1, -5], "m8[25s]"),
            np.array(["NaT"], "M8"), np.arange(6, dtype=">f4").reshape(2, 3),
            np.arange(3, dtype=">i8"), np.array([1 + 2j], ">c16"),
            np.array(["a", "bb", "ccc"])[::2]]   # not contiguous


@pytest.mark.parametrize("mmap", [False, True])
def test_numpy_strings_dates_and_big_endian_round_trip(tmp_path, mmap):
    """Values numpy alone names (strings, bytes, dates, big-endian numbers) are stored under
    numpy's own dtype spelling, and the file says tree version 6; others stay version 1."""
    obj = {f"a{i}": a for i, a in enumerate(_SPELLED)}
    obj.update(s=np.str_("dog"), s0=np.str_(""), b=np.bytes_(b"\x01"), nat=np.datetime64("NaT"),
               day=np.datetime64("2021-03-04"), hours=np.timedelta64(5, "h"),
               be=np.array([1.5], ">f8")[0])
    path = tmp_path / "np.lcc"
    S.save(obj, path)
    out = S.load(path, mmap=mmap)
    assert_same(obj, out)
    assert out["a0"].tolist() == ["cat", "dög", "", "🎉"] and out["s0"] == ""
    assert np.isnat(out["a6"][1]) and out["a9"].dtype.str == ">f4" and out["a9"][1, 2] == 5
    assert lcckpt.open(path).header()["lcckpt_tree"] == 6
    S.save({"a": np.arange(3.0), "s": np.float16(2)}, path)
    assert lcckpt.open(path).header()["lcckpt_tree"] == 1


_spelled_dtypes = st.one_of(
    st.builds(lambda o, n: f"{o}U{n}", st.sampled_from("<>"), st.integers(1, 9)),
    st.builds(lambda n: f"|S{n}", st.integers(1, 9)),
    st.builds(lambda o, k, u: f"{o}{k}8[{u}]", st.sampled_from("<>"), st.sampled_from("Mm"),
              st.sampled_from(["Y", "M", "W", "D", "h", "m", "s", "ms", "us", "ns", "3s"])),
    st.sampled_from([">f2", ">f4", ">f8", ">i2", ">i4", ">i8", ">u2", ">u4", ">u8", ">c8", ">c16"]),
)


@settings(max_examples=60, deadline=None)
@given(_spelled_dtypes, st.lists(st.integers(0, 3), max_size=3), st.randoms(use_true_random=False))
def test_any_spelled_array_round_trips_byte_for_byte(code, shape, rnd):
    dt = np.dtype(code)
    n = math.prod(shape) * dt.itemsize
    if dt.kind == "U":                   # code points (below the surrogates), not any bytes
        a = np.array([rnd.randrange(0xD800) for _ in range(n // 4)], code[0] + "u4").view(dt)
    else:
        a = np.frombuffer(bytes(rnd.getrandbits(8) for _ in range(n)), dt)
    a = a.reshape(shape)
    out = round_trip({"a": a, "s": a.reshape(-1)[0] if a.size else None})
    assert_same({"a": a, "s": a.reshape(-1)[0] if a.size else None}, out)


@pytest.mark.parametrize("code", ["O", "|V8", "<U07", "<f4", "U3", "<S3", "|U3", "<M8[fortnight]",
                                  "<M8[3]", ">b1", "F32 ", "<U3,<i4", "<U9999999999"])
def test_a_file_cannot_name_a_dtype_outside_the_allowed_forms(code):
    with pytest.raises(CorruptDataError):
        S.load(_file_with_tree({"$": "npscalar", "dtype": code, "hex": ""}))
    meta = {"kind": "ndarray", "dtype": code, "shape": [0], "nbytes": 0, "codec": "raw"}
    with pytest.raises(CorruptDataError):
        S.load(_file_with_tree({"$": "ndarray", "s": 0}, [("a", meta, b"")]))


@pytest.mark.parametrize("mmap", [False, True])
def test_compress_codes_numeric_arrays(tmp_path, mmap):
    """``compress=True`` codes numpy arrays of the numeric dtypes as it codes tensors
    (tree version 6); strings, dates, tiny and empty arrays stay raw; without it arrays are
    stored as before."""
    rng = np.random.default_rng(0)
    obs = (rng.standard_normal((4000, 16)) * 0.1).astype(np.float32)
    ro = obs[:500].copy()
    ro.flags.writeable = False
    arrays = {"obs": obs, "f16": obs.astype(np.float16), "f64": obs.astype(np.float64),
              "act": rng.integers(0, 4, 20000), "done": rng.random(20000) < 0.01,
              "c": (obs[:300] + 1j).astype(np.complex64),
              "u16": rng.integers(0, 99, 5000).astype(np.uint16),
              "strided": obs[:, ::2], "ro": ro, "tiny": np.arange(3.0),
              "empty": np.zeros((0, 4), np.float32), "labels": np.array(["a", "b"]),
              "zeros": np.zeros((300, 300), np.float32)}
    path = tmp_path / "a.lcc"
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # no read-only array warning from torch
        S.save(arrays, path, compress=True)
    assert_same(arrays, S.load(path, mmap=mmap))
    with read_container(str(path)) as c:
        codecs = {e["name"].split('"')[1]: e["meta"]["codec"] for e in c.sections}
        assert c.meta["lcckpt_tree"] == 6
    assert {k for k, v in codecs.items() if v == "lossless"} == \
        {"obs", "f16", "f64", "act", "done", "c", "u16", "strided", "ro"}, codecs
    assert codecs["zeros"] == "zeros" and codecs["tiny"] == codecs["labels"] == "raw"
    from lcckpt.format.verify import verify_file
    assert verify_file(path)["ok"]
    plain = tmp_path / "p.lcc"
    numeric = {k: v for k, v in arrays.items() if k != "labels"}
    S.save(numeric, plain)
    assert os.path.getsize(path) < 0.7 * os.path.getsize(plain)
    with read_container(str(plain)) as c:
        assert c.meta["lcckpt_tree"] == 1 and {e["meta"]["codec"] for e in c.sections} == {"raw"}


@pytest.mark.parametrize("codec", ["delta", "nope"])
def test_an_array_section_codes_only_as_compress_writes(codec):
    meta = {"kind": "ndarray", "dtype": "F32", "shape": [1], "nbytes": 4, "codec": codec}
    with pytest.raises(CorruptDataError, match="array section"):
        S.load(_file_with_tree({"$": "ndarray", "s": 0}, [("a", meta, b"\0\0\0\0")]))

def test_a_runs_args_namespace_round_trips(tmp_path):
    """argparse.Namespace (a run's args, which checkpoints often carry) is stored by its
    attributes (tree version 6) and loads as a Namespace."""
    import argparse
    ns = argparse.Namespace(lr=0.1, arch="resnet", layers=[1, 2], w=torch.ones(2),
                            inner=argparse.Namespace(a=1), **{"odd key": None})
    S.save({"args": ns}, tmp_path / "a.lcc")
    out = S.load(tmp_path / "a.lcc")["args"]
    assert type(out) is argparse.Namespace and type(out.inner) is argparse.Namespace
    assert_same(vars(ns), vars(out))
    assert lcckpt.open(tmp_path / "a.lcc").header()["lcckpt_tree"] == 6


def test_a_defaultdict_of_a_builtin_factory_round_trips(tmp_path):
    """defaultdict(list) and the like (metric logs) load as defaultdicts of that factory,
    in order, with tensors and nesting (tree version 6)."""
    logs = collections.defaultdict(list, loss=[0.5, 0.25], w=[torch.ones(2)])
    counts = collections.defaultdict(int, {3: 1, "a": 2})
    plain = collections.defaultdict(None, x=1)
    out = round_trip({"logs": logs, "counts": counts, "plain": plain,
                      "nested": collections.defaultdict(dict, a={"b": 1})})
    for k, v in (("logs", logs), ("counts", counts), ("plain", plain)):
        assert type(out[k]) is collections.defaultdict and out[k].default_factory is \
            v.default_factory and list(out[k]) == list(v), k
        assert_same(dict(v), dict(out[k]))
    out["logs"]["new"].append(1)                 # the factory works
    assert out["counts"]["missing"] == 0 and out["nested"]["a"] == {"b": 1}
    S.save({"d": counts}, tmp_path / "d.lcc")
    assert lcckpt.open(tmp_path / "d.lcc").header()["lcckpt_tree"] == 6


def test_a_load_into_reaches_tensors_in_a_defaultdict_and_a_namespace(tmp_path):
    import argparse
    S.save({"logs": collections.defaultdict(list, w=[torch.ones(3)]),
            "args": argparse.Namespace(t=torch.full((2,), 5.0))}, tmp_path / "i.lcc")
    into = {"logs": collections.defaultdict(list, w=[torch.zeros(3)]),
            "args": argparse.Namespace(t=torch.zeros(2))}
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # no "target left as it was" warning
        out = S.load(tmp_path / "i.lcc", into=into)
    assert out["logs"]["w"][0] is into["logs"]["w"][0] and out["args"].t is into["args"].t
    assert into["logs"]["w"][0].tolist() == [1.0] * 3 and into["args"].t.tolist() == [5.0] * 2


def test_dates_times_durations_and_paths_round_trip():
    """datetime's four types (a fixed-offset time zone, its name and fold kept) and pathlib
    paths load as they were saved (tree version 6); a zone that only pickle stores is
    refused, naming what to do."""
    import datetime as dt
    import pathlib
    import zoneinfo
    utc, ist = dt.timezone.utc, dt.timezone(dt.timedelta(hours=5, minutes=30))
    obj = {"at": dt.datetime(2026, 12, 1, 2, 3, 4, 567890),
           "utc": dt.datetime(2020, 1, 1, tzinfo=utc), "ist": dt.datetime(2020, 1, 1, 5, tzinfo=ist),
           "fold": dt.datetime(2020, 11, 1, 1, 30, fold=1),
           "named": dt.time(9, tzinfo=dt.timezone(dt.timedelta(hours=1), "CET")),
           "day": dt.date(1999, 12, 31), "took": dt.timedelta(days=-3, seconds=5, microseconds=7),
           "out": pathlib.Path("/runs/a/ck.lcc"), "rel": pathlib.PurePosixPath("a/b"),
           "win": pathlib.PureWindowsPath(r"C:\runs\a")}
    out = round_trip(obj)
    for k, v in obj.items():
        w = out[k]
        assert type(w) is type(v) and w == v and getattr(w, "fold", 0) == getattr(v, "fold", 0), k
        if getattr(v, "tzinfo", None) is not None:
            assert w.tzname() == v.tzname(), k
    with pytest.raises(UnsafeObjectError, match="astimezone"):
        S.save({"z": dt.datetime(2020, 1, 1, tzinfo=zoneinfo.ZoneInfo("UTC"))}, io.BytesIO())


@pytest.mark.parametrize("node", [
    {"$": "datetime", "v": [2020, 13, 1, 0, 0, 0, 0]}, {"$": "date", "v": [2020, 1]},
    {"$": "time", "v": [1, 2, 3, 4], "utcoffset": [1, 0, 0]},
    {"$": "timedelta", "v": [10**30, 0, 0]},
    {"$": "date", "v": [2020, 1, 1], "fold": 1}, {"$": "time", "v": [1, 2, 3, 4], "fold": 2},
    {"$": "time", "v": [1, 2, 3, 4], "utcoffset": [0, 60, 0], "tzname": 3},
    {"$": "path", "v": "a", "flavour": "mac", "pure": True},
    {"$": "path", "v": 1, "flavour": "posix", "pure": True},
])
def test_hostile_dates_and_paths_are_corrupt_data(node):
    with pytest.raises(CorruptDataError):
        S.load(_file_with_tree(node))


@pytest.mark.parametrize("node", [
    {"$": "defaultdict", "items": [], "factory": "eval"},
    {"$": "defaultdict", "items": [], "factory": 3},
    {"$": "defaultdict", "items": [], "metadata": {}},
])
def test_hostile_defaultdicts_are_corrupt_data(node):
    with pytest.raises(CorruptDataError):
        S.load(_file_with_tree(node))


@pytest.mark.parametrize("node", [
    {"$": "namespace"}, {"$": "namespace", "items": 3}, {"$": "namespace", "items": [[1, 2]]},
    {"$": "namespace", "items": [["a", 1]], "extra": 1},
])
def test_hostile_namespaces_are_corrupt_data(node):
    with pytest.raises(CorruptDataError):
        S.load(_file_with_tree(node))

def test_zero_width_values():
    """np.str_("") is a "<U0" scalar, which no array can hold: numpy makes "<U0" arrays
    "<U1". A file that claims a zero-width array (it would load as uninitialized "<U1"
    memory) is refused."""
    out = round_trip({"s": np.str_(""), "b": np.bytes_(b""), "a": np.array([""])})
    assert out["s"] == "" and out["s"].dtype.str == "<U0" and out["b"].dtype.str == "|S0"
    assert out["a"].dtype.str == "<U1" and out["a"].tolist() == [""]
    for code in ("<U0", "|S0"):
        meta = {"kind": "ndarray", "dtype": code, "shape": [3], "nbytes": 0, "codec": "raw"}
        with pytest.raises(CorruptDataError, match="array dtype"):
            S.load(_file_with_tree({"$": "ndarray", "s": 0}, [("a", meta, b"")]))


def _ref_node(v):
    """The tree node of a plain value, from docs/format.md's table alone (the reference the
    writer's fast paths for lists and dicts of plain values are held to)."""
    if v is None or type(v) in (bool, str):
        return v
    if type(v) is int:
        return v if -(2**63) <= v < 2**63 else {"$": "int", "hex": hex(v)}
    if type(v) is float:
        return v if math.isfinite(v) else {"$": "float", "v": repr(v)}
    if type(v) is list:
        return [_ref_node(x) for x in v]
    if type(v) is tuple:
        return {"$": "tuple", "v": [_ref_node(x) for x in v]}
    return {"$": "dict", "items": [[_ref_node(k), _ref_node(x)] for k, x in v.items()]}


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**64), 2**64),
                     st.sampled_from([2**63 - 1, -(2**63), 2**63]), st.floats(), st.text(max_size=3))
_plain_trees = st.recursive(
    st.lists(_scalars, max_size=6),
    lambda kids: st.one_of(st.lists(kids | _scalars, max_size=4),
                           st.tuples(kids, _scalars),
                           st.dictionaries(st.one_of(st.text(max_size=2), st.integers(-3, 3),
                                                     st.floats(allow_nan=False)),
                                           kids | _scalars, max_size=4)),
    max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(_plain_trees)
def test_plain_values_are_written_as_the_format_says(obj):
    """Lists, tuples and dicts of plain values are written without a node call each (a
    history of a million losses); the tree is still exactly docs/format.md's, and loads
    back exactly (bools stay bools, -0.0 and NaN stay, 2**63 takes its hex node)."""
    f = io.BytesIO()
    S.save({"v": obj}, f)
    f.seek(0)
    with read_container(f) as c:
        tree_json = S.tree_of(c.meta)
    assert tree_json == {"$": "dict", "items": [["v", _ref_node(obj)]]}
    f.seek(0)
    assert_same({"v": obj}, S.load(f))


def test_a_long_history_of_plain_values_round_trips():
    hist = {"loss": [i * 1e-3 for i in range(200_000)], "step": list(range(200_000)),
            "tag": ["a"] * 1000, "by_step": {i: float(i) for i in range(1000)},
            "mixed": [1, 2.5, "x", None, True, float("nan"), 2**70]}
    out = round_trip(hist)
    assert_same(hist, out)

def test_deep_nesting_up_to_the_limit():
    deep, key = [], ()
    for i in range(tree.MAX_DEPTH - 1):
        deep = {i: deep} if i % 2 else (deep,)
        key = (key,)
    obj = {"deep": deep, key: 1}
    assert_same(obj, round_trip(obj))
    with pytest.raises(InvalidArgumentError):
        S.save({(((key,),),): 1}, io.BytesIO())


def _deep_key(n):
    key = "k"
    for _ in range(n):
        key = {"$": "tuple", "v": [key]}
    return key


def test_state_dict_metadata_is_kept():
    sd = torch.nn.BatchNorm1d(3).state_dict()
    out = round_trip(sd)
    assert out._metadata == sd._metadata


Point = collections.namedtuple("Point", "x y")


class MyDict(dict):
    pass


@pytest.mark.parametrize(
    "bad, kind",
    [
        (object(), "object"),
        ({1, object()}, "set elements"),
        (lambda: 0, "function"),
        (Point(1, 2), "namedtuple"),
        (collections.defaultdict(lambda: 0), "defaultdict"),
        (MyDict(), "MyDict"),
        (torch.nn.Parameter(torch.eye(2).to_sparse()), "sparse Parameter"),
        (np.array([object()]), "object"),
        (np.zeros(2, "f4,i4"), "structured"),
    ],
)
def test_unsafe_values_are_refused_with_their_path(tmp_path, bad, kind):
    state = {"optim": {"param_groups": [{"lr": 0.1, "foo": bad}]}}
    path = tmp_path / "ck.lc"
    with pytest.raises((UnsafeObjectError, UnsupportedDtypeError)) as info:
        S.save(state, path)
    assert 'obj["optim"]["param_groups"][0]["foo"]' in str(info.value)
    assert kind in str(info.value)
    assert not path.exists() and list(tmp_path.iterdir()) == []


def test_other_refusals():
    with pytest.raises(UnsafeObjectError, match="dict keys"):
        S.save({object(): 1}, io.BytesIO())
    if torch.backends.mkldnn.is_available():
        with pytest.raises(UnsupportedDtypeError, match="layout"):
            S.save({"s": torch.eye(2).to_mkldnn()}, io.BytesIO())
    cyclic = []
    cyclic.append(cyclic)
    with pytest.raises(InvalidArgumentError, match="cyclic"):
        S.save(cyclic, io.BytesIO())
    od = collections.OrderedDict()
    od.extra = 1
    with pytest.raises(UnsafeObjectError, match="extra"):
        S.save(od, io.BytesIO())


# ---- what torch.load(weights_only=True) also opens: sets, complex, Counter, bytearray, sparse


def test_sets_complex_numbers_counters_and_bytearrays_round_trip():
    shared = bytearray(b"\x00buffer")
    obj = {
        "seen": {3, "a", (1, ("b", None)), -(2**70), 2.5, True},
        "frozen": frozenset({"x", 1}),
        "empty": set(),
        "c": [1 + 2j, complex(-0.0, float("inf")), complex(float("nan"), 0.0)],
        "counts": collections.Counter({"a": 3, "b": 1, 7: torch.ones(2)}),
        "buf": shared,
        "again": [shared],
        "bytes": b"plain",
    }
    back = round_trip(obj)
    assert_same(obj, back)
    assert back["buf"] is back["again"][0]          # one bytearray, as it was saved
    back["buf"][0] = 1                               # and a mutable one
    with_nan = round_trip({float("nan"), 1})         # unequal to itself, still one element
    assert len(with_nan) == 2 and math.isnan(max(with_nan, key=lambda x: x != x))
    meta = read_container(_saved({"s": {1}})).meta
    assert meta["lcckpt_tree"] == 4 and read_container(_saved({"d": [1]})).meta["lcckpt_tree"] == 1


def _saved(obj) -> io.BytesIO:
    f = io.BytesIO()
    S.save(obj, f)
    f.seek(0)
    return f


def test_a_set_saves_the_same_bytes_whatever_the_string_hashing(tmp_path):
    import subprocess
    import sys
    code = ("import lcckpt, sys; lcckpt.save({'s': {'w%d' % i for i in range(200)}, "
            "'f': frozenset(('a', 'b', ('c', 1)))}, sys.argv[1])")
    for seed in ("1", "2"):
        subprocess.run([sys.executable, "-c", code, str(tmp_path / seed)], check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed})
    assert (tmp_path / "1").read_bytes() == (tmp_path / "2").read_bytes()


def _sparse_examples():
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    d = torch.arange(24.0).reshape(4, 6) * (torch.arange(24).reshape(4, 6) % 3 == 0)
    return {
        "coo": torch.sparse_coo_tensor(i, torch.tensor([3.0, -0.0, float("nan")]), (2, 3)),
        "uncoalesced": torch.sparse_coo_tensor(torch.tensor([[0, 0], [1, 1]]),
                                               torch.tensor([1.0, 2.0]), (2, 2)),
        "hybrid": torch.sparse_coo_tensor(i, torch.randn(3, 4), (2, 3, 4)).coalesce(),
        "empty": torch.sparse_coo_tensor(torch.zeros(2, 0, dtype=torch.long), torch.zeros(0), (5, 5)),
        "ints": torch.tensor([[0, 2], [1, 0]]).to_sparse(),
        "complex": (d * 1j).to_sparse(),
        "grad": torch.eye(3).to_sparse().requires_grad_(True),
        "csr": d.to_sparse_csr(), "csc": d.to_sparse_csc(),
        "bsr": d.to_sparse_bsr((2, 3)), "bsc": d.to_sparse_bsc((2, 3)),
    }


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_tensors_round_trip_in_every_layout():
    obj = _sparse_examples()
    back = round_trip(obj)
    assert_same(obj, back)
    assert not back["uncoalesced"].is_coalesced() and back["hybrid"].is_coalesced()
    assert torch.equal(back["csr"].to_dense(), obj["csr"].to_dense())


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_tensors_in_a_chain(tmp_path):
    ck = lcckpt.DeltaCheckpointer(tmp_path)
    states = []
    for step in range(3):
        w = torch.randn(64, 64)
        sp = (w * (w > 1)).to_sparse()
        states.append({"w": w, "sp": sp, "csr": sp.to_sparse_csr(), "tags": {"run", step}})
        ck.save(step, states[-1])
    for step, state in enumerate(states):
        back = ck.load(step)
        assert back["tags"] == state["tags"]
        for k in ("sp", "csr"):      # their values are tracked like any tensor, within target
            assert back[k].layout == state[k].layout
            assert torch.equal(sparse_parts(back[k])[0], sparse_parts(state[k])[0])
            assert torch.allclose(back[k].to_dense(), state[k].to_dense(), rtol=0.05, atol=0.05)


def _tensor_section(name, t):
    meta = {"kind": "tensor", "dtype": lcckpt.codec.dtypes.TORCH_NAME[t.dtype],
            "shape": list(t.shape), "nbytes": t.numel() * t.element_size(), "codec": "raw",
            "device": "cpu"}
    return name, meta, t.contiguous().view(torch.uint8).numpy().tobytes()


_I = {"$": "tensor", "s": 0}
_V = {"$": "tensor", "s": 1}


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype")
def test_nested_and_quantized_tensors_round_trip():
    torch.manual_seed(0)
    lin = torch.ao.nn.quantized.Linear(4, 3)
    lin.set_weight_bias(torch.quantize_per_tensor(torch.randn(3, 4), 0.05, 0, torch.qint8),
                        torch.randn(3))
    obj = {
        "nested": torch.nested.nested_tensor([torch.ones(2, 3), torch.arange(12.0).reshape(4, 3)]),
        "jagged": torch.nested.nested_tensor([torch.ones(2, 3), torch.zeros(5, 3)], layout=torch.jagged),
        "q": torch.quantize_per_tensor(torch.randn(5), 0.1, 3, torch.qint8),
        "q32": torch.quantize_per_tensor(torch.randn(5), 0.5, -2, torch.qint32),
        "channels": torch.quantize_per_channel(torch.randn(3, 4), torch.tensor([0.1, 0.2, 0.3]),
                                               torch.tensor([0, 1, 2]), 0, torch.quint8),
        "float_qparams": torch.quantize_per_channel(
            torch.randn(4, 3), torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.5, 1.0, 2.0]), 1,
            torch.quint8),
        "linear": lin.state_dict(), "scheme": torch.per_channel_affine, "packed": torch.quint4x2,
    }
    back = round_trip(obj)
    for k in ("nested", "jagged"):
        assert back[k].layout == obj[k].layout and back[k].is_nested
        assert all(torch.equal(a, b) for a, b in zip(obj[k].unbind(), back[k].unbind()))
    for k in ("q", "q32", "channels", "float_qparams"):
        a, b = obj[k], back[k]
        assert (b.dtype, b.qscheme()) == (a.dtype, a.qscheme()) and torch.equal(a.int_repr(), b.int_repr())
        assert torch.equal(a.dequantize(), b.dequantize())
    again = torch.ao.nn.quantized.Linear(4, 3)
    again.load_state_dict(back["linear"])
    x = torch.quantize_per_tensor(torch.randn(2, 4), 0.1, 0, torch.quint8)
    assert torch.equal(lin(x).int_repr(), again(x).int_repr())
    assert back["scheme"] is torch.per_channel_affine and back["packed"] is torch.quint4x2


_Q = _I


@pytest.mark.parametrize(
    "node",
    [
        {"dtype": "quint8", "scheme": "per_tensor_affine", "int": _Q, "scale": 0.1, "zero_point": 0},
        {"dtype": "qint8", "scheme": "per_tensor_affine", "int": _Q, "scale": {"$": "float", "v": "nan"},
         "zero_point": 0},
        {"dtype": "qint8", "scheme": "per_tensor_affine", "int": _Q, "scale": 0.1, "zero_point": 1.5},
        {"dtype": "qint8", "scheme": "per_tensor_symmetric", "int": _Q, "scale": 0.1, "zero_point": 0},
        {"dtype": "qint9", "scheme": "per_tensor_affine", "int": _Q, "scale": 0.1, "zero_point": 0},
        {"dtype": "qint8", "scheme": "per_channel_affine", "int": _Q, "axis": 0,
         "scales": {"$": "tensor", "s": 1}, "zero_points": {"$": "tensor", "s": 1}},
        {"dtype": "qint8", "scheme": "per_channel_affine", "int": _Q, "axis": 5,
         "scales": {"$": "tensor", "s": 1}, "zero_points": {"$": "tensor", "s": 2}},
        {"dtype": "qint8", "scheme": "per_channel_affine", "int": _Q, "axis": 0,
         "scales": {"$": "tensor", "s": 3}, "zero_points": {"$": "tensor", "s": 2}},
    ],
)
def test_hostile_quantized_tensors_are_corrupt_data(node):
    secs = [_tensor_section("i", torch.tensor([[1, -2], [3, 4]], dtype=torch.int8)),
            _tensor_section("s", torch.tensor([0.1, 0.2], dtype=torch.float64)),
            _tensor_section("z", torch.tensor([0, 1])),
            _tensor_section("s3", torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64))]
    with pytest.raises(CorruptDataError, match="quantized|quantization|scale|integers|keys"):
        S.load(_file_with_tree({"$": "quantized", **node}, secs))


@pytest.mark.parametrize(
    "node",
    [
        {"layout": "ragged", "v": [_I]}, {"layout": "strided", "v": _I},
        {"layout": "strided", "v": [_I, _V]},                 # components of other dims
        {"layout": "strided", "v": [{"$": "bytes", "s": 2}]}, {"layout": "strided"},
    ],
)
def test_hostile_nested_tensors_are_corrupt_data(node):
    secs = [_tensor_section("i", torch.ones(2, 2)), _tensor_section("v", torch.ones(2)),
            ("b", {"kind": "bytes"}, b"xy")]
    with pytest.raises(CorruptDataError):
        S.load(_file_with_tree({"$": "nested", **node}, secs))




@pytest.mark.parametrize(
    "indices, node",
    [
        ([[0, 5], [0, 1]], {"size": [2, 2]}),                      # an index past the size
        ([[0, -1], [0, 1]], {"size": [2, 2]}),                     # a negative one
        ([[1, 0], [0, 1]], {"size": [2, 2], "coalesced": True}),   # not coalesced as it says
        ([[0, 1], [0, 1]], {"size": [2, -2]}),
        ([[0, 1], [0, 1]], {"size": [2, 2], "layout": "xyz"}),
        ([[0, 1], [0, 1]], {"size": [2, 2], "values": {"$": "bytes", "s": 2}}),
        ([[0, 1], [0, 1]], {"size": [2, 2], "grad": 1}),
        ([[0, 1], [0, 1]], {"size": [2, 2], "extra": 1}),
        ([[0, 1, 2]], {"size": [3, 3]}),                           # indices of the wrong rank
        ([[0, 1], [0, 1]], {"layout": "csr", "size": [2, 2], "compressed": _I, "plain": _I}),
    ],
)
def test_hostile_sparse_tensors_are_corrupt_data(indices, node):
    node = {"$": "sparse", "layout": "coo", "indices": _I, "values": _V, **node}
    if node["layout"] == "csr":
        del node["indices"]
    secs = [_tensor_section("i", torch.tensor(indices)), _tensor_section("v", torch.ones(2)),
            ("b", {"kind": "bytes"}, b"xy")]
    with pytest.raises(CorruptDataError):
        S.load(_file_with_tree(node, secs))


@pytest.mark.parametrize(
    "tree",
    [
        {"$": "set", "v": [1, 1]}, {"$": "set", "v": [{"$": "tensor", "s": 0}]},
        {"$": "set", "v": [[1]]}, {"$": "set", "v": 1}, {"$": "set", "v": [], "frozen": 1},
        {"$": "complex", "re": 1, "im": 2.0}, {"$": "complex", "re": 1.0},
        {"$": "complex", "re": "1", "im": 2.0}, {"$": "bytes", "s": 0, "mutable": 1},
        {"$": "counter", "items": [["a", 1], ["a", 2]]}, {"$": "counter", "items": 1},
    ],
)  # fmt: skip
def test_hostile_sets_complex_numbers_and_counters_are_corrupt_data(tree):
    with pytest.raises(CorruptDataError):
        S.load(_file_with_tree(tree, [("b", {"kind": "bytes"}, b"xy")]))


# ---- torch.save files and unsafe pickles


def test_reads_torch_save_files_exactly(tmp_path):
    model = _cnn()
    opt = torch.optim.Adam(model.parameters())
    _train(model, opt, 2)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    for legacy in (False, True):
        path = tmp_path / f"ck{legacy}.pt"
        torch.save(state, path, _use_new_zipfile_serialization=not legacy)
        assert_same(state, S.load(path))
        with open(path, "rb") as f:
            assert_same(state, S.load(f, map_location="cpu"))


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def test_malicious_pickles_are_refused_and_never_run(tmp_path):
    # the payload is real: plain pickle runs it
    proof = tmp_path / "proof"
    pickle.loads(pickle.dumps(Evil(str(proof))))
    assert proof.exists()

    marker = tmp_path / "pwned"
    zipped, plain = tmp_path / "evil.pt", tmp_path / "evil.pkl"
    torch.save({"w": torch.ones(2), "x": Evil(str(marker))}, zipped)
    plain.write_bytes(pickle.dumps({"x": Evil(str(marker))}, protocol=2))
    for path in (zipped, plain):
        with pytest.raises(UnsafeObjectError, match="trust"):
            S.load(path)
        with open(path, "rb") as f, pytest.raises(UnsafeObjectError):
            S.load(f)
    assert not marker.exists()


def test_a_refused_torch_file_names_what_needs_code(tmp_path):
    """lcckpt.load said only torch's banner ("Weights only load failed. ..."), cut short
    and with terminal escapes; the command line named the object. Both name it now, and
    a whole module saved with torch.save(model) is told to save its state_dict()."""
    torch.save(torch.nn.Sequential(torch.nn.Linear(2, 2)), tmp_path / "whole.pt")
    torch.save({"w": torch.ones(2), "x": Evil(str(tmp_path / "never"))}, tmp_path / "evil.pt")
    with pytest.raises(UnsafeObjectError) as e:
        S.load(tmp_path / "whole.pt")
    assert "whole.pt: " in str(e.value) and "torch.nn.modules.container.Sequential" in str(e.value)
    assert "save model.state_dict()" in str(e.value) and "\x1b" not in str(e.value)
    with pytest.raises(UnsafeObjectError, match=r"\(it needs exec\)") as e:   # its __reduce__
        S.load(tmp_path / "evil.pt")
    assert "state_dict" not in str(e.value)
    assert not (tmp_path / "never").exists()


def test_damaged_torch_file_is_corrupt_data(tmp_path):
    path = tmp_path / "x.pt"
    torch.save({"w": torch.ones(100)}, path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CorruptDataError):
        S.load(path)


# ---- files, streams, map_location


def test_path_and_stream_targets(tmp_path):
    obj = {"w": torch.randn(5)}
    path = tmp_path / "a.lc"
    S.save(obj, str(path))
    assert_same(obj, S.load(str(path)))
    with open(tmp_path / "b.lc", "wb") as f:
        S.save(obj, f)
    with open(tmp_path / "b.lc", "rb") as f:
        assert_same(obj, S.load(f))

    assert_same(obj, S.load(NonSeekableStream(path.read_bytes())))
    with pytest.raises(InvalidArgumentError):
        S.load(12)


def _with_device(obj, device):
    """A saved file whose tensors claim to come from ``device``."""
    meta, sections = S.pack(obj)
    sections = [(n, {**m, "device": device}, d) for n, m, d in sections]
    f = io.BytesIO()
    write_container(f, sections, meta)
    return f.getvalue()


def test_map_location_forms():
    obj = {"w": torch.randn(4), "v": torch.arange(3)}
    raw = _with_device(obj, "cuda:1")
    for ml in ("cpu", torch.device("cpu"), {"cuda:1": "cpu"}, {"cuda:1": torch.device("cpu")}):
        assert_same(obj, S.load(io.BytesIO(raw), map_location=ml))
    seen = []

    def fn(storage, loc):
        seen.append(loc)
        return storage

    assert_same(obj, S.load(io.BytesIO(raw), map_location=fn))
    assert seen == ["cuda:1", "cuda:1"]
    assert_same(obj, S.load(io.BytesIO(round_trip_bytes(obj)), map_location=lambda s, loc: None))
    if not torch.cuda.is_available():
        with pytest.raises(InvalidArgumentError, match="map_location"):
            S.load(io.BytesIO(raw))
        with pytest.raises(InvalidArgumentError):
            S.load(io.BytesIO(raw), map_location={"cuda:0": "cpu"})
    with pytest.raises(InvalidArgumentError):
        S.load(io.BytesIO(raw), map_location=3)


def round_trip_bytes(obj):
    f = io.BytesIO()
    S.save(obj, f)
    return f.getvalue()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_tensors_round_trip():
    obj = {"g": torch.randn(3, device="cuda"), "c": torch.randn(2)}
    out = S.load(io.BytesIO(round_trip_bytes(obj)))
    assert out["g"].device == obj["g"].device and torch.equal(out["g"], obj["g"])
    out = S.load(io.BytesIO(round_trip_bytes(obj)), map_location="cpu")
    assert out["g"].device.type == "cpu" and torch.equal(out["g"], obj["g"].cpu())


# ---- codec hook


@pytest.fixture
def zlib_codec(monkeypatch):
    monkeypatch.setattr(sections, "_registered", dict(sections._registered))

    def encode(t):
        return zlib.compress(t.numpy().tobytes()), {"level": 6}

    def decode(data, meta):
        return np.frombuffer(zlib.decompress(data), np.float32).reshape(meta["shape"])

    S.register_codec("test-zlib", encode, decode, dtypes=[torch.float32])
    return "test-zlib"


def test_registered_codec_is_used_and_recorded(zlib_codec):
    obj = {"w": torch.zeros(1000), "i": torch.arange(5), "s": torch.tensor(1.5)}
    raw = round_trip_bytes_with(obj, codec=zlib_codec)
    with read_container(raw) as c:
        metas = {s["name"]: s["meta"] for s in c.sections}
    assert metas['obj["w"]']["codec"] == "test-zlib"
    assert metas['obj["w"]']["codec_params"] == {"level": 6}
    assert metas['obj["w"]']["nbytes"] == 4000 and len(raw) < 4000
    assert metas['obj["i"]']["codec"] == "raw"  # dtype not handled by the codec
    assert_same(obj, S.load(io.BytesIO(raw)))

    chosen = round_trip_bytes_with(obj, codec=lambda path, t: zlib_codec if path.endswith('["s"]') else "raw")
    with read_container(chosen) as c:
        assert [s["meta"]["codec"] for s in c.sections] == ["raw", "raw", "test-zlib"]
    assert_same(obj, S.load(io.BytesIO(chosen)))

    # a file needing a codec this build lacks
    del sections._registered[zlib_codec]
    with pytest.raises(UnsupportedVersionError, match="test-zlib"):
        S.load(io.BytesIO(raw))


def round_trip_bytes_with(obj, **kw):
    f = io.BytesIO()
    S.save(obj, f, **kw)
    return f.getvalue()


def test_misbehaving_codecs(monkeypatch):
    monkeypatch.setattr(sections, "_registered", dict(sections._registered))
    S.register_codec("bad-shape", lambda t: b"", lambda d, m: np.zeros(3, np.float32))
    S.register_codec("raises", lambda t: b"", lambda d, m: 1 / 0)
    for name in ("bad-shape", "raises"):
        raw = round_trip_bytes_with({"w": torch.zeros(2)}, codec=name)
        with pytest.raises(CorruptDataError, match=name):
            S.load(io.BytesIO(raw))
    with pytest.raises(CorruptDataError, match=r"returned a torch.float32 \[3\] tensor, not a "
                       r"torch.float32 \[2\] tensor"):      # what it gave, not only its type
        S.load(io.BytesIO(round_trip_bytes_with({"w": torch.zeros(2)}, codec="bad-shape")))
    with pytest.raises(InvalidArgumentError):
        S.register_codec("raises", lambda t: b"", lambda d, m: None)
    with pytest.raises(InvalidArgumentError):
        S.register_codec("raw", lambda t: b"", lambda d, m: None, replace=True)
    with pytest.raises(InvalidArgumentError):
        S.register_codec("bad name!", lambda t: b"", lambda d, m: None)
    with pytest.raises(InvalidArgumentError, match="unknown codec"):
        S.save({}, io.BytesIO(), codec="nope")
    with pytest.raises(InvalidArgumentError, match="not registered"):
        S.save({"w": torch.zeros(1)}, io.BytesIO(), codec=lambda p, t: "nope")


# ---- hostile trees (valid checksums, invalid content)


def _deep(n):
    tree = []
    for _ in range(n):
        tree = [tree]
    return tree


def _file_with_tree(tree, sections=()):
    f = io.BytesIO()
    write_container(f, list(sections), {"lcckpt_tree": 1, "tree": tree})
    f.seek(0)
    return f


@pytest.mark.parametrize(
    "tree",
    [
        {"$": "nope"}, {"$": "tuple"}, {"$": "tuple", "v": 1}, {"$": "int", "hex": "12"},
        {"$": "float", "v": "1.0"}, {"$": "dict", "items": [[1]]}, {"$": "dict", "items": [[[], 1]]},
        {"$": "dict", "items": [["a", 1], ["a", 2]]}, {"$": "tensor", "s": 0}, {"$": "bytes", "s": -1},
        {"$": "dtype", "v": "F33"}, {"$": "size", "v": ["a"]}, {"$": "device", "v": "nowhere:7"},
        {"$": "npscalar", "dtype": "F32", "hex": "00"}, {"$": "dict", "items": [], "extra": 1},
        {"no": "tag"}, _deep(200), {"$": "dict", "items": [[_deep_key(100), 1]]},
    ],
)  # fmt: skip
def test_hostile_trees_are_corrupt_data(tree):
    with pytest.raises(CorruptDataError):
        S.load(_file_with_tree(tree))


@pytest.mark.parametrize(
    "meta",
    [
        {"kind": "bytes"},
        {"kind": "tensor", "dtype": "F99", "shape": [1], "nbytes": 4, "codec": "raw"},
        {"kind": "tensor", "dtype": "F32", "shape": [-1], "nbytes": 4, "codec": "raw"},
        {"kind": "tensor", "dtype": "F32", "shape": [2], "nbytes": 4, "codec": "raw"},
        {"kind": "tensor", "dtype": "F32", "shape": [2**40], "nbytes": 2**42, "codec": "raw"},
        {"kind": "tensor", "dtype": "F32", "shape": [1], "nbytes": 4, "codec": "raw", "codec_params": []},
    ],
)
def test_hostile_tensor_sections(meta):
    with pytest.raises(CorruptDataError):
        S.load(_file_with_tree({"$": "tensor", "s": 0}, [("t", meta, b"\0\0\0\0")]))


_TAGS = ["int", "float", "tuple", "dict", "odict", "tensor", "ndarray", "bytes", "npscalar",
         "dtype", "size", "device", "set", "complex", "counter", "sparse", "nested",
         "quantized", "qscheme", "namespace", "defaultdict", "datetime", "date", "time",
         "timedelta", "path", "deque", "range", "slice", "ellipsis", "fraction", "decimal",
         "uuid", "npdtype", "nope"]  # fmt: skip
_FIELDS = ["$", "v", "items", "s", "obj", "hex", "dtype", "metadata", "frozen", "re", "im",
           "mutable", "layout", "size", "indices", "values", "compressed", "plain", "coalesced",
           "scheme", "scale", "zero_point", "scales", "zero_points", "axis", "int", "factory",
           "fold", "utcoffset", "tzname", "flavour", "pure", "maxlen", "type"]
_json_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 2**70), st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(_TAGS + ["F32", "U8", "0x1f", "00", "cpu", "nan", "coo", "csr", "qint8",
                             "per_tensor_affine", "jagged", "list", "posix", "windows",
                             "<U1", ">f4", "<M8[D]"]),
    st.text(max_size=4),
)  # fmt: skip
_json = st.recursive(
    _json_leaves,
    lambda kids: st.one_of(
        st.lists(kids, max_size=3),
        st.dictionaries(st.sampled_from(_FIELDS), kids, max_size=3),
        st.builds(lambda tag, rest: {**rest, "$": tag}, st.sampled_from(_TAGS),
                  st.dictionaries(st.sampled_from(_FIELDS[1:]), kids, max_size=3)),
    ),
    max_leaves=12,
)


_VALID_META = {"kind": "tensor", "dtype": "F32", "shape": [1], "nbytes": 4, "codec": "raw",
               "device": "cpu", "codec_params": {}}  # fmt: skip
_section_meta = st.fixed_dictionaries(
    {},
    optional={k: st.one_of(st.just(v), _json) for k, v in _VALID_META.items()},
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_json, _section_meta)
def test_arbitrary_trees_load_or_raise_lcckpt_errors(tree, meta):
    sections = [
        ("t", meta, b"\0" * 4),
        ("b", {"kind": "bytes"}, b"xy"),
        ("a", {"kind": "ndarray", "dtype": "U8", "shape": [2], "nbytes": 2, "codec": "raw"}, b"ab"),
        ("u", {"kind": "ndarray", "dtype": "<U1", "shape": [1], "nbytes": 4, "codec": "raw"},
         b"a\0\0\0"),
    ]
    try:
        S.load(_file_with_tree(tree, sections))
    except (CorruptDataError, UnsupportedVersionError, ResourceLimitError):
        pass                             # a meta's nbytes past the limit is refused cleanly


def test_not_a_saved_object():
    f = io.BytesIO()
    write_container(f, [], {"something": "else"})
    f.seek(0)
    with pytest.raises(CorruptDataError, match="no saved object"):
        S.load(f)
    f = io.BytesIO()
    write_container(f, [], {"lcckpt_tree": 99, "tree": None})
    f.seek(0)
    with pytest.raises(UnsupportedVersionError):
        S.load(f)


# ---- property tests

_keys = st.one_of(st.text(max_size=5), st.integers(-(2**70), 2**70))
_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**80), 2**80), st.floats(allow_nan=True),
    st.text(max_size=10), st.binary(max_size=20), st.binary(max_size=5).map(bytearray),
    st.complex_numbers(allow_nan=True), st.frozensets(_keys, max_size=4).map(set),
    st.frozensets(_keys, max_size=3), st.datetimes(), st.dates(), st.times(), st.timedeltas(),
    st.datetimes(timezones=st.timedeltas(min_value=datetime.timedelta(hours=-23),
                                         max_value=datetime.timedelta(hours=23))
                 .map(datetime.timezone)),
    st.text(max_size=8).map(pathlib.PurePosixPath), st.text(max_size=8).map(pathlib.PureWindowsPath),
)  # fmt: skip
_trees = st.recursive(
    _leaves,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.lists(kids, max_size=4).map(tuple),
        st.dictionaries(_keys, kids, max_size=4),
        st.dictionaries(_keys, kids, max_size=4).map(lambda d: collections.OrderedDict(reversed(d.items()))),
        st.dictionaries(_keys, kids, max_size=3).map(collections.Counter),
        st.dictionaries(_keys, kids, max_size=3).map(lambda d: collections.defaultdict(list, d)),
        st.dictionaries(st.text(max_size=5), kids, max_size=3).map(lambda d: argparse.Namespace(**d)),
    ),
    max_leaves=20,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_trees)
def test_random_trees_round_trip(obj):
    assert_same(obj, round_trip(obj))


_dtypes = st.sampled_from(list(lcckpt.codec.dtypes.TORCH_NAME))


@st.composite
def _tensors(draw):
    dtype = draw(_dtypes)
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    size = dtype.itemsize
    n = math.prod(shape) * size
    raw = torch.tensor(list(draw(st.binary(min_size=n, max_size=n))), dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw % 2
    t = raw.view(dtype).reshape(shape)
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.transpose(0, 1)
    return t


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_tensors(), max_size=4))
def test_random_tensors_round_trip(tensors):
    obj = {str(i): t for i, t in enumerate(tensors)}
    out = round_trip(obj)
    for k, t in obj.items():
        assert out[k].stride() == t.stride() or t.numel() == 0, k
        assert_same(t.contiguous(), out[k].contiguous(), k)


def test_save_never_writes_a_partial_file_on_refusal(tmp_path):
    path = tmp_path / "ck.lc"
    S.save({"w": torch.ones(2)}, path)
    before = path.read_bytes()
    with pytest.raises(UnsafeObjectError):
        S.save({"w": torch.ones(2), "bad": object()}, path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["ck.lc"]


def test_saving_a_module_suggests_its_state_dict(tmp_path):
    with pytest.raises(lcckpt.UnsafeObjectError, match=r"obj.state_dict\(\) instead"):
        lcckpt.save(torch.nn.Linear(2, 2), tmp_path / "m.lcc")


def test_a_delta_file_loads_as_its_step_only_in_its_chain_directory(tmp_path):
    """By its path, in the directory it was written to, a chain's delta file loads (and
    opens lazily) as its step; alone (a copy, a file object, ``follow=False``) it says
    where its chain must be."""
    ck = lcckpt.DeltaCheckpointer(tmp_path / "c")
    ck.save(0, {"w": torch.randn(10_000)})
    ck.save(1, {"w": torch.randn(10_000)})
    ck.close()
    step = ck.load(1)
    got = lcckpt.load(ck.path(1))
    assert torch.equal(got["w"], step["w"])
    into = {"w": torch.empty(10_000)}
    lcckpt.load(ck.path(1), into=into)
    assert torch.equal(into["w"], step["w"])
    with lcckpt.open(ck.path(1)) as f:
        assert torch.equal(f.get_tensor("w"), step["w"])
        assert torch.equal(f.get_slice("w")[5:9], step["w"][5:9])
    lone = tmp_path / "lone.lcc"
    lone.write_bytes(open(ck.path(1), "rb").read())
    for read in (lambda: lcckpt.load(lone), lambda: lcckpt.open(lone)):
        with pytest.raises(lcckpt.BrokenChainError, match="not its chain directory's"):
            read()
    with open(ck.path(1), "rb") as f, \
            pytest.raises(lcckpt.BrokenChainError, match="DeltaCheckpointer chain"):
        lcckpt.load(f)
    with pytest.raises(lcckpt.BrokenChainError, match="DeltaCheckpointer chain"):
        lcckpt.load(ck.path(1), follow=False)
    assert lcckpt.load(ck.path(0))["w"].numel() == 10_000     # a keyframe loads alone


def test_register_section_codec_is_the_name_and_register_codec_its_alias():
    """Not to be confused with numcodecs' own register_codec."""
    import lcckpt
    assert lcckpt.register_codec is lcckpt.register_section_codec


def test_loaded_tensors_are_freed_with_their_last_reference(tmp_path):
    """A load leaves no reference cycle holding what it decoded: with the garbage collector
    off (as between its runs), a restored state's memory is given back as soon as the
    user drops it, not at the next collection. (A loader that kept a table of its own
    bound methods held every tensor of a 245 MB state until then.)"""
    import gc
    import weakref
    state = {"w": torch.randn(64, 64), "opt": {"m": torch.randn(64, 64)}, "n": 3}
    lcckpt.save(state, tmp_path / "a.lcc")
    ck = lcckpt.DeltaCheckpointer(tmp_path / "chain")
    ck.save(0, state)
    ck.save(1, {**state, "w": state["w"] + 0.01})
    ck.close()
    reader = lcckpt.DeltaCheckpointer(tmp_path / "chain")
    loads = {"load": lambda: lcckpt.load(tmp_path / "a.lcc"),
             "keyframe": lambda: reader.load(0), "delta": lambda: reader.load(1),
             "get_tensor": lambda: {"w": lcckpt.open(tmp_path / "a.lcc").get_tensor("w")}}
    gc.collect()
    gc.disable()
    try:
        for name, fn in loads.items():
            obj = fn()
            ref = weakref.ref(obj["w"])
            del obj
            assert ref() is None, f"{name}: the loaded tensor outlived its last reference"
    finally:
        gc.enable()


# ------------------------------------------------------------------ loading into tensors


@pytest.mark.parametrize("compress", [False, True])
def test_load_into_fills_the_callers_tensors_with_the_bits_of_a_plain_load(
        tmp_path, monkeypatch, compress):
    """lcckpt.load(into=...) returns the target tensors where they fit (a raw section
    read into one, a large lossless one decoded into it: no fresh tensor of that size),
    holding what a plain load gives; a target of another shape or dtype is left alone."""
    g = torch.Generator().manual_seed(0)
    big = torch.randn(3_000_000, generator=g)            # ~11 MB: streamed when coded
    state = {"model": {"w": big.reshape(3000, 1000), "b": torch.randn(1000, generator=g),
                       "h": torch.randn(4000, generator=g).bfloat16(),
                       "n": torch.arange(7)},
             "other": torch.ones(3), "step": 5}
    path = tmp_path / "ck.lcc"
    lcckpt.save(state, path, compress=compress)
    plain = lcckpt.load(path)
    model = {k: torch.zeros_like(v) for k, v in state["model"].items()}
    model["b"] = torch.zeros(999)                        # another shape: not used
    targets = dict(model)
    made = []
    real = torch.empty

    def recording(*shape, **kw):
        made.append(tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int)
                    else shape)
        return real(*shape, **kw)
    monkeypatch.setattr(torch, "empty", recording)
    with pytest.warns(RuntimeWarning, match=r'2 target tensors were left .*obj\["model"\]\["b"\] '
                      r'\(the stored tensor is float32\[1000\], the target float32\[999\]\)'):
        got = lcckpt.load(path, into={"model": model, "other": torch.zeros(3, dtype=torch.int8)})
    monkeypatch.setattr(torch, "empty", real)
    assert_same(got, plain)
    for k in state["model"]:
        assert (got["model"][k] is targets[k]) == (k != "b"), k
    assert torch.equal(targets["b"], torch.zeros(999))
    assert (3000, 1000) not in made


@pytest.mark.parametrize("compress", [False, True])
def test_load_into_fills_targets_whose_tensors_are_views_of_a_shared_storage(
        tmp_path, compress):
    """A weight the object also holds as a transposed view or a slice is stored as one
    storage section of another shape; its target is still filled (a copy), and so are a
    non-contiguous target and a target of its own at a second place of the same tensor.
    Before, those targets kept their old values."""
    g = torch.Generator().manual_seed(1)
    w, c = torch.randn(30, 40, generator=g), torch.randn(4, 3, 3, 3, generator=g)
    state = {"model": {"w": w, "conv": c.to(memory_format=torch.channels_last)},
             "t": w.t(), "rows": w[5:9], "again": w}
    path = tmp_path / "ck.lcc"
    lcckpt.save(state, path, compress=compress)
    plain = lcckpt.load(path)
    model = {"w": torch.zeros(30, 40), "conv": torch.zeros(4, 3, 3, 3).to(
        memory_format=torch.channels_last)}
    rows, again = torch.zeros(4, 40), torch.zeros(30, 40)
    got = lcckpt.load(path, into={"model": dict(model), "rows": rows, "again": again})
    assert_same(got, plain)
    assert got["model"]["w"] is model["w"] and torch.equal(model["w"], w)
    assert got["again"] is again and torch.equal(again, w)     # the same object, met again
    assert got["model"]["conv"] is model["conv"] and torch.equal(model["conv"], c)
    assert got["rows"] is rows and torch.equal(rows, w[5:9])
    assert torch.equal(got["t"], w.t())


_INTO_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool,
                torch.uint8, torch.complex64]


@st.composite
def _into_case(draw):
    """A state of fresh tensors, views of them and repeats, and ``into`` targets for
    some of its keys: fitting (contiguous or not), or of another shape or dtype."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    state, made = {}, []
    for i in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["fresh", "fresh", "view", "again"])) if made else "fresh"
        if kind == "fresh":
            dt = draw(st.sampled_from(_INTO_DTYPES))
            shape = tuple(draw(st.lists(st.integers(0, 40), max_size=3)))
            t = (torch.randn(shape, generator=g) * 50).to(dt)
            made.append(t)
        else:
            base = made[draw(st.integers(0, len(made) - 1))]
            t = base
            if kind == "view" and base.dim() == 2:
                t = base.t() if draw(st.booleans()) else base[draw(st.integers(0, base.shape[0])):]
            elif kind == "view" and base.dim() >= 1:
                t = base[draw(st.integers(0, base.shape[0])):]
        state[f"k{i}"] = t
    targets, fits = {}, {}
    for k, t in state.items():
        how = draw(st.sampled_from(["none", "fit", "fit", "strided", "shape", "dtype"]))
        if how == "none":
            continue
        if how == "strided" and t.dim() == 2:
            target = torch.empty(t.shape[::-1], dtype=t.dtype).t()      # not contiguous
        elif how == "shape":
            target = torch.empty(t.numel() + 1, dtype=t.dtype)
        elif how == "dtype":
            target = torch.empty(t.shape, dtype=torch.int8 if t.dtype != torch.int8 else torch.int16)
        else:
            target = torch.empty(t.shape, dtype=t.dtype)
        target.fill_(7)                     # a sentinel no stored tensor holds everywhere
        targets[k], fits[k] = target, how in ("fit", "strided")
    return state, targets, fits


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_into_case(), st.booleans())
def test_load_into_fills_every_fitting_target_and_nothing_else(tmp_path_factory, case, compress):
    """Property: ``load(into=...)`` returns what a plain load returns, bit for bit; every
    host target of a stored tensor's dtype and shape (contiguous or not, whether the
    stored tensor is a view, a repeat of another key's tensor or its own) holds those
    values and is the very tensor returned there; targets of another shape or dtype are
    left alone."""
    state, targets, fits = case
    path = tmp_path_factory.mktemp("into") / "x.lcc"
    lcckpt.save(state, path, compress=compress)
    _check_into(lambda into: lcckpt.load(path, into=into), lcckpt.load(path), state,
                targets, fits)


def _check_into(load, plain, want, targets, fits):
    """``load(into)`` gives ``plain`` bit for bit; each fitting target is returned and
    holds ``want``'s values, the others are untouched, and the warning names those."""
    before = {k: t.clone() for k, t in targets.items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = load(dict(targets))
    _named_the_unfilled(caught, targets, fits)
    for k in plain:
        assert torch.equal(got[k], plain[k]) and got[k].dtype == plain[k].dtype, k
    for k, target in targets.items():
        if fits[k]:
            assert got[k] is target and torch.equal(target, want[k]), k
        else:
            assert torch.equal(target.view(-1), before[k].view(-1)), k


def _named_the_unfilled(caught, targets, fits):
    """One warning, naming the targets that received nothing (empty ones aside), or none."""
    missed = {f'obj["{k}"]' for k, t in targets.items() if not fits[k] and t.numel()}
    said = [str(w.message) for w in caught if "into=" in str(w.message)]
    if not missed:
        assert said == []
        return
    head = "1 target tensor was" if len(missed) == 1 else f"{len(missed)} target tensors were"
    assert len(said) == 1 and said[0].startswith(f"into=: {head} left as")
    named = set(re.findall(r'obj\["k\d+"\]', said[0]))
    assert named and named <= missed


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_into_case())
def test_a_chain_loads_into_every_fitting_target_and_nothing_else(tmp_path_factory, case):
    """The same property for ``DeltaCheckpointer.load(into=...)`` of a delta step (tracked
    tensors, packs of small ones, views and repeats), against its plain load."""
    state, targets, fits = case
    ck = lcckpt.DeltaCheckpointer(tmp_path_factory.mktemp("chain"))
    ck.save(0, state)
    with torch.no_grad():
        for t in state.values():
            if t.is_floating_point() and t._base is None:
                t.add_(0.01)                 # views and repeats follow their storage
    ck.save(1, state)
    plain = ck.load(1)
    _check_into(lambda into: ck.load(1, into=into), plain, plain, targets, fits)


@pytest.mark.parametrize("fmt", ["lcckpt", "torch", "safetensors"])
def test_load_into_fills_from_every_format_and_warns_of_a_misshapen_into(tmp_path, fmt):
    """``into=model.state_dict()`` where the file holds ``{"model": ...}`` fills nothing:
    the warning names the targets, where the model silently kept its old values before.
    A torch.save or safetensors file fills the targets too (with a copy), where ``into``
    was ignored."""
    m = torch.nn.Linear(6, 3)
    state = {"model": m.state_dict()}
    path = tmp_path / f"ck.{ {'lcckpt': 'lcc', 'torch': 'pt'}.get(fmt, fmt) }"
    if fmt == "lcckpt":
        lcckpt.save(state, path)
    elif fmt == "torch":
        torch.save(state, path)
    else:
        from lcckpt.format.safetensors_io import save_safetensors
        save_safetensors({"weight": m.weight.detach(), "bias": m.bias.detach()}, path)
    fresh = torch.nn.Linear(6, 3)
    right = {"model": fresh.state_dict()} if fmt != "safetensors" else fresh.state_dict()
    wrong = {"net": fresh.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lcckpt.load(path, into=right)
    assert torch.equal(fresh.weight, m.weight) and torch.equal(fresh.bias, m.bias)
    with torch.no_grad():
        fresh.weight.zero_()
    with pytest.warns(RuntimeWarning, match=r'2 target tensors were left as they were.*'
                      r'obj\["net"\]\["weight"\] \(no dense tensor is stored at this place\)') \
            as seen:
        lcckpt.load(path, into=wrong)
    assert not fresh.weight.any()
    assert [w.filename for w in seen] == [__file__]          # the caller's line


def test_into_holding_a_module_or_an_optimizer_is_refused_by_its_place(tmp_path):
    """A module, an optimizer or anything else with a ``state_dict`` inside ``into``
    (or no container at all) was passed by without a word: its tensors were never
    reached, so nothing was filled and nothing warned."""
    m = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(m.parameters(), 0.1)
    lcckpt.save({"model": m.state_dict()}, tmp_path / "a.lcc")
    ck = lcckpt.DeltaCheckpointer(tmp_path / "c")
    ck.save(0, {"model": m.state_dict()})
    fresh = torch.nn.Linear(6, 3)
    for load in (lambda into: lcckpt.load(tmp_path / "a.lcc", into=into),
                 lambda into: ck.load(into=into)):
        for into, where in ((fresh, r"into is a torch\.nn\.modules\.linear\.Linear object"),
                            ({"model": fresh}, r'into\["model"\] is a torch.*Linear object'),
                            ({"model": fresh.state_dict(), "o": opt},
                             r'into\["o"\] is a torch\.optim\.sgd\.SGD object')):
            with pytest.raises(InvalidArgumentError, match=where + r".*state_dict\(\)"):
                load(into)
        with pytest.raises(InvalidArgumentError, match="shaped like the stored object, got "
                           "builtins.int"):
            load(3)
        assert not torch.equal(fresh.weight, m.weight)
        load({"model": fresh.state_dict()})
        assert torch.equal(fresh.weight, m.weight)
        with torch.no_grad():
            fresh.weight.zero_()


def test_a_text_mode_file_or_another_object_is_refused_by_name(tmp_path):
    """A file opened without 'b' raised a TypeError from inside the writer, or a
    UnicodeDecodeError from the reader."""
    lcckpt.save({"w": torch.ones(3)}, tmp_path / "ok.lcc")
    with open(tmp_path / "t.lcc", "w") as f, \
            pytest.raises(InvalidArgumentError, match="got a text-mode file: open the file with 'wb'"):
        lcckpt.save({"w": torch.ones(3)}, f)
    with open(tmp_path / "ok.lcc") as f, \
            pytest.raises(InvalidArgumentError, match="got a text-mode file: open the file with 'rb'"):
        lcckpt.load(f)
    with pytest.raises(InvalidArgumentError, match="an object of type int"):
        lcckpt.save({"w": torch.ones(3)}, 3)
    with open(tmp_path / "ok.lcc") as f, \
            pytest.raises(InvalidArgumentError, match="text-mode file: open it with 'rb'"):
        lcckpt.read_metadata(f)
    (tmp_path / "g.bin").write_bytes(b"GARBAGE, NOT A CHECKPOINT")
    with pytest.raises(CorruptDataError, match="g.bin: not a checkpoint lcckpt knows: expected "
                       "an lcckpt, torch.save or safetensors file, found bytes b'GARBAGE,'"):
        lcckpt.load(tmp_path / "g.bin")


def test_load_into_and_mmap_exclude_each_other(tmp_path):
    lcckpt.save({"w": torch.ones(3)}, tmp_path / "a.lcc")
    with pytest.raises(InvalidArgumentError, match="into= and mmap"):
        lcckpt.load(tmp_path / "a.lcc", into={"w": torch.zeros(3)}, mmap=True)


def test_a_target_given_twice_receives_one_tensor_only(tmp_path):
    """Two stored tensors, one target given at both places: the first fills it, the
    second loads on its own (filling it too would change what the first returned)."""
    a, b = torch.arange(6.0), torch.arange(6.0) + 100
    lcckpt.save({"a": a, "b": b}, tmp_path / "f.lcc")
    t = torch.zeros(6)
    got = lcckpt.load(tmp_path / "f.lcc", into={"a": t, "b": t})
    assert got["a"] is t and got["b"] is not t
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)


@pytest.mark.parametrize("compress", [False, True])
def test_an_expanded_target_is_left_with_a_warning_that_says_why(tmp_path, compress):
    """A target whose elements share memory (``expand()``) cannot take the values: the
    load returns them beside it and says so, where torch's copy raised."""
    a = torch.randn(4, 3)
    lcckpt.save({"a": a}, tmp_path / "f.lcc", compress=compress)
    t = torch.zeros(3).expand(4, 3)
    with pytest.warns(RuntimeWarning, match=r"share memory \(expand\(\)-ed\): clone\(\) it"):
        got = lcckpt.load(tmp_path / "f.lcc", into={"a": t})
    assert got["a"] is not t and torch.equal(got["a"], a) and not t.any()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs and Unix sockets")
@pytest.mark.parametrize("kind", ["FIFO", "socket"])
def test_a_target_that_is_no_regular_file_is_refused_and_left_in_place(tmp_path, kind):
    """A save renames a temp file over its target: given /dev/full (run as root) it
    replaced the device with a regular file. Every writer that renames (lcckpt.save,
    save_safetensors, convert to torch.save) now refuses any target that is not a
    regular file, before it writes; the test uses a FIFO and a socket of its own."""
    import socket
    import stat
    target = tmp_path / "target"
    if kind == "FIFO":
        os.mkfifo(target)
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(target))
    is_kind = stat.S_ISFIFO if kind == "FIFO" else stat.S_ISSOCK
    torch.save({"w": torch.ones(3)}, tmp_path / "src.pt")
    writes = [lambda: lcckpt.save({"w": torch.ones(3)}, target),
              lambda: lcckpt.save_safetensors({"w": torch.ones(3)}, target),
              lambda: lcckpt.convert(tmp_path / "src.pt", target, to="torch")]
    for write in writes:
        with pytest.raises(lcckpt.StorageError, match=f"that is a {kind}, not a file"):
            write()
        assert is_kind(os.lstat(target).st_mode)
    assert sorted(os.listdir(tmp_path)) == ["src.pt", "target"]      # no temp file left
    if kind == "socket":
        sock.close()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("fmt", ["lcckpt", "compressed", "torch", "safetensors"])
def test_a_path_that_is_a_pipe_loads_as_a_stream(tmp_path, fmt):
    """``lcckpt.load("/dev/stdin")`` fed by a pipe: the format sniffing read the pipe's
    first bytes, then the load failed with a bare "Illegal seek" (a safetensors file was
    called damaged). A pipe is now read once, as a file object is; a lazy open of one is
    refused by name (it needs reads at any offset)."""
    import threading
    state = {"w": torch.randn(50, 20), "b": torch.arange(7.0)}
    src = tmp_path / "src"
    if fmt == "torch":
        torch.save(state, src)
    elif fmt == "safetensors":
        lcckpt.save_safetensors(state, src)
    else:
        lcckpt.save(state, src, compress=fmt == "compressed")
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    out = {}

    def read():
        try:
            out["got"] = lcckpt.load(pipe)
        except BaseException as e:
            out["error"] = e
    reader = threading.Thread(target=read, daemon=True)     # a hang fails, not blocks
    reader.start()
    threading.Thread(target=lambda: pipe.write_bytes(src.read_bytes()), daemon=True).start()
    reader.join(60)
    assert not reader.is_alive(), "the load of a pipe hung"
    assert "error" not in out, out.get("error")
    got = out["got"]
    assert set(got) == set(state) and all(torch.equal(got[k], state[k]) for k in state)
    with pytest.raises(lcckpt.InvalidArgumentError, match="is a pipe or a device"):
        lcckpt.open(pipe)


def test_an_endless_stream_is_refused_as_it_passes_the_limit(tmp_path):
    """A non-seekable stream (a pipe) is read whole before it is parsed, and was read to
    its end whatever its length: an endless one took all the memory. It is now refused
    once it is longer than any file ``max_bytes`` lets load, and read no further; so is
    one given to ``load_safetensors``."""
    lcckpt.save({"w": torch.ones(4)}, tmp_path / "a.lcc")
    head = (tmp_path / "a.lcc").read_bytes()[:64]

    class Endless(io.RawIOBase):
        read_so_far = 0

        def readable(self):
            return True

        def readinto(self, b):
            n = len(b)
            b[:n] = (head[self.read_so_far:] + bytes(n))[:n]     # the header, then zeros
            self.read_so_far += n
            return n
    stream = Endless()
    with pytest.raises(lcckpt.ResourceLimitError, match="a stream of more than"):
        lcckpt.load(stream, max_bytes=1_000_000)
    assert stream.read_so_far <= 1_000_000 + (64 << 20) + (16 << 20)
    old = lcckpt.limits.set_max_bytes(1_000_000)    # a safetensors stream: the same bound
    try:
        stream = Endless()
        with pytest.raises(lcckpt.ResourceLimitError, match="a stream of more than"):
            lcckpt.load_safetensors(stream)
        assert stream.read_so_far <= 1_000_000 + (64 << 20) + (16 << 20)
    finally:
        lcckpt.limits.set_max_bytes(old)


def test_a_url_is_refused_by_name_and_makes_no_local_folder(tmp_path, monkeypatch):
    """``"memory://x/a.lcc"`` is a valid relative path on POSIX: a chain made a folder
    named ``memory:`` and wrote there, and ``lcckpt.save`` said its directory was
    missing. Every local entry point now names the URL and lcckpt.distributed, which
    writes to fsspec URLs; ``file://`` is a local path."""
    monkeypatch.chdir(tmp_path)
    state = {"w": torch.ones(3)}
    calls = {
        "lcckpt.save": lambda u: lcckpt.save(state, u),
        "lcckpt.load": lambda u: lcckpt.load(u),
        "DeltaCheckpointer": lambda u: lcckpt.DeltaCheckpointer(u).save(0, state),
        "CheckpointManager": lambda u: lcckpt.CheckpointManager(u, torch.nn.Linear(2, 2), every=1),
        "lcckpt.open": lambda u: lcckpt.open(u),
        "lcckpt.convert": lambda u: lcckpt.convert(u, "b.lcc"),
        "lcckpt.save_safetensors": lambda u: lcckpt.save_safetensors(state, u),
    }
    for what, call in calls.items():
        for url in ("memory://x/a.lcc", "s3://bucket/run/a.lcc"):
            with pytest.raises(InvalidArgumentError, match=f"{what} reads and writes local files.*"
                               r"lcckpt\.distributed"):
                call(url)
    assert os.listdir(tmp_path) == []
    lcckpt.save(state, f"file://{tmp_path}/a.lcc")
    assert torch.equal(lcckpt.load(f"file://{tmp_path}/a.lcc")["w"], state["w"])


def test_meta_tensors_save_and_load_as_torch_save_keeps_them(tmp_path):
    """A model built on ``device="meta"`` (deferred initialisation) has a state_dict of
    meta tensors, which torch.save stores and lcckpt.save refused ("a meta tensor has no
    data"). They are kept as torch keeps them: dtype, shape, strides, Parameter and
    requires_grad, one object where one was met twice, meta whatever ``map_location``;
    tree version 5, written only where a meta tensor is."""
    net = torch.nn.Linear(3, 4, device="meta")
    x = torch.empty(4, 6, device="meta", dtype=torch.bfloat16).t()
    state = {"sd": net.state_dict(keep_vars=True), "x": x, "again": x, "real": torch.ones(2),
             "grad": torch.empty(2, device="meta", requires_grad=True)}
    torch.save(state, tmp_path / "t.pt")
    lcckpt.save(state, tmp_path / "m.lcc")
    for loaded in (lcckpt.load(tmp_path / "m.lcc"), lcckpt.load(tmp_path / "m.lcc", map_location="cpu"),
                   lcckpt.load(tmp_path / "t.pt")):
        want = torch.load(tmp_path / "t.pt", weights_only=True)
        for k in ("x", "grad"):
            got, ref = loaded[k], want[k]
            assert (got.device.type, got.dtype, got.shape, got.stride(), got.requires_grad) == \
                (ref.device.type, ref.dtype, ref.shape, ref.stride(), ref.requires_grad)
        w = loaded["sd"]["weight"]
        assert type(w) is torch.nn.Parameter and w.requires_grad and w.is_meta
        assert loaded["x"] is loaded["again"] and torch.equal(loaded["real"], state["real"])
    assert _tree_version(tmp_path / "m.lcc") == 5
    lcckpt.save({"real": torch.ones(2)}, tmp_path / "plain.lcc")
    assert _tree_version(tmp_path / "plain.lcc") == 1
    ck = lcckpt.DeltaCheckpointer(tmp_path / "chain")
    for step in range(3):
        ck.save(step, {"model": net.state_dict(), "w": torch.full((5000,), float(step))})
    assert ck.load(1)["model"]["weight"].is_meta and torch.equal(ck.load(2)["w"], torch.full((5000,), 2.0))


def _tree_version(path):
    with read_container(path) as c:
        return c.meta["lcckpt_tree"]


@pytest.mark.parametrize("node", [
    {"m": 0, "dtype": "F99", "shape": [2], "stride": [1]},
    {"m": 0, "dtype": "F32", "shape": [2, 3], "stride": [1]},
    {"m": -1, "dtype": "F32", "shape": [2], "stride": [1]},
    {"m": 0, "dtype": "F32", "shape": [-2], "stride": [1]},
    {"m": 0, "dtype": "F32", "shape": [2**40, 2**40], "stride": [1, 1]},
    {"m": 0, "dtype": "F32", "shape": [2], "stride": [1], "extra": 1},
    {"m": 0, "dtype": "F32", "shape": [2], "stride": [1], "param": "yes"},
])  # fmt: skip
def test_hostile_meta_nodes_are_corrupt_data(node):
    with pytest.raises(CorruptDataError):
        S.load(_file_with_tree({"$": "meta", **node}))


def _archives(tmp_path) -> dict:
    """Zips that are no torch.save file, each as its own library writes it."""
    import zipfile
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    paths = {k: tmp_path / n for k, n in (("script", "s.pt"), ("export", "e.pt2"),
                                          ("npz", "a.npz"), ("zip", "x.zip"))}
    torch.jit.save(torch.jit.script(m), paths["script"])
    torch.export.save(torch.export.export(m, (torch.randn(2, 4),)), paths["export"])
    np.savez(paths["npz"], a=np.ones(3))
    with zipfile.ZipFile(paths["zip"], "w") as z:
        z.writestr("notes/readme.txt", "hi")
    return paths


def test_zips_that_are_no_torch_save_file_are_named(tmp_path):
    paths = _archives(tmp_path)
    expect = {"script": (UnsafeObjectError, "TorchScript archive.*torch.jit.load"),
              "export": (CorruptDataError, "torch.export archive.*torch.export.load"),
              "npz": (CorruptDataError, r"numpy \.npz archive"),
              "zip": (CorruptDataError, "'notes/readme.txt'")}
    for kind, (cls, pattern) in expect.items():
        with warnings.catch_warnings():
            warnings.simplefilter("error")       # torch's TorchScript dispatch warns
            with pytest.raises(cls, match=pattern) as info:
                S.load(paths[kind])
        assert str(info.value).startswith(str(paths[kind])), info.value
        with open(paths[kind], "rb") as f, pytest.raises(cls, match=pattern):
            S.load(f)
    # a torch.save file passes the same check
    torch.save({"w": torch.ones(2)}, tmp_path / "ok.pt")
    assert torch.equal(S.load(tmp_path / "ok.pt")["w"], torch.ones(2))


def test_torch_save_calls_run_unchanged(tmp_path):
    import json as json_module
    state = {"w": torch.randn(3, 2), "step": 4}
    calls = [((), {"pickle_protocol": 4}), ((pickle, 2), {}),
             ((), {"pickle_module": pickle, "_use_new_zipfile_serialization": False,
                   "_disable_byteorder_record": True})]
    for args, kwargs in calls:
        path = tmp_path / "a.lcc"
        S.save(state, path, *args, **kwargs)
        back = S.load(path)
        assert torch.equal(back["w"], state["w"]) and back["step"] == 4
    for kwargs, pattern in (({"pickle_module": json_module}, "pickle_module='json'"),
                            ({"pickle_protocol": "4"}, "must be an int"),
                            ({"_use_new_zipfile": True}, r"unknown arguments \['_use_new_zipfile'\]")):
        with pytest.raises(InvalidArgumentError, match=pattern):
            S.save(state, tmp_path / "b.lcc", **kwargs)
        assert not (tmp_path / "b.lcc").exists()


def test_an_lcckpt_file_named_safetensors_is_warned_of(tmp_path):
    with pytest.warns(RuntimeWarning, match="safetensors cannot read.*save_safetensors"):
        S.save({"w": torch.ones(2)}, tmp_path / "model.safetensors")
    assert torch.equal(S.load(tmp_path / "model.safetensors")["w"], torch.ones(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        S.save({"w": torch.ones(2)}, tmp_path / "model.lcc")
        S.save({"w": torch.ones(2)}, tmp_path / "model.pt")    # torch.save's drop-in


def test_a_file_object_left_at_its_end_after_writing_says_to_rewind_it():
    """torch.load says only EOFError; the file is not empty, it was not rewound."""
    buf = io.BytesIO()
    lcckpt.save({"w": torch.ones(3)}, buf)
    with pytest.raises(InvalidArgumentError, match=r"at its end \(byte \d+\); rewind it with "
                       r"f.seek\(0\)"):
        lcckpt.load(buf)
    buf.seek(0)
    assert torch.equal(lcckpt.load(buf)["w"], torch.ones(3))
    with pytest.raises(lcckpt.CorruptDataError, match="the file is empty"):
        lcckpt.load(io.BytesIO())
