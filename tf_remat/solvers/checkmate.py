"""Checkmate: rematerialization as a mixed-integer program, and its LP relaxation with rounding.

The frontier-advancing formulation of Checkmate over the stages of ``graph.order`` (stage ``t``
computes ``order[t]`` for the first time; positions ``p`` stand for ``order[p]``):

* ``R[t,k]`` (binary, ``k <= t``): k is computed in stage t; ``R[t,t] = 1``.
* ``S[t,k]`` (binary, ``k < t <= n``): k is resident when stage t starts; ``S[n,o] = 1`` for
  the outputs (resident at the end).
* ``FREE[t,i,k]`` (in [0, 1]): i is freed right after k is computed in stage t, for every edge
  ``i -> k`` and for ``i = k`` (a value no one reads is freed at once: the own-output hazard).
  Freeing is only ever good for memory, so only its hazards bound it: ``FREE <= R[t,k]``,
  ``FREE <= 1 - S[t+1,i]`` and ``FREE <= 1 - R[t,j]`` for every later reader j of i in the
  stage. This disaggregated linearization is tighter than the paper's single aggregated row
  and lets FREE be continuous: at integral R, S its largest value is 0 or 1.
* ``U[t,k]`` (continuous): memory right after computing k in stage t,
  ``U[t,0] = sum_i S[t,i] m_i + R[t,0] m_0`` and
  ``U[t,k] = U[t,k-1] + R[t,k] m_k - sum_i FREE[t,i,k-1] m_i``, with
  ``U <= budget - fixed_memory``.
* Rows: ``R[t,k] <= R[t,i] + S[t,i]`` per edge (inputs resident), ``S[t+1,i] <= S[t,i] +
  R[t,i]`` (a value is kept only if it was there), and ``R[t,i] + S[t,i] <= 1`` (a resident
  value is never recomputed: it would be counted twice; no staged plan needs it).
* Objective: ``sum R[t,k] cost_k`` (the first computations are a constant).

Memory is in units of the GCD of the sizes and cost in units of the GCD of the costs when they
are integers (:class:`~tf_remat.solvers._staged.Scaling`), so integral solutions are exact. The
model is built with ``scipy.sparse`` from index arithmetic, no Python loop over its entries.

Notes:
    Jain, Jain, Nrusimha, Gholami, Abbeel, Keutzer, Stoica, Gonzalez: "Checkmate: Breaking the
    Memory Wall with Optimal Tensor Rematerialization", MLSys 2020 (§4 the MILP, §5 the LP
    relaxation and two-phase rounding). HiGHS is used through the bindings SciPy vendors
    (:func:`~tf_remat.solvers._staged.highs_core`), which take a warm start and report
    incumbents and the dual bound through callbacks. HiGHS does not look at the clock in every
    phase, so a large model under a time limit is solved in a child process that is killed at
    the deadline (:mod:`~tf_remat.solvers._highs_worker`).
"""

from __future__ import annotations

import math
import time

import numpy as np
import scipy.sparse as sp

from tf_remat.errors import StrategyError
from tf_remat.graph import Graph
from tf_remat.plan import Schedule, minimal_r, sequence_from_rs
from tf_remat.solvers import register
from tf_remat.solvers._highs_worker import HighsWorker, should_isolate
from tf_remat.solvers._staged import (Deadline, Positions, Scaling, check_hint, evaluate,
                                      highs_core, sequence_from_stages, staged_hints)

__all__ = ["checkmate_milp", "checkmate_lp_rounding", "CheckmateModel"]

_MILP_OPTIONS = {
    "max_nonzeros": (int, 20_000_000, "skip HiGHS above this many matrix entries and return "
                                      "the first plan"),
    "hint": (tuple, None, "a compute sequence to warm-start from (Python API)"),
}
_LP_OPTIONS = {
    "samples": (int, 32, "randomized roundings per allowance"),
    "first_plans": (bool, True, "also keep the exact solvers' first plans (gap program, "
                                "greedy) when no rounding beats them"),
    "max_nonzeros": (int, 20_000_000, "skip the LP above this many matrix entries"),
    "hint": (tuple, None, "a compute sequence kept when no rounding beats it (Python API)"),
}


@register("checkmate-milp", "Checkmate MILP on HiGHS: frontier-advancing stages of the graph's "
                            "order, optimal for that order", options=_MILP_OPTIONS, exact=True)
