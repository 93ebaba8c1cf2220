"""Lazy-read benchmark: one small tensor of a >= 500 MB file vs a full load; see lcckpt/bench/lazy.py."""

import sys

from lcckpt.bench.lazy import main

if __name__ == "__main__":
    sys.exit(main())
