"""Restore quality of delta chains (rate vs accuracy, resume); see lcckpt/bench/quality.py."""

import sys

from lcckpt.bench.quality import main

if __name__ == "__main__":
    sys.exit(main())
