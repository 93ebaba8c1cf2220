"""Save and load compressed, balanced DCP checkpoints, with or without a process group.

``save``/``load``: one checkpoint directory, exact keyframes. :class:`DistributedCheckpointer`:
a chain of step directories (keyframes + deltas), the distributed counterpart of
``lcckpt.DeltaCheckpointer``. Every function runs DCP's SPMD protocol: call it on every rank
of the group with the same arguments.

The commit rule lives here: DCP returns from a save on a rank only after the coordinator
renamed ``.metadata`` into place, so references and the planner's history advance right
after that return, and a failed save (DCP's ``CheckpointException``, a ``BaseException``) aborts
both and removes this rank's files before it is re-raised as
:class:`~lcckpt.errors.DistributedCheckpointError`.

Not here: the codec (``storage.py``) and the partitioning (``partition.py``, ``planner.py``).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import warnings
from concurrent.futures import Future

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.metadata import Metadata

from .. import limits
from ..errors import DistributedCheckpointError, InvalidArgumentError, LcckptError
from .fill import missing_key_hint, settle
from .futures import Outcome, raise_unasked, unwrap
from .groups import Background, background_group
from .plain import reader_for
from .live import LiveStager, Versions
from .pool import Pool, PoolStager, live_stager
from .merge import merge_step, rebase_step
from .planner import BalancedSavePlanner, SafeLoadPlanner
from .retention import apply_retention
from .storage import CompressedReader, CompressedWriter
from .store import files_for
from ..util.caller import warn_user
from ..util.collector import paused

_STEP = re.compile(r"step_(\d{10})")


def _step_of(name: str) -> int | None:
    m = _STEP.fullmatch(name)
    return int(m.group(1)) if m else None


def _no_dist(process_group) -> bool:
    return process_group is None and not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _quiet(no_dist: bool):
    """No DCP warning that a process-group-less call means one process (that is intended),
    and no garbage collection meanwhile in the main thread (util/collector.py)."""
    with paused():
        if not no_dist:
            yield
            return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield


def _save(state, writer: CompressedWriter, planner: BalancedSavePlanner, process_group):
    no_dist = _no_dist(process_group)
    try:
        with _quiet(no_dist):
            md = dcp.save(state, storage_writer=writer, planner=planner,
                          process_group=process_group, no_dist=no_dist)
    except BaseException as e:       # CheckpointException is a BaseException
        writer.abort()
        err = unwrap(e, f"saving {writer.path}")
        if err is e:
            raise
        raise err from e
    writer.commit()
    planner.commit(md)
    return md


def _finish_async(fut: Future, writer, planner, out: Future):
    writer.live = None
    try:
        md = fut.result()
    except BaseException as e:
        writer.abort()
        err = unwrap(e, f"saving {writer.path}")
        out.set_exception(err)
    else:
        writer.commit()
        planner.commit(md)
        out.set_result(md)


def _reusable(stager: DefaultStager) -> bool:
    """False once the stager's inner copier has been closed (its copy table emptied)."""
    inner = getattr(stager, "_state_dict_stager", None)
    return bool(getattr(inner, "_deepcopy_dispatch", True))


def _async(state, writer, planner, process_group, process=False, stager=None, saver=None):
    kind = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
    fed = stager.feeder if isinstance(stager, PoolStager) else None
    try:
        if process and _no_dist(process_group):
            raise InvalidArgumentError(
                "process=True saves in DCP's background process, which joins this job's "
                "process group: call torch.distributed.init_process_group first, or use "
                "process=False")
        if process:
            _forget_dead_background_process()
        else:                            # the loop's collectives go on meanwhile: not beside them
            process_group = background_group(process_group, saver)
        with _quiet(_no_dist(process_group)):
            inner = dcp.async_save(state, storage_writer=writer, planner=planner,
                                   process_group=process_group, no_dist=_no_dist(process_group),
                                   async_checkpointer_type=kind, async_stager=stager)
    except BaseException as e:
        if fed is not None:
            fed.attach(writer, None)
        err = unwrap(e, f"saving {writer.path}")
        if err is e:
            raise
        raise err from e
    inner = getattr(inner, "upload_completion", inner)
    out = Outcome()
    if fed is not None:
        fed.attach(writer, out)
    inner.add_done_callback(lambda f: _finish_async(f, writer, planner, out))
    return out


