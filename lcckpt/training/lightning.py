"""Lightning's checkpoint files written by lcckpt: ``Trainer(plugins=[LcckptCheckpointIO()])``.

Lightning writes every checkpoint (``ModelCheckpoint``'s top-k and ``last.ckpt``,
``trainer.save_checkpoint``) through the trainer's ``CheckpointIO`` and reads it back the
same way for ``trainer.fit(ckpt_path=...)``. This one writes with :func:`lcckpt.save`
(no pickle, checksummed, written atomically; with ``compress=True``, the default, every
tensor is coded bit-exactly, 1.2x smaller in fp32 and 1.5x in bf16) and reads with
:func:`lcckpt.load`, which also reads Lightning's own ``torch.save`` checkpoints with the
weights-only unpickler: a run can switch to it and resume from its old checkpoints.

Two things differ from Lightning's files:

* ``hyper_parameters`` is stored as a plain ``dict`` (Lightning keeps an ``AttributeDict``,
  a ``dict`` subclass only pickle stores); a value that lcckpt does not store (an
  ``nn.Module`` passed to ``save_hyperparameters``) is refused by name at the save.
* ``LightningModule.load_from_checkpoint`` calls ``torch.load`` itself, not the trainer's
  ``CheckpointIO``, so it cannot read these files: :func:`load_module` does its work for
  the common case (the module built from its saved hyperparameters, its
  ``on_load_checkpoint`` hook called, then its weights loaded).

Paths may be fsspec URLs, as with Lightning's own ``CheckpointIO``: a local path is written
atomically (a temporary file renamed over it), a URL through ``fsspec``'s file object.

:class:`ChainCallback` keeps every checkpoint Lightning builds as a step of a delta chain
as well (17.7x smaller than Lightning's files in ``benchmarks/lightning_trainer.py``),
and :func:`export_checkpoint` writes any step back as a checkpoint file that
``trainer.fit(ckpt_path=...)`` resumes from; :func:`import_checkpoints` stores an existing
run's files as a chain.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.data import AttributeDict
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.callbacks import Callback

from ..chain.checkpointer import DeltaCheckpointer
from ..chain.lock import check_free
from ..chain.pointer import POINTER, chain_of, checked, metadata, pointer_of, resolve
from ..chain.policy import RESUMABLE
from ..errors import CorruptDataError, InvalidArgumentError, LcckptError
from ..format.container import MAGIC
from ..format.serialization import load, save
from ..util.durable import TEMP_SUFFIX
from .background import Writer
from .hostcopy import HostBuffers
from ..util.caller import warn_user

__all__ = ["ChainCallback", "LcckptCheckpointIO", "export_checkpoint", "import_checkpoints",
           "load_module"]

HPARAMS = "hyper_parameters"


class LcckptCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves with :func:`lcckpt.save` and loads with
    :func:`lcckpt.load` (see the module's notes). ``compress``: code tensors bit-exactly
    (smaller files, a little more time); ``False`` stores their bytes as they are.

    ``chain``: a directory where the model's and the optimizers' state of every checkpoint
    go as the step ``global_step`` of a delta chain (``options``: its
    :class:`~lcckpt.DeltaCheckpointer`'s keywords, the first moments held to
    :data:`~lcckpt.chain.policy.RESUMABLE`'s 0.3 of their movement unless a target is
    given), while each checkpoint file keeps the rest (loops, callbacks, schedulers,
    hyperparameters) and the step; loading a file rebuilds the step, within the chain's
    targets. A second file at the step it stored last (``last.ckpt`` beside a top-k file)
    points at the state stored first. Local paths only, and steps only increase (a run
    resumed from an older file needs another chain directory).

    ``prune``: when Lightning removes a file (a top-k file that fell out, the previous
    ``last.ckpt``), delete the chain's steps that no file in the directories this object
    writes, loads or removes in names, and that no named step needs (a delta needs its
    base, back to its keyframe: at most ``keyframe_every`` steps behind each named step and
    the newest). The chain then takes about as much room as the files Lightning keeps. A
    file copied elsewhere does not keep its step: export it (:func:`export_checkpoint`) or
    pass ``prune=False``."""

    def __init__(self, compress: bool = True, *, chain=None, prune: bool = True,
                 **options: Any):
        if type(compress) is not bool:
            raise InvalidArgumentError(f"compress must be True or False, got {compress!r}")
        if type(prune) is not bool:
            raise InvalidArgumentError(f"prune must be True or False, got {prune!r}")
        if options and chain is None:
            raise InvalidArgumentError(f"options {sorted(options)} are a chain's: pass chain=")
        self.compress = compress
        self.chain = None if chain is None else os.path.abspath(os.fspath(chain))
        if not {"target", "bits", "error_bound"} & options.keys():
            options = {**options, "target": RESUMABLE}
        self.options = options
        self.prune = prune
        self._ck: DeltaCheckpointer | None = None
        self._stored: int | None = None          # the step this object stored last
        self._dirs: set[str] = set()             # where its files are: what names steps

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options (got "
                            f"{storage_options!r}): the file is written whole, as it is")
        state = _plain(checkpoint)
        path, fs = str(path), get_filesystem(path)
        if self.chain is not None:
            if not _local(fs):
                raise InvalidArgumentError(f"{path}: a chain's checkpoint files are local paths")
            state = self._into_chain(state, path)
        if _local(fs):
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            save(state, path, compress=self.compress, metadata=metadata(state))
            return
        fs.makedirs(os.path.dirname(path), exist_ok=True)
        with fs.open(path, "wb") as f:
            save(state, f, compress=self.compress)

    def _into_chain(self, state: dict, path: str) -> dict:
        """``state`` without its large parts, stored as a chain step, and where they are."""
        step = state.get("global_step")
        if type(step) is not int or step < 0:
            raise InvalidArgumentError(f"{path}: a checkpoint without a global_step cannot be "
                                       "a chain step; save it without chain=")
        if step != self._stored:                  # not a second file of this run's step
            self._ck = _ready(self._ck, self.chain, self.options, step)
            self._ck.save(step, {k: state[k] for k in _IN_CHAIN if k in state})
            self._stored = step
        rest = {k: v for k, v in state.items() if k not in _IN_CHAIN}
        self._dirs.add(os.path.dirname(os.path.abspath(path)))
        where = os.path.relpath(self.chain, os.path.dirname(os.path.abspath(path)))
        return {**rest, POINTER: {"chain": where, "step": step}}

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict[str, Any]:
        """The checkpoint at ``path`` (an lcckpt file, or a Lightning ``torch.save``
        checkpoint read weights-only; ``weights_only=False`` is refused for those, as
        :func:`lcckpt.load` refuses it); a file of a chain with its step rebuilt, under
        DDP by rank 0 alone (:func:`_read_once`). ``FileNotFoundError`` if there is none."""
        path, fs = str(path), get_filesystem(path)
        if not fs.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        kw = {} if weights_only is None else {"weights_only": weights_only}
        if _local(fs):
            if self.chain is not None:
                self._dirs.add(os.path.dirname(os.path.abspath(path)))
            return _read_once(lambda where: _from_chain(
                load(path, map_location=where, **kw), path, where, self._writer_of),
                map_location, path)
        with fs.open(path, "rb") as f:
            return load(f, map_location=map_location, **kw)

    def _writer_of(self, directory: str) -> DeltaCheckpointer | None:
        """This object's checkpointer if ``directory`` is its chain and it has stored
        nothing yet: a run resuming from the chain, whose next save then goes on from the
        references this load decodes instead of replaying the chain again. Only in the
        process that saves (global rank 0): another rank's would hold them for nothing."""
        if self.chain is None or self._stored is not None or rank_zero_only.rank != 0 \
                or os.path.realpath(directory) != os.path.realpath(self.chain):
            return None
        if self._ck is None:
            self._ck = DeltaCheckpointer(self.chain, **self.options)
        return self._ck

    def remove_checkpoint(self, path) -> None:
        """Remove ``path``; with a chain (and ``prune``), then the steps no file names."""
        path, fs = str(path), get_filesystem(path)
        if fs.exists(path):
            fs.rm(path, recursive=True)
        if self.chain is not None and self.prune and _local(fs):
            self._dirs.add(os.path.dirname(os.path.abspath(path)))
            self._prune()

    def _prune(self) -> None:
        """Delete the chain's steps that no file in ``_dirs`` names (nor one named needs).
        Best effort: a failure warns, and the next removal tries again."""
        try:                                     # a file that might name a step: keep all
            named = _named_steps(self._dirs, self.chain)
            if self._ck is None:
                if not os.path.isdir(self.chain):
                    return
                self._ck = DeltaCheckpointer(self.chain, **self.options)
            self._ck.retain(named)
        except (LcckptError, OSError) as e:
            warn_user(f"the chain in {self.chain} is not pruned: {e}")

    def teardown(self) -> None:
        if self._ck is not None:
            self._ck.close()
            self._ck = None


