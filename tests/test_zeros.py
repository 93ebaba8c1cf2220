"""Tensors of zeros: stored as their dtype and shape (the ``"zeros"`` section codec), loaded
as pages that take memory only where written, and not held against the default load
limit. Before, a file holding a large zero buffer (a preallocated cache, a zero-initialised
adapter) coded losslessly was thousands of times smaller than what it declared, and the
default limit's 32x bound refused it: a `CheckpointManager` could not restore its own
checkpoint."""

import io
import os
import sys
import warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st

import lcckpt
from lcckpt import limits
from lcckpt.errors import CorruptDataError, InvalidArgumentError, ResourceLimitError
from lcckpt.format import sections, serialization
from lcckpt.format.container import read_container
from lcckpt.format.verify import verify_file
from lcckpt.training.manager import CheckpointManager

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "attacks"))
import craft  # noqa: E402

N = 1 << 20                     # 4 MiB of fp32 zeros: past a 1 MiB floor, under the 1 MiB


@pytest.fixture
def small_limit(monkeypatch):
    """A default limit of 1 MiB + 32x the stored size (192 MiB in earnest), so that a few
    MB of zeros show what hundreds of MB did."""
    monkeypatch.setattr(limits, "AUTO_FLOOR", 1 << 20)


def _codecs(path) -> dict:
    with read_container(path) as c:
        return {s["name"]: (s["meta"].get("codec"), s["length"]) for s in c.sections}


