"""Lightning through LcckptCheckpointIO: a real Trainer writes its checkpoints as lcckpt
files, resumes from them to the same weights as an uninterrupted run, and a module loads
from them."""

import os
import warnings

import pytest
import torch

pytest.importorskip("lightning")
import lightning as L  # noqa: E402
from lightning.fabric.utilities.rank_zero import rank_zero_only  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import lcckpt  # noqa: E402
from lcckpt.errors import InvalidArgumentError, UnsafeObjectError  # noqa: E402
from lcckpt.format.container import MAGIC  # noqa: E402
from lcckpt.training.lightning import LcckptCheckpointIO, load_module  # noqa: E402


class Regressor(L.LightningModule):
    def __init__(self, width: int = 16, lr: float = 0.05, note: str = "x"):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(),
                                       torch.nn.Linear(width, 1))
        self.loaded_hook = False

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)]

    def on_load_checkpoint(self, checkpoint):
        self.loaded_hook = True


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(256, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def _fit(root, max_steps, ckpt_path=None, io=None, callbacks=()):
    L.seed_everything(0, verbose=False)
    model = Regressor(width=16, note="run")
    trainer = L.Trainer(default_root_dir=root, max_steps=max_steps, accelerator="cpu",
                        devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, plugins=[io] if io else None,
                        callbacks=list(callbacks))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, _data(), ckpt_path=ckpt_path)
    return model, trainer


def _same(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}/{i}")
    else:
        assert a == b, where


def test_a_trainer_writes_lcckpt_files_and_resumes_from_them_as_from_its_own(tmp_path):
    """The same run checkpointed by Lightning's own CheckpointIO and by this one: equal
    checkpoints (model, optimizer, scheduler, loops, callbacks), and runs resumed from
    each, mid-epoch, end with the same weights."""
    runs = {}
    for name, io in (("torch", None), ("lcckpt", LcckptCheckpointIO())):
        every = ModelCheckpoint(dirpath=tmp_path / name, every_n_train_steps=5, save_top_k=-1,
                                save_last=True)
        _fit(tmp_path / f"{name}-a", 20, io=io, callbacks=[every])
        last = str(tmp_path / name / "last.ckpt")
        resumed, trainer = _fit(tmp_path / f"{name}-b", 30, ckpt_path=last, io=io)
        assert trainer.global_step == 30
        runs[name] = (sorted(os.listdir(tmp_path / name)), last, resumed.state_dict())
    files, last, _ = runs["lcckpt"]
    assert files == runs["torch"][0] and "last.ckpt" in files and len(files) == 5, files
    for f in files:
        with open(tmp_path / "lcckpt" / f, "rb") as fh:
            assert fh.read(len(MAGIC)) == MAGIC, f          # lcckpt files, not pickles
    ours = lcckpt.load(last)
    theirs = torch.load(runs["torch"][1], weights_only=False)
    assert type(ours["hyper_parameters"]) is dict
    assert ours["hyper_parameters"] == dict(theirs.pop("hyper_parameters"))
    ours.pop("hyper_parameters")
    for key in ("callbacks",):       # ModelCheckpoint's state names its own directory
        ours.pop(key), theirs.pop(key)
    _same(ours, theirs)
    _same(runs["lcckpt"][2], runs["torch"][2])


def test_a_module_loads_from_a_checkpoint_of_the_plugin(tmp_path):
    model, trainer = _fit(tmp_path, 6, io=LcckptCheckpointIO(compress=False))
    path = tmp_path / "m.ckpt"
    trainer.save_checkpoint(path)
    back = load_module(Regressor, path, note="override")
    assert back.loaded_hook and not back.training and back.hparams.note == "override"
    for a, b in zip(back.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
    lcckpt.save({"x": 1}, tmp_path / "other.lcc")
    with pytest.raises(InvalidArgumentError, match="state_dict"):
        load_module(Regressor, tmp_path / "other.lcc")


def test_old_torch_checkpoints_still_resume_and_bad_inputs_are_named(tmp_path):
    every = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=5, save_top_k=-1)
    _fit(tmp_path, 10, callbacks=[every])                       # Lightning's own torch.save
    old = max(os.listdir(tmp_path / "ck"), key=lambda n: int(n.split("step=")[1][:-5]))
    io = LcckptCheckpointIO()
    ck = io.load_checkpoint(tmp_path / "ck" / old)              # read weights-only
    assert ck["global_step"] == 10
    _, t2 = _fit(tmp_path / "b", 12, ckpt_path=str(tmp_path / "ck" / old), io=io)
    assert t2.global_step == 12
    with pytest.raises(UnsafeObjectError):
        io.load_checkpoint(tmp_path / "ck" / old, weights_only=False)
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(tmp_path / "none.ckpt")
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({}, tmp_path / "x.ckpt", storage_options={"a": 1})
    with pytest.raises(UnsafeObjectError, match="state_dict"):
        io.save_checkpoint({"hyper_parameters": {"net": torch.nn.Linear(1, 1)}},
                           tmp_path / "x.ckpt")
    assert not os.path.exists(tmp_path / "x.ckpt")
    io.save_checkpoint({"a": torch.ones(2)}, tmp_path / "gone.ckpt")
    io.remove_checkpoint(tmp_path / "gone.ckpt")
    assert not os.path.exists(tmp_path / "gone.ckpt")
    with pytest.raises(InvalidArgumentError):
        LcckptCheckpointIO(compress="yes")


