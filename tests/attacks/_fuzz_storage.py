"""Faults and links around a chain directory; prints the outcomes as JSON.

Run by fuzz_large.py in a subprocess. Three kinds of case, each a whole run of saves
(keyframes, deltas, a merge, retention with ``keep_last``) checked against the same run
written without faults:

- *fault*: the k-th call of ``os.fsync``, ``os.replace``, ``os.unlink`` or a creating
  ``os.open`` fails (EIO, EPERM, ENOSPC, EROFS), for every k the run makes;
- *full* / *readonly*: the run writes into a small tmpfs that fills up, or that is
  remounted read-only before some step (skipped, and said so, where mounting fails);
- *link*: the directory holds symlinks and hard links to files outside it (a step, the
  writer lock, a temp file), or symlinks named like steps.

What must hold: every failure is an ``LcckptError``; a save
that raised either left its step absent or fully there; after the fault is gone the next
save succeeds; every step on disk loads exactly as the clean run's; no file outside the
directory is changed or created; links are never counted as steps.

Usage: _fuzz_storage.py SEED [--scale N]
"""

import argparse
import errno
import hashlib
import json
import os
import random
import shutil
import subprocess
import tempfile
import warnings

import torch

from lcckpt import DeltaCheckpointer
from lcckpt.errors import LcckptError

STEPS = 7
MERGE_AFTER = 3


