"""The 2-process check of test_gpu.py (spawned, so it lives in an importable module): two
gloo ranks whose replicated state lives on a device (``cuda``: one GPU per rank where there
are two, else both on the one), saved and restored by every distributed path."""

import os

import torch
import torch.distributed as dist

import _dist_worker as W

MODES = [("thread", "copy"), ("process", "copy"), ("thread", "live"), ("process", "live")]


def _on(state, device):
    return {k: _on(v, device) if isinstance(v, dict) else
            v.to(device) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _zeros(state):
    return {k: _zeros(v) if isinstance(v, dict) and k != "meta" else
            torch.zeros_like(v) if isinstance(v, torch.Tensor) else
            {"epoch": 0, "tag": "", "lr": [0.0, 0.0]} if k == "meta" else v
            for k, v in state.items()}


def _update(state, step):
    """``_dist_worker.step_update`` for state on any device (the same host-drawn noise)."""
    g = torch.Generator().manual_seed(100 + step)
    state["emb"].add_((torch.randn(state["emb"].shape, generator=g) * 1e-3).to(
        state["emb"].device))
    for w in state["small"].values():
        w.add_((torch.randn(w.shape, generator=g) * 1e-3).to(w.device))


def _tensors(state) -> dict:
    return {k: v for k, v in W.flatten(state).items() if isinstance(v, torch.Tensor)}


def device_ranks(rank, world, init_method, root, device):
    """A cooperative restore of an exact checkpoint into device targets (items given by a
    peer land in host buffers and are copied up); then a chain saved by each async mode
    (thread or background process, staged copy or live reads through the pinned pool)
    writes deltas that load onto the device as the writer's references say, every mode
    bit for bit the same. Each part's failure is recorded and the rest still run (all
    failures are then reported together)."""
    import traceback
    W._init(rank, world, init_method, log_dir=root)
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
    failed, restored = {}, {}
    for part in ["exact", *MODES]:
        try:
            if part == "exact":
                _exact(root, device)
            else:
                restored[part] = _chain(root, device, *part)
        except Exception:      # noqa: BLE001  (reported below, with the other parts')
            failed[str(part)] = traceback.format_exc()
        dist.barrier()
    if restored:                     # every mode that ran restores the same, bit for bit
        base, first = next(iter(restored.items()))
        for mode, got in restored.items():
            for k, v in first.items():
                if not torch.equal(got[k], v):
                    failed[str(mode)] = f"{k} differs from {base}'s restore"
    with open(os.path.join(root, f"ok{rank}"), "w") as f:
        f.write("\n\n".join(f"{k}: {v}" for k, v in failed.items()) or "ok")
    dist.barrier()
    dist.destroy_process_group()


def _exact(root, device):
    import torch.distributed.checkpoint as dcp
    import lcckpt.distributed as ld
    from lcckpt.distributed.planner import SafeLoadPlanner
    from lcckpt.distributed.storage import CompressedReader
    state = _on(W.replicated_state(), device)
    d = os.path.join(root, "exact")
    ld.save(state, d, planner=ld.BalancedSavePlanner(min_split_bytes=64 << 10))
    target = _zeros(state)
    reader = CompressedReader(d, cooperative=True)
    dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner())
    for k, v in _tensors(state).items():
        got = W.flatten(target)[k]
        assert got.device == v.device and torch.equal(got, v), k
    assert target["meta"] == state["meta"]
    part = reader.last_exchange
    assert part is not None and part.recv and part.decode, "the cooperative path was not taken"
    assert part.copied == sum(reader.storage_data[i].raw_nbytes for i in part.recv), part.copied


def _chain(root, device, process, staging) -> dict:
    import lcckpt.distributed as ld
    from lcckpt.distributed.storage import CompressedReader
    state = _on(W.replicated_state(), device)
    ck = ld.DistributedCheckpointer(os.path.join(root, f"{process}_{staging}"))
    for step in range(3):
        if step:
            _update(state, step)
        ck.async_save(step, state, process=process == "process",
                      staging=staging).result(timeout=120)
    codecs = {i.codec for i in CompressedReader(ck.path(2)).read_metadata()
              .storage_data.values()}
    assert "delta" in codecs, codecs
    target = _zeros(state)
    assert ck.load(target) == 2
    flat = W.flatten(target)
    for p, ref in ck.references().items():      # what the writer's last save staged
        got = W.piece_slice(flat, p.key, p.start, p.stop)
        assert got.device == torch.device(device) and torch.equal(got.cpu(), ref), p
    for k, v in _tensors(state).items():       # the newest state, within the target
        err = (flat[k].double() - v.double()).norm().item()
        assert err <= 1e-2 * v.double().norm().item() + 1e-12, (k, err)
    ck.close()
    return {k: v.cpu() for k, v in _tensors(target).items()}
