"""Worker functions for the 2-process gloo tests in test_distributed.py (spawned, so they live
in an importable module). Each asserts what it can see on its own rank and leaves files for
the parent to check the rest."""

import ast
import datetime
import faulthandler
import math
import os
import random
import sys

import torch
import torch.distributed as dist
from torch import nn


def rendezvous(directory) -> str:
    """A fresh ``file://`` init method in ``directory``: ranks meet through a file, not a
    port picked in advance, which another process on the host may take first (runs in
    parallel under xdist, gloo's own connections)."""
    import tempfile
    fd, path = tempfile.mkstemp(prefix="rendezvous-", dir=str(directory))
    os.close(fd)
    os.unlink(path)                     # the store creates it; a stale one would not be empty
    return f"file://{path}"


def _init(rank, world, init_method, log_dir=None):
    # a rank once died with SIGABRT ("terminate called without an active exception"): if
    # it happens again, every thread's native stack (torch's fatal-signal handler, which
    # then hands the signal on) and every Python thread's stack go to stderr, to say
    # which C++ thread was destroyed while joinable. With ``log_dir`` stderr itself (fd 2,
    # so C++'s message too) goes to a file of this rank that the parent quotes when the
    # rank dies (pytest hides a passing test's output).
    if log_dir is not None:
        log = open(os.path.join(log_dir, f"rank{rank}.stderr"), "w", buffering=1)
        os.dup2(log.fileno(), 2)
        faulthandler.enable(file=log, all_threads=True)
    else:
        faulthandler.enable(all_threads=True)
    torch._C._set_print_stack_traces_on_fatal_signal(True)
    os.environ["LCCKPT_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=init_method, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)


def spawn(fn, args: tuple, nprocs: int, log_dir: str) -> None:
    """``mp.spawn(fn, args, nprocs)`` whose ranks log to ``log_dir`` (``_init``); a rank
    killed by a signal fails with that rank's stderr (C++'s "terminate called ..." line
    and faulthandler's thread stacks) in the message. No retry."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessExitedException
    try:
        mp.spawn(_rank_main, args=(fn, *args), nprocs=nprocs, join=True)
    except ProcessExitedException as e:
        try:
            with open(os.path.join(log_dir, f"rank{e.error_index}.stderr")) as f:
                log = f.read()[-30000:] or "(empty)"
        except OSError as err:
            log = f"(unreadable: {err})"
        raise AssertionError(f"{nprocs}-process run died ({e}); the dead rank's stderr: "
                             f"{log}") from e


def _gloo_threads() -> int:
    n = 0
    for t in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ():
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                n += f.read().startswith("pt_gloo")
        except OSError:
            pass
    return n


def _rank_main(rank, fn, *args):
    """``fn(rank, *args)``, then the exit. Once FSDP2's ``fully_shard`` has run, process
    groups outlive ``destroy_process_group()`` (measured: one process keeps 2 gloo
    threads after it, 0 without ``fully_shard``; each rank of ``three_rank_worker`` keeps
    2-4), and a gloo thread alive into the interpreter's exit can abort the rank there
    (docs/distributed.md, "A rank that died with SIGABRT"): rank 0 of
    ``three_rank_worker`` did once, in a fresh clone's run. Such a rank ends with
    ``os._exit(0)`` once its work is done and written; any other exits normally, so a
    group that lcckpt kept alive still shows."""
    fn(rank, *args)
    if "torch.distributed.fsdp._fully_shard" in sys.modules and _gloo_threads():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def replicated_state():
    """The same values on every rank: one dominant tensor, some small ones, non-tensors."""
    g = torch.Generator().manual_seed(0)
    return {
        "emb": torch.randn(4096, 64, generator=g) * 0.02,            # 1 MiB
        "small": {f"w{i}": torch.randn(32, 16, generator=g) for i in range(8)},
        "half": (torch.randn(64, 8, generator=g)).to(torch.bfloat16),
        "ids": torch.arange(100, dtype=torch.int64),
        "meta": {"epoch": 3, "tag": "run", "lr": [0.1, 0.01]},
    }


def fsdp_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 12), nn.Linear(12, 4))
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    return model


def step_update(state, model, step):
    g = torch.Generator().manual_seed(100 + step)
    state["emb"].add_(torch.randn(state["emb"].shape, generator=g) * 1e-3)
    for w in state["small"].values():
        w.add_(torch.randn(w.shape, generator=g) * 1e-3)
    with torch.no_grad():
        for p in (model.parameters() if model is not None else ()):
            p.to_local().add_(1e-3)


def piece_slice(full: dict, key: str, start: int, stop: int):
    """The part of a flattened full state that a piece stands for."""
    if "@" in key:
        fqn, off = key.split("@", 1)
        off = ast.literal_eval(off)
        t = full[fqn]
        for d, o in enumerate(off):
            n = t.shape[d] if d else stop - start
            t = t.narrow(d, o, n)
        return t
    t = full[key]
    return t[start:stop] if t.dim() else t


def flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, name + "."))
        else:
            out[name] = v
    return out


def chain(rank, world, root):
    """Keyframe, delta, a save that fails on rank 1, another delta; load back on 2 ranks."""
    import lcckpt.distributed as ld
    from lcckpt.errors import DistributedCheckpointError
    state = replicated_state()
    model = fsdp_model()
    full = {"state": state, "model": model.state_dict()}
    ck = ld.DistributedCheckpointer(root, bits=2, planner=ld.BalancedSavePlanner(
        min_split_bytes=64 << 10, item_overhead=4096, raw_weight=0.25))
    ck.save(0, full)
    asg = ck.planner.assignment if rank == 0 else None
    if rank == 0:
        torch.save({"imbalance": asg.imbalance(), "loads": asg.loads}, f"{root}/asg0.pt")
    step_update(state, model, 1)
    ck.save(1, full)
    refs_before = {p: t.clone() for p, t in ck.references().items()}

    # step 2 fails on rank 1 after writing part of its file
    step_update(state, model, 2)
    if rank == 1:
        orig = ck.writer.write_data

        def broken(plan, planner):
            path = ck.writer.fs.concat_path(ck.writer.path, f"{plan.storage_data.prefix}0.distcp")
            ck.writer._written.append(path)
            with open(path, "wb") as f:
                f.write(b"partial")
            raise OSError("disk full (injected)")
        ck.writer.write_data = broken
    try:
        ck.save(2, full)
    except DistributedCheckpointError as e:
        assert "disk full" in str(e), str(e)
    else:
        raise AssertionError("the failed save did not raise")
    if rank == 1:
        ck.writer.write_data = orig
    dist.barrier()
    assert ck.steps() == [0, 1], ck.steps()
    leftovers = [n for n in os.listdir(ck.path(2))] if os.path.isdir(ck.path(2)) else []
    assert not leftovers, leftovers
    refs_after = ck.references()
    assert refs_after.keys() == refs_before.keys()
    assert all(torch.equal(refs_after[p], refs_before[p]) for p in refs_before)

    step_update(state, model, 3)
    md = ck.save(3, full)
    # every floating piece stayed on its rank (sticky plan), so every one is a delta, but
    # for the shards of fewer than 8 elements (the biases' halves), stored exactly
    _all_deltas(md)
    refs = {f"{p.key}|{p.start}|{p.stop}": t for p, t in ck.references().items()}
    torch.save(refs, f"{root}/refs_{rank}.pt")

    # load on 2 ranks, into fresh tensors of the same layout
    target = {"state": replicated_state(), "model": fsdp_model().state_dict()}
    for t in flatten(target["state"]).values():
        if isinstance(t, torch.Tensor):
            t.zero_()
    target["state"]["meta"] = {"epoch": 0, "tag": "", "lr": [0.0, 0.0]}
    flat = _loads_as_referenced(ck, target, 3)
    assert torch.equal(flat["state.ids"], torch.arange(100))
    assert target["state"]["meta"] == {"epoch": 3, "tag": "run", "lr": [0.1, 0.01]}

    # async_save on both ranks: a delta step committed in the background
    step_update(state, model, 4)
    fut = ck.async_save(4, full)
    md = fut.result(timeout=60)
    assert ck.steps() == [0, 1, 3, 4]
    flat = _loads_as_referenced(ck, target, 4)
    if rank == 0:           # what step 4 restores to, for loads at other world sizes
        torch.save({k: v for k, v in flat.items() if isinstance(v, torch.Tensor)},
                   f"{root}/restored4.pt")
    dist.barrier()

    # merge step 4 (rank 0 writes, both ranks' writers rebase): it loads the same, with no
    # chain, and a delta after it loads onto the writers' references
    assert ck.merge() == 4
    md = ld.CompressedReader(ck.path(4)).read_metadata()
    assert all(not i.chain for i in md.storage_data.values()), "a merged item keeps a chain"
    for t in flatten(target["state"]).values():
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t.zero_()
    _loads_as_referenced(ck, target, 4)
    step_update(state, model, 5)
    md = ck.save(5, full)
    chains = _delta_chains(md)
    assert chains and all(len(c) == 1 and "step_0000000004" in c[0][0] for c in chains), chains
    _loads_as_referenced(ck, target, 5)

    # merge step 5 once step 6 is on it: step 6's chains, and those of the writers' next
    # delta, start at step 5's keyframes; step 6 still loads onto the references
    step_update(state, model, 6)
    ck.save(6, full)
    assert ck.merge(5) == 5
    md = ld.CompressedReader(ck.path(6)).read_metadata()
    chains = _delta_chains(md)
    assert chains and all(len(c) == 1 and "step_0000000005" in c[0][0] for c in chains), chains
    _loads_as_referenced(ck, target, 6)
    step_update(state, model, 7)
    md = ck.save(7, full)
    chains = _delta_chains(md)
    assert chains and all(len(c) == 2 and "step_0000000005" in c[0][0] for c in chains), chains
    dist.barrier()

    # a restarted job: a new writer on the directory goes on from step 7's chains with
    # this rank's references, bit for bit the old writer's, and writes deltas
    ck2 = ld.DistributedCheckpointer(root, bits=2, planner=ld.BalancedSavePlanner(
        min_split_bytes=64 << 10, item_overhead=4096, raw_weight=0.25))
    ck2._continue_chain(False)
    old, new = ck.references(), ck2.references()
    assert old.keys() == new.keys() and all(torch.equal(old[p], new[p]) for p in old)
    step_update(state, model, 8)
    md = ck2.save(8, full)
    _all_deltas(md)
    chains = _delta_chains(md)
    assert all(len(c) == 3 and "step_0000000005" in c[0][0] for c in chains), chains
    _loads_as_referenced(ck2, target, 8)
    dist.barrier()


def _loads_as_referenced(ck, target, step):
    """Load the newest step (``step``) into ``target``: every piece equals the writer's
    reference. Returns the loaded state, flat."""
    assert ck.load(target) == step
    flat = flatten(target["state"], "state.")
    flat.update({f"model.{k}": v.full_tensor() for k, v in target["model"].items()})
    for p, t in ck.references().items():
        assert torch.equal(piece_slice(flat, p.key, p.start, p.stop), t), p
    return flat


def _all_deltas(md) -> None:
    """Every floating item of 8 elements or more is a delta (12 or more of them)."""
    codecs = {idx.fqn: info.codec for idx, info in md.storage_data.items()
              if info.dtype in ("torch.float32", "torch.bfloat16")
              and math.prod(info.shape) >= 8}
    assert set(codecs.values()) == {"delta"} and len(codecs) >= 12, codecs


def _delta_chains(md) -> list:
    return [i.chain for i in md.storage_data.values() if i.codec == "delta"]


def reshard(rank, world, src):
    """Load a checkpoint written by one process into an FSDP2 model and a DTensor."""
    import lcckpt.distributed as ld
    from torch.distributed.tensor import Shard, distribute_tensor
    model = fsdp_model()
    sd = model.state_dict()
    for v in sd.values():
        v.to_local().zero_()
    mesh = next(iter(sd.values())).device_mesh
    emb = distribute_tensor(torch.zeros(4096, 64), mesh, [Shard(0)])
    target = {"model": sd, "emb": emb}
    ld.load(target, src)
    want = torch.load(f"{src}.expected.pt")
    for k, v in sd.items():
        assert torch.equal(v.full_tensor(), want[f"model.{k}"]), k
    assert torch.equal(emb.full_tensor(), want["emb"])
    assert emb.to_local().shape[0] == 4096 // world
    with open(f"{src}.loaded_on_{rank}", "w") as f:
        f.write("ok")
    dist.barrier()


def cooperative(rank, world, root):
    """A replicated state saved by both ranks loads with each rank reading and decoding
    about half of it; a damaged item that rank 1 decodes makes both ranks raise its error."""
    import torch.distributed.checkpoint as dcp
    import lcckpt.distributed as ld
    from lcckpt.distributed.planner import SafeLoadPlanner
    from lcckpt.distributed.storage import CompressedReader
    from lcckpt.errors import CorruptDataError
    d = os.path.join(root, "coop")
    state = replicated_state()
    ld.save(state, d, planner=ld.BalancedSavePlanner(min_split_bytes=64 << 10))
    ld.save(state, os.path.join(root, "exact2"))        # left intact, for three_rank_worker

    def fresh():
        t = replicated_state()
        for v in flatten(t).values():
            if isinstance(v, torch.Tensor):
                v.zero_()
        t["meta"] = {"epoch": 0, "tag": "", "lr": [0.0, 0.0]}
        return t

    target = fresh()
    reader = CompressedReader(d, cooperative=True)
    dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner())
    for k, v in flatten(state).items():
        got = flatten(target)[k]
        assert torch.equal(got, v) if isinstance(v, torch.Tensor) else got == v, k
    part = reader.last_exchange
    assert part is not None and part.decode, "the cooperative path was not taken"
    assert part.recv, "this rank was given no item to receive"
    # both ranks share this host: every item came straight from the peer's memory (peer.py)
    assert part.copied == sum(reader.storage_data[i].raw_nbytes for i in part.recv), part.copied
    with open(f"{d}.read{rank}", "w") as f:
        f.write(str(reader.bytes_read))
    from lcckpt.distributed import exchange
    spare = exchange._spare_cores(exchange.peer.handshake(None, {})[1], rank)
    real = exchange._spare_cores      # the writes on a thread of their own, as on a host with
    exchange._spare_cores = lambda ok, me: not spare     # cores to spare (or inline, if this
    try:                                                 # one has them)
        target = fresh()
        reader = CompressedReader(d, cooperative=True)
        dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner())
    finally:
        exchange._spare_cores = real
    for k, v in flatten(state).items():
        got = flatten(target)[k]
        assert torch.equal(got, v) if isinstance(v, torch.Tensor) else got == v, k
    assert reader.last_exchange.copied == part.copied, reader.last_exchange.copied
    for off in ((0, 1), (1,)):     # the same load over the process group: both ranks, or
        if rank in off:            # one (neither writes into the other's memory then)
            os.environ["LCCKPT_PEER_COPY"] = "0"
        try:
            target = fresh()
            reader = CompressedReader(d, cooperative=True)
            dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner())
        finally:
            os.environ.pop("LCCKPT_PEER_COPY", None)
        for k, v in flatten(state).items():
            got = flatten(target)[k]
            assert torch.equal(got, v) if isinstance(v, torch.Tensor) else got == v, k
        assert reader.last_exchange.recv and reader.last_exchange.copied == 0, off
    if rank == 1:               # one of the tensor items rank 1 decodes, for rank 0 to damage
        idx = max(part.send, key=lambda i: reader.storage_data[i].length)
        info = reader.storage_data[idx]
        with open(os.path.join(d, info.relative_path), "r+b") as f:
            f.seek(info.offset + info.length // 2)
            b = f.read(1)
            f.seek(info.offset + info.length // 2)
            f.write(bytes([b[0] ^ 0xFF]))
    dist.barrier()
    for flip in (False, True):         # the writes as this host has them, then the other way
        exchange._spare_cores = (lambda ok, me: not spare) if flip else real
        try:
            ld.load(fresh(), d, cooperative=True)
            raised = None
        except CorruptDataError as e:
            raised = e
        finally:
            exchange._spare_cores = real
        assert raised is not None, f"rank {rank} loaded a damaged checkpoint ({flip})"
        assert not exchange._KEPT, "a restore that failed after every write kept its buffers"
    dist.barrier()


def process_mode(rank, world, root):
    """``async_save(..., process=True)`` writes deltas: a chain saved in DCP's background
    process restores bit for bit to what the same saves in a thread give; the background
    process killed mid-save leaves the previous step loadable, and the next save, in a new
    background process that takes its references from the files, writes deltas too."""
    import signal
    from torch.distributed.checkpoint import _async_process_executor as ape
    import lcckpt.distributed as ld
    from lcckpt.distributed.storage import CompressedReader
    from lcckpt.errors import DistributedCheckpointError
    # a frozen piece parked in the background process (after step 1's zero delta), coded
    # against itself, then fetched back for a change by replaying its blobs there: the
    # chain restores as the same saves in a thread restore it
    back = {}
    for mode in ("thread", "process"):
        g = torch.Generator().manual_seed(1)
        state = {"frozen": torch.randn(512, 256, generator=g), "w": torch.randn(256, 64,
                                                                          generator=g)}
        ck = ld.DistributedCheckpointer(os.path.join(root, f"parked_{mode}"))
        for step in range(4):
            state["w"] += 0.01 * torch.randn(256, 64, generator=g)
            if step == 3:
                state["frozen"][7] += 0.5
            ck.async_save(step, state, process=mode == "process").result(timeout=120)
        back[mode] = {k: torch.zeros_like(v) for k, v in state.items()}
        assert ck.load(back[mode]) == 3
    for k, v in back["thread"].items():
        assert torch.equal(back["process"][k], v), k
    assert (back["process"]["frozen"][7] - state["frozen"][7]).abs().max() < 0.01

    runs = {}
    for mode in ("thread", "process"):
        state = replicated_state()
        ck = ld.DistributedCheckpointer(os.path.join(root, f"async_{mode}"), bits=2)
        for step in range(3):
            if step:
                step_update(state, None, step)
            ck.async_save(step, state, process=mode == "process").result(timeout=120)
        runs[mode] = ck
    codecs = {i.codec for i in CompressedReader(runs["process"].path(2)).read_metadata()
              .storage_data.values()}
    assert "delta" in codecs, codecs
    target = replicated_state()
    assert runs["process"].load(target) == 2
    for p, t in runs["thread"].references().items():
        assert torch.equal(piece_slice(flatten(target), p.key, p.start, p.stop), t), p
    want = {k: v.clone() for k, v in flatten(target).items() if isinstance(v, torch.Tensor)}

    # a merge while the references live in the background process: the step loads the
    # same, and the next save there goes on from the merged keyframes, read from the files
    ck = runs["process"]
    assert ck.merge() == 2
    target = replicated_state()
    assert ck.load(target) == 2
    for k, v in want.items():
        assert torch.equal(flatten(target)[k], v), k
    state = replicated_state()
    step_update(state, None, 3)
    ck.async_save(3, state, process=True).result(timeout=120)
    md = CompressedReader(ck.path(3)).read_metadata()
    assert "delta" in {i.codec for i in md.storage_data.values()}
    assert all(len(c) == 1 and "step_0000000002" in c[0][0] for c in _delta_chains(md))
    target = replicated_state()
    assert ck.load(target) == 3
    want = {k: v.clone() for k, v in flatten(target).items() if isinstance(v, torch.Tensor)}

    step_update(state, None, 4)
    fut = ck.async_save(4, state, process=True)
    os.kill(ape._CHECKPOINT_PROCESS._save_process.pid, signal.SIGKILL)
    try:
        fut.result(timeout=120)
        raised = None
    except DistributedCheckpointError as e:
        raised = e
    dist.barrier()
    if raised is not None:                    # killed before it committed (else: too late)
        assert ck.steps() == [0, 1, 2, 3], ck.steps()
        target = replicated_state()
        assert ck.load(target) == 3
        for k, v in want.items():
            assert torch.equal(flatten(target)[k], v), k
    ck.async_save(5, state, process=True).result(timeout=120)    # a new background process
    codecs = {i.codec for i in CompressedReader(ck.path(5)).read_metadata().storage_data.values()}
    assert "delta" in codecs, codecs
    target = replicated_state()
    assert ck.load(target) == 5
    fresh = ld.DistributedCheckpointer(ck.directory, bits=2)       # the same, in this process
    fresh._continue_chain(False)
    for p, t in fresh.references().items():
        assert torch.equal(piece_slice(flatten(target), p.key, p.start, p.stop), t), p
    with open(os.path.join(root, f"killed{rank}"), "w") as f:
        f.write("raised" if raised is not None else "committed")
    dist.barrier()


def steered_shards(rank, world, root):
    """An FSDP2 model with Adam in a default chain: each rank's weight shards are steered
    by the local shards of their first moments, the moments keep their roles, and a
    reload gives back the references."""
    import lcckpt.distributed as ld
    from lcckpt.distributed import targets
    model = fsdp_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    seen, real = {}, targets.direction_of

    def spy(dirs, piece, data):
        m = real(dirs, piece, data)
        seen[targets.fqn(piece.key)] = None if m is None else tuple(m.shape)
        return m
    targets.direction_of = spy
    try:
        ck = ld.DistributedCheckpointer(os.path.join(root, "steered"))
        for step in range(3):
            model(torch.randn(8, 16, generator=torch.Generator().manual_seed(step))).sum() \
                .backward()
            opt.step()
            opt.zero_grad()
            ck.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
    finally:
        targets.direction_of = real
    shards = {f"model.{n}": tuple(p.to_local().shape) for n, p in model.named_parameters()
              if p.to_local().numel() >= targets.MIN_ELEMENTS}     # the weights' shards
    assert len(shards) == 2 and {k: seen[k] for k in shards} == shards, seen
    assert all(seen[k] is None for k in seen if k not in shards), seen
    back = {"model": model.state_dict(), "optim": opt.state_dict()}
    for v in list(back["model"].values()) + [t for e in back["optim"]["state"].values()
                                             for t in e.values()]:
        v.to_local().zero_() if hasattr(v, "to_local") else v.zero_()
    assert ck.load(back) == 2
    flat = flatten({"model": back["model"],
                    "optim": {"state": {str(k): e for k, e in back["optim"]["state"].items()}}})
    for piece, ref in ck.references().items():
        got = flat[targets.fqn(piece.key)]
        got = got.to_local() if hasattr(got, "to_local") else got
        assert torch.equal(got, ref), piece


def live_staging(rank, world, root):
    """``staging="live"``: saves read the state itself (no host copy). A tensor changed in
    place on one rank while its share is written fails the save on every rank with
    StateChangedError, nothing committed; the references it advanced are read back from
    the committed files, and the next save commits deltas that load as they say."""
    import lcckpt.distributed as ld
    from lcckpt.distributed import storage
    from lcckpt.errors import StateChangedError
    state = replicated_state()
    ck = ld.DistributedCheckpointer(os.path.join(root, "live"), bits=2)
    for step in range(2):
        if step:
            step_update(state, None, step)
        ck.async_save(step, state, staging="live").result(timeout=120)
    step_update(state, None, 2)
    real = storage.CompressedWriter._encode_into
    if rank == 1:                 # an optimizer step racing the write, on one rank only
        def racing(self, f, wi, piece, data, *args):
            out = real(self, f, wi, piece, data, *args)
            state["emb"].add_(1e-3)
            return out
        storage.CompressedWriter._encode_into = racing
    try:
        ck.async_save(2, state, staging="live").result(timeout=120)
        raised = None
    except StateChangedError as e:
        raised = e
    finally:
        storage.CompressedWriter._encode_into = real
    assert raised is not None and "state['emb']" in str(raised), raised
    assert ck.steps() == [0, 1], ck.steps()
    step_update(state, None, 3)
    md = ck.async_save(3, state, staging="live").result(timeout=120)
    assert ck.steps() == [0, 1, 3], ck.steps()
    assert "delta" in {i.codec for i in md.storage_data.values()}
    target = replicated_state()
    assert ck.load(target) == 3
    for p, t in ck.references().items():
        assert torch.equal(piece_slice(flatten(target), p.key, p.start, p.stop), t), p
    with open(os.path.join(root, f"live{rank}"), "w") as f:
        f.write("ok")
    dist.barrier()


def _adam_model(fsdp: bool):
    """A small MLP (FSDP2-sharded over all ranks with ``fsdp``) and its Adam optimizer."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 300), nn.ReLU(), nn.Linear(300, 10))
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _adam_step(model, opt, step):
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step))
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _adam_target(fsdp: bool) -> dict:
    """A state to load into, shaped as ``_adam_model``'s after a step (its moments exist)."""
    model, opt = _adam_model(fsdp)
    _adam_step(model, opt, 99)
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _local_values(state) -> dict:
    return {k: (v.to_local() if hasattr(v, "to_local") else v).clone()
            for k, v in flatten(state).items() if isinstance(v, torch.Tensor)}