def checkmate_milp(graph: Graph, budget: int, *, time_limit=None, seed: int = 0,
                   progress=None, max_nonzeros: int = 20_000_000, hint=None) -> Schedule:
    """Solve the Checkmate MILP (module notes) with HiGHS, warm-started from the best first plan.

    Returns a Schedule: ``optimal`` when HiGHS closed the gap, else ``feasible`` with HiGHS's
    dual bound as ``lower_bound`` (a bound on every staged plan of the order).
    """
    hint = check_hint(hint, graph)
    deadline = Deadline(time_limit, reserve=_reserve(graph, time_limit))
    P = Positions(graph)
    model = CheckmateModel(P, budget)
    worker = _start_worker(graph, P, budget, model, time_limit, max_nonzeros)
    try:
        return _milp(graph, budget, P, model, worker, deadline, time_limit=time_limit,
                     seed=seed, progress=progress, max_nonzeros=max_nonzeros, hint=hint)
    finally:
        if worker is not None:
            worker.close()


def _milp(graph, budget, P, model, worker, deadline, *, time_limit, seed, progress,
          max_nonzeros, hint):
    cands = staged_hints(graph, P, budget, hint=hint, deadline=deadline,
                         gap_limit=_gap_limit(time_limit))
    first = next((c for c in cands if c[0]), None)
    info = {}
    if first is not None:
        info["first_plan"] = first[4]
        if progress is not None:
            progress(cost=first[1], peak=first[2], message=f"first plan from {first[4]}")
    info["nonzeros"] = model.nnz_estimate
    if model.nnz_estimate > max_nonzeros or deadline.left() <= 0.05:
        info["skipped"] = "model too large for max_nonzeros" if deadline.left() > 0.05 \
            else "no time left"
        return _fallback(graph, cands, info)
    warm = first[3] if first is not None else None
    if worker is not None:
        res = worker.solve(integral=True, deadline=deadline, seed=seed, progress=progress,
                           total=graph.total_cost, warm=warm, model=model)
    else:
        model.build()
        res = model.solve(integral=True, deadline=deadline, seed=seed, progress=progress,
                          total=graph.total_cost, warm=warm)
    info.update(res["info"])
    best = (first[1], sequence_from_stages(P, first[3])) if first is not None else None
    if res["stages"] is not None:
        seq = sequence_from_stages(P, res["stages"])
        ev = evaluate(graph, seq)
        if ev is not None and ev[0] <= budget and (best is None or ev[1] <= best[0]):
            best = (ev[1], seq)
    lb = None
    if res["bound"] is not None:
        lb = graph.total_cost + model.scale.true_bound(res["bound"], model.max_extra)
        if best is not None:
            lb = min(lb, best[0])
    if best is None:
        status = "infeasible" if res["status"] == "infeasible" else "timeout"
        if cands:
            return Schedule(sequence=sequence_from_stages(P, cands[0][3]), status="infeasible",
                            lower_bound=lb, info=info)
        return Schedule(sequence=(), status=status, lower_bound=lb, info=info)
    status = "feasible"
    if res["status"] == "optimal" and lb is not None and best[0] <= lb * (1 + 1e-9) + 1e-12:
        status = "optimal"
    return Schedule(sequence=best[1], status=status, lower_bound=lb, info=info)


@register("checkmate-lp-rounding", "Checkmate LP relaxation with two-phase rounding "
                                   "(deterministic and randomized), budget allowance searched",
          options=_LP_OPTIONS)
def checkmate_lp_rounding(graph: Graph, budget: int, *, time_limit=None, seed: int = 0,
                          progress=None, samples: int = 32, first_plans: bool = True,
                          max_nonzeros: int = 20_000_000, hint=None) -> Schedule:
    """Checkmate §5: solve the LP relaxation, round ``S`` and take the least ``R`` for it.

    The LP is solved at budgets ``(1 - eps) * (budget - fixed)`` for a few allowances eps (the
    paper's 0.1 is too conservative on some graphs, too loose on others); for each LP solution
    ``S`` is rounded at several thresholds and by ``samples`` Bernoulli draws, ``R`` is
    :func:`tf_remat.plan.minimal_r` of it, and the simulator keeps the cheapest plan within
    budget. The LP optimum at eps = 0 bounds every staged plan from below. With
    ``first_plans`` (default) the first plans of the exact solvers compete too, so a plan within
    budget comes back even when no rounding fits (``info["from"]`` says which won).
    """
    if samples < 0:
        raise StrategyError(f"option samples={samples} of strategy 'checkmate-lp-rounding' "
                            "must be >= 0")
    hint = check_hint(hint, graph)
    deadline = Deadline(time_limit, reserve=_reserve(graph, time_limit))
    P = Positions(graph)
    model = CheckmateModel(P, budget)
    worker = _start_worker(graph, P, budget, model, time_limit, max_nonzeros)
    try:
        return _lp_rounding(graph, budget, P, model, worker, deadline, time_limit=time_limit,
                            seed=seed, progress=progress, samples=samples,
                            first_plans=first_plans, max_nonzeros=max_nonzeros, hint=hint)
    finally:
        if worker is not None:
            worker.close()


