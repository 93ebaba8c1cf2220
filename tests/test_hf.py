"""Hugging Face Trainer: ChainCallback keeps every checkpoint the Trainer saves (also in
the background), export_checkpoint writes a step back as a directory the Trainer resumes
from, import_checkpoints stores existing directories as a chain. The Trainer's own
checkpoint directories are the oracle: they hold the true states."""

import json
import os
import types

import numpy as np
import pytest
import torch

pytest.importorskip("accelerate", reason="the Trainer needs accelerate (pip install accelerate)")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

import lcckpt  # noqa: E402
from lcckpt.errors import InvalidArgumentError  # noqa: E402
from lcckpt.training.hf import ChainCallback, export_checkpoint, import_checkpoints  # noqa: E402

transformers.utils.logging.set_verbosity_error()
STEPS, EVERY = 12, 4


class _Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.x = torch.randint(0, 100, (64, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _model():
    """A 2-layer GPT-2: its input and output embeddings are one tied tensor."""
    return GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2,
                                      n_positions=32))


def _trainer(out, callbacks=()):
    """The model trained with AdamW on CPU, a checkpoint every EVERY steps."""
    torch.manual_seed(0)
    model = _model()
    args = TrainingArguments(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=8,
        save_strategy="steps", save_steps=EVERY, report_to=[], logging_steps=100,
        use_cpu=True, learning_rate=1e-3, seed=0, disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=_Tokens(),
                   callbacks=list(callbacks))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One uninterrupted run, its checkpoints kept by the Trainer and by three chains:
    exact, default, and default written in the background."""
    root = tmp_path_factory.mktemp("hf")
    exact, lossy = ChainCallback(root / "exact", keyframe_every=1), ChainCallback(root / "chain")
    t = _trainer(root / "out", [exact, lossy, ChainCallback(root / "background", background=True)])
    t.train()
    final = {k: v.clone() for k, v in t.model.state_dict().items()}
    return types.SimpleNamespace(root=root, out=root / "out", final=final, lossy=lossy)


def _weights(path):
    return load_file(os.path.join(path, "model.safetensors"))


def test_the_chains_hold_every_checkpoint_the_trainer_saved(run):
    steps = list(range(EVERY, STEPS + 1, EVERY))
    assert lcckpt.DeltaCheckpointer(run.root / "exact").steps() == steps
    assert lcckpt.DeltaCheckpointer(run.root / "chain").steps() == steps
    assert run.lossy.last_save["step"] == STEPS and run.lossy.last_save["kind"] == "delta"
    for step in steps:
        hf = run.out / f"checkpoint-{step}"
        got = lcckpt.DeltaCheckpointer(run.root / "exact").load(step)
        for name, w in _weights(hf).items():
            assert torch.equal(got["model"][name], w), (step, name)
        # tied weights keep sharing one storage, as in the model
        tied = got["model"]["lm_head.weight"], got["model"]["transformer.wte.weight"]
        assert tied[0].data_ptr() == tied[1].data_ptr()
        opt = torch.load(hf / "optimizer.pt", weights_only=True)
        for i, s in opt["state"].items():
            for k, v in s.items():
                assert torch.equal(got["optimizer"]["state"][i][k], v), (step, i, k)
        assert got["scheduler"] == torch.load(hf / "scheduler.pt", weights_only=True)
        assert got["trainer_state"] == (hf / "trainer_state.json").read_text()
        rng = torch.load(hf / "rng_state.pth", weights_only=False)
        assert got["rng"]["python"] == rng["python"]
        assert torch.equal(got["rng"]["cpu"], rng["cpu"])
        assert all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
                   for a, b in zip(got["rng"]["numpy"], rng["numpy"]))


def test_a_background_chain_writes_the_same_files(run):
    """The host copy and the thread change when the bytes are written, not which."""
    names = sorted(os.listdir(run.root / "chain"))
    assert names == sorted(os.listdir(run.root / "background"))
    for name in names:
        if name.endswith(".lcc"):
            assert (run.root / "chain" / name).read_bytes() == \
                (run.root / "background" / name).read_bytes(), name


def test_replace_writes_the_chain_instead_and_resumes_bit_for_bit(run, tmp_path):
    """No checkpoint-N directory written; the same states as the run's exact chain, and
    its trainer state but for total_flos (the Trainer adds it up when it saves or logs);
    a step exported resumes as the run went on."""
    cb = ChainCallback(tmp_path / "c", keyframe_every=1, replace=True, background=True)
    t = _trainer(tmp_path / "out", [cb])
    t.train()
    assert not any(p.name.startswith("checkpoint-") for p in (tmp_path / "out").iterdir())
    for step in range(EVERY, STEPS + 1, EVERY):
        mine = lcckpt.DeltaCheckpointer(tmp_path / "c").load(step)
        theirs = lcckpt.DeltaCheckpointer(run.root / "exact").load(step)
        mine_state, theirs_state = (json.loads(x["trainer_state"]) for x in (mine, theirs))
        assert mine_state.pop("total_flos") <= theirs_state.pop("total_flos")
        assert mine_state == theirs_state
        assert all(torch.equal(mine["model"][k], v) for k, v in theirs["model"].items())
    out = export_checkpoint(tmp_path / "c", tmp_path / "ex" / "checkpoint-8", _model(), step=8)
    t = _trainer(tmp_path / "resumed")
    t.train(resume_from_checkpoint=out)
    assert all(torch.equal(t.model.state_dict()[k], v) for k, v in run.final.items())


@pytest.mark.parametrize("kw", [dict(load_best_model_at_end=True),
                                dict(save_strategy=transformers.trainer_utils.SaveStrategy.BEST)])
def test_replace_refuses_what_needs_the_trainer_s_directories(kw):
    args = types.SimpleNamespace(fsdp=None, deepspeed=None, should_save=True, **kw)
    with pytest.raises(InvalidArgumentError, match="replace=True"):
        ChainCallback("unused", replace=True).on_train_begin(args, None, None)
    assert not os.path.exists("unused")


def test_save_only_model_stores_the_model_alone(tmp_path):
    cb = ChainCallback(tmp_path / "c")
    args = types.SimpleNamespace(fsdp=None, deepspeed=None, should_save=True,
                                 save_only_model=True, output_dir=str(tmp_path / "out"))
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    cb.on_save(args, transformers.TrainerState(global_step=1), None, model=model, optimizer=opt)
    assert sorted(lcckpt.DeltaCheckpointer(tmp_path / "c").load(1)) == ["model", "trainer_state"]


def _first_moment_error(cb, tmp_path) -> float:
    """The restored ``exp_avg``'s error over its movement since the keyframe, after a
    keyframe and one delta written through ``cb``."""
    args = types.SimpleNamespace(fsdp=None, deepspeed=None, should_save=True,
                                 output_dir=str(tmp_path / "out"))
    model = torch.nn.Linear(256, 64)
    opt = torch.optim.AdamW(model.parameters())
    torch.manual_seed(0)
    moments = []
    for step in (1, 2):
        model.weight.grad = torch.randn_like(model.weight)
        model.bias.grad = torch.randn_like(model.bias)
        opt.step()
        moments.append(opt.state[model.weight]["exp_avg"].clone())
        cb.on_save(args, transformers.TrainerState(global_step=step), None, model=model,
                   optimizer=opt)
    got = lcckpt.DeltaCheckpointer(cb.directory).load(2)["optimizer"]["state"][0]["exp_avg"]
    return float((got - moments[1]).norm() / (moments[1] - moments[0]).norm())


def test_replace_holds_first_moments_closer_for_the_resume_it_serves(tmp_path):
    """With replace=True a resume can only read the chain: first moments within 0.3 of
    their movement (RESUMABLE), where the chain beside the Trainer's directories may
    leave up to 0.8; a target given still wins."""
    assert _first_moment_error(ChainCallback(tmp_path / "a", replace=True), tmp_path) <= 0.3
    assert _first_moment_error(ChainCallback(tmp_path / "b"), tmp_path) > 0.3
    assert ChainCallback(tmp_path / "c", replace=True, target=0.01).options == {"target": 0.01}


def test_a_failed_background_save_is_raised_by_the_next_call(tmp_path, monkeypatch):
    cb = ChainCallback(tmp_path / "c", background=True)
    args = types.SimpleNamespace(fsdp=None, deepspeed=None, should_save=True,
                                 output_dir=str(tmp_path / "out"))
    model = torch.nn.Linear(2, 2)
    cb.on_save(args, transformers.TrainerState(global_step=1), None, model=model)
    cb.wait()
    assert cb.last_save["step"] == 1

    def full(*a, **k):
        raise lcckpt.StorageError(28, "No space left on device", "x")
    monkeypatch.setattr(lcckpt.DeltaCheckpointer, "save", full)
    cb.on_save(args, transformers.TrainerState(global_step=2), None, model=model)   # returns
    with pytest.raises(lcckpt.StorageError, match="No space left"):
        cb.on_train_end(args, None, None)
    cb.wait()                                        # raised once, then clear
    assert lcckpt.DeltaCheckpointer(tmp_path / "c").steps() == [1]


def test_a_background_save_memory_cannot_hold_is_written_in_on_save(tmp_path, monkeypatch):
    from lcckpt import limits
    monkeypatch.setattr(limits, "usable_memory", lambda: (1 << 20, "the cgroup's memory limit"))
    cb = ChainCallback(tmp_path / "c", background=True)
    args = types.SimpleNamespace(fsdp=None, deepspeed=None, should_save=True,
                                 output_dir=str(tmp_path / "out"))
    model = torch.nn.Linear(64, 64)
    with pytest.warns(RuntimeWarning, match="saved in the foreground"):
        cb.on_save(args, transformers.TrainerState(global_step=1), None, model=model)
    assert cb.last_save["step"] == 1 and cb.stats["foreground"] == 1    # before it returned
    cb.on_save(args, transformers.TrainerState(global_step=2), None, model=model)
    assert cb.last_save["step"] == 2 and cb.stats["foreground"] == 2


def test_lossy_steps_keep_what_training_changed(run):
    """Every restored weight tensor of the default chain within 5% of how far it moved
    since the keyframe (the default's largest share: docs/chain.md)."""
    first = _weights(run.out / f"checkpoint-{EVERY}")
    ck = lcckpt.DeltaCheckpointer(run.root / "chain")
    for step in range(2 * EVERY, STEPS + 1, EVERY):
        got = ck.load(step)["model"]
        for name, w in _weights(run.out / f"checkpoint-{step}").items():
            moved = (w - first[name]).norm()
            assert moved > 0, name
            assert (got[name] - w).norm() <= 0.05 * moved, (step, name)


def test_an_exact_chain_resumes_bit_for_bit(run, tmp_path):
    out = export_checkpoint(run.root / "exact", tmp_path / "ex" / "checkpoint-4", _model(),
                            step=4)            # its parent is created
    t = _trainer(tmp_path / "resumed")
    t.train(resume_from_checkpoint=out)
    assert t.state.global_step == STEPS
    for k, v in run.final.items():
        assert torch.equal(t.model.state_dict()[k], v), k


def _loss(model):
    x = _Tokens().x
    model.eval()
    with torch.no_grad():
        return model(input_ids=x, labels=x).loss.item()


def test_a_lossy_step_resumes_close_to_the_run(run, tmp_path):
    """From the default chain's first delta: the run ends with its loss within 0.5% of
    the uninterrupted run's (0.04% measured) and its weights within a tenth of how far
    training moved them (0.066 measured: Adam's moments are restored within 80% and 10%
    of their movement, docs/chain.md)."""
    out = export_checkpoint(run.root / "chain", tmp_path / "checkpoint-8", _model(), step=8)
    assert json.loads((tmp_path / "checkpoint-8" / "trainer_state.json").read_text())[
        "global_step"] == 8
    t = _trainer(tmp_path / "resumed", [ChainCallback(tmp_path / "next")])
    t.train(resume_from_checkpoint=out)
    assert t.state.global_step == STEPS
    assert lcckpt.DeltaCheckpointer(tmp_path / "next").steps() == [STEPS]
    torch.manual_seed(0)
    init, got = _model().state_dict(), t.model.state_dict()
    err = sum((got[k] - v).norm() ** 2 for k, v in run.final.items()) ** 0.5
    moved = sum((v - init[k]).norm() ** 2 for k, v in run.final.items()) ** 0.5
    assert err <= 0.1 * moved
    model = _model()
    model.load_state_dict(run.final)
    assert abs(_loss(t.model) / _loss(model) - 1) <= 0.005


def test_resuming_before_the_chains_newest_step_is_refused(run, tmp_path):
    out = export_checkpoint(run.root / "chain", tmp_path / "checkpoint-4", _model(), step=4)
    t = _trainer(tmp_path / "resumed", [ChainCallback(run.root / "chain")])
    with pytest.raises(InvalidArgumentError, match="holds steps up to 12, after step 4"):
        t.train(resume_from_checkpoint=out)
    assert lcckpt.DeltaCheckpointer(run.root / "chain").steps() == [4, 8, 12]


def test_export_refuses_what_it_cannot_write(run, tmp_path):
    model = _model()
    (tmp_path / "taken").mkdir()
    with pytest.raises(InvalidArgumentError, match="exists"):
        export_checkpoint(run.root / "chain", tmp_path / "taken", model)
    ck = lcckpt.DeltaCheckpointer(tmp_path / "other")
    ck.save(1, {"model": model.state_dict()})
    with pytest.raises(InvalidArgumentError, match="lacks trainer_state"):
        export_checkpoint(tmp_path / "other", tmp_path / "x", model)
    assert sorted(os.listdir(tmp_path)) == ["other", "taken"]    # no temp directory left


def test_sharded_training_is_refused():
    args = types.SimpleNamespace(fsdp="full_shard", deepspeed=None, should_save=True)
    with pytest.raises(InvalidArgumentError, match="FSDP or DeepSpeed"):
        ChainCallback("unused").on_train_begin(args, None, None)
    assert not os.path.exists("unused")


def test_only_the_saving_process_writes(tmp_path):
    cb = ChainCallback(tmp_path / "c")
    args = types.SimpleNamespace(fsdp=None, deepspeed=None, should_save=False)
    cb.on_train_begin(args, None, None)
    cb.on_save(args, None, None, model=torch.nn.Linear(2, 2))
    assert not (tmp_path / "c").exists() and cb.last_save is None


def test_a_step_saved_twice_is_stored_once(tmp_path):
    cb = ChainCallback(tmp_path / "c")
    args = types.SimpleNamespace(fsdp=None, deepspeed=None, should_save=True,
                                 output_dir=str(tmp_path / "out"))
    state = transformers.TrainerState(global_step=3)
    model = torch.nn.Linear(2, 2)
    cb.on_save(args, state, None, model=model)
    first = cb.last_save
    cb.on_save(args, state, None, model=model)
    assert cb.last_save is first and lcckpt.DeltaCheckpointer(tmp_path / "c").steps() == [3]


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return type(a) is type(b) and a == b


def _same_files(a, b):
    """Two Trainer checkpoint directories hold the same state."""
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        assert _equal(*(torch.load(p / name, weights_only=False) for p in (a, b))), name
    assert (a / "trainer_state.json").read_text() == (b / "trainer_state.json").read_text()


def test_trainer_directories_imported_and_exported_come_back_the_same(run, tmp_path):
    dirs = [run.out / f"checkpoint-{s}" for s in (12, 4, 8)]          # any order
    assert import_checkpoints(dirs, tmp_path / "c", keyframe_every=1) == [4, 8, 12]
    ck = lcckpt.DeltaCheckpointer(tmp_path / "c")
    assert ck.steps() == [4, 8, 12] and "training_args" not in repr(ck.load(4).keys())
    for step in (4, 12):
        out = export_checkpoint(tmp_path / "c", tmp_path / f"checkpoint-{step}", _model(),
                                step=step)
        _same_files(run.out / f"checkpoint-{step}", tmp_path / f"checkpoint-{step}")
        assert os.path.isfile(os.path.join(out, "config.json"))


def test_an_imported_history_is_a_default_chain(run, tmp_path):
    dirs = [run.out / f"checkpoint-{s}" for s in (4, 8, 12)]
    import_checkpoints(dirs, tmp_path / "c")
    ck = lcckpt.DeltaCheckpointer(tmp_path / "c")
    assert [ck.info(s)["kind"] for s in ck.steps()] == ["keyframe", "delta", "delta"]
    first, want = _weights(run.out / "checkpoint-4"), _weights(run.out / "checkpoint-12")
    got = ck.load(12)["model"]
    assert all((got[k] - v).norm() <= 0.05 * (v - first[k]).norm() for k, v in want.items())


def test_import_refuses_what_is_not_a_trainer_checkpoint(run, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidArgumentError, match="not a Trainer checkpoint directory"):
        import_checkpoints([tmp_path / "empty"], tmp_path / "c")
    twice = [run.out / "checkpoint-4", run.out / "checkpoint-4"]
    with pytest.raises(InvalidArgumentError, match="are both step 4"):
        import_checkpoints(twice, tmp_path / "c")
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "trainer_state.json").write_text('{"global_step": 1}')
    with pytest.raises(InvalidArgumentError, match="holds no model weights"):
        import_checkpoints([tmp_path / "bare"], tmp_path / "c")


