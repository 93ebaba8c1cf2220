"""lcckpt.util.jit: every kernel's disk cache is saved under a lock, data before index, so
processes compiling at once never leave an index naming another signature's code
(tests/attacks/numba_cache_race.py shows plain Numba doing that); a cache that cannot be
written or read back, or a lock that is held too long, never fails or hangs a kernel."""

import importlib
import os
import pathlib
import pickle
import pkgutil
import subprocess
import sys
import textwrap
import threading

from numba.core.registry import CPUDispatcher

import lcckpt
from helpers import closed_in_child
from lcckpt.util import jit

ROOT = pathlib.Path(lcckpt.__file__).parent


def _dispatchers():
    mods = ["lcckpt.util.crc32c"] + [
        f"lcckpt.codec.kernels.{m.name}"
        for m in pkgutil.iter_modules([str(ROOT / "codec" / "kernels")])]
    for name in mods:
        for attr, obj in vars(importlib.import_module(name)).items():
            if isinstance(obj, CPUDispatcher) and obj.__module__ == name:
                yield f"{name}.{attr}", obj


def test_every_kernel_saves_its_cache_under_the_lock():
    found = dict(_dispatchers())
    assert len(found) > 100                    # the codec's kernels, not an empty scan
    plain = [n for n, d in found.items() if not isinstance(d._cache, jit.GuardedCache)
             or not isinstance(d._cache._cache_file, jit.GuardedIndex)]
    assert plain == []


def test_no_kernel_bypasses_the_decorator():
    users = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
             if p.name != "jit.py" and "njit" in p.read_text()]
    assert users == []


def _index(d, base="f"):
    return jit.GuardedIndex(cache_path=str(d), filename_base=base, source_stamp=(1.0, 7))


def _load(path):
    with open(path, "rb") as f:
        pickle.load(f)                          # numba's version
        return pickle.loads(f.read())[1]        # (stamp, overloads)


def test_data_is_written_before_the_index_names_it(tmp_path):
    idx = _index(tmp_path)
    seen = []
    real = idx._save_index

    def check(overloads):
        for key, name in overloads.items():
            p = tmp_path / name
            seen.append((key, p.exists() and idx._load_data(name)))
        real(overloads)
    idx._save_index = check
    idx.save("sig-a", ("code", "a"))
    idx.save("sig-b", ("code", "b"))
    assert ("sig-b", ("code", "b")) in seen and ("sig-a", ("code", "a")) in seen
    assert all(data for _, data in seen)
    assert idx.load("sig-a") == ("code", "a") and idx.load("sig-b") == ("code", "b")


def test_a_second_save_waits_for_the_first_and_keeps_both(tmp_path):
    first, second = _index(tmp_path), _index(tmp_path)
    inside, go, done = threading.Event(), threading.Event(), threading.Event()
    real = first._save_data

    def paused(name, data):                     # the first save, stopped mid-way
        inside.set()
        go.wait(30)
        real(name, data)
    first._save_data = paused
    ta = threading.Thread(target=first.save, args=("sig-a", "code-a"))
    ta.start()
    assert inside.wait(30)

    def other():
        second.save("sig-b", "code-b")
        done.set()
    tb = threading.Thread(target=other)
    tb.start()
    finished_early = done.wait(0.5)             # without the lock it runs straight through
    go.set()
    ta.join(30)
    tb.join(30)
    assert not finished_early
    overloads = _load(tmp_path / "f.nbi")
    assert sorted(overloads) == ["sig-a", "sig-b"]
    assert overloads["sig-a"] != overloads["sig-b"]
    assert first.load("sig-a") == "code-a" and first.load("sig-b") == "code-b"


def test_a_stale_index_is_replaced_without_reusing_its_names_wrongly(tmp_path):
    old = jit.GuardedIndex(cache_path=str(tmp_path), filename_base="f", source_stamp=(0.0, 1))
    old.save("sig-a", "old code a")
    old.save("sig-b", "old code b")
    new = _index(tmp_path)                      # the source changed: the index is stale
    assert new.load("sig-b") is None
    new.save("sig-b", "new code b")
    assert new.load("sig-b") == "new code b" and new.load("sig-a") is None
    assert _load(tmp_path / "f.nbi") == {"sig-b": "f.1.nbc"}


