"""Numba's disk cache under concurrent compiles after a source change (not part of the
default suite: it starts a few hundred processes).

    python tests/attacks/numba_cache_race.py [--rounds 12] [--procs 10] [--plain]

Each round writes a module with one cached kernel, compiles it for six dtypes in one
process (the cache of "the old version"), changes the source (as an upgrade does), then
starts ``--procs`` processes at once, each calling the kernel for three dtypes in its own
order, and one more process afterwards for all six. A process fails if a call raises or
returns a wrong result: that is code compiled for other types, loaded from the cache.
The kernel is decorated with ``lcckpt.util.jit.kernel``, or with plain
``numba.njit(cache=True, nogil=True)`` under ``--plain``. Prints the failures and exits 1
if any process failed.
"""

import argparse
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KERNEL = '''
import numpy as np
{imp}

@{deco}
def running_sum(a):
    s = a.dtype.type(0)
    out = np.empty(a.size, a.dtype)
    for i in range(a.size):
        s += a[i]
        out[i] = s
    return out
'''

WORKER = '''
import sys
import numpy as np
import kmod
for dt in sys.argv[1].split(","):
    r = kmod.running_sum(np.arange(5, dtype=dt))
    if r.dtype != np.dtype(dt) or list(r) != [0, 1, 3, 6, 10]:
        sys.exit(f"{dt}: wrong result {r!r}")
'''

DTYPES = ["float32", "int64", "int32", "float64", "uint8", "int16"]


def _orders(procs: int) -> list[str]:
    return [",".join(DTYPES[(i + k * (1 + i % 5)) % 6] for k in range(3)) for i in range(procs)]


def _round(d: str, r: int, procs: int) -> list[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([d, ROOT]))
    env.pop("NUMBA_CACHE_DIR", None)            # the module's own __pycache__
    run = [sys.executable, os.path.join(d, "worker.py")]
    subprocess.run(run + [",".join(DTYPES)], env=env, capture_output=True)   # old version
    with open(os.path.join(d, "kmod.py"), "a") as f:
        f.write(f"# changed {r}\n")
    ps = [(o, subprocess.Popen(run + [o], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)) for o in _orders(procs)]
    ps.append((",".join(DTYPES), None))
    failed = []
    for o, p in ps:
        if p is None:                                           # after all of them
            p = subprocess.Popen(run + [o], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT)
        out = p.communicate()[0].decode(errors="replace").strip().splitlines()
        if p.returncode:
            failed.append(f"round {r}, dtypes {o}: exit {p.returncode}: "
                          f"{out[-1] if out else ''}"[:200])
    return failed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--procs", type=int, default=10)
    ap.add_argument("--plain", action="store_true", help="numba's njit, not lcckpt's kernel")
    a = ap.parse_args(argv)
    imp, deco = (("from numba import njit", "njit(cache=True, nogil=True)") if a.plain
                 else ("from lcckpt.util.jit import kernel", "kernel"))
    failed = []
    for r in range(a.rounds):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "kmod.py"), "w") as f:
                f.write(KERNEL.format(imp=imp, deco=deco))
            with open(os.path.join(d, "worker.py"), "w") as f:
                f.write(WORKER)
            failed += _round(d, r, a.procs)
    for line in failed:
        print(line)
    print(f"{'plain njit' if a.plain else 'lcckpt kernel'}: {a.rounds} rounds of "
          f"{a.procs + 1} processes, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
