"""Progress reports: lcckpt.save(progress=...), convert's, and the command line's bars."""

import sys

import numpy as np
import torch

import lcckpt
from lcckpt.format import stream as _stream
from lcckpt.interop.convert import convert
from lcckpt.util import bars


def _state():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(300, 40, generator=g), "b": torch.zeros(7, dtype=torch.bfloat16),
            "n": torch.arange(10), "a": np.ones(50, np.float32), "note": "x"}


def test_save_reports_the_bytes_of_every_tensor_it_codes(tmp_path, monkeypatch):
    """Each tensor's bytes once, and a numpy array's where it is coded (compress=True);
    the same on the path that writes tensors as they are coded (objects of 64 MiB or
    more, its threshold lowered here)."""
    state = _state()
    tensors = 300 * 40 * 4 + 7 * 2 + 10 * 8
    for streamed in (False, True):
        if streamed:
            monkeypatch.setattr(_stream, "STREAM_ABOVE", 1)
        for compress, want in ((False, tensors), (True, tensors + 50 * 4)):
            seen = []
            path = tmp_path / f"s{streamed}{compress}.lcc"
            lcckpt.save(state, path, compress=compress, progress=seen.append)
            assert sum(seen) == want and all(n > 0 for n in seen), (streamed, compress, seen)
            assert torch.equal(lcckpt.load(path)["w"], state["w"])


def test_convert_reports_bytes_against_the_total(tmp_path):
    src = tmp_path / "a.pt"
    torch.save({k: v for k, v in _state().items() if k != "a"}, src)
    calls = []
    convert(src, tmp_path / "a.lcc", compress=True, progress=lambda n, t: calls.append((n, t)))
    total = 300 * 40 * 4 + 7 * 2 + 10 * 8
    assert calls and {t for _, t in calls} == {total} and sum(n for n, _ in calls) == total


def test_bars_draw_on_a_terminal_only(monkeypatch):
    drawn = []

    class Fake:
        def __init__(self, iterable=None, **kw):
            drawn.append(kw)
            self.iterable, self.n = iterable, 0

        def __iter__(self):
            return iter(self.iterable)

        def update(self, n):
            self.n += n

        def close(self):
            drawn.append(("closed", self.n))

    monkeypatch.setattr(bars, "_tqdm", lambda: None)          # a pipe: nothing drawn
    assert bars.items([1, 2], "x") == [1, 2]
    with bars.byte_bar("x") as bar:
        assert bar is None
    monkeypatch.setattr(bars, "_tqdm", lambda: Fake)
    assert list(bars.items([1, 2], "x")) == [1, 2] and drawn[-1]["desc"] == "x"
    with bars.byte_bar("convert") as bar:
        bar(10, 30)
        bar(20, 30)
    assert drawn[-2]["total"] == 30 and drawn[-2]["unit"] == "B" and drawn[-1] == ("closed", 30)
    monkeypatch.undo()                                          # the real check: a pipe
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert bars._tqdm() is None
