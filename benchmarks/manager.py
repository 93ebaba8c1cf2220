"""Training-loop overhead of CheckpointManager; see lcckpt/bench/manager.py."""

import sys

from lcckpt.bench.manager import main

if __name__ == "__main__":
    sys.exit(main())
