"""The load walk's readers of single values that are neither containers nor tensors: numpy
scalars, torch dtypes, sizes and devices, and argparse namespaces (a run's ``args``). A
mixin of the loader (tree.py), which provides ``bad``, ``fields`` and ``dict_``."""

from __future__ import annotations

import argparse
import re

import numpy as np
import torch

from ..codec import dtypes
from .composite import QUANTIZED_BY_NAME

DEVICE_RE = re.compile(r"[a-z][a-z0-9_]{0,31}(?::[0-9]{1,6})?")


def _named(table: dict, code):
    return table.get(code) if type(code) is str else None


class ValueLoader:
    """Handlers of the nodes named in ``_Loader.HANDLERS`` that hold one value each."""

    def namespace(self, j, path, depth):
        self.fields(j, path, ("items",))
        attrs = self.dict_({"$": "dict", "items": j["items"]}, path, depth)
        if any(type(k) is not str for k in attrs):
            self.bad(path, "a namespace's attribute names must be strings")
        return argparse.Namespace(**attrs)

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
