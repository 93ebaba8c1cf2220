"""Helpers shared by the test files (importable because conftest.py puts tests/ on the path)."""

from __future__ import annotations

import argparse
import collections
import io
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import torch
from hypothesis import strategies as st


class NonSeekableStream(io.RawIOBase):
    """A readable, non-seekable binary stream (a pipe or socket, say)."""

    def __init__(self, data):
        self.b = io.BytesIO(data)

    def readable(self):
        return True

    def readinto(self, out):
        return self.b.readinto(out)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bits(a, b) -> bool:
    """Same dtype, shape and bytes (numpy arrays or tensors; NaN payloads and -0.0 count)."""
    a = torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a
    b = torch.from_numpy(np.ascontiguousarray(b)) if isinstance(b, np.ndarray) else b
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes_of(a), _bytes_of(b))


def sparse_parts(t: torch.Tensor) -> tuple:
    """What a sparse tensor is made of: its index and value tensors (and whether a COO
    one is coalesced)."""
    if t.layout == torch.sparse_coo:
        return t._indices(), t._values().detach(), t.is_coalesced()
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return t.crow_indices(), t.col_indices(), t.values().detach()
    return t.ccol_indices(), t.row_indices(), t.values().detach()


def assert_same(a, b, path="obj"):
    """Exact equality: same types, same key order, bit-identical tensors and floats."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor) and a.layout != torch.strided:
        assert (a.layout, a.shape, a.dtype, a.device, a.requires_grad) == \
            (b.layout, b.shape, b.dtype, b.device, b.requires_grad), path
        for k, (x, y) in enumerate(zip(sparse_parts(a), sparse_parts(b))):
            assert_same(x, y, f"{path}<part {k}>")
    elif isinstance(a, torch.Tensor):
        assert a.device == b.device, path
        assert same_bits(a, b), f"{path}: tensors differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype.str == b.dtype.str and a.shape == b.shape and a.tobytes() == b.tobytes(), path
    elif isinstance(a, argparse.Namespace):
        assert_same(vars(a), vars(b), path)
    elif isinstance(a, (dict, collections.OrderedDict)):
        assert list(a.keys()) == list(b.keys()), path
        assert getattr(a, "default_factory", None) is getattr(b, "default_factory", None), path
        for (k, x), y in zip(a.items(), b.values()):
            assert type(k) is type(next(iter(kk for kk in b if kk == k))), path
            assert_same(x, y, f"{path}[{k!r}]")
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), path
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)), path
    elif isinstance(a, np.generic):
        assert a.dtype.str == b.dtype.str and a.tobytes() == b.tobytes(), path
    elif isinstance(a, complex):
        assert_same(a.real, b.real, f"{path}.real")
        assert_same(a.imag, b.imag, f"{path}.imag")
    else:
        assert a == b, path


def assert_equal_state(a, b):
    """Equal nested dicts in any key order (what a DCP load gives back): same keys,
    tensors of the same dtype and values, other values equal."""
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_equal_state(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def train_steps(model, opt, steps: int, seed: int = 0, shape=(4, 3, 12, 12)):
    """A few deterministic optimizer steps of a 10-class model on random data."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(*shape, generator=g)
        y = torch.randint(0, 10, (shape[0],), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def kill_while_writing(script: str, args: list[str], directory, is_partial) -> bool:
    """Run ``script`` in a child; once it prints "ready", SIGKILL it as soon as a file of
    ``directory`` for which ``is_partial(path)`` holds has bytes in it.

    Returns True when the child was killed with that file still present (killed in the
    middle of writing), False when the write finished first (the caller may retry).
    """
    child = subprocess.Popen([sys.executable, "-c", script, *map(str, args)],
                             stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"ready\n"
        temp = None
        deadline = time.monotonic() + 120
        while temp is None and child.poll() is None and time.monotonic() < deadline:
            if os.path.isdir(directory):
                for name in os.listdir(directory):
                    p = os.path.join(directory, name)
                    try:
                        if is_partial(p) and os.path.getsize(p) > 0:
                            temp = p
                    except FileNotFoundError:
                        pass
            time.sleep(0.001)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        return temp is not None and os.path.exists(temp)
    finally:
        child.stdout.close()


def drifting_state(step: int) -> dict:
    """One state of a drifting run (fp32, bf16, fp16 and fp64 weights, a small tensor,
    counters): deterministic per step, so another process can make it too."""
    base = np.random.default_rng(0)
    w0, d = base.standard_normal(6000), base.standard_normal(6000)
    noise = np.random.default_rng(1000 + step).standard_normal(6000)
    w = w0 + 0.02 * np.sqrt(step) * d + 0.002 * noise
    return {
        "model": {"w": torch.from_numpy(w.astype(np.float32)),
                  "h": torch.from_numpy(w[:5000].copy()).to(torch.bfloat16),
                  "g": torch.from_numpy(w[1000:5096].astype(np.float16)),
                  "x": torch.from_numpy(w[:4500] * 3.0),
                  "b": torch.from_numpy(w[:10].astype(np.float32))},
        "step": torch.tensor(step), "epoch": step // 10, "name": "run",
    }


# --------------------------------------------------------------------------- strategies

def _random_tensor(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel() * dtype.itemsize),),
                        dtype=torch.uint8, generator=g)
    raw = raw[: torch.Size(shape).numel() * dtype.itemsize]
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def _safetensors_dtypes():
    from lcckpt.format.safetensors_io import TORCH_DTYPE
    return list(TORCH_DTYPE.values())


# dicts of tensors of every dtype safetensors holds, random bytes; and its string metadata
tensor_dicts = st.dictionaries(
    st.text(min_size=1, max_size=8).filter(lambda s: s != "__metadata__"),
    st.tuples(st.sampled_from(_safetensors_dtypes()), st.lists(st.integers(0, 5), max_size=3),
              st.integers(0, 2**31)),
    max_size=6,
).map(lambda d: {k: _random_tensor(dt, shape, seed) for k, (dt, shape, seed) in d.items()})
metadata = st.one_of(st.none(), st.dictionaries(st.text(max_size=5), st.text(max_size=10),
                                                max_size=3))


def closed_in_child(fd: int) -> bool:
    """Whether a child forked now finds ``fd`` closed (a lock it must not keep)."""
    pid = os.fork()
    if pid == 0:                                # the child: report, never return
        try:
            os.fstat(fd)
            code = 1
        except OSError:
            code = 0
        os._exit(code)
    return os.waitpid(pid, 0)[1] == 0