def test_a_url_goes_through_fsspec(tmp_path):
    io = LcckptCheckpointIO()
    io.save_checkpoint({"w": torch.arange(5.0), "step": 3}, "memory://lightning/a.ckpt")
    back = io.load_checkpoint("memory://lightning/a.ckpt")
    assert back["step"] == 3 and torch.equal(back["w"], torch.arange(5.0))
    io.remove_checkpoint("memory://lightning/a.ckpt")
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint("memory://lightning/a.ckpt")


def test_a_chain_callback_keeps_every_checkpoint_and_a_step_resumes(tmp_path):
    """Every checkpoint the run builds is a step of the chain, stored once per step; an
    exact chain (keyframe_every=1) exported and resumed ends as a resume from Lightning's
    own file; the default chain is smaller than the files and resumes too."""
    from lcckpt.training.lightning import ChainCallback, export_checkpoint
    ends = {}
    for name, options in (("exact", {"keyframe_every": 1}), ("default", {})):
        every = ModelCheckpoint(dirpath=tmp_path / f"{name}-files", every_n_train_steps=5,
                                save_top_k=-1, save_last=True)
        chain = ChainCallback(tmp_path / f"{name}-chain", **options)
        _fit(tmp_path / f"{name}-a", 20, callbacks=[every, chain])
        assert lcckpt.DeltaCheckpointer(tmp_path / f"{name}-chain").steps() == [5, 10, 15, 20]
        assert chain.last_save["kind"] == ("keyframe" if name == "exact" else "delta")
        out = tmp_path / f"{name}.ckpt"
        assert export_checkpoint(tmp_path / f"{name}-chain", out) == 20
        resumed, trainer = _fit(tmp_path / f"{name}-b", 30, ckpt_path=str(out),
                                io=LcckptCheckpointIO())
        assert trainer.global_step == 30
        ends[name] = resumed.state_dict()
    own, _ = _fit(tmp_path / "own", 30, ckpt_path=str(tmp_path / "exact-files" / "last.ckpt"))
    _same(ends["exact"], own.state_dict())
    files = sum(os.path.getsize(tmp_path / "default-files" / f)
                for f in os.listdir(tmp_path / "default-files") if f != "last.ckpt")
    chain_bytes = sum(os.path.getsize(tmp_path / "default-chain" / f)
                      for f in os.listdir(tmp_path / "default-chain"))
    assert chain_bytes < files / 2, (chain_bytes, files)
    with pytest.raises(InvalidArgumentError, match="only increase"):
        _fit(tmp_path / "again", 10, callbacks=[ChainCallback(tmp_path / "default-chain"),
                                                ModelCheckpoint(dirpath=tmp_path / "x",
                                                                every_n_train_steps=5)])
    with pytest.raises(InvalidArgumentError, match="no chain steps"):
        export_checkpoint(tmp_path / "empty", tmp_path / "e.ckpt")