def _ready(ck: DeltaCheckpointer | None, directory: str, options: dict,
           step: int) -> DeltaCheckpointer:
    """``ck`` (a checkpointer of ``directory`` opened with ``options`` if None), checked
    to take ``step`` next: a chain's steps only increase."""
    ck = ck if ck is not None else DeltaCheckpointer(directory, **options)
    steps = ck.steps()
    if steps and steps[-1] >= step:
        raise InvalidArgumentError(
            f"{directory} holds steps up to {steps[-1]}, not before step {step} that this run "
            "saves; a chain's steps only increase: resume from its newest step or give the "
            "resumed run another directory")
    return ck


_IN_CHAIN = ("state_dict", "optimizer_states")    # what a chain step holds


def _named_steps(directories, chain: str) -> set[int]:
    """The steps of the chain in ``chain`` that the lcckpt files in ``directories`` name,
    read from their headers (a small file written before the headers said it: loaded)."""
    real, named = os.path.realpath(chain), set()
    for d in directories:
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            continue
        for name in names:
            path = os.path.join(d, name)
            if name.endswith(TEMP_SUFFIX) or not os.path.isfile(path):
                continue
            try:
                with open(path, "rb") as f:
                    if f.read(len(MAGIC)) != MAGIC:
                        continue                  # not an lcckpt file: names no step
            except FileNotFoundError:             # removed since it was listed
                continue
            ref = pointer_of(path, load_old=True)
            if ref is not None and os.path.realpath(chain_of(path, ref)) == real:
                named.add(ref["step"])
    return named


