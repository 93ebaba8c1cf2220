"""DCP storage with lcckpt's codecs: each rank encodes the items it was given and writes one file.

:class:`CompressedWriter` (a ``FileSystemWriter``) stores every tensor item as an lcckpt blob:
an exact keyframe, or, in a chain, a lossy delta against this rank's reference of that
piece (the decoder's reconstruction of the piece's last committed state). Each item's
:class:`LcckptStorageInfo` records its codec, dtype, shape, raw size, owner rank and, for a
delta, where the earlier blobs of its chain lie. A piece that the planner found under two
names (tied weights, :meth:`~.planner.BalancedSavePlanner.tied_to`) is stored once; the
other names' records point to its blob. References advance only in :meth:`commit`,
which the caller runs after the save committed on every rank; :meth:`abort` drops them and
removes this save's files. File names carry a per-save tag, so saving again into a
directory never overwrites the files its committed ``.metadata`` points to.

:class:`CompressedReader` (a ``FileSystemReader``) decodes each stored item once (following
its delta chain) and lets DCP narrow and copy it into whatever layout the loader asks for, so
resharding works as with plain DCP. It reads ``.metadata`` with an allow-list unpickler.

Not here: which rank writes what (``planner.py``) and the save/commit protocol (``api.py``).
"""

from __future__ import annotations

