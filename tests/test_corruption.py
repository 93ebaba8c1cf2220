"""Damaged files and killed writers: every failure is an LcckptError, never wrong data."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lcckpt
from lcckpt.format import serialization as S
from lcckpt.format.container import read_container, write_container
from lcckpt.errors import CorruptDataError, LcckptError, TruncatedError

from helpers import kill_while_writing

WORKER = Path(__file__).with_name("_fuzz_worker.py")


def _real_checkpoint(path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 10),
    )  # fmt: skip
    opt = torch.optim.Adam(model.parameters())
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 3, 8, 8)).sum().backward()
        opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 2, "tag": b"run-1"}
    S.save(state, path)
    return state


ROOT = str(Path(__file__).resolve().parents[1])


def _fuzz(*args) -> dict:
    """Run the fuzz worker on this checkout's lcckpt (not an installed one)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, str(WORKER.parent)])}
    proc = subprocess.run([sys.executable, str(WORKER), *map(str, args)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"worker crashed ({proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_random_bit_flips_and_truncations_are_always_detected(tmp_path):
    path = tmp_path / "ck.lc"
    _real_checkpoint(path)
    report = _fuzz(path, 1234, 600, 200)
    assert report["cases"] >= 800
    assert report["failures"] == [], report
    assert set(report["outcomes"]) <= {
        "ChecksumError", "CorruptDataError", "TruncatedError", "UnsupportedVersionError",
    }, report  # fmt: skip


@pytest.mark.slow
def test_swaps_splices_bombs_and_forged_headers(tmp_path):
    """Compressed files: every swap of equal-length sections, splices from the next
    "step", forged bombs and headers; a chain's swaps and splices. None loads wrong data
    or passes verify; none escapes the LcckptError hierarchy (tests/attacks/ has more)."""
    torch.manual_seed(0)
    a, b = tmp_path / "a.lc", tmp_path / "b.lc"
    w = {f"w{i}": torch.randn(32) for i in range(6)}
    S.save({**w, "z0": torch.zeros(16), "z1": torch.ones(16)}, a, compress=True)
    S.save({**{k: v + 1 for k, v in w.items()}, "z0": torch.ones(16), "z1": torch.zeros(16)},
           b, compress=True)
    chain = tmp_path / "chain"
    ck = lcckpt.DeltaCheckpointer(chain, keyframe_every=3, min_delta_elements=64,
                                  keyframe_coding="raw")
    u = torch.randn(256)
    for step in range(4):            # u and -u: sections of equal length, to swap
        u = u + 0.01 * torch.randn(256)
        ck.save(step, {"u": u.clone(), "v": -u, "step": step})
    ck.close()
    report = _fuzz(a, 7, 20, 5, "--donor", b, "--forged", 60, "--chain", chain)
    assert report["failures"] == [], report
    assert report["kinds"]["swap"] >= 15 and report["kinds"]["splice"] >= 20, report
    assert report["kinds"].get("chain-swap", 0) + report["kinds"].get("chain-splice", 0) >= 2, report["kinds"]


def test_every_truncation_of_the_fixed_prefix(tmp_path):
    path = tmp_path / "ck.lc"
    S.save({"w": torch.ones(3)}, path)
    raw = path.read_bytes()
    for n in range(len(raw)):
        path.write_bytes(raw[:n])
        with pytest.raises((TruncatedError, CorruptDataError)):
            S.load(path)


@pytest.mark.parametrize("compress", [True, False])
def test_every_bit_flip_and_truncation_of_a_small_file(compress):
    """Every byte of a version 4 file (prefix and flags, the header stored compressed or
    plain, the 16-byte padding after it, sections and the gaps between them) is a fixed
    field, under a checksum, or a required zero: no flip of any bit loads, and neither
    does any truncation."""
    meta, sections = S.pack({"w": torch.arange(5.0), "b": b"xyz", "n": 3, "tag": "run-1" * 9})
    f = io.BytesIO()
    write_container(f, sections, meta, compress_header=compress)
    raw = f.getvalue()
    with read_container(raw) as c:
        assert c.version == 4 and c.header_compressed == compress
        assert c.data_start > 24 + c.header_bytes and c.sections[1]["offset"] == 32
    assert S.load(io.BytesIO(raw))["b"] == b"xyz"
    for bit in range(len(raw) * 8):
        bad = bytearray(raw)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(LcckptError):
            S.load(io.BytesIO(bytes(bad)))
    for n in range(len(raw)):
        with pytest.raises(CorruptDataError):
            S.load(io.BytesIO(raw[:n]))


_CHILD = """
import sys, torch
from lcckpt.format.serialization import save
big = torch.full((48 * 2**20,), 7.0)  # 192 MiB: writing it takes a while
print("ready", flush=True)
save({"step": 2, "w": big}, sys.argv[1])
print("done", flush=True)
"""


@pytest.mark.slow
@pytest.mark.skipif(os.name != "posix", reason="needs SIGKILL")
def test_sigkill_during_save_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "ck.lc"
    previous = {"step": 1, "w": torch.arange(1000.0)}
    S.save(previous, path)
    partial = lambda p: os.path.basename(p) != path.name  # noqa: E731
    for _attempt in range(3):
        if kill_while_writing(_CHILD, [path], tmp_path, partial):
            break  # killed in the middle of writing
        S.save(previous, path)  # the save finished first: put the old one back, try again
    else:
        pytest.fail("could not kill the writer while it was writing")

    loaded = S.load(path)  # the old checkpoint, intact
    assert loaded["step"] == 1 and torch.equal(loaded["w"], previous["w"])
    assert [p for p in tmp_path.iterdir() if partial(p)]  # the killed writer's partial temp file

    S.save({"step": 3, "w": torch.zeros(2)}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["ck.lc"]
    assert S.load(path)["step"] == 3


def test_error_hierarchy():
    for cls in (CorruptDataError, TruncatedError):
        assert issubclass(cls, LcckptError)