def _from_chain(state, path: str, map_location, writer_of=lambda d: None) -> Any:
    """``state`` with the parts its chain step holds, where it names one. ``writer_of(d)``:
    a checkpointer that goes on writing the chain in ``d`` after this load, or None."""
    ref = state.get(POINTER) if isinstance(state, dict) else None
    if ref is None:
        return state
    writer = writer_of(chain_of(path, checked(ref, path)))
    return resolve(state, path, map_location, ck=writer)


def _read_once(read, map_location, path: str):
    """``read(map_location)``; under DDP, where every rank loads the file (a resume) and
    it names a chain step, rank 0 alone reads it, on the host where ``map_location`` is
    None, and sends it to the others (:func:`lcckpt.training.broadcast.restore`): the
    chain is replayed once, not once per rank."""
    from .ranks import all_meet, in_group
    if map_location not in (None, "cpu") or not in_group() or not _names_a_step(path) \
            or not all_meet("lightning-load", f"LcckptCheckpointIO.load_checkpoint({path!r}): "
                            "not every rank loaded it, so each replays the chain itself"):
        return read(map_location)
    import torch.distributed as dist
    from .broadcast import restore
    return restore(lambda: (read("cpu"), 0), dist.get_rank() == 0, {})[0]


def _names_a_step(path: str) -> bool:
    """Whether the file at ``path`` is an lcckpt file whose header names a chain step."""
    try:
        return pointer_of(path) is not None
    except LcckptError:
        return False      # Lightning's own (torch.save) file, or one the load refuses


