"""Files written by earlier versions load to the same values (golden files in fixtures/).

Each ``tests/fixtures/<version>/`` was written by ``make_golden.py`` with the code of that
version and is never rewritten; ``manifest.json`` holds digests of what it decoded to then.
"""

import json
import os
import shutil

import numpy as np
import pytest

import lcckpt

from fixtures.make_golden import CODERS, delta_source, digest, tree_digest

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
VERSIONS = sorted(d for d in os.listdir(FIXTURES) if os.path.isfile(os.path.join(FIXTURES, d, "manifest.json")))


def _manifest(version):
    with open(os.path.join(FIXTURES, version, "manifest.json")) as f:
        return json.load(f)


def test_there_are_golden_files():
    assert "v1" in VERSIONS
    m = _manifest("v1")
    assert len(m["blobs"]) == 40 and len(m["files"]) == 2 and len(m["chain"]) == 5


@pytest.mark.parametrize("version", VERSIONS)
def test_blobs_decode_to_the_recorded_values(version):
    m = _manifest(version)
    for name, want in m["blobs"].items():
        with open(os.path.join(FIXTURES, version, name), "rb") as f:
            assert digest(lcckpt.decode(f.read())) == want, name


@pytest.mark.parametrize("version", VERSIONS)
def test_files_load_to_the_recorded_values(version):
    m = _manifest(version)
    for name, want in m["files"].items():
        assert tree_digest(lcckpt.load(os.path.join(FIXTURES, version, name))) == want, name


@pytest.mark.parametrize("version", [v for v in VERSIONS if _manifest(v)["chain"]])
def test_chain_restores_every_step_to_the_recorded_values(version, tmp_path):
    m = _manifest(version)
    d = tmp_path / "chain"
    shutil.copytree(os.path.join(FIXTURES, version, "chain"), d)   # a reader never writes, but be safe
    ck = lcckpt.DeltaCheckpointer(d)
    assert [str(s) for s in ck.steps()] == sorted(m["chain"], key=int)
    kinds = {ck.info(s)["kind"] for s in ck.steps()}
    assert kinds == {"keyframe", "delta"}
    for step in ck.steps():
        assert tree_digest(ck.load(step)) == m["chain"][str(step)], step
    assert [tree_digest(obj) for _, obj in ck.replay()] == [m["chain"][str(s)] for s in ck.steps()]


def test_lossy_encoder_output_is_unchanged():
    """Today's encoder writes v1's lossy blobs byte for byte (the LC-faithful coder above all)."""
    for dtype in (np.float32, np.float64, np.float16):
        for coder in CODERS:
            for bits in (1, 2, 4):
                name = f"lossy-{np.dtype(dtype).name}-{coder}-b{bits}.blob"
                with open(os.path.join(FIXTURES, "v1", name), "rb") as f:
                    want = f.read()
                assert lcckpt.encode(delta_source(dtype, bits), bits=bits, coder=coder) == want, name
