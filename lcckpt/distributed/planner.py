"""DCP planners: a save planner that balances replicated state across ranks, a safe load planner.

:class:`BalancedSavePlanner` replaces DCP's deduplication of replicated items (first come, to
the least-loaded rank, never split) with :func:`~lcckpt.distributed.partition.partition`:
large replicated tensors become row-range chunks (ordinary DCP chunks, so loading and
resharding work unchanged) and every piece goes to a rank by cost. It keeps the last committed
save's per-piece encoded sizes and owners (:meth:`BalancedSavePlanner.commit`) to estimate
costs and to keep pieces where their delta references live. A tensor under two names (tied
input and output embeddings) is planned once: its other names follow its pieces to the same
ranks, where the writer stores each piece once (``storage.py``).

Non-tensor values are stored as lcckpt files (:class:`TreeBytes`: no pickle, and numpy
arrays, sets and the rest of what ``lcckpt.save`` stores load back), where DCP stores
``torch.save`` bytes; a value only pickle stores (a class registered with
``torch.serialization.add_safe_globals``) is stored as DCP stores it.
:class:`SafeLoadPlanner` reads those with ``torch.load(weights_only=True)``, where DCP's
default planner unpickles them with ``weights_only=False``.

Neither encodes nor writes anything: that is the storage layer's job (``storage.py``).
"""

from __future__ import annotations

import dataclasses
import io
import math
import pickle
from collections import ChainMap

import torch
from torch.distributed.checkpoint.default_planner import (DefaultLoadPlanner,
                                                          DefaultSavePlanner,
                                                          create_default_global_save_plan)
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (ReadItem, SavePlan, TensorWriteData,
                                                  WriteItem, WriteItemType)

from .. import limits
from ..errors import InvalidArgumentError, LcckptError, UnsafeObjectError, UnsupportedDtypeError
from ..format import serialization
from ..format.container import at_path
from .fill import fill_empty
from .partition import ITEM_OVERHEAD, MIN_SPLIT_BYTES, Assignment, History, Item, Piece, partition


class TreeBytes(io.BytesIO):
    """A non-tensor value's bytes as an lcckpt file (``lcckpt.save``), not a pickle."""


def tree_bytes(obj) -> TreeBytes | None:
    """``obj`` as an lcckpt file, or None if only pickle stores it."""
    buf = TreeBytes()
    try:
        serialization.save(obj, buf)
    except (UnsafeObjectError, UnsupportedDtypeError):
        return None
    buf.seek(0)
    return buf


def item_key(item: WriteItem) -> str:
    """A stable name for what a local plan asked to write: the fqn, plus the shard's offset
    for sharded tensors (DTensor shards of one fqn differ only by offset)."""
    if item.type == WriteItemType.SHARD:
        return f"{item.index.fqn}@{tuple(item.index.offset or ())}"
    return item.index.fqn


def identity(t) -> tuple | None:
    """What makes two tensors of a state one: the same memory seen the same way (tied
    weights under two names; a DTensor by its local shard); None for what is not a tensor
    with elements. A meta tensor (a live process-mode save's placeholder, which holds no
    memory) is one with itself only: tied names share one placeholder (pool.py)."""
    t = getattr(t, "_local_tensor", t)
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return None
    if t.device.type == "meta":
        return ("meta", id(t))
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            tuple(t.stride()), t.dtype)


def whole_piece(item: WriteItem) -> Piece:
    rows = _rows(item)
    return Piece(item_key(item), 0, rows)


def chunk_nbytes(item: WriteItem) -> int:
    """Raw bytes of the chunk an item writes (``WriteItem.tensor_storage_size`` counts the
    whole tensor, also for a shard)."""
    td = item.tensor_data
    if td is None:
        return 0
    itemsize = torch.empty((), dtype=td.properties.dtype).element_size()
    return math.prod(td.chunk.sizes) * itemsize


def piece_for(planner, item: WriteItem) -> Piece:
    """The partition piece ``item`` stands for under any DCP save planner (whole where the
    planner is not ours)."""
    return planner.piece_of(item) if hasattr(planner, "piece_of") else whole_piece(item)


def _rows(item: WriteItem) -> int:
    td = item.tensor_data
    if td is None or len(td.chunk.sizes) == 0:
        return 0
    return int(td.chunk.sizes[0])