def test_a_background_chain_writes_what_a_save_in_the_hook_writes(tmp_path, monkeypatch):
    """The same run with the chain written in the hook and in the background: every
    step restores to the same model and optimizer state, bit for bit; a failed background
    write is raised in the training thread by the end of the run."""
    from lcckpt.training.lightning import ChainCallback
    back = {}
    for mode in (False, True):
        every = ModelCheckpoint(dirpath=tmp_path / f"files-{mode}", every_n_train_steps=4,
                                save_top_k=-1)
        chain = ChainCallback(tmp_path / f"chain-{mode}", background=mode)
        _fit(tmp_path / f"run-{mode}", 16, callbacks=[every, chain])
        ck = lcckpt.DeltaCheckpointer(tmp_path / f"chain-{mode}")
        assert ck.steps() == [4, 8, 12, 16] and chain.last_save["kind"] == "delta"
        back[mode] = [{k: ck.load(s)[k] for k in ("state_dict", "optimizer_states")}
                      for s in ck.steps()]
    _same(back[False], back[True])

    def broken(self, step, obj, **kw):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(lcckpt.DeltaCheckpointer, "save", broken)
    every = ModelCheckpoint(dirpath=tmp_path / "files-x", every_n_train_steps=4, save_top_k=-1)
    with pytest.raises(OSError, match="No space"):
        _fit(tmp_path / "run-x", 8, callbacks=[every, ChainCallback(tmp_path / "chain-x",
                                                                    background=True)])


def test_a_background_save_memory_cannot_hold_is_written_in_the_hook(tmp_path, monkeypatch):
    from lcckpt import limits
    from lcckpt.training.lightning import ChainCallback
    monkeypatch.setattr(limits, "usable_memory", lambda: (1 << 20, "the cgroup's memory limit"))
    chain = ChainCallback(tmp_path / "chain", background=True)
    every = ModelCheckpoint(dirpath=tmp_path / "files", every_n_train_steps=4, save_top_k=-1)
    _fit(tmp_path / "run", 8, callbacks=[every, chain])     # (it silences warnings)
    assert chain.stats["foreground"] == 2
    assert lcckpt.DeltaCheckpointer(tmp_path / "chain").steps() == [4, 8]


def test_a_chain_behind_the_files_resumes_and_keeps_them_small(tmp_path):
    """``LcckptCheckpointIO(chain=...)``: ModelCheckpoint's files hold the small parts and a
    step of the chain; a run resumes from them with no other change; a removed file leaves
    the chain; a file whose step is gone says so."""
    io = LcckptCheckpointIO(chain=tmp_path / "chain")
    top = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=5, save_top_k=-1,
                          save_last=True)
    model, _ = _fit(tmp_path / "a", 20, io=io, callbacks=[top])
    assert lcckpt.DeltaCheckpointer(tmp_path / "chain").steps() == [5, 10, 15, 20]
    files = sorted(os.listdir(tmp_path / "ck"))
    assert len(files) == 5 and all(os.path.getsize(tmp_path / "ck" / f) < 20_000 for f in files)
    back = io.load_checkpoint(tmp_path / "ck" / "last.ckpt")
    assert back["global_step"] == 20 and "lcckpt_chain_step" not in back
    for k, v in model.state_dict().items():       # within the chain's targets of the model
        err = (back["state_dict"][k] - v).norm() / (v.norm() + 1e-12)
        assert err < 0.05, k
    assert len(back["optimizer_states"][0]["state"]) == 4
    _same(lcckpt.load(tmp_path / "ck" / "last.ckpt"), back)    # lcckpt.load follows it too
    small = lcckpt.load(tmp_path / "ck" / "last.ckpt", follow=False)
    assert "state_dict" not in small and small["lcckpt_chain_step"]["step"] == 20
    with open(tmp_path / "ck" / "last.ckpt", "rb") as fh, \
            pytest.warns(RuntimeWarning, match="by its path"):
        assert lcckpt.load(fh) == small           # no directory to find the chain from
    name = next(iter(back["state_dict"]))
    with lcckpt.open(tmp_path / "ck" / "last.ckpt") as f, \
            pytest.raises(KeyError, match=r"stands for step 20 of a chain.*step=20\)"):
        f.get_tensor(f"state_dict.{name}")        # the error says where the tensors are
    with lcckpt.open(tmp_path / "chain", step=20) as f:
        assert torch.equal(f.get_tensor(f"state_dict.{name}"), back["state_dict"][name])
    into = {"state_dict": {k: torch.zeros_like(v) for k, v in back["state_dict"].items()}}
    filled = lcckpt.load(tmp_path / "ck" / "last.ckpt", into=into)
    for k, v in into["state_dict"].items():       # the step decoded into the given tensors
        assert torch.equal(v, back["state_dict"][k]) and filled["state_dict"][k] is v, k
    resumed, trainer = _fit(tmp_path / "b", 30, ckpt_path=str(tmp_path / "ck" / "last.ckpt"),
                            io=LcckptCheckpointIO(chain=tmp_path / "chain"),
                            callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck",
                                                       every_n_train_steps=5, save_top_k=-1)])
    assert trainer.global_step == 30
    assert lcckpt.DeltaCheckpointer(tmp_path / "chain").steps() == [5, 10, 15, 20, 25, 30]
    io.remove_checkpoint(tmp_path / "ck" / "last.ckpt")
    assert lcckpt.DeltaCheckpointer(tmp_path / "chain").steps()[-1] == 30
    model30 = load_module(Regressor, tmp_path / "ck" / "epoch=1-step=30.ckpt")
    for k, v in resumed.state_dict().items():
        err = (model30.state_dict()[k] - v).norm() / (v.norm() + 1e-12)
        assert err < 0.05, k
    gone = lcckpt.load(tmp_path / "ck" / "epoch=1-step=30.ckpt", follow=False)
    gone["lcckpt_chain_step"]["step"] = 999                 # a step retention removed
    lcckpt.save(gone, tmp_path / "ck" / "gone.ckpt")
    with pytest.raises(FileNotFoundError, match="does not hold it"):
        io.load_checkpoint(tmp_path / "ck" / "gone.ckpt")
    with pytest.raises(InvalidArgumentError, match="only increase"):
        _fit(tmp_path / "c", 5, io=LcckptCheckpointIO(chain=tmp_path / "chain"),
             callbacks=[ModelCheckpoint(dirpath=tmp_path / "x", every_n_train_steps=5)])
    with pytest.raises(InvalidArgumentError, match="chain's"):
        LcckptCheckpointIO(keep_last=2)


