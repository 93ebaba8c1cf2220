"""Expected cost of a checkpoint schedule, and the dynamic program that minimises it.

The model (stated in full in docs/scheduler.md): the job is cut into segments
``(b, e]`` between checkpoints. An attempt at a segment runs iterations b+1..e and
then the blocking checkpoint (the stall); a failure anywhere in the attempt rolls
back to the checkpoint at b, costs the downtime and a restart (which can itself
fail) and the attempt starts again. With failure hazard ``A`` accumulated over
work, iteration m runs ``exp(A_e + a_C - A_{m-1})`` times in expectation
(memoryless failures). Lost work is weighted by ``u(k)``; stalls, restarts and
downtime are plain seconds. Termination (the job stops after iteration K) cuts
the segment that holds K short and skips its checkpoint. A checkpoint waits for
the previous one's background persist (backpressure), and a failure during its
own persist window also loses the segment before it (durability lag, charged to
first order).

Nothing here is first-order in the failure rate except that lag term. This module
does not choose candidates or policies; :mod:`lcckpt.schedule.solver` does.
"""

from __future__ import annotations

import numpy as np

from .problem import Problem

_TIE = 1e-10


def _per_iteration(prob: Problem, u: np.ndarray):
    lam, tau = prob.lam, prob.tau
    x = lam * tau
    a = np.concatenate([[0.0], np.cumsum(x)])
    with np.errstate(divide="ignore", invalid="ignore"):
        f = u * np.where(lam > 0, -np.expm1(-x) / np.where(lam > 0, lam, 1.0), tau)
    return a, f


def _restart_terms(prob: Problem, points: np.ndarray):
    """Per failure, restarting from checkpoint ``points``: (cost, restart s, downtime s, failures)."""
    h = prob.horizon
    lr = prob.lam[np.minimum(points, h - 1)]
    r = prob.restart[points]
    y = lr * r
    with np.errstate(divide="ignore", invalid="ignore"):
        rs = np.where(lr > 0, np.expm1(y) / np.where(lr > 0, lr, 1.0), r)
    ey = np.exp(y)
    down = prob.downtime * ey
    return rs + down, rs, down, ey


def _stall(lam_s, length):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(lam_s > 0, np.expm1(lam_s * length) / np.where(lam_s > 0, lam_s, 1.0), length)


def evaluate(prob: Problem, u: np.ndarray, survival: np.ndarray, iterations) -> dict:
    """Expected overhead components of a given schedule (checkpoints after ``iterations``).

    Returns seconds (lost work in ``u``-weighted seconds): ``total``, ``stall``,
    ``lost``, ``restart``, ``downtime``, ``lag``, and ``failures`` (a count), plus
    ``segments``: a list of per-segment dicts used by ``Plan.explain``.
    """
    h = prob.horizon
    a, f = _per_iteration(prob, u)
    s = survival
    pi = s[1:h + 1] - s[2:h + 2]
    ends = [int(k) for k in iterations if 0 < int(k) < h] + [h]
    out = dict(stall=0.0, lost=0.0, restart=0.0, downtime=0.0, lag=0.0, failures=0.0)
    segments = []
    b = 0
    for e in ends:
        kb, rs, down, nfr = (float(v[0]) for v in _restart_terms(prob, np.array([b])))
        aloc = a[b + 1:e + 1] - a[b]
        aprev = a[b:e] - a[b]
        fz = f[b:e] * np.exp(-aprev)
        pf = np.exp(aloc) * np.cumsum(fz)
        p = pi[b:e]
        work = float(np.dot(p, pf))
        nf = float(np.dot(p, np.expm1(aloc)))
        stall = lag = 0.0
        wait = 0.0
        sn = float(s[e + 1])
        if e < h and sn > 0:
            lam_s = float(prob.lam[e - 1])
            pb = float(prob.persist[b - 1]) if b > 0 else 0.0
            wait = max(0.0, pb - (prob.t[e] - prob.t[b]))
            ac = lam_s * (prob.ckpt[e - 1] + wait)
            work_ck = float(np.exp(ac) * pf[-1])
            stall_ck = float(_stall(np.float64(lam_s), np.float64(prob.ckpt[e - 1] + wait)))
            nf_ck = float(np.expm1(ac + aloc[-1]))
            p_lag = float(np.expm1(lam_s * prob.persist[e - 1]))
            lag = sn * p_lag * (work_ck + stall_ck + nf_ck * kb)
            work += sn * work_ck
            stall = sn * stall_ck
            nf += sn * nf_ck
        useful = float(np.dot(u[b:e] * prob.tau[b:e], s[b + 1:e + 1]))
        seg = dict(start=b, end=e, lost=work - useful, stall=stall, restart=nf * rs,
                   downtime=nf * down, lag=lag, failures=nf * nfr, wait=wait)
        for key in out:
            out[key] += seg[key]
        segments.append(seg)
        b = e
    out["total"] = out["lost"] + out["stall"] + out["restart"] + out["downtime"] + out["lag"]
    out["segments"] = segments
    return out


