"""How fast one process copies into another on this host: Linux's cross-memory attach
(``process_vm_readv``/``process_vm_writev``, what a cooperative restore uses between ranks
of one host, lcckpt/distributed/peer.py) against a local copy.

    python benchmarks/peer_copy.py [--mb 106] [--reps 5]

The peer's buffer is a torch tensor (as a rank's state is) or a numpy array (which numpy
backs with transparent huge pages when it is large); prints the best of ``--reps``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os

import numpy as np
import torch

from lcckpt.bench.timing import measure
from lcckpt.distributed import peer


def _peer(nbytes: int, kind: str, conn) -> None:
    buf = torch.ones(nbytes, dtype=torch.uint8) if kind == "torch" else np.ones(nbytes, np.uint8)
    conn.send((os.getpid(), buf.data_ptr() if kind == "torch" else buf.ctypes.data))
    conn.recv()                      # keep the buffer until the parent is done


def _best(fn, reps: int) -> float:
    return measure(fn, min_runs=reps, max_runs=reps, min_time=0).min_s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=106, help="MiB per copy")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    n = args.mb << 20
    print(f"{args.mb} MiB per copy, best of {args.reps}")
    print(f"{'copy':<40} {'seconds':>8} {'GB/s':>6}")
    for kind in ("torch", "numpy"):
        here, there = mp.Pipe()
        child = mp.get_context("spawn").Process(target=_peer, args=(n, kind, there))
        child.start()
        pid, addr = here.recv()
        mine = torch.zeros(n, dtype=torch.uint8) if kind == "torch" else \
            torch.from_numpy(np.zeros(n, np.uint8))
        mine += 1                                                  # touched, as a state is
        for name, fn in (("process_vm_readv", lambda: peer.read(pid, addr, mine)),
                         ("process_vm_writev", lambda: peer.write(pid, addr, mine))):
            s = _best(fn, args.reps)
            print(f"{name + ', ' + kind + ' buffers':<40} {s:8.4f} {n / s / 1e9:6.2f}")
        here.send(None)
        child.join()
    a, b = torch.ones(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    s = _best(lambda: b.copy_(a), args.reps)
    print(f"{'local copy_ (torch)':<40} {s:8.4f} {n / s / 1e9:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
