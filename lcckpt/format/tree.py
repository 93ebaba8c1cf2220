"""The object tree: nested training state <-> a JSON tree plus one data section per leaf.

An object tree (dict, OrderedDict, list, tuple, tensors, numpy arrays and plain values)
becomes a typed JSON tree for the container header; every tensor, array and bytes value
becomes one data section. Nothing is pickled, so loading never runs code from the file;
values outside that vocabulary are refused at save time, naming their key path, because
silently pickling them would bring the unsafety back.

How a tensor leaf is coded is not decided here: :func:`flatten` calls the leaf encoder
it is given and :func:`unflatten` the leaf decoder (sections.py has the defaults, the
chain its own). Tensors come back as ``torch.load`` gives them: Parameters stay
Parameters, ``requires_grad`` is kept, and tensors viewing one storage are stored once, as
the span of that storage they cover, with each one's offset, shape and strides, so they
load as views of one storage (transposes keep their strides, a stride-0 ``expand`` costs
its storage, not its size). A tensor that is plainly itself (dense, C-ordered, alone on its
stored span) is stored as in tree version 1, which is what :func:`flatten` then writes.
"""

from __future__ import annotations

import functools
import json
import math
import re
import reprlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..codec import dtypes
from .container import Container
from ..errors import (
    CorruptDataError, InvalidArgumentError, LcckptError, UnsafeObjectError,
    UnsupportedDtypeError,
)
from .sections import Encoded

__all__ = ["MAX_DEPTH", "flatten", "leaves", "load_leaf", "pack_name", "unflatten", "view_of"]

MAX_DEPTH = 64  # levels of containers; a few JSON levels each in the header
DTYPE_CODES: dict[torch.dtype, str] = dtypes.TORCH_NAME   # dtype -> header name

LeafEncoder = Callable[[str, torch.Tensor], Encoded]
LeafDecoder = Callable[[str, Container, int, dict], Any]
PackRule = Callable[[str, torch.Tensor], bool]


def pack_name(dtype_name: str, device: str) -> str:
    """The section name of the pack of small ``dtype_name`` tensors on ``device`` (never a
    key path: those start with ``obj``); a chain tracks the pack under this name."""
    return f"pack[{dtype_name}@{device}]"


def flatten(obj: Any, encode_leaf: LeafEncoder, pack: PackRule | None = None,
            encode_pack: LeafEncoder | None = None
            ) -> tuple[Any, list[tuple[str, dict, Any]], int]:
    """``obj`` as ``(json_tree, sections, tree_version)``; ``encode_leaf`` codes each
    tensor leaf. ``tree_version`` is the lowest tree version that holds ``obj`` (1 unless
    it has Parameters, tensors requiring grad, or views that are not the plain tensor).

    ``pack(key_path, tensor)``: tensors it picks (small ones), when each is alone on its
    storage, are stored in one section per dtype and device (coded by ``encode_pack``,
    default ``encode_leaf``, under the section name :func:`pack_name` gives) instead of
    one section each, and load as separate tensors again (tree version 3). One section
    per tensor costs a header entry and a codec call: 100,000 of them take minutes."""
    saver = _Saver(encode_leaf, pack, encode_pack)
    tree = saver.node(obj, "obj", 0)
    return tree, saver.sections, saver.finish()


def unflatten(tree: Any, c: Container, decode_leaf: LeafDecoder, map_location=None) -> Any:
    """Rebuild the object of ``tree`` from container ``c``; ``decode_leaf`` decodes each
    tensor section (after its dtype, shape and size were validated)."""
    return _Loader(c, decode_leaf, map_location).node(tree, "obj", 0)


