"""The GPU side: CUDA state snapshotted to host by the manager, chains and DCP checkpoints of
CUDA tensors, and restores onto the GPU through ``map_location``. Skipped without CUDA
(CI has none); each check is written once over a device so that it also runs on the CPU."""

import pathlib

import pytest
import torch

import lcckpt
import lcckpt.distributed as ld
from lcckpt.training.manager import CheckpointManager

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))]


def _model(device, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10)).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train(model, opt, n, device):
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        x = torch.randn(32, 64, generator=g).to(device)
        loss = model(x).logsumexp(1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss


def _close(restored, true, rel):
    """Each tensor within ``rel`` of its own norm (the chain's targets are far tighter)."""
    for k, t in true.items():
        r = restored[k]
        assert r.device == t.device and r.dtype == t.dtype, k
        err = (r.double() - t.double()).norm().item()
        assert err <= rel * t.double().norm().item() + 1e-12, (k, err)


@pytest.mark.parametrize("background", [True, "overlap"])
@pytest.mark.parametrize("device", DEVICES)
def test_manager_snapshots_device_state_to_host_and_restores_it_in_place(tmp_path, device,
                                                                        background):
    model, opt = _model(device)
    with CheckpointManager(tmp_path, model, opt, every=3, backpressure="wait",
                           background=background) as mgr:
        for _ in range(9):
            mgr.step(_train(model, opt, 1, device))
        mgr.wait()
        if background == "overlap":    # written from the device tensors themselves
            assert not any('["model"]' in k or '["optimizer"]' in k
                           for k in mgr._buffers._buffers)
        elif device == "cuda":         # every CUDA tensor copied by DMA into pinned memory
            on_gpu = [t for t in [*model.state_dict().values(), *(
                v for s in opt.state.values() for v in s.values())] if t.is_cuda]
            pinned = [b for b in mgr._buffers._buffers.values() if b.is_pinned()]
            assert sum(t.nbytes for t in on_gpu) == sum(b.nbytes for b in pinned) > 0
        true = {k: v.detach().clone() for k, v in model.state_dict().items()}
        moments = [(s["exp_avg"].clone(), s["exp_avg_sq"].clone()) for s in opt.state.values()]
    fresh, fresh_opt = _model(device, seed=5)
    with CheckpointManager(tmp_path, fresh, fresh_opt, every=3) as mgr:
        assert mgr.restore() == 9
    _close(fresh.state_dict(), true, 1e-2)
    for (p, s), (m1, m2) in zip(fresh_opt.state.items(), moments):   # the roles' targets
        assert p.device.type == device and s["exp_avg"].device == m1.device
        assert (s["exp_avg"] - m1).norm() <= 0.8 * m1.norm()
        assert (s["exp_avg_sq"] - m2).norm() <= 0.1 * m2.norm()
    _train(fresh, fresh_opt, 1, device)          # the restored run trains on


@pytest.mark.parametrize("device", DEVICES)
def test_a_chain_of_device_tensors_restores_where_map_location_says(tmp_path, device):
    model, opt = _model(device)
    ck = lcckpt.DeltaCheckpointer(tmp_path, keyframe_every=4)
    truth = {}
    for step in range(6):
        _train(model, opt, 2, device)
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        sd["half"] = sd["0.weight"].to(torch.bfloat16)
        ck.save(step, sd)
        truth[step] = sd
    for step in (0, 5):
        own = ck.load(step)                              # the devices the file records
        assert {t.device.type for t in own.values()} == {device}
        _close(own, truth[step], 1e-2)
        host = ck.load(step, map_location="cpu")
        assert all(t.device.type == "cpu" for t in host.values())
        for k in own:
            assert torch.equal(host[k], own[k].cpu()), (step, k)
    if device == "cuda":                                 # and back onto the GPU from host
        host_truth = {k: v.cpu() for k, v in truth[5].items()}
        path = tmp_path / "host.lcc"
        lcckpt.save(host_truth, path)
        on_gpu = lcckpt.load(path, map_location="cuda")
        assert all(t.is_cuda and torch.equal(t.cpu(), host_truth[k]) for k, t in on_gpu.items())


@pytest.mark.parametrize("device", DEVICES)
def test_load_into_fills_device_targets_from_every_kind_of_file(tmp_path, device):
    """``into={"model": model.state_dict()}`` of a model on the GPU: every target is
    filled (a copy up from the host), the result holds the targets where it would hold
    tensors on their device, and a target left unfilled is named. Before, GPU targets
    were skipped and not even warned of."""
    import warnings
    model, opt = _model(device)
    ck = lcckpt.DeltaCheckpointer(tmp_path / "chain", keyframe_every=3)
    for step in range(4):
        _train(model, opt, 2, device)
        state = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()}}
        ck.save(step, state)
    lcckpt.save(state, tmp_path / "raw.lcc", compress=False)
    lcckpt.save(state, tmp_path / "lossless.lcc", compress=True)
    torch.save(state, tmp_path / "plain.pt")
    loads = {"chain": lambda **kw: ck.load(3, **kw)}
    for name in ("raw.lcc", "lossless.lcc", "plain.pt"):
        loads[name] = lambda name=name, **kw: lcckpt.load(tmp_path / name, **kw)
    for name, load in loads.items():
        want = load()
        for where in (None, "cpu"):
            fresh, _ = _model(device, seed=7)
            targets = fresh.state_dict()
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                got = load(map_location=where, into={"model": targets})
            for k, t in targets.items():
                assert torch.equal(t, want["model"][k]), (name, where, k)
                held = (where is None or device == "cpu") and name != "plain.pt"
                assert (got["model"][k] is t) == held, (name, where, k)   # torch's: a copy
                assert torch.equal(got["model"][k].to(device), want["model"][k]), (name, k)
        fresh, _ = _model(device, seed=7)
        wrong = dict(fresh.state_dict(), **{"2.bias": torch.zeros(3, device=device)})
        with pytest.warns(RuntimeWarning, match=r'\["2\.bias"\] \(the stored tensor is '
                                                r'float32\[10\], the target float32\[3\]\)'):
            load(into={"model": wrong})
        assert torch.equal(wrong["0.weight"], want["model"]["0.weight"]), name
        assert not wrong["2.bias"].any(), name


