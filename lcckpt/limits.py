"""How much memory and work a load may spend: the caller's limits for untrusted input.

A compressed section can describe far more data than it stores (a constant chunk costs
two bytes for 2**24 elements), so a small file can ask for gigabytes. Every load adds up
what the file *declares* it will decode (each tensor's and array's ``nbytes``, each bytes
section's length; nothing for a tensor of zeros stored as such, which loads as untouched
pages, so a file holding a large zero buffer loads) and compares it with the limit
before decoding anything; decoders then refuse a section whose blob does not hold
exactly the declared shape.

The limit (``max_bytes``) of a call is one of:

- an ``int``: at most that many decoded bytes;
- ``None``: no limit (input you trust);
- ``"auto"`` (the global default): what fits in the memory this process can still use
  (:func:`usable_memory`: available RAM, the cgroup's limit, ``RLIMIT_AS``), and at most
  ``AUTO_FLOOR + AUTO_EXPANSION * file size``, so a file under 1 MB decodes to at most
  224 MiB (peak memory of the whole process under 1 GB), while an uncompressed file, or
  trained weights coded losslessly (1.2x fp32, 1.5x bf16: docs/benchmarks.md), always
  load when they fit (a load that declares at most ``AUTO_SMALL``, 16 MiB, is not held
  against the memory left: such a read is too small to matter and too frequent, as in a
  loop of lazy row reads, to pay for reading /proc each time). A chain's delta
  counts only what it brings anew (see ``DeltaCheckpointer.load``), so the 1000x deltas
  of a large state load too;
- omitted: the global default, set with :func:`set_max_bytes`.

The header itself is bounded by fixed limits, before it is parsed: its size, stored and
inflated, and the number of arrays, objects and values it can hold.

Deliberately not here: measuring memory while decoding (declared sizes are enforced
exactly by the decoders instead), and limits of the tensor codec API (``lcckpt.decode``
trusts its caller).
"""

from __future__ import annotations

import os
import threading

try:
    import resource
except ImportError:                      # not on Windows: no RLIMIT_AS to read
    resource = None

from .errors import InvalidArgumentError, ResourceLimitError
from .util import cgroups
from .util.caller import warn_user

__all__ = ["AUTO", "AUTO_EXPANSION", "AUTO_FLOOR", "AUTO_SMALL", "DEFAULT", "MAX_HEADER_BYTES",
           "MAX_HEADER_CONTAINERS", "MAX_HEADER_VALUES", "check", "declared_bytes",
           "get_max_bytes", "is_auto", "parse_max_bytes", "read_stream", "resolve", "set_max_bytes",
           "usable_memory"]

AUTO = "auto"
AUTO_FLOOR = 192 << 20          # decoded bytes any file may ask for
AUTO_EXPANSION = 32             # ... plus this many times its stored size
AUTO_SMALL = 16 << 20           # loads this small are not held against the memory left
# A container header's bytes, as stored and as inflated from a compressed header (an
# inflate stops after this many bytes, whatever the stored size).
MAX_HEADER_BYTES = 64 << 20
# Header parsing: the JSON header's arrays and objects ('[' and '{' bytes), and its values
# (',' and ':' bytes), counted before parsing. A real header needs about 15 of each per
# tensor, so these allow well over 100,000 tensors while keeping a parse under ~1 GB.
MAX_HEADER_CONTAINERS = 1 << 21
MAX_HEADER_VALUES = 1 << 23


class _Default:
    def __repr__(self) -> str:
        return "<the global default>"


DEFAULT = _Default()            # "use the global setting"
_lock = threading.Lock()
_global: int | str | None = AUTO


def _validate(value) -> int | str | None:
    if value is None or value == AUTO:
        return value
    if type(value) is int and value >= 0:
        return value
    raise InvalidArgumentError(
        f"max_bytes must be a non-negative int, None (no limit) or 'auto', got {value!r:.60}")


def set_max_bytes(value) -> int | str | None:
    """Set the default ``max_bytes`` of every load in this process; returns the old one."""
    global _global
    value = _validate(value)
    with _lock:
        old, _global = _global, value
    return old


