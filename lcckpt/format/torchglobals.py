"""What lcckpt lets torch's weights-only unpickler read beyond torch's own allowlist:
numpy arrays, scalars and scalar types, ``argparse.Namespace``, dates, times and
durations, pathlib paths, ``range``, ``slice``, ``Ellipsis``, ``Fraction`` and
``Decimal``, without running code from the file.

Training scripts pickled these freely (``best_acc: np.float64``, observations as an
array, the run's ``args``, when it ran, where it wrote); torch's weights-only load
refuses them. A Namespace is made empty and given its attributes, as pickle would; the
``datetime``, ``pathlib``, ``range``, ``slice``, ``Fraction`` and ``Decimal`` classes are
called with the values their pickles hold, which they check, and touch nothing outside
the process. A numpy scalar type (``np.float32`` in a config) is the class itself, and
called makes only a scalar. Two stay refused: a ``deque`` (torch's unpickler cannot
append to one) and a ``UUID`` (its pickle sets its number on an empty object, unchecked:
a forged one would load as a UUID that is not one). Numpy values take three numpy callables
and the dtypes' own state: :data:`GLOBALS` allows guarded stand-ins for the callables,
under their pickled names (numpy 2's ``numpy._core`` and numpy 1's ``numpy.core``), and the
dtype classes, so that their state may be set:

- a dtype is made only if it holds no Python objects, and no structured dtype's state
  can be set (its class is not allowed);
- an array starts empty, of no subclass; its shape, dtype and bytes come from its state,
  which numpy checks against each other, so nothing larger than the file is allocated
  (``numpy.ndarray`` itself is not callable from the file);
- a scalar is made from its dtype and exactly that dtype's number of bytes;
- ``bytes()`` (an empty array's data) is called with no argument only.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import decimal
import fractions
import pathlib
import threading
from pickle import UnpicklingError

import numpy as np
import torch

try:
    from numpy._core import multiarray as _multiarray      # numpy 2
except ImportError:                                         # numpy 1.26
    from numpy.core import multiarray as _multiarray


def _dtype(spec, align=False, copy=False) -> np.dtype:
    dt = np.dtype(spec, align, copy)
    if dt.hasobject:
        raise UnpicklingError("a numpy dtype of Python objects needs full unpickling")
    return dt


class _NdarrayName:
    """What the file's ``numpy.ndarray`` stands for: a name to pass to
    :func:`_reconstruct`, not a class to call."""


def _reconstruct(subtype, shape, dtype) -> np.ndarray:
    if subtype is not _NdarrayName:
        raise UnpicklingError(f"numpy array of type {subtype!r} needs full unpickling")
    return np.ndarray((0,), np.uint8)      # its state sets shape, dtype and bytes


def _empty_bytes(*args) -> bytes:
    """``bytes()``, which an empty array's pickle calls for its data; never ``bytes(n)``."""
    if args:
        raise UnpicklingError("bytes(...) with arguments needs full unpickling")
    return b""


def _scalar(dtype, data=None):
    if type(dtype) not in _DTYPE_TYPES or type(data) is not bytes \
            or len(data) != dtype.itemsize:
        raise UnpicklingError("invalid numpy scalar in the pickle")
    return _multiarray.scalar(dtype, data)


_DTYPES = [np.dtype(c) for c in "?bBhHiIlLqQefdgFDGSUMm"]    # numbers, bool, bytes, str, dates
_DTYPE_TYPES = {type(dt) for dt in _DTYPES}
GLOBALS = [(_dtype, "numpy.dtype"), (_NdarrayName, "numpy.ndarray"),
           (np.ndarray, "lcckpt.format.torchglobals.ndarray"),      # may be built (setstate)
           (_empty_bytes, "builtins.bytes"), (_empty_bytes, "__builtin__.bytes"),
           (argparse.Namespace, "argparse.Namespace")]
GLOBALS += [(f, f"{module}.{name}")
            for module in ("numpy._core.multiarray", "numpy.core.multiarray")
            for f, name in ((_reconstruct, "_reconstruct"), (_scalar, "scalar"))]
GLOBALS += [(t, f"lcckpt.format.torchglobals.{t.__name__}") for t in _DTYPE_TYPES]
GLOBALS += [(c, f"datetime.{c.__name__}") for c in (datetime.datetime, datetime.date,
                                                     datetime.time, datetime.timedelta,
                                                     datetime.timezone)]
GLOBALS += [(c, f"{module}.{c.__name__}") for module in ("pathlib", "pathlib._local")
            for c in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.PureWindowsPath,
                      pathlib.WindowsPath)]
GLOBALS += [(range, "builtins.range"), (slice, "builtins.slice"),
            (Ellipsis, "builtins.Ellipsis"), (fractions.Fraction, "fractions.Fraction"),
            (decimal.Decimal, "decimal.Decimal")]
GLOBALS += [(dt.type, f"numpy.{dt.type.__name__}") for dt in _DTYPES]     # scalar types


_LOCK = threading.Lock()
_users = 0
_allowing = torch.serialization.safe_globals(GLOBALS)


@contextlib.contextmanager
def allowed():
    """:data:`GLOBALS` in torch's allowlist while any thread is inside (torch keeps one
    list per process: a plain ``with safe_globals(...)`` that ends in one thread would
    take them away from another thread's load still under way)."""
    global _users
    with _LOCK:
        if _users == 0:
            _allowing.__enter__()
        _users += 1
    try:
        yield
    finally:
        with _LOCK:
            _users -= 1
            if _users == 0:
                _allowing.__exit__(None, None, None)
