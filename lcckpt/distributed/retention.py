"""Retention for distributed chains: keep the newest ``keep_last`` committed steps and
every step directory the chains of their deltas name, and delete the rest.

The guarantees are :class:`~lcckpt.DeltaCheckpointer`'s:
- a kept step never loses a directory it needs (each delta item's ``.metadata`` entry
  lists every earlier blob of its chain, so one read per kept step finds them all; a
  step whose metadata cannot be read keeps every older step);
- deletion runs newest first and stops at the first failure, so whatever is left behind,
  by a failure or a crash, still has every older directory its chains walk back through;
- a step is first made uncommitted (its ``.metadata`` removed), then its files: a crash
  in between leaves a directory no load takes for a checkpoint, removed by the next pass.
"""

from __future__ import annotations


from ..errors import LcckptError
from .storage import CompressedReader
from ..util.caller import warn_user


def needed_steps(files, directory: str, steps: list[int], keep_last: int, step_of, path_of,
                 storage_options=None) -> set[int]:
    """The steps that the newest ``keep_last`` of ``steps`` (committed, oldest first) need."""
    needed: set[int] = set()
    top = files.join(directory)
    for s in steps[-keep_last:]:
        needed.add(s)
        try:
            md = CompressedReader(path_of(s), storage_options=storage_options).read_metadata()
        except (LcckptError, OSError):
            needed.update(x for x in steps if x <= s)      # unknown chains: keep all older
            continue
        for info in (md.storage_data or {}).values():
            for rel, _, _ in getattr(info, "chain", ()):
                d = files.dirname(files.join(path_of(s), rel))
                if files.dirname(d) == top:
                    base = step_of(files.basename(d))
                    if base is not None:
                        needed.add(base)
    return needed


def apply_retention(files, directory: str, steps: list[int], keep_last: int | None, step_of,
                    path_of, uncommitted: list[int] = (), storage_options=None) -> None:
    """Delete what no kept step needs (see the module docstring); warns on failure.
    ``uncommitted``: step directories without ``.metadata`` (a crash mid-deletion, a failed
    save); those older than every kept step are removed too."""
    if keep_last is None or len(steps) <= keep_last:
        return
    needed = needed_steps(files, directory, steps, keep_last, step_of, path_of,
                          storage_options)
    oldest_kept = min(needed)
    doomed = [s for s in steps if s not in needed] + [s for s in uncommitted if s < oldest_kept]
    for s in sorted(doomed, reverse=True):
        path = path_of(s)
        try:
            files.rmtree(path)          # .metadata first: no longer a checkpoint
        except OSError as e:
            warn_user(f"retention (keep_last={keep_last}) could not remove {path} "
                      f"({e.strerror}); the new step is saved, and the next save tries "
                      "again")
            return