def process_live(rank, world, root):
    """``async_save(..., process=True, staging="live")``: DCP's background process reads
    the live state through a bounded pool of shared buffers (lcckpt/distributed/pool.py).
    Its chains equal the same live saves in a thread, for replicated and FSDP2 state with
    Adam (steered weights); the pool holds at most SLOTS pieces with their moments and no
    staging copy is made; a tensor changed in place while it is read fails the save on
    every rank; ``wait_before`` holds an optimizer's step until the state was read; a
    killed background process leaves the previous step, and the next save commits."""
    import signal
    import threading
    from torch.distributed.checkpoint import _async_process_executor as ape
    import lcckpt.distributed as ld
    from lcckpt.distributed import pool
    from lcckpt.errors import DistributedCheckpointError, StateChangedError
    for fsdp in (True, False):            # the last one (replicated, process) goes on below
        back = {}
        for mode in ("thread", "process"):
            model, opt = _adam_model(fsdp)
            ck = ld.DistributedCheckpointer(os.path.join(root, f"plive_{fsdp}_{mode}"))
            for step in range(3):
                _adam_step(model, opt, step)
                ck.async_save(step, {"model": model.state_dict(), "optim": opt.state_dict()},
                              process=mode == "process", staging="live").result(timeout=120)
            target = _adam_target(fsdp)
            assert ck.load(target) == 2
            back[mode] = _local_values(target)
            if mode == "process":
                largest = max(v.numel() * v.element_size() for v in _local_values(
                    {"model": model.state_dict(), "optim": opt.state_dict()}).values())
                assert ck._pool.buffer.numel() <= pool.SLOTS * 2 * largest
                assert not ck._stagers              # no staging copy of the state
            if fsdp or mode == "thread":
                ck.close()
        assert any("exp_avg_sq" in k for k in back["thread"]), list(back["thread"])
        for k, v in back["thread"].items():
            assert torch.equal(back["process"][k], v), (fsdp, k)

    state = lambda: {"model": model.state_dict(), "optim": opt.state_dict()}  # noqa: E731
    real = pool._put
    gate = threading.Event()
    try:
        if rank == 1:                 # an in-place change while the feeder reads the state
            def racing(*a):
                out = real(*a)
                with torch.no_grad():
                    model[0].weight.mul_(1.0)
                return out
            pool._put = racing
        _adam_step(model, opt, 3)
        try:
            ck.async_save(3, state(), process=True, staging="live").result(timeout=120)
            raised = None
        except StateChangedError as e:
            raised = e
        assert raised is not None and "weight" in str(raised), raised
        assert ck.steps() == [0, 1, 2], ck.steps()

        def gated(*a):
            gate.wait(60)
            return real(*a)
        pool._put = gated
        ck.wait_before(opt)
        fut = ck.async_save(4, state(), process=True, staging="live")
        threading.Timer(0.3, gate.set).start()
        _adam_step(model, opt, 4)     # opt.step() waits until the feeder has read the state
        assert ck._versions.read.is_set()
        fut.result(timeout=120)
        assert ck.steps() == [0, 1, 2, 4], ck.steps()

        gate.clear()
        fut = ck.async_save(5, state(), process=True, staging="live")
        os.kill(ape._CHECKPOINT_PROCESS._save_process.pid, signal.SIGKILL)
        gate.set()
        try:
            fut.result(timeout=120)
            raised = None
        except DistributedCheckpointError as e:
            raised = e
        assert raised is not None
        ck._wait_read()               # returns: the feeder let go of the state
    finally:
        pool._put = real
    dist.barrier()
    assert ck.steps() == [0, 1, 2, 4], ck.steps()
    _adam_step(model, opt, 6)
    ck.async_save(6, state(), process=True, staging="live").result(timeout=120)
    target = _adam_target(False)
    assert ck.load(target) == 6
    ck.close()
    # an exact checkpoint, through the module's function (its own pool)
    path = os.path.join(root, "plive_exact")
    ld.async_save(state(), path, process=True, staging="live").result(timeout=120)
    target = _adam_target(False)
    ld.load(target, path)
    for k, v in _local_values(state()).items():
        assert torch.equal(_local_values(target)[k], v), k
    with open(os.path.join(root, f"plive{rank}"), "w") as f:
        f.write("ok")
    dist.barrier()


