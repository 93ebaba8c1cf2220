"""How often a restored step's movement misses its target, over many seeds; see
lcckpt/bench/movement.py.

    python benchmarks/movement.py [--n 5000] [--rel 1e-4] [--kind rows] [--target 0.01]
                                  [--update 0] [--seeds 0:1600] [--steps 6]
"""

import sys

from lcckpt.bench.movement import main

if __name__ == "__main__":
    sys.exit(main())