def test_a_compressed_file_of_a_large_zero_tensor_loads_under_the_default_limit(
        tmp_path, small_limit):
    state = {"cache": torch.zeros(4, N // 4), "w": torch.randn(30, 30),
             "mask": torch.zeros(N, dtype=torch.bool), "neg": torch.full((N // 8,), -0.0)}
    lcckpt.save(state, tmp_path / "s.lcc", compress=True)
    codecs = _codecs(tmp_path / "s.lcc")
    assert codecs['obj["cache"]'] == codecs['obj["mask"]'] == ("zeros", 0)
    assert codecs['obj["neg"]'][0] == "lossless"      # -0.0 is not zero bytes: kept exact
    everything = sum(t.nbytes for t in state.values())          # what was counted before
    assert os.path.getsize(tmp_path / "s.lcc") * 32 + (1 << 20) < everything
    back = lcckpt.load(tmp_path / "s.lcc")
    for k, t in state.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k].view(torch.uint8),
                                                        t.view(torch.uint8)), k
    report = verify_file(tmp_path / "s.lcc")
    assert report["ok"] and report["declared_bytes"] < 2 * N     # what the load allocates
    # into= zeroes its target; a lazy read gives any part
    target = {"cache": torch.ones(4, N // 4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)     # the other keys have no target
        got = lcckpt.load(tmp_path / "s.lcc", into=target)
    assert got["cache"] is target["cache"] and not target["cache"].any()
    with lcckpt.open(tmp_path / "s.lcc") as f:
        assert torch.equal(f.get_slice("cache")[1:3, 5:9], torch.zeros(2, 4))
        assert not f.get_tensor("mask").any()


@pytest.mark.parametrize("stream", [False, True])
def test_a_compressed_file_of_a_large_constant_loads_under_the_default_limit(
        tmp_path, small_limit, monkeypatch, stream):
    """A buffer of one value other than zero codes to a few bytes, as a bomb does: the
    sections that expand past 32x may exceed it by the floor together; beyond that, a
    tensor goes raw, so that the file loads under "auto" (streamed to the file, too)."""
    if stream:
        monkeypatch.setattr(serialization._stream, "STREAM_ABOVE", 1)
    state = {"a_small": torch.full((N // 16,), 2.0), "ones": torch.ones(N),
             "w": torch.randn(30, 30)}
    lcckpt.save(state, tmp_path / "s.lcc", compress=True)
    codecs = _codecs(tmp_path / "s.lcc")
    assert codecs['obj["a_small"]'][0] == "lossless" and codecs['obj["a_small"]'][1] < 1000
    assert codecs['obj["ones"]'] == ("raw", 4 * N)
    back = lcckpt.load(tmp_path / "s.lcc")              # refused before: 4 MiB in ~70 KB
    assert all(torch.equal(back[k], t) for k, t in state.items())
    lcckpt.save({"ones": torch.ones(N // 4)}, tmp_path / "t.lcc", compress=True)
    assert _codecs(tmp_path / "t.lcc")['obj["ones"]'][0] == "lossless"   # within the floor


def test_a_chain_of_a_large_constant_loads_under_the_default_limit(tmp_path, small_limit):
    """The same in a chain: a keyframe's, and a merge's, exact blob of a large constant
    has raw planes, and every step loads; a small constant stays coded."""
    ck = lcckpt.DeltaCheckpointer(tmp_path / "c")
    ones, w = torch.ones(N), torch.randn(1000)
    ck.save(0, {"ones": ones, "small": torch.full((N // 16,), 2.0), "w": w})
    assert os.path.getsize(ck.path(0)) > 4 * N                    # the ones, raw
    ones[:10] = 3.0
    ck.save(1, {"ones": ones, "small": torch.full((N // 16,), 2.0), "w": w + 1})
    assert os.path.getsize(ck.path(1)) < 10_000                   # a delta
    for step in (0, 1):
        assert torch.equal(lcckpt.DeltaCheckpointer(tmp_path / "c").load(step)["ones"][:11],
                           torch.tensor([3.0] * 10 + [1.0]) if step else torch.ones(11))
    ck.merge(1)
    got = lcckpt.DeltaCheckpointer(tmp_path / "c").load(1)
    assert torch.equal(got["ones"], ones) and torch.equal(got["w"], w + 1)
    assert ck.info(0)["tensors"]['obj["small"]']["nbytes"] < 1000


def test_small_zero_tensors_and_raw_files_are_stored_as_before(tmp_path):
    lcckpt.save({"z": torch.zeros(100), "big": torch.zeros(N)}, tmp_path / "raw.lcc")
    assert {c for c, _ in _codecs(tmp_path / "raw.lcc").values()} == {"raw"}  # mmap-able
    lcckpt.save({"z": torch.zeros(sections.ZEROS_MIN // 4 - 1)}, tmp_path / "s.lcc",
                compress=True)
    assert _codecs(tmp_path / "s.lcc")['obj["z"]'][0] != "zeros"
    with pytest.raises(InvalidArgumentError, match="unknown codec 'zeros'"):
        lcckpt.save({"z": torch.zeros(N)}, tmp_path / "x.lcc", codec="zeros")


def test_a_chain_stores_zero_tensors_as_zeros_and_tracks_them_once_they_move(
        tmp_path, small_limit):
    """A zero-initialised weight (a LoRA B matrix) and a cache buffer filled later: each
    is stored as zeros while it is zero, then written as a tensor new to the chain. Every
    step loads under the default limit; a reopened writer goes on as the first did."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(512, 512, generator=g)
    lora_b = torch.zeros(N // 512, 512)
    cache = torch.zeros(N)
    ck = lcckpt.DeltaCheckpointer(tmp_path, keyframe_every=4)
    truth = {}
    for step in range(6):
        if step >= 1:
            w += 1e-3 * torch.randn(w.shape, generator=g)
            lora_b += 1e-3 * torch.randn(lora_b.shape, generator=g)
        if step == 2:
            cache[: N // 2] = torch.randn(N // 2, generator=g)
        if step == 4:
            cache.zero_()
        state = {"model": {"w": w.clone(), "lora_b": lora_b.clone()},
                 "buffers": {"cache": cache.clone()}}
        ck.save(step, state)
        truth[step] = state
    ck.close()
    files = sorted(tmp_path.glob("step-*.lcc"))
    kinds = [_codecs(f) for f in files]
    assert kinds[0]['obj["model"]["lora_b"]'] == ("zeros", 0)
    assert kinds[1]['obj["model"]["lora_b"]'][0] == "delta"
    assert [k['obj["buffers"]["cache"]'][0] for k in kinds] == \
        ["zeros", "zeros", "delta", "delta", "zeros", "zeros"]
    reader = lcckpt.DeltaCheckpointer(tmp_path)
    for step, want in truth.items():
        got = reader.load(step)
        for part, tensors in want.items():
            for k, t in tensors.items():
                err = (got[part][k] - t).norm().item()
                assert err <= 0.1 * max(t.norm().item(), 1e-30), (step, k, err)   # sanity
                if not t.any():
                    assert not got[part][k].any(), (step, k)    # zeros are exact
        with lcckpt.open(tmp_path, step=step) as f:           # lazy reads agree
            for k in ("model.lora_b", "buffers.cache"):
                part, name = k.split(".")
                assert torch.equal(f.get_slice(k)[3:5], got[part][name][3:5]), (step, k)
    # a writer reopened on the chain writes what the first one would have written next
    for d, reopen in ((tmp_path, True), (tmp_path / "again", False)):
        if not reopen:
            again = lcckpt.DeltaCheckpointer(d, keyframe_every=4)
            for step, state in truth.items():
                again.save(step, state)
        else:
            again = lcckpt.DeltaCheckpointer(d, keyframe_every=4)
            again.load(5, resume=True)
        cache[:] = 1.0
        again.save(6, {"model": truth[5]["model"], "buffers": {"cache": cache.clone()}})
        again.close()
    assert (tmp_path / "step-000000000006.lcc").read_bytes() == \
        (tmp_path / "again" / "step-000000000006.lcc").read_bytes()


def test_a_manager_restores_a_model_with_a_large_zero_buffer(tmp_path, small_limit):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)
            self.register_buffer("cache", torch.zeros(N))

    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with CheckpointManager(tmp_path, model, opt, every=1, backpressure="wait") as mgr:
        for _ in range(3):
            model.lin(torch.randn(8, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
            mgr.step()
    fresh = Model()
    fresh.cache.fill_(7.0)
    with CheckpointManager(tmp_path, fresh, torch.optim.AdamW(fresh.parameters()), every=1) as mgr:
        assert mgr.restore() == 3
    assert not fresh.cache.any()
    assert (fresh.lin.weight - model.lin.weight).norm() <= 0.01 * model.lin.weight.norm()


def test_crafted_zeros_sections_fail_cleanly(tmp_path):
    # a payload where there must be none
    raw = craft.tensor_file(b"\0" * 16, [4], codec="zeros")
    with pytest.raises(CorruptDataError, match="zeros section holds 16 bytes"):
        lcckpt.load(io.BytesIO(raw))
    (tmp_path / "bad.lcc").write_bytes(raw)
    assert not verify_file(tmp_path / "bad.lcc")["ok"]
    # a shape that cannot be mapped is refused by the mapping, not by the header's size:
    # 2**47 float64 elements (1 PiB) of zeros in a file of a few hundred bytes
    raw = craft.tensor_file(b"", [1 << 47], dtype="F64", codec="zeros")
    try:
        out = lcckpt.load(io.BytesIO(raw))
    except ResourceLimitError as e:
        assert "cannot be mapped" in str(e)
    else:                          # an always-overcommitting kernel: nothing is touched
        assert out["t"].shape == (1 << 47,) and not out["t"][-4:].any()


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8,
          torch.int64, torch.bool, torch.complex64]


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(DTYPES), nbytes=st.integers(sections.ZEROS_MIN - 64,
                                                        sections.ZEROS_MIN + 8192),
       where=st.one_of(st.none(), st.floats(0, 1)), byte=st.integers(1, 255))
def test_zeros_is_chosen_exactly_when_every_byte_is_zero(dtype, nbytes, where, byte):
    """One non-zero byte anywhere (in the first 4 KiB the probe reads, or past it; a -0.0
    is one such byte) keeps a tensor lossless; a tensor of zero bytes from 64 KiB up is
    stored as zeros. Either way it loads bit for bit."""
    item = torch.empty((), dtype=dtype).element_size()
    t = torch.zeros(nbytes // item, dtype=dtype)
    raw = t.view(torch.uint8)
    if where is not None:
        raw[min(int(where * raw.numel()), raw.numel() - 1)] = byte
    buf = io.BytesIO()
    lcckpt.save({"t": t}, buf, compress=True)
    back = lcckpt.load(io.BytesIO(buf.getvalue()))["t"]
    assert back.dtype == dtype and torch.equal(back.view(torch.uint8), raw)
    with read_container(io.BytesIO(buf.getvalue())) as c:
        codec = c.sections[0]["meta"]["codec"]
    assert (codec == "zeros") == (where is None and raw.numel() >= sections.ZEROS_MIN)


_CHILD = """
import sys, torch, lcckpt
before = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:"))
state = lcckpt.load(sys.argv[1])
assert state["cache"].shape == (1 << 28,) and not state["cache"][-1000:].any()
peak = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(peak - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_gib_of_zeros_loads_without_taking_the_memory(tmp_path):
    """What the limit does not count must cost nothing: a 1 GiB zero tensor loads in a
    fresh process whose peak resident memory grows by far less than that."""
    import subprocess
    lcckpt.save({"cache": torch.zeros(1 << 28)}, tmp_path / "z.lcc", compress=True)
    # its header alone, in the room a streamed writer keeps for 1 GiB of sections' windows
    from lcckpt.format.windows import room
    assert os.path.getsize(tmp_path / "z.lcc") < 16384 + room(1 << 30)
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "z.lcc")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    # 63 MiB measured (the code a first load brings in); faulted in, the zeros add 1 GiB
    assert int(out.stdout) * 1024 < 256 << 20, f"peak grew by {int(out.stdout) // 1024} MiB"
