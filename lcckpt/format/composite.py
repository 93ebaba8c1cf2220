"""Tensors stored as the plain tensors they are made of (tree version 4): a sparse
tensor as its indices and values, a nested one as its components, a quantized one as its
integers and quantizer (docs/format.md). The save walk (flatten.py) stores the parts as it
stores any tensor, under ``path.NAME``; the load walk (tree.py) rebuilds the tensor from
them with torch's own checks of what it builds, those ``torch.load`` runs, so a damaged
index or quantizer is a ``CorruptDataError``, not a tensor that crashes later."""

from __future__ import annotations

import math

import torch

from ..errors import UnsupportedDtypeError

SPARSE_LAYOUTS = {torch.sparse_coo: "coo", torch.sparse_csr: "csr", torch.sparse_csc: "csc",
                  torch.sparse_bsr: "bsr", torch.sparse_bsc: "bsc"}
QUANTIZED = {torch.qint8: "qint8", torch.quint8: "quint8", torch.qint32: "qint32"}
QUANTIZED_DTYPES = {**QUANTIZED, torch.quint4x2: "quint4x2", torch.quint2x4: "quint2x4"}  # as values
QSCHEMES = ("per_tensor_affine", "per_channel_affine", "per_channel_affine_float_qparams")
_SPARSE = {name: layout for layout, name in SPARSE_LAYOUTS.items()}
_QUANTIZED = {name: dtype for dtype, name in QUANTIZED.items()}
QUANTIZED_BY_NAME = {name: dtype for dtype, name in QUANTIZED_DTYPES.items()}
_INT_REPR = {torch.qint8: torch.int8, torch.quint8: torch.uint8, torch.qint32: torch.int32}


def is_composite(v: torch.Tensor) -> bool:
    return v.layout != torch.strided or v.is_nested or v.is_quantized


def describe(v: torch.Tensor, path: str) -> tuple[str, dict, dict]:
    """``(tag, parts, fields)`` of a sparse, nested or quantized tensor: its node's tag,
    the plain tensors it is stored as (a list for a nested one's components) and the
    node's other fields; ``UnsupportedDtypeError`` for a layout or quantizer not stored."""
    if v.is_nested:
        return "nested", {"v": list(v.detach().unbind())}, \
            {"layout": "jagged" if v.layout == torch.jagged else "strided"}
    if v.is_quantized:
        name, scheme = QUANTIZED.get(v.dtype), str(v.qscheme()).removeprefix("torch.")
        if name is None or scheme not in QSCHEMES:
            raise UnsupportedDtypeError(f"cannot save {path}: a {v.dtype} tensor ({scheme}) "
                                        "is not stored; use x.dequantize()")
        if scheme == "per_tensor_affine":
            return "quantized", {"int": v.int_repr()}, {
                "dtype": name, "scheme": scheme, "scale": float(v.q_scale()),
                "zero_point": int(v.q_zero_point())}
        return "quantized", {"int": v.int_repr(), "scales": v.q_per_channel_scales(),
                             "zero_points": v.q_per_channel_zero_points()}, \
            {"dtype": name, "scheme": scheme, "axis": int(v.q_per_channel_axis())}
    name = SPARSE_LAYOUTS.get(v.layout)
    if name is None:
        raise UnsupportedDtypeError(
            f"cannot save {path}: layout {v.layout} is not stored; use x.to_dense()")
    if name == "coo":
        return "sparse", {"indices": v._indices(), "values": v._values()}, \
            {"layout": name, "size": list(v.shape), "coalesced": bool(v.is_coalesced())}
    compressed, plain = ((v.crow_indices(), v.col_indices()) if name in ("csr", "bsr")
                         else (v.ccol_indices(), v.row_indices()))
    return "sparse", {"compressed": compressed, "plain": plain, "values": v.values()}, \
        {"layout": name, "size": list(v.shape)}


def plain_parts(v: torch.Tensor) -> list:
    """The plain tensors :func:`describe` stores ``v`` as (a writer sizing its header)."""
    try:
        parts = describe(v, "")[1].values()
    except UnsupportedDtypeError:
        return []
    return [t for p in parts for t in (p if type(p) is list else [p])]


def _named(table: dict, name):
    return table.get(name) if type(name) is str else None