def _plain(checkpoint: dict) -> dict:
    """``checkpoint`` with its hyperparameters as a plain ``dict`` (a shallow copy)."""
    state = dict(checkpoint)
    if isinstance(state.get(HPARAMS), AttributeDict):
        state[HPARAMS] = dict(state[HPARAMS])
    return state


def _local(fs) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def load_module(cls, path, map_location=None, strict: bool = True, **kwargs):
    """``cls.load_from_checkpoint(path, ...)`` for a checkpoint of this plugin, with or
    without a chain behind it (or any file :func:`lcckpt.load` reads): ``cls`` built from
    the saved ``hyper_parameters`` updated by ``kwargs``, its
    ``on_load_checkpoint(checkpoint)`` called, its ``state_dict`` loaded (``strict`` as in
    ``load_state_dict``); in eval mode, on the CPU unless ``map_location`` says otherwise. (Lightning's own also handles a datamodule's
    hyperparameters and a module saved under another name; this does not.)"""
    where = "cpu" if map_location is None else map_location
    checkpoint = _from_chain(load(path, map_location=where), os.fspath(path), where)
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise InvalidArgumentError(f"{path} holds no Lightning checkpoint (no 'state_dict')")
    model = cls(**{**dict(checkpoint.get(HPARAMS) or {}), **kwargs})
    model.on_load_checkpoint(checkpoint)
    model.load_state_dict(checkpoint["state_dict"], strict=strict)
    return model.eval()


class ChainCallback(Callback):
    """Keeps every checkpoint Lightning builds (each save of ``ModelCheckpoint`` or
    ``trainer.save_checkpoint``: model, optimizers, LR schedulers, loops, callbacks,
    hyperparameters) as the step ``trainer.global_step`` of a chain in ``directory``
    (``options``: :class:`~lcckpt.DeltaCheckpointer`'s keywords; ``keyframe_every=1``
    keeps every step exact). Beside Lightning's own files: ``ModelCheckpoint``'s
    ``save_top_k`` then bounds those, while the chain keeps every step. Two saves at one
    step (a top-k file and ``last.ckpt``) store it once. Only the global-zero process
    writes; a state split across ranks (FSDP, DeepSpeed) belongs in ``lcckpt.distributed``.
    ``last_save``: the checkpointer's record of the newest finished save.

    ``background=True``: the hook copies the checkpoint's tensors into host buffers
    (reused from one save to the next: memory of one state) and returns; a thread encodes
    and writes them while training goes on. The next save and the end of the run wait for
    it and raise its error if it failed. The files are those a save in the hook writes.
    Where the memory left could not hold the copy beside the save, the hook writes in the
    loop instead, with one warning (``stats["foreground"]`` counts those saves)."""

    def __init__(self, directory, *, background: bool = False, **options: Any) -> None:
        self.directory = os.fspath(directory)
        self.options = options
        self.last_save: dict | None = None
        self._ck: DeltaCheckpointer | None = None
        self._step: int | None = None
        self._buffers = HostBuffers() if background else None
        self.stats = {"foreground": 0}          # background saves the memory left could not hold
        self._writer = Writer("lcckpt-lightning-chain")

    def on_fit_start(self, trainer, pl_module) -> None:
        if trainer.is_global_zero and self._ck is None:
            check_free(self.directory)   # another run writing this chain: told now

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        step = trainer.global_step
        if not trainer.is_global_zero or step == self._step:
            return
        self.wait()
        self._ck = _ready(self._ck, self.directory, self.options, step)
        self._step = step
        state = _plain(checkpoint)
        if self._buffers is None or not self._buffers.fits(state, self.last_save is None,
                                                           self.stats):
            self._write(self._ck, step, state)
            return
        self._writer.start(self._write, self._ck, step, self._buffers.snapshot(state))

    def wait(self) -> None:
        """Wait for a background save in flight; raise its error if it failed."""
        self._writer.wait()

    def _write(self, ck: DeltaCheckpointer, step: int, state: dict) -> None:
        ck.save(step, state)           # the checkpointer handed over: the run's end may
        self.last_save = ck.last_save  # detach it from self while this thread writes

    def on_train_end(self, trainer, pl_module) -> None:
        self.wait()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        ck, self._ck = self._ck, None
        self._writer.finish(ck)