def aborting_worker(rank, world, init_method, log_dir):
    """A rank that dies as the one that once aborted did: std::terminate, then SIGABRT."""
    _init(rank, world, init_method, log_dir=log_dir)
    os.abort()


def tied(rank, world, root):
    """A replicated tensor under two names, its rows split between the ranks, is stored
    once in every step of a chain; both names load back as one tensor's values, each blob
    read by one rank."""
    import torch.distributed.checkpoint as dcp
    import lcckpt.distributed as ld
    from lcckpt.distributed.planner import SafeLoadPlanner
    from lcckpt.distributed.storage import CompressedReader
    for name in ("tied", "untied", "tied_live"):
        emb = replicated_state()["emb"]
        state = {"emb": emb} if name == "untied" else {"emb": emb, "out": emb}
        ck = ld.DistributedCheckpointer(os.path.join(root, name), planner=ld.BalancedSavePlanner(
            min_split_bytes=64 << 10, item_overhead=16 << 10))   # the 1 MiB tensor cut in rows
        g = torch.Generator().manual_seed(5)
        for step in range(3):
            emb.add_(torch.randn(emb.shape, generator=g) * 1e-3)
            if name == "tied_live":             # planned from placeholders in a process
                ck.async_save(step, state, process=True, staging="live").result(timeout=120)
            else:
                ck.save(step, state)
        got = {k: torch.zeros_like(emb) for k in state}
        reader = CompressedReader(ck.path(2), cooperative=True)     # as ck.load(got) reads
        dcp.load(got, storage_reader=reader, planner=SafeLoadPlanner())
        assert all(torch.equal(v, got["emb"]) for v in got.values())
        assert (got["emb"] - emb).norm() <= 0.01 * emb.norm()
        read = torch.tensor([reader.bytes_read])
        dist.all_reduce(read)                   # each blob read once, by one of the ranks
        with open(os.path.join(root, f"{name}.read"), "w") as f:
            f.write(str(int(read)))
        torch.save(emb, os.path.join(root, f"{name}.pt"))
        ck.close()
    dist.barrier()