import dataclasses
from functools import partial
import io
import re
import time
import uuid
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.futures import Future
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (LoadPlan, LoadPlanner,
                                                  SavePlan, SavePlanner, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.storage import WriteResult

from ..codec import dtypes
from ..codec.tensor import encode
from ..chain.policy import RolePolicy
from ..codec.delta import NONFINITE, NONFINITE_DONE, Reconstruction
from ..errors import CorruptDataError, InvalidArgumentError
from ..codec.streamed import StreamedBlob
from . import exchange, targets
from ..format.sections import decode_streamed, replay_into_tensor
from .blobs import (LocalFiles, as_tensor, decode_exact, deferred_blob, missing,
                    streamed_blob)
from .refs import (BACKGROUND, Background, Ref, park, park_in, read_blob, reopened, replay,
                   resync)
from .metadata import check_items, unpickle
from .partition import Piece
from .planner import SafeLoadPlanner, TreeBytes, piece_for
from ..format.serialization import load
from .store import Flusher, check_size, files_for, remove_stale
from ..util.caller import warn_user
from ..util.collector import paused

SUFFIX = ".distcp"
_OUR_FILE = re.compile(r"__\d+_[0-9a-f]{8}_\d+\.distcp")


@dataclass
class LcckptStorageInfo:
    """Where one stored item lies and how to decode it (kept in DCP's ``.metadata``)."""
    relative_path: str
    offset: int
    length: int
    codec: str                 # "exact" (lcckpt lossless blob), "delta" (lossy), "tree" (a
                               # value as an lcckpt file), "bytes" (a value as torch.save bytes)
    piece: tuple               # (key, start, stop): the partition piece it stores
    rank: int                  # the rank that wrote it
    raw_nbytes: int
    dtype: str = ""
    shape: tuple = ()
    chain: tuple = ()          # earlier blobs of a delta, keyframe first: (path, offset, length),
                               # paths relative to this checkpoint's directory
    zero_base: bool = False    # the chain's first blob is a delta against zeros, not a keyframe
    alias: bool = False        # the blob of another name of the same tensor (tied weights)

    def replay(self, read, work: str | None = None) -> Reconstruction:
        """The item's chain applied, keyframe (or the delta from zero) first; ``read(path,
        offset, length)`` gives a blob's bytes, ``read(..., stream_as=work)`` the first
        one's, which it may give as a blob read as it is decoded (a keyframe)."""
        rec = Reconstruction()          # the whole chain replayed at once, chunk by chunk
        blobs = tuple(self.chain) + ((self.relative_path, self.offset, self.length),)
        for i, (rel, off, n) in enumerate(blobs):
            first = i == 0 and not self.zero_base and work is not None
            rec.apply(read(rel, off, n, stream_as=work) if first else read(rel, off, n),
                      dtype=targets.dtype_name(self), shape=self.shape,
                      zero_base=self.zero_base and i == 0)
        return rec


@dataclass(frozen=True)
class FilePrefix:
    """Each rank's file name prefix for one save: ``__{rank}_{save tag}_``."""
    prefix: str


class CompressedWriter(FileSystemWriter):
    """DCP storage writer that encodes each item with lcckpt's codecs.

    ``chain=False`` (the default): every tensor is an exact keyframe and no reference is
    kept. ``chain=True``: floating tensors become deltas against this rank's committed
    reference of the same piece (a keyframe when there is none, when the layout changed, or
    every ``keyframe_every`` blobs), held to ``target`` (default :data:`DEFAULT_POLICY`),
    or LC-Checkpoint's ``bits=1..4`` (:mod:`.targets`). Reuse one writer across saves for
    deltas, and call :meth:`commit` / :meth:`abort` after each (the ``lcckpt.distributed``
    functions do).
    """

    def __init__(self, path, *, chain: bool = False, bits: int | None = None, target=None,
                 keyframe_every: int = 20, sync_files: bool = True,
                 storage_options: dict | None = None):
        files = files_for(path, storage_options)
        super().__init__("." if files.remote else path, single_file_per_rank=True,
                         sync_files=sync_files, thread_count=1, overwrite=True)
        self.fs = files
        self.path = files.init_path(path)
        chain = chain or bits is not None or target is not None
        self.target = targets.check(bits, target) if chain else None
        if keyframe_every < 1:
            raise InvalidArgumentError(f"keyframe_every must be >= 1, got {keyframe_every}")
        self.chain, self.bits, self.keyframe_every = chain, bits, keyframe_every
        self.force_keyframe = False
        self.resume_from: tuple | None = None  # (metadata, step dir) to go on from: resume()
        self._refs: dict[Piece, Ref] = {}
        self._pending: dict[Piece, Ref] | None = None
        self.writer_id = uuid.uuid4().hex
        self._retired: list[str] = []     # ids whose references a background process drops
        self._last_committed: str | None = None      # save_id of the last committed save
        self._bg: Background | None = None           # set in a background process
        self._written: list = []
        self._advanced: set = set()        # pieces whose references this save advanced
        self.live = None                   # a live save's Versions, checked before it commits
        self.feed = None                   # a live process-mode save's pool.FeedClient
        self.last_write_stats: dict = {}

    # DCP's process-based async_save pickles the writer into its background process for
    # every save. The references live there, in ``BACKGROUND`` under this writer's id: a
    # save's new references become the ones deltas use when the next copy arrives saying
    # that save committed (``_last_committed``, set by :meth:`commit` here). A background
    # process that died takes them along: the next save there is a keyframe.
    def __getstate__(self):
        state = dict(self.__dict__)
        state["_refs"], state["_pending"], state["_bg"] = {}, None, None
        state["_advanced"], state["live"] = set(), None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        for old in self._retired:               # no save of theirs comes here again
            BACKGROUND.pop(old, None)
        bg = BACKGROUND.setdefault(self.writer_id, Background())
        if bg.pending is not None and bg.pending_save == self._last_committed:
            bg.refs = bg.pending
        else:                   # that save failed: what it advanced is read back from disk
            bg.refs = resync(bg.refs, bg.advanced, partial(read_blob, self.fs))
        bg.pending, bg.advanced = None, set()
        self._refs, self._bg = bg.refs, bg
        park_in(bg, self.fs)            # unchanged pieces' references leave memory

    # -- DCP hooks -------------------------------------------------------------------------
    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        if not self.use_collectives:
            raise InvalidArgumentError("CompressedWriter needs use_collectives=True: the "
                                       "balanced plan is made by the coordinator")
        if self._pending is not None:
            warn_user("the previous save was neither committed nor aborted; the references "
                      "it advanced are read back from the committed files (call commit() "
                      "after a save returns on every rank)")
            self._refs = resync(self._refs, self._advanced, partial(read_blob, self.fs))
            self._pending, self._advanced = None, set()
        if self.resume_from is not None:        # in DCP's background process, if there
            self.resume(*self.resume_from, self.rank or 0)
            self.resume_from = None
        self._written = []

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.fs.mkdir(self.path)       # no overwrite warning: our files never collide
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        tag = uuid.uuid4().hex[:8]
        return [dataclasses.replace(p, storage_data=FilePrefix(f"__{i}_{tag}_"))
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        with paused(background=True):   # an async save's thread beside training: no GIL-held
            return self._write(plan, planner)     # collections (util/collector.py)

    def _write(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        t0, c0 = time.perf_counter(), time.process_time()
        name = f"{plan.storage_data.prefix}0{SUFFIX}"
        path = self.fs.concat_path(self.path, name)
        rank = self.rank or 0
        pending: dict[Piece, Ref] = {}
        results = []
        raw_total = 0
        self._written.append(path)
        self._advanced = set()
        if self._bg is not None:
            self._bg.pending, self._bg.pending_save = None, self.save_id
            self._bg.advanced = self._advanced
        flusher = Flusher() if self.sync_files and not self.fs.remote else None
        dirs = targets.directions(planner) if isinstance(self.target, RolePolicy) else {}
        feed = self.feed                        # a live process-mode save: see pool.py
        tied = getattr(planner, "tied_to", lambda wi: None)
        order = sorted(plan.items, key=lambda wi: (wi.type != WriteItemType.BYTE_IO,
                                                   tied(wi) is not None))
        pieces = {wi.index: piece_for(planner, wi) for wi in order}
        here = set(pieces.values())
        alias = {wi.index: tied(wi) for wi in order if tied(wi) in here}   # stored before
        stored: dict[Piece, LcckptStorageInfo] = {}
        if feed is not None:                    # see pool.FeedClient.start
            asked = [(wi, pieces[wi.index]) for wi in order
                     if wi.index not in alias and wi.type != WriteItemType.BYTE_IO]
            feed.start([(wi.index.fqn, tuple(wi.tensor_data.chunk.offsets),
                         tuple(wi.tensor_data.chunk.sizes), dataclasses.astuple(p),
                         targets.fqn(p.key) in dirs) for wi, p in asked])
        with self.fs.create_stream(path, "wb") as f:
            for wi in order:
                piece = pieces[wi.index]
                if wi.index in alias:           # another name of a piece stored above
                    results.append(WriteResult(index=wi.index, size_in_bytes=0, storage_data=
                                               dataclasses.replace(stored[alias[wi.index]],
                                                                   alias=True)))
                    continue
                data, steer = planner.resolve_data(wi), dirs
                if feed is not None and wi.type != WriteItemType.BYTE_IO:
                    data, m = feed.next()       # the piece, copied in by the trainer
                    steer = {} if m is None else {targets.fqn(piece.key): m}
                offset = f.tell()
                info = self._encode_into(f, wi, piece, data, pending,
                                         self.fs.absolute(path), offset, steer)
                info = LcckptStorageInfo(name, offset, f.tell() - offset, rank=rank,
                                         piece=(piece.key, piece.start, piece.stop), **info)
                raw_total += info.raw_nbytes
                stored[piece] = info
                results.append(WriteResult(index=wi.index, size_in_bytes=info.length,
                                           storage_data=info))
                if flusher is not None:
                    flusher.written(f, info.length)
            if self.live is not None:           # every byte written: the state is read no more
                self.live.release()
            if feed is not None:
                feed.finish(self.path)
            f.flush()
            if flusher is not None:
                flusher.finish(f)
            written = f.tell()
        check_size(self.fs, path, written)      # a remote upload completes on close
        if self.live is not None:
            self.live.check()
        self._pending = pending if self.chain else None
        if self._bg is not None:
            self._bg.pending = self._pending
        self.last_write_stats = {"rank": rank, "items": len(results), "raw_bytes": raw_total,
                                 "bytes": written, "seconds": time.perf_counter() - t0,
                                 "cpu_seconds": time.process_time() - c0}
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def _encode_into(self, f, wi: WriteItem, piece: Piece, data, pending, abs_path, offset,
                     dirs):
        if wi.type == WriteItemType.BYTE_IO:
            buf = data.getbuffer()
            f.write(buf)
            return {"codec": "tree" if isinstance(data, TreeBytes) else "bytes",
                    "raw_nbytes": len(buf)}
        t = data.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        meta = {"raw_nbytes": t.numel() * t.element_size(), "dtype": str(t.dtype),
                "shape": tuple(t.shape)}
        if not self.chain or t.dtype not in targets.FLOATS or t.numel() < targets.MIN_ELEMENTS:
            f.write(encode(t, lossless=True))       # and scalars such as step counts
            return {"codec": "exact", **meta}
        prev = self._refs.get(piece)
        fresh = prev is None or self.force_keyframe or len(prev.chain) >= self.keyframe_every
        # a moment new to a chain under way (an optimizer's first step): a delta from zero
        zero = prev is None and not self.force_keyframe and bool(self._refs) \
            and self.target is not None and targets.starts_at_zero(piece.key)
        if fresh:
            enc = targets.new_encoder(self.bits, self.target, piece.key)
        else:               # advanced in place: a failed save reads it back (abort)
            enc = prev.encoder
            self._advanced.add(piece)
        parts, st = enc.encode_parts(t, keyframe=fresh and not zero, from_zero=zero,
                                     direction=targets.direction_of(dirs, piece, t), warn=False)
        if st.fallback in NONFINITE:            # named here, where the piece is known
            warn_user(f"{abs_path}: {piece.key}: {st.fallback}; {NONFINITE_DONE}")
        for part in parts:
            f.write(part)
        here = ((abs_path, offset, f.tell() - offset),)
        if st.kind != "lossless":                # a delta: "lossy" (LC) or "uniform"
            before, zero = ((), True) if zero else (prev.chain, prev.zero_base)
            pending[piece] = Ref(enc, before + here, zero)
            base = self.fs.dirname(abs_path)     # this rank's own view of the directory
            chain = tuple((self.fs.relative(p, base), o, n) for p, o, n in before)
            return {"codec": "delta", "chain": chain, "zero_base": zero, **meta}
        pending[piece] = Ref(enc, here)
        return {"codec": "exact", **meta}

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        sync, self.sync_files = self.sync_files, self.sync_files and not self.fs.remote
        try:        # DCP syncs .metadata with fsync, or os.sync() for a remote stream
            super().finish(metadata, results)
        finally:
            self.sync_files = sync
        # from the results, not metadata.storage_data: torch < 2.13 fills that in on a copy
        remove_stale(self.fs, self.path, _OUR_FILE,
                     {wr.storage_data.relative_path for wrs in results for wr in wrs})

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id)

    # -- after the save --------------------------------------------------------------------
    def commit(self) -> None:
        """The save committed on every rank: its references become the ones deltas use."""
        if self._pending is not None:
            self._refs = self._pending
            park(self._refs, self._fetch)           # unchanged pieces' references leave memory
        self._pending, self._advanced = None, set()
        self._written = []
        self.force_keyframe = False
        self._last_committed = self.save_id

    def resume(self, md: Metadata, step_dir: str, rank: int) -> None:
        """Go on from the step committed in ``step_dir`` (``md``: its metadata) as the writer
        of ``rank`` that saved it did (:func:`.refs.reopened`); nothing if it holds any."""
        if not self._refs:
            self._refs = reopened(md.storage_data.values(), rank, step_dir, self.fs,
                                  targets.chained,
                                  partial(targets.new_encoder, self.bits, self.target))
            if self._bg is not None:
                self._bg.refs = self._refs

    def _fetch(self, piece: Piece):
        """A parked reference (lcckpt/codec/parked.py): the piece's committed chain replayed."""
        return replay(self._refs[piece], partial(read_blob, self.fs)).ref

    def abort(self) -> None:
        """The save failed somewhere: remove this rank's files, and rebuild the references
        the save advanced from their committed blobs (:func:`.refs.resync`)."""
        self._refs = resync(self._refs, self._advanced, partial(read_blob, self.fs))
        self._pending, self._advanced = None, set()
        for p in self._written + [self.fs.concat_path(self.path, ".metadata.tmp")]:
            try:
                if self.fs.exists(p):
                    self.fs.rm_file(p)
            except OSError:
                pass
        self._written = []

    def rebase(self, moved: dict, mine: int) -> None:
        """Chains through a merged blob (``{old: new}``, merge.py) start at its keyframe; if
        fewer than ``mine`` do (references kept elsewhere), all go: a keyframe comes next."""
        through = [p for p, r in self._refs.items() if any(b in moved for b in r.chain)]
        for p in through:
            r = self._refs[p]
            i = max(i for i, b in enumerate(r.chain) if b in moved)
            self._refs[p] = Ref(r.encoder, (moved[r.chain[i]],) + r.chain[i + 1:], False)
        if len(through) < mine:
            self._retired.append(self.writer_id)
            self._refs, self.writer_id = {}, uuid.uuid4().hex

    def references(self) -> dict[Piece, torch.Tensor]:
        """This rank's committed references: what a load of its pieces will return."""
        return {p: as_tensor(r.encoder.reference()) for p, r in self._refs.items()}


class CompressedReader(FileSystemReader):
    """DCP storage reader for checkpoints written by :class:`CompressedWriter`.

    ``cooperative`` (default): with several ranks, an item several of them need is read
    and decoded by one and given to the others (``exchange.py``): written straight into
    their memory on one host where the kernel allows it (``peer.py``;
    ``LCCKPT_PEER_COPY=0`` turns that off), sent over the process group otherwise. False:
    each rank reads and decodes all it needs itself."""

    def __init__(self, path, *, storage_options: dict | None = None, process_group=None,
                 cooperative: bool = True):
        files = files_for(path, storage_options)
        super().__init__("." if files.remote else path)
        self.fs = files
        self.path = files.init_path(path)
        self.process_group, self.cooperative = process_group, cooperative
        self.bytes_read = 0                  # by the last read_data, for benchmarks and tests
        self.last_exchange: exchange.Exchange | None = None
        self._cached: tuple | None = None      # (raw .metadata, parsed): read once per load
        self._files: LocalFiles | None = None  # local files open during read_data

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        if not self.fs.exists(path):
            raise InvalidArgumentError(f"no committed checkpoint at {self.path} (no .metadata); "
                                       "pass the directory a save completed into")
        with self.fs.create_stream(path, "rb") as f:
            raw = f.read()
        if self._cached is not None and self._cached[0] == raw:
            md = self._cached[1]
        else:
            md = unpickle(raw, path, LcckptStorageInfo)
            check_items(md, self.path, LcckptStorageInfo)
            self._cached = (raw, md)
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """A tied tensor's other names read its first name's item, which decodes once."""
        sd, tied = self.storage_data, lambda i: getattr(self.storage_data[i], "alias", False)
        first = {(sd[i].relative_path, sd[i].offset): i for i in sd if not tied(i)}
        plan.items = [dataclasses.replace(r, storage_index=first[(
            sd[r.storage_index].relative_path, sd[r.storage_index].offset)])
            if tied(r.storage_index) else r for r in plan.items]
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        plans = super().prepare_global_plan(plans)
        if self.cooperative and len(plans) > 1:
            plans = exchange.schedule(plans, self.storage_data)
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self.bytes_read = 0
        self.last_exchange = plan.storage_data if isinstance(plan.storage_data,
                                                             exchange.Exchange) else None
        self._files = None if self.fs.remote else LocalFiles()
        try:
            if self.last_exchange is not None:                       # see exchange.py
                exchange.run(plan.storage_data, plan, planner, self.storage_data,
                             self.process_group,
                             lambda info, reqs: self._item(info, reqs, planner),
                             lambda reqs, whole: exchange.apply(planner, reqs, whole))
            else:
                groups: dict = {}
                for req in plan.items:
                    groups.setdefault(req.storage_index, []).append(req)
                for idx in sorted(groups, key=lambda i: (self.storage_data[i].relative_path,
                                                         self.storage_data[i].offset)):
                    exchange.apply(planner, groups[idx],
                           self._item(self.storage_data[idx], groups[idx], planner))
        finally:
            if self._files is not None:
                self._files.close()
            self._files = None
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _item(self, info: LcckptStorageInfo, reqs, planner):
        """A stored item as read: a value's bytes, or the decoded tensor; an item that one
        request takes whole is decoded straight into its target (a chain's where its
        dtype is the working one: fp32, fp64)."""
        if info.codec in exchange.VALUES:
            data = self._read(info.relative_path, info.offset, info.length)
            if info.codec == "bytes":
                return io.BytesIO(data)
            if isinstance(planner, SafeLoadPlanner):
                return TreeBytes(data)
            buf = io.BytesIO()      # DCP's own planner unpickles: give it torch.save bytes
            torch.save(load(io.BytesIO(data)), buf)
            buf.seek(0)
            return buf
        return self._decode(info, exchange.whole_target(info, reqs, planner))

    def _read(self, rel: str, offset: int, length: int, stream_as: str | None = None,
              defer: bool = False):
        """The blob's bytes; or, in a local file, a large lossless one stored as
        ``stream_as`` as a :class:`~lcckpt.codec.streamed.StreamedBlob`, a large one as a
        :class:`~lcckpt.codec.streamed.DeferredBlob` where ``defer`` (blobs.py)."""
        path = self.fs.join(self.path, rel)
        if self._files is not None:             # a local file, kept open for the load
            data = streamed_blob(path, offset, length, stream_as, rel)
            if data is None and defer:
                data = deferred_blob(path, offset, length, rel)
            if data is None:
                data = self._files.read(path, offset, length)
        else:
            if not self.fs.exists(path):
                raise missing(path)
            data = read_blob(self.fs, path, offset, length)
        self.bytes_read += length
        return data

    def _decode(self, info: LcckptStorageInfo, out: torch.Tensor | None = None) -> torch.Tensor:
        if info.codec == "exact":       # its shape is DCP's chunk's (read_metadata)
            args = info.relative_path, info.offset, info.length
            out = torch.empty(info.shape, dtype=exchange._dtype(info.dtype)) if out is None else out
            blob = self._read(*args, stream_as=targets.dtype_name(info))
            if isinstance(blob, StreamedBlob):       # None: read it whole after all
                got = decode_streamed(blob, out)
                blob = got if got is not None else self._read(*args)
            if not isinstance(blob, torch.Tensor):
                out = decode_exact(blob, out, info.relative_path)
        else:                           # "delta" (read_metadata refused any other)
            work = dtypes.work_name(targets.dtype_name(info))
            rec = info.replay(partial(self._read, defer=True), work)
            # an fp32/fp64 item replays straight into its target, if it has one
            if out is None or not replay_into_tensor(rec, out):
                out = as_tensor(rec.value(copy=False))
        if str(out.dtype) != info.dtype or tuple(out.shape) != tuple(info.shape):
            raise CorruptDataError(f"decoded {out.dtype}{tuple(out.shape)}, metadata says "
                                   f"{info.dtype}{tuple(info.shape)}")
        return out
