"""Distributed save benchmark (1 vs 2 ranks, DCP's default planner vs the balanced one);
see lcckpt/bench/distributed.py.

Usage: python benchmarks/distributed.py [--total-mb 256] [--repeats 3] [--threads 1]
       [--no-fsync] [--json out.json]
"""

import sys

from lcckpt.bench.distributed import main

if __name__ == "__main__":
    sys.exit(main())
