"""Element types: the one table of names, numpy/torch equivalents and blob codes.

Names are safetensors' where safetensors has one; files (container headers and blobs)
store names or codes, never torch's or numpy's own spellings (except numpy arrays of
strings, bytes, dates and big-endian numbers, whose width, unit and byte order only
numpy's spelling says: :func:`numpy_code`). Every torch dtype has a
name (:data:`TORCH_NAME`); the tensor codec handles the subset in :data:`BY_NAME`. Arrays
travel through the kernels as numpy; dtypes numpy lacks (bfloat16, float8) travel as
same-width unsigned integer views and come back as torch tensors.
"""

import re
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import LcckptError, UnsupportedDtypeError


# torch dtype attribute -> name; those this torch build lacks are skipped
_NAMES = [
    ("float64", "F64"), ("float32", "F32"), ("float16", "F16"), ("bfloat16", "BF16"),
    ("int64", "I64"), ("int32", "I32"), ("int16", "I16"), ("int8", "I8"),
    ("uint64", "U64"), ("uint32", "U32"), ("uint16", "U16"), ("uint8", "U8"),
    ("bool", "BOOL"), ("complex128", "C128"), ("complex64", "C64"), ("complex32", "C32"),
    ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"), ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
    ("float8_e8m0fnu", "F8_E8M0"), ("float4_e2m1fn_x2", "F4_E2M1FN_X2"),
]  # fmt: skip
TORCH_NAME: dict[torch.dtype, str] = {
    getattr(torch, attr): name for attr, name in _NAMES if hasattr(torch, attr)
}
NAME_TORCH = {name: dtype for dtype, name in TORCH_NAME.items()}
# numpy dtype.str (explicit byte order) -> name, for numpy arrays stored as themselves
NUMPY_NAME = {
    "<f8": "F64", "<f4": "F32", "<f2": "F16", "<i8": "I64", "<i4": "I32", "<i2": "I16",
    "|i1": "I8", "<u8": "U64", "<u4": "U32", "<u2": "U16", "|u1": "U8", "|b1": "BOOL",
    "<c16": "C128", "<c8": "C64",
}  # fmt: skip
NAME_NUMPY = {name: np.dtype(s) for s, name in NUMPY_NAME.items()}
# numpy dtypes without a name above, stored under numpy's own dtype.str (tree version 6):
# fixed-width strings and bytes, datetime64/timedelta64 (any unit), big-endian numbers
_NUMPY_SPELLED = re.compile(
    r"[<>]U\d{1,9}|\|S\d{1,9}"
    r"|[<>][Mm]8(?:\[\d{0,9}(?:Y|M|W|D|h|m|s|ms|us|ns|ps|fs|as)\])?"
    r"|>(?:f2|f4|f8|i2|i4|i8|u2|u4|u8|c8|c16)")


def numpy_code(dt: np.dtype) -> str | None:
    """The code a numpy array or scalar of dtype ``dt`` is stored under: a name of
    :data:`NUMPY_NAME`, or numpy's ``dtype.str`` for the types it lacks (``"<U7"``,
    ``"|S3"``, ``"<M8[ns]"``, ``">f4"``); None for object, structured and other dtypes."""
    code = NUMPY_NAME.get(dt.str)
    if code is None and dt.names is None and dt.subdtype is None \
            and _NUMPY_SPELLED.fullmatch(dt.str):
        code = dt.str
    return code


def numpy_dtype(code) -> np.dtype | None:
    """The numpy dtype of a stored ``code`` (see :func:`numpy_code`), or None if ``code``
    is not one: a file's spelling is parsed only once it matches the allowed forms, and
    only if numpy spells the parsed dtype back the same way."""
    if type(code) is not str:
        return None
    dt = NAME_NUMPY.get(code)
    if dt is None and _NUMPY_SPELLED.fullmatch(code):
        try:
            dt = np.dtype(code)
        except (TypeError, ValueError):
            return None
        if dt.str != code:
            return None
    return dt


def numpy_spelled(code: str) -> bool:
    """Whether ``code`` is numpy's own spelling (a file that holds one is tree version 6)."""
    return code not in NAME_NUMPY


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


# the codec's dtypes: name, blob code, numpy dtype or carrier, numpy has it, kind
_CODEC = [
    ("F32", 0, np.float32, True, "float"), ("F64", 1, np.float64, True, "float"),
    ("F16", 2, np.float16, True, "float"), ("BF16", 3, np.uint16, False, "float"),
    ("I8", 4, np.int8, True, "int"), ("U8", 5, np.uint8, True, "int"),
    ("I16", 6, np.int16, True, "int"), ("U16", 7, np.uint16, True, "int"),
    ("I32", 8, np.int32, True, "int"), ("U32", 9, np.uint32, True, "int"),
    ("I64", 10, np.int64, True, "int"), ("U64", 11, np.uint64, True, "int"),
    ("BOOL", 12, np.bool_, True, "bool"),
    ("C64", 13, np.complex64, True, "complex"), ("C128", 14, np.complex128, True, "complex"),
    ("F8_E4M3", 15, np.uint8, False, "float"), ("F8_E5M2", 16, np.uint8, False, "float"),
]  # fmt: skip
_ALL = [DType(name, code, NAME_TORCH[name], np.dtype(ndt), native, kind)
        for name, code, ndt, native, kind in _CODEC if name in NAME_TORCH]

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
        if isinstance(x, np.ndarray) and not x.dtype.isnative and \
                x.dtype.newbyteorder("=") in BY_NUMPY:
            raise UnsupportedDtypeError(
                f"dtype {x.dtype.str} is not in this machine's byte order; convert "
                "it first: a.astype(a.dtype.newbyteorder('='))") from None
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


def work_name(name: str | None) -> str:
    """The name of the working float of the dtype named ``name`` (:func:`to_float_work`):
    what a chain's references, and its keyframes, hold."""
    return "F64" if name == "F64" else "F32"


def to_float_work(a: np.ndarray, dt: DType) -> np.ndarray:
    """The values as the quantizer's working float (fp64 stays fp64, the rest fp32)."""
    if dt.name in ("F32", "F64"):
        return a
    if dt.name == "F16":
        return a.astype(np.float32)
    if dt.native or dt.kind != "float":
        raise UnsupportedDtypeError(f"lossy coding needs a floating dtype, got {dt.name}")
    if a.size == 0:                  # an empty byte view has stride 0: torch's view refuses
        return np.zeros(a.shape, np.float32)
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


def work_flat(x, shape) -> np.ndarray | None:
    """``x`` as flat working floats (:func:`to_float_work`) if it is a floating tensor or
    array of ``shape``, else None (a delta's direction: ``DeltaEncoder.encode_parts``)."""
    if x is None or tuple(getattr(x, "shape", ())) != tuple(shape):
        return None
    try:
        a, dt = to_numpy(x)
        return to_float_work(a, dt).reshape(-1) if dt.kind == "float" else None
    except LcckptError:
        return None
