"""What a CheckpointManager costs a DDP loop; see lcckpt/bench/ddp.py."""

import sys

from lcckpt.bench.ddp import main

if __name__ == "__main__":
    sys.exit(main())