def _lp_rounding(graph, budget, P, model, worker, deadline, *, time_limit, seed, progress,
                 samples, first_plans, max_nonzeros, hint):
    info = {}
    best = None  # (cost, seq, peak)
    if first_plans:
        cands = staged_hints(graph, P, budget, hint=hint, deadline=deadline,
                             gap_limit=_gap_limit(time_limit))
        c = next((c for c in cands if c[0]), None)
        if c is not None:
            best = (c[1], sequence_from_stages(P, c[3]), c[2])
            info["from"] = c[4]
            if progress is not None:
                progress(cost=c[1], peak=c[2], message=f"first plan from {c[4]}")
    elif hint is not None:
        ev = evaluate(graph, hint)
        if ev is not None and ev[0] <= budget:
            best = (ev[1], tuple(hint), ev[0])
            info["from"] = "hint"
    info["nonzeros"] = model.nnz_estimate
    if model.nnz_estimate > max_nonzeros:
        info["skipped"] = "model too large for max_nonzeros"
        return Schedule(sequence=best[1] if best else (), status="feasible" if best else
                        "timeout", info=info)
    if worker is None:
        model.build()
    rng = np.random.default_rng(seed)
    lb = None
    tried = 0
    over = None  # the lowest-peak rounding over budget, returned when none fits
    eps_list = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3)
    for eps in eps_list:
        if deadline.left() <= 0.05 and (eps > 0 or best is not None or over is not None):
            break
        if worker is not None:
            res = worker.solve(integral=False, deadline=deadline, seed=seed, allowance=eps)
            for key in ("isolated", "error", "build_seconds"):
                if key in res["info"]:
                    info[key] = res["info"][key]
        else:
            res = model.solve(integral=False, deadline=deadline, seed=seed, allowance=eps)
        if res["s"] is None:
            if eps == 0.0 and res["status"] == "infeasible":
                info["lp"] = "infeasible"
                break
            continue
        if eps == 0.0 and res["status"] == "optimal":
            lb = graph.total_cost + model.scale.true_bound(res["objective"] * (1 - 1e-9),
                                                           model.max_extra)
            info["lp_overhead"] = lb / graph.total_cost - 1 if graph.total_cost else 0.0
            if progress is not None:
                progress(lower_bound=lb)
        s_frac = res["s"]
        for S in _roundings(P, s_frac, rng, samples):
            # past the deadline: stop even with nothing within budget (the lowest over-budget
            # rounding is returned as infeasible; each rounding is simulated, which on large
            # graphs takes long enough to overrun the limit by many seconds)
            if deadline.left() <= 0 and (best is not None or tried > 0):
                break
            tried += 1
            seq = _plan_from_s(graph, P, S)
            if seq is None:
                continue
            ev = evaluate(graph, seq)
            if ev is None:
                continue
            if ev[0] > budget:
                if over is None or ev[0] < over[2]:
                    over = (ev[1], seq, ev[0])
                continue
            if best is None or ev[1] < best[0] - 1e-12:
                best = (ev[1], seq, ev[0])
                info["allowance"] = eps
                info["from"] = "rounding"
                if progress is not None:
                    progress(cost=ev[1], peak=ev[0], lower_bound=lb)
        if best is not None and lb is not None and best[0] <= lb * (1 + 1e-9):
            break
    info["roundings"] = tried
    if best is None:
        return Schedule(sequence=over[1] if over else (),
                        status="infeasible" if over or info.get("lp") == "infeasible"
                        else "timeout", lower_bound=lb, info=info)
    if lb is not None:
        lb = min(lb, best[0])
    status = "optimal" if lb is not None and best[0] <= lb * (1 + 1e-9) + 1e-12 else "feasible"
    return Schedule(sequence=best[1], status=status, lower_bound=lb, info=info)