def two_rank_worker(rank, world, init_method, root, src):
    """One spawn for every 2-process check (process start-up dominates their time)."""
    _init(rank, world, init_method, log_dir=root)
    chain(rank, world, root)
    steered_shards(rank, world, root)
    reshard(rank, world, src)
    cooperative(rank, world, root)
    process_mode(rank, world, root)
    live_staging(rank, world, root)
    process_live(rank, world, root)
    tied(rank, world, root)
    dist.destroy_process_group()


def s3_failed_upload_worker(rank, world, init_method, url, opts, out_dir):
    """Two ranks commit step 0 of a chain on S3; rank 1's upload of step 1 fails. Each
    rank writes the name of what it raised, then both load step 0."""
    _init(rank, world, init_method, log_dir=out_dir)
    import s3fs
    import lcckpt.distributed as ld
    state = replicated_state()
    ck = ld.DistributedCheckpointer(url, storage_options=opts)
    ck.save(0, state)
    want = {p.key: t.clone() for p, t in ck.references().items()}
    if rank == 1:
        def broken(self, final=False):
            raise OSError(5, "injected upload failure")
        s3fs.core.S3File._upload_chunk = broken
    state["emb"] += 1
    try:
        ck.save(1, state)
        raised = "nothing"
    except Exception as e:      # noqa: BLE001
        raised = f"{type(e).__name__}: {e}"
    with open(os.path.join(out_dir, f"raised{rank}"), "w") as f:
        f.write(raised)
    dist.barrier()
    target = replicated_state()
    target["emb"].zero_()
    assert ck.load(target) == 0
    if "emb" in want:
        assert torch.equal(target["emb"], want["emb"])
    dist.destroy_process_group()