def get_max_bytes() -> int | str | None:
    """The default ``max_bytes`` of loads in this process."""
    return _global


def _value(max_bytes) -> int | str | None:
    """``max_bytes`` checked, or the global default where it is :data:`DEFAULT`."""
    return _global if max_bytes is DEFAULT else _validate(max_bytes)


def resolve(max_bytes, stored_bytes: int) -> int | None:
    """The decoded-byte limit for a load of ``stored_bytes`` (None: unlimited)."""
    return _resolve(max_bytes, stored_bytes)[0]


def _resolve(max_bytes, stored_bytes: int, memory: bool = True,
             in_place: int = 0) -> tuple[int | None, str]:
    """The limit and how it was set, for the message of a refusal; ``memory=False``
    leaves the memory left out of "auto"; ``in_place`` bytes decode into memory the
    caller holds already (a load's ``into=`` tensors), which the memory left need not."""
    value = _value(max_bytes)
    if value != AUTO:
        return value, f"max_bytes={value}"
    limit = AUTO_FLOOR + AUTO_EXPANSION * stored_bytes
    how = f"the default limit, 'auto': 192 MiB + {AUTO_EXPANSION} x the stored size"
    mem = usable_memory() if memory else None
    if mem is not None and mem[0] + in_place < limit:
        limit = mem[0] + in_place
        how = f"the default limit, 'auto': what {mem[1]} leaves this process" + (
            f", plus {in_place:,} bytes that go into the given tensors" if in_place else "")
    return limit, how


def usable_memory() -> tuple[int, str] | None:
    """About how many more bytes this process can allocate, and what bounds it: the least
    of available RAM, what the cgroup's memory limit leaves and what ``RLIMIT_AS``
    leaves; None where none of them can be read."""
    found = [m for m in (_available_ram(), _cgroup_left(), _rlimit_left()) if m is not None]
    return min(found) if found else None


