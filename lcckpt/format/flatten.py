"""Saving an object tree: the walk that turns nested training state into a typed JSON
tree and one data section per tensor, array or bytes leaf (loading: tree.py)."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import json
import math
import re
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..codec import dtypes
from ..errors import InvalidArgumentError, UnsafeObjectError, UnsupportedDtypeError
from . import composite, stdlib, values
from .sections import Encoded

MAX_DEPTH = 64  # levels of containers; a few JSON levels each in the header
DTYPE_CODES: dict[torch.dtype, str] = dtypes.TORCH_NAME   # dtype -> header name

LeafEncoder = Callable[[str, torch.Tensor], Encoded]
PackRule = Callable[[str, torch.Tensor], bool]
Lookahead = Callable[[list[tuple[str, torch.Tensor]]], None]


def pack_name(dtype_name: str, device: str) -> str:
    """The section name of the pack of small ``dtype_name`` tensors on ``device`` (never a
    key path: those start with ``obj``); a chain tracks the pack under this name."""
    return f"pack[{dtype_name}@{device}]"


def flatten(obj: Any, encode_leaf: LeafEncoder, pack: PackRule | None = None,
            encode_pack: LeafEncoder | None = None, ahead: Lookahead | None = None,
            encode_array: LeafEncoder | None = None
            ) -> tuple[Any, list[tuple[str, dict, Any]], int]:
    """``obj`` as ``(json_tree, sections, tree_version)``; ``encode_leaf`` codes each
    tensor leaf. ``tree_version`` is the lowest tree version that holds ``obj`` (1 unless
    it has Parameters, tensors requiring grad, or views that are not the plain tensor;
    4 where it holds sets, complex numbers, Counters, bytearrays, or sparse, nested or
    quantized tensors).

    ``pack(key_path, tensor)``: tensors it picks (small ones), when each is alone on its
    storage, are stored in one section per dtype and device (coded by ``encode_pack``,
    default ``encode_leaf``, under the section name :func:`pack_name` gives) instead of
    one section each, and load as separate tensors again (tree version 3). One section
    per tensor costs a header entry and a codec call: 100,000 of them take minutes.

    ``ahead(leaves)``: told, before the first ``encode_leaf`` call, the ``(key_path,
    tensor)`` of the dense host tensors it will code one by one, in that order (each
    then comes to ``encode_leaf`` as a new view of that tensor).

    ``encode_array``: codes numpy arrays of the numeric dtypes as tensors (tree version 6
    where it codes one); default: their bytes as they are."""
    saver = _Saver(encode_leaf, pack, encode_pack, ahead, encode_array)
    tree = saver.node(obj, "obj", 0)
    return tree, saver.sections, saver.finish()


_PLAIN_KEY = re.compile(r'[^"\\\x00-\x1f\x7f-\x9f\u2028\u2029]*')


_SECTION_NODES = ("tensor", "ndarray", "bytes")


def renumber_sections(meta: dict, new_index: dict[int, int]) -> None:
    """Point every node of ``pack``'s ``meta["tree"]`` at its section's new index (a node
    met at several places of the tree is one dict, renumbered once)."""
    seen, stack = set(), [meta["tree"]]
    while stack:
        v = stack.pop()
        if type(v) is list:
            stack.extend(v)
        elif type(v) is dict and id(v) not in seen:
            seen.add(id(v))
            if v.get("$") in _SECTION_NODES and "s" in v:
                v["s"] = new_index[v["s"]]
            stack.extend(v.values())


FACTORIES = (list, dict, set, int, float, str, tuple, bool)   # a defaultdict's, by name


def _plain(x) -> bool:
    """Whether ``x`` is its own node: None, a bool, a str, a finite float or a 64-bit int."""
    t = type(x)
    return (math.isfinite(x) if t is float else -(2**63) <= x < 2**63 if t is int
            else x is None or t is str or t is bool)


def key_repr(k) -> str:
    if type(k) is not str:
        return repr(k)
    if _PLAIN_KEY.fullmatch(k):          # what json.dumps would leave as it is, quoted
        return f'"{k}"'
    return json.dumps(k, ensure_ascii=False)


_SUPPORTED = (
    "dict, OrderedDict, Counter, list, tuple, set, frozenset, torch.Tensor, numpy.ndarray, "
    "numpy scalars, int, float, complex, str, bytes, bytearray, bool, None, torch.dtype, "
    "torch.Size, torch.device, argparse.Namespace, defaultdict (of a builtin type), "
    "datetime's date, time, datetime and timedelta, pathlib paths, deque, range, slice, "
    "Ellipsis, Fraction, Decimal, UUID, numpy dtypes; sparse, nested and quantized tensors"
)


def _dense_strides(shape) -> tuple:
    """The strides of a fresh C-contiguous tensor of ``shape`` (what a loaded one gets)."""
    return _strides_of(tuple(shape))


@functools.lru_cache(maxsize=4096)
def _strides_of(shape: tuple) -> tuple:
    return torch.empty(shape, device="meta").stride()


class _Saver:
    """Walks an object tree, returning its JSON tree and collecting data sections."""

    def __init__(self, encode_leaf: LeafEncoder, pack: PackRule | None = None,
                 encode_pack: LeafEncoder | None = None, ahead: Lookahead | None = None,
                 encode_array: LeafEncoder | None = None):
        self.encode_leaf, self.ahead, self.encode_array = encode_leaf, ahead, encode_array
        self.pack, self.encode_pack = pack, encode_pack or encode_leaf
        self.indexed: list[dict] = []  # every node holding a section index ("s")
        self.sections: list[tuple[str, dict, Any]] = []
        self.by_id: dict[int, Any] = {}  # id(obj) -> node, for tensors, arrays, bytes
        self.storages: dict[tuple, list] = {}  # (device, dtype, storage) -> [(tensor, node, path)]
        self.storage_sections: dict[tuple, int] = {}  # the same key -> its section
        self.version = 1  # tree version the nodes written so far need
        self.metas = 0  # meta tensors met so far
        self.alive: list[Any] = []  # keeps ids unique while saving

    def refuse(self, value, path: str, hint: str | None = ""):
        t = type(value)
        if not hint and callable(getattr(value, "state_dict", None)):
            hint = (f"It has a state_dict(): save {path}.state_dict() instead (a module or "
                    "optimizer saves and loads through its state dict).")
        raise UnsafeObjectError(
            f"cannot save {path}: a {t.__module__}.{t.__qualname__} is not storable without "
            f"pickle. lcckpt stores {_SUPPORTED}. "
            + (hint or "Convert it to those types (e.g. a dict of plain values) first.")
        )

    def node(self, v, path: str, depth: int):
        if depth > MAX_DEPTH:
            raise InvalidArgumentError(
                f"{path} is nested more than {MAX_DEPTH} levels deep (or is cyclic)"
            )
        t = type(v)
        if v is None or t is bool or t is str:
            return v
        if t is int:
            return v if -(2**63) <= v < 2**63 else {"$": "int", "hex": hex(v)}
        if t is float:
            return v if math.isfinite(v) else {"$": "float", "v": repr(v)}
        if t is list:
            return self.seq(v, path, depth)
        if t is tuple:
            return {"$": "tuple", "v": self.seq(v, path, depth)}
        if t is dict:
            return {"$": "dict", "items": self.items(v, path, depth)}
        if t is OrderedDict:
            return self.odict(v, path, depth)
        if t is Counter:
            self.version = max(self.version, 4)
            return {"$": "counter", "items": self.items(v, path, depth)}
        if t is set or t is frozenset:
            return self.set(v, path, depth)
        if t is complex:
            self.version = max(self.version, 4)
            return {"$": "complex", "re": self.node(v.real, path, depth + 1),
                    "im": self.node(v.imag, path, depth + 1)}
        if isinstance(v, torch.Tensor):
            return self.tensor(v, path)
        if t is np.ndarray:
            return self.ndarray(v, path)
        if isinstance(v, np.generic) and (code := dtypes.numpy_code(v.dtype)) is not None:
            if dtypes.numpy_spelled(code):
                self.version = max(self.version, 6)
            raw = v.tobytes()[:v.dtype.itemsize]    # np.str_("") is "<U0" with 4 bytes
            return {"$": "npscalar", "dtype": code, "hex": raw.hex()}
        if t is bytes or t is bytearray:
            return self.bytes(v, path)
        if t is torch.dtype:
            if v in composite.QUANTIZED_DTYPES:          # a quantized model's settings
                self.version = max(self.version, 4)
                return {"$": "dtype", "v": composite.QUANTIZED_DTYPES[v]}
            if v not in DTYPE_CODES:
                raise UnsupportedDtypeError(f"cannot save {path}: dtype {v} is not supported")
            return {"$": "dtype", "v": DTYPE_CODES[v]}
        if t in values.SINGLE:                     # dates, times, durations, paths
            try:
                node = values.value_node(v)
            except ValueError as e:
                raise UnsafeObjectError(f"cannot save {path}: {e}") from None
            self.version = max(self.version, 6)
            return node
        if t is argparse.Namespace:                # a run's args: its attributes, by name
            self.version = max(self.version, 6)
            return {"$": "namespace", "items": self.items(vars(v), path, depth)}
        if t is torch.Size:
            return {"$": "size", "v": list(v)}
        if t is torch.device:
            return {"$": "device", "v": str(v)}
        if t is torch.qscheme and str(v).removeprefix("torch.") in composite.QSCHEMES:
            self.version = max(self.version, 4)
            return {"$": "qscheme", "v": str(v).removeprefix("torch.")}
        if t is defaultdict:
            if v.default_factory is not None and v.default_factory not in FACTORIES:
                self.refuse(v, path, "A defaultdict is stored with a default_factory of "
                            f"{', '.join(f.__name__ for f in FACTORIES)} or None only.")
            self.version = max(self.version, 6)
            node = {"$": "defaultdict", "items": self.items(v, path, depth)}
            if v.default_factory is not None:
                node["factory"] = v.default_factory.__name__
            return node
        if stdlib.holds(v):                       # deques, ranges, ..., numpy dtypes
            return self.stdlib_node(v, path, depth)
        self.refuse_other(v, path)

    def stdlib_node(self, v, path: str, depth: int) -> dict:
        """The node of a value :func:`stdlib.holds` takes (tree version 7)."""
        try:
            node = stdlib.node_of(v, lambda x, at: self.node(x, path + at, depth + 1),
                                  lambda xs: self.seq(xs, path, depth))
        except ValueError as e:
            raise UnsupportedDtypeError(f"cannot save {path}: {e}") from None
        self.version = max(self.version, 7)
        return node

    def refuse_other(self, v, path: str):
        """Refuse a value no node holds, saying what to store instead where a plain form
        of it exists."""
        if isinstance(v, tuple) and hasattr(v, "_fields"):
            self.refuse(v, path, "Convert the namedtuple with tuple(x) or x._asdict().")
        if isinstance(v, enum.Enum):
            self.refuse(v, path, "Store the member's value (x.value) or name (x.name), "
                        "and look the member up from it after loading.")
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            self.refuse(v, path, "Convert it with dataclasses.asdict(x), and rebuild it "
                        "from that dict after loading.")
        base = next((b.__name__ for b in (dict, list, tuple, str, int, float, bytes)
                     if isinstance(v, b)), None)
        self.refuse(v, path, base and f"It is a subclass of {base}: convert with {base}(x).")

    def seq(self, v, path: str, depth: int) -> list:
        """A list's or tuple's element nodes. Plain values are their own nodes, taken
        without building a key path each (a history of a million losses)."""
        if depth >= MAX_DEPTH:                 # node() says what is nested too deeply
            return [self.node(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]
        types = set(map(type, v))              # one type throughout: checked in C loops
        if len(types) == 1:
            t = types.pop()
            if t is str or (t is float and all(map(math.isfinite, v))) \
                    or (t is int and -(2**63) <= min(v) and max(v) < 2**63):
                return list(v)
        return [x if _plain(x) else self.node(x, f"{path}[{i}]", depth + 1)
                for i, x in enumerate(v)]

    def items(self, d: dict, path: str, depth: int) -> list:
        out = []
        fast = depth < MAX_DEPTH
        for k, v in d.items():
            if fast and _plain(k) and _plain(v):          # their own nodes, as in seq()
                out.append([k, v])
                continue
            sub = f"{path}[{key_repr(k)}]"
            out.append([self.key(k, sub, depth + 1), self.node(v, sub, depth + 1)])
        return out

    def key(self, k, path: str, depth: int, what: str = "dict keys"):
        t = type(k)
        if k is None or t in (bool, int, float, str):
            return self.node(k, path, 0)
        if t is tuple:
            if depth > MAX_DEPTH:
                raise InvalidArgumentError(f"a key of {path} is nested too deeply")
            return {"$": "tuple", "v": [self.key(x, path, depth + 1, what) for x in k]}
        raise UnsafeObjectError(
            f"cannot save {path}: {what} must be str, int, float, bool, None or tuples "
            f"of those, not {t.__module__}.{t.__qualname__}"
        )

    def set(self, v, path: str, depth: int) -> dict:
        """A set's elements (the values a dict key may hold), in an order that does not
        depend on the process's string hashing: equal sets give equal files."""
        self.version = max(self.version, 4)
        items = [self.key(x, f"{path}{{...}}", depth + 1, "set elements") for x in v]
        items.sort(key=lambda j: json.dumps(j, sort_keys=True))
        node = {"$": "set", "v": items}
        if type(v) is frozenset:
            node["frozen"] = True
        return node

    def odict(self, v: OrderedDict, path: str, depth: int) -> dict:
        node = {"$": "odict", "items": self.items(v, path, depth)}
        attrs = dict(vars(v))
        if "_metadata" in attrs:  # torch state_dict's per-module version info
            node["metadata"] = self.node(attrs.pop("_metadata"), f"{path}._metadata", depth + 1)
        if attrs:
            raise UnsafeObjectError(
                f"cannot save {path}: the OrderedDict carries attributes {sorted(attrs)}; only "
                "a state_dict's _metadata is kept. Delete them or move them into the dict."
            )
        return node

    def add_section(self, path: str, meta: dict, payload, node: dict | None = None) -> int:
        self.sections.append((path, meta, payload))
        if node is not None:
            self.indexed.append(node)
        return len(self.sections) - 1

    def tensor(self, v: torch.Tensor, path: str):
        if id(v) in self.by_id:
            return self.by_id[id(v)]
        if v.is_nested or (v.is_quantized and type(v) is torch.Tensor):
            return self.composite(v, path, *composite.describe(v, path))
        if type(v) not in (torch.Tensor, torch.nn.Parameter):
            self.refuse(v, path, "Tensor subclasses are not stored: pass x.as_subclass(torch.Tensor).")
        if v.layout != torch.strided:
            return self.composite(v, path, *composite.describe(v, path))
        if v.dtype not in DTYPE_CODES:
            raise UnsupportedDtypeError(
                f"cannot save {path}: dtype {v.dtype} is not supported; "
                f"supported: {', '.join(str(d) for d in DTYPE_CODES)}"
            )
        self.alive.append(v)
        if v.device.type == "meta":              # no data: its dtype, shape and strides
            return self.meta(v)
        node = {"$": "tensor"}
        if type(v) is torch.nn.Parameter:        # torch.load gives Parameters back
            node["param"] = True
            node["grad"] = bool(v.requires_grad)
            self.version = max(self.version, 2)
        elif v.requires_grad:
            node["grad"] = True
            self.version = max(self.version, 2)
        if v.numel() and v.untyped_storage().data_ptr() and not (v.is_conj() or v.is_neg()):
            key = (v.device, v.dtype, v.untyped_storage().data_ptr())
            self.storages.setdefault(key, []).append((v, node, path))
            if key not in self.storage_sections:     # coded after the walk (finish)
                self.storage_sections[key] = self.add_section(path, None, None)
            node["s"] = self.storage_sections[key]
            self.indexed.append(node)
        else:                                    # no storage to share: stored as it is
            node["s"] = self.add_section(path, *self.encode_tensor(v, path), node=node)
        self.by_id[id(v)] = node
        return node

    def meta(self, v: torch.Tensor) -> dict:
        """A meta tensor (a model built on ``device="meta"``), as torch.save keeps it: ``m``
        numbers the distinct ones, so that one met twice loads as one object."""
        self.version = max(self.version, 5)
        node = {"$": "meta", "m": self.metas, "dtype": DTYPE_CODES[v.dtype],
                "shape": list(v.shape), "stride": list(v.stride())}
        if type(v) is torch.nn.Parameter:
            node["param"], node["grad"] = True, bool(v.requires_grad)
        elif v.requires_grad:
            node["grad"] = True
        self.metas += 1
        self.by_id[id(v)] = node
        return node

    def composite(self, v: torch.Tensor, path: str, tag: str, parts: dict, extra: dict) -> dict:
        """A tensor stored as the plain tensors it is made of (each as any tensor is,
        under ``path.NAME`` or ``path.NAME[i]``) and the fields it is rebuilt from."""
        if type(v) is torch.nn.Parameter:
            self.refuse(v, path, f"A {tag} Parameter is not stored: save the tensor.")
        self.version = max(self.version, 4)
        node = {"$": tag, **extra}
        for k, t in parts.items():
            node[k] = [self.tensor(x.detach(), f"{path}.{k}[{i}]") for i, x in enumerate(t)] \
                if type(t) is list else self.tensor(t.detach(), f"{path}.{k}")
        if v.requires_grad:
            node["grad"] = True
        self.by_id[id(v)] = node
        self.alive.append(v)
        return node

    def finish(self) -> int:
        """Encode the storages met during the walk; returns the tree version needed (1:
        every tensor is stored as it is; 2: some are views of a stored storage span; 3:
        some small tensors share a pack; 4: sets, complex numbers, Counters, bytearrays,
        or sparse, nested or quantized tensors)."""
        version = self.version
        packs: dict[tuple, list] = {}        # (dtype, device) -> [(tensor, node)]
        packed, alone = set(), []            # storages in packs; the rest of one dense user
        for key, users in self.storages.items():
            v0, path = users[0][0], self.sections[self.storage_sections[key]][0]
            if len(users) == 1 and v0.stride() == _dense_strides(v0.shape):
                if self.pack is not None and self.pack(path, v0):
                    packed.add(key)
                elif key[0].type == "cpu":
                    alone.append((path, v0.detach()))
        if self.ahead is not None:
            self.ahead(alone)
        for key, users in self.storages.items():
            s = self.storage_sections[key]
            path = self.sections[s][0]
            v0 = users[0][0]
            dense = v0.stride() == _dense_strides(v0.shape)
            if key in packed:
                packs.setdefault((v0.dtype, str(v0.device)), []).append((v0, users[0][1]))
                self.sections[s] = None
                continue
            views = {(v.storage_offset(), tuple(v.shape), tuple(v.stride())) for v, _, _ in users}
            if len(views) == 1 and dense:    # as in format v1
                self.sections[s] = (path, *self.encode_tensor(v0, path))
                for k, (_, node, _) in enumerate(users):
                    if k:
                        node["obj"] = k
            else:                            # the span of storage the views cover, once
                lo = min(o for o, _, _ in views)
                hi = max(o + sum((n - 1) * st for n, st in zip(shape, stride)) + 1
                         for o, shape, stride in views)
                span = torch.as_strided(v0.detach(), (hi - lo,), (1,), lo)
                self.sections[s] = (path, *self.encode_tensor(span, path, v0.device))
                for k, (v, node, _) in enumerate(users):
                    node.update(obj=k, offset=v.storage_offset() - lo, shape=list(v.shape),
                                stride=list(v.stride()))
                version = max(version, 2)
        if packs:
            self._pack(packs)
            version = max(version, 3)
        return version

    def _pack(self, packs: dict) -> None:
        """Store each group of ``packs`` as one section (their places in ``sections`` are
        None) and renumber every node's section index."""
        keep = [i for i, sec in enumerate(self.sections) if sec is not None]
        new = {old: i for i, old in enumerate(keep)}
        self.sections[:] = [self.sections[i] for i in keep]     # the list flatten returns
        for node in self.indexed:
            node["s"] = new.get(node["s"], node["s"])
        for (dtype, device), members in packs.items():
            flat = torch.cat([v.detach().reshape(-1) for v, _ in members])
            name = pack_name(DTYPE_CODES[dtype], device)
            s = len(self.sections)
            self.sections.append((name, *self.encode_tensor(flat, name, encode=self.encode_pack)))
            at = 0
            for k, (v, node) in enumerate(members):
                node.update(s=s, obj=k, offset=at, shape=list(v.shape),
                            stride=list(_dense_strides(v.shape)), packed=True)
                at += v.numel()

    def encode_tensor(self, v: torch.Tensor, path: str, device=None,
                      encode: LeafEncoder | None = None) -> tuple[dict, Any]:
        t = v.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.resolve_conj().resolve_neg().contiguous()
        enc = (encode or self.encode_leaf)(path, t)
        meta = {
            "kind": "tensor",
            "dtype": DTYPE_CODES[t.dtype],
            "shape": list(t.shape),
            "nbytes": t.numel() * t.element_size(),
            "codec": enc.codec,
            "device": str(v.device if device is None else device),
        }
        if enc.params:
            meta["codec_params"] = enc.params
        return meta, enc.payload

    def ndarray(self, v: np.ndarray, path: str):
        if id(v) in self.by_id:
            return self.by_id[id(v)]
        code = dtypes.numpy_code(v.dtype)
        if code is None:
            raise UnsupportedDtypeError(
                f"cannot save {path}: numpy dtype {v.dtype.str} is not supported (object "
                "and structured arrays are not); convert with arr.astype(...)"
            )
        spelled = dtypes.numpy_spelled(code)
        if spelled:
            self.version = max(self.version, 6)
        self.alive.append(v)
        node = {"$": "ndarray"}
        if self.encode_array is not None and v.size and not spelled:
            meta, data = self.coded_array(v, path)
        else:
            data = np.ascontiguousarray(v).reshape(-1).view(np.uint8)
            meta = {"kind": "ndarray", "dtype": code, "shape": list(v.shape),
                    "nbytes": v.nbytes, "codec": "raw"}
        node["s"] = self.add_section(path, meta, data, node=node)
        self.by_id[id(v)] = node
        return node

    def coded_array(self, v: np.ndarray, path: str) -> tuple[dict, Any]:
        """A numeric array's section, coded as a tensor by ``encode_array`` (or raw)."""
        a = np.ascontiguousarray(v)
        if not a.flags.writeable:            # torch.from_numpy warns about read-only arrays
            a = a.copy()
        meta, data = self.encode_tensor(torch.from_numpy(a), path, encode=self.encode_array)
        del meta["device"]
        meta["kind"] = "ndarray"
        if meta["codec"] != "raw":
            self.version = max(self.version, 6)
        return meta, data

    def bytes(self, v: bytes | bytearray, path: str):
        node = self.by_id.get(id(v))
        if node is None:
            self.alive.append(v)
            node = self.by_id[id(v)] = {"$": "bytes"}
            data = v
            if type(v) is bytearray:         # loads as one bytearray, wherever it is met
                node["mutable"] = True
                self.version = max(self.version, 4)
                data = bytes(v)              # its bytes as they are now
            node["s"] = self.add_section(path, {"kind": "bytes"}, data, node=node)
        return node
