"""The README's tour and docs/getting-started.md's examples run as written.

Their code blocks use names a reader brings (a model, an optimizer, a delta, a training
step); the fixtures below stand in for those, and nothing in a block is rewritten, so a
renamed argument or a changed signature in the library fails here before a reader meets it.
"""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _python_blocks(doc: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), re.S)


def _reader_names() -> dict:
    """What the examples assume the reader has: a model with an ``fc`` layer, Adam after one
    step, arrays for the codec, and a loop's step function and counters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("fc", torch.nn.Linear(8, 4))
    opt = torch.optim.Adam(model.parameters())

    def train_step():
        opt.zero_grad()
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        return loss.detach()

    train_step()
    rng = np.random.default_rng(0)
    weights = rng.standard_normal(20_000).astype(np.float32)
    delta = (rng.standard_normal(20_000) * 1e-3).astype(np.float32)
    return {"model": model, "opt": opt, "train_step": train_step, "weights": weights,
            "delta": delta, "states": [weights + i * delta for i in range(4)],
            "state": {"model": model.state_dict()}, "step": 1200, "steps": 201,
            "total_steps": 3}


def _run(code: str, name: str, tmp_path, monkeypatch) -> dict:
    monkeypatch.chdir(tmp_path)
    namespace = _reader_names()
    exec(compile(code, name, "exec"), namespace)
    return namespace


def test_the_readme_tour_runs(tmp_path, monkeypatch):
    (tour,) = _python_blocks("README.md")
    ns = _run(tour, "README.md", tmp_path, monkeypatch)
    assert ns["ck"].steps() == [1200]                  # the rollback to 1200 kept it
    assert ns["start"] == 0 and ns["mgr"].iteration == 3   # the manager's loop ran
    last = ns["states"][-1]
    assert np.linalg.norm(ns["y"] - last) < 0.01 * np.linalg.norm(last)   # the stream kept up
    saved = ns["lcckpt"].load(tmp_path / "ckpt.lcc")["model"]["fc.weight"]
    assert torch.equal(ns["w"], saved) and torch.equal(ns["rows"], saved[:16])


def test_getting_started_runs(tmp_path, monkeypatch):
    blocks = _python_blocks("docs/getting-started.md")
    assert len(blocks) == 5
    replace, chain, reader = blocks[0], blocks[1], blocks[4]
    ns = _run("\n".join([replace, chain, reader]), "getting-started.md", tmp_path, monkeypatch)
    assert ns["ck"].steps() == [0, 100, 200]
    assert set(ns["state"]) == {"model", "optim"}
    assert torch.equal(ns["w"], ns["lcckpt"].load(tmp_path / "ckpt.lcc")["model"]["fc.weight"])


@pytest.mark.parametrize("doc", ["README.md", "docs/getting-started.md"])
def test_the_examples_are_found(doc):
    """A block fenced differently would silently drop out of the tests above."""
    text = (ROOT / doc).read_text()
    assert text.count("```python") == len(_python_blocks(doc)) > 0