def _kib_field(path: str, field: str) -> int | None:
    """A ``Field:  123 kB`` line of a /proc file, in bytes."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def warn_if_short(nbytes: int, what: str) -> None:
    """Warn when ``nbytes`` more would not fit in what this process can still allocate:
    in a container or a batch job, running out is the kernel's kill, which says nothing.
    A warning, not a refusal: swap may still hold it."""
    mem = usable_memory()
    if mem is not None and nbytes > mem[0]:
        warn_user(f"{what}, about {nbytes / 2**20:,.0f} MiB, and {mem[1]} leaves "
                  f"{mem[0] / 2**20:,.0f} MiB: the process may be killed for memory; free "
                  "memory or raise the limit")


def _available_ram() -> tuple[int, str] | None:
    avail = _kib_field("/proc/meminfo", "MemAvailable:")
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            return None
    return avail, "available RAM"


def _cgroup_left() -> tuple[int, str] | None:
    """The least that a memory limit of this process's cgroup or of one above it leaves,
    counting reclaimable page cache as free (cgroup v2, and v1's memory controller: a
    batch scheduler's job sits in a cgroup of its own below the hierarchy's root, which
    has no limit)."""
    found = []
    for base, version in cgroups.dirs("memory"):
        limit_f, used_f, cache_key = _V2 if version == 2 else _V1
        limit = cgroups.read_int(os.path.join(base, limit_f))
        used = cgroups.read_int(os.path.join(base, used_f))
        if limit is None or used is None or limit >= 1 << 60:     # v1 says "none" so
            continue
        cache = 0
        try:
            with open(os.path.join(base, "memory.stat")) as f:
                for line in f:
                    k, _, v = line.partition(" ")
                    if k == cache_key:
                        cache = int(v)
        except (OSError, ValueError):
            pass
        found.append(max(limit - used + cache, 0))
    return (min(found), "the cgroup's memory limit") if found else None


_V2 = ("memory.max", "memory.current", "inactive_file")
_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


def _rlimit_left() -> tuple[int, str] | None:
    if resource is None:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft < 0:
        return None
    size = _kib_field("/proc/self/status", "VmSize:") or 0
    return max(soft - size, 0), "RLIMIT_AS"


def is_auto(max_bytes) -> bool:
    """Whether ``max_bytes`` (or the global default it stands for) is "auto"."""
    return (_global if max_bytes is DEFAULT else max_bytes) == AUTO


def declared_bytes(sections) -> int:
    """What a container's sections say they decode to (validated later, section by
    section: a wrong ``nbytes`` is refused before that section is decoded). A raw
    section is read as stored, so its length counts, whatever its metadata claims; a
    chain's 16-bit float sections are decoded through fp32, so they count three times.
    A ``"zeros"`` section (no payload) loads as pages that take memory only where
    written, so it does not count (a mapping larger than the process may have is
    refused when it is made)."""
    total = 0
    for s in sections:
        meta = s["meta"]
        n = s["length"]                   # bytes sections, and raw ones (read as stored)
        if meta.get("codec") == "zeros" and n == 0:
            continue
        if meta.get("kind") in ("tensor", "ndarray") and meta.get("codec") != "raw":
            n = meta.get("nbytes")
            if meta.get("codec") == "delta" and meta.get("dtype") in ("F16", "BF16") \
                    and type(n) is int:
                n *= 3                    # a 16-bit carrier, then fp32 while tracked
        if type(n) is int and n > 0:
            total += n
    return total


def check(declared: int, stored_bytes: int, max_bytes, what: str, in_place: int = 0) -> None:
    """Raise :class:`ResourceLimitError` when ``declared`` exceeds the resolved limit;
    ``in_place`` of them decode into tensors the caller holds (no memory is taken)."""
    limit, how = _resolve(max_bytes, stored_bytes, memory=declared - in_place > AUTO_SMALL,
                          in_place=in_place)
    if limit is None or declared <= limit:
        return
    if "leaves this process" in how:
        advice = ("It would not fit in memory: free memory, load it on a larger machine, or "
                  "read only the tensors you need with lcckpt.open(...); max_bytes=None lifts "
                  "the limit (and the process may then be killed for memory)")
    else:
        advice = ("If you trust this file, pass max_bytes=None (or a larger number), or set "
                  "lcckpt.limits.set_max_bytes(...) for the whole process")
    raise ResourceLimitError(
        f"{what} declares {declared:,} bytes of data in {stored_bytes:,} stored bytes "
        f"(expansion {declared / max(stored_bytes, 1):,.0f}x), over {limit:,} bytes ({how}). "
        + advice)


def read_stream(f, max_bytes, what: str) -> bytearray:
    """All of the non-seekable ``f`` (a pipe). A load reads such a stream whole before it
    can parse it, so one longer than any file ``max_bytes`` lets load (the limit plus a
    header; under "auto", the memory this process has left) is refused as it passes that
    size: an endless stream took all the memory before."""
    value = _value(max_bytes)
    mem = usable_memory() if value == AUTO else None
    cap = mem[0] if mem is not None else value + MAX_HEADER_BYTES if type(value) is int else None
    data = bytearray()
    while piece := f.read(1 << 24):
        data += piece
        if cap is not None and len(data) > cap:
            raise ResourceLimitError(
                f"{what} is a stream of more than {cap:,} bytes, more than any file the limit "
                f"lets load ({'what ' + mem[1] + ' leaves this process' if mem else 'max_bytes'}"
                "); if you trust it, pass max_bytes=None, or save it to a file first")
    return data


def parse_max_bytes(text: str):
    """The command line's ``--max-bytes``: a number of bytes (suffixes K, M, G, T: powers
    of 1024), "auto" or "none" (None)."""
    t = text.strip().lower()
    if t in ("auto", "none"):
        return None if t == "none" else "auto"
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}.get(t[-1:], 1)
    try:
        n = int(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        n = -1
    if n < 0:
        from argparse import ArgumentTypeError      # the command line's error
        raise ArgumentTypeError(
            f"{text!r}: give a number of bytes (e.g. 8G), 'auto' or 'none'")
    return n
