"""Every bit of a torch.save file's zip structure, flipped one at a time (not part of the
default suite; about a minute).

    python tests/attacks/torch_zip_sweep.py [--seed 3]

The file is the foreign fuzz's state (five tensors) saved by torch.save. Its structure is
the central directory with the end records, and each member's local header and data
descriptor; tensor data is left out (a flip there loads other numbers, as torch checks no
CRC, and fails ``lcckpt verify``). Each damaged file goes through ``lcckpt.load`` and, when
it loads other data, through ``lcckpt verify``. Prints the outcomes per region; exits 1 if
any case escaped the LcckptError hierarchy or loaded other data that verify passed.
"""

import argparse
import collections
import io
import os
import struct
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), HERE]

import torch  # noqa: E402

import lcckpt  # noqa: E402
from lcckpt.cli import verify_file  # noqa: E402
from lcckpt.errors import LcckptError  # noqa: E402
from _fuzz_foreign import _same, _state, _zip_directory_start  # noqa: E402


def regions(raw: bytes) -> dict[str, list[tuple[int, int]]]:
    """Byte ranges of the zip's structure: the central directory to the end, and each
    member's local header and data descriptor."""
    local = []
    for info in zipfile.ZipFile(io.BytesIO(raw)).infolist():
        h = info.header_offset
        names, extra = struct.unpack("<HH", raw[h + 26:h + 30])
        data = h + 30 + names + extra
        local.append((h, data))
        if info.flag_bits & 0x08:                       # a data descriptor follows
            local.append((data + info.compress_size, data + info.compress_size + 16))
    return {"directory": [(_zip_directory_start(raw), len(raw))], "local headers": local}


def outcome(data: bytes, state: dict, scratch: str) -> tuple[str, bool]:
    """``(outcome, ok)`` of loading ``data`` from a file."""
    with open(scratch, "wb") as f:
        f.write(data)
    try:
        obj = lcckpt.load(scratch)
    except LcckptError as e:
        return type(e).__name__, True
    except BaseException as e:  # noqa: BLE001 (anything else is a bug)
        return f"OTHER {type(e).__name__}: {str(e)[:120]}", False
    if _same(state, obj):
        return "loaded the same", True
    try:
        passed = verify_file(scratch)["ok"]
    except LcckptError:
        passed = False
    return ("other data, verify PASSES", False) if passed else ("other data, verify fails", True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()
    state = _state(args.seed)
    buf = io.BytesIO()
    torch.save(state, buf)
    raw = buf.getvalue()
    fd, scratch = tempfile.mkstemp(suffix=".pt")
    os.close(fd)
    failures = []
    try:
        for name, spans in regions(raw).items():
            counts = collections.Counter()
            for lo, hi in spans:
                for bit in range(lo * 8, hi * 8):
                    data = bytearray(raw)
                    data[bit // 8] ^= 1 << (bit % 8)
                    what, ok = outcome(bytes(data), state, scratch)
                    counts[what] += 1
                    if not ok:
                        failures.append((name, bit // 8, bit % 8, what))
            print(f"{name}: {sum(counts.values())} flips: {dict(counts)}")
    finally:
        os.unlink(scratch)
    for f in failures:
        print("FAIL", f)
    print(f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
