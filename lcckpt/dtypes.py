"""Element types: safetensors-style names, numpy/torch equivalents, blob codes.

Arrays travel through the kernels as numpy; dtypes numpy lacks (bfloat16, float8) travel
as same-width unsigned integer views and come back as torch tensors.
"""

from dataclasses import dataclass

import numpy as np
import torch

from .errors import UnsupportedDtypeError


@dataclass(frozen=True)
class DType:
    name: str            # safetensors name, e.g. "BF16"
    code: int            # byte stored in blobs
    torch: torch.dtype
    numpy: np.dtype      # the dtype itself, or its same-width unsigned carrier
    native: bool         # numpy has this dtype
    kind: str            # "float", "int", "bool", "complex"

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize


def _d(name, code, tdt, ndt, native, kind):
    return DType(name, code, tdt, np.dtype(ndt), native, kind)


_ALL = [
    _d("F32", 0, torch.float32, np.float32, True, "float"),
    _d("F64", 1, torch.float64, np.float64, True, "float"),
    _d("F16", 2, torch.float16, np.float16, True, "float"),
    _d("BF16", 3, torch.bfloat16, np.uint16, False, "float"),
    _d("I8", 4, torch.int8, np.int8, True, "int"),
    _d("U8", 5, torch.uint8, np.uint8, True, "int"),
    _d("I16", 6, torch.int16, np.int16, True, "int"),
    _d("I32", 8, torch.int32, np.int32, True, "int"),
    _d("I64", 10, torch.int64, np.int64, True, "int"),
    _d("BOOL", 12, torch.bool, np.bool_, True, "bool"),
    _d("C64", 13, torch.complex64, np.complex64, True, "complex"),
    _d("C128", 14, torch.complex128, np.complex128, True, "complex"),
]
for _name, _code, _attr, _ndt in (("U16", 7, "uint16", np.uint16), ("U32", 9, "uint32", np.uint32),
                                  ("U64", 11, "uint64", np.uint64)):
    if hasattr(torch, _attr):
        _ALL.append(_d(_name, _code, getattr(torch, _attr), _ndt, True, "int"))
for _name, _code, _attr in (("F8_E4M3", 15, "float8_e4m3fn"), ("F8_E5M2", 16, "float8_e5m2")):
    if hasattr(torch, _attr):
        _ALL.append(_d(_name, _code, getattr(torch, _attr), np.uint8, False, "float"))

BY_NAME = {d.name: d for d in _ALL}
BY_CODE = {d.code: d for d in _ALL}
BY_TORCH = {d.torch: d for d in _ALL}
BY_NUMPY = {d.numpy: d for d in _ALL if d.native}


def of(x) -> DType:
    """The :class:`DType` of a numpy array or torch tensor."""
    try:
        if isinstance(x, torch.Tensor):
            return BY_TORCH[x.dtype]
        return BY_NUMPY[np.dtype(x.dtype)]
    except KeyError:
        raise UnsupportedDtypeError(
            f"dtype {x.dtype} is not supported; supported: {', '.join(sorted(BY_NAME))}") from None


def to_numpy(x) -> tuple[np.ndarray, DType]:
    """A C-contiguous numpy array of ``x`` (carrier view for bf16/fp8) and its DType.

    Tensors and arrays keep their dtype; other array-likes (lists, scalars) go through
    ``np.asarray``.
    """
    if not isinstance(x, (torch.Tensor, np.ndarray)):
        x = np.asarray(x)
    dt = of(x)
    if isinstance(x, torch.Tensor):
        t = x.detach().to("cpu").contiguous()
        if not dt.native:
            t = t.view(torch.uint16 if dt.itemsize == 2 else torch.uint8)
        return t.numpy(), dt
    return np.asarray(x, order="C"), dt          # (ascontiguousarray would make 0-d 1-d)


def to_float_work(a: np.ndarray, dt: DType) -> np.ndarray:
    """The values as the quantizer's working float (fp64 stays fp64, the rest fp32)."""
    if dt.name in ("F32", "F64"):
        return a
    if dt.name == "F16":
        return a.astype(np.float32)
    if dt.native or dt.kind != "float":
        raise UnsupportedDtypeError(f"lossy coding needs a floating dtype, got {dt.name}")
    return torch.from_numpy(a.view(np.uint8).copy()).view(dt.torch).float().numpy()


def from_float_work(w: np.ndarray, dt: DType):
    """Cast working floats back to ``dt``: numpy where numpy has it, else torch."""
    if dt.native:
        return w.astype(dt.numpy, copy=False)
    return torch.from_numpy(w).to(dt.torch)


def from_carrier(a: np.ndarray, dt: DType):
    """Turn a carrier array (raw element bits) back into the user's type."""
    if dt.native:
        return a.view(dt.numpy)
    return torch.from_numpy(a).view(dt.torch)
