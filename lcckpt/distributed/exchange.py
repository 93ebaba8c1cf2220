"""Cooperative restore: each stored item is read and decoded by one rank, and sent to the
other ranks that need it.

Without it every rank of a DDP-style (replicated) load reads and decodes the whole
checkpoint, so a second rank adds nothing. Here the coordinator, which sees every rank's
load plan, gives each item that several ranks need to one of them (the least-loaded by raw
bytes, in a fixed order), and records who sends what to whom in each rank's plan
(:func:`schedule`, O(items + requests)). Each rank then (:func:`run`):

1. learns which peers share its host and may write into its memory (peer.py), and posts
   a receive for every item it gets from a peer that may not, straight into its
   destination tensor where one request covers the whole item contiguously (DDP's case;
   no copy), else into a buffer;
2. decodes its own items in order and gives each to the ranks that need it: written
   straight into a peer's destination (or buffer) on the same host, one copy at memory
   speed, by a thread of its own while the next item decodes where the host has a core
   to spare for it (:class:`_Writes`), else right after the decode; sent over the
   process group otherwise; either way with a bounded number of decoded bytes waiting;
3. sums a failure flag over the group (after which every item has landed), so that a rank
   whose decode failed (it still sends zeros, so nobody waits forever) makes every rank
   raise, each its own error or a :class:`PeerFailedError` naming the ranks that failed.

Sent bytes move as raw bytes (any dtype, bf16 included) over the process group's
point-to-point calls, each message tagged with the item's position in the global schedule.
:func:`apply` puts a decoded item into each request's target (also on a load's other path).
"""

from __future__ import annotations

import io
import queue
import threading
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..errors import CorruptDataError, LcckptError
from ..util import pool
from . import peer

VALUES = ("tree", "bytes")       # the codecs of non-tensor values: read by each rank needing one
_INFLIGHT_BYTES = 64 << 20      # decoded bytes a sender keeps while its sends complete
_KEPT: list = []                # buffers of restores that failed while peers could write


class PeerFailedError(LcckptError):
    """Another rank could not read or decode its share of a cooperative restore."""


@dataclass
class Exchange:
    """One rank's part of the schedule (kept in its ``LoadPlan.storage_data``)."""
    decode: list = field(default_factory=list)      # storage indexes this rank decodes
    send: dict = field(default_factory=dict)        # index -> [(group rank, tag), ...]
    recv: dict = field(default_factory=dict)        # index -> (group rank, tag)
    copied: int = 0         # bytes peers wrote straight into this rank's memory (peer.py)


def schedule(plans: list, storage_data: dict) -> list:
    """Each plan with an :class:`Exchange` in ``storage_data`` (``plans`` in group-rank
    order). Items one rank needs, and values' bytes, are read by each rank that needs them;
    shared tensor items go, costliest first, to the needing rank with the least decoding so
    far (:func:`_cost`; the item's writer first on a tie). Each rank decodes in file order."""
    need: dict = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            need.setdefault(item.storage_index, set()).add(rank)
    load = [0] * len(plans)
    owner: dict = {}
    shared = []
    for idx, ranks in need.items():
        info = storage_data[idx]         # values, and empty tensors: nothing to send
        if len(ranks) == 1 or info.codec in VALUES or not info.raw_nbytes:
            for r in ranks:
                load[r] += _cost(info)
        else:
            shared.append(idx)
    # costliest first, each to its least-loaded needing rank (LPT), the writer first on a tie
    for idx in sorted(shared, key=lambda i: (-_cost(storage_data[i]), _place(storage_data[i]))):
        info = storage_data[idx]
        owner[idx] = min(need[idx], key=lambda r: (load[r], r != info.rank, r))
        load[owner[idx]] += _cost(info)
    parts = [Exchange() for _ in plans]
    tag = 0
    for idx in sorted(need, key=lambda i: _place(storage_data[i])):     # file order
        if idx not in owner:
            for r in sorted(need[idx]):
                parts[r].decode.append(idx)
            continue
        src = owner[idx]
        parts[src].decode.append(idx)
        for r in sorted(need[idx] - {src}):
            parts[src].send.setdefault(idx, []).append((r, tag))
            parts[r].recv[idx] = (src, tag)
            tag += 1
    for plan, part in zip(plans, parts):
        plan.storage_data = part
    return plans


def _cost(info) -> int:
    """Elements decoded, in raw bytes: the item and every earlier blob of its chain."""
    return info.raw_nbytes * (1 + len(info.chain))