def test_a_resuming_plugin_goes_on_from_the_references_its_load_decoded(tmp_path,
                                                                         monkeypatch):
    """The plugin that loads a file of its own chain before storing anything keeps the
    restored references (``load(resume=True)``): its next save continues the chain from
    them, and loads the same step as a fresh writer's would. A plugin on a rank that does
    not save keeps none."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 300, generator=g)
    def state(step):
        return {"global_step": step, "state_dict": {"w": w + 0.01 * step * torch.ones(1)},
                "loops": {"at": step}}
    first = LcckptCheckpointIO(chain=tmp_path / "chain")
    for step in (1, 2):
        first.save_checkpoint(state(step), tmp_path / f"s{step}.ckpt")
    first.teardown()
    again = LcckptCheckpointIO(chain=tmp_path / "chain")
    assert again.load_checkpoint(tmp_path / "s2.ckpt")["loops"] == {"at": 2}
    assert again._ck is not None and again._ck._primed[0] == 2      # the references kept
    again.save_checkpoint(state(3), tmp_path / "s3.ckpt")
    again.teardown()
    other_rank = LcckptCheckpointIO(chain=tmp_path / "chain")   # a rank that never saves
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    assert other_rank.load_checkpoint(tmp_path / "s2.ckpt")["loops"] == {"at": 2}
    assert other_rank._ck is None                    # no references held for nothing
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    fresh = LcckptCheckpointIO(chain=tmp_path / "other")
    for step in (1, 2, 3):
        fresh.save_checkpoint(state(step), tmp_path / f"o{step}.ckpt")
    fresh.teardown()
    a = LcckptCheckpointIO().load_checkpoint(tmp_path / "s3.ckpt")["state_dict"]["w"]
    b = LcckptCheckpointIO().load_checkpoint(tmp_path / "o3.ckpt")["state_dict"]["w"]
    assert torch.equal(a, b)


def test_the_chain_keeps_only_what_the_files_lightning_keeps_need(tmp_path):
    """``save_top_k=1``: each new file's save removes the one before, and the chain keeps
    only the newest step's keyframe interval, as Lightning keeps one file; the run resumes
    from the file it kept."""
    io = LcckptCheckpointIO(chain=tmp_path / "chain", keyframe_every=3)
    one = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=5, save_top_k=1)
    _fit(tmp_path / "a", 40, io=io, callbacks=[one])
    io.teardown()
    assert os.listdir(tmp_path / "ck") == ["epoch=2-step=40.ckpt"]
    ck = lcckpt.DeltaCheckpointer(tmp_path / "chain")
    assert ck.steps() == [35, 40] and ck.info(35)["kind"] == "keyframe"
    kept = LcckptCheckpointIO(chain=tmp_path / "chain", prune=False)
    _, trainer = _fit(tmp_path / "b", 50, ckpt_path=str(tmp_path / "ck" / "epoch=2-step=40.ckpt"),
                      io=kept, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck",
                                                          every_n_train_steps=5, save_top_k=1)])
    kept.teardown()
    assert trainer.global_step == 50
    assert lcckpt.DeltaCheckpointer(tmp_path / "chain").steps() == [35, 40, 45, 50]
    with pytest.raises(InvalidArgumentError, match="prune"):
        LcckptCheckpointIO(chain=tmp_path / "chain", prune=1)


def _state(step, w):
    return {"global_step": step, "state_dict": {"w": w + 0.01 * step}, "loops": {"at": step}}


def test_a_step_a_kept_file_names_stays_with_its_base_and_the_rest_goes(tmp_path):
    """Files removed by Lightning free their steps; a kept file's step keeps the steps back
    to its keyframe and loads as before; so does a file written before pointer files named
    their step in the header; an unreadable lcckpt file stops the pruning with a warning;
    a file elsewhere does not keep its step."""
    w = torch.randn(200, 200, generator=torch.Generator().manual_seed(0))
    io = LcckptCheckpointIO(chain=tmp_path / "chain", keyframe_every=3)
    ck_dir = tmp_path / "ck"
    for step in range(1, 10):
        io.save_checkpoint(_state(step, w), ck_dir / f"s{step}.ckpt")
    before = io.load_checkpoint(ck_dir / "s2.ckpt")["state_dict"]["w"]
    old = lcckpt.load(ck_dir / "s5.ckpt", follow=False)    # as the version before wrote it
    lcckpt.save(old, ck_dir / "old.ckpt")
    _same(lcckpt.load(ck_dir / "old.ckpt"), io.load_checkpoint(ck_dir / "s5.ckpt"))
    os.makedirs(tmp_path / "elsewhere")
    lcckpt.save({**old, "lcckpt_chain_step": {"chain": "../chain", "step": 6}},
                tmp_path / "elsewhere" / "copy.ckpt")
    torch.save({"not": "ours"}, ck_dir / "torch.ckpt")     # not an lcckpt file: ignored
    (ck_dir / "bad.ckpt").write_bytes(MAGIC + b"\0" * 40)
    with pytest.warns(RuntimeWarning, match="not pruned.*bad.ckpt"):
        io.remove_checkpoint(ck_dir / "s1.ckpt")
    assert lcckpt.DeltaCheckpointer(tmp_path / "chain").steps() == list(range(1, 10))
    os.remove(ck_dir / "bad.ckpt")
    for step in (1, 3, 4, 5, 6, 8):
        io.remove_checkpoint(ck_dir / f"s{step}.ckpt")
    io.teardown()
    # s2 needs 1 (its keyframe); old.ckpt names 5, which needs 4; s7 is a keyframe; the
    # newest, 9, needs 7 and 8
    assert lcckpt.DeltaCheckpointer(tmp_path / "chain").steps() == [1, 2, 4, 5, 7, 8, 9]
    again = LcckptCheckpointIO(chain=tmp_path / "chain")
    assert torch.equal(again.load_checkpoint(ck_dir / "s2.ckpt")["state_dict"]["w"], before)
    assert again.load_checkpoint(ck_dir / "old.ckpt")["loops"] == {"at": 5}
    with pytest.raises(FileNotFoundError, match="does not hold it"):
        again.load_checkpoint(tmp_path / "elsewhere" / "copy.ckpt")
    again.teardown()


def test_pruning_that_cannot_take_the_chain_warns_and_training_goes_on(tmp_path):
    """Another writer holds the chain: a removal still removes the file, and the pruning
    is skipped with a warning instead of failing Lightning's save."""
    w = torch.randn(100, 100, generator=torch.Generator().manual_seed(2))
    io = LcckptCheckpointIO(chain=tmp_path / "chain")
    for step in (1, 2):
        io.save_checkpoint(_state(step, w), tmp_path / "ck" / f"s{step}.ckpt")
    io.teardown()
    other = LcckptCheckpointIO(chain=tmp_path / "chain")
    with lcckpt.DeltaCheckpointer(tmp_path / "chain") as holder:
        holder.save(3, _state(3, w))
        with pytest.warns(RuntimeWarning, match="not pruned.*another"):
            other.remove_checkpoint(tmp_path / "ck" / "s1.ckpt")
    assert not os.path.exists(tmp_path / "ck" / "s1.ckpt")
    assert lcckpt.DeltaCheckpointer(tmp_path / "chain").steps() == [1, 2, 3]


