"""Header benchmark: delta file sizes of a small model's chain, header time of a big file; see lcckpt/bench/header.py."""

import sys

from lcckpt.bench.header import main

if __name__ == "__main__":
    sys.exit(main())
