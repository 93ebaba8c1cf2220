"""Numpy values and argparse namespaces in torch.save files: read by lcckpt.load without
running code from them."""

import argparse
import datetime
import pathlib

import numpy as np
import pytest
import torch
try:
    from numpy._core import multiarray          # numpy 2
except ImportError:                             # numpy 1.26
    from numpy.core import multiarray

import lcckpt
from lcckpt.errors import CorruptDataError, UnsafeObjectError


def _values():
    return {"arr": np.arange(6.0).reshape(2, 3), "i": np.int64(3), "f": np.float64(0.5),
            "b": np.bool_(True), "s": np.str_("xy"), "u8": np.zeros(3, np.uint8),
            "f16": np.float16(2), "c": np.array([1 + 2j]), "labels": np.array(["ab", "c"]),
            "day": np.datetime64("2020-01-01"), "strided": np.arange(12.0).reshape(3, 4)[:, ::2],
            "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)), "empty": np.zeros((0, 2)),
            "w": torch.randn(3), "epoch": 3, "args": argparse.Namespace(lr=0.1, layers=[1, 2]),
            "saved_at": datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc),
            "took": datetime.timedelta(seconds=90), "out": pathlib.Path("/runs/a"),
            "win": pathlib.PureWindowsPath("C:/runs")}


def test_numpy_values_in_a_torch_file_load_and_resave(tmp_path):
    """What torch.load(weights_only=True) refuses (numpy arrays and scalars, a run's
    argparse args, dates and paths, as training scripts pickled them) loads, equal to a full unpickling,
    and saves as lcckpt; torch's own weights-only load outside lcckpt is left as it was."""
    torch.save(_values(), tmp_path / "a.pt")
    got = lcckpt.load(tmp_path / "a.pt")
    want = torch.load(tmp_path / "a.pt", weights_only=False)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert type(got[k]) is type(v), k
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v)
        elif isinstance(v, np.ndarray):
            assert got[k].dtype == v.dtype and np.array_equal(got[k], v), k
        else:
            assert got[k] == v and getattr(got[k], "dtype", None) == getattr(v, "dtype", None), k
    lcckpt.save(got, tmp_path / "a.lcc", compress=True)
    assert np.array_equal(lcckpt.load(tmp_path / "a.lcc")["arr"], want["arr"])
    with pytest.raises(Exception, match="numpy"):
        torch.load(tmp_path / "a.pt", weights_only=True)


class _Reduce:
    """Pickles as ``fn(*args)`` (then ``state`` set on the result): what a hostile file holds."""

    def __init__(self, fn, args, state=None):
        self.fn, self.args, self.state = fn, args, state

    def __reduce__(self):
        return (self.fn, self.args) if self.state is None else (self.fn, self.args, self.state)


@pytest.mark.parametrize("bad", [
    np.array([1, "a"], dtype=object),                       # Python objects
    np.zeros(2, "f4,i4"),                                   # a structured dtype's state
    np.ma.array([1, 2]),                                    # a subclass
    _Reduce(np.ndarray, ((10**12,),)),                      # allocate by calling the class
    _Reduce(argparse.Namespace, (1,)),                      # positional arguments
    _Reduce(bytes, (10**12,)),                              # bytes(n): n zero bytes
    _Reduce(np.dtype, ("O",)),
    _Reduce(multiarray.scalar, (np.dtype("S100000000"),)),  # a scalar of no bytes
    _Reduce(multiarray.scalar, (np.dtype("f8"), b"\0")),    # the wrong number of bytes
    _Reduce(multiarray._reconstruct, (np.ndarray, (0,), b"b"),
            (1, (10**9,), np.dtype("f8"), False, b"")),      # a shape its bytes do not fill
], ids=["object", "structured", "subclass", "ndarray-call", "namespace-args", "bytes-n",
        "object-dtype", "scalar-empty", "scalar-short", "state-short"])
def test_hostile_numpy_pickles_are_refused(tmp_path, bad):
    torch.save({"x": bad}, tmp_path / "h.pt")
    with pytest.raises((UnsafeObjectError, CorruptDataError)):
        lcckpt.load(tmp_path / "h.pt")


def test_loads_in_threads_keep_the_allowlist_until_the_last_ends(tmp_path):
    """torch keeps one allowlist per process: a plain ``safe_globals`` context ending in
    one thread took the numpy stand-ins from another thread's load under way (176 of 400
    such loads in 8 threads were refused). They stay while any load is inside, and are
    gone after the last."""
    from concurrent.futures import ThreadPoolExecutor
    torch.save({"a": np.arange(100_000.0), "b": np.float64(1)}, tmp_path / "a.pt")

    def load(_):
        return lcckpt.load(tmp_path / "a.pt")["a"].shape

    with ThreadPoolExecutor(8) as ex:
        assert set(ex.map(load, range(200))) == {(100_000,)}
    with pytest.raises(Exception, match="numpy"):
        torch.load(tmp_path / "a.pt", weights_only=True)


def test_ranges_slices_fractions_decimals_and_numpy_types_in_a_torch_file_load(tmp_path):
    """What a training script's state also pickles: they load as a full unpickling gives
    them, and save as lcckpt; a deque and a UUID stay refused (torch's unpickler cannot
    fill a deque, and a UUID's pickle sets its number unchecked)."""
    import decimal
    import fractions
    values = {"seen": range(0, 10**20, 3), "window": slice(1, None, -1), "all": ...,
              "share": fractions.Fraction(-2, 7), "price": decimal.Decimal("-1.10"),
              "dtypes": [np.float32, np.int8, np.bool_, np.str_, np.datetime64, np.complex64]}
    torch.save(values, tmp_path / "v.pt")
    got = lcckpt.load(tmp_path / "v.pt")
    assert repr(got) == repr(torch.load(tmp_path / "v.pt", weights_only=False))
    lcckpt.save(got, tmp_path / "v.lcc")
    assert repr(lcckpt.load(tmp_path / "v.lcc")) == repr(got)
    with pytest.raises(Exception, match="range"):
        torch.load(tmp_path / "v.pt", weights_only=True)       # torch's own load unchanged
    import collections
    import uuid
    for refused in (collections.deque([1]), uuid.UUID(int=1)):
        torch.save({"x": refused}, tmp_path / "r.pt")
        with pytest.raises(UnsafeObjectError):
            lcckpt.load(tmp_path / "r.pt")


@pytest.mark.parametrize("bad", [
    _Reduce(__import__("fractions").Fraction, (1, 0)),
    _Reduce(__import__("decimal").Decimal, ("nope",)),
    _Reduce(range, ("a",)),
    _Reduce(np.float32, ("x",)),
], ids=["fraction-zero", "decimal-text", "range-text", "scalar-type-text"])
def test_hostile_values_of_the_allowed_classes_are_damage(tmp_path, bad):
    torch.save({"x": bad}, tmp_path / "h.pt")
    with pytest.raises(CorruptDataError):
        lcckpt.load(tmp_path / "h.pt")