def _place(info) -> tuple:
    return (info.relative_path, info.offset)


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise LcckptError(f"checkpoint metadata names an unknown dtype {name!r}")
    return dt


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def run(part: Exchange, plan, planner, storage_data: dict, group, decode, apply) -> None:
    """This rank's share of a cooperative restore (see the module docstring).
    ``decode(info, reqs)`` gives an item's whole tensor (maybe decoded straight into the
    requests' target); ``apply(reqs, whole)`` copies it into the requests' targets."""
    reqs_of: dict = {}
    for req in plan.items:
        reqs_of.setdefault(req.storage_index, []).append(req)
    landing = {idx: _receive_buffer(storage_data[idx], reqs_of[idx], planner)
               for idx in part.recv}          # idx -> (buffer, whether it is the target)
    peers = peer.handshake(group, {idx: (buf.data_ptr(), buf.nbytes)
                                   for idx, (buf, _) in landing.items() if buf.nbytes})
    try:
        error = _give(part, reqs_of, storage_data, group, (decode, apply), landing, peers)
        failed = _failures(error, group)    # every rank has decoded and written what it copies
    except BaseException:
        _KEPT.append(landing)   # a peer may still write into these buffers: never free them
        raise
    me = dist.get_rank(group)
    for idx, (src, _) in part.recv.items():
        if error is not None or failed[src]:
            continue
        buf, direct = landing[idx]
        if _copied(peers, idx, src, me):
            part.copied += buf.nbytes
        try:
            if direct:
                planner.commit_tensor(reqs_of[idx][0], buf)
            else:
                apply(reqs_of[idx], buf)
        except Exception as e:         # noqa: BLE001
            error = e
    _agree(error, group)


def _give(part, reqs_of, storage_data, group, calls, landing, peers) -> BaseException | None:
    """Decode this rank's items, apply them here and give them to the peers that need them:
    written into a peer's memory where the handshake allows (peer.py), else sent; wait
    until every send and receive is done. The first error, if any."""
    decode, apply = calls
    offers = peers[0]
    glob = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    me = dist.get_rank(group)

    incoming = []
    for idx, (src, tag) in sorted(part.recv.items(), key=lambda kv: kv[1][1]):
        if not _copied(peers, idx, src, me):
            buf = landing[idx][0]
            incoming.append(dist.irecv(_bytes_of(buf), src=glob(src), group=group, tag=tag))

    error: BaseException | None = None
    inflight: deque = deque()
    held = 0
    copies = any(_copied(peers, idx, me, dst) for idx, sends in part.send.items()
                 for dst, _ in sends)
    writes = _Writes() if copies and _spare_cores(peers[1], me) else None
    try:
        for idx in part.decode:
            info = storage_data[idx]
            try:
                whole = decode(info, reqs_of[idx]) if error is None else None
                if whole is not None:
                    apply(reqs_of[idx], whole)
            except Exception as e:     # noqa: BLE001  (peers must not wait forever; raised below)
                error, whole = e, None
            for dst, tag in part.send.get(idx, ()):
                if _copied(peers, idx, me, dst):
                    if writes is None:
                        error = error or _write(offers[dst], idx, whole)
                    elif whole is not None:    # a failed decode writes nothing
                        writes.put(offers[dst], idx, whole)
                    continue
                out = whole if whole is not None else torch.zeros(info.shape,
                                                                  dtype=_dtype(info.dtype))
                out = out.contiguous()
                inflight.append((dist.isend(_bytes_of(out), dst=glob(dst), group=group,
                                            tag=tag), out.nbytes))
                held += out.nbytes
            while inflight and held > _INFLIGHT_BYTES:
                work, n = inflight.popleft()
                work.wait()
                held -= n
    finally:
        if writes is not None:             # no write into a peer outlives this call
            failed_write = writes.close()  # (always: a decode's error does not skip it)
            error = error or failed_write
    for work, _ in inflight:
        work.wait()
    for work in incoming:
        work.wait()
    return error


def _spare_cores(ok, me: int) -> bool:
    """Whether this host has a core for a writer thread beside every rank's decoding
    threads. Where it has not (two ranks of one thread each on two cores), a writer only
    slows the decoding beside it, and the writes stay inline."""
    here = 1 + sum(1 for r in range(len(ok)) if r != me and (ok[me, r] or ok[r, me]))
    return pool.cpus() >= here * (pool.threads() + 1)