def leaves(tree: Any) -> list[tuple[tuple, str, dict]]:
    """Every tensor and array leaf of a stored tree, without decoding any data:
    ``(parts, key_path, node)``; ``parts`` are the dict keys and list/tuple indices on the
    way (``("model", "fc.weight")``), ``key_path`` the unambiguous ``obj["model"]["fc.weight"]``
    form of section names. A leaf met at several paths is listed at each."""
    walker, out = _Loader(None, None, None), []
    stack = [(tree, (), "obj", 0)]
    while stack:
        j, parts, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            _bad(path, f"nested more than {MAX_DEPTH} levels")
        tag = j.get("$") if type(j) is dict else None
        if type(j) is list or tag == "tuple":
            items = j if type(j) is list else j.get("v")
            if type(items) is not list:
                _bad(path, "tuple node needs a list")
            kids = [(x, parts + (i,), f"{path}[{i}]") for i, x in enumerate(items)]
        elif tag in ("dict", "odict"):
            if type(j.get("items")) is not list:
                _bad(path, "dict node needs a list of items")
            kids = []
            for item in j["items"]:
                if type(item) is not list or len(item) != 2:
                    _bad(path, "dict item is not a [key, value] pair")
                k = walker.key(item[0], path, depth + 1)
                kids.append((item[1], parts + (k,), f"{path}[{_key_repr(k)}]"))
        else:
            if tag in ("tensor", "ndarray"):
                out.append((parts, path, j))
            continue
        stack.extend((x, p, kp, depth + 1) for x, p, kp in reversed(kids))
    return out


def load_leaf(node: dict, path: str, c: Container, decode_leaf: LeafDecoder,
              map_location=None):
    """One tensor or array leaf of ``c`` (a node :func:`leaves` listed), validated and
    decoded as :func:`unflatten` would, decoding only the section it needs."""
    return _Loader(c, decode_leaf, map_location).node(node, path, 0)


def view_of(node: dict, section_meta: dict) -> tuple[int, list, list]:
    """``(offset, shape, stride)`` in elements of the section that tensor ``node`` sees."""
    view = _view(node, "tensor")
    if view is not None:
        return view
    shape = list(section_meta.get("shape", ()))
    return 0, shape, list(_dense_strides(shape))


# --------------------------------------------------------------------------- save


_PLAIN_KEY = re.compile(r'[^"\\\x00-\x1f\x7f-\x9f\u2028\u2029]*')


def _key_repr(k) -> str:
    if type(k) is not str:
        return repr(k)
    if _PLAIN_KEY.fullmatch(k):          # what json.dumps would leave as it is, quoted
        return f'"{k}"'
    return json.dumps(k, ensure_ascii=False)


