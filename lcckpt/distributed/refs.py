"""A distributed writer's references: one per piece, the encoder whose reference is what
a load of the piece's chain gives, and the blobs of that chain. A delta save advances them
in place; a save that fails puts back, from the committed files, those it advanced."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from ..codec.delta import DeltaEncoder, Reconstruction
from ..errors import LcckptError
from .blobs import exactly
from .partition import Piece
from ..util.caller import warn_user


class Background:
    """A writer's references in DCP's async-save background process (see __getstate__)."""

    def __init__(self):
        self.refs: dict = {}
        self.pending: dict | None = None
        self.pending_save: str | None = None
        self.advanced: set = set()


BACKGROUND: dict[str, Background] = {}


@dataclass
class Ref:
    encoder: DeltaEncoder      # its reference = the decoder's reconstruction of the piece
    chain: tuple               # (absolute file, offset, length) of every blob, keyframe first
    zero_base: bool = False    # the first blob is a delta against zeros


def resync(refs: dict, advanced: set, read) -> dict:
    """``refs`` with the pieces a failed save advanced in place set back to their
    committed chains, replayed from disk (bit for bit what the encoder held: a load gives
    the same); a piece whose chain cannot be read is dropped, and its next blob is a
    keyframe. Copying every reference before a save instead cost a state of memory."""
    out = dict(refs)
    for piece in advanced:
        r = refs.get(piece)
        if r is None:
            continue
        try:
            r.encoder.resume(replay(r, read))        # replays the pending blobs
        except (LcckptError, OSError) as e:
            warn_user(f"piece {piece.key}[{piece.start}:{piece.stop}]: its reference "
                      f"cannot be read back after a failed save ({e}); its next save "
                      "is a keyframe")
            del out[piece]
    return out


def replay(r: Ref, read, dtype: str | None = None) -> Reconstruction:
    """The reconstruction ``r``'s chain of blobs gives, read with ``read(path, offset,
    length)``: what a load of the piece gives. ``dtype``: the piece's codec dtype name
    (default: the encoder's)."""
    rec = Reconstruction()
    for i, (path, off, n) in enumerate(r.chain):
        first = i == 0
        rec.apply(read(path, off, n), dtype=dtype or r.encoder.dtype.name,
                  zero_base=first and r.zero_base, movement=first and not r.zero_base)
    return rec


def reopened(infos, rank: int, step_dir: str, fs, chained, new_encoder) -> dict:
    """The references that the writer of ``rank`` held once the save of ``infos`` (the
    items of the step committed in ``step_dir``) committed: each piece it wrote that a
    chain tracks (``chained(info)``: the piece's codec dtype name, else None), an encoder
    from ``new_encoder(key)`` resumed from the piece's chain replayed from disk (what a
    load of it gives, bit for bit what that writer's encoder held). A writer new to the
    directory, a restarted job's, then goes on with deltas. A piece whose chain cannot
    be read is left out with a warning: its next blob is a keyframe."""
    out, read = {}, partial(read_blob, fs)
    for info in infos:
        name = chained(info)
        if name is None or info.rank != rank or getattr(info, "alias", False):
            continue
        here = fs.absolute(fs.join(step_dir, info.relative_path))
        base = fs.dirname(here)                 # chains are relative to the data file's
        chain = tuple((fs.absolute(fs.join(base, p)), o, n) for p, o, n in info.chain)
        piece = Piece(*info.piece)
        r = Ref(new_encoder(piece.key), chain + ((here, info.offset, info.length),),
                bool(info.zero_base))
        try:
            r.encoder.resume(replay(r, read, name))
        except (LcckptError, OSError) as e:
            warn_user(f"piece {piece.key}[{piece.start}:{piece.stop}]: its chain in "
                      f"{step_dir} cannot be read ({e}); its next save is a keyframe")
            continue
        out[piece] = r
    return out


def park(refs: dict, fetch) -> None:
    """Each reference that its last delta left as it was leaves memory
    (lcckpt/codec/parked.py); ``fetch(piece)`` gives it back."""
    for piece, r in refs.items():
        r.encoder.park(partial(fetch, piece), f"{piece.key}[{piece.start}:{piece.stop}]")


def park_in(bg: Background, fs) -> None:
    """:func:`park` in DCP's background process, where every save gets a new copy of the
    writer: a fetch finds the piece's committed chain in ``bg``, which they all share."""
    park(bg.refs, lambda piece: replay(bg.refs[piece], partial(read_blob, fs)).ref)


def read_blob(fs, path: str, offset: int, length: int) -> bytes:
    """``length`` bytes of ``path`` at ``offset``, on the writer's filesystem."""
    with fs.create_stream(path, "rb") as f:
        f.seek(offset)
        return exactly(f.read(length), path, offset, length)
