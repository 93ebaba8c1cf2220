"""Checkpoint-schedule comparison; see lcckpt/bench/schedule.py."""

import sys

from lcckpt.bench.schedule import main

if __name__ == "__main__":
    sys.exit(main())
