"""Live saves in DCP's background process, through a bounded staging pool of host
buffers (``async_save(..., process=True, staging="live")``).

A process-mode save with ``staging="copy"`` first copies this rank's whole state into
shared host memory, since the background process cannot read the trainer's tensors: the
copy is as large as the state. Here that process gets a state whose tensors are meta
placeholders (their shapes and dtypes, no data), so DCP plans as usual, and reads the data
piece by piece through a few shared buffers (``SLOTS``, each as large as the largest piece
with its steering moment, and together never larger than what they feed; pinned where
CUDA is present):

- the background writer sends this rank the pieces it will encode, in order;
- a thread here (:class:`Feeder`) copies each into a free buffer (a device tensor
  straight from the device) and says which;
- the writer encodes it there and hands the buffer back, so the copy of the next pieces
  overlaps the encoding of this one.

Once every piece is copied the state is read no more: the version counters are compared
(a change fails the save on every rank with :class:`~lcckpt.errors.StateChangedError`,
before it commits) and ``wait_before`` lets the optimizer step, while the save encodes
its last pieces, syncs and commits.
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from ..chain.moments import first_moments
from ..errors import DistributedCheckpointError
from .futures import shm_hint
from .live import LiveStager, Versions, changed_error
from .partition import Piece
from .planner import identity
from .targets import direction_view

SLOTS = 3           # buffers: one being encoded, the next ones being filled
_ALIGN = 64


def _aligned(t: torch.Tensor | None) -> int:
    n = 0 if t is None else t.numel() * t.element_size()
    return -(-n // _ALIGN) * _ALIGN


def _local(t: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """A tensor's local data and its offsets in the whole (a DTensor's shard)."""
    if not hasattr(t, "_local_tensor"):
        return t, (0,) * t.dim()
    from torch.distributed.tensor import _utils  # noqa: PLC0415
    _, offsets = _utils.compute_local_shape_and_global_offset(t.shape, t.device_mesh,
                                                              t.placements)
    return t._local_tensor, tuple(offsets)


def placeholders(obj: Any, _memo: dict | None = None) -> Any:
    """``obj`` with each tensor's data replaced by a meta tensor of its shape and dtype (a
    DTensor keeps its mesh and placements); everything else as it is. Names that share a
    tensor (tied weights) share its placeholder, so the planner still sees them tied."""
    memo = {} if _memo is None else _memo
    if isinstance(obj, torch.Tensor):
        same = identity(obj)
        if same in memo:
            return memo[same]
        if hasattr(obj, "_local_tensor"):
            from torch.distributed.tensor import DTensor  # noqa: PLC0415
            local = torch.empty_like(obj._local_tensor, device="meta")
            out = DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False,
                                     shape=obj.shape, stride=obj.stride())
        else:
            out = torch.empty_like(obj, device="meta")
        if same is not None:
            memo[same] = out
        return out
    if isinstance(obj, dict):
        return {k: placeholders(v, memo) for k, v in obj.items()}
    if isinstance(obj, list):
        return [placeholders(v, memo) for v in obj]
    if isinstance(obj, tuple):
        return tuple(placeholders(v, memo) for v in obj)
    return obj


class Pool:
    """The staging pool: the shared (and, with CUDA, pinned) buffer a rank's live
    process-mode saves reuse; it grows to the largest request, :meth:`close` frees it."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def get(self, nbytes: int) -> torch.Tensor:
        if self.buffer is None or self.buffer.numel() < nbytes:
            self.close()
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8).share_memory_()
            if torch.cuda.is_available():       # unpinned when the buffer is freed
                import torch.cuda._pin_memory_utils as pin  # noqa: PLC0415
                pin.pin_memory(buf.data_ptr(), buf.numel())
                weakref.finalize(buf, pin.unpin_memory, buf.data_ptr())
            self.buffer = buf
        return self.buffer

    def close(self) -> None:
        self.buffer = None


class PoolStager(LiveStager):
    """A DCP ``AsyncStager`` that hands the background process placeholders and keeps the
    state (after DCP turned its Stateful objects into state dicts) for the feeder."""

    def __init__(self, feeder: "Feeder"):
        self.feeder = feeder

    def stage(self, state_dict):
        self.feeder.state = state_dict
        return placeholders(state_dict)


