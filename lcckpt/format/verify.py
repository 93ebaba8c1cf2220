"""Check every byte of an lcckpt file: its container and, inside, every tensor blob.

The container module checks headers, sections and their checksums; a blob's own
structure and checksums belong to blob.py. This module is where the two meet, so that
one call (``lcckpt verify``, the fuzz runs) checks a file whole without decoding it.
"""

from __future__ import annotations

import os

from ..codec import blob as _blob
from .. import limits
from .container import at_path, read_container
from .sections import ZEROS
from ..errors import (
    CorruptDataError, InvalidArgumentError, LcckptError, NotFoundError, StorageError,
)

__all__ = ["BLOB_CODECS", "verify_file"]

BLOB_CODECS = ("lossless", "delta")    # section codecs whose payload is a tensor blob


def verify_file(path: str | os.PathLike) -> dict:
    """Check every byte of a container file against what covers it; never raises for a
    damaged file (an unreadable path still raises :class:`NotFoundError` / StorageError).

    Checks the header, every section's checksum and padding, and inside every tensor
    blob (codecs ``lossless`` and ``delta``) its own two checksums, its structure, and
    that it holds the shape its section declares. Returns a JSON-able report: ``ok``,
    ``error`` (the first failure, or None), ``version`` (the file format version),
    ``file_bytes``, ``header_bytes`` (the header as stored), ``header_json_bytes``
    (inflated), ``header_compressed``, ``declared_bytes`` (what loading it decodes to),
    ``expansion`` (declared / file bytes: what a load's ``max_bytes`` is compared with),
    ``sections`` and ``warnings``.
    """
    path = os.fspath(path)
    report = {"path": path, "ok": False, "error": None, "version": None, "file_bytes": None,
              "header_bytes": None, "header_json_bytes": None, "header_compressed": None,
              "declared_bytes": None, "expansion": None, "sections": None, "warnings": []}
    try:
        c = read_container(path)
    except (NotFoundError, StorageError, InvalidArgumentError):
        raise
    except LcckptError as e:
        report["error"] = f"{type(e).__name__}: {e}"
        return report
    with c:
        declared = limits.declared_bytes(c.sections)
        report.update(version=c.version, file_bytes=c.size, sections=len(c),
                      header_bytes=c.header_bytes, header_json_bytes=c.header_json_bytes,
                      header_compressed=c.header_compressed,
                      declared_bytes=declared, expansion=round(declared / max(c.size, 1), 3))
        if c.version == 1:
            report["warnings"].append(
                "format version 1: a section swapped with another of equal length cannot be "
                "detected; load and save the file again to upgrade it")
        try:
            c.verify()
            for i, s in enumerate(c.sections):
                meta = s["meta"]
                if meta.get("codec") == ZEROS and s["length"]:
                    raise CorruptDataError(f"section {s['name']!r} holds {s['length']} bytes, "
                                           "a 'zeros' section none")
                if meta.get("kind") not in ("tensor", "ndarray") \
                        or meta.get("codec") not in BLOB_CODECS:
                    continue
                _, p = _blob.parse(c.data(i), check_payload=True)
                if list(p.shape) != meta.get("shape"):
                    raise CorruptDataError(
                        f"section {s['name']!r} holds a blob of shape {list(p.shape)}, its "
                        f"header says {meta.get('shape')!r:.80}")
        except LcckptError as e:
            report["error"] = f"{type(e).__name__}: {at_path(e, path)}"
            return report
    report["ok"] = True
    return report
