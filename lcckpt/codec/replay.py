"""Replaying parsed blobs onto a reference: a keyframe and its deltas, chunk by chunk.

A chain's restore decodes the keyframe and adds every pending delta while each chunk of
the reference is in cache, so N deltas over a state larger than the cache cost one pass
over memory, not N (:func:`replay`); many small tensors replay side by side
(:func:`settle`). :class:`~lcckpt.codec.delta.Reconstruction` calls them.
"""

from __future__ import annotations

import contextlib
import copy
import threading

import numpy as np

from ..errors import CorruptDataError
from ..util.pool import run_balanced, run_tasks
from .blob import Parsed
from .streamed import BY_CHUNK_MIN, DeferredBlob, DeltaChunks, StreamedBlob
from .streams import StreamDecoder, decode_side_by_side
from .tensor import apply_escapes, decode_symbols_into, exact_chunk_decoder


def _with_escapes(chunk, p: Parsed, ref: np.ndarray):
    def step(c):
        chunk(c)
        apply_escapes(p, ref, c)
    return step


TINY = 1 << 14              # elements: tensors of at most this many replay on the caller
SIDE_BY_SIDE_CHUNKS = 16    # tensors of at most this many chunks replay whole, a task each


def settle(recs, into=None) -> None:
    """Apply the pending blobs of many reconstructions: those of up to
    SIDE_BY_SIDE_CHUNKS chunks side by side on the pool, a task each (a state of many
    small tensors would otherwise replay them one at a time, each over the pool's few
    chunks, waiting for its slowest), then the larger ones, each over the pool's chunks.
    (A restore of MiniLM-L6's 306 tensors and 10 deltas: 0.885 s against 0.952 s with
    single-chunk tensors alone side by side, medians of 14 loads.) Tensors of at most
    TINY elements replay first, one after another on the calling thread: their replay is
    mostly Python between short kernels, and two pool threads doing it at once wait on
    each other for the GIL at every kernel call (500 tensors of 384 elements and 11
    blobs each settled in 182-192 ms against 376-383 ms side by side; 8192 elements,
    265-280 ms against 322-328 ms; at 32768 the pool's threads win, 405-416 ms against
    526-550 ms). ``into(rec)``: replays ``rec`` into a tensor of the caller's and says
    whether it did; else into fresh memory."""
    tiny, small, large = [], [], []
    for rec in recs:
        head = rec._key if rec._key is not None else (rec.pending[0] if rec.pending else None)
        if head is not None:
            if head[1].n <= TINY:
                tiny.append(rec)
            elif head[1].n <= SIDE_BY_SIDE_CHUNKS << head[1].log2:
                small.append(rec)
            else:
                large.append(rec)

    def done(rec):
        if into is None or not into(rec):
            rec.ref
    for rec in tiny:
        done(rec)
    run_balanced(lambda k: done(small[k]), len(small))
    for rec in large:
        done(rec)


