"""Checkpointing inside a PyTorch training loop: when, how fast, and how to resume.

:class:`CheckpointManager` is what a training loop adds in two lines::

    with lcckpt.CheckpointManager("ckpt/", model, opt, mtbf=6 * 3600) as mgr:
        start = mgr.restore() or 0
        for it in range(start, steps):
            loss = train_step()
            mgr.step(loss)

``step(loss)`` records the loss and the iteration time and returns at once, except at the
iterations the plan picks, where the loop stalls only for a snapshot: a copy of the state
into reusable host buffers. Delta coding and the durable, atomic write run in a background
thread, at most one at a time. The manager measures its own costs (snapshot, persist,
restore), uses Young/Daly until the loss curve can be fitted, and re-plans after every
checkpoint (receding horizon). A process killed at any moment leaves the newest complete
checkpoint restorable: files only ever appear whole.

One process writes a directory (under DDP, global rank 0: newest.py); one call of
:meth:`CheckpointManager.step` is one iteration.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Mapping

import torch

from . import replan as _replan
from .. import limits
from ..util import collector, owned
from .background import said_at_exit
from .capture import Capture, delegated
from .costs import Costs
from .explain import explain
from .options import check_arguments, default_bits
from .hostcopy import HostBuffers
from .overlap import LiveState, remove_newest, torn
from .losscurve import LossCurve
from .newest import generators_to_restore, is_writer, restore_state
from .signals import SigtermHook, signals_of
from ..chain.checkpointer import DEFAULT_KEYFRAME_EVERY, DeltaCheckpointer
from ..chain.lock import check_free
from ..errors import InvalidArgumentError
from ..util.caller import warn_user
from ..util.paths import local

__all__ = ["CheckpointManager", "default_bits"]

STATE_VERSION = 1


class CheckpointManager(owned.Owned):
    """Plans, takes and restores checkpoints of a training loop (see the module docstring).

    ``model`` and ``optimizer`` (may be None), and optionally ``scheduler`` (an LR
    scheduler), ``scaler`` (AMP grad scaler) and ``objects`` (name -> anything with
    ``state_dict()``/``load_state_dict()``, a ``torch.Generator`` or a
    ``numpy.random.Generator``) are saved and restored together with ``extra`` (a dict of
    your own storable values, e.g. epoch and data position, available as ``mgr.extra``)
    and the global random generators. The model is saved unwrapped (``torch.compile``, DDP).

    When: ``every=N`` checkpoints every N iterations; otherwise ``mtbf`` (seconds between
    failures of the whole job) is required and ``policy`` picks the plan: "young_daly"
    (time alone), "convergence" (weights lost work by how fast the loss is falling) or
    "exploratory" (also by how likely the job is still wanted). ``total_steps`` (the planned
    number of iterations) lets the plan skip checkpoints that cannot pay off before the end.
    ``downtime``: seconds from a failure to the restarted job running again, beyond the
    checkpoint load that the manager measures; ``restart_cost`` overrides that measurement.
    ``profile_at``: iteration of the first checkpoint, taken to measure the costs.

    ``backpressure``: what a due checkpoint does while the previous one is still being
    written: "defer" (default: it is taken at the first step after the write finishes, or
    by ``close()``; the loop never waits) or "wait" (the loop waits, then snapshots).
    ``background=False`` writes every checkpoint inside ``step()`` from the live state: no
    host copy of it (the process holds the state, the writer's reference and small
    buffers, where a background write also holds the copy), and the loop stalls for the
    whole write, which the plan counts as the checkpoint's cost. ``checkpoint(wait=True)``
    always writes that way, as does a background checkpoint whose host copy the memory
    left cannot hold (a warning, ``stats["foreground"]``). ``background="overlap"``
    writes in the background from the live parameters and optimizer state (no copy of
    them); the optimizer's next ``step()`` waits until the write has read them, and only
    it may change them in place meanwhile (:class:`~lcckpt.errors.StateChangedError`
    otherwise; docs/manager.md).
    ``sigterm=True`` installs a SIGTERM handler (main thread only; or the signals given,
    such as SLURM's ``signal.SIGUSR1``): at the next ``step()`` the manager writes a
    checkpoint of that iteration (a keyframe: the run resumes from it exactly), waits
    until it is durable, then calls the handler installed before, or exits with 128 +
    the signal (143: SystemExit). Under DDP, with one on every rank, the ranks agree on
    that iteration (an all-reduce about once a second) and exit together once it is
    durable; it holds every rank's generators, each rank resuming its own (docs/manager.md).

    ``writer``: whether this process writes the checkpoints; by default, under
    ``torch.distributed``, the process of global rank 0 (and a process without a process
    group). Under DDP, where every rank holds the same state, create the manager on every
    rank with one directory: rank 0 writes and every rank restores. A process that does
    not write takes no snapshot and never stalls; its ``restore()`` keeps no references,
    and keeps its own random generators unless the checkpoint is a SIGTERM's (which holds
    every rank's). Sharded state (FSDP) is :mod:`lcckpt.distributed`'s.

    ``bits``, ``keyframe_every``, ``keep_last`` and ``checkpointer_options`` configure the
    :class:`~lcckpt.DeltaCheckpointer` that writes the files; by default (``bits=None``)
    it keeps the chain's restored-state targets (docs/chain.md); ``bits=default_bits``
    gives LC-Checkpoint coding, 4 bits for optimizer state and 2 for the rest.
    """

    def __init__(self, directory: str | os.PathLike, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None = None, *,
                 policy: str = "convergence", mtbf: float | None = None,
                 every: int | None = None, total_steps: int | None = None,
                 scheduler: Any = None, scaler: Any = None,
                 objects: Mapping[str, Any] | None = None, extra: dict | None = None,
                 downtime: float = 0.0, restart_cost: float | None = None,
                 profile_at: int = 20, backpressure: str = "defer", background: bool | str = True,
                 sigterm: bool | int | tuple = False, writer: bool | None = None,
                 bits: int | Callable[[str], int] | None = None,
                 keyframe_every: int | None = DEFAULT_KEYFRAME_EVERY,
                 keep_last: int | None = 3, checkpointer_options: Mapping[str, Any] | None = None):
        check_arguments(model, policy, mtbf, every, total_steps, objects, extra, downtime,
                         restart_cost, profile_at, backpressure, background, optimizer)
        self._capture = Capture(model, optimizer, scheduler, scaler, objects, extra)
        self.directory = local(directory, "CheckpointManager")
        self.policy, self.mtbf, self.every = policy, mtbf, every
        self.total_steps, self.downtime, self.restart_cost = total_steps, float(downtime), restart_cost
        self.backpressure, self.background = backpressure, background
        self.writer = is_writer(writer)
        self._ck_args = dict(bits=bits, keyframe_every=keyframe_every, keep_last=keep_last,
                             **dict(checkpointer_options or {}))
        self._ck = DeltaCheckpointer(self.directory, **self._ck_args)   # validates them
        if self.writer:                 # a second job on this directory: told now, not later
            check_free(self.directory)
        self.iteration = 0              # completed iterations (calls of step)
        self.last_checkpoint: int | None = None   # newest snapshot taken
        self.durable_step: int | None = None      # newest step known complete on disk
        self._restored, self._deferring, self._closed = False, False, False
        self._curve, self._buffers, self._costs = LossCurve(), HostBuffers(), Costs(restart_cost)
        self._last_t: float | None = None
        self._next_at = every if every is not None else profile_at
        self._decision: _replan.Decision | None = None
        self._basis: _replan.Inputs | None = None     # what the current plan was based on
        self._gaps: list[int] = []                     # the plan's gaps still to follow
        self._job: threading.Thread | None = None
        self._error: BaseException | None = None     # the job's, raised at the next call
        self._persists = 0              # saves finished by this object
        self.stats = {"checkpoints": 0, "deferred": 0, "waited_s": 0.0, "stall_s": 0.0, "plans": 0,
                      "foreground": 0}
        self._sigterm = None if sigterm is False or sigterm is None else \
            SigtermHook(signals=signals_of(sigterm))    # in a group: agreed (signals.py)
        self._live = None if background != "overlap" or not self.writer else LiveState(
            model, [optimizer, *self._capture.objects.values()], self._before_optimizer_step)

    # ---------------------------------------------------------------- the loop

    def step(self, loss: Any = None) -> bool:
        """Record one finished iteration; returns True when it took a checkpoint.

        ``loss`` (optional) is a number or a scalar tensor on any device; tensors are not
        synchronized here (they reach the host in batches). Call it after the optimizer step,
        so that the state it may snapshot is the state after this iteration."""
        now = time.perf_counter()
        self._check_usable()
        if self._last_t is not None:
            self._record_interval(now - self._last_t)
        self.iteration += 1
        if loss is not None:
            self._curve.add(self.iteration, loss)
        took = False
        if self._sigterm is not None and self._sigterm.due(self.iteration, self._costs.iter_time):
            self._emergency()           # raises SystemExit unless an earlier handler says otherwise
            took = True
        elif self.iteration >= self._next_at:
            took = self._due()
        elif self.iteration % 128 == 0 and self._between_checkpoints_replan():
            self._start(self._plan_job, (self._inputs(),))
        self._last_t = time.perf_counter()
        return took

    def checkpoint(self, wait: bool = False, keyframe: bool = False) -> int:
        """Take a checkpoint of the current iteration now; returns its step.

        Waits for an earlier save still in flight first. ``wait=True`` also waits until this
        one is durable (e.g. at the end of training, or on SIGTERM); since the loop waits
        anyway, it is written from the live state in this thread, with no host copy.
        ``keyframe=True``: stored as a keyframe, which restores exactly (a step the run
        will resume from, as on SIGTERM: docs/manager.md); a delta of this iteration
        already written is written again as one."""
        self._check_usable()
        if type(keyframe) is not bool:
            raise InvalidArgumentError(f"keyframe must be True or False, got {keyframe!r}")
        if not self.writer:
            return self.iteration
        if keyframe and self.last_checkpoint == self.iteration:
            self.wait()
            if self._ck.info(self.iteration)["kind"] != "keyframe":
                self._ck, removed = remove_newest(self._ck, self.iteration, self._ck_args, None)
                self.last_checkpoint = self._ck.steps()[-1] if removed else self.iteration
                self.durable_step = self.last_checkpoint
        if self.last_checkpoint != self.iteration:
            self._join()
            t0 = time.perf_counter()
            self._snapshot_and_persist(False if wait else self.background, keyframe)
            if wait and self.background:        # not the plan's cost: the caller's choice
                self.stats["waited_s"] += time.perf_counter() - t0
            if self._last_t is not None:        # the write is not an iteration's time
                self._last_t = time.perf_counter()
        if wait:
            self.wait()
        return self.iteration

    def wait(self) -> None:
        """Block until no save is in flight; re-raises an error of the background save."""
        self._join()
        self._raise_error()

    def close(self) -> None:
        """Wait for the save in flight, take a checkpoint deferred behind it (it was due),
        release the directory's lock, uninstall the SIGTERM handler (a SIGTERM noted since
        the last ``step()`` is acted on first, as there, outside a process group). Idempotent."""
        if self._closed:
            return
        if self._sigterm is not None and self._sigterm.pending and not self._sigterm.group:
            self._emergency()           # else dropped: the job ran on, and nothing was saved
        self._closed = True
        if self._sigterm is not None:
            self._sigterm.uninstall()
        if self._live is not None:
            self._live.remove_hooks()
        try:
            self._join()
            if self._deferring and self._error is None:
                self._snapshot_and_persist(False)
        finally:
            self._ck.close()
        self._raise_error()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            return self.close()
        self._deferring = False         # the state may be what failed: not written now
        if self._sigterm is not None:
            self._sigterm.pending = False
        try:                            # do not hide the exception that is unwinding
            self.close()
        except Exception as e:
            warn_user(f"closing the checkpoint manager failed too: {e!r}")

    # ---------------------------------------------------------------- restore

    def restore(self, *, max_bytes=limits.DEFAULT, step: int | None = None,
                cooperative: bool | None = None) -> int | None:
        """Load the newest restorable checkpoint into every registered object; ``step``:
        that step instead, the later ones set aside as ``*.rolledback`` files (a rollback,
        after a loss spike say: the run continues its chain from that step).

        Returns its step (continue the loop from there), or None when the directory holds
        none. A newest file proven damaged (a checksum, its structure or its chain link
        fails) is passed over with a warning naming it and why, and renamed to
        ``*.damaged`` so that the chain continues from the step restored. Anything else (an
        unreadable file, a limit, a newer format, memory running out) is raised, nothing
        renamed. ``max_bytes`` as in :meth:`DeltaCheckpointer.load`. The model's host
        tensors are decoded into: a restore that raises may leave part of it there. Under DDP,
        called on every rank, the writer alone reads and sends it (``cooperative=False``: all read).
        """
        self._check_usable()
        self._join()
        self._raise_error()
        t0 = time.perf_counter()
        reader = DeltaCheckpointer(self.directory, **self._ck_args)   # the next writer
        found = restore_state(reader, self._capture.targets(), max_bytes, self.writer, step,
                              cooperative)
        if found is None:
            return None
        state, step = found
        where = f"checkpoint step {step} in {self.directory}"
        m = self._capture.apply(state, where, rng=generators_to_restore(self.writer))
        if "loss_curve" in m:           # and the costs its manager measured
            self._curve.load(m["loss_curve"], step)
        self._costs.load(m)
        self._ck = reader     # its first save goes on from the references the load kept
        self._costs.add("restore", time.perf_counter() - t0)
        self._restored = True
        self.iteration = self.last_checkpoint = self.durable_step = step
        self._last_t = None
        if self.every is not None:
            self._next_at = step + self.every
        else:
            self._next_at = step + max(1, int(state.get("manager", {}).get("gap") or 1))
            self._basis, self._gaps = None, []
            if self._costs.intervals:
                self._start(self._plan_job, (self._inputs(),))
        return step

    # ---------------------------------------------------------------- explain

    @property
    def costs(self) -> dict[str, float]:
        """Measured seconds: per iteration, per checkpoint, persist (background), restart.

        Medians of the recent measurements; NaN/0 before the first one. ``iteration`` is
        timed while no background job runs; ``checkpoint`` = ``snapshot`` (the stall) +
        ``interference`` (how much longer the iterations beside a background write took,
        summed over the write). ``restart`` is the given ``restart_cost``, else the
        measured restore time, else the persist time."""
        return self._costs.summary()

    @property
    def next_checkpoint(self) -> int | None:
        """The iteration at which the next checkpoint is due (None: no further one)."""
        return self._next_at if self._next_at < (1 << 62) else None

    @property
    def plan_summary(self) -> dict[str, Any] | None:
        """The latest plan: gap (iterations), policy used, Young/Daly gap, horizon; or None."""
        d = self._decision
        return None if d is None else {
            "gap": d.gap, "policy": d.policy_used, "young_daly_gap": d.young_daly_gap,
            "horizon": d.horizon, "block": d.block, "note": d.note}

    def explain(self) -> str:
        """Why the manager checkpoints at its current rate, in a few lines."""
        return explain(every=self.every, iteration=self.iteration,
                       last_checkpoint=self.last_checkpoint, durable_step=self.durable_step,
                       next_at=self._next_at, costs=self._costs, downtime=self.downtime,
                       mtbf=self.mtbf, decision=self._decision, stats=self.stats,
                       backpressure=self.backpressure)

    # ---------------------------------------------------------------- internals

    def _check_usable(self) -> None:
        if self._closed:
            raise InvalidArgumentError("this CheckpointManager is closed; create a new one")
        self._raise_error()

    def _raise_error(self) -> None:
        err, self._error = self._error, None
        if err is not None:
            raise err

    def _busy(self) -> bool:
        return self._job is not None and self._job.is_alive()

    def _join(self) -> None:
        if self._job is not None:
            t0 = time.perf_counter()
            self._job.join()
            self.stats["waited_s"] += time.perf_counter() - t0
            self._job = None
            self._costs.book()

    def _start(self, target: Callable, args: tuple) -> None:
        """Run ``target`` on the background thread (the previous job must be finished)."""
        self._costs.job_started()
        self._job = threading.Thread(target=self._guard, args=(target, args),
                                     name="lcckpt-manager", daemon=False)
        self._job.start()

    def _guard(self, target: Callable, args: tuple) -> None:
        try:
            target(*args)
        except BaseException as e:  # handed to the training thread at its next call
            self._error = e
            said_at_exit(e)

    def _due(self) -> bool:
        if not self.writer:                       # another process writes: nothing to take
            self._next_at = self.iteration + (self.every or self.iteration)
            return False
        if self._busy():
            if self.backpressure == "defer":
                if not self._deferring:
                    self.stats["deferred"] += 1
                    self._deferring = True
                return False
            self._join()
        self._raise_error()
        self._deferring = False
        self._snapshot_and_persist(self.background)
        return True

    def _snapshot_and_persist(self, background: bool, keyframe: bool = False) -> None:
        """Take the checkpoint of this iteration: ``background``, a snapshot into the host
        buffers written by the job thread; otherwise written now from the live state (the
        whole write is then the stall, and the plan's snapshot cost, when it is the
        manager's mode)."""
        t0 = time.perf_counter()
        if self.last_checkpoint is None and not self._restored:
            stored = self._ck.steps()
            if stored and stored[-1] >= self.iteration:
                raise InvalidArgumentError(
                    f"{self.directory} already holds checkpoints up to step {stored[-1]}: call "
                    "restore() to continue that run, or use another directory")
        self._curve.flush()
        tree = self._collect()
        if background is True and not self._buffers.fits(tree, not self._persists, self.stats):
            background = False          # a copy the memory left cannot hold: the kernel's kill
        live = background == "overlap"
        snap = (self._live.take(tree, self._buffers) if live else
                self._buffers.snapshot(tree) if background else tree)
        before, step = self.last_checkpoint, self.iteration
        self.last_checkpoint = step
        if self.every is not None:
            self._next_at = step + self.every
            args = (step, snap, None, False, keyframe)
        else:
            # follow the plan; the writer re-plans after the save if the inputs moved
            following = bool(self._gaps)
            self._next_at = step + (self._gaps.pop(0) if following else max(1, step))
            args = (step, snap, self._inputs(), following, keyframe)
        self.stats["checkpoints"] += 1
        if background:
            self._record_stall(time.perf_counter() - t0)
            self._start(self._persist_live if live else self._persist, args)
            return
        try:
            self._persist(*args)
        except BaseException:
            self.last_checkpoint = before           # nothing written: a retry may take it
            raise
        finally:
            if not self.background:
                self._record_stall(time.perf_counter() - t0)

    def _record_stall(self, seconds: float) -> None:
        self._costs.add("snapshot", seconds)
        self.stats["stall_s"] += seconds

    def _collect(self) -> dict:
        return self._capture.collect(self._manager_state())

    def _manager_state(self) -> dict:
        d = self._decision
        return {"version": STATE_VERSION, "iteration": self.iteration,
                "iter_time": self._costs.iter_time(),
                **{k: self._costs.cost(k) for k in ("snapshot", "interference", "persist")},
                "gap": d.gap if d is not None and d.gap else (self.every or 0),
                "loss_curve": self._curve.state()}

    def _persist(self, step: int, snap: dict, inputs: _replan.Inputs | None,
                 following: bool, keyframe: bool, released: Callable | None = None) -> None:
        t0 = time.perf_counter()
        with collector.paused(background=True):      # beside training: no GIL-held collections
            self._ck.save(step, snap, released=released, keyframe=keyframe)
        if self._persists == 1:         # the first save of a process compiles kernels: not typical
            self._costs.clear("persist")
        self._persists += 1
        self._costs.add("persist", time.perf_counter() - t0)
        self.durable_step = step
        if inputs is not None:
            inputs = replace(inputs, persist_time=self._costs.cost("persist"))
            if not following or _replan.moved(self._basis, inputs, self._decision):
                self._plan_job(inputs)

    def _persist_live(self, step: int, snap: dict, *args) -> None:
        """:meth:`_persist` from the live state; a torn step is removed (overlap.py)."""
        before = self.durable_step
        try:
            self._persist(step, snap, *args, released=self._live.release)
        finally:
            changed = self._live.finish()
        if changed:
            self._ck, removed = remove_newest(self._ck, step, self._ck_args, before)
            self.durable_step = before if removed else step
            raise torn(changed, step, removed)

    def _before_optimizer_step(self) -> None:
        """The optimizers' step pre-hook: wait until a write from the live state has read
        it (costs.py counts the wait as the write's interference with this iteration)."""
        if self._live.writing and self._job is not None:
            t0 = time.perf_counter()
            self._live.wait_released(self._job)
            self.stats["stall_s"] += time.perf_counter() - t0

    def _plan_job(self, inputs: _replan.Inputs) -> None:
        if not math.isfinite(inputs.iter_time):
            return                      # no iteration timed yet: keep the provisional gap
        d = _replan.decide(inputs)
        self._decision, self._basis, self._gaps = d, inputs, list(d.later)
        self.stats["plans"] += 1
        self._next_at = inputs.anchor + d.gap if d.gap is not None else 1 << 62

    def _between_checkpoints_replan(self) -> bool:
        """Re-plan between checkpoints only when the iteration time has moved by half."""
        if self.every is not None or self._basis is None or self._busy():
            return False
        return abs(self._costs.iter_time() / self._basis.iter_time - 1) > 0.5

    def _inputs(self) -> _replan.Inputs:
        return _replan.Inputs(
            anchor=self.last_checkpoint if self.last_checkpoint is not None else self.iteration,
            iter_time=self._costs.iter_time(), checkpoint_cost=self._costs.checkpoint_cost(),
            persist_time=self._costs.cost("persist"), restart_cost=self._costs.restart(),
            downtime=self.downtime, mtbf=float(self.mtbf), policy=self.policy,
            total_steps=self.total_steps, curve=self._curve.points())

    def _record_interval(self, dt: float) -> None:
        self._costs.record(dt, self._job is not None)
        if self._job is not None and not self._job.is_alive():   # its last iteration
            self._costs.book()
            self._job = None

    # ---------------------------------------------------------------- SIGTERM

    def _emergency(self) -> None:
        self._sigterm.pending = False
        self._capture.rank_generators = self._sigterm.generators(self.writer)   # under DDP
        self.checkpoint(wait=True, keyframe=True)     # the step the run resumes from: exact
        self._capture.rank_generators = None
        self._sigterm.pass_on()         # the previous handler, or SystemExit(128 + signal)


for _name in ("model", "optimizer", "scheduler", "scaler", "objects", "extra"):
    setattr(CheckpointManager, _name, delegated(_name))