def _row_piece_item(item: WriteItem, piece: Piece) -> WriteItem:
    """The write item for rows ``[piece.start, piece.stop)`` of a plain tensor's item."""
    td = item.tensor_data
    offsets = torch.Size([piece.start] + [0] * (len(td.size) - 1))
    sizes = torch.Size([piece.stop - piece.start] + list(td.size[1:]))
    return WriteItem(index=MetadataIndex(item.index.fqn, offsets), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, sizes),
                                                 properties=td.properties, size=td.size))


class BalancedSavePlanner(DefaultSavePlanner):
    """DCP save planner that splits and balances replicated state by cost (see partition.py).

    ``granularity`` g: a replicated tensor costing more than W/(P*g) is cut into row ranges,
    so max/avg load stays under 1 + (1 - 1/P)/g. ``stickiness``: keep the last assignment
    while it is within this fraction of a fresh one. Reuse one planner across saves (and call
    :meth:`commit` after each successful save; the ``lcckpt.distributed`` save functions do)
    so costs come from measured encoded sizes and pieces stay on their ranks.
    """

    def __init__(self, *, granularity: int = 4, stickiness: float = 0.05,
                 item_overhead: float = ITEM_OVERHEAD, min_split_bytes: float = MIN_SPLIT_BYTES,
                 raw_weight: float = 0.0, flatten_state_dict: bool = True,
                 flatten_sharded_tensors: bool = True):
        super().__init__(flatten_state_dict=flatten_state_dict,
                         flatten_sharded_tensors=flatten_sharded_tensors)
        if granularity < 1:
            raise InvalidArgumentError(f"granularity must be >= 1, got {granularity}")
        self.granularity, self.stickiness = granularity, stickiness
        self.item_overhead, self.min_split_bytes = item_overhead, min_split_bytes
        self.raw_weight = raw_weight
        self.history: History | None = None
        self.assignment: Assignment | None = None
        self._local: dict = {}
        self._local_items: list[WriteItem] | None = None
        self._aliases: dict[str, str] = {}     # a tied tensor's other name -> its first

    def __getstate__(self):
        # process-based async_save pickles the planner on every save: the history (a few
        # numbers per piece) goes along, so that pieces keep their ranks and their deltas
        state = dict(self.__dict__)
        state["state_dict"] = None
        return state

    # -- coordinator: the global plan ------------------------------------------------------
    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        holders: dict[str, list[int]] = {}
        first: dict[str, WriteItem] = {}
        for rank, plan in enumerate(all_plans):
            for wi in plan.items:
                k = item_key(wi)
                holders.setdefault(k, []).append(rank)
                first.setdefault(k, wi)
        # replicated state is alike on every rank: the coordinator's own ties stand for all
        tied = {a: p for a, p in self._aliases.items()
                if a in first and p in first and holders[a] == holders[p]}
        items = []
        for k, wi in first.items():
            if k in tied:
                continue
            ranks = tuple(sorted(set(holders[k])))
            if wi.type == WriteItemType.BYTE_IO:
                ranks = (0,) if 0 in ranks else ranks[:1]     # non-tensors: the coordinator
            nbytes = chunk_nbytes(wi)
            items.append(Item(k, nbytes, ranks, _rows(wi),
                              splittable=wi.type == WriteItemType.TENSOR and len(ranks) > 1))
        asg = partition(items, len(all_plans), history=self.history,
                        granularity=self.granularity, item_overhead=self.item_overhead,
                        min_split_bytes=self.min_split_bytes, raw_weight=self.raw_weight,
                        stickiness=self.stickiness)
        self.assignment = asg
        per_rank: list[list[WriteItem]] = [[] for _ in all_plans]
        for piece, rank in sorted(asg.owner.items(), key=lambda kv: kv[0]):
            wi = first[piece.key]
            whole = piece.start == 0 and piece.stop == _rows(wi)
            per_rank[rank].append(wi if whole else _row_piece_item(wi, piece))
            for alias in (a for a, p in tied.items() if p == piece.key):   # same rank, rows
                awi = first[alias]
                per_rank[rank].append(awi if whole else _row_piece_item(awi, piece))
        plans = [dataclasses.replace(p, items=items_r) for p, items_r in zip(all_plans, per_rank)]
        global_plan, metadata = create_default_global_save_plan(plans)
        if self.flatten_state_dict:
            merged = dict(ChainMap(*[p.planner_data for p in global_plan]))
            metadata = dataclasses.replace(metadata, planner_data=merged)
        self.global_plan, self.metadata = global_plan, metadata
        return global_plan, metadata

    # -- every rank: what to write ---------------------------------------------------------
    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = new_plan
        originals = {wi.index: wi for wi in (self._local_items or [])}
        self._local = {}
        for wi in new_plan.items:
            orig = originals.get(wi.index)
            if orig is not None and orig.type == wi.type:
                self._local[wi.index] = (whole_piece(wi), False)
            else:                                                 # a row range we cut
                start = int(wi.tensor_data.chunk.offsets[0])
                stop = start + int(wi.tensor_data.chunk.sizes[0])
                self._local[wi.index] = (Piece(wi.index.fqn, start, stop), True)
        return new_plan

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        self._local_items = list(plan.items)
        self._aliases, seen = {}, {}
        for wi in plan.items:
            if wi.type != WriteItemType.BYTE_IO:
                same = identity(self.state_dict.get(wi.index.fqn))
                if same in seen:
                    self._aliases[wi.index.fqn] = seen[same]
                elif same is not None:
                    seen[same] = wi.index.fqn
        return plan

    def tied_to(self, item: WriteItem) -> Piece | None:
        """The piece that ``item`` (of this rank's final plan) is another name of: the same
        rows of the same tensor in the state this rank saves (tied weights); else None."""
        first = self._aliases.get(item.index.fqn)
        if first is None:
            return None
        p = self.piece_of(item)
        return Piece(first + p.key[len(item.index.fqn):], p.start, p.stop)

    def piece_of(self, item: WriteItem) -> Piece:
        """The partition piece a write item of this rank's final plan stands for."""
        got = self._local.get(item.index)
        return got[0] if got is not None else whole_piece(item)

    def transform_object(self, write_item: WriteItem, object):
        if write_item.type == WriteItemType.BYTE_IO:
            got = tree_bytes(object)
            if got is not None:
                return got
        return super().transform_object(write_item, object)

    def lookup_object(self, index: MetadataIndex):
        got = self._local.get(index)
        if got is not None and got[1]:
            piece = got[0]
            whole = self.state_dict[index.fqn]
            return whole.narrow(0, piece.start, piece.stop - piece.start)
        return super().lookup_object(index)

    # -- after a save committed on every rank ----------------------------------------------
    def commit(self, metadata: Metadata) -> None:
        """Remember the committed save's encoded sizes and owners for the next plan."""
        hist = History()
        for info in (metadata.storage_data or {}).values():
            piece = getattr(info, "piece", None)
            if piece is None or getattr(info, "alias", False):
                continue
            p = Piece(*piece)
            hist.encoded[p] = int(info.length)
            hist.owner[p] = int(info.rank)
            hist.raw[p] = int(info.raw_nbytes)
        self.history = hist if hist.owner else None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, except that non-tensor values load without pickle (lcckpt files:
    :class:`TreeBytes`) or are unpickled with ``weights_only=True`` (plain containers,
    numbers, strings, tensors): a checkpoint cannot run code on load. What the checkpoint
    holds under an empty container of the state (a fresh optimizer's) is added to it
    (``filled``: their fqns)."""

    filled: tuple[str, ...] = ()

    def __init__(self, *args, max_bytes=limits.DEFAULT, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_bytes = max_bytes

    def set_up_planner(self, state_dict, metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        """DCP's, after adding the stored entries under the state's empty containers (a
        fresh optimizer's ``state``, at most ``max_bytes`` of them: fill.py)."""
        if metadata is not None and self.flatten_state_dict:
            self.filled = tuple(fill_empty(state_dict, metadata, self.max_bytes))
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        if isinstance(value, TreeBytes):
            try:
                obj = serialization.load(value)
            except LcckptError as e:             # named by the value, not the file's "obj"
                raise at_path(e, f"value {read_item.dest_index.fqn!r}") from None
        else:
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                raise UnsafeObjectError(
                    f"value {read_item.dest_index.fqn!r} needs unrestricted unpickling ({e}); "
                    "store only tensors, numbers, strings and plain containers") from None
        if self.flatten_state_dict:
            _set_path(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _set_path(root, path, value) -> None:
    """``root[path[0]][path[1]]... = value``, creating dicts (str keys) and lists (int keys)."""
    cur = root
    for key, nxt in zip(path, path[1:]):
        fresh = [] if isinstance(nxt, int) else {}
        if isinstance(cur, list):
            cur.extend([None] * (key + 1 - len(cur)))
            if cur[key] is None:
                cur[key] = fresh
        else:
            cur.setdefault(key, fresh)
        cur = cur[key]
    last = path[-1]
    if isinstance(cur, list):
        cur.extend([None] * (last + 1 - len(cur)))
    cur[last] = value