class Feeder:
    """This rank's side of one live process-mode save (see the module docstring)."""

    def __init__(self, pool: Pool, versions: Versions):
        self.pool, self.versions = pool, versions
        self.state: Any = None
        self.over = threading.Event()     # the save ended: stop waiting for its requests
        self.conn, remote = mp.get_context("spawn").Pipe()
        self.client = FeedClient(remote)
        self.thread = threading.Thread(target=self._serve, name="lcckpt-feeder", daemon=True)
        self.thread.start()

    def attach(self, writer, fut) -> None:
        """Serve ``writer``'s save, whose future is ``fut``, until it ends."""
        def end(_f=None) -> None:
            self.over.set()
            if writer.feed is self.client:      # not a next save's, started meanwhile
                writer.feed = None
            self.thread.join(timeout=60)
            self.conn.close()
            self.client.conn.close()
        if fut is None:
            end()
        else:
            fut.add_done_callback(end)

    def _recv(self):
        while not self.conn.poll(0.1):
            if self.over.is_set():       # the save ended (failed) without asking more
                raise EOFError
        return self.conn.recv()

    def _serve(self) -> None:
        try:
            kind, items = self._recv()
            if kind != "plan":
                raise DistributedCheckpointError(f"live save: expected its plan, got {kind!r}")
            flat, _ = flatten_state_dict(self.state)
            dirs = first_moments(self.state, dotted=True) if any(it[4] for it in items) else {}
            sources = [self._source(flat, dirs, *it) for it in items]
            sizes = [_aligned(d) + _aligned(m) for d, m in sources]
            slot = max(sizes + [_ALIGN])        # empty pieces too take a (small) slot
            # never more than what is fed: one large piece gets one slot, not a copy of three
            slots = max(1, min(SLOTS, sum(sizes) // slot))
            buf = self.pool.get(slots * slot)
            self.conn.send(("pool", buf, slot))
            free = list(range(slots))
            for i, (data, direction) in enumerate(sources):
                while not free:
                    free.append(self._recv()[1])
                s = free.pop(0)
                metas = [_put(buf, s * slot, data)]
                if direction is not None:
                    metas.append(_put(buf, s * slot + _aligned(data), direction))
                self.conn.send(("item", i, s, metas))
            changed = self.versions.release()        # the state is read no more
            self.conn.send(("done", changed))
        except EOFError:
            pass
        except BaseException as e:     # noqa: BLE001 - told to the writer, which raises it
            try:
                self.conn.send(("error", f"{type(e).__name__}: {e}"))
            except OSError:
                pass
        finally:
            self.versions.release()    # an optimizer waiting in wait_before goes on

    @staticmethod
    def _source(flat, dirs, fqn, offsets, sizes, piece, want_dir):
        """The piece's data (a view of the live tensor) and its steering moment's."""
        local, base = _local(flat[fqn])
        data = local
        for d, (o, n) in enumerate(zip(offsets, sizes)):
            data = data.narrow(d, int(o) - base[d], int(n))
        direction = direction_view(dirs, Piece(*piece), data) if want_dir else None
        return data.detach(), None if direction is None else direction.detach()


def _put(buf: torch.Tensor, offset: int, t: torch.Tensor) -> tuple:
    n = t.numel() * t.element_size()
    buf[offset:offset + n].view(t.dtype).view(t.shape).copy_(t)
    return offset, str(t.dtype).replace("torch.", ""), tuple(t.shape)


def live_stager(writer, pool: Pool) -> PoolStager:
    """The stager of a live process-mode save by ``writer`` (whose ``live`` holds the
    state's version counters); :meth:`Feeder.attach` its future once the save started."""
    feeder = Feeder(pool, writer.live)
    writer.feed = feeder.client
    return PoolStager(feeder)


class FeedClient:
    """The background writer's side: :meth:`start` with the pieces it will encode, then
    :meth:`next` for each, then :meth:`finish`. Pickled with the writer into DCP's
    background process (the pipe's end goes with it; nothing else is set before then)."""

    def __init__(self, conn):
        self.conn = conn
        self._buf: torch.Tensor | None = None
        self._slot, self._held = 0, None

    def start(self, items: list[tuple]) -> None:
        """``items``: ``(fqn, offsets, sizes, (piece key, start, stop), steered)`` each."""
        self.conn.send(("plan", items))
        _, self._buf, self._slot = self._expect("pool")

    def next(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The next piece's data and its steering moment (None if it has none), views of a
        buffer that stays the piece's until the next call."""
        if self._held is not None:
            self.conn.send(("free", self._held))
        _, _, slot, metas = self._expect("item")
        self._held = slot
        views = [self._view(*m) for m in metas]
        return views[0], views[1] if len(views) > 1 else None

    def _view(self, offset: int, dtype: str, shape: tuple) -> torch.Tensor:
        dt = getattr(torch, dtype, None)
        dt = dt if isinstance(dt, torch.dtype) else None
        nbytes = math.prod(int(s) for s in shape) * (0 if dt is None else dt.itemsize)
        if dt is None or not 0 <= offset <= offset + nbytes <= self._buf.numel():
            raise DistributedCheckpointError(f"the training process sent a piece this save "
                                             f"cannot read ({dtype}, {shape} at {offset})")
        return self._buf[offset:offset + nbytes].view(dt).view(shape)

    def finish(self, step_of: str) -> None:
        """Wait until the training process has read the state; raise StateChangedError if
        a tensor changed in place meanwhile."""
        if self._held is not None:
            self.conn.send(("free", self._held))
            self._held = None
        changed = self._expect("done")[1]
        self._buf = None
        if changed:
            raise changed_error(changed, step_of)

    def _expect(self, kind: str):
        try:
            msg = self.conn.recv()
        except EOFError as e:
            raise DistributedCheckpointError("the training process stopped answering a live "
                                             "save's reads") from e
        if msg[0] == "error":
            hint = shm_hint(str(msg[1]))
            raise DistributedCheckpointError(f"reading the live state failed: {msg[1]}"
                                             + (f" ({hint})" if hint else ""))
        if msg[0] != kind:
            raise DistributedCheckpointError(f"live save: expected {kind!r}, got {msg[0]!r}")
        return msg
