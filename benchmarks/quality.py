"""Restore quality of delta chains (rate vs accuracy, resume); see lcckpt/bench/quality.py."""

import argparse
import json
import sys

from lcckpt.bench.quality import run, table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="skip the resume experiment")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--plot", help="write the rate-distortion plot here (png)")
    args = ap.parse_args(argv)
    result = run(quick=args.quick, plot=args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
