"""A CheckpointManager's restore under DDP, each rank reading against the writer sending;
see lcckpt/bench/ddp_restore.py."""

import sys

from lcckpt.bench.ddp_restore import main

if __name__ == "__main__":
    sys.exit(main())