def test_a_kernel_cached_by_one_process_loads_in_the_next(tmp_path):
    (tmp_path / "kmod.py").write_text(textwrap.dedent("""
        from lcckpt.util.jit import kernel

        @kernel
        def twice(x):
            return 2 * x

        @kernel(inline="always")
        def plus_one(x):
            return x + 1
        """))
    prog = ("import kmod; assert kmod.twice(3) == 6 and kmod.twice(1.5) == 3.0; "
            "assert kmod.plus_one(1) == 2; "
            "print(len(kmod.twice.stats.cache_hits), len(kmod.twice.stats.cache_misses))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT.parent)]))
    env.pop("NUMBA_CACHE_DIR", None)
    runs = [subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True,
                           text=True, timeout=300) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr[-2000:]
    assert runs[0].stdout.split() == ["0", "2"]     # compiled and saved for int and float
    assert runs[1].stdout.split() == ["2", "0"]     # both loaded from the cache
    assert (tmp_path / "__pycache__" / jit.CACHE_LOCK).exists()


def test_a_filesystem_without_locks_still_saves(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "flock", no_locks)
    idx = _index(tmp_path)
    idx.save("sig-a", "code-a")
    assert idx.load("sig-a") == "code-a"


def test_a_damaged_cache_file_compiles_again(tmp_path):
    idx = _index(tmp_path)
    idx.save("sig-a", "code-a")
    data = tmp_path / "f.1.nbc"
    data.write_bytes(data.read_bytes()[:5])          # cut short
    assert idx.load("sig-a") is None
    idx.save("sig-a", "code-a again")                # the next save replaces it
    assert idx.load("sig-a") == "code-a again"
    index = tmp_path / "f.nbi"
    index.write_bytes(index.read_bytes()[:-3])
    assert idx.load("sig-a") is None


def _module(tmp_path, name, body):
    import importlib.util
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_cache_that_cannot_be_written_warns_once_and_the_kernel_runs(tmp_path, monkeypatch):
    import errno

    import pytest

    def full(self, name, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(jit.GuardedIndex, "_save_data", full)
    monkeypatch.setattr(jit, "_warned", False)
    mod = _module(tmp_path, "kfull", """
        from lcckpt.util.jit import kernel

        @kernel
        def inc(x):
            return x + 1
        """)
    with pytest.warns(RuntimeWarning, match="could not save a compiled kernel"):
        assert mod.inc(1) == 2
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")                # once per process
        assert mod.inc(2.5) == 3.5


def test_a_child_forked_during_a_save_does_not_keep_the_lock(tmp_path):
    import fcntl
    with jit._locked(str(tmp_path)):
        held = max(jit.forks._HELD)
        assert closed_in_child(held)
    other = os.open(tmp_path / jit.CACHE_LOCK, os.O_RDWR)
    try:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)     # free once the save is done
    finally:
        os.close(other)
    assert held not in jit.forks._HELD


def test_a_lock_held_too_long_does_not_hang_a_save(tmp_path, monkeypatch):
    import fcntl
    monkeypatch.setattr(jit, "LOCK_WAIT", 0.2)
    monkeypatch.setattr(jit, "_stuck", False)
    holder = os.open(tmp_path / jit.CACHE_LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        idx = _index(tmp_path)
        idx.save("sig-a", "code-a")             # waits 0.2 s, then saves in the safe order
        assert idx.load("sig-a") == "code-a" and jit._stuck
        def waits(seconds):
            raise AssertionError("the save waited for the lock again")
        monkeypatch.setattr(jit.time, "sleep", waits)
        idx.save("sig-b", "code-b")             # and does not wait again
        assert idx.load("sig-b") == "code-b"
    finally:
        os.close(holder)


def test_no_writable_cache_directory_compiles_uncached(tmp_path, monkeypatch):
    import pytest
    from numba.core import caching

    impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl   # numba's name varies
    monkeypatch.setattr(impl, "_locator_classes", [])     # no directory applies
    monkeypatch.setattr(jit, "_warned", False)
    with pytest.warns(RuntimeWarning, match="cannot be cached"):
        mod = _module(tmp_path, "knocache", """
            from lcckpt.util.jit import kernel

            @kernel
            def inc(x):
                return x + 1
            """)
    assert mod.inc(1) == 2 and not (tmp_path / "__pycache__").exists()


def test_a_numba_without_these_cache_classes_keeps_its_own_cache(tmp_path, monkeypatch):
    import importlib.util

    from numba.core import caching
    monkeypatch.delattr(caching, "FunctionCache")
    spec = importlib.util.spec_from_file_location("lcckpt.util._jit_moved", jit.__file__)
    moved = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(moved)              # imports, where it would have failed
    monkeypatch.undo()                          # numba itself needs the class back
    monkeypatch.setitem(sys.modules, spec.name, moved)
    mod = _module(tmp_path, "kmoved", """
        from lcckpt.util._jit_moved import kernel

        @kernel
        def inc(x):
            return x + 1
        """)
    assert mod.inc(1) == 2
    assert not isinstance(mod.inc._cache, jit.GuardedCache)     # numba's own cache