def _states(seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(6000, generator=g)
    out = []
    for step in range(STEPS):
        w = w + 0.01 * torch.randn(6000, generator=g)
        out.append({"w": w.clone(), "b": torch.randn(10, generator=g), "step": torch.tensor(step),
                    "lr": 0.1 / (step + 1)})
    return out


def _run(d: str, states: list, on_error=None) -> list[int]:
    """The run of saves; ``on_error(step, exc)`` is told of a failed save, which is then
    retried once (if its step is not on disk already). Returns the steps it committed."""
    ck = DeltaCheckpointer(d, keyframe_every=3, keep_last=4)
    done = []
    try:
        for step, s in enumerate(states):
            for attempt in range(2):
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        if step not in _own_steps(d):
                            ck.save(step, s)
                        if step == MERGE_AFTER:
                            ck.merge()       # (again, if only the merge failed)
                    done.append(step)
                    break
                except BaseException as e:     # noqa: BLE001 (judged by on_error)
                    if on_error is None:
                        raise
                    on_error(step, e)
    finally:
        try:
            ck.close()
        except BaseException as e:            # noqa: BLE001
            if on_error is None:
                raise
            on_error(-1, e)
    return done


def _own_steps(d: str) -> list[int]:
    try:
        return DeltaCheckpointer(d).steps()
    except LcckptError:
        return []


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape \
            and torch.equal(a.view(torch.uint8) if a.dtype.is_floating_point else a,
                            b.view(torch.uint8) if b.dtype.is_floating_point else b)
    return a == b


class _Fault:
    """Make the ``at``-th call of ``os.<name>`` (counted from install) raise ``err``."""

    def __init__(self, name: str, err: int, at: int):
        self.name, self.err, self.at, self.calls = name, err, at, 0
        self.real = getattr(os, name)

    def __call__(self, *args, **kwargs):
        if self.name == "open" and not (len(args) > 1 and args[1] & os.O_CREAT):
            return self.real(*args, **kwargs)
        self.calls += 1
        if self.calls - 1 == self.at:
            raise OSError(self.err, os.strerror(self.err), args[0] if args else None)
        return self.real(*args, **kwargs)

    def __enter__(self):
        setattr(os, self.name, self)
        return self

    def __exit__(self, *exc):
        setattr(os, self.name, self.real)


def _check_dir(d: str, truth: dict, failures: list, case) -> str:
    """Every step on disk loads as the clean run's; the next save works."""
    try:
        ck = DeltaCheckpointer(d)
        steps = ck.steps()
        for s in steps:
            if not _same(ck.load(s), truth[s]):
                failures.append({"case": case, "outcome": f"step {s} loads other data"})
                return "WRONG"
        ck.close()
    except LcckptError as e:
        failures.append({"case": case, "outcome": f"an intact run fails to load: {e!r}"[:300]})
        return "LOST"
    return "OK"


def fault_cases(truth: dict, states: list, work: str):
    kinds = [("fsync", errno.EIO), ("replace", errno.EIO), ("unlink", errno.EIO),
             ("unlink", errno.EPERM), ("open", errno.ENOSPC), ("open", errno.EROFS)]
    for name, err in kinds:
        with _Fault(name, err, -1) as probe:         # count the calls of a clean run
            _run(os.path.join(work, f"probe-{name}-{err}"), states)
        for k in range(probe.calls):
            d = os.path.join(work, f"{name}-{err}-{k}")
            seen = []

            def on_error(step, e, seen=seen):
                seen.append((step, e))

            with _Fault(name, err, k):
                _run(d, states, on_error)
            escapes = [repr(e)[:200] for _, e in seen if not isinstance(e, LcckptError)]
            case = [name, errno.errorcode[err], k]
            if escapes:
                yield "fault", case, "ESCAPE", [{"case": case, "outcome": f"raised {escapes}"}]
                continue
            failures = []
            outcome = _check_dir(d, truth, failures, case)
            if outcome == "OK" and len(_own_steps(d)) < 1:
                outcome = "LOST"
                failures.append({"case": case, "outcome": "no step survived"})
            yield "fault", case, outcome + (" raised" if seen else ""), failures


def _mount(path: str, size: int) -> bool:
    os.makedirs(path, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                          capture_output=True).returncode == 0


def _umount(path: str) -> None:
    subprocess.run(["umount", path], capture_output=True)


def mount_cases(seed: int, scale: int, truth: dict, states: list, work: str, notes: list):
    mnt = os.path.join(work, "mnt")
    if not _mount(mnt, 1 << 20):
        notes.append("tmpfs cases skipped: mounting a tmpfs needs root (mount failed)")
        return
    _umount(mnt)
    _run(os.path.join(work, "size-probe"), states)
    biggest = max(os.path.getsize(os.path.join(work, "size-probe", f))
                  for f in os.listdir(os.path.join(work, "size-probe")))
    rng = random.Random(seed)
    sizes = sorted({4096 * rng.randrange(1, 4 * biggest // 4096 + 2) for _ in range(25 * scale)})
    for size in sizes:
        case = ["full", size]
        _mount(mnt, size)
        try:
            d = os.path.join(mnt, "ck")
            os.makedirs(d)
            seen = []
            _run(d, states, lambda step, e: seen.append(e))
            bad = [repr(e)[:200] for e in seen if not isinstance(e, LcckptError)]
            if bad:
                yield "full", case, "ESCAPE", [{"case": case, "outcome": f"raised {bad}"}]
                continue
            subprocess.run(["mount", "-o", f"remount,size={64 << 20}", mnt], capture_output=True)
            failures = []
            outcome = _check_dir(d, truth, failures, case)
            try:                               # room again: the run goes on
                ck = DeltaCheckpointer(d, keyframe_every=3, keep_last=4)
                ck.save(STEPS, states[-1])
                ck.close()
            except LcckptError as e:
                outcome = "STUCK"
                failures.append({"case": case, "outcome": f"no save after space came back: {e!r}"[:300]})
            yield "full", case, outcome + (" raised" if seen else ""), failures
        finally:
            _umount(mnt)
    for at in range(1, STEPS):
        case = ["readonly", at]
        _mount(mnt, 64 << 20)
        try:
            d = os.path.join(mnt, "ck")
            os.makedirs(d)
            seen = []
            _run(d, states[:at])
            subprocess.run(["mount", "-o", "remount,ro", mnt], capture_output=True)
            try:
                ck = DeltaCheckpointer(d, keyframe_every=3, keep_last=4)
                ck.save(at, states[at])
                seen.append("saved on a read-only filesystem")
            except LcckptError:
                pass
            except BaseException as e:        # noqa: BLE001
                seen.append(repr(e)[:200])
            failures = [{"case": case, "outcome": s} for s in seen]
            outcome = _check_dir(d, truth, failures, case)
            yield "readonly", case, outcome if not seen else "ESCAPE", failures
        finally:
            _umount(mnt)


def _tree_digest(root: str) -> dict:
    out = {}
    for base, dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(base, f)
            if not os.path.islink(p):
                with open(p, "rb") as fh:
                    out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def link_cases(truth: dict, states: list, work: str):
    outside = os.path.join(work, "outside")
    os.makedirs(outside)
    victim = os.path.join(outside, "victim.txt")
    with open(victim, "w") as f:
        f.write("do not touch\n")
    foreign = os.path.join(work, "foreign")
    _run(foreign, [{"w": torch.ones(6000) * i} for i in range(STEPS + 2)])
    foreign_step = os.path.join(foreign, sorted(os.listdir(foreign))[-1])
    shutil.copy(foreign_step, os.path.join(outside, "foreign-step.lcc"))
    os.makedirs(os.path.join(outside, "dir"))
    name = "step-{:012d}.lcc"

    def put(make_at, path):                # over whatever is there, as an attacker would
        tmp = path + ".new"
        make_at(tmp)
        os.replace(tmp, path)

    layouts = {
        "newer step -> foreign step": lambda d: os.symlink(
            os.path.join(outside, "foreign-step.lcc"), os.path.join(d, name.format(99))),
        "older step -> victim": lambda d: put(lambda p: os.symlink(victim, p),
                                              os.path.join(d, name.format(0))),
        "lock -> victim": lambda d: os.symlink(victim, os.path.join(d, ".lcckpt-writer.lock")),
        "step -> outside dir": lambda d: os.symlink(os.path.join(outside, "dir"),
                                                    os.path.join(d, name.format(98))),
        "dangling step": lambda d: os.symlink(os.path.join(outside, "nothing"),
                                              os.path.join(d, name.format(97))),
        "temp -> victim": lambda d: os.symlink(
            victim, os.path.join(d, f".{name.format(5)}.1.1.h.lcckpt-tmp")),
        "hard link of a foreign step": lambda d: os.link(
            os.path.join(outside, "foreign-step.lcc"), os.path.join(d, name.format(96))),
        "step named directory": lambda d: os.makedirs(os.path.join(d, name.format(95))),
    }
    before = _tree_digest(outside)
    listing = sorted(os.listdir(outside))
    for label, make in layouts.items():
        for when in ("before", "during"):
            case = [label, when]
            d = os.path.join(work, f"link-{len(os.listdir(work))}")
            os.makedirs(d)
            if when == "before":
                make(d)
            seen = []

            def on_error(step, e, seen=seen):
                seen.append(e)

            if when == "during":
                _run(d, states[:3], on_error)
                make(d)
                ck = DeltaCheckpointer(d, keyframe_every=3, keep_last=4)
                for step in range(3, STEPS):
                    try:
                        ck.save(step, states[step])
                    except BaseException as e:     # noqa: BLE001
                        on_error(step, e)
                try:
                    ck.close()
                except BaseException as e:         # noqa: BLE001
                    on_error(-1, e)
            else:
                _run(d, states, on_error)
            failures = []
            bad = [repr(e)[:200] for e in seen if not isinstance(e, LcckptError)]
            if bad:
                failures.append({"case": case, "outcome": f"raised {bad}"})
            links = [s for s in _own_steps(d) if os.path.islink(os.path.join(d, name.format(s)))]
            if links:
                failures.append({"case": case, "outcome": f"links counted as steps: {links}"})
            if _tree_digest(outside) != before or sorted(os.listdir(outside)) != listing:
                failures.append({"case": case, "outcome": "a file outside the directory changed"})
            try:
                ck = DeltaCheckpointer(d)
                for s in ck.steps():
                    got = ck.load(s)
                    if s in truth and not _same(got, truth[s]):
                        failures.append({"case": case, "outcome": f"step {s} loads other data"})
            except LcckptError:
                pass                           # refused: the foreign file is in its chain
            yield "link", case, "FAIL" if failures else ("OK raised" if seen else "OK"), failures


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("seed", type=int)
    ap.add_argument("--scale", type=int, default=1)
    args = ap.parse_args()
    states = _states(args.seed)
    results = {"outcomes": {}, "kinds": {}, "failures": [], "notes": []}
    work = tempfile.mkdtemp()
    try:
        clean = os.path.join(work, "clean")
        ck = DeltaCheckpointer(clean, keyframe_every=3)
        for step, s in enumerate(states):
            ck.save(step, s)
            if step == MERGE_AFTER:
                ck.merge()
        truth = {s: ck.load(s) for s in ck.steps()}
        truth[STEPS] = None
        ck.close()
        for gen in (fault_cases(truth, states, work),
                    mount_cases(args.seed, args.scale, truth, states, work, results["notes"]),
                    link_cases(truth, states, work)):
            for kind, case, outcome, failures in gen:
                results["kinds"][kind] = results["kinds"].get(kind, 0) + 1
                results["outcomes"][outcome] = results["outcomes"].get(outcome, 0) + 1
                results["failures"] += failures
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["cases"] = sum(results["kinds"].values())
    print(json.dumps(results))


if __name__ == "__main__":
    main()
