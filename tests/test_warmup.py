"""``lcckpt.warmup()`` loads every kernel that a chain's save and restore run, so neither
pays for loading code (time, and the memory the code takes) the first time."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys, tempfile, os
    import torch, lcckpt
    from numba.core.registry import CPUDispatcher

    def loaded():
        return {(m, k): len(v.overloads) for m, mod in list(sys.modules.items())
                if m.startswith("lcckpt") for k, v in vars(mod).items()
                if isinstance(v, CPUDispatcher)}

    before_dirs = set(os.listdir(tempfile.gettempdir()))
    lcckpt.warmup()
    assert set(os.listdir(tempfile.gettempdir())) <= before_dirs, "warmup left files"
    loaded_before = loaded()
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 300))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    for settings in ({}, {"bits": 2}):                 # the default targets, LC mode
        d = os.path.join(sys.argv[1], str(len(settings)))
        ck = lcckpt.DeltaCheckpointer(d, **settings)
        for step in range(4):
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(32, 256)).pow(2).mean().backward()
                opt.step()
            ck.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
        ck.close()
        lcckpt.DeltaCheckpointer(d).load()
    new = {k: v for k, v in loaded().items() if v != loaded_before.get(k, 0)}
    assert not new, f"kernels first loaded by a save after warmup: {sorted(new)}"
    g = torch.Generator().manual_seed(5)
    n = 3_000_000
    state = {"w": torch.randn(n, generator=g), "m": torch.zeros(n), "b": torch.randn(7)}
    chain = os.path.join(sys.argv[1], "large")
    ck = lcckpt.DeltaCheckpointer(chain)
    for step in range(6):
        ck.save(step, state)
        state = {"w": state["w"] + 1e-3 * torch.randn(n, generator=g),
                 "m": state["m"] + 1e-4 * torch.randn(n, generator=g) * (step % 2),
                 "b": state["b"] + 1.0}
        state["w"][step::70001] += 0.3
    ck.close()
    loaded_before = loaded()
    reader = lcckpt.DeltaCheckpointer(chain)
    for step in (1, 5):
        reader.load(step)
    reader.load(into={k: torch.empty_like(v) for k, v in state.items()})
    new = {k: v for k, v in loaded().items() if v != loaded_before.get(k, 0)}
    assert not new, f"kernels first loaded by a restore after warmup: {sorted(new)}"
    print("ok")
""")


def test_saves_and_restores_after_warmup_load_no_kernel(tmp_path):
    """In a fresh process after ``warmup()``: chains of a model and its Adam state (the
    default targets, whose steps are steered along the first moments, and LC mode) save
    and restore, and restores of a chain of large tensors (one delta; five side by side;
    escapes; a tensor that moves every other step) run, loading no kernel that
    ``warmup()`` did not; ``warmup()`` leaves nothing in the temporary directory."""
    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp"))
    os.makedirs(env["TMPDIR"])
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "chain")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_writable_and_read_only_blobs_share_compiled_decoders():
    """A blob in writable memory (a bytearray, a numpy array) decodes through the kernels
    compiled for read-only bytes: each decoder is compiled once for both (each compile
    of the larger ones took seconds of a fresh install's first restore)."""
    import numpy as np
    import torch

    import lcckpt
    from lcckpt.codec.kernels import head, planes

    t = torch.randn(300_000, generator=torch.Generator().manual_seed(3))
    blob = lcckpt.encode(t, lossless=True)
    for held in (bytes(blob), bytearray(blob), np.frombuffer(bytearray(blob), np.uint8)):
        assert torch.equal(torch.as_tensor(lcckpt.decode(held)), t)
    for kernel in (head.read_head, planes.decode_float_chunks):
        assert kernel.signatures, kernel
        assert not any(sig[0].mutable for sig in kernel.signatures), (kernel, kernel.signatures)