_SUPPORTED = (
    "dict, OrderedDict, list, tuple, torch.Tensor, numpy.ndarray, numpy scalars, int, "
    "float, str, bytes, bool, None, torch.dtype, torch.Size, torch.device"
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
                 encode_pack: LeafEncoder | None = None):
        self.encode_leaf = encode_leaf
        self.pack, self.encode_pack = pack, encode_pack or encode_leaf
        self.indexed: list[dict] = []  # every node holding a section index ("s")
        self.sections: list[tuple[str, dict, Any]] = []
        self.by_id: dict[int, Any] = {}  # id(obj) -> node, for tensors, arrays, bytes
        self.storages: dict[tuple, list] = {}  # (device, dtype, storage) -> [(tensor, node, path)]
        self.storage_sections: dict[tuple, int] = {}  # the same key -> its section
        self.version = 1  # tree version the nodes written so far need
        self.alive: list[Any] = []  # keeps ids unique while saving

    def refuse(self, value, path: str, hint: str = ""):
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
            return [self.node(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]
        if t is tuple:
            items = [self.node(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]
            return {"$": "tuple", "v": items}
        if t is dict:
            return {"$": "dict", "items": self.items(v, path, depth)}
        if t is OrderedDict:
            return self.odict(v, path, depth)
        if isinstance(v, torch.Tensor):
            return self.tensor(v, path)
        if t is np.ndarray:
            return self.ndarray(v, path)
        if isinstance(v, np.generic) and v.dtype.str in dtypes.NUMPY_NAME:
            return {"$": "npscalar", "dtype": dtypes.NUMPY_NAME[v.dtype.str],
                    "hex": v.tobytes().hex()}
        if t is bytes:
            return self.bytes(v, path)
        if t is torch.dtype:
            if v not in DTYPE_CODES:
                raise UnsupportedDtypeError(f"cannot save {path}: dtype {v} is not supported")
            return {"$": "dtype", "v": DTYPE_CODES[v]}
        if t is torch.Size:
            return {"$": "size", "v": list(v)}
        if t is torch.device:
            return {"$": "device", "v": str(v)}
        if isinstance(v, tuple) and hasattr(v, "_fields"):
            self.refuse(v, path, "Convert the namedtuple with tuple(x) or x._asdict().")
        if isinstance(v, (dict, list, tuple, str, int, float, bytes)):
            base = next(b for b in (dict, list, tuple, str, int, float, bytes) if isinstance(v, b))
            name = base.__name__
            self.refuse(v, path, f"It is a subclass of {name}: convert with {name}(x).")
        self.refuse(v, path)

    def items(self, d: dict, path: str, depth: int) -> list:
        out = []
        for k, v in d.items():
            sub = f"{path}[{_key_repr(k)}]"
            out.append([self.key(k, sub, depth + 1), self.node(v, sub, depth + 1)])
        return out

    def key(self, k, path: str, depth: int):
        t = type(k)
        if k is None or t in (bool, int, float, str):
            return self.node(k, path, 0)
        if t is tuple:
            if depth > MAX_DEPTH:
                raise InvalidArgumentError(f"a key of {path} is nested too deeply")
            return {"$": "tuple", "v": [self.key(x, path, depth + 1) for x in k]}
        raise UnsafeObjectError(
            f"cannot save {path}: dict keys must be str, int, float, bool, None or tuples "
            f"of those, not {t.__module__}.{t.__qualname__}"
        )

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
        if type(v) not in (torch.Tensor, torch.nn.Parameter):
            self.refuse(v, path, "Tensor subclasses are not stored: pass x.as_subclass(torch.Tensor).")
        if v.layout != torch.strided:
            raise UnsupportedDtypeError(
                f"cannot save {path}: layout {v.layout} is not stored; use x.to_dense()"
            )
        if v.dtype not in DTYPE_CODES:
            raise UnsupportedDtypeError(
                f"cannot save {path}: dtype {v.dtype} is not supported; "
                f"supported: {', '.join(str(d) for d in DTYPE_CODES)}"
            )
        if v.device.type == "meta":
            raise InvalidArgumentError(f"cannot save {path}: a meta tensor has no data")
        self.alive.append(v)
        node = {"$": "tensor"}
        if type(v) is torch.nn.Parameter:        # torch.load gives Parameters back
            node["param"] = True
            node["grad"] = bool(v.requires_grad)
            self.version = 2
        elif v.requires_grad:
            node["grad"] = True
            self.version = 2
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

    def finish(self) -> int:
        """Encode the storages met during the walk; returns the tree version needed (1:
        every tensor is stored as it is; 2: some are views of a stored storage span; 3:
        some small tensors share a pack)."""
        version = self.version
        packs: dict[tuple, list] = {}        # (dtype, device) -> [(tensor, node)]
        for key, users in self.storages.items():
            s = self.storage_sections[key]
            path = self.sections[s][0]
            v0 = users[0][0]
            dense = v0.stride() == _dense_strides(v0.shape)
            if len(users) == 1 and dense and self.pack is not None and self.pack(path, v0):
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
                version = 2
        if packs:
            self._pack(packs)
            version = 3
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
        code = dtypes.NUMPY_NAME.get(v.dtype.str)
        if code is None:
            raise UnsupportedDtypeError(
                f"cannot save {path}: numpy dtype {v.dtype.str} is not supported (object, "
                "structured and big-endian arrays are not); convert with arr.astype(...)"
            )
        self.alive.append(v)
        data = np.ascontiguousarray(v).reshape(-1).view(np.uint8)
        meta = {"kind": "ndarray", "dtype": code, "shape": list(v.shape), "nbytes": v.nbytes,
                "codec": "raw"}  # fmt: skip
        node = {"$": "ndarray"}
        node["s"] = self.add_section(path, meta, data, node=node)
        self.by_id[id(v)] = node
        return node

    def bytes(self, v: bytes, path: str):
        if id(v) not in self.by_id:
            self.alive.append(v)
            node = self.by_id[id(v)] = {"$": "bytes"}
            node["s"] = self.add_section(path, {"kind": "bytes"}, v, node=node)
        return self.by_id[id(v)]


# --------------------------------------------------------------------------- load


def _bad(path: str, msg: str):
    raise CorruptDataError(f"invalid object tree at {path}: {msg}")


def _fields(j: dict, path: str, required: tuple, optional: tuple = ()) -> None:
    keys = set(j) - {"$"}
    if not set(required) <= keys or not keys <= set(required) | set(optional):
        _bad(path, f"{j['$']!r} node has keys {sorted(keys)}")


def _is_uint(v) -> bool:
    return type(v) is int and v >= 0


def _lookup(table: dict, code):
    return table.get(code) if type(code) is str else None


MAX_INT_HEX = 3500         # ~14,000 bits: below Python's 4,300-digit str() limit
MAX_ELEMENTS = 1 << 48     # per dimension and per tensor: far beyond any real one, and
                           # small enough that no size computed from a shape overflows
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")   # where a file's own device strings may put
                                               # tensors; others need map_location
_DEVICE_RE = re.compile(r"[a-z][a-z0-9_]{0,31}(?::[0-9]{1,6})?")


def _shape(meta: dict, path: str) -> list[int]:
    shape = meta.get("shape")
    if type(shape) is not list or not all(_is_uint(n) for n in shape) or len(shape) > 64:
        _bad(path, f"section shape {shape!r:.80} is not a list of non-negative integers")
    if any(n > MAX_ELEMENTS for n in shape) or math.prod(shape) > MAX_ELEMENTS:
        _bad(path, f"section shape {shape!r:.80} is larger than any tensor can be "
                   f"(at most 2**48 elements)")
    return shape

def _view(j: dict, path: str) -> tuple[int, list, list] | None:
    """A tensor node's ``(offset, shape, stride)`` into its section, or None (the section
    is the tensor itself)."""
    keys = [k for k in ("offset", "shape", "stride") if k in j]
    if not keys:
        return None
    if len(keys) != 3:
        _bad(path, "a tensor view needs offset, shape and stride together")
    offset, shape, stride = j["offset"], j["shape"], j["stride"]
    if not _is_uint(offset) or type(shape) is not list or type(stride) is not list \
            or len(shape) != len(stride) or len(shape) > 64 \
            or not all(_is_uint(n) for n in shape + stride):
        _bad(path, "a tensor view needs a non-negative offset and equally long lists of "
                   "non-negative sizes and strides")
    if math.prod(shape) >= 2**63:
        _bad(path, f"view shape {shape} has too many elements")
    return offset, shape, stride


def _as_view(base: torch.Tensor, view: tuple, path: str) -> torch.Tensor:
    """``base`` (a stored storage span) seen through ``view``, checked to stay inside it."""
    offset, shape, stride = view
    n = base.numel()
    last = offset + sum((k - 1) * st for k, st in zip(shape, stride)) if all(shape) else offset - 1
    if offset > n or last >= n:
        _bad(path, f"view (offset {offset}, shape {shape}, stride {stride}) reaches past "
                   f"the {n} stored elements")
    return base.as_strided(shape, stride, base.storage_offset() + offset)


def _saved_device(meta: dict, path: str) -> str:
    """The device string a section was saved from, well formed (not yet allowed)."""
    loc = meta.get("device", "cpu")
    if type(loc) is not str or not _DEVICE_RE.fullmatch(loc):
        _bad(path, f"device {loc!r:.40} is not a device string such as 'cpu' or 'cuda:0'")
    return loc


def _check_file_device(loc: str, path: str) -> None:
    """A device taken from the file itself (no map_location says otherwise) must be a
    real one lcckpt places tensors on: never 'meta' (the data would be dropped) nor a
    backend whose module would be imported by placing a tensor there."""
    if loc.split(":")[0] not in DEVICE_TYPES:
        raise InvalidArgumentError(
            f"{path} was saved on device {loc!r}, which lcckpt does not place tensors on "
            f"(only {', '.join(DEVICE_TYPES)}); pass map_location='cpu', or a dict such as "
            f"{{{loc!r}: 'cpu'}}")

class _Loader:
    """Walks a JSON tree, validating every node before building its value."""

    def __init__(self, c: Container, decode_leaf: LeafDecoder, map_location):
        self.c = c
        self.decode_leaf = decode_leaf
        self.map_location = map_location
        self.sections: dict[int, Any] = {}  # section index -> decoded value
        self.objects: dict[tuple, Any] = {}  # (section, obj) -> tensor object
        self.handlers = {
            "int": self.int_, "float": self.float_, "tuple": self.tuple_, "dict": self.dict_,
            "odict": self.dict_, "tensor": self.tensor, "ndarray": self.ndarray,
            "bytes": self.bytes_, "npscalar": self.npscalar, "dtype": self.dtype,
            "size": self.size, "device": self.device,
        }  # fmt: skip

    def node(self, j, path: str, depth: int):
        if depth > MAX_DEPTH:
            _bad(path, f"nested more than {MAX_DEPTH} levels")
        t = type(j)
        if j is None or t in (bool, int, float, str):
            return j
        if t is list:
            return [self.node(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(j)]
        if t is not dict or type(j.get("$")) is not str or j["$"] not in self.handlers:
            _bad(path, f"unknown node {reprlib.repr(j)}")
        return self.handlers[j["$"]](j, path, depth)

    def int_(self, j, path, depth):
        _fields(j, path, ("hex",))
        if type(j["hex"]) is not str or not re.fullmatch(r"-?0x[0-9a-f]+", j["hex"]):
            _bad(path, "int node needs a hex string")
        if len(j["hex"]) > MAX_INT_HEX:       # Python could not even print such an int
            _bad(path, f"int of {len(j['hex'])} hex digits; at most {MAX_INT_HEX} load")
        return int(j["hex"], 16)

    def float_(self, j, path, depth):
        _fields(j, path, ("v",))
        if j["v"] not in ("nan", "inf", "-inf"):
            _bad(path, f"float node holds {j['v']!r:.40}")
        return float(j["v"])

    def tuple_(self, j, path, depth):
        _fields(j, path, ("v",))
        if type(j["v"]) is not list:
            _bad(path, "tuple node needs a list")
        return tuple(self.node(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(j["v"]))

    def key(self, j, path, depth):
        if depth > MAX_DEPTH:
            _bad(path, f"dict key nested more than {MAX_DEPTH} levels")
        t = type(j)
        if j is None or t in (bool, int, float, str):
            return j
        if t is dict and j.get("$") in ("int", "float", "tuple"):
            if j["$"] != "tuple":
                return self.node(j, path, 0)
            _fields(j, path, ("v",))
            if type(j["v"]) is list:
                return tuple(self.key(x, path, depth + 1) for x in j["v"])
        _bad(path, f"invalid dict key {reprlib.repr(j)}")

    def dict_(self, j, path, depth):
        ordered = j["$"] == "odict"
        _fields(j, path, ("items",), ("metadata",) if ordered else ())
        items = j["items"]
        if type(items) is not list:
            _bad(path, "dict node needs a list of items")
        out = OrderedDict() if ordered else {}
        for item in items:
            if type(item) is not list or len(item) != 2:
                _bad(path, "dict item is not a [key, value] pair")
            k = self.key(item[0], path, depth + 1)
            sub = f"{path}[{_key_repr(k)}]"
            if k in out:
                _bad(sub, "duplicate key")
            out[k] = self.node(item[1], sub, depth + 1)
        if "metadata" in j:
            out._metadata = self.node(j["metadata"], f"{path}._metadata", depth + 1)
        return out

    def section(self, j, path, kind: str) -> tuple[int, dict]:
        s = j.get("s")
        if not _is_uint(s) or s >= len(self.c.sections):
            _bad(path, f"section index {s!r} out of range")
        meta = self.c.sections[s]["meta"]
        if meta.get("kind") != kind:
            _bad(path, f"section {s} holds {meta.get('kind')!r}, expected {kind!r}")
        return s, meta

    def tensor(self, j, path, depth):
        _fields(j, path, ("s",), ("obj", "offset", "shape", "stride", "param", "grad", "packed"))
        s, meta = self.section(j, path, "tensor")
        obj = j.get("obj", 0)
        if not _is_uint(obj):
            _bad(path, "tensor obj is not a non-negative integer")
        if (s, obj) in self.objects:
            return self.objects[(s, obj)]
        view = _view(j, path)
        packed = j.get("packed", False)
        if type(packed) is not bool or (packed and view is None):
            _bad(path, "packed must be a boolean, on a node with offset, shape and stride")
        if s not in self.sections:
            base = self.sections[s] = self.place(self.decode_tensor(s, meta, path), meta, path)
            t = base if view is None else _as_view(base, view, path)
        else:  # another tensor object viewing the same storage
            base = self.sections[s]
            t = base.view(base.shape) if view is None else _as_view(base, view, path)
        if packed:                           # a small tensor of a pack: its own storage
            t = t.clone()
        param, grad = j.get("param", False), j.get("grad", False)
        if type(param) is not bool or type(grad) is not bool:
            _bad(path, "tensor param and grad must be booleans")
        if param:
            t = torch.nn.Parameter(t, requires_grad=grad)
        elif grad:
            if not t.dtype.is_floating_point and not t.dtype.is_complex:
                _bad(path, f"a {t.dtype} tensor cannot require grad")
            t = t.detach().requires_grad_(True)
        self.objects[(s, obj)] = t
        return t

    def decode_tensor(self, s: int, meta: dict, path: str) -> torch.Tensor:
        dtype = _lookup(dtypes.NAME_TORCH, meta.get("dtype"))
        if dtype is None:
            _bad(path, f"unknown tensor dtype {meta.get('dtype')!r:.40}")
        shape = _shape(meta, path)
        nbytes = math.prod(shape) * dtype.itemsize
        if meta.get("nbytes") != nbytes:
            _bad(path, f"nbytes {meta.get('nbytes')!r} does not match dtype and shape ({nbytes})")
        name = meta.get("codec")
        if type(meta.get("codec_params", {})) is not dict:
            _bad(path, "codec_params is not an object")
        try:
            out = self.decode_leaf(path, self.c, s, meta)
        except LcckptError:
            raise
        except Exception as e:
            raise CorruptDataError(
                f"codec {name!r:.40} could not decode {path}: {type(e).__name__}: {e}"
            ) from e
        if isinstance(out, np.ndarray):
            if not out.flags.writeable or not out.flags.c_contiguous:
                out = out.copy()
            if out.dtype.str not in dtypes.NUMPY_NAME:
                _bad(path, f"codec {name!r} returned numpy dtype {out.dtype}")
            out = torch.from_numpy(out)
        if not isinstance(out, torch.Tensor) or out.dtype != dtype or list(out.shape) != shape:
            _bad(path, f"codec {name!r} returned a {type(out).__name__}, not a {dtype} {shape} tensor")
        return out

    def place(self, t: torch.Tensor, meta: dict, path: str) -> torch.Tensor:
        loc = _saved_device(meta, path)
        ml = self.map_location
        if ml is None:
            target = loc
        elif isinstance(ml, (str, torch.device)):
            target = ml
        elif isinstance(ml, dict):
            target = ml.get(loc, loc)
        elif callable(ml):
            res = ml(t.untyped_storage(), loc)
            if res is None:
                target = loc
            else:
                if isinstance(res, torch.TypedStorage):
                    res = res.untyped()
                if not isinstance(res, torch.UntypedStorage):
                    raise InvalidArgumentError("a map_location function must return a storage or None")
                out = torch.empty(0, dtype=t.dtype, device=res.device)
                return out.set_(res, 0, t.shape, t.stride())
        else:
            raise InvalidArgumentError(
                "map_location must be None, a device string, a torch.device, a dict or a function"
            )
        if target is loc:                    # not mapped: the file decides
            _check_file_device(loc, path)
        try:
            device = torch.device(target)
            return t if device.type == "cpu" else t.to(device)
        except Exception as e:                # torch reports a missing backend many ways
            raise InvalidArgumentError(
                f"cannot place {path} (saved on {loc}) on {target}: {e}. "
                "Pass map_location='cpu' or a dict such as {'cuda:1': 'cuda:0'}."
            ) from e

    def ndarray(self, j, path, depth):
        _fields(j, path, ("s",))
        s, meta = self.section(j, path, "ndarray")
        if s not in self.sections:
            dtype = _lookup(dtypes.NAME_NUMPY, meta.get("dtype"))
            if dtype is None:
                _bad(path, f"unknown array dtype {meta.get('dtype')!r:.40}")
            shape = _shape(meta, path)
            nbytes = math.prod(shape) * dtype.itemsize
            length = self.c.sections[s]["length"]
            if meta.get("nbytes") != nbytes or length != nbytes or meta.get("codec") != "raw":
                _bad(path, "array section size or codec does not match its dtype and shape")
            arr = np.empty(shape, dtype=dtype.newbyteorder("="))
            self.c.read_into(s, arr.reshape(-1).view(np.uint8) if nbytes else bytearray())
            self.sections[s] = arr
        return self.sections[s]

    def bytes_(self, j, path, depth):
        _fields(j, path, ("s",))
        s, _ = self.section(j, path, "bytes")
        if s not in self.sections:
            self.sections[s] = bytes(self.c.data(s))
        return self.sections[s]

    def npscalar(self, j, path, depth):
        _fields(j, path, ("dtype", "hex"))
        dtype = _lookup(dtypes.NAME_NUMPY, j["dtype"])
        h = j["hex"]
        if dtype is None or type(h) is not str or not re.fullmatch(r"(?:[0-9a-f]{2})*", h):
            _bad(path, "invalid numpy scalar")
        raw = bytes.fromhex(h)
        if len(raw) != dtype.itemsize:
            _bad(path, "numpy scalar has the wrong size")
        return np.frombuffer(raw, dtype=dtype)[0]

    def dtype(self, j, path, depth):
        _fields(j, path, ("v",))
        dtype = _lookup(dtypes.NAME_TORCH, j["v"])
        if dtype is None:
            _bad(path, f"unknown dtype {j['v']!r:.40}")
        return dtype

    def size(self, j, path, depth):
        _fields(j, path, ("v",))
        if type(j["v"]) is not list or len(j["v"]) > 64 or \
                not all(type(n) is int and -(2**63) <= n < 2**63 for n in j["v"]):
            _bad(path, "torch.Size needs a list of at most 64 64-bit ints")
        try:
            return torch.Size(j["v"])
        except (ValueError, OverflowError, RuntimeError) as e:
            _bad(path, f"invalid torch.Size: {e}")

    def device(self, j, path, depth):
        _fields(j, path, ("v",))
        try:
            if type(j["v"]) is not str or not _DEVICE_RE.fullmatch(j["v"]):
                raise TypeError("not a device string such as 'cpu' or 'cuda:0'")
            return torch.device(j["v"])
        except (RuntimeError, TypeError, ValueError) as e:
            _bad(path, f"invalid device: {e}")
