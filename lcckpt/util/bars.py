"""Progress bars of the command line: tqdm on stderr where it is a terminal and tqdm is
installed, and nothing otherwise (a pipe, a log file, a test)."""

from __future__ import annotations

import contextlib
import sys


def _tqdm():
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm if sys.stderr.isatty() else None


def items(iterable, desc: str):
    """``iterable`` under a bar counting its items, or as it is."""
    tqdm = _tqdm()
    return iterable if tqdm is None else tqdm(iterable, desc=desc, file=sys.stderr, leave=False)


@contextlib.contextmanager
def byte_bar(desc: str):
    """``bar(nbytes, total)``, drawing a bar of bytes made when first called (so that the
    total can be known late), or None; the bar is closed at the end."""
    tqdm = _tqdm()
    if tqdm is None:
        yield None
        return
    made = []

    def bar(n: int, total: int) -> None:
        if not made:
            made.append(tqdm(total=total, desc=desc, unit="B", unit_scale=True,
                             file=sys.stderr, leave=False))
        made[0].update(n)
    try:
        yield bar
    finally:
        if made:
            made[0].close()
