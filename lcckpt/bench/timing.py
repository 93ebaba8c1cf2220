"""Timing and reporting helpers shared by the benchmarks.

``measure`` repeats a call until it has both a minimum number of runs and a
minimum total wall time (the approach of python-zstandard's bench): fast
functions get enough runs for a stable median, slow ones are not run 50 times.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..util.table import format_table  # noqa: F401  (the benchmarks import it from here)
from ..errors import InvalidArgumentError


@dataclass(frozen=True)
class Timing:
    """Wall-clock median and minimum, run count, and median process CPU time.

    ``cpu_s`` counts every thread of the process, so ``cpu_s / median_s`` shows
    how many cores a parallel kernel kept busy.
    """

    median_s: float
    min_s: float
    runs: int
    cpu_s: float


def measure(
    fn: Callable[[], Any],
    *,
    min_runs: int = 3,
    min_time: float = 0.3,
    max_runs: int = 50,
    warmup: int = 0,
    before: Callable[[], Any] | None = None,
) -> Timing:
    """Call ``fn()`` until ``min_runs`` calls and ``min_time`` seconds are reached.

    ``max_runs`` caps the count even if ``min_time`` is not reached. ``warmup``
    untimed calls come first, e.g. to keep JIT compilation out of the numbers.
    ``before()``, if given, runs untimed before every timed call (e.g. ``os.sync``, so
    that a write does not pay for the writeback of the previous one).
    """
    if min_runs < 1 or max_runs < min_runs or min_time < 0 or warmup < 0:
        raise InvalidArgumentError(
            f"need 1 <= min_runs <= max_runs, min_time >= 0, warmup >= 0; got "
            f"min_runs={min_runs}, max_runs={max_runs}, min_time={min_time}, warmup={warmup}"
        )
    for _ in range(warmup):
        fn()
    walls: list[float] = []
    cpus: list[float] = []
    total = 0.0
    while len(walls) < max_runs and (len(walls) < min_runs or total < min_time):
        if before is not None:
            before()
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        t1, c1 = time.perf_counter(), time.process_time()
        walls.append(t1 - t0)
        cpus.append(c1 - c0)
        total += t1 - t0
    return Timing(statistics.median(walls), min(walls), len(walls), statistics.median(cpus))


def throughput_mbs(nbytes: int, seconds: float) -> float:
    """Decimal megabytes (10**6 bytes) per second; ``inf`` for a zero duration."""
    return math.inf if seconds <= 0 else nbytes / 1e6 / seconds


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "Hardware"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def environment() -> dict[str, Any]:
    """Versions and hardware that a benchmark result should be reported with.

    Versions come from package metadata, so nothing heavy is imported.
    """
    return {
        "python": platform.python_version(),
        "numpy": _version("numpy"),
        "numba": _version("numba"),
        "torch": _version("torch"),
        "zstandard": _version("zstandard"),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
    }


# --- shared by the codec benchmark's sections -------------------------------------------

MB = 1e6


def zstandard_module():
    try:
        import zstandard
    except ImportError as e:
        raise ImportError("the benchmark compares against zstd: pip install 'lcckpt[bench]'") from e
    return zstandard


class _Zstd:
    """zstandard, imported on first use so that ``lcckpt --help`` works without it."""

    def __getattr__(self, name):
        return getattr(zstandard_module(), name)


zstandard = _Zstd()


def median_time(fn, runs, setup=None) -> float:
    """Median wall seconds of ``runs`` calls of ``fn`` (``setup`` before each, untimed)."""
    times = []
    for _ in range(runs):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def zstd_compress(data: bytes, level: int, threads: int = 0) -> bytes:
    return zstandard.ZstdCompressor(level=level, threads=threads).compress(data)


LATENCY_SNIPPET = """
import time
t0 = time.perf_counter()
import numpy as np, lcckpt
t1 = time.perf_counter()
x = np.random.default_rng(0).standard_normal(1_000_000).astype(np.float32)
t2 = time.perf_counter()
lcckpt.decode(lcckpt.encode(x))
t3 = time.perf_counter()
print(t1 - t0, t3 - t2)
"""


def latency(log):
    """Import time and the first encode + decode of a fresh process (Numba cache warm:
    a first run fills it)."""
    subprocess.run([sys.executable, "-c", LATENCY_SNIPPET], check=True, capture_output=True)
    out = subprocess.run([sys.executable, "-c", LATENCY_SNIPPET], check=True,
                         capture_output=True, text=True).stdout.split()
    res = {"import_s": float(out[0]), "first_encode_decode_s": float(out[1])}
    log(f"\n## latency: import {res['import_s']:.2f} s, first encode+decode of 1M fp32 "
        f"(cache warm) {res['first_encode_decode_s']:.3f} s")
    return res