def _start_worker(graph, P, budget, model, time_limit, max_nonzeros):
    """A HiGHS child process for a large model under a time limit (None: solve in process).

    Started before the first plans are searched, so that the child's start-up and model build
    overlap them.
    """
    if model.nnz_estimate > max_nonzeros or not should_isolate(model.nnz_estimate, time_limit):
        return None
    return HighsWorker(graph, P.order, budget)


def _reserve(graph, time_limit):
    if time_limit is None:
        return 0.0
    return min(0.25 * time_limit, 0.05 + 0.002 * graph.n + 0.02 * time_limit)


def _gap_limit(time_limit):
    return 30.0 if time_limit is None else max(0.5, 0.2 * time_limit)


def _fallback(graph, cands, info):
    P = Positions(graph)
    if not cands:
        return Schedule(sequence=(), status="timeout", info=info)
    c = cands[0]
    return Schedule(sequence=sequence_from_stages(P, c[3]),
                    status="feasible" if c[0] else "infeasible", info=info)


# --------------------------------------------------------------------- rounding
def _roundings(P, s_frac, rng, samples):
    """Deterministic thresholds, then Bernoulli samples, of the fractional S (n+1 x n)."""
    seen = set()
    for tau in (0.5, 0.9, 0.7, 0.3, 0.1, 0.01):
        S = s_frac >= tau - 1e-9
        key = S.tobytes()
        if key not in seen:
            seen.add(key)
            yield S
    for _ in range(samples):
        S = rng.random(s_frac.shape) < s_frac
        key = S.tobytes()
        if key not in seen:
            seen.add(key)
            yield S


def _plan_from_s(graph, P, S_pos):
    """The least R for a rounded S (positions), as a sequence; stateful nodes are kept."""
    n = P.n
    S = np.array(S_pos[:n], dtype=bool, copy=True)
    for p in np.flatnonzero(~P.recomputable):
        last = min(int(max(P.last_use[p], p)), n - 1)
        S[p + 1:last + 1, p] = True
    Sg = np.zeros((n, n), dtype=np.int8)
    Sg[:, P.order] = S
    R = minimal_r(graph, Sg.tolist())
    seq = sequence_from_rs(graph, R)
    counts = np.bincount(np.asarray(seq, dtype=np.int64), minlength=graph.n)
    if np.any((counts > 1) & ~np.asarray(graph.recomputable, dtype=bool)):
        return None
    return seq


