"""The files of a checkpoint directory: which names are steps, the validated chain
header of each (cached by file identity), and what to say when one is missing."""

from __future__ import annotations

import errno
import operator
import os
import re

from ..errors import (BrokenChainError, CorruptDataError, InvalidArgumentError, NotFoundError,
                      StorageError)
from ..format.container import read_container
from ..util.paths import distributed_hint
from .links import Link, with_sizes
from .lock import LOCK_NAME

NAME_RE = re.compile(r"step-(\d{12,})\.lcc")


def file_name(step: int) -> str:
    """The file name of ``step`` in a checkpoint directory."""
    return f"step-{step:012d}.lcc"


def check_step(step) -> int:
    """``step`` as an int, or :class:`InvalidArgumentError` saying why it is not a step."""
    try:
        if isinstance(step, bool):      # save(is_best, state): an int, but not a step
            raise TypeError
        step = operator.index(step)
    except TypeError:
        raise InvalidArgumentError(f"step must be an int, got {type(step).__name__}") from None
    if step < 0:
        raise InvalidArgumentError(f"step must be >= 0, got {step}")
    return step


class ChainDirectory:
    """One checkpoint directory as a chain reads it (nothing here writes)."""

    def __init__(self, directory: str):
        self.directory = directory
        self._headers: dict[str, tuple] = {}    # path -> (stat key, Link)

    def forget(self, path: str) -> None:
        """Drop the cached header of a removed or rewritten file."""
        self._headers.pop(path, None)

    def path(self, step: int) -> str:
        """Where ``step`` is (or would be) stored."""
        return os.path.join(self.directory, file_name(step))

    def steps(self) -> list[int]:
        """Sorted list of the stored steps: regular files named like steps. A symbolic
        link (or anything else) under a step's name is not a step (:meth:`strays` lists
        them): a link could bring in another run's file, and retention would then delete
        this run's steps below it."""
        return sorted(s for s, regular in self.entries() if regular)

    def strays(self) -> list[str]:
        """Paths named like steps that are not regular files (links, directories)."""
        return [self.path(s) for s, regular in self.entries() if not regular]

    def entries(self) -> list[tuple[int, bool]]:
        """``(step, is a regular file)`` of every name in the directory that names a step."""
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise StorageError(e.errno, f"cannot list the checkpoint directory: {e.strerror}",
                               self.directory) from None
        out = []
        for e in entries:
            m = NAME_RE.fullmatch(e.name)
            if m and e.name == file_name(int(m.group(1))):
                try:
                    regular = e.is_file(follow_symlinks=False)
                except OSError:
                    regular = False
                out.append((int(m.group(1)), regular))
        return out

    def no_checkpoints(self) -> NotFoundError:
        d = self.directory
        if not os.path.isdir(d):
            why = "the directory does not exist"
        else:
            others = [n for n in os.listdir(d) if n != LOCK_NAME]
            why = ("the directory is empty" if not others else distributed_hint(d) or
                   f"it holds {len(others)} other entries but no step-<step>.lcc file: "
                   "is it the right directory?")
        return NotFoundError(errno.ENOENT, f"no checkpoints to load: {why}", d)

    def missing_step(self, step: int) -> NotFoundError:
        if not self.steps():
            return self.no_checkpoints()
        return NotFoundError(errno.ENOENT, f"no checkpoint for step {step}; stored: "
                             f"{brief(self.steps())}", self.path(step))

    def link(self, step: int) -> Link:
        """The validated chain header of ``step`` (cached by file identity)."""
        path = self.path(step)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise self.missing_step(step) from None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        hit = self._headers.get(path)
        if hit is not None and hit[0] == key:
            return hit[1]
        with read_container(path) as c:
            link = Link(with_sizes(c.meta.get("lcckpt_chain"), c.sections), step, path)
        self._headers[path] = (key, link)
        return link


def brief(steps: list[int]) -> str:
    if not steps:
        return "none"
    if len(steps) <= 6:
        return ", ".join(map(str, steps))
    return f"{steps[0]}, {steps[1]}, ..., {steps[-2]}, {steps[-1]} ({len(steps)} steps)"


def delta_step(meta: dict, path: str) -> int | None:
    """The step of the chain delta that a container's ``meta`` describes, None for any
    other file. A delta is a difference from the step before it, so it reads as its step
    only in the directory it was written to: :class:`BrokenChainError` where ``path`` is
    not that directory's file of its step (a copy moved out of it)."""
    info = meta.get("lcckpt_chain")
    if not (isinstance(info, dict) and info.get("kind") == "delta"):
        return None
    step = info.get("step")
    if type(step) is not int or step < 0:
        raise CorruptDataError(f"{path}: its header names chain step {step!r:.40}, not a step")
    own = os.path.join(os.path.dirname(os.path.abspath(path)), file_name(step))
    if not (os.path.exists(own) and os.path.samefile(own, path)):
        raise BrokenChainError(
            f"{path} is step {step} of a DeltaCheckpointer chain, stored as a delta against "
            f"the step before it, and is not its chain directory's {file_name(step)}: read "
            f"the chain's directory instead (lcckpt.DeltaCheckpointer(directory).load({step}), "
            f"lcckpt convert DIRECTORY OUTPUT --step {step})")
    return step
