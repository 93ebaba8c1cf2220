"""The command line: inspect and verify on files and chains, exit codes, JSON."""

import json

import pytest
import torch

import lcckpt
from lcckpt.cli import main


@pytest.fixture()
def chain_dir(tmp_path):
    ck = lcckpt.DeltaCheckpointer(tmp_path / "ck", keyframe_every=3)
    w = torch.randn(5000)
    for s in range(5):
        w = w + 0.01 * torch.randn(5000)
        ck.save(s, {"w": w.clone(), "step": s})
    return tmp_path / "ck"


def test_inspect_chain_json(chain_dir, capsys):
    assert main(["inspect", str(chain_dir), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in doc["steps"]] == [0, 1, 2, 3, 4]
    assert [r["kind"] for r in doc["steps"]] == ["keyframe", "delta", "delta", "keyframe", "delta"]
    assert all(r["ratio"] > 5 for r in doc["steps"] if r["kind"] == "delta")


def test_inspect_file_table(tmp_path, capsys):
    lcckpt.save({"a": torch.randn(1000), "n": 3}, tmp_path / "x.lcc", compress=True)
    assert main(["inspect", str(tmp_path / "x.lcc")]) == 0
    out = capsys.readouterr().out
    assert "lossless" in out and "[1000]" in out


def test_inspect_torch_file(tmp_path, capsys):
    torch.save({"a": torch.randn(3)}, tmp_path / "t.pt")
    assert main(["inspect", str(tmp_path / "t.pt")]) == 0
    assert "torch.save" in capsys.readouterr().out


def test_verify_passes_then_fails_on_damage(chain_dir, capsys):
    assert main(["verify", str(chain_dir)]) == 0
    assert "OK" in capsys.readouterr().out
    victim = chain_dir / "step-000000000002.lcc"
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x10
    victim.write_bytes(bytes(data))
    assert main(["verify", str(chain_dir), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert not doc["ok"] and any(r["step"] == 2 and not r["ok"] for r in doc["report"])


def test_verify_detects_missing_link(chain_dir, capsys):
    (chain_dir / "step-000000000001.lcc").unlink()
    assert main(["verify", str(chain_dir)]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_verify_single_file(tmp_path, capsys):
    p = tmp_path / "x.lcc"
    lcckpt.save({"a": torch.randn(100)}, p)
    assert main(["verify", str(p)]) == 0
    p.write_bytes(p.read_bytes()[:-7])
    assert main(["verify", str(p)]) == 1


def test_missing_path_is_usage_error(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "nope")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_bench_help():
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0