def test_replace_keeps_as_many_checkpoints_as_save_total_limit_asks(tmp_path):
    """With replace=True the chain is the run's checkpoints: save_total_limit becomes its
    keep_last (unless given), and a kept step keeps its base back to its keyframe."""
    args = types.SimpleNamespace(fsdp=None, deepspeed=None, should_save=True,
                                 save_total_limit=1, output_dir=str(tmp_path / "out"))
    cb = ChainCallback(tmp_path / "c", replace=True, keyframe_every=2)
    cb.on_train_begin(args, transformers.TrainerState(global_step=0), None)
    assert cb.options["keep_last"] == 1
    model = torch.nn.Linear(64, 64)
    for step in range(1, 5):                       # keyframes at 1 and 3
        with torch.no_grad():
            model.weight.add_(0.01)
        cb.on_save(args, transformers.TrainerState(global_step=step), None, model=model)
        cb.wait()
    assert lcckpt.DeltaCheckpointer(tmp_path / "c").steps() == [3, 4]
    mine = ChainCallback(tmp_path / "d", replace=True, keep_last=3)
    mine.on_train_begin(args, transformers.TrainerState(global_step=0), None)
    assert mine.options["keep_last"] == 3
    beside = ChainCallback(tmp_path / "e")
    beside.on_train_begin(args, transformers.TrainerState(global_step=0), None)
    assert "keep_last" not in beside.options        # beside the directories: every step


def test_a_chain_another_writer_holds_is_refused_when_training_begins(tmp_path):
    """A second run given a chain that a running writer holds learns it at the start,
    not from its first save."""
    other = lcckpt.DeltaCheckpointer(tmp_path / "chain")
    other.save(0, {"w": torch.ones(2)})                       # holds the writer lock
    t = _trainer(tmp_path / "out", [ChainCallback(tmp_path / "chain")])
    with pytest.raises(lcckpt.ConcurrentWriteError, match="one writer per directory"):
        t.train()
    assert t.state.global_step == 0
    other.close()