def _forget_dead_background_process() -> bool:
    """DCP keeps one background process for process-mode async saves and, once it died,
    fails every later save on it; forget a dead one so that the next save starts another
    (every rank's died with it, or the new ones cannot form their group). Whether one was."""
    try:
        from torch.distributed.checkpoint import _async_process_executor as ape  # noqa: PLC0415
        proc = ape._CHECKPOINT_PROCESS
        if proc is not None and not proc._save_process.is_alive():
            ape._CHECKPOINT_PROCESS = None
            return True
    except (ImportError, AttributeError):        # another torch: its own behaviour
        pass
    return False


def save(state, directory, *, process_group=None, planner: BalancedSavePlanner | None = None,
         sync_files: bool = True, storage_options: dict | None = None) -> Metadata:
    """Save ``state`` (a state dict, tensors/DTensors/values) to ``directory``: every rank
    compresses and writes its balanced share, exactly (lossless). ``planner``: a
    :class:`BalancedSavePlanner` with other settings (granularity, overhead, split size).
    ``directory`` may be an fsspec URL (``s3://bucket/run``); ``storage_options`` go to
    its filesystem (credentials, ``endpoint_url``)."""
    return _save(state, CompressedWriter(directory, sync_files=sync_files,
                                         storage_options=storage_options),
                 planner or BalancedSavePlanner(), process_group)


def async_save(state, directory, *, process_group=None,
               planner: BalancedSavePlanner | None = None,
               storage_options: dict | None = None, process: bool = False,
               staging: str = "copy") -> Future:
    """:func:`save` in a background thread, or with ``process=True`` in DCP's background
    process (the training process's GIL stays free); the state is staged to CPU first, or
    with ``staging="live"`` read as it is: see :meth:`DistributedCheckpointer.async_save`.
    The future gives the metadata, or raises DistributedCheckpointError (StateChangedError
    for a live save whose state changed)."""
    writer = CompressedWriter(directory, storage_options=storage_options)
    stager = _live(writer, state, _check_staging(staging), 0, process, Pool())
    return _async(state, writer, planner or BalancedSavePlanner(), process_group,
                  process=process, stager=stager)


def _check_staging(staging) -> bool:
    """Whether ``staging`` asks for a live save."""
    if staging not in ("copy", "live"):
        raise InvalidArgumentError(f"staging must be 'copy' or 'live', got {staging!r}")
    return staging == "live"


def _live(writer: CompressedWriter, state, live: bool, step: int, process: bool, pool: Pool):
    """The stager of a live save (None otherwise), the writer set to check the state's
    version counters before the save commits; in a process, through ``pool`` (pool.py)."""
    if not live:
        return None
    writer.live = Versions(state, step)
    return live_stager(writer, pool) if process else LiveStager()


def load(state, directory, *, process_group=None, storage_options: dict | None = None,
         cooperative: bool = True, max_bytes=limits.DEFAULT) -> None:
    """Load ``directory`` into ``state`` in place (its tensors/DTensors give the layout: any
    world size and sharding); what it holds under a container ``state`` holds empty is
    added (a fresh optimizer's ``state``; ``{}``: the whole checkpoint, as new CPU tensors,
    at most ``max_bytes`` of them, as in :func:`lcckpt.load`). Values load without pickle
    (stored as lcckpt files), or with ``weights_only=True`` where only pickle stored them.
    ``cooperative``: see :class:`CompressedReader` (ranks share the reading and decoding)."""
    no_dist = _no_dist(process_group)
    reader = reader_for(directory, storage_options=storage_options,      # plain DCP's too
                        process_group=process_group, cooperative=cooperative)
    planner = SafeLoadPlanner(max_bytes=max_bytes)
    try:
        with _quiet(no_dist):
            dcp.load(state, storage_reader=reader, planner=planner,
                     process_group=process_group, no_dist=no_dist)
    except BaseException as e:
        err = missing_key_hint(unwrap(e, f"loading {directory}"), reader)
        if err is e:
            raise
        raise err from e
    settle(state, planner)


