"""Distributed save benchmark (1 vs 2 ranks, DCP's default planner vs the balanced one);
see lcckpt/bench/distributed.py.

Usage: python benchmarks/distributed.py [--total-mb 256] [--repeats 3] [--threads 1]
       [--no-fsync] [--json out.json]
"""

import argparse
import json
import sys

from lcckpt.bench.distributed import run, table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mb", type=float, default=256)
    ap.add_argument("--dominant", type=float, default=0.8,
                    help="fraction of the state in the one large tensor")
    ap.add_argument("--small", type=int, default=200, help="number of small tensors")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="compression threads per rank")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp directory)")
    ap.add_argument("--no-fsync", action="store_true",
                    help="do not fsync the files (tells compression time from the disk's)")
    ap.add_argument("--json", default=None, help="write the result here too")
    a = ap.parse_args(argv)
    res = run(a.total_mb, a.dominant, a.small, a.repeats, a.threads, a.dir, sync=not a.no_fsync)
    s = res["state"]
    print(f"state: {s['bytes'] / 1e6:.1f} MB in {s['tensors']} tensors, largest "
          f"{s['largest_bytes'] / 1e6:.1f} MB; {res['threads_per_rank']} thread(s) per rank; "
          f"fsync {'on' if res['fsync'] else 'off'}; "
          f"load average before {res['loadavg_before'][0]:.2f}, after "
          f"{res['loadavg_after'][0]:.2f}")
    print(table(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