class _Writes:
    """The writes into peers' memory on a thread of their own, so that the next item
    decodes meanwhile (both release the GIL); at most ``_INFLIGHT_BYTES`` of decoded items
    wait for it. :meth:`close` waits for every write and gives the first error."""

    def __init__(self) -> None:
        self.todo: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.held = 0
        self.freed = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="lcckpt-peer-writes",
                                       daemon=True)
        self.thread.start()

    def put(self, offer: tuple, idx, whole: torch.Tensor) -> None:
        with self.freed:
            while self.held and self.held + whole.nbytes > _INFLIGHT_BYTES:
                self.freed.wait()
            self.held += whole.nbytes
        self.todo.put((offer, idx, whole))

    def _run(self) -> None:
        while (job := self.todo.get()) is not None:
            offer, idx, whole = job
            try:
                err = None if self.error is not None else _write(offer, idx, whole)
            except BaseException as e:     # noqa: BLE001  (handed to close)
                err = e
            with self.freed:
                self.error = self.error or err
                self.held -= whole.nbytes
                self.freed.notify_all()

    def close(self) -> BaseException | None:
        self.todo.put(None)
        self.thread.join()
        return self.error


def _copied(peers: tuple, idx, src: int, dst: int) -> bool:
    """Whether ``src`` writes item ``idx`` straight into ``dst``'s memory (peer.py)."""
    offers, ok = peers
    return bool(ok[src, dst]) and idx in offers[dst][1]


def _write(offer: tuple, idx, whole: torch.Tensor | None) -> BaseException | None:
    """Copy a decoded item into a peer's buffer; the error, if that failed (a failed
    decode writes nothing: the peer learns of it from the failure flags)."""
    if whole is None:
        return None
    address, nbytes = offer[1][idx]
    if whole.nbytes != nbytes:       # never past the end of the peer's buffer
        return LcckptError(f"decoded {whole.nbytes} bytes for a peer's item of {nbytes}")
    try:
        peer.write(offer[0], address, whole.cpu().contiguous())     # host bytes only
    except OSError as e:
        return e
    return None


def whole_target(info, reqs, planner) -> torch.Tensor | None:
    """The destination tensor when one request covers the whole item with the same dtype,
    contiguously, on the CPU (DDP's case): an item can land there with no copy."""
    if len(reqs) != 1:
        return None
    req = reqs[0]
    dst = planner.resolve_tensor(req).detach()
    if tuple(req.lengths) == tuple(info.shape) and not any(req.storage_offsets) and \
            dst.dtype == _dtype(info.dtype) and tuple(dst.shape) == tuple(info.shape) and \
            dst.is_contiguous() and dst.device.type == "cpu":
        return dst
    return None


def _receive_buffer(info, reqs, planner):
    """Where an item from a peer lands: its destination (see :func:`whole_target`), else a
    buffer to copy from."""
    dst = whole_target(info, reqs, planner)
    if dst is not None:
        return dst, True
    return torch.empty(info.shape, dtype=_dtype(info.dtype)), False


def _failures(error: BaseException | None, group) -> list:
    """Collective: whether each rank has failed so far."""
    flags = torch.zeros(dist.get_world_size(group), dtype=torch.int32)
    flags[dist.get_rank(group)] = error is not None
    dist.all_reduce(flags, group=group)
    return [bool(f) for f in flags]


def _agree(error: BaseException | None, group) -> None:
    """Every rank learns whether any rank failed; each raises its own error, or, if it had
    none, one naming the ranks that failed."""
    flags = _failures(error, group)
    if error is not None:
        raise error
    failed = [r for r, f in enumerate(flags) if f]
    if failed:
        raise PeerFailedError(f"rank(s) {failed} could not read or decode their share of "
                              "this restore; see their errors")


def apply(planner, reqs, whole) -> None:
    """Copy a decoded item (or a value's bytes) into every request's target."""
    if isinstance(whole, io.BytesIO):
        for req in reqs:
            whole.seek(0)
            planner.load_bytes(req, whole)
        return
    for req in reqs:
        src = _narrow(whole, req.storage_offsets, req.lengths)
        dst = planner.resolve_tensor(req).detach()
        if dst.size() != src.size():
            raise CorruptDataError(f"{req.storage_index.fqn}: stored piece gives "
                                   f"{tuple(src.size())}, target wants {tuple(dst.size())}")
        if not _same(dst, src):                 # else decoded straight into the target
            dst.copy_(src)
        planner.commit_tensor(req, dst)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape and \
        a.stride() == b.stride()


def _narrow(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(offsets, lengths)):
        t = t.narrow(d, int(o), int(n))
    return t