def export_checkpoint(directory, path, step: int | None = None, compress: bool = True) -> int:
    """Write ``step`` of the chain in ``directory`` (default: the newest) to ``path`` as a
    checkpoint file of :class:`LcckptCheckpointIO` (resume with
    ``Trainer(plugins=[LcckptCheckpointIO()]).fit(..., ckpt_path=path)``); returns the
    step. The restored state is within the chain's targets of the saved one (exact where
    the chain stores it exactly: ``keyframe_every=1``, or a keyframe)."""
    ck = DeltaCheckpointer(directory)
    try:
        steps = ck.steps()
        if not steps:
            raise InvalidArgumentError(f"{os.fspath(directory)} holds no chain steps to export")
        step = steps[-1] if step is None else step
        state = ck.load(step)
    finally:
        ck.close()
    LcckptCheckpointIO(compress).save_checkpoint(state, path)
    return step


def import_checkpoints(paths, chain, *, replace: bool = False, **options: Any) -> list[int]:
    """Store a run's checkpoint files (Lightning's ``torch.save`` files or this plugin's,
    in any order) as the steps of a chain in ``chain``, oldest first, as
    ``LcckptCheckpointIO(chain=chain)`` stores them; returns the steps. ``options``: the
    chain's :class:`~lcckpt.DeltaCheckpointer` keywords (first moments held to
    :data:`~lcckpt.chain.policy.RESUMABLE`'s 0.3 unless a target is given). Files of
    one step (``last.ckpt`` beside a top-k file) store it once, from the first.

    ``replace=True`` then rewrites each file, once its step is stored, as a file of that
    plugin: the small parts and its step (atomically; a file not yet rewritten is as it
    was), so the run resumes from any of them with ``LcckptCheckpointIO(chain=chain)``
    and its directory shrinks. Files that already point at ``chain`` are skipped, so an
    import cut short goes on when run again (a step the chain holds already is refused:
    the chain's steps only increase). Files are read without running code from them."""
    io = LcckptCheckpointIO(chain=chain, **options)
    found: dict[int, list[str]] = {}
    for path in map(os.fspath, paths):
        try:
            head = load(path, mmap=True)       # tensors mapped, not read: the step only
        except CorruptDataError:
            head = load(path)                  # torch.save's legacy format maps nothing
        step = head.get("global_step") if isinstance(head, dict) else None
        ref = head.get(POINTER) if isinstance(head, dict) else None
        del head
        if ref is not None and os.path.realpath(chain_of(path, checked(ref, path))) \
                == os.path.realpath(io.chain):
            continue                           # stored already (an import run again)
        if type(step) is not int or step < 0:
            raise InvalidArgumentError(f"{path} holds no global_step: not a Lightning "
                                       "checkpoint to store as a chain step")
        found.setdefault(step, []).append(path)
    try:
        for step in sorted(found):
            for path in found[step]:       # the first stores the step, the rest point at it
                state = io.load_checkpoint(path)
                pointer_file = io._into_chain(_plain(state), path)
                if replace:
                    save(pointer_file, path, compress=io.compress,
                         metadata=metadata(pointer_file))
    finally:
        io.teardown()
    return sorted(found)
