"""Single values that are neither containers nor tensors: numpy scalars, torch dtypes,
sizes and devices, argparse namespaces (a run's ``args``), dates, times and durations,
and filesystem paths. The load walk reads them here (:class:`ValueLoader`, a mixin of the
loader in tree.py, which provides ``bad``, ``fields`` and ``dict_``); the nodes of the
last two kinds are also made here (:func:`value_node`)."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import pathlib
import re

import numpy as np
import torch

from ..codec import dtypes
from .composite import QUANTIZED_BY_NAME

DEVICE_RE = re.compile(r"[a-z][a-z0-9_]{0,31}(?::[0-9]{1,6})?")


def _named(table: dict, code):
    return table.get(code) if type(code) is str else None


_PATHS = {pathlib.PurePosixPath: ("posix", True), pathlib.PureWindowsPath: ("windows", True),
          pathlib.PosixPath: ("posix", False), pathlib.WindowsPath: ("windows", False)}
SINGLE = {dt.datetime, dt.date, dt.time, dt.timedelta, *_PATHS}   # what value_node() takes


def value_node(v) -> dict:
    """The node of a date, time, duration or path (a type in :data:`SINGLE`; tree version
    6). A time zone must be a fixed offset (``datetime.timezone``): ValueError otherwise."""
    t = type(v)
    if t is dt.timedelta:
        return {"$": "timedelta", "v": [v.days, v.seconds, v.microseconds]}
    if t is dt.date:
        return {"$": "date", "v": [v.year, v.month, v.day]}
    if t in _PATHS:
        flavour, pure = _PATHS[t]
        return {"$": "path", "v": str(v), "flavour": flavour, "pure": pure}
    node = {"$": t.__name__, "v": ([v.year, v.month, v.day] if t is dt.datetime else [])
            + [v.hour, v.minute, v.second, v.microsecond]}
    if v.fold:
        node["fold"] = 1
    if v.tzinfo is not None:
        if type(v.tzinfo) is not dt.timezone:
            raise ValueError(f"its time zone is a {type(v.tzinfo).__name__}, which only "
                             "pickle stores, not a fixed offset: convert it first, e.g. "
                             "x.astimezone(datetime.timezone.utc)")
        off = v.tzinfo.utcoffset(None)
        node["utcoffset"] = [off.days, off.seconds, off.microseconds]
        if v.tzinfo.tzname(None) != dt.timezone(off).tzname(None):      # a named offset
            node["tzname"] = v.tzinfo.tzname(None)
    return node


class ValueLoader:
    """Handlers of the nodes named in ``_Loader.HANDLERS`` that hold one value each."""

    def namespace(self, j, path, depth):
        self.fields(j, path, ("items",))
        attrs = self.dict_({"$": "dict", "items": j["items"]}, path, depth)
        if any(type(k) is not str for k in attrs):
            self.bad(path, "a namespace's attribute names must be strings")
        return argparse.Namespace(**attrs)

    def time_value(self, j, path, depth):
        tag, v = j["$"], j.get("v")
        plain = tag in ("date", "timedelta")
        self.fields(j, path, ("v",), () if plain else ("fold", "utcoffset", "tzname"))
        off, name, fold = j.get("utcoffset", [0, 0, 0]), j.get("tzname"), j.get("fold", 0)
        if type(v) is not list or len(v) != {"datetime": 7, "time": 4}.get(tag, 3) \
                or type(off) is not list or len(off) != 3 or fold not in (0, 1) \
                or not all(type(x) is int for x in v + off) \
                or (name is not None and type(name) is not str):
            self.bad(path, f"invalid {tag} node")
        try:
            if plain:
                return (dt.date if tag == "date" else dt.timedelta)(*v)
            tz = None if "utcoffset" not in j else dt.timezone(dt.timedelta(*off)) \
                if name is None else dt.timezone(dt.timedelta(*off), name)
            return (dt.datetime if tag == "datetime" else dt.time)(*v, tzinfo=tz, fold=fold)
        except (ValueError, OverflowError, TypeError) as e:
            self.bad(path, f"invalid {tag}: {e}")

    def fspath(self, j, path, depth):
        self.fields(j, path, ("v", "flavour", "pure"))
        v, flavour, pure = j["v"], j["flavour"], j["pure"]
        if type(v) is not str or flavour not in ("posix", "windows") or type(pure) is not bool:
            self.bad(path, "invalid path node")
        native = (flavour == "posix") == (os.name != "nt")  # a concrete path of the other
        cls = next(c for c, (f, p) in _PATHS.items()         # system's flavour loads pure
                   if f == flavour and p == (pure or not native))
        return cls(v)

    def npscalar(self, j, path, depth):
        self.fields(j, path, ("dtype", "hex"))
        dtype = dtypes.numpy_dtype(j["dtype"])
        h = j["hex"]
        if dtype is None or type(h) is not str or not re.fullmatch(r"(?:[0-9a-f]{2})*", h):
            self.bad(path, "invalid numpy scalar")
        if len(h) != 2 * dtype.itemsize:
            self.bad(path, "numpy scalar has the wrong size")
        if dtype.itemsize == 0:            # np.str_(""), np.bytes_(b""): no array holds them
            return dtype.type()
        return np.frombuffer(bytes.fromhex(h), dtype)[0]

    def dtype(self, j, path, depth):
        self.fields(j, path, ("v",))
        dtype = _named(dtypes.NAME_TORCH, j["v"]) or _named(QUANTIZED_BY_NAME, j["v"])
        if dtype is None:
            self.bad(path, f"unknown dtype {j['v']!r:.40}")
        return dtype

    def size(self, j, path, depth):
        self.fields(j, path, ("v",))
        if type(j["v"]) is not list or len(j["v"]) > 64 or \
                not all(type(n) is int and -(2**63) <= n < 2**63 for n in j["v"]):
            self.bad(path, "torch.Size needs a list of at most 64 64-bit ints")
        try:
            return torch.Size(j["v"])
        except (ValueError, OverflowError, RuntimeError) as e:
            self.bad(path, f"invalid torch.Size: {e}")

    def device(self, j, path, depth):
        self.fields(j, path, ("v",))
        try:
            if type(j["v"]) is not str or not DEVICE_RE.fullmatch(j["v"]):
                raise TypeError("not a device string such as 'cpu' or 'cuda:0'")
            return torch.device(j["v"])
        except (RuntimeError, TypeError, ValueError) as e:
            self.bad(path, f"invalid device: {e}")