class CompositeLoader:
    """The load walk's half: rebuilding the tensor of a composite node. The loader
    provides ``node`` (a child node's value) and its checks ``bad`` and ``fields``."""

    def parts(self, j, path, depth, names, many: bool = False) -> list:
        """The plain tensors a composite node is made of, one per name (``many``: a list
        of them per name)."""
        out = []
        for k in names:
            if (type(j[k]) is list) != many:
                self.bad(path, f"a {j['$']} tensor's {k!r} must be a "
                         + ("list of tensors" if many else "tensor"))
            kids = j[k] if many else [j[k]]
            ts = [self.node(x, f"{path}.{k}", depth + 1) for x in kids]
            if not all(isinstance(t, torch.Tensor) and t.layout == torch.strided
                       and not t.is_nested and not t.is_quantized for t in ts):
                self.bad(path, f"a {j['$']} tensor's parts must be dense tensors")
            ts = [t.detach() for t in ts]
            out.append(ts if many else ts[0])
        return out

    def composite(self, j, path, build):
        """``build()``, with torch's own checks of what it builds (those ``torch.load``
        runs) reported as damage; ``"grad"`` applied."""
        grad = j.get("grad", False)
        if type(grad) is not bool:
            self.bad(path, "'grad' must be a boolean")
        try:
            t = build()
        except (RuntimeError, ValueError, TypeError, IndexError) as e:
            self.bad(path, f"invalid {j['$']} tensor: {(str(e).splitlines() or [repr(e)])[0][:200]}")
        return t.requires_grad_(True) if grad else t

    def sparse(self, j, path, depth):
        """A sparse tensor from its dense parts, checked by torch as ``torch.load`` checks
        one (every index within the size, compressed indices in order)."""
        layout = _named(_SPARSE, j.get("layout"))
        if layout is None:
            self.bad(path, f"unknown sparse layout {j.get('layout')!r:.40}")
        names = ("indices", "values") if layout == torch.sparse_coo \
            else ("compressed", "plain", "values")
        self.fields(j, path, ("layout", "size") + names, ("coalesced", "grad"))
        size, coalesced = j["size"], j.get("coalesced", False)
        if type(size) is not list or len(size) > 64 or \
                not all(type(n) is int and 0 <= n < 2**63 for n in size):
            self.bad(path, "a sparse tensor's size needs a list of at most 64 non-negative ints")
        if type(coalesced) is not bool:
            self.bad(path, "sparse 'coalesced' must be a boolean")
        parts = self.parts(j, path, depth, names)
        if layout == torch.sparse_coo:
            return self.composite(j, path, lambda: torch.sparse_coo_tensor(
                *parts, size, is_coalesced=coalesced, check_invariants=True))
        return self.composite(j, path, lambda: torch.sparse_compressed_tensor(
            *parts, size, layout=layout, check_invariants=True))

    def nested(self, j, path, depth):
        self.fields(j, path, ("layout", "v"), ("grad",))
        layout = _named({"strided": torch.strided, "jagged": torch.jagged}, j["layout"])
        if layout is None or type(j["v"]) is not list:
            self.bad(path, "a nested tensor needs a layout (strided or jagged) and a list")
        kids = self.parts(j, path, depth, ("v",), many=True)[0]
        return self.composite(j, path, lambda: torch.nested.nested_tensor(kids, layout=layout))

    def quantized(self, j, path, depth):
        """A quantized tensor from its integers and quantizer, as torch builds one."""
        scheme = j.get("scheme")
        per_tensor = scheme == "per_tensor_affine"
        names = ("int",) if per_tensor else ("int", "scales", "zero_points")
        self.fields(j, path, ("dtype", "scheme") + names
                + (("scale", "zero_point") if per_tensor else ("axis",)), ("grad",))
        dtype = _named(_QUANTIZED, j["dtype"])
        if dtype is None or scheme not in QSCHEMES:
            self.bad(path, "unknown quantized dtype or scheme")
        ints, *qparams = self.parts(j, path, depth, names)
        if ints.dtype != _INT_REPR[dtype]:
            self.bad(path, f"a {j['dtype']} tensor's integers are {ints.dtype}")
        if per_tensor:
            scale, zero = j["scale"], j["zero_point"]
            if type(scale) is not float or not math.isfinite(scale) or type(zero) is not int:
                self.bad(path, "a quantized tensor needs a finite float scale and an int zero point")
            build = lambda: torch._make_per_tensor_quantized_tensor(ints, scale, zero)  # noqa: E731
        else:
            axis = j["axis"]
            if type(axis) is not int or not 0 <= axis < max(ints.dim(), 1):
                self.bad(path, f"quantization axis {axis!r:.20} out of range")
            build = lambda: torch._make_per_channel_quantized_tensor(ints, *qparams, axis)  # noqa: E731
        t = self.composite(j, path, build)
        if t.dtype != dtype or str(t.qscheme()).removeprefix("torch.") != scheme:
            self.bad(path, f"the integers and quantizer make a {t.dtype} {t.qscheme()} tensor")
        return t

    def qscheme(self, j, path, depth):
        self.fields(j, path, ("v",))
        if j["v"] not in QSCHEMES:
            self.bad(path, f"unknown qscheme {j['v']!r:.40}")
        return getattr(torch, j["v"])
