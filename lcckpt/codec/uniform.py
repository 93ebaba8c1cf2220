"""The error-bounded uniform quantizer: a delta -> symbols of one step, the coarsest step
whose restored error meets the target (docs/algorithm.md §7b).

A magnitude histogram of the delta (:class:`ErrorModel`, from the one read of the state
that :func:`~lcckpt.codec.survey.survey` makes) predicts the error and the symbol counts of any step; the
step is solved from it, then one quantization pass
writes the symbols and the reconstruction the decoder will make, measuring the error
exactly. Escapes store elements beyond the widest symbol exactly.
"""

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..util import memory as _memory
from ..util.pool import run_tasks
from ..errors import NonFiniteError
from . import entropy, sample
from .errmodel import ErrorModel
from .survey import Survey, survey
from .kernels import uniform as uk


UNIFORM_BITS = (2, 3, 4, 5, 6, 7, 8)       # symbol widths it may choose; escapes beyond
ESCAPE_COST = 12                           # bytes an escape costs, roughly (index, value)
SQRT12 = float(np.sqrt(12.0))
STEP_TRIES = 6        # quantization passes spent looking for the step, at most
MODEL_AIM = 0.995     # the model aims this close under the target (its bins are approximate)
RETRY_AIM = 0.96      # a step solved from measured errors aims this far under the target
CLOSE_ENOUGH = 0.5    # a step whose error² is under this share of the target² is widened
FLOOR_AIM = 0.865     # the first aim of a floored tensor (see uniform_quantize)
NONNEG_FLOOR = 0.25  # a tensor without negative values restores each element >= 1/4 of it
DEADZONE = 0.6     # round magnitudes up only past 0.6 of a step: more zeros, ~5% fewer bits
                   # than rounding to nearest at equal error on real deltas
SAMPLE_MIN = 1 << 17    # a floored tensor this large searches its step on a sample first
SAMPLE_BLOCK = 1024     # elements per sampled block (every SAMPLE_EVERY-th block)
SAMPLE_EVERY = 8
SAMPLE_MAX = 1 << 21    # elements in a sample at most (the stride grows beyond)
SAMPLE_TRIES = 5        # quantizations of the sample, at most
SAMPLE_AIM = 0.94       # the sample's step aims this far under the target, and is taken
SAMPLE_CLOSE = 0.9      # once a sample's scaled error² lands within this share of it


@lru_cache(maxsize=None)
def zigzag_levels(bits: int) -> np.ndarray:
    """Symbol -> signed level: 0, -1, 1, -2, 2, ... (``2**bits`` symbols; read-only, one
    array per ``bits``)."""
    s = np.arange(1 << bits, dtype=np.int64)
    out = np.where(s & 1, -((s + 1) >> 1), s >> 1)
    out.flags.writeable = False
    return out


def uniform_table(step: float, bits: int, dtype) -> np.ndarray:
    """What each symbol adds to the reference: ``level * step`` rounded once to ``dtype``.

    The encoder and the decoder both take the table from here, so they add the very same
    floats and their references stay bit-identical.
    """
    return (zigzag_levels(bits) * float(step)).astype(dtype)   # int64 x float: float64


_U4, _U8 = np.dtype("<u4"), np.dtype("<u8")


def escape_index_dtype(n: int):
    """The dtype a blob of ``n`` elements stores its escapes' indices in."""
    return _U4 if n < (1 << 32) else _U8