def _mixed_target(mesh=None):
    """Zeros shaped like the mixed state: the replicated part, and the model's parameters
    as FSDP2 shards over all ranks (``mesh=None``) or as DTensor row shards over ``mesh``."""
    from torch.distributed.tensor import Shard, distribute_tensor
    state = replicated_state()
    for v in flatten(state).values():
        if isinstance(v, torch.Tensor):
            v.zero_()
    state["meta"] = {"epoch": 0, "tag": "", "lr": [0.0, 0.0]}
    if mesh is None:
        model = fsdp_model().state_dict()
        for v in model.values():
            v.to_local().zero_()
    else:
        shapes = {k: v.shape for k, v in
                  nn.Sequential(nn.Linear(16, 12), nn.Linear(12, 4)).state_dict().items()}
        model = {k: distribute_tensor(torch.zeros(sh), mesh, [Shard(0)]) for k, sh in shapes.items()}
    return {"state": state, "model": model}


def _full(target) -> dict:
    """Copies of the target's tensors, flattened, DTensors gathered (a collective: every
    member calls)."""
    flat = flatten(target["state"], "state.")
    flat.update({f"model.{k}": v.full_tensor() for k, v in target["model"].items()})
    return {k: v.clone() for k, v in flat.items() if isinstance(v, torch.Tensor)}