class DistributedCheckpointer:
    """A chain of distributed checkpoints: ``directory/step_NNNNNNNNNN/``, each a DCP
    checkpoint whose floating pieces are deltas against the same rank's previous save of
    that piece (exact keyframes first, every ``keyframe_every`` saves, and whenever a piece
    changed rank, shape or dtype). Delta steps need the earlier step directories of their
    chains. ``keep_last``: after each committed save, rank 0 deletes the step directories
    that none of the newest ``keep_last`` steps needs (:mod:`.retention`); None keeps all.
    Deltas are held to ``target`` (default :data:`lcckpt.DEFAULT_POLICY`, as
    ``DeltaCheckpointer``'s), or coded with LC-Checkpoint's ``bits`` (1..4) instead."""

    def __init__(self, directory, *, bits: int | None = None, target=None,
                 keyframe_every: int = 20,
                 process_group=None, planner: BalancedSavePlanner | None = None,
                 sync_files: bool = True, keep_last: int | None = None,
                 storage_options: dict | None = None):
        if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
            raise InvalidArgumentError(f"keep_last must be a positive int or None, got {keep_last!r}")
        self.keep_last = keep_last
        self.files = files_for(directory, storage_options)
        self.directory = str(self.files.init_path(os.fspath(directory)))
        self.storage_options = storage_options
        self.process_group = process_group
        self.writer = CompressedWriter(self.directory, chain=True, bits=bits, target=target,
                                       keyframe_every=keyframe_every, sync_files=sync_files,
                                       storage_options=storage_options)
        # a delta's encode time follows its raw bytes (~4x faster per byte than a lossless
        # keyframe), not its tiny encoded size: weigh raw bytes in, so that the relative
        # costs, and with them the plan and the references, stay put across keyframes and deltas
        self.planner = planner or BalancedSavePlanner(raw_weight=0.25)
        self._busy = threading.Lock()
        self._inflight: tuple[Future, int] | None = None   # with its step
        self._versions = None              # the live save in flight's version check
        self._stagers: dict[bool, DefaultStager] = {}
        self._pool = Pool()                 # live process-mode saves' buffers (pool.py)
        self._background = Background()     # its thread-mode saves' group (groups.py)
        self._reopen = True                 # the first save goes on from a chain on disk

    def _stager(self, process: bool) -> DefaultStager:
        """The host copy an async save works from, kept between saves: each save copies the
        state into the buffers of the previous one (one copy of this rank's state; pinned
        where CUDA is present; shared memory in process mode, so handing it to the
        background process copies nothing). Safe because a save waits for the one in flight.
        A stager that torch closed after a stage (2.11 does; its copy table emptied, the next
        save failed with ``KeyError: <class 'type'>``) is replaced."""
        old = self._stagers.get(process)
        if old is not None and not _reusable(old):
            old.close()
            del self._stagers[process]
        if process not in self._stagers:
            cuda = torch.cuda.is_available()
            self._stagers[process] = DefaultStager(StagingOptions(
                use_pinned_memory=cuda, use_shared_memory=process, use_async_staging=False,
                use_non_blocking_copy=cuda))
        return self._stagers[process]

    def close(self) -> None:
        """Wait for a save in flight, then free the async saves' staging buffers (and raise
        the save's failure if its future was not asked: :meth:`wait`)."""
        try:
            self.wait()
        finally:
            for stager in self._stagers.values():
                stager.close()
            self._stagers.clear()
            self._pool.close()

    def path(self, step: int) -> str:
        return self.files.join(self.directory, f"step_{int(step):010d}")

    def _prepare(self, step: int, keyframe: bool, process: bool = False) -> str:
        if type(step) is bool or not isinstance(step, int) or step < 0:
            raise InvalidArgumentError(f"step must be a non-negative int, got {step!r}")
        self.wait()
        path = self.path(step)
        if self.files.exists(self.files.join(path, ".metadata")):
            raise InvalidArgumentError(f"step {step} is already committed at {path}; later "
                                       "steps may depend on it, so it is not overwritten")
        self.writer.resume_from = None
        # a background process that died took its references along: a new one goes on too
        fresh = process and _forget_dead_background_process()
        if (self._reopen or fresh) and not keyframe:
            self._continue_chain(process)
        self._reopen = False
        self.writer.reset(path)
        self.writer.force_keyframe = keyframe
        return path

    def _continue_chain(self, process: bool) -> None:
        """A writer new to a directory whose chain is under way (a restarted job) goes on
        from its newest step: this rank's references replayed from the files it wrote
        (:meth:`CompressedWriter.resume`; in ``process`` mode by DCP's background process,
        where they live, at its save), and the planner's history, so that pieces stay on
        the ranks that hold their references. Not after a change of world size (pieces
        move: keyframes). A step that cannot be read is warned about: keyframes follow."""
        steps = self.steps() if self.writer.chain else []
        if not steps:
            return
        path = self.path(steps[-1])
        no_dist = _no_dist(self.process_group)
        rank = 0 if no_dist else dist.get_rank(self.process_group)
        world = 1 if no_dist else dist.get_world_size(self.process_group)
        try:
            md = CompressedReader(path, storage_options=self.storage_options).read_metadata()
        except (LcckptError, OSError) as e:
            warn_user(f"cannot go on from the chain in {path} ({e}); this save writes keyframes")
            return
        infos = (md.storage_data or {}).values()
        if any(info.rank >= world for info in infos):
            return
        if self.planner.history is None:
            self.planner.commit(md)
        if process:
            self.writer.resume_from = (md, path)
        else:
            self.writer.resume(md, path, rank)

    def save(self, step: int, state, *, keyframe: bool = False) -> Metadata:
        """Save ``state`` as ``step`` on every rank; returns DCP's metadata."""
        self._prepare(step, keyframe)
        md = _save(state, self.writer, self.planner, self.process_group)
        self._retain()
        return md

    def async_save(self, step: int, state, *, keyframe: bool = False,
                   process: bool = False, staging: str = "copy") -> Future:
        """:meth:`save` in a background thread, or with ``process=True`` in DCP's background
        process, where this writer's references then live (deltas as in a thread; if that
        process dies, the next save is a keyframe). The next save or load waits for it.

        ``staging="copy"``: the state is first copied into staging buffers reused from
        save to save (``close`` frees them). ``staging="live"``: no copy of the state; the
        save reads the tensors as they are (in a process, piece by piece through a few
        shared buffers: :mod:`lcckpt.distributed.pool`), so leave them alone until it has
        read them (:meth:`wait_before` an optimizer's step). A tensor changed in place
        meanwhile fails the save on every rank with StateChangedError, before it commits
        (:mod:`lcckpt.distributed.live`)."""
        live = _check_staging(staging)
        self._prepare(step, keyframe, process)
        stager = _live(self.writer, state, live, step, process, self._pool) or \
            self._stager(process)
        self._versions = self.writer.live
        try:
            fut = _async(state, self.writer, self.planner, self.process_group,
                         process=process, stager=stager, saver=self._background)
        except BaseException:
            self.writer.live = None          # not left to fail a later save's check
            raise
        if self.keep_last is not None:
            fut = self._then_retain(fut)
        self._inflight = fut, step
        return fut

    def _then_retain(self, inner: Future) -> Future:
        """A future that completes after the committed save's retention ran."""
        out = Outcome()

        def done(f: Future) -> None:       # f is done: its result or error is there
            if f.exception() is not None:
                return out.set_exception(f.exception())
            try:
                self._retain()
            finally:
                out.set_result(f.result())
        inner.add_done_callback(done)
        return out

    def _retain(self) -> None:
        """Retention after a committed save, by rank 0 alone (the others must not race it)."""
        if self.keep_last is None:
            return
        if not _no_dist(self.process_group) and dist.get_rank(self.process_group) != 0:
            return
        try:
            committed = self.steps()
            known = set(committed)
            stray = [s for s in self._step_dirs() if s not in known]
        except OSError as e:           # the step is committed: retried at the next save
            warn_user(f"retention (keep_last={self.keep_last}) skipped: cannot list "
                      f"{self.directory} ({e.strerror})")
            return
        apply_retention(self.files, self.directory, committed, self.keep_last, _step_of,
                        self.path, stray, self.storage_options)

    def _step_dirs(self) -> list[int]:
        if not self.files.isdir(self.directory):
            return []
        return sorted(s for s in map(_step_of, self.files.listdir(self.directory))
                      if s is not None)

    def wait_before(self, optimizer: torch.optim.Optimizer):
        """Make every ``optimizer.step()`` first wait for the save in flight (what a live
        save needs): a live save only until this rank has written its share, not for its
        sync and commit. Returns the hook's handle (``.remove()`` undoes it)."""
        return optimizer.register_step_pre_hook(lambda *_: self._wait_read())

    def _wait_read(self) -> None:       # a failure is left for the next save to raise
        fut = self._inflight[0] if self._inflight is not None else None
        if fut is not None and self._versions is not None:
            self._versions.wait(done=fut.done)
        elif fut is not None:
            Future.exception(fut)                      # waits; does not count as asking

    def wait(self) -> None:
        """Wait for an in-flight :meth:`async_save`; raise its failure if its future was
        not asked (:mod:`.futures`: a dropped future lost it)."""
        if self._inflight is not None:
            (fut, step), self._inflight = self._inflight, None
            raise_unasked(fut, step)

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        if not self.files.isdir(self.directory):
            return []
        out = []
        for name in self.files.listdir(self.directory):
            m = _STEP.fullmatch(name)
            if m and self.files.exists(self.files.join(self.directory, name, ".metadata")):
                out.append(int(m.group(1)))
        return sorted(out)

    def _committed(self, step: int | None) -> int:
        """``step``, or the newest committed step where None, once saves in flight end."""
        self.wait()
        steps = self.steps()
        if not steps:
            raise InvalidArgumentError(f"no committed checkpoint in {self.directory}")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise InvalidArgumentError(f"step {step} is not committed in {self.directory}; "
                                       f"committed: {steps}")
        return step

    def load(self, state, step: int | None = None) -> int:
        """Load ``step`` (default: the latest committed) into ``state``; returns the step."""
        step = self._committed(step)
        load(state, self.path(step), process_group=self.process_group,
             storage_options=self.storage_options)
        return step

    def merge(self, step: int | None = None) -> int:
        """Rewrite a committed step's (default: the newest) delta items as keyframes of
        exactly what they restore (lcckpt/distributed/merge.py): loads of it and of later
        deltas give the same tensors, and need no earlier step, so that retention
        (``keep_last``) may delete those; the later steps' chains are made to start at
        the new keyframes. Rank 0 writes; call it on every rank. Returns the step."""
        step = self._committed(step)
        no_dist = _no_dist(self.process_group)
        rank = 0 if no_dist else dist.get_rank(self.process_group)
        outcome: list = [None]
        error: BaseException | None = None
        if rank == 0:
            try:
                outcome[0] = merge_step(self.files, self.path(step), self.storage_options)
                for later in (s for s in self.steps() if s > step):
                    rebase_step(self.files, self.path(later), outcome[0],
                                self.storage_options)
            except Exception as e:       # every rank raises, this one its own error
                error, outcome[0] = e, f"{type(e).__name__}: {e}"
        if not no_dist:
            src = 0 if self.process_group is None else dist.get_global_rank(self.process_group, 0)
            dist.broadcast_object_list(outcome, src=src, group=self.process_group)
        if error is not None:
            raise error
        if isinstance(outcome[0], str):
            raise DistributedCheckpointError(f"merging step {step} failed on rank 0: "
                                             f"{outcome[0]}", {})
        moved = outcome[0]           # this rank's merged blobs: its file names start __rank_
        self.writer.rebase(moved, sum(self.files.basename(p).startswith(f"__{rank}_")
                                      for p, _, _ in moved))
        self._reopen = True          # references the rebase dropped: from the merged files
        self._retain()
        return step

    def references(self):
        """This rank's committed references ({piece: tensor}); what loading its pieces gives."""
        return self.writer.references()