# --------------------------------------------------------------------- the model
class CheckmateModel:
    """The Checkmate MILP of one graph, order and budget, as sparse matrices for HiGHS."""

    def __init__(self, P: Positions, budget: int):
        self.P = P
        self.n = n = P.n
        self.scale = Scaling(P, budget)
        self.budget = budget
        # free pairs f = (i, k): edges i -> k, then own outputs (k, k)
        e = P.edges
        own = np.arange(n, dtype=np.int64)
        self.fi = np.concatenate([e[:, 0], own])
        self.fk = np.concatenate([e[:, 1], own])
        nf = len(self.fi)
        self.fbase = np.concatenate([[0], np.cumsum(n - self.fk)])[:-1]
        tri = n * (n + 1) // 2
        self.nR = tri
        self.nS = tri          # S[t, k] for 1 <= t <= n, k < t
        self.nF = int((n - self.fk).sum())
        self.nU = tri
        self.offS = self.nR
        self.offF = self.offS + self.nS
        self.offU = self.offF + self.nF
        self.ncol = self.offU + self.nU
        # later readers: (pair f, reader j) with j > k_f, j a reader of i_f
        pf, pj = [], []
        succ = P.succs
        for f in range(nf):
            i, k = int(self.fi[f]), int(self.fk[f])
            for j in succ[i]:
                if j > k:
                    pf.append(f)
                    pj.append(j)
        self.hz_f = np.asarray(pf, dtype=np.int64)
        self.hz_j = np.asarray(pj, dtype=np.int64)
        hz_rows = int((n - self.hz_j).sum()) if len(pj) else 0
        self.nnz_estimate = int(3 * len(e) * n + 2 * hz_rows + 6 * tri + 3 * self.nF
                                + tri * 2)
        self.max_extra = np.maximum(0, n - 1 - np.arange(n))
        self.built = False

    # index helpers (vectorized)
    def iR(self, t, k):
        return t * (t + 1) // 2 + k

    def iS(self, t, k):
        return self.offS + (t - 1) * t // 2 + k

    def iF(self, t, f):
        return self.offF + self.fbase[f] + (t - self.fk[f])

    def iU(self, t, k):
        return self.offU + t * (t + 1) // 2 + k

    def build(self):
        P, n = self.P, self.n
        mem = self.scale.mem.astype(np.float64)
        rows, cols, vals, lo, hi = [], [], [], [], []
        nrow = 0

        def add(rr, cc, vv, lb, ub):
            nonlocal nrow
            rows.append(rr + nrow)
            cols.append(cc)
            vals.append(np.broadcast_to(np.asarray(vv, dtype=np.float64), cc.shape).ravel())
            m = int(rr.max()) + 1 if rr.size else 0
            lo.append(np.broadcast_to(np.asarray(lb, dtype=np.float64), (m,)).copy())
            hi.append(np.broadcast_to(np.asarray(ub, dtype=np.float64), (m,)).copy())
            nrow += m

        def expand(k0, base_items):
            """For items with start stage k0 (array), all t in [k0, n): (item index, t)."""
            cnt = n - k0
            idx = np.repeat(np.arange(len(k0)), cnt)
            start = np.repeat(np.cumsum(cnt) - cnt, cnt)
            t = np.arange(int(cnt.sum())) - start + np.repeat(k0, cnt)
            return idx, t

        # 1. inputs resident: R[t,k] - R[t,i] - S[t,i] <= 0 for edges (i,k), t >= k
        e = P.edges
        if len(e):
            idx, t = expand(e[:, 1], e)
            i, k = e[idx, 0], e[idx, 1]
            m = len(t)
            r = np.arange(m)
            add(np.concatenate([r, r, r]),
                np.concatenate([self.iR(t, k), self.iR(t, i), self.iS(t, i)]),
                np.concatenate([np.ones(m), -np.ones(m), -np.ones(m)]), -np.inf, 0.0)
        # 2. kept only if there: S[t+1,i] - S[t,i] - R[t,i] <= 0, i <= t (S[t,i] when i < t)
        idx, t = expand(np.arange(n), None)
        i = idx
        m = len(t)
        r = np.arange(m)
        has_s = i < t
        add(np.concatenate([r, r[has_s], r]),
            np.concatenate([self.iS(t + 1, i), self.iS(t[has_s], i[has_s]), self.iR(t, i)]),
            np.concatenate([np.ones(m), -np.ones(int(has_s.sum())), -np.ones(m)]),
            -np.inf, 0.0)
        # 3. never both resident and recomputed: R[t,i] + S[t,i] <= 1, i < t
        sel = i < t
        ti, ii = t[sel], i[sel]
        m2 = len(ti)
        r2 = np.arange(m2)
        add(np.concatenate([r2, r2]), np.concatenate([self.iR(ti, ii), self.iS(ti, ii)]),
            1.0, -np.inf, 1.0)
        # 4. FREE hazards: FREE <= R[t,k]; FREE + S[t+1,i] <= 1; FREE + R[t,j] <= 1 (j later)
        fidx, t = expand(self.fk, None)
        fcol = self.iF(t, fidx)
        m = len(t)
        r = np.arange(m)
        add(np.concatenate([r, r]), np.concatenate([fcol, self.iR(t, self.fk[fidx])]),
            np.concatenate([np.ones(m), -np.ones(m)]), -np.inf, 0.0)
        add(np.concatenate([r, r]), np.concatenate([fcol, self.iS(t + 1, self.fi[fidx])]),
            1.0, -np.inf, 1.0)
        if len(self.hz_f):
            hidx, t = expand(self.hz_j, None)
            f = self.hz_f[hidx]
            j = self.hz_j[hidx]
            m = len(t)
            r = np.arange(m)
            add(np.concatenate([r, r]), np.concatenate([self.iF(t, f), self.iR(t, j)]),
                1.0, -np.inf, 1.0)
        # 5. memory: U[t,0] - sum_i m_i S[t,i] - m_0 R[t,0] = 0
        #            U[t,k] - U[t,k-1] - m_k R[t,k] + sum_{f: k_f = k-1} m_{i_f} FREE[t,f] = 0
        T = np.arange(n)
        r0 = T  # one row per stage for k = 0
        # S terms of row t: i < t
        idx, tt = expand(np.arange(n), None)  # (i, t) with t >= i
        sel = idx < tt
        si, st = idx[sel], tt[sel]
        add(np.concatenate([r0, r0, st]),
            np.concatenate([self.iU(T, 0), self.iR(T, 0), self.iS(st, si)]),
            np.concatenate([np.ones(n), -np.full(n, mem[0]), -mem[si]]), 0.0, 0.0)
        # rows for k >= 1: index them by (t, k) with 1 <= k <= t
        kk_idx, tk = expand(np.arange(1, n), None)
        kk = kk_idx + 1
        m = len(tk)
        rk = np.arange(m)
        # row offset of (t, k): rows are ordered by k (expand over k then t)
        cnt = n - np.arange(1, n)
        kstart = np.concatenate([[0], np.cumsum(cnt)])[:-1]

        def row_of(t, k):
            return kstart[k - 1] + (t - k)

        ft_idx, ftt = expand(self.fk + 1, None)  # FREE pairs with k_f + 1 <= t < n
        valid = (self.fk[ft_idx] + 1) < n
        ft_idx, ftt = ft_idx[valid], ftt[valid]
        frows = row_of(ftt, self.fk[ft_idx] + 1)
        add(np.concatenate([rk, rk, rk, frows]),
            np.concatenate([self.iU(tk, kk), self.iU(tk, kk - 1), self.iR(tk, kk),
                            self.iF(ftt, ft_idx)]),
            np.concatenate([np.ones(m), -np.ones(m), -mem[kk], mem[self.fi[ft_idx]]]),
            0.0, 0.0)
        A = sp.csc_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                          shape=(nrow, self.ncol))
        A.sum_duplicates()
        self.A = A
        self.row_lo = np.concatenate(lo)
        self.row_hi = np.concatenate(hi)
        # bounds
        lb = np.zeros(self.ncol)
        ub = np.ones(self.ncol)
        idx, t = expand(np.arange(n), None)
        diag = idx == t
        ub_r = np.where(~P.recomputable[idx] & ~diag, 0.0, 1.0)
        ub[self.iR(t, idx)] = ub_r
        lb[self.iR(t[diag], idx[diag])] = 1.0
        # S[n, k]: outputs 1, others 0
        kn = np.arange(n)
        sn = self.iS(np.full(n, n), kn)
        lb[sn] = P.output.astype(np.float64)
        ub[sn] = P.output.astype(np.float64)
        ub[self.offU:] = float(self.scale.cap)
        self.col_lb, self.col_ub = lb, ub
        cost = np.zeros(self.ncol)
        sel = idx < t
        cost[self.iR(t[sel], idx[sel])] = self.scale.cost[idx[sel]].astype(np.float64)
        self.cost = cost
        self.built = True

    # ------------------------------------------------------------------ solutions
    def s_matrix(self, x):
        """Fractional S as an (n+1) x n array over positions (row t: start of stage t)."""
        n = self.n
        S = np.zeros((n + 1, n))
        t = np.repeat(np.arange(1, n + 1), np.arange(1, n + 1))
        k = np.arange(len(t)) - np.repeat(np.cumsum(np.arange(1, n + 1)) - np.arange(1, n + 1),
                                          np.arange(1, n + 1))
        S[t, k] = x[self.offS:self.offS + self.nS]
        return np.clip(S, 0.0, 1.0)

    def stages_from_x(self, x):
        n = self.n
        R = x[:self.nR] > 0.5
        t = np.repeat(np.arange(n), np.arange(1, n + 1))
        k = np.arange(self.nR) - np.repeat(np.cumsum(np.arange(1, n + 1)) - np.arange(1, n + 1),
                                           np.arange(1, n + 1))
        stages = [[] for _ in range(n)]
        sel = R & (k < t)
        for tt, kk in zip(t[sel], k[sel]):
            stages[int(tt)].append(int(kk))
        return stages

    def warm_start(self, stages):
        """A full column vector for a staged plan (the simulator's S, largest FREE, its U)."""
        P, n = self.P, self.n
        R = np.zeros((n, n), dtype=bool)
        for t, s in enumerate(stages):
            R[t, s] = True
            R[t, t] = True
        # copies: per position, list of [stage, last reader stage]
        S = np.zeros((n + 1, n), dtype=bool)
        latest = [-1] * n
        copy_last = {}
        for t in range(n):
            for k in list(stages[t]) + [t]:
                for u in P.preds[k]:
                    copy_last[u, latest[u]] = t
                latest[k] = t
                copy_last.setdefault((k, t), t)
        for (u, c), last in copy_last.items():
            S[c + 1:last + 1, u] = True
        for o in np.flatnonzero(P.output):
            S[latest[o] + 1:n + 1, o] = True
        x = np.zeros(self.ncol)
        idx = np.repeat(np.arange(n), np.arange(1, n + 1))
        k = np.arange(self.nR) - np.repeat(np.cumsum(np.arange(1, n + 1)) - np.arange(1, n + 1),
                                           np.arange(1, n + 1))
        x[:self.nR] = R[idx, k]
        ts = np.repeat(np.arange(1, n + 1), np.arange(1, n + 1))
        ks = np.arange(self.nS) - np.repeat(np.cumsum(np.arange(1, n + 1)) - np.arange(1, n + 1),
                                            np.arange(1, n + 1))
        x[self.offS:self.offS + self.nS] = S[ts, ks]
        # FREE: largest value its hazards allow
        nf = len(self.fi)
        cnt = n - self.fk
        fidx = np.repeat(np.arange(nf), cnt)
        t = np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt) + self.fk[fidx]
        free = R[t, self.fk[fidx]] & ~S[t + 1, self.fi[fidx]]
        free &= R[t, self.fi[fidx]] | S[t, self.fi[fidx]]
        if len(self.hz_f):
            later = np.zeros(len(t), dtype=bool)
            # for each (f, j) hazard and t >= j with R[t, j]: mark FREE[t, f] blocked
            hc = n - self.hz_j
            hidx = np.repeat(np.arange(len(self.hz_f)), hc)
            ht = np.arange(int(hc.sum())) - np.repeat(np.cumsum(hc) - hc, hc) + self.hz_j[hidx]
            blocked = R[ht, self.hz_j[hidx]]
            pos = self.fbase[self.hz_f[hidx]] + (ht - self.fk[self.hz_f[hidx]])
            np.logical_or.at(later, pos[blocked], True)
            free &= ~later
        x[self.offF:self.offF + self.nF] = free
        # U by the recursion
        mem = self.scale.mem.astype(np.float64)
        U = np.zeros((n, n))
        Sm = S[:n] * mem[None, :]
        freed = np.zeros((n, n))  # freed[t, k]: memory freed right after computing k in stage t
        np.add.at(freed, (t, self.fk[fidx]), free * mem[self.fi[fidx]])
        for tt in range(n):
            row = Sm[tt].sum() + R[tt, 0] * mem[0]
            U[tt, 0] = row
            if tt >= 1:
                inc = R[tt, 1:tt + 1] * mem[1:tt + 1] - freed[tt, 0:tt]
                U[tt, 1:tt + 1] = row + np.cumsum(inc)
        x[self.offU:] = U[idx, k]
        return x

    # ------------------------------------------------------------------ HiGHS
    def solve(self, *, integral, deadline, seed=0, progress=None, total=0.0, warm=None,
              allowance=0.0, report=None):
        """Run HiGHS; returns a dict with status, values, objective, bound, stages, s, info.

        ``s`` is :meth:`s_matrix` of an LP solution. ``report(kind, **data)``, when given, hears
        of every improving MIP solution (``"incumbent"``: objective, bound, stages) and of dual
        bound moves (``"bound"``) while HiGHS runs: the child process of
        :mod:`~tf_remat.solvers._highs_worker` streams them to a parent that may kill it.
        """
        core = highs_core()
        h = core._Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("random_seed", int(seed))
        h.setOptionValue("threads", 1)
        # HiGHS looks at the clock only between phases and in callbacks: stop it early enough
        left = deadline.left()
        if math.isfinite(left):
            left = max(0.05, 0.95 * left - 0.1 - 2e-7 * self.nnz_estimate)
            h.setOptionValue("time_limit", left)
        if integral:
            h.setOptionValue("mip_rel_gap", 0.0)
            h.setOptionValue("mip_abs_gap", 0.999 if self.scale.exact_cost else 1e-9)
            h.setOptionValue("mip_feasibility_tolerance", 1e-9)
            # symmetry detection can run for seconds without checking the clock
            h.setOptionValue("mip_detect_symmetry", False)
            # nor does feasibility jump, which runs first; the warm start makes it moot
            h.setOptionValue("mip_heuristic_run_feasibility_jump", False)
        h.setOptionValue("primal_feasibility_tolerance", 1e-9)
        lp = core.HighsLp()
        A = self.A
        lp.num_col_ = self.ncol
        lp.num_row_ = A.shape[0]
        lp.col_cost_ = self.cost
        lp.col_lower_ = self.col_lb
        ub = self.col_ub.copy()
        if allowance:
            ub[self.offU:] = math.floor(self.scale.cap * (1.0 - allowance))
        lp.col_upper_ = ub
        lp.row_lower_ = self.row_lo
        lp.row_upper_ = self.row_hi
        lp.a_matrix_.format_ = core.MatrixFormat.kColwise
        lp.a_matrix_.start_ = A.indptr
        lp.a_matrix_.index_ = A.indices
        lp.a_matrix_.value_ = A.data
        lp.a_matrix_.num_col_ = self.ncol
        lp.a_matrix_.num_row_ = A.shape[0]
        if integral:
            integ = np.zeros(self.ncol, dtype=np.uint8)
            integ[:self.offF] = 1
            lp.integrality_ = [core.HighsVarType.kInteger if v else
                               core.HighsVarType.kContinuous for v in integ]
        h.passModel(lp)
        info = {}
        if integral and warm is not None:
            sol = core.HighsSolution()
            sol.col_value = self.warm_start(warm)
            sol.value_valid = True
            h.setSolution(sol)
        unit = self.scale.cost_unit
        end = time.perf_counter() + left if math.isfinite(left) else math.inf
        types = core.cb.HighsCallbackType
        improving = int(types.kCallbackMipImprovingSolution)
        mip_interrupt = int(types.kCallbackMipInterrupt)
        state = {"bound": None, "sent": 0.0}

        def cb(kind, message, out, inp, user):
            # a callback must never raise into HiGHS
            try:
                kind = int(kind)
                if kind != improving:
                    # HiGHS checks its own time limit too rarely in presolve and the root LP:
                    # the interrupt callbacks stop it at the deadline
                    now = time.perf_counter()
                    if now > end:
                        inp.user_interrupt = True
                    if report is not None and kind == mip_interrupt and now - state["sent"] > 0.2:
                        bound = self._safe_bound(float(out.mip_dual_bound))
                        if bound is not None and bound != state["bound"]:
                            state["bound"], state["sent"] = bound, now
                            report("bound", bound=bound)
                    return
                obj = float(out.mip_primal_bound)
                bound = float(out.mip_dual_bound)
                if report is not None and math.isfinite(obj):
                    stages = self.stages_from_x(np.asarray(out.mip_solution))
                    report("incumbent", objective=obj, bound=self._safe_bound(bound),
                           stages=stages)
                if progress is not None:
                    cost = total + obj * unit if math.isfinite(obj) else None
                    lbv = total + self.scale.true_bound(bound, self.max_extra) \
                        if math.isfinite(bound) else None
                    progress(cost=cost, lower_bound=lbv)
            except Exception:  # noqa: BLE001
                return

        h.setCallback(cb, None)
        kinds = [types.kCallbackSimplexInterrupt, types.kCallbackIpmInterrupt]
        if integral:
            kinds.append(types.kCallbackMipInterrupt)
            if progress is not None or report is not None:
                kinds.append(types.kCallbackMipImprovingSolution)
        for kind in kinds:
            h.startCallback(kind)
        t0 = time.perf_counter()
        h.run()
        info["highs_seconds"] = round(time.perf_counter() - t0, 3)
        ms = h.getModelStatus()
        hinfo = h.getInfo()
        status = {core.HighsModelStatus.kOptimal: "optimal",
                  core.HighsModelStatus.kInfeasible: "infeasible",
                  core.HighsModelStatus.kTimeLimit: "timeout",
                  core.HighsModelStatus.kInterrupt: "timeout"}.get(ms, "other")
        info["highs_status"] = h.modelStatusToString(ms)
        out = {"status": status, "values": None, "objective": None, "bound": None,
               "stages": None, "s": None, "info": info}
        has_sol = int(hinfo.primal_solution_status) == int(core.kSolutionStatusFeasible)
        if has_sol:
            x = np.asarray(h.getSolution().col_value)
            out["values"] = x
            out["objective"] = float(hinfo.objective_function_value)
            if integral:
                out["stages"] = self.stages_from_x(x)
            else:
                out["s"] = self.s_matrix(x)
        if integral:
            out["bound"] = None if status == "infeasible" else \
                self._safe_bound(float(hinfo.mip_dual_bound))
            info["mip_gap"] = float(hinfo.mip_gap) if has_sol else None
        return out

    def _safe_bound(self, bound):
        """HiGHS's dual bound less its tolerance (rounded up for integral costs), or None."""
        if not math.isfinite(bound):
            return None
        tol = max(1e-6, 1e-5 * abs(bound))
        bound = math.ceil(bound - tol) if self.scale.exact_cost else bound - tol
        return max(0.0, bound)