def _assert_equal(got: dict, want: dict, what: str):
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want)))
    for k, v in want.items():
        assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, (what, k)


def three_rank_worker(rank, world, init_method, root2, out):
    """Any N -> M: the two-rank run's exact keyframe step 0, its delta step 4 and its exact
    replicated checkpoint load on three ranks (2 -> 3; FSDP2 over three ranks); then three
    ranks save an exact checkpoint and a chain of the mixed state, which ranks {0, 1} load
    as DTensor row shards (3 -> 2); the parent loads them in one process (3 -> 1)."""
    _init(rank, world, init_method, log_dir=out)
    import lcckpt.distributed as ld
    from torch.distributed.device_mesh import DeviceMesh
    ck2 = ld.DistributedCheckpointer(root2)
    target = _mixed_target()
    assert ck2.load(target, 0) == 0             # keyframe: the values the run started from
    start = {"state": replicated_state(), "model": fsdp_model().state_dict()}
    _assert_equal(_full(target), _full(start), "2->3 step 0")
    assert ck2.load(target, 4) == 4
    _assert_equal(_full(target), torch.load(f"{root2}/restored4.pt"), "2->3 step 4")
    rep = _mixed_target()["state"]
    ld.load(rep, os.path.join(root2, "exact2"))
    _assert_equal(flatten(rep), flatten(replicated_state()), "2->3 exact replicated")

    state, model = replicated_state(), fsdp_model()
    full = {"state": state, "model": model.state_dict()}
    ld.save(full, f"{out}/exact3")
    want_exact = _full(full)
    ck3 = ld.DistributedCheckpointer(f"{out}/chain3", bits=2)
    for step in range(3):
        if step:
            step_update(state, model, step)
        ck3.save(step, full)
    t3 = _mixed_target()
    assert ck3.load(t3) == 2
    want_chain = _full(t3)
    if rank == 0:
        torch.save(want_exact, f"{out}/exact3.expected.pt")
        torch.save(want_chain, f"{out}/chain3.expected.pt")
    sub = dist.new_group([0, 1])
    if rank < 2:
        mesh = DeviceMesh.from_group(sub, "cpu")
        t2 = _mixed_target(mesh)
        ld.load(t2, f"{out}/exact3", process_group=sub)
        _assert_equal(_full(t2), want_exact, "3->2 exact")
        t2 = _mixed_target(mesh)
        assert ld.DistributedCheckpointer(f"{out}/chain3", process_group=sub).load(t2) == 2
        _assert_equal(_full(t2), want_chain, "3->2 chain")
        with open(f"{out}/ok{rank}", "w") as f:
            f.write("ok")
    dist.barrier()
    dist.destroy_process_group()


def ddp_manager_worker(rank, world, init_method, root):
    """A DDP run with a CheckpointManager on every rank over one directory: rank 0
    writes, every rank steps; then a restart into differently initialized models, where
    every rank restores the same parameters and training goes on."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from lcckpt import CheckpointManager, DeltaCheckpointer
    _init(rank, world, init_method, log_dir=root)
    d = os.path.join(root, "ck")

    def run(seed, steps, restore):
        torch.manual_seed(seed)
        model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(rank)             # each rank its own data
        with CheckpointManager(d, model, opt, every=3, backpressure="wait") as mgr:
            assert mgr.writer == (rank == 0)
            start = mgr.restore() if restore else 0
            for _ in range(steps):
                loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                mgr.step(loss)
        dist.barrier()                                      # rank 0's files are durable
        return start, torch.cat([p.detach().flatten() for p in model.parameters()])

    _, trained = run(0, 9, restore=False)
    start, restored = run(100 + rank, 0, restore=True)      # a restart: other weights
    assert start == 9
    every = [torch.empty_like(restored) for _ in range(world)]
    dist.all_gather(every, restored)
    assert all(torch.equal(every[0], p) for p in every)     # one state on every rank
    assert (restored - trained).norm() <= 0.05 * trained.norm()
    start, _ = run(7, 3, restore=True)
    assert start == 9 and DeltaCheckpointer(d).steps() == [3, 6, 9, 12]
    _cooperative_restore(rank, d)
    _ddp_sigterm(rank, d)
    _sigterm_on_rank_0_alone(rank, os.path.join(root, "alone"))
    _restore_on_rank_0_alone(rank, d)
    dist.destroy_process_group()


def share_worker(rank, world, init_method, root):
    """broadcast.share: rank 0 loads, rank 1 gets the same tree (values, dtypes, nesting,
    tensors spread over small pieces), a tensor received into its target in place; a
    load that finds nothing, or raises, does so on both ranks."""
    from lcckpt import InvalidArgumentError, PeerRestoreError
    from lcckpt.training import broadcast
    _init(rank, world, init_method, log_dir=root)
    g = torch.Generator().manual_seed(3)
    tree = {"a": torch.arange(10), "b": [torch.randn(3, 5, generator=g).bfloat16(),
                                         (torch.tensor(True), 7, "x")],
            "c": torch.randn(100, 33, generator=g), "e": torch.empty(0, 4),
            "s": torch.tensor(2.5, dtype=torch.float64), "t": torch.randn(6, 4, generator=g).t()}

    def load():
        assert rank == 0, "only the source loads"
        return tree, 42
    target = torch.zeros(100, 33)
    state, step = broadcast.share(load, 0, {"c": target, "a": torch.zeros(9)}, piece=1000,
                                  pack=300)                # tensors cut and packed
    assert step == 42 and type(state["b"][1]) is tuple and state["b"][1][1:] == (7, "x")
    for k, v in [("a", tree["a"]), ("c", tree["c"]), ("e", tree["e"]), ("s", tree["s"]),
                 ("t", tree["t"]), ("b0", tree["b"][0]), ("b1", tree["b"][1][0])]:
        got = state["b"][0] if k == "b0" else state["b"][1][0] if k == "b1" else state[k]
        assert got.dtype == v.dtype and got.shape == v.shape and torch.equal(got, v), k
    assert (state["c"] is target) == (rank == 1)        # received in place
    assert broadcast.share(lambda: None, 0, {}) is None

    def fails():
        raise InvalidArgumentError("no checkpoint step 5")
    try:
        broadcast.share(fails, 0, {})
        raise AssertionError("share did not raise")
    except (InvalidArgumentError, PeerRestoreError) as e:
        assert type(e) is (InvalidArgumentError if rank == 0 else PeerRestoreError)
        assert "no checkpoint step 5" in str(e) and (rank == 0 or "rank 0" in str(e))
    assert broadcast.source_rank(rank == 1) == 1 and broadcast.source_rank(False) is None
    assert broadcast.source_rank(True) is None                     # two writers
    dist.destroy_process_group()


def _count_chain_loads():
    """(the list of ``DeltaCheckpointer.load`` calls made from now on, a function that
    stops counting)."""
    from lcckpt import DeltaCheckpointer
    real, reads = DeltaCheckpointer.load, []

    def counted(self, *a, **k):
        reads.append(a)
        return real(self, *a, **k)
    DeltaCheckpointer.load = counted
    return reads, lambda: setattr(DeltaCheckpointer, "load", real)


def _cooperative_restore(rank, d):
    """The manager's restore under DDP: rank 1 reads no checkpoint file and gets the same
    values as a restore that reads it (``cooperative=False``); an unknown step raises on
    both ranks."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from lcckpt import CheckpointManager, NotFoundError, PeerRestoreError
    reads, stop = _count_chain_loads()
    try:
        out = {}
        for coop in (True, False):
            torch.manual_seed(50 + rank)
            model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            mgr = CheckpointManager(d, model, opt, every=3)
            reads.clear()
            assert mgr.restore(cooperative=coop) == 12
            assert len(reads) == (1 if coop is False or rank == 0 else 0), reads
            out[coop] = [*model.state_dict().values(),
                         *[t for s in opt.state_dict()["state"].values() for t in s.values()]]
            try:
                mgr.restore(step=5, cooperative=coop)
                raise AssertionError("restore(step=5) did not raise")
            except (NotFoundError, PeerRestoreError) as e:
                assert type(e) is (NotFoundError if rank == 0 or not coop else PeerRestoreError)
                assert "no checkpoint step 5" in str(e)
            mgr.close()
        assert all(torch.equal(a, b) for a, b in zip(out[True], out[False], strict=True))
        from lcckpt.training import broadcast           # a default group without gloo
        made = []                                        # (NCCL alone): a gloo group for it
        real_group = broadcast.host_group

        def host_group():
            made.append(dist.new_group(backend="gloo"))
            return made[-1]
        broadcast.host_group = host_group
        try:
            torch.manual_seed(50 + rank)
            model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)))
            mgr = CheckpointManager(d, model, torch.optim.AdamW(model.parameters()), every=3)
            assert mgr.restore() == 12 and len(made) == 1
            assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), out[True]))
            mgr.close()
            own = d if rank == 0 else os.path.join(os.path.dirname(d), "rank1-local")
            mgr = CheckpointManager(own, model, torch.optim.AdamW(model.parameters()), every=3)
            assert mgr.restore() == 12                   # rank 1's directory holds nothing
            assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), out[True]))
            mgr.close()
        finally:
            broadcast.host_group = real_group
    finally:
        stop()
    dist.barrier()


