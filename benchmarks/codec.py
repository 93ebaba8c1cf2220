"""Codec benchmark on real training trajectories; see lcckpt/bench/codec.py (= `lcckpt bench`)."""

import sys

from lcckpt.bench.codec import main

if __name__ == "__main__":
    sys.exit(main())
