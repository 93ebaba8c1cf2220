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

The save walk is flatten.py's; this module loads, and validates every node it reads.
"""

from __future__ import annotations

import math
import re
import reprlib
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..codec import dtypes
from .composite import CompositeLoader
from .container import Container
from ..errors import (
    CorruptDataError, InvalidArgumentError, LcckptError,
)
from .flatten import (
    FACTORIES, MAX_DEPTH, LeafEncoder, Lookahead, PackRule, _dense_strides, key_repr,
    flatten, pack_name,
)   # the save half (flatten.py), one tree API for both halves
from .stdlib import TAGS as STDLIB_TAGS, StdlibLoader
from .values import DEVICE_RE, ValueLoader

__all__ = ["MAX_DEPTH", "LeafDecoder", "LeafEncoder", "Lookahead", "PackRule", "flatten",
           "leaves", "load_leaf", "pack_name", "unflatten", "view_of"]

LeafDecoder = Callable[[str, Container, int, dict], Any]


def unflatten(tree: Any, c: Container, decode_leaf: LeafDecoder, map_location=None,
              fill: Callable | None = None) -> Any:
    """Rebuild the object of ``tree`` from container ``c``; ``decode_leaf`` decodes each
    tensor section (after its dtype, shape and size were validated). ``fill(key_path,
    tensor)``: what the object holds instead of each tensor built (``Into.fill``, a
    load's ``into=`` target filled with its values)."""
    return _Loader(c, decode_leaf, map_location, fill).node(tree, "obj", 0)


def leaves(tree: Any) -> list[tuple[tuple, str, dict]]:
    """Every tensor and array leaf of a stored tree, without decoding any data:
    ``(parts, key_path, node)``; ``parts`` are the dict keys (a namespace's attribute
    names) and list/tuple/deque indices on the way (``("model", "fc.weight")``),
    ``key_path`` the unambiguous ``obj["model"]["fc.weight"]`` form of section names. A
    leaf met at several paths is listed at each."""
    walker, out = _Loader(None, None, None), []
    stack = [(tree, (), "obj", 0)]
    while stack:
        j, parts, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            _bad(path, f"nested more than {MAX_DEPTH} levels")
        tag = j.get("$") if type(j) is dict else None
        if type(j) is list or tag in ("tuple", "deque"):
            items = j if type(j) is list else j.get("v")
            if type(items) is not list:
                _bad(path, f"{tag} node needs a list")
            kids = [(x, parts + (i,), f"{path}[{i}]") for i, x in enumerate(items)]
        elif tag in ("dict", "odict", "counter", "defaultdict", "namespace"):
            if type(j.get("items")) is not list:
                _bad(path, "dict node needs a list of items")
            kids = []
            for item in j["items"]:
                if type(item) is not list or len(item) != 2:
                    _bad(path, "dict item is not a [key, value] pair")
                k = walker.key(item[0], path, depth + 1)
                kids.append((item[1], parts + (k,), f"{path}[{key_repr(k)}]"))
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


# --------------------------------------------------------------------------- load


def _bad(path: str, msg: str):
    raise CorruptDataError(f"invalid object tree at {path}: {msg}")


def _fields(j: dict, path: str, required: tuple, optional: tuple = ()) -> None:
    keys = set(j) - {"$"}
    if not set(required) <= keys or not keys <= set(required) | set(optional):
        _bad(path, f"{j['$']!r} node has keys {sorted(keys)}")


def _is_uint(v) -> bool:
    return type(v) is int and v >= 0


_PLAIN = (bool, int, float, str)     # JSON values that are their own nodes (and None)
_FACTORY_NAMED = {f.__name__: f for f in FACTORIES}   # a defaultdict's factory by its name


def _lookup(table: dict, code):
    return table.get(code) if type(code) is str else None


MAX_INT_HEX = 3500         # ~14,000 bits: below Python's 4,300-digit str() limit
MAX_ELEMENTS = 1 << 48     # per dimension and per tensor: far beyond any real one, and
                           # small enough that no size computed from a shape overflows
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")   # where a file's own device strings may put
                                               # tensors; others need map_location


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
    if type(loc) is not str or not DEVICE_RE.fullmatch(loc):
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

class _Loader(CompositeLoader, ValueLoader, StdlibLoader):
    """Walks a JSON tree, validating every node before building its value."""

    bad, fields = staticmethod(_bad), staticmethod(_fields)    # for CompositeLoader

    def __init__(self, c: Container, decode_leaf: LeafDecoder, map_location, fill=None):
        self.c = c
        self.decode_leaf = decode_leaf
        self.map_location = map_location
        self.fill = fill
        self.sections: dict[int, Any] = {}  # section index -> decoded value
        self.objects: dict[tuple, Any] = {}  # (section, obj) -> tensor object

    # node tag -> method name: a table of bound methods would make each loader a reference
    # cycle, and keep every tensor it decoded alive until the garbage collector ran
    HANDLERS = {
        "int": "int_", "float": "float_", "tuple": "tuple_", "dict": "dict_", "odict": "dict_",
        "counter": "dict_", "defaultdict": "dict_", "tensor": "tensor", "ndarray": "ndarray",
        "bytes": "bytes_", "npscalar": "npscalar", "dtype": "dtype", "size": "size",
        "device": "device", "namespace": "namespace", "datetime": "time_value",
        "date": "time_value", "time": "time_value", "timedelta": "time_value", "path": "fspath",
        "set": "set_", "complex": "complex_", "sparse": "sparse", "nested": "nested",
        "quantized": "quantized", "qscheme": "qscheme", "meta": "meta", **STDLIB_TAGS,
    }  # fmt: skip

    def node(self, j, path: str, depth: int):
        if depth > MAX_DEPTH:
            _bad(path, f"nested more than {MAX_DEPTH} levels")
        t = type(j)
        if j is None or t in (bool, int, float, str):
            return j
        if t is list:
            return self.seq(j, path, depth)
        if t is not dict or type(j.get("$")) is not str or j["$"] not in self.HANDLERS:
            _bad(path, f"unknown node {reprlib.repr(j)}")
        return getattr(self, self.HANDLERS[j["$"]])(j, path, depth)

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
        return tuple(self.seq(j["v"], path, depth))

    def seq(self, j: list, path, depth) -> list:
        """A JSON list's values; plain values are taken as they are, without a key path."""
        if depth >= MAX_DEPTH:                  # node() says what is nested too deeply
            return [self.node(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(j)]
        return [x if x is None or type(x) in _PLAIN else self.node(x, f"{path}[{i}]", depth + 1)
                for i, x in enumerate(j)]

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

    def set_(self, j, path, depth):
        _fields(j, path, ("v",), ("frozen",))
        frozen = j.get("frozen", False)
        if type(j["v"]) is not list or type(frozen) is not bool:
            _bad(path, "set node needs a list of elements and a boolean 'frozen'")
        items = [self.key(x, f"{path}{{...}}", depth + 1) for x in j["v"]]
        out = (frozenset if frozen else set)(items)
        if len(out) != len(items):
            _bad(path, "set holds an element twice")
        return out

    def complex_(self, j, path, depth):
        _fields(j, path, ("re", "im"))
        parts = [self.node(j[k], path, depth + 1) for k in ("re", "im")]
        if any(type(x) is not float for x in parts):
            _bad(path, "complex node needs two floats")
        return complex(*parts)

    def dict_(self, j, path, depth):
        ordered, tag = j["$"] == "odict", j["$"]
        _fields(j, path, ("items",), ("metadata",) if ordered else
                ("factory",) if tag == "defaultdict" else ())
        items = j["items"]
        if type(items) is not list:
            _bad(path, "dict node needs a list of items")
        out = OrderedDict() if ordered else Counter() if tag == "counter" else \
            defaultdict(self._factory(j, path)) if tag == "defaultdict" else {}
        fast = depth < MAX_DEPTH
        for item in items:
            if type(item) is not list or len(item) != 2:
                _bad(path, "dict item is not a [key, value] pair")
            k, v = item
            if fast and (k is None or type(k) in _PLAIN) and (v is None or type(v) in _PLAIN) \
                    and k not in out:
                out[k] = v                      # no key path to build (as seq())
                continue
            k = self.key(k, path, depth + 1)
            sub = f"{path}[{key_repr(k)}]"
            if k in out:
                _bad(sub, "duplicate key")
            out[k] = self.node(v, sub, depth + 1)
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

    @staticmethod
    def _factory(j, path):
        name = j.get("factory")
        factory = _FACTORY_NAMED.get(name) if type(name) is str else None
        if name is not None and factory is None:
            _bad(path, f"a defaultdict's factory must be one of "
                 f"{', '.join(f.__name__ for f in FACTORIES)}, not {name!r:.40}")
        return factory

    def tensor(self, j, path, depth):
        _fields(j, path, ("s",), ("obj", "offset", "shape", "stride", "param", "grad", "packed"))
        s, meta = self.section(j, path, "tensor")
        obj = j.get("obj", 0)
        if not _is_uint(obj):
            _bad(path, "tensor obj is not a non-negative integer")
        if (s, obj) in self.objects:         # met before: the same object, unless this
            t = self.objects[(s, obj)]       # place has a target of its own to fill
            got = t if self.fill is None else self.fill(path, t)
            return t if got is t else self._flags(j, path, got)
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
        if self.fill is not None:
            t = self.fill(path, t)
        t = self.objects[(s, obj)] = self._flags(j, path, t)
        return t

    def meta(self, j, path, depth):
        """A meta tensor: dtype, shape and strides, no data (wherever ``map_location``
        says, as torch.load leaves it); one ``m`` is one object."""
        _fields(j, path, ("m", "dtype", "shape", "stride"), ("param", "grad"))
        dtype, shape, stride = _lookup(dtypes.NAME_TORCH, j["dtype"]), j["shape"], j["stride"]
        if not _is_uint(j["m"]) or dtype is None or type(shape) is not list or \
                type(stride) is not list or len(shape) > 64 or len(stride) != len(shape) or \
                not all(_is_uint(n) and n < MAX_ELEMENTS for n in shape + stride) or \
                math.prod(shape) >= MAX_ELEMENTS:
            _bad(path, "a meta node needs an id, a known dtype, and a shape and strides of "
                       "as many sizes")
        if ("meta", j["m"]) not in self.objects:
            t = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
            self.objects[("meta", j["m"])] = self._flags(j, path, t)
        return self.objects[("meta", j["m"])]

    @staticmethod
    def _flags(j, path, t: torch.Tensor) -> torch.Tensor:
        """``t`` as the node says: a Parameter, or requiring grad."""
        param, grad = j.get("param", False), j.get("grad", False)
        if type(param) is not bool or type(grad) is not bool:
            _bad(path, "tensor param and grad must be booleans")
        if param:
            return torch.nn.Parameter(t, requires_grad=grad)
        if grad:
            if not t.dtype.is_floating_point and not t.dtype.is_complex:
                _bad(path, f"a {t.dtype} tensor cannot require grad")
            return t.detach().requires_grad_(True)
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
        except (LcckptError, MemoryError):     # the machine's limit, not the file's damage
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
            got = f"a {out.dtype} {list(out.shape)} tensor" if isinstance(out, torch.Tensor) \
                else f"a {type(out).__name__}"
            _bad(path, f"codec {name!r} returned {got}, not a {dtype} {shape} tensor (a "
                 "decoder gives the dtype and shape of the section's meta)")
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
            dtype = dtypes.numpy_dtype(meta.get("dtype"))
            if dtype is None or dtype.itemsize == 0:     # numpy makes no "<U0" array
                _bad(path, f"unknown array dtype {meta.get('dtype')!r:.40}")
            shape = _shape(meta, path)
            nbytes = math.prod(shape) * dtype.itemsize
            spelled = dtypes.numpy_spelled(meta["dtype"])
            if meta.get("codec") in ("lossless", "zeros") and not spelled:   # compress=True:
                self.sections[s] = self.decode_tensor(s, meta, path).numpy()  # as a tensor
                return self.sections[s]
            length = self.c.sections[s]["length"]
            if meta.get("nbytes") != nbytes or length != nbytes or meta.get("codec") != "raw":
                _bad(path, "array section size or codec does not match its dtype and shape")
            arr = np.empty(shape, dtype=dtype if spelled else dtype.newbyteorder("="))
            self.c.read_into(s, arr.reshape(-1).view(np.uint8) if nbytes else bytearray())
            self.sections[s] = arr
        return self.sections[s]

    def bytes_(self, j, path, depth):
        _fields(j, path, ("s",), ("mutable",))
        mutable = j.get("mutable", False)
        if type(mutable) is not bool:
            _bad(path, "bytes 'mutable' must be a boolean")
        s, _ = self.section(j, path, "bytes")
        if (s, mutable) not in self.sections:    # a bytearray met twice is one object
            self.sections[(s, mutable)] = (bytearray if mutable else bytes)(self.c.data(s))
        return self.sections[(s, mutable)]
