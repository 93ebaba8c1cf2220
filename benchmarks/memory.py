"""Peak resident memory of a default save, a restore, a manager save and bench --checkpoint,
each in a child process; see lcckpt/bench/memory.py."""

import sys

from lcckpt.bench.memory import main

if __name__ == "__main__":
    sys.exit(main())