@pytest.mark.parametrize("device", DEVICES)
def test_streamed_files_of_device_tensors_restore_on_their_device(tmp_path, monkeypatch, device):
    """Files written a tensor at a time (large ones: every one here) copy each tensor off
    the device as it is written: a save, a chain keyframe and a merge."""
    from lcckpt.format import stream
    monkeypatch.setattr(stream, "STREAM_ABOVE", 0)
    model, opt = _model(device)
    _train(model, opt, 2, device)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sd["half"] = sd["0.weight"].to(torch.bfloat16)
    for compress in (False, True):
        lcckpt.save(sd, tmp_path / "s.lcc", compress=compress)
        back = lcckpt.load(tmp_path / "s.lcc")
        assert all(back[k].device == t.device and torch.equal(back[k], t) for k, t in sd.items())
    ck = lcckpt.DeltaCheckpointer(tmp_path / "chain")
    ck.save(0, sd)
    _train(model, opt, 2, device)
    sd1 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sd1["half"] = sd1["0.weight"].to(torch.bfloat16)
    ck.save(1, sd1)
    before = ck.load(1)
    ck.merge(1)
    for step, want in ((0, sd), (1, before)):
        got = lcckpt.DeltaCheckpointer(tmp_path / "chain").load(step)
        assert all(got[k].device == t.device and torch.equal(got[k], t) for k, t in want.items())


@pytest.mark.parametrize("device", DEVICES)
def test_dcp_checkpoints_of_device_tensors_load_into_device_targets(tmp_path, device):
    model, opt = _model(device)
    _train(model, opt, 3, device)
    state = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
             "step": 3}
    ld.save(state, tmp_path / "exact")
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": 0}
    ld.load(target, tmp_path / "exact")
    assert target["step"] == 3
    for k, v in state["model"].items():
        assert target["model"][k].device == v.device and torch.equal(target["model"][k], v), k

    ck = ld.DistributedCheckpointer(tmp_path / "chain", keyframe_every=3)
    for step in range(4):
        _train(model, opt, 2, device)
        state["model"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        ck.save(step, state)
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": 0}
    assert ck.load(target) == 3
    _close(target["model"], state["model"], 1e-2)
    for piece, ref in ck.references().items():        # the reader tracks the writer exactly
        assert torch.equal(target["model"][piece.key.split(".", 1)[1]].cpu(), ref), piece
    for step in (4, 5):                 # background saves stage into reused (pinned) buffers
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        _train(model, opt, 2, device)
        state["model"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        ck.async_save(step, state).result(timeout=120)
        assert ck.load(target) == step
        for piece, ref in ck.references().items():    # what this save's stage held
            assert torch.equal(target["model"][piece.key.split(".", 1)[1]].cpu(), ref), piece
        w = "0.weight"                                 # the new state's, not a stale one
        assert (target["model"][w] - state["model"][w]).norm() < \
            (target["model"][w] - before[w]).norm()
    ck.close()


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_two_ranks_save_and_restore_device_state_on_every_path(tmp_path, device):
    """Two gloo ranks with replicated device state: a cooperative restore into device
    targets, and chains saved by every async mode (thread or process, copy or live)."""
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import _dist_worker as W
    import _gpu_worker as G
    W.spawn(G.device_ranks, (2, W.rendezvous(tmp_path), str(tmp_path), device), 2,
            str(tmp_path))
    for r in range(2):
        text = (tmp_path / f"ok{r}").read_text()
        if text != "ok":
            pytest.fail(f"rank {r}: {text}", pytrace=False)
