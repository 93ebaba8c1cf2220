"""Frozen-state benchmark: a writer's memory on a LoRA fine-tune, references parked or kept; see lcckpt/bench/frozen.py."""

import sys

from lcckpt.bench.frozen import main

if __name__ == "__main__":
    sys.exit(main())
