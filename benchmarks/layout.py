"""Chain layouts (previous step, keyframe, skip deltas): bytes against restore work on real
training runs; see lcckpt/bench/layout.py."""

import sys

from lcckpt.bench.layout import main

if __name__ == "__main__":
    sys.exit(main())
