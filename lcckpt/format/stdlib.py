"""More of the standard library's values, and numpy's dtypes (tree version 7).

A training loop's state holds more than tensors: a ``deque`` of recent losses, a
``range`` or ``slice`` of the data it has seen, a ``Fraction`` or ``Decimal`` in a
schedule, a run's ``UUID``, a numpy dtype in its config. ``torch.save`` pickles them;
here each is a node of fixed fields, rebuilt by its own constructor on load, so a file
still runs no code of its own. The save walk (flatten.py) makes the nodes with
:func:`node_of`; the load walk reads them with :class:`StdlibLoader`, a mixin of the
loader in tree.py, which provides ``bad``, ``fields``, ``node`` and ``seq``.
"""

from __future__ import annotations

import decimal
import fractions
import re
import uuid
from collections import deque
from collections.abc import Callable

import numpy as np

from ..codec import dtypes

TYPES = {deque, range, slice, fractions.Fraction, decimal.Decimal, uuid.UUID, type(Ellipsis)}
TAGS = {"deque": "deque_", "range": "range_", "slice": "slice_", "ellipsis": "ellipsis",
        "fraction": "fraction", "decimal": "decimal_", "uuid": "uuid_", "npdtype": "npdtype"}
_UUID_HEX = re.compile(r"[0-9a-f]{32}")


def holds(v) -> bool:
    """Whether :func:`node_of` stores ``v``: a value of :data:`TYPES`, a numpy dtype, or a
    numpy scalar type (``np.float32`` itself, as a config names it)."""
    return type(v) in TYPES or isinstance(v, np.dtype) or \
        (isinstance(v, type) and issubclass(v, np.generic))


def node_of(v, part: Callable, items: Callable) -> dict:
    """The node of a value :func:`holds` takes. ``part(x, where)`` is the node of a value
    it holds (``where`` extends the key path), ``items(xs)`` the nodes of a deque's items.
    ValueError (with what to do) for a numpy dtype that has no code."""
    t = type(v)
    if t is deque:
        node = {"$": "deque", "v": items(list(v))}
        if v.maxlen is not None:
            node["maxlen"] = v.maxlen
        return node
    if t is range or t is slice:
        return {"$": t.__name__, "v": [part(getattr(v, k), f".{k}")
                                      for k in ("start", "stop", "step")]}
    if t is fractions.Fraction:
        return {"$": "fraction", "v": [part(v.numerator, ".numerator"),
                                       part(v.denominator, ".denominator")]}
    if t is decimal.Decimal:
        return {"$": "decimal", "v": str(v)}
    if t is uuid.UUID:
        return {"$": "uuid", "hex": v.hex}
    if v is Ellipsis:
        return {"$": "ellipsis"}
    as_type = isinstance(v, type)
    try:
        dt = np.dtype(v)
    except TypeError:
        dt = None
    code = None if dt is None or (as_type and dt.type is not v) else dtypes.numpy_code(dt)
    if code is None:
        raise ValueError(f"numpy dtype {v!r} has no dtype code (docs/format.md lists them; "
                         "object, structured, long double and abstract types have none); "
                         "store its name, str(x), instead")
    return {"$": "npdtype", "v": code, **({"type": True} if as_type else {})}


class StdlibLoader:
    """Handlers of the nodes in :data:`TAGS`, each checking its fields before it builds."""

    def deque_(self, j, path, depth):
        self.fields(j, path, ("v",), ("maxlen",))
        maxlen = j.get("maxlen")
        if type(j["v"]) is not list or (maxlen is not None and not (
                type(maxlen) is int and len(j["v"]) <= maxlen < 2**63)):
            self.bad(path, "deque node needs a list of at most 'maxlen' items")
        return deque(self.seq(j["v"], path, depth), maxlen)

    def _parts(self, j, path, depth, n: int) -> list:
        if type(j["v"]) is not list or len(j["v"]) != n:
            self.bad(path, f"{j['$']} node needs a list of {n} values")
        return [self.node(x, path, depth + 1) for x in j["v"]]

    def range_(self, j, path, depth):
        self.fields(j, path, ("v",))
        start, stop, step = self._parts(j, path, depth, 3)
        if not all(type(x) is int for x in (start, stop, step)) or step == 0:
            self.bad(path, "range node needs three ints, the step not 0")
        return range(start, stop, step)

    def slice_(self, j, path, depth):
        self.fields(j, path, ("v",))
        return slice(*self._parts(j, path, depth, 3))

    def ellipsis(self, j, path, depth):
        self.fields(j, path, ())
        return Ellipsis

    def fraction(self, j, path, depth):
        self.fields(j, path, ("v",))
        num, den = self._parts(j, path, depth, 2)
        if type(num) is not int or type(den) is not int or den <= 0:
            self.bad(path, "fraction node needs two ints, the denominator positive")
        out = fractions.Fraction(num, den)
        if out.denominator != den:             # a writer stores it in lowest terms
            self.bad(path, "fraction is not in lowest terms")
        return out

    def decimal_(self, j, path, depth):
        self.fields(j, path, ("v",))
        try:
            out = decimal.Decimal(j["v"]) if type(j["v"]) is str else None
        except (decimal.InvalidOperation, ValueError):
            out = None
        if out is None or str(out) != j["v"]:  # the writer's spelling, str(x)
            self.bad(path, f"invalid decimal {j['v']!r:.40}")
        return out

    def uuid_(self, j, path, depth):
        self.fields(j, path, ("hex",))
        if type(j["hex"]) is not str or not _UUID_HEX.fullmatch(j["hex"]):
            self.bad(path, "uuid node needs 32 lowercase hex digits")
        return uuid.UUID(hex=j["hex"])

    def npdtype(self, j, path, depth):
        self.fields(j, path, ("v",), ("type",))
        dt, as_type = dtypes.numpy_dtype(j["v"]), j.get("type", False)
        if dt is None or type(as_type) is not bool:
            self.bad(path, f"unknown numpy dtype {j['v']!r:.40}")
        return dt.type if as_type else dt
