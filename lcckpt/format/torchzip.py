"""A torch.save zip, checked before torch reads it.

torch's zip reader (miniz) checks no CRC-32 and reads some directory fields that Python's
zipfile ignores, so damage it cannot see loads as other numbers. Before a load, the
zip's directory is read here: what its members inflate to is held to ``max_bytes``;
what torch.save never writes (a member marked a directory, a zip feature Python's
zipfile does not read) is damage; and members torch.save would have stored but that are
compressed (a re-zipped file, or a flipped compression method) are read to their ends,
which checks their CRC-32s. A zip that is no torch.save file (a TorchScript or
torch.export archive, a numpy ``.npz``) is named as such instead of reaching torch's
loader, which would call it damaged. Of stored members, all of a torch.save file, only the local
headers are read (torch finds the data by their lengths; 15-17 µs a member, against
about 200 µs for ``torch.load``'s own work on each of 100,000 tiny tensors): their data
is checked by :func:`read_members` in ``lcckpt verify``, as ``torch.load`` does not.
"""

from __future__ import annotations

import errno
import os
import zipfile
import zlib

from .. import limits
from ..errors import ChecksumError, CorruptDataError, StorageError, UnsafeObjectError
from .container import open_file

__all__ = ["check_before_load", "is_zip", "open_zip", "read_members"]

PIECE = 1 << 24         # bytes read at a time from a member


def check_before_load(f, max_bytes) -> None:
    """Check the torch.save zip ``f`` (a path, or a binary file whose position is kept)
    as the module says; a file that is no zip (the legacy format) is left to torch."""
    own = isinstance(f, (str, os.PathLike))
    fh = open_file(os.fspath(f)) if own else f
    pos = fh.tell()
    try:
        size = fh.seek(0, os.SEEK_END)
        fh.seek(pos)
        z = open_zip(fh, "the torch.save file")
        if z is None:
            return
        with z:
            infos = z.infolist()
            check_kind([i.filename for i in infos])
            # torch's reader takes a member marked a directory (a DOS attribute bit that
            # Python's zipfile ignores) for one without data: it would load other numbers
            folder = next((i.filename for i in infos if i.external_attr & 0x10
                           or i.filename.endswith("/")), None)
            if folder is not None:
                raise CorruptDataError(f"member {folder!r} of the torch.save file is marked a "
                                       "directory, which torch.save never writes: the file "
                                       "is damaged")
            limits.check(sum(i.file_size for i in infos), size, max_bytes, "the torch.save file")
            stored = [i for i in infos if i.compress_type == zipfile.ZIP_STORED]
            read_members(z, stored, "the torch.save file", data=False)
            read_members(z, [i for i in infos if i.compress_type != zipfile.ZIP_STORED],
                         "the torch.save file")
    finally:
        fh.seek(pos)
        if own:
            fh.close()


def is_zip(path: str) -> bool:
    """Whether the file at ``path`` is a zip (torch.save's format since 1.6, which torch
    can map), not the legacy pickle stream (which it cannot)."""
    with open(path, "rb") as fh:
        return fh.read(4) == b"PK\x03\x04"


def check_kind(names: list[str]) -> None:
    """Raise where the zip members ``names`` are not a torch.save file's (which keeps its
    pickle in ``<archive>/data.pkl``), saying what the archive is and how to read it."""
    if any(n.endswith("/constants.pkl") or "/code/" in n for n in names):
        raise UnsafeObjectError(
            "a TorchScript archive (torch.jit.save), not a torch.save file: it holds the "
            "model's code, which lcckpt never runs. If you trust it, load it with "
            "torch.jit.load(path) and save its state_dict() with lcckpt.save")
    if any(n.endswith("/archive_format") or n.endswith("/models/model.json") for n in names):
        raise CorruptDataError(
            "a torch.export archive (torch.export.save), not a checkpoint: load it with "
            "torch.export.load(path); its module().state_dict() saves with lcckpt.save")
    if any(n.endswith("/data.pkl") for n in names):
        return
    if names and all(n.endswith(".npy") for n in names):
        raise CorruptDataError(
            "a numpy .npz archive, not a checkpoint lcckpt knows: read it with "
            "numpy.load(path, allow_pickle=False)")
    shown = ", ".join(repr(n) for n in names[:4]) + (", ..." if len(names) > 4 else "")
    raise CorruptDataError(
        f"a zip archive without a torch.save pickle (no '<archive>/data.pkl'; members: "
        f"{shown or 'none'}): not a torch.save file, or one that is damaged")


def open_zip(fh, where: str) -> zipfile.ZipFile | None:
    """The zip directory of ``fh``; None where it is no zip (the legacy format, or damage
    left to torch). A feature Python's zipfile does not read is damage: unread, the
    directory could hide a bomb from the limit."""
    try:
        return zipfile.ZipFile(fh)
    except (zipfile.BadZipFile, ValueError, EOFError):
        return None
    except OSError as e:
        if e.errno == errno.EINVAL:     # a seek before the file's start: damage
            return None
        raise StorageError(e.errno, f"cannot read the zip directory: {e.strerror}",
                           where) from None
    except NotImplementedError as e:    # a zip version, strong encryption
        raise CorruptDataError(f"{where}: the zip directory declares what torch.save never "
                               f"writes ({e}): the file is damaged") from None


def read_members(z: zipfile.ZipFile, infos: list, where: str, data: bool = True) -> None:
    """Read each member of ``infos`` to its end, which checks its CRC-32 (``data=False``:
    only its local header, which must sit where the directory says and name the same
    member; torch's reader finds the data by that header's lengths); damage raises
    :class:`ChecksumError` or :class:`CorruptDataError` naming ``where`` and the member."""
    for info in infos:
        try:
            with z.open(info) as m:
                while data and m.read(PIECE):
                    pass
        except zipfile.BadZipFile as e:
            raise ChecksumError(f"{where}: member {info.filename!r}: {e}; the file is "
                                "damaged") from None
        except (zlib.error, EOFError, ValueError, NotImplementedError, RuntimeError) as e:
            raise CorruptDataError(
                f"{where}: member {info.filename!r} cannot be read: {e}") from None
        except OSError as e:
            if e.errno == errno.EINVAL:     # a seek before the file's start
                raise CorruptDataError(f"{where}: member {info.filename!r} lies outside the "
                                       "file, by the zip's directory: the file is damaged") from None
            raise StorageError(e.errno, f"cannot read member {info.filename!r}: "
                               f"{e.strerror}", where) from None