def replay(deltas: list, ref: np.ndarray, base=None) -> None:
    """Add several parsed lossy blobs to ``ref`` in order, chunk by chunk across them.

    The result is bit-identical to decoding them one after another (each element sees the
    same adds in the same order), but every chunk of ``ref`` is loaded into cache once
    for all blobs instead of once per blob: replaying N deltas over a model larger than
    the cache costs one pass over memory, not N.

    ``base``: a lossless blob ``(buf, parsed)`` holding exactly ``ref``'s dtype and size
    (a keyframe), decoded into ``ref`` chunk by chunk before the deltas, in the same pass.
    Any ``buf`` may be a :class:`~lcckpt.codec.streamed.DeferredBlob`, read here: chunk
    by chunk, by the task that replays the chunk
    (:class:`~lcckpt.codec.streamed.DeltaChunks`), where the deferred deltas hold more
    than :data:`~lcckpt.codec.streamed.BY_CHUNK_MIN` together.
    """
    if base is not None and isinstance(base[0], DeferredBlob):
        base = base[0].load()
    log2s = {p.log2 for _, p in deltas}
    if base is not None:
        if base[1].dt.numpy != ref.dtype or base[1].n != ref.size:
            raise ValueError("the base blob does not hold the reference's dtype and size")
        log2s.add(base[1].log2)
    if len(log2s) > 1:                           # different chunking: one blob at a time
        if base is not None:
            with _checked(base):
                run_tasks(_base_decoder(base, ref), -(-ref.size // (1 << base[1].log2)))
        for buf, p in map(_loaded, deltas):
            decode_symbols_into(buf, p, ref)
        return
    if not log2s:
        return
    cs = 1 << log2s.pop()
    nch = -(-ref.size // cs)
    chunked = _by_chunk(deltas, nch)
    try:
        decs = []
        for k, (buf, p) in enumerate(deltas):
            buf, p = (None, p) if k in chunked else _loaded((buf, p))
            decs.append((StreamDecoder(buf, p.payload_base, p.layouts[0], p.n, cs, p.bits,
                                       None, "lcckpt blob", apply=(p.centroids, ref)),
                         p, chunked.get(k)))
        _replay_steps(decs, ref, cs, nch, base)
    finally:
        for r in chunked.values():
            r.close()


def replay_window(decoders: list, ref: np.ndarray, k0: int, k1: int) -> None:
    """Chunks ``k0..k1-1`` of several deltas ``(StreamDecoder, parsed)`` (each over a
    window of those chunks alone, :meth:`StreamDecoder.window`) added in order onto
    ``ref``, which holds those chunks of the keyframe: what :func:`replay` gives there,
    bit for bit (a lazy read of a few rows of a chain step)."""
    if not decoders:
        return
    steps, _ = _steps([(d, p, None) for d, p in decoders], ref, None, False)
    for c in range(k0, k1):
        _replay_chunk(steps, c, ref, decoders[0][0].cs)


def _loaded(delta):
    """``(buf, parsed)`` of a delta, read whole now if it is deferred."""
    return delta[0].load() if isinstance(delta[0], DeferredBlob) else delta


def _by_chunk(deltas: list, nch: int) -> dict:
    """The deferred deltas to read chunk by chunk, by their place in ``deltas``: all that
    can be, where together they hold more than BY_CHUNK_MIN; else none."""
    can = {k: b for k, (b, _) in enumerate(deltas) if isinstance(b, DeferredBlob) and b.by_chunk()}
    if nch < 2 or sum(b.part.length for b in can.values()) <= BY_CHUNK_MIN:
        return {}
    readers = {}
    try:
        for k, b in can.items():
            readers[k] = DeltaChunks(b)
    except BaseException:
        for r in readers.values():
            r.close()
        raise
    return readers


def _steps(decs: list, ref: np.ndarray, base_dec, own: bool):
    """The replay's steps (a chunk's decode, and what decodes it side by side) and the
    deltas read chunk by chunk, each ``(DeltaChunks, decoder)``; ``own``: those decoders
    are copies for one thread (each decodes from its thread's bytes)."""
    steps = [] if base_dec is None else [(base_dec, None)]
    readers = []
    for dec, p, reader in decs:
        if reader is not None:
            dec = copy.copy(dec) if own else dec
            readers.append((reader, dec))
        escaped = p.esc_idx is not None and p.esc_idx.size
        steps.append((_with_escapes(dec.chunk, p, ref) if escaped else dec.chunk,
                      (dec, p if escaped else None)))
    return steps, readers


def _replay_steps(decs: list, ref: np.ndarray, cs: int, nch: int, base) -> None:
    """Every delta of ``decs`` (``(decoder, parsed, DeltaChunks or None)``), after the
    keyframe ``base`` if any, over every chunk, on the pool; a delta read chunk by chunk
    is read by each task for its own chunks, into its thread's buffer."""
    base_dec = None if base is None else _base_decoder(base, ref)
    steps, readers = _steps(decs, ref, base_dec, False)
    local = threading.local()
    # dense Huffman chunks decode four bit streams side by side: four deltas' streams of
    # one chunk where the chain has four deltas or more (each chunk a task, in the core's
    # cache for every blob), else four chunks of one delta (four chunks a task)
    dense = [f is not None and f[0].multi8 is not None for _, f in steps]
    group = 4 if nch >= 8 and 0 < sum(dense) < 4 else 1

    def task(g):
        lo, hi = g * group, min(nch, (g + 1) * group)
        block = None
        run = steps
        if readers:
            if not hasattr(local, "steps"):
                local.steps, local.readers = _steps(decs, ref, base_dec, True)
            run = local.steps
            for reader, dec in local.readers:
                dec.window(reader.read(lo, hi), lo, hi)
        if group == 1:
            _replay_chunk(run, lo, ref, cs)
            return
        for chunk, four in run:
            if four is not None and hi - lo == 4:
                block = np.empty(4 * (cs + 8), np.uint8) if block is None else block
                if four[0].chunks4(lo, block):
                    if four[1] is not None:
                        for c in range(lo, hi):
                            apply_escapes(four[1], ref, c)
                    continue
            for c in range(lo, hi):
                chunk(c)
    try:
        with _checked(base):
            run_balanced(task, -(-nch // group))    # chunks differ in cost
    except CorruptDataError:
        for reader, _ in readers:
            reader.check_whole()
        raise
    for reader, _ in readers:
        reader.finish()


def _base_decoder(base, ref: np.ndarray):
    """Per-chunk task decoding the keyframe ``(buf or StreamedBlob, parsed)`` into ``ref``."""
    if isinstance(base[0], StreamedBlob):
        return base[0].chunk_decoder(ref)
    return exact_chunk_decoder(base[0], base[1], ref)


@contextlib.contextmanager
def _checked(base):
    """A streamed keyframe's payload checksum, once every chunk was read and decoded (or,
    if a decode failed, of the whole payload: damage is a ChecksumError on either path)."""
    streamed = base is not None and isinstance(base[0], StreamedBlob)
    try:
        yield
    except CorruptDataError:
        if streamed:
            base[0].check_whole()
        raise
    if streamed:
        base[0].verify()


def _replay_chunk(steps: list, c: int, ref: np.ndarray, cs: int) -> None:
    """Chunk ``c`` of every step in order; runs of two to four deltas whose chunk is
    dense are decoded side by side (:func:`lcckpt.codec.streams.decode_side_by_side`),
    then added one after another, each delta's escapes set before the next adds."""
    block, run = None, []

    def flush():
        nonlocal block
        if len(run) == 1:
            run[0][0](c)
        elif run:
            block = np.empty(4 * (cs + 8), np.uint8) if block is None else block
            at = decode_side_by_side([(f[0], c) for _, f in run], block)
            for (_, (dec, p)), a in zip(run, at):
                dec.add_block(c, block, a)
                if p is not None:
                    apply_escapes(p, ref, c)
        run.clear()
    for step in steps:
        four = step[1]
        if four is not None and four[0].dense(c):
            run.append(step)
            if len(run) == 4:
                flush()
            continue
        flush()
        step[0](c)
    flush()
