"""The manager's stall: snapshotting a state of CUDA tensors into reused pinned host buffers
(lcckpt.training.hostcopy.HostBuffers) against a plain ``.cpu()`` of the same tensors.

Needs a GPU: ``python benchmarks/snapshot.py [--gib 1]``. Prints the first snapshot (which
allocates the pinned buffers), the median of the next five, and the median of three plain
copies; checks that the snapshot is bit-exact.
"""

import argparse
import statistics
import sys
import time

import torch

from lcckpt.training.hostcopy import HostBuffers


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=int, default=1, help="state size in GiB (64 MiB tensors)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("snapshot benchmark: no CUDA device, nothing to measure")
        return 0
    torch.manual_seed(0)
    state = {f"l{i}": torch.randn(4096, 4096, device="cuda") for i in range(16 * args.gib)}
    nbytes = sum(t.nbytes for t in state.values())
    buffers, snap = HostBuffers(), {}

    def snapshot():
        snap.update(buffers.snapshot(state))
    first = _timed(snapshot)
    steady = statistics.median(_timed(snapshot) for _ in range(5))
    plain = statistics.median(_timed(lambda: [t.cpu() for t in state.values()]) for _ in range(3))
    exact = all(torch.equal(snap[k], v.cpu()) for k, v in state.items())
    print(f"{torch.cuda.get_device_name()}, {nbytes / 2**30:.0f} GiB of fp32 CUDA tensors")
    print(f"snapshot: first {first:.3f} s (allocates pinned buffers), then median "
          f"{steady * 1e3:.1f} ms = {nbytes / steady / 1e9:.1f} GB/s; bit-exact: {exact}")
    print(f"plain .cpu(): median {plain:.3f} s ({plain / steady:.0f}x the snapshot)")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