def _restore_on_rank_0_alone(rank, d):
    """A restore called on rank 0 alone waits for the others, warns, and reads alone."""
    import warnings
    from lcckpt import CheckpointManager, DeltaCheckpointer
    from lcckpt.training import ranks
    ranks.REGISTER_WAIT = 1.0
    if rank == 0:
        # no DDP: the manager saved the model inside DDP's wrapper, whose keys fit this
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        mgr = CheckpointManager(d, model, torch.optim.AdamW(model.parameters()), every=3)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert mgr.restore() == DeltaCheckpointer(d).steps()[-1]
        assert [w.filename for w in seen if "not every rank" in str(w.message)] == [__file__]
        mgr.close()
    dist.barrier()


def _sigterm_on_rank_0_alone(rank, d):
    """A manager with sigterm=True on rank 0 alone (as a loop that gathers the state on
    one rank makes it): it waits for the others' to register, gives up with a warning,
    and acts alone; its steps enter no collective."""
    import warnings
    from lcckpt import CheckpointManager, DeltaCheckpointer
    from lcckpt.training import ranks
    ranks.REGISTER_WAIT = 1.0
    if rank == 0:
        model = nn.Linear(8, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            mgr = CheckpointManager(d, model, opt, every=2, sigterm=True,
                                    backpressure="wait")
        assert any("not every rank" in str(w.message) for w in seen)
        for _ in range(4):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            mgr.step()
        mgr.close()
        assert DeltaCheckpointer(d).steps() == [2, 4]
    dist.barrier()


def _ddp_sigterm(rank, d):
    """SIGTERM to rank 1 alone, in its 2nd iteration: both ranks act at the same step(),
    the next at which they agree (rank 0 writes a keyframe of it), and both exit with
    143 once it is durable."""
    import signal
    from torch.nn.parallel import DistributedDataParallel as DDP
    from lcckpt import CheckpointManager, DeltaCheckpointer
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mgr = CheckpointManager(d, model, opt, every=100, sigterm=True)
    assert mgr.restore() == 12
    code = None
    try:
        for i in range(400):                 # agreements at most 100 iterations apart
            if rank == 1 and i == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            loss = model(torch.randn(4, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            mgr.step(loss)
    except SystemExit as e:
        code = e.code
        own = (torch.get_rng_state(), random.getstate())     # this rank's, where it left
    finally:
        mgr.close()
    assert code == 143 and 14 <= mgr.iteration <= 114, (code, mgr.iteration)
    ck = DeltaCheckpointer(d)                # rank 0's keyframe of the iteration both left
    assert ck.steps()[-1] == mgr.iteration and ck.info(mgr.iteration)["kind"] == "keyframe"
    torch.manual_seed(99)                    # a restart: each rank resumes its generators
    random.seed(99)
    mgr = CheckpointManager(d, model, opt, every=100)
    for coop in (True, False):
        assert mgr.restore(cooperative=coop) == ck.steps()[-1]
        assert torch.equal(torch.get_rng_state(), own[0]) and random.getstate() == own[1]
        torch.manual_seed(99)
    mgr.close()
    dist.barrier()


def hf_ddp_worker(rank, world, init_method, root):
    """A Hugging Face Trainer under DDP (gloo, CPU) with a ChainCallback: each step of the
    chain holds every process's generators as the Trainer's own ``rng_state_{i}.pth``
    files hold them (each process draws a different number of values per step, so they
    differ), and an exported directory writes them back the same."""
    import random as pyrandom
    from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,
                              TrainingArguments)
    from transformers.utils import logging as hf_logging
    from lcckpt import DeltaCheckpointer
    from lcckpt.training.hf import ChainCallback, export_checkpoint
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    _init(rank, world, init_method, log_dir=root)
    hf_logging.set_verbosity_error()

    class Tokens(torch.utils.data.Dataset):
        x = torch.randint(0, 100, (64, 16), generator=torch.Generator().manual_seed(1))

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"input_ids": self.x[i], "labels": self.x[i]}

    class Draw(TrainerCallback):                     # each process its own generator state
        def on_step_begin(self, *a, **k):
            torch.rand(rank + 1)
            pyrandom.random() if rank else None

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2,
                                       n_positions=32))
    out, chain = os.path.join(root, "out"), os.path.join(root, "chain")
    args = TrainingArguments(output_dir=out, max_steps=8, per_device_train_batch_size=4,
                             save_strategy="steps", save_steps=4, report_to=[],
                             logging_steps=100, use_cpu=True, ddp_backend="gloo", seed=0,
                             disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=Tokens(),
            callbacks=[Draw(), ChainCallback(chain, keyframe_every=1)]).train()
    dist.barrier()
    if rank == 0:
        exported = export_checkpoint(chain, os.path.join(root, "exported"), model, step=8)
        for step in (4, 8):
            got = DeltaCheckpointer(chain).load(step)["rng_ranks"]
            hf = os.path.join(out, f"checkpoint-{step}")
            assert sorted(got) == [str(i) for i in range(world)]
            for i in range(world):
                want = torch.load(os.path.join(hf, f"rng_state_{i}.pth"), weights_only=False)
                assert torch.equal(got[str(i)]["cpu"], want["cpu"]), (step, i)
                assert tuple(got[str(i)]["python"][1]) == tuple(want["python"][1]), (step, i)
                if step == 8:
                    back = torch.load(os.path.join(exported, f"rng_state_{i}.pth"),
                                      weights_only=False)
                    assert torch.equal(back["cpu"], want["cpu"]), i
        assert not torch.equal(got["0"]["cpu"], got["1"]["cpu"])
    dist.barrier()
    dist.destroy_process_group()


