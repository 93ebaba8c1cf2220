"""Exact codec against ZipNN and zstd on trained weights; see lcckpt/bench/exact.py.

    python benchmarks/exact.py [--threads 2] [--reps 11] [--dtypes fp32,bf16,fp16] [--weights mlp|minilm|minilm-adamw] [--json out.json]
"""

import os
import sys

if __name__ == "__main__":
    threads = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--threads=")), None)
    if threads is None and "--threads" in sys.argv:
        threads = sys.argv[sys.argv.index("--threads") + 1]
    os.environ["LCCKPT_THREADS"] = threads or os.environ.get("LCCKPT_THREADS", "2")
    from lcckpt.bench.exact import main  # after the pool size is set
    sys.exit(main())