def dp_schedule(prob: Problem, u: np.ndarray, survival: np.ndarray, cand: np.ndarray,
                window_time: float) -> tuple[list[int], float]:
    """Minimise the expected overhead over checkpoints at candidate iterations.

    ``cand`` holds 0, the candidates, and H, increasing. Segments longer than
    ``window_time`` seconds of work are not considered. Returns (checkpoint
    iterations, expected overhead). O(M * window) with vector work per candidate.
    """
    h = prob.horizon
    a, f = _per_iteration(prob, u)
    s = survival
    pi = s[1:h + 1] - s[2:h + 2]
    m_count = cand.size - 1
    ac = a[cand]
    tc = prob.t[cand]
    # Interval j = (cand[j-1], cand[j]]; iteration m (1..H) belongs to j(m).
    m = np.arange(1, h + 1)
    j = np.searchsorted(cand, m, side="left")
    a_start = ac[j - 1]
    big_f = np.bincount(j, weights=f * np.exp(ac[j] - a[m - 1]), minlength=m_count + 1)
    z = np.cumsum(f * np.exp(-(a[m - 1] - a_start)))
    off = np.concatenate([[0.0], z])[cand[:-1]]            # cumsum before each interval
    e_rel = np.exp(a[m] - a_start)
    pf = e_rel * (z - off[j - 1])
    big_pi = np.bincount(j, weights=pi, minlength=m_count + 1)
    big_eps = np.bincount(j, weights=pi * e_rel, minlength=m_count + 1)
    big_phi = np.bincount(j, weights=pi * pf, minlength=m_count + 1)
    growth = np.exp(np.diff(ac, prepend=0.0))
    has_mass = (big_pi > 0) | (big_phi > 0) | (big_eps > 0)

    kb = _restart_terms(prob, cand)[0]
    e_it = np.maximum(cand, 1) - 1                            # array index of iteration cand[e]
    cost_c = prob.ckpt[e_it]
    lam_s = prob.lam[e_it]
    p_b = np.where(cand > 0, prob.persist[e_it], 0.0)
    p_lag = np.expm1(lam_s * prob.persist[e_it])
    s_next = s[cand + 1]
    has_persist = bool(np.any(prob.persist > 0))
    lo_arr = np.minimum(np.searchsorted(tc, tc - window_time, side="left"), np.arange(m_count + 1) - 1)

    big_j = np.zeros(m_count + 1)
    parent = np.zeros(m_count + 1, dtype=np.int64)
    tv = np.zeros(m_count + 1)
    qv = np.zeros(m_count + 1)
    for e in range(1, m_count + 1):
        lo = int(max(lo_arr[e], 0))
        tv[e - 1] = 0.0
        qv[e - 1] = 0.0
        tsl = tv[lo:e]
        if has_mass[e]:  # the job may stop inside interval e
            e_prev = np.exp(ac[e - 1] - ac[lo:e])
            qv[lo:e] += tsl * big_eps[e] + big_phi[e] + kb[lo:e] * (e_prev * big_eps[e] - big_pi[e])
        tsl *= growth[e]
        tsl += big_f[e]
        cost = big_j[lo:e] + qv[lo:e]
        if e < m_count and s_next[e] > 0:
            length = cost_c[e]
            if has_persist:
                length = length + np.maximum(0.0, p_b[lo:e] - (tc[e] - tc[lo:e]))
            eac = np.exp(lam_s[e] * length)
            stall = _stall(lam_s[e], length) if lam_s[e] > 0 else length
            ck = eac * tsl
            ck += (eac * np.exp(ac[e] - ac[lo:e]) - 1.0) * kb[lo:e]
            ck += stall
            cost += (s_next[e] * (1.0 + p_lag[e])) * ck
        # Exact ties (e.g. the order of equal-cost gaps) are broken the same way
        # whatever the time unit: the earliest b within a relative 1e-10 wins.
        best = float(cost.min())
        i = int(np.argmax(cost <= best + _TIE * abs(best)))
        big_j[e] = cost[i]
        parent[e] = lo + i
    path = []
    e = m_count
    while e > 0:
        e = int(parent[e])
        if e > 0:
            path.append(int(cand[e]))
    useful = float(np.dot(u * prob.tau, s[1:h + 1]))
    return sorted(path), float(big_j[m_count] - useful)