def lightning_io_worker(rank, world, init_method, root):
    """LcckptCheckpointIO(chain=...).load_checkpoint on every rank (Lightning's resume
    under DDP): rank 0 replays the chain step and sends it, rank 1 reads no chain file
    and gets the same checkpoint; a file that names no step is read by each rank."""
    from lcckpt.training.lightning import LcckptCheckpointIO
    _init(rank, world, init_method, log_dir=root)
    path, plain = os.path.join(root, "last.ckpt"), os.path.join(root, "plain.ckpt")
    g = torch.Generator().manual_seed(0)
    if rank == 0:
        io = LcckptCheckpointIO(chain=os.path.join(root, "chain"))
        for step in (1, 2):
            io.save_checkpoint({"global_step": step, "epoch": 0, "loops": {"n": step},
                                "state_dict": {"w": torch.randn(300, 200, generator=g),
                                               "b": torch.randn(200, generator=g)},
                                "optimizer_states": [{"state": {}, "param_groups": []}]},
                               path)
        torch.save({"global_step": 3, "state_dict": {"w": torch.ones(2)}}, plain)
    dist.barrier()
    reads, stop = _count_chain_loads()
    try:
        got = LcckptCheckpointIO(chain=os.path.join(root, "chain")).load_checkpoint(path)
        assert len(reads) == (1 if rank == 0 else 0), reads
        assert got["global_step"] == 2 and got["loops"] == {"n": 2}
        flat = torch.cat([got["state_dict"]["w"].flatten(), got["state_dict"]["b"]])
        every = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(every, flat)
        assert all(torch.equal(every[0], x) for x in every)
        assert LcckptCheckpointIO().load_checkpoint(plain)["global_step"] == 3
    finally:
        stop()
    dist.barrier()
    dist.destroy_process_group()


def fresh_optimizer_worker(rank, world, init_method, root):
    """Two ranks save a chain of an AdamW run; new objects on each rank (an optimizer that
    has not stepped) restore from it cooperatively and take the optimizer's state; rank 0
    writes what each got."""
    import lcckpt.distributed as ld
    _init(rank, world, init_method, root)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ck = ld.DistributedCheckpointer(os.path.join(root, "chain"))
    for step in range(3):
        _adam_step(model, opt, step)
        ck.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
    torch.manual_seed(5)
    model2 = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1.0)
    fresh = {"model": model2.state_dict(), "optim": opt2.state_dict()}
    assert ld.DistributedCheckpointer(os.path.join(root, "chain")).load(fresh) == 2
    opt2.load_state_dict(fresh["optim"])
    stepped = {"model": model.state_dict(), "optim": opt.state_dict()}
    ck.load(stepped)                                   # into existing moments, in place
    torch.save({"fresh": opt2.state_dict(), "stepped": stepped["optim"],
                "model": model2.state_dict()}, os.path.join(root, f"fresh{rank}.pt"))
    ck.close()
    dist.destroy_process_group()


def plain_fsdp_worker(rank, world, init_method, root):
    """Two FSDP2 ranks save with plain DCP (``dcp.save``); rank 0 writes the full tensors
    and the optimizer's step for the test to compare."""
    import torch.distributed.checkpoint as dcp
    _init(rank, world, init_method, root)
    model = fsdp_model()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 4},
             checkpoint_id=os.path.join(root, "plain"))
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(full, os.path.join(root, "plain.expected.pt"))
    dist.destroy_process_group()


def async_beside_collectives_worker(rank, world, init_method, root):
    """Thread-mode async saves while the loop keeps all-reducing on the default group, as
    DDP's backward does: DCP's collectives in the save's thread ran on that group too, met
    the loop's in another order on each rank, and the job hung. They run on a group of
    their own (groups.background_group); each save commits and loads back."""
    import lcckpt.distributed as ld
    from lcckpt.distributed import groups
    _init(rank, world, init_method, log_dir=root)
    ck = ld.DistributedCheckpointer(os.path.join(root, "ck"), keyframe_every=3)
    ema = ld.DistributedCheckpointer(os.path.join(root, "ema"))   # a second saver beside it
    g = torch.Generator().manual_seed(5)
    state = {"w": torch.randn(300_000, generator=g), "b": torch.randn(64, generator=g)}
    for step in range(4):
        state["w"] += 0.01 * torch.randn(300_000, generator=g)
        futs = [ck.async_save(step, state), ema.async_save(step, {"e": state["w"] * 0.5})]
        for _ in range(40):                  # the loop's collectives, while the saves run
            t = torch.ones(4096)
            dist.all_reduce(t)
            assert t[0].item() == world
        for fut in futs:
            fut.result(timeout=60)
    mine = ck._background.group(None)
    assert mine is not None and mine is ck._background.group(None)        # made once
    assert mine is not ema._background.group(None) and mine is not groups.background_group(None)
    assert ck.steps() == ema.steps() == [0, 1, 2, 3]
    back = {"w": torch.zeros(300_000), "b": torch.zeros(64)}
    ck.load(back)
    assert torch.equal(back["b"], state["b"])     # too small for a delta: stored exactly
    ck.close()
    ema.close()
    dist.destroy_process_group()
