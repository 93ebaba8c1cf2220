"""Deques, ranges, slices, Ellipsis, fractions, decimals, UUIDs and numpy dtypes in a saved
state (tree version 7): they load as they were saved, in a file and in a chain; hostile
nodes are damage; older readers refuse the version by name."""

import collections
import dataclasses
import decimal
import enum
import fractions
import io
import json
import uuid

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lcckpt
from lcckpt.errors import (
    CorruptDataError, UnsafeObjectError, UnsupportedDtypeError, UnsupportedVersionError,
)
from lcckpt.format import serialization as S
from lcckpt.format.container import read_container, write_container


def round_trip(obj):
    f = io.BytesIO()
    lcckpt.save(obj, f)
    f.seek(0)
    return lcckpt.load(f), f


def tree_version(f) -> int:
    f.seek(0)
    return read_container(f).meta["lcckpt_tree"]


def same(a, b) -> bool:
    """Equal values of equal types (``repr`` tells a NaN decimal and a maxlen apart)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (list, tuple, collections.deque)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b)) \
            and getattr(a, "maxlen", None) == getattr(b, "maxlen", None)
    return repr(a) == repr(b)


CASES = {
    "deque": collections.deque([1, 2.5, "a", None, (3, 4)], maxlen=9),
    "deque of tensors": collections.deque([torch.arange(3.0), torch.ones(2, dtype=torch.int8)]),
    "empty deque": collections.deque(maxlen=0),
    "range": range(2, 10**30, 7),
    "empty range": range(5, 1, 1),
    "slice": slice(1, None, -2),
    "slice of anything": slice("a", (1, 2), 2.5),
    "ellipsis": ...,
    "fraction": fractions.Fraction(-(10**40), 3),
    "decimals": [decimal.Decimal(s) for s in
                 ("1.10", "-0", "NaN", "-sNaN12", "Infinity", "1E+999999", "0.000", "123456789.0123456789")],
    "uuid": uuid.UUID("12345678-1234-5678-1234-567812345678"),
    "numpy dtypes": [np.dtype("float32"), np.dtype("<U3"), np.dtype(">f8"), np.dtype("M8[ns]"),
                     np.dtype("bool")],
    "numpy scalar types": [np.float32, np.int64, np.bool_, np.complex64, np.str_],
}


@pytest.mark.parametrize("name", CASES)
def test_each_value_loads_as_saved_in_tree_version_7(name):
    v = CASES[name]
    out, f = round_trip({"v": v})
    assert same(out["v"], v), (out["v"], v)
    assert tree_version(f) == 7


def test_files_without_them_keep_their_lower_version():
    _, f = round_trip({"w": torch.ones(2), "n": 3, "s": {1, 2}})
    assert tree_version(f) == 4


def test_a_chain_keeps_them_beside_its_deltas(tmp_path):
    ck = lcckpt.DeltaCheckpointer(tmp_path / "ck")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=g)
    for step in range(3):
        w = w + 0.01 * torch.randn(64, 64, generator=g)
        ck.save(step, {"w": w, "losses": collections.deque([0.5, 0.25 + step], maxlen=100),
                       "seen": range(0, 128 * (step + 1)), "dtype": np.float32,
                       "run": uuid.UUID(int=step)})
    back = ck.load(2)
    assert back["losses"] == collections.deque([0.5, 2.25]) and back["losses"].maxlen == 100
    assert back["seen"] == range(0, 384) and back["dtype"] is np.float32
    assert back["run"] == uuid.UUID(int=2)


_ints = st.integers(-(2**80), 2**80)


@settings(max_examples=150, deadline=None)
@given(st.one_of(
    st.builds(lambda xs, extra: collections.deque(xs, len(xs) + extra),
              st.lists(st.one_of(_ints, st.floats(), st.text(max_size=3), st.none()), max_size=8),
              st.integers(0, 3)),
    st.builds(range, _ints, _ints, _ints.filter(bool)),
    st.builds(slice, st.one_of(_ints, st.none()), st.one_of(_ints, st.none()),
              st.one_of(_ints, st.none())),
    st.fractions(),
    st.decimals(allow_nan=True, allow_infinity=True),
    st.uuids(),
))
def test_property_values_load_as_saved(v):
    out, _ = round_trip({"v": v})
    assert same(out["v"], v)


def _file_with_tree(node):
    f = io.BytesIO()
    write_container(f, [], {"lcckpt_tree": 7, "tree": node})
    f.seek(0)
    return f


@pytest.mark.parametrize("node", [
    {"$": "deque"}, {"$": "deque", "v": 3}, {"$": "deque", "v": [1, 2], "maxlen": 1},
    {"$": "deque", "v": [], "maxlen": -1}, {"$": "deque", "v": [], "maxlen": True},
    {"$": "deque", "v": [], "maxlen": 2**63}, {"$": "deque", "v": [], "extra": 1},
    {"$": "range", "v": [1, 2]}, {"$": "range", "v": [1, 2, 0]}, {"$": "range", "v": [1, 2.0, 1]},
    {"$": "range", "v": [1, True, 1]}, {"$": "range", "v": "0:3"},
    {"$": "slice", "v": [1, 2]}, {"$": "slice", "v": [1, 2, {"$": "nope"}]},
    {"$": "ellipsis", "v": 1},
    {"$": "fraction", "v": [1, 0]}, {"$": "fraction", "v": [2, 4]}, {"$": "fraction", "v": [1, -3]},
    {"$": "fraction", "v": [1.5, 2]},
    {"$": "decimal", "v": "abc"}, {"$": "decimal", "v": "1.0e3"}, {"$": "decimal", "v": 1},
    {"$": "decimal", "v": " 1"},
    {"$": "uuid", "hex": "12"}, {"$": "uuid", "hex": "A" * 32}, {"$": "uuid", "v": "0" * 32},
    {"$": "npdtype", "v": "F33"}, {"$": "npdtype", "v": "|O"}, {"$": "npdtype", "v": "F32", "type": 1},
    {"$": "npdtype", "v": "<U03"},
])
def test_hostile_nodes_are_corrupt_data(node):
    with pytest.raises(CorruptDataError):
        lcckpt.load(_file_with_tree(node))


def test_an_older_reader_refuses_version_7_by_name(monkeypatch):
    _, f = round_trip({"v": collections.deque([1])})
    monkeypatch.setattr(S, "TREE_VERSION", 6)
    f.seek(0)
    with pytest.raises(UnsupportedVersionError, match="version 7"):
        lcckpt.load(f)


def test_the_nodes_are_the_documented_ones():
    """docs/format.md's table, for a few of them (a reader of another language builds the
    same values from these fields)."""
    f = io.BytesIO()
    lcckpt.save({"d": collections.deque([1], maxlen=2), "r": range(3), "e": ...,
                 "q": fractions.Fraction(1, 3), "x": decimal.Decimal("1.10"),
                 "u": uuid.UUID(int=1), "t": np.float32, "n": np.dtype(">f4")}, f)
    f.seek(0)
    items = dict((k, v) for k, v in read_container(f).meta["tree"]["items"])
    assert items == {
        "d": {"$": "deque", "v": [1], "maxlen": 2}, "r": {"$": "range", "v": [0, 3, 1]},
        "e": {"$": "ellipsis"}, "q": {"$": "fraction", "v": [1, 3]},
        "x": {"$": "decimal", "v": "1.10"}, "u": {"$": "uuid", "hex": "0" * 31 + "1"},
        "t": {"$": "npdtype", "v": "F32", "type": True}, "n": {"$": "npdtype", "v": ">f4"},
    }, json.dumps(items)


class Color(enum.Enum):
    RED = 1


@dataclasses.dataclass
class Config:
    lr: float = 0.1


@pytest.mark.parametrize("value, hint", [
    (Color.RED, r"x\.value"), (Config(), r"dataclasses\.asdict"),
    (collections.namedtuple("P", "a")(1), r"_asdict"),
    (type("MyDict", (dict,), {})(a=1), r"subclass of dict: convert with dict\(x\)"),
    (type("MyStr", (str,), {})("a"), r"subclass of str: convert with str\(x\)"),
])
def test_enums_and_dataclasses_are_refused_with_what_to_store(value, hint):
    with pytest.raises(UnsafeObjectError, match=hint):
        lcckpt.save({"v": value}, io.BytesIO())


@pytest.mark.parametrize("dt", [np.dtype([("a", "f4")]), np.floating, np.dtype(object)])
def test_numpy_dtypes_without_a_code_are_refused_by_name(dt):
    with pytest.raises(UnsupportedDtypeError, match="str\\(x\\)"):
        lcckpt.save({"v": dt}, io.BytesIO())


def test_lazy_reads_list_the_tensors_in_deques_defaultdicts_and_namespaces(tmp_path):
    import argparse
    path = tmp_path / "s.lcc"
    state = {"hist": collections.deque([torch.ones(3), 1.5], maxlen=5),
             "dd": collections.defaultdict(list, a=torch.zeros(2)),
             "ns": argparse.Namespace(w=torch.full((1,), 7.0))}
    lcckpt.save(state, path)
    with lcckpt.open(path) as f:
        assert list(f.keys()) == ["hist.0", "dd.a", "ns.w"]
        assert torch.equal(f.get_tensor("hist.0"), torch.ones(3))
        assert torch.equal(f.get_tensor('obj["ns"]["w"]'), torch.full((1,), 7.0))


def test_a_load_into_fills_the_tensors_of_a_deque(tmp_path):
    state = {"hist": collections.deque([torch.arange(4.0)], maxlen=3)}
    lcckpt.save(state, tmp_path / "d.lcc")
    target = {"hist": collections.deque([torch.zeros(4)], maxlen=3)}
    buf = target["hist"][0]
    out = lcckpt.load(tmp_path / "d.lcc", into=target)
    assert torch.equal(buf, torch.arange(4.0)) and out["hist"][0].data_ptr() == buf.data_ptr()