def test_a_file_of_a_chain_step_converted_resumes_with_lightnings_own_io(tmp_path):
    """``lcckpt convert`` of a chain-behind-the-files checkpoint writes the whole of it in
    torch.save format, from which a Trainer without the plugin resumes."""
    io = LcckptCheckpointIO(chain=tmp_path / "chain")
    _fit(tmp_path / "a", 10, io=io,
         callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=5,
                                    save_top_k=-1)])
    io.teardown()
    src = tmp_path / "ck" / "epoch=0-step=10.ckpt"
    lcckpt.convert(str(src), str(tmp_path / "torch.ckpt"))
    plain = torch.load(tmp_path / "torch.ckpt", weights_only=False)
    assert "lcckpt_chain_step" not in plain and plain["global_step"] == 10
    want = io.load_checkpoint(src)
    _same(plain["state_dict"], want["state_dict"])
    _, trainer = _fit(tmp_path / "b", 15, ckpt_path=str(tmp_path / "torch.ckpt"))
    assert trainer.global_step == 15


def test_a_run_of_lightnings_own_files_is_imported_as_a_chain_and_resumes(tmp_path):
    """``import_checkpoints``: Lightning's torch.save files stored as chain steps (a step
    two files hold, once); with ``replace=True`` each file rewritten as the plugin's, the
    run resumed from one of them; the steps restored within their targets."""
    from lcckpt.training.lightning import import_checkpoints
    own = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=5, save_top_k=-1,
                          save_last=True)
    _fit(tmp_path / "a", 20, callbacks=[own])
    files = sorted((tmp_path / "ck").iterdir())
    before = {f.name: torch.load(f, weights_only=False) for f in files}
    size = sum(f.stat().st_size for f in files)
    assert import_checkpoints(files, tmp_path / "kept") == [5, 10, 15, 20]
    assert sum(f.stat().st_size for f in files) == size          # left as they were
    steps = import_checkpoints(files, tmp_path / "chain", replace=True)
    assert steps == [5, 10, 15, 20]
    for f in files:                                   # the small parts and the step
        small = lcckpt.load(f, follow=False)
        assert "state_dict" not in small and small["lcckpt_chain_step"]["step"] in steps
    io = LcckptCheckpointIO(chain=tmp_path / "chain")
    for f in files:
        back, true = io.load_checkpoint(f), before[f.name]
        assert back["global_step"] == true["global_step"] and back["loops"] == true["loops"]
        for k, v in true["state_dict"].items():
            err = (back["state_dict"][k] - v).norm() / (v.norm() + 1e-12)
            assert err < 0.05, (f.name, k)
    io.teardown()
    _, trainer = _fit(tmp_path / "b", 30, ckpt_path=str(tmp_path / "ck" / "last.ckpt"),
                      io=LcckptCheckpointIO(chain=tmp_path / "chain"),
                      callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck2",
                                                 every_n_train_steps=5, save_top_k=-1)])
    assert trainer.global_step == 30
    assert import_checkpoints(files, tmp_path / "chain", replace=True) == []  # run again
    legacy = tmp_path / "legacy.ckpt"                  # torch.save's pre-zip format too
    torch.save(before[files[0].name], legacy, _use_new_zipfile_serialization=False)
    assert import_checkpoints([legacy], tmp_path / "from-legacy") == [
        before[files[0].name]["global_step"]]
    with pytest.raises(InvalidArgumentError, match="only increase"):
        import_checkpoints(files, tmp_path / "kept")


def test_a_chain_another_writer_holds_is_refused_when_fitting_starts(tmp_path):
    from lcckpt.training.lightning import ChainCallback
    other = lcckpt.DeltaCheckpointer(tmp_path / "chain")
    other.save(0, {"w": torch.ones(2)})                       # holds the writer lock
    steps = []

    class Steps(L.Callback):
        def on_train_batch_end(self, *args):
            steps.append(1)
    with pytest.raises(lcckpt.ConcurrentWriteError, match="one writer per directory"):
        _fit(tmp_path / "run", 4, callbacks=[ChainCallback(tmp_path / "chain"), Steps()])
    assert steps == []                          # before training, not at its first save
    other.close()
    _fit(tmp_path / "run", 4, callbacks=[ChainCallback(tmp_path / "chain")])   # free again