@dataclass
class Uniform:
    """A delta coded by the uniform quantizer, with the reconstruction it leads to. Its
    escapes are a bitmap until :attr:`esc_idx` or :attr:`esc_val` is asked for: a try the
    search drops, or one with so many escapes that the tensor is stored exactly, never
    lists them (12 bytes each: an early Adam delta peaked while its tries listed theirs).

    Without held symbols (``sym`` None: ``uniform_quantize(..., count=modes)``) a chunk's
    symbols are quantized again when it is coded (:meth:`chunk_symbols`), and the
    histograms the entropy coder's analysis needs were counted by the quantizing pass
    (:attr:`counted`). Either reads the reference, so both come before it advances."""
    sym: np.ndarray | None     # uint8 [n], or None (see above)
    sym_hist: np.ndarray       # int64 [nchunks, 2**bits]
    bits: int
    step: float
    table: np.ndarray          # [2**bits] in the work dtype (see uniform_table)
    escf: np.ndarray           # uint8 [ceil(n / 8)]: escape flags, bit i % 8 of byte i // 8
    escapes: int               # how many elements are stored exactly
    source: np.ndarray         # the state the escaped values are read from
    residual_sq: float         # ||u - ũ||^2, measured on the reconstruction itself
    target_sq: float           # ||u||^2
    _listed: tuple | None = None
    quantizer: "_Chunks | None" = None   # how to quantize a chunk again (``sym`` None)
    counted: dict | None = None          # the analysis' counts (``sym`` None; see
                                         # lcckpt.codec.entropy.count_chunk)

    def chunk_symbols(self, c: int, out: np.ndarray) -> np.ndarray:
        """Chunk ``c``'s symbols, written into ``out`` (at least a chunk long; ``sym``
        None only). Call it before the reference advances over that chunk."""
        self.quantizer.symbols(c, out)
        return out

    def symbols(self) -> np.ndarray:
        """Every symbol (quantized again into a new array when they are not held, from
        the reference as it is before it advances)."""
        if self.sym is not None:
            return self.sym
        n, cs = self.source.size, self.quantizer.chunk_size
        out = np.empty(n, np.uint8)
        for c in range(-(-n // cs)):
            self.quantizer.symbols(c, out[c * cs:min(n, (c + 1) * cs)])
        return out

    @property
    def esc_idx(self) -> np.ndarray:
        """The escaped elements, sorted, in the blob's index dtype (:func:`escape_index_dtype`)."""
        return self._escaped()[0]

    @property
    def esc_val(self) -> np.ndarray:
        """Their values, in the work dtype."""
        return self._escaped()[1]

    def _escaped(self) -> tuple:
        if self._listed is None:     # indices in the blob's own dtype: no second copy
            n = self.source.size
            idx = np.empty(self.escapes, escape_index_dtype(n))
            idx = idx[:uk.list_bits(self.escf, n, idx)]
            val = np.empty(idx.size, self.source.dtype)
            uk.take(self.source, idx, val)
            self._listed = (idx, val)
        return self._listed

    def reconstruction(self, ref: np.ndarray | None) -> np.ndarray:
        """What the decoder restores from ``ref`` (None: zeros), as a new array. The
        encoder itself never builds it: the reference advances while the symbols are
        entropy-coded (:func:`lcckpt.codec.tensor.encode_uniform`)."""
        sym = self.symbols()
        out = np.zeros(sym.size, self.table.dtype) if ref is None else ref.copy()
        nz = sym != 0
        out[nz] += self.table[sym[nz]]
        out[self.esc_idx] = self.esc_val
        return out

    @property
    def rel_error(self) -> float:
        """||u - ũ||₂ / ||u||₂ of the restored tensor, exactly (fp32 rounding included)."""
        if self.target_sq == 0:
            return 0.0 if self.residual_sq == 0 else float("inf")
        return float(np.sqrt(self.residual_sq / self.target_sq))


def _entropy(counts: np.ndarray) -> float:
    c = counts[counts > 0].astype(np.float64)
    t = c.sum()
    return float(-(c * np.log2(c / t)).sum()) if t else 0.0


@dataclass
class _Chunks:
    """One try's quantization, kept to be run again a chunk at a time (the same kernel
    call on the chunk's slices: the same symbols, bit for bit)."""
    u: np.ndarray
    ref: np.ndarray
    use_ref: bool
    chunk_size: int
    args: tuple         # step, up, floor, rstep, S, table, limit, use_limit

    def symbols(self, c: int, out: np.ndarray, esc=None, hist=None) -> np.ndarray:
        """Chunk ``c``'s symbols into ``out[:len]`` (escape flags and counts into ``esc``
        and ``hist`` if given, else thrown away); returns the error² of the chunk."""
        cs, n = self.chunk_size, self.u.size
        lo, hi = c * cs, min(n, (c + 1) * cs)
        if esc is None:
            esc = np.zeros(-(-(hi - lo) // 8), np.uint8)
        if hist is None:
            hist = np.zeros(self.args[4], np.int64)
        return uk.quantize_range(self.u[lo:hi], self.ref[lo:hi], self.use_ref, 0, hi - lo,
                                 *self.args, out, esc, hist)


def _try_args(hist, step, up, floor, rstep, limit, dtype) -> tuple:
    """``(estimated bytes, bits, args)`` of a try with the level histogram ``hist``: the
    symbol width of fewest estimated bytes, and the quantizer's arguments from ``step`` on
    (:func:`lcckpt.codec.kernels.uniform.quantize_range`).

    The widths from the narrowest up to the first without escapes are the candidates,
    the narrowest of the cheapest chosen. They are weighed from the widest down, and one
    whose escapes and table alone cost more than the best so far is not weighed (its
    estimate only adds the symbols' entropy to that): the same choice and estimate, for
    fewer entropy evaluations (a small tensor's tries spent more in them than in
    quantizing)."""
    per_escape = 4 + np.dtype(dtype).itemsize
    escs = [int(hist[1 << b:].sum()) for b in UNIFORM_BITS]     # counts beyond each width
    last = next((i for i, e in enumerate(escs) if e == 0), len(escs) - 1)
    best = None
    for i in range(last, -1, -1):
        b, esc = UNIFORM_BITS[i], escs[i]
        S = 1 << b
        if best is not None and esc * per_escape + (S if b > 4 else 0) / 2 > best[0]:
            continue
        h = hist[:S].copy()
        h[0] += esc
        est = _entropy(h) / 8 + esc * per_escape + (S if b > 4 else 0) / 2
        if best is None or est <= best[0]:
            best = (est, b)
    est, b = best
    lim = float(limit) if limit is not None else 0.0
    return est, b, (float(step), up, floor, float(rstep), 1 << b,
                    uniform_table(rstep, b, dtype), lim, limit is not None)


def _try_step(u, ref, step, chunk_size, deadzone=DEADZONE, limit=None, floor=0.0, hist=None,
              rstep=None, sym=None, count=None):
    """Quantize ``u - ref`` with ``step``: the symbol width of fewest estimated bytes,
    escapes for levels beyond it; returns (Uniform, estimated bytes). Two chunk-parallel
    passes: the level histogram, then symbols and reconstruction.

    ``deadzone``: a magnitude rounds up past ``deadzone`` of a step (0.5: to nearest).
    ``limit``: the largest finite value of the stored dtype (fp16, bf16); an element the
    step would carry past it becomes an escape, so no restored value overflows.
    ``floor``: for a tensor without negative values, no element restores below ``floor``
    times its value (levels are raised; see :mod:`lcckpt.codec.kernels.uniform`).
    ``hist``: the symbol histogram (``[257]``, the last bin all beyond) when the caller
    has it already (:class:`ErrorModel`); then one pass. ``rstep``: the step levels are
    restored with (default ``step``; see :meth:`ErrorModel.recon_step`). ``sym``: a
    buffer of ``u.size`` bytes to write the symbols into (a dropped try's, so that a
    later try faults in no fresh pages). ``count``: the entropy coder's modes; hold no
    symbols (each chunk's go to a per-thread buffer and are dropped), but count the
    runs letters the coder's analysis needs (:func:`lcckpt.codec.entropy.count_chunk`;
    grouped letters, seldom needed, are counted later from the chunks made again)."""
    rstep = step if rstep is None else rstep
    n = u.size
    nch = -(-n // chunk_size)
    use_ref = ref is not None
    r = ref if use_ref else u
    up = 1.0 - deadzone
    if hist is None:
        levels = np.zeros((nch, 257), np.int64)

        def pass1(c):
            uk.level_histogram(u, r, use_ref, c * chunk_size, min(n, (c + 1) * chunk_size),
                               float(step), up, floor, float(rstep), levels[c])
        run_tasks(pass1, nch)
        hist = levels.sum(axis=0)
    est, b, args = _try_args(hist, step, up, floor, rstep, limit, u.dtype)
    S = 1 << b
    table = args[5]
    escf = np.zeros(-(-n // 8), np.uint8)               # escape flags, a bit each
    sym_hist = np.zeros((nch, S), np.int64)
    errs = np.zeros(nch)
    chunks = counted = None
    if count is None:
        sym = _memory.bulk_empty(n, np.uint8) if sym is None else sym   # every byte is written

        def pass2(c):
            errs[c] = uk.quantize_range(u, r, use_ref, c * chunk_size,
                                        min(n, (c + 1) * chunk_size), *args, sym, escf,
                                        sym_hist[c])
    else:
        sym, chunks, counted = None, _Chunks(u, r, use_ref, chunk_size, args), {}
        if entropy.RUNS in count:
            counted["runs"] = (np.zeros((nch, entropy.alphabet(entropy.RUNS, b)),
                                        entropy.LETTERS), np.zeros(nch, np.int64))

        def pass2(c):
            lo = c * chunk_size
            k = min(n, lo + chunk_size) - lo
            buf = entropy.chunk_buffer(chunk_size)
            errs[c] = chunks.symbols(c, buf, escf[lo // 8:(lo + k + 7) // 8], sym_hist[c])
            entropy.count_chunk(buf, 0, k, b, counted, c, sym_hist)
    run_tasks(pass2, nch)
    uq = Uniform(sym, sym_hist, b, float(rstep), table, escf, int(uk.count_bits(escf)), u,
                 float(errs.sum()), 0.0, quantizer=chunks, counted=counted)
    return uq, est


def _next_step(oks: list, misses: list, aim_sq: float, model: ErrorModel, up: float):
    """The step to try next, from the tries so far (``(step, measured error²)`` that met
    the target, and that missed it), or None when they leave nothing to try.

    The error is taken as ``c·step^k`` locally and solved for ``aim_sq``: between the
    two tries that bracket the target (kept strictly inside the bracket), else from the
    last two tries on the same side, else with the error model's own slope (at least 1:
    the model does not see the floor of a tensor without negative values, and a step cut
    too far costs bits in every file). ``k`` is not 2: with the dead zone and the floor,
    Adam's second moment measured ``k`` near 1; rescaling by the square root took three
    passes to get under the target there and a fresh search of four to come back near it.
    """
    if oks and misses:
        s0, e0 = max(oks)
        s1, e1 = min(misses)
        if s1 <= s0 or e1 <= e0:
            return None
        t = 0.5                                         # where aim_sq falls, 0..1 of the way
        if e0 > 0:
            t = np.log(aim_sq / e0) / np.log(e1 / e0)
        return float(s0 * (s1 / s0) ** min(0.9, max(0.1, t)))
    side = misses if misses else oks
    s, e = side[-1]
    if e <= 0:
        return float(s * 4.0)
    k = 0.0
    if len(side) > 1 and side[-2][0] != s and side[-2][1] != e and side[-2][1] > 0:
        k = np.log(side[-2][1] / e) / np.log(side[-2][0] / s)
    if not 0.5 <= k <= 4.0:
        near = model.errors_sq(np.array([s, 0.9 * s]), up)
        k = 2.0
        if near[1] > 0 and near[0] > near[1]:
            k = min(4.0, max(1.0, np.log(near[0] / near[1]) / np.log(1 / 0.9)))
    f = (aim_sq / e) ** (1 / k)
    return float(s * (min(0.98, max(1 / 64, f)) if misses else min(4.0, max(1.02, f))))


def _search(u, ref, s, model: ErrorModel, tol_sq: float, chunk_size: int, limit, floor,
            count=None):
    """The step search from the modelled step ``s``: ``(Uniform, estimated bytes)`` of the
    cheapest try that met ``tol_sq``, or None (see :func:`uniform_quantize`).

    Every try writes its symbols into the same buffer, so the search holds one tensor's
    symbols, not two; when the cheapest try is not the last, its step is quantized again
    (the same symbols, bit for bit: the kernels are deterministic), which the search's
    exits make rare. With ``count`` (see :func:`_try_step`) no try holds symbols."""
    up = 1.0 - DEADZONE
    best, oks, misses = None, [], []
    buf, tries = None, 0
    for _ in range(STEP_TRIES):
        key = (s, model.symbol_histogram(s, up), model.recon_step(s, up))
        uq, est = _try_step(u, ref, s, chunk_size, limit=limit, floor=floor, hist=key[1],
                            rstep=key[2], sym=buf, count=count)
        buf, tries = uq.sym, tries + 1
        e = uq.residual_sq
        if e <= tol_sq:
            if best is None or est < best[1]:
                best = (uq, est, key, tries)
            if e >= CLOSE_ENOUGH * tol_sq:
                break
            oks.append((s, e))
        else:
            misses.append((s, e))
        uq = None                        # the next try's arrays replace, not join, these
        s = _next_step(oks, misses, RETRY_AIM * tol_sq, model, up)
        if s is None:
            break
    if best is None:
        return None
    uq, est, key, when = best
    if when != tries and count is None:  # a later try wrote over its symbols
        best = None
        uq, est = _try_step(u, ref, key[0], chunk_size, limit=limit, floor=floor, hist=key[1],
                            rstep=key[2], sym=buf)
    return uq, est


def _sampled_step(u, ref, s, model: ErrorModel, tol_sq: float, chunk_size: int, limit,
                  floor):
    """The step the full search should start from, solved on a sample of the tensor.

    The error model does not see the floor of a tensor without negative values: on a
    fine-tuned transformer's second moments (AdamW) the modelled step missed the target
    by 2-5x at the median and by hundreds of times at the tail, and the search spent
    three full quantizations a tensor on average. Tries of an eighth of the tensor's
    blocks find the step first (at most :data:`SAMPLE_TRIES`), each with the symbol width
    the whole tensor's histogram picks, so the full try that follows usually lands within
    the target at once. A sample that misses the tensor's worst elements only costs that
    full try's miss: the search goes on from there as before. The sample is gathered
    chunk by chunk as each try quantizes it (:mod:`lcckpt.codec.sample`), never copied.
    """
    stride, sampled = sample.blocks(u.size, SAMPLE_BLOCK, SAMPLE_EVERY, SAMPLE_MAX)
    scale = u.size / (sampled * SAMPLE_BLOCK)
    up = 1.0 - DEADZONE
    oks, misses = [], []
    for _ in range(SAMPLE_TRIES):
        _est, _b, args = _try_args(model.symbol_histogram(s, up), s, up, floor,
                                   model.recon_step(s, up), limit, u.dtype)
        e = sample.error_sq(u, ref, SAMPLE_BLOCK, stride, sampled, chunk_size, args) * scale
        if e <= tol_sq:
            oks.append((s, e))
            if e >= SAMPLE_CLOSE * SAMPLE_AIM * tol_sq:
                break
        else:
            misses.append((s, e))
        nxt = _next_step(oks, misses, SAMPLE_AIM * tol_sq, model, up)
        if nxt is None:
            break
        s = nxt
    return max(oks)[0] if oks else s


def uniform_quantize(u: np.ndarray, ref: np.ndarray | None, target: float,
                     chunk_size: int, limit: float | None = None,
                     surveyed: Survey | None = None, count=None) -> Uniform:
    """Code ``u - ref`` so that the *restored* tensor meets ``||u - ũ||₂ <= target·||u||₂``.

    ``ũ = ref + level·step`` (levels are integers, magnitudes rounded with a small dead
    zone, :data:`DEADZONE`), so every element is off by at most ``0.6·step`` and,
    because ``ref`` is the decoder's own reconstruction, the error does not build up
    along a chain: each step measures it afresh against the true ``u``. The step is
    searched: first the one the error model predicts (:class:`ErrorModel`), then steps
    solved from the errors the tries measure (:func:`_next_step`), at most
    :data:`STEP_TRIES` quantizations, until one meets the target with an error² of at
    least :data:`CLOSE_ENOUGH` of the target's; ``2·target·rms(u)`` (for which the max-error bound alone guarantees the
    target) is the last resort. The cheapest step whose measured error meets the target
    wins. Levels beyond 8-bit symbols, and every change when
    ``target == 0``, are escapes: elements stored exactly. The returned error is measured
    on the reconstruction itself; if even the last resort misses (fp rounding under a tiny
    target) the caller stores the tensor exactly.

    A tensor without negative values (a second moment, a running variance: something a
    step divides by, often through a square root) never restores an element below
    :data:`NONNEG_FLOOR` of its value, nor below zero: plain rounding would set its small
    elements to 0 and a resumed Adam would divide by ``sqrt(0) + eps``. The error model
    does not see that floor: on the save benchmark's second moments its first step missed
    the target by 1-13% and took a second quantization pass nearly every time, so a
    floored tensor's first aim is :data:`FLOOR_AIM` of the target (after which its first
    tries landed at 0.86-0.93 of it, at the same bytes). On a fine-tune's second moments
    it missed by far more, so a large floored tensor finds its step on a sample first
    (:func:`_sampled_step`).

    ``surveyed``: the :func:`survey` of ``u`` and ``ref`` when the caller took it already
    (a chain's delta takes it once, with the movement sketch). ``count``: hold no
    symbols, for a delta coded as a file takes it (see :func:`_try_step`).
    """
    n = u.size
    sv = survey(u, ref) if surveyed is None else surveyed
    if not sv.finite:
        raise NonFiniteError(
            "the state holds NaN/Inf values, which the uniform quantizer cannot bound; "
            "check the state for divergence, or store this step as an exact keyframe")
    norm_u = sv.norm_sq
    tol_sq = target * target * norm_u
    rms = np.sqrt(norm_u / n) if n else 0.0
    floor = NONNEG_FLOOR if n and sv.least >= 0 else 0.0   # never steered (survey)
    best = None
    if target == 0 or rms == 0:                  # every change an escape
        uq, est = _try_step(u, ref, 0.0, chunk_size, limit=limit, floor=floor, count=count)
        if uq.residual_sq <= tol_sq:
            best = (uq, est)
    else:                               # the modelled step, then steps solved from what
        aim = FLOOR_AIM if floor > 0 else MODEL_AIM     # the tries measure
        up, start = 1.0 - DEADZONE, SQRT12 * target * rms
        s = sv.model.step_for(aim * tol_sq, up, start)
        if sv.model.direction is not None:      # a steered step errs more than modelled
            base = sv.model.error_sq(s, up)
            more = sv.model.steered_excess_sq(s, up)
            if more > 0 and base > 0:
                s = sv.model.step_for(aim * tol_sq * base / (base + more), up, start)
        if floor > 0 and n >= SAMPLE_MIN:
            s = _sampled_step(u, ref, s, sv.model, tol_sq, chunk_size, limit, floor)
        best = _search(u, ref, s, sv.model, tol_sq, chunk_size, limit, floor, count)
    if best is None and target > 0 and rms > 0:          # the guaranteed step
        uq, est = _try_step(u, ref, 2 * target * rms, chunk_size, 0.5, limit, floor,
                            count=count)
        if uq.residual_sq <= tol_sq:
            best = (uq, est)
    if best is None:
        return None
    uq = best[0]
    uq.target_sq = norm_u
    return uq
