"""Shared machinery of the exact (fixed-order) solvers: the staged view of a graph.

Checkmate (Jain et al. 2020) and MOCCASIN's fixed-order variant (Bartan et al. 2023, §2.3)
search the same set of plans, the *staged* plans of a topological order: stage ``t`` computes
``order[t]`` for the first time, after recomputing some earlier nodes, each at most once and in
``order``. A staged plan is a compute sequence, and the simulator frees every value right after
its last reader, so both models and :func:`tf_remat.plan.simulate` agree on its peak. "The
fixed-order optimum" in this package is the cheapest staged plan within budget.

Everything here works in *position space*: node ``order[p]`` is position ``p``.

This module also holds what both solvers use around their models: the greedy eviction heuristic
that gives them a first plan (and the `auto` portfolio a fast one), the conversion of any compute
sequence to stages, and the exact integer scaling of memory and cost.
"""

from __future__ import annotations

import math
import os
import time
from bisect import bisect_right

import numpy as np

from tf_remat.errors import StrategyError
from tf_remat.graph import Graph
from tf_remat.plan import simulate, steps_from_sequence

__all__ = ["Positions", "stages_from_sequence", "sequence_from_stages", "greedy_stages",
           "staged_hints", "Scaling", "Deadline", "check_hint", "evaluate", "gap_stages",
           "highs_core"]


class Positions:
    """A graph seen through a topological order: arrays indexed by position."""

    def __init__(self, graph: Graph, order=None):
        order = tuple(graph.order if order is None else order)
        n = graph.n
        self.graph = graph
        self.n = n
        self.order = np.asarray(order, dtype=np.int64)
        pos = np.empty(n, dtype=np.int64)
        pos[self.order] = np.arange(n)
        self.pos = pos
        self.mem = np.asarray(graph.memory, dtype=np.int64)[self.order]
        self.cost = np.asarray(graph.cost, dtype=np.float64)[self.order]
        self.recomputable = np.asarray(graph.recomputable, dtype=bool)[self.order]
        self.output = np.zeros(n, dtype=bool)
        self.output[pos[list(graph.outputs)]] = True
        self.preds = [sorted(int(pos[u]) for u in graph.preds[v]) for v in order]
        self.succs = [sorted(int(pos[w]) for w in graph.succs[v]) for v in order]
        for p in range(n):
            if any(u >= p for u in self.preds[p]):
                raise ValueError("order is not topological")
        e = [(u, p) for p in range(n) for u in self.preds[p]]
        self.edges = np.asarray(e, dtype=np.int64).reshape(-1, 2)
        # last stage in which the value is read by a first computation (n: an output)
        self.last_use = np.array([max(s) if s else -1 for s in self.succs], dtype=np.int64)
        self.last_use[self.output] = n
        self.fixed = int(graph.fixed_memory)

    def nodes(self, positions) -> list:
        return [int(self.order[p]) for p in positions]


# --------------------------------------------------------------------- staged sequences
def stages_from_sequence(P: Positions, sequence, *, repair: bool = True):
    """The stages of a compute sequence: ``stages[t]`` lists the positions recomputed in stage t.

    A sequence is staged when first computations follow ``P.order`` and the recomputations
    before each first computation are increasing positions. With ``repair`` the recomputations
    of a stage are sorted and deduplicated (the plan may then peak differently: simulate it).
    Returns None when first computations leave the order or a recomputation follows the last
    first computation.
    """
    n = P.n
    stages = [[] for _ in range(n)]
    frontier = 0
    pending: list = []
    for v in sequence:
        p = int(P.pos[int(v)])
        if p == frontier:
            stages[frontier] = pending
            pending = []
            frontier += 1
        elif p < frontier:
            if frontier >= n:
                return None
            pending.append(p)
        else:
            return None
    if frontier < n or pending:
        return None
    for t in range(n):
        s = stages[t]
        if any(b <= a for a, b in zip(s, s[1:])):
            if not repair:
                return None
            stages[t] = sorted(set(s))
    return stages


def sequence_from_stages(P: Positions, stages) -> tuple:
    seq = []
    order = P.order
    for t, s in enumerate(stages):
        seq.extend(int(order[p]) for p in s)
        seq.append(int(order[t]))
    return tuple(seq)


def evaluate(graph: Graph, sequence):
    """``(peak, cost)`` of a compute sequence by the simulator, or None if it is invalid."""
    try:
        sim = simulate(graph, steps_from_sequence(graph, sequence))
    except Exception:  # noqa: BLE001 - an invalid hint is simply not used
        return None
    return sim.peak_memory, sim.cost


# --------------------------------------------------------------------- greedy heuristic
def greedy_stages(P: Positions, budget: int, *, alpha: float = 1.0, beta: float = 1.0,
                  depth: int = 3):
    """A staged plan by eviction: run ``order``, and when the next computation does not fit,
    drop resident values (far next use, large, cheap to recompute first), recomputing them,
    with their dropped inputs, right before their next reader.

    The eviction score of a resident value is ``(next_use - t)**alpha * size / recost**beta``.
    Returns ``(stages, fits)``; ``fits`` is False when some computation could not be made to
    fit (the plan is then over budget).
    """
    n = P.n
    cap = budget - P.fixed
    mem_of, cost_of = P.mem, P.cost
    preds, succs = P.preds, P.succs
    last_use = P.last_use
    evictable = P.recomputable & ~P.output
    resident = np.zeros(n, dtype=bool)
    next_use = np.full(n, n + 1, dtype=np.float64)
    mem = 0
    fits = True
    stages = [[] for _ in range(n)]
    eps = max(1e-9, float(cost_of.mean()) * 1e-3 if n else 1e-9)
    memf = mem_of.astype(np.float64)
    for t in range(n):
        missing, stack = set(), [u for u in preds[t] if not resident[u]]
        while stack:
            u = stack.pop()
            if u in missing:
                continue
            missing.add(u)
            stack.extend(w for w in preds[u] if not resident[w] and w not in missing)
        todo = sorted(missing)
        todo.append(t)
        reads: dict = {}
        for k in todo:
            for u in preds[k]:
                reads[u] = reads.get(u, 0) + 1
        pinned = np.zeros(n, dtype=bool)
        pinned[todo] = True
        if reads:
            pinned[list(reads)] = True
        for k in todo:
            pinned[k] = reads.get(k, 0) > 0 or k == t
            need = int(mem_of[k])
            if mem + need > cap:
                cand = resident & evictable & ~pinned
                idx = np.flatnonzero(cand)
                if idx.size:
                    dist = np.maximum(next_use[idx] - t, 1.0)
                    recost = np.array([_recost(int(u), next_use[u], resident, preds,
                                               cost_of, last_use, depth)
                                       for u in idx])
                    score = dist ** alpha * memf[idx] / (recost + eps) ** beta
                    for a in np.argsort(-score, kind="stable"):
                        if mem + need <= cap:
                            break
                        u = idx[a]
                        resident[u] = False
                        mem -= int(mem_of[u])
                if mem + need > cap:
                    fits = False
            resident[k] = True
            mem += need
            if k != t:
                stages[t].append(k)
            for u in preds[k]:
                reads[u] -= 1
                if reads[u] == 0:
                    pinned[u] = False
                if reads[u] == 0 and last_use[u] <= t and resident[u]:
                    resident[u] = False
                    mem -= int(mem_of[u])
            if reads.get(k, 0) == 0 and last_use[k] <= t:
                resident[k] = False
                mem -= need
        for u in preds[t]:
            s = succs[u]
            i = bisect_right(s, t)
            next_use[u] = s[i] if i < len(s) else n + 1
        s = succs[t]
        next_use[t] = s[0] if s else n + 1
    return stages, fits


def _recost(u, when, resident, preds, cost_of, last_use, depth, memo=None):
    """Cost of recomputing u at stage ``when``: u and, to ``depth`` levels, the inputs that
    will not be resident then (dropped now, or dead before ``when``)."""
    if memo is None:
        memo = {}
    if u in memo:
        return memo[u]
    total = float(cost_of[u])
    memo[u] = total
    if depth > 0:
        for w in preds[u]:
            if not resident[w] or last_use[w] < when:
                total += _recost(w, when, resident, preds, cost_of, last_use, depth - 1, memo)
    memo[u] = total
    return total


def staged_hints(graph: Graph, P: Positions, budget: int, *, hint=None, deadline=None,
                 baselines: bool = True, gap_limit: float = 30.0):
    """Candidate first plans for the exact solvers, best first.

    Returns a list of ``(within, cost, peak, stages, source)``: the greedy eviction heuristic
    with a few score exponents, the gap program (:func:`gap_stages`), the fast baselines (when
    their plans are staged), and the caller's ``hint`` (repaired into stages when possible). Plans
    within budget come first, cheapest first; then over-budget ones by peak.
    """
    found = {}

    def consider(seq, source):
        if seq is None:
            return
        stages = stages_from_sequence(P, seq)
        if stages is None:
            return
        seq2 = sequence_from_stages(P, stages)
        if seq2 in found:
            return
        ev = evaluate(graph, seq2)
        if ev is None:
            return
        peak, cost = ev
        if any(len(s) != len(set(s)) for s in stages):
            return
        if not _stateful_ok(P, stages):
            return
        found[seq2] = (peak <= budget, cost, peak, stages, source)

    if hint is not None:
        consider(hint, "hint")
    consider(tuple(int(v) for v in P.order), "order")
    left = deadline.left() if deadline is not None else math.inf
    gap_time = min(gap_limit, max(0.5, 0.3 * left)) if math.isfinite(left) else gap_limit
    try:
        got = gap_stages(P, budget, time_limit=gap_time)
    except Exception:  # noqa: BLE001 - the heuristic is optional
        got = None
    if got is not None:
        consider(sequence_from_stages(P, got[0]), "gaps")
    took = 0.0
    for alpha, beta in ((1.0, 1.0), (1.0, 0.5), (2.0, 1.0), (0.5, 1.0), (1.0, 2.0)):
        # one run takes seconds on graphs of thousands of nodes (6-8 s at 2169): none is
        # started that the time left would not cover, as the last one took
        if deadline is not None and deadline.left() <= took and found:
            break
        t = time.perf_counter()
        stages, _ = greedy_stages(P, budget, alpha=alpha, beta=beta)
        took = time.perf_counter() - t
        consider(sequence_from_stages(P, stages), f"greedy({alpha},{beta})")
    if baselines and not _is_order_changed(graph, P) and graph.n <= 400:
        from tf_remat.solvers import get_strategy

        for name in ("chen-greedy", "ap-greedy"):
            if deadline is not None and deadline.left() <= 0:
                break
            try:
                sched = get_strategy(name).func(graph, budget, time_limit=None, seed=0,
                                                progress=None)
            except Exception:  # noqa: BLE001 - a baseline that fails is no hint
                continue
            consider(sched.sequence, name)
    cands = sorted(found.values(), key=lambda c: (not c[0], c[1] if c[0] else c[2]))
    return cands


def _is_order_changed(graph, P):
    return tuple(int(v) for v in P.order) != tuple(graph.order)


def _stateful_ok(P, stages):
    for s in stages:
        for p in s:
            if not P.recomputable[p]:
                return False
    return True


def check_hint(hint, graph: Graph):
    """Validate the ``hint`` option: a compute sequence (tuple of node ids) or None."""
    if hint is None:
        return None
    try:
        seq = tuple(int(v) for v in hint)
    except (TypeError, ValueError) as exc:
        raise StrategyError("option hint must be a compute sequence (a tuple of node ids, "
                            "from the Python API)") from exc
    if any(not 0 <= v < graph.n for v in seq):
        raise StrategyError(f"option hint names a node outside 0..{graph.n - 1}")
    return seq


def first_occurrence_order(seq, n):
    seen = np.zeros(n, dtype=bool)
    out = []
    for v in seq:
        if not seen[v]:
            seen[v] = True
            out.append(int(v))
    return tuple(out) if len(out) == n else None


# --------------------------------------------------------------------- scaling
class Scaling:
    """Exact integer units for memory and cost (the papers divide by a GCD).

    Memory: every size divided by their GCD, and the capacity ``budget - fixed_memory`` rounded
    down in those units, which keeps exactly the same feasible plans. Cost: when every cost is an
    integer (as in the published graphs) the GCD again, exact; otherwise costs are scaled to
    integers below ``2**30`` per node and rounded, and ``cost_bound`` turns a bound on the scaled
    objective into a bound on the true one that is never too high.
    """

    def __init__(self, P: Positions, budget: int, *, cost_max: float = 2.0 ** 30):
        mem = [int(m) for m in P.mem]
        g = 0
        for m in mem:
            g = math.gcd(g, m)
        self.mem_unit = max(1, g)
        self.mem = np.asarray([m // self.mem_unit for m in mem], dtype=np.int64)
        self.cap = (int(budget) - P.fixed) // self.mem_unit
        cost = P.cost
        self.exact_cost = (bool(np.all(np.floor(cost) == cost))
                           and float(cost.max(initial=0)) < 2 ** 52)
        if self.exact_cost:
            ci = [int(c) for c in cost]
            gc = 0
            for c in ci:
                gc = math.gcd(gc, c)
            gc = max(1, gc)
            self.cost_unit = float(gc)
            self.cost = np.asarray([c // gc for c in ci], dtype=np.int64)
            if self.cost.max(initial=0) > 2 ** 40:  # too wide for the solvers: round instead
                self.exact_cost = False
        if not self.exact_cost:
            top = float(cost.max(initial=0))
            self.cost_unit = top / cost_max if top > 0 else 1.0
            self.cost = np.round(cost / self.cost_unit).astype(np.int64)
        # how much the scaled cost can overstate a node's true cost (per computation)
        over = self.cost * self.cost_unit - cost
        self.over = np.maximum(over, 0.0)

    def true_bound(self, scaled_bound: float, max_extra) -> float:
        """A lower bound on the true recomputation cost from one on the scaled objective.

        ``max_extra[p]`` bounds how often position p can be recomputed.
        """
        lb = scaled_bound * self.cost_unit
        if not self.exact_cost:
            lb -= float(np.dot(self.over, max_extra))
            lb -= abs(lb) * 1e-12
        return max(0.0, lb)


class Deadline:
    """Wall-clock budget of one solve; ``left()`` is never negative."""

    def __init__(self, time_limit, *, reserve: float = 0.0):
        self.start = time.perf_counter()
        self.limit = None if time_limit is None else float(time_limit)
        self.reserve = reserve

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        if self.limit is None:
            return math.inf
        return max(0.0, self.limit - self.reserve - self.elapsed())


def workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


# --------------------------------------------------------------------- gap heuristic
def gap_stages(P: Positions, budget: int, *, time_limit: float = 5.0, seed: int = 0):
    """A staged plan from a small integer program over the *gaps* of the plain order.

    A gap of value u is the stretch between two consecutive reads of it (or its creation and
    first read) in ``order`` run once. Dropping u over a gap saves its memory there and costs
    one recomputation right before the read that ends the gap, in that reader's stage. Its
    inputs must then be resident: either they live there anyway (and are not dropped over that
    point themselves) or their lifetime is extended up to it. Minimizing the recomputation cost
    under the budget at every stage is a small covering program (a restriction of Checkmate's
    without cascades) that HiGHS solves in well under a second on most published graphs. When
    the budget cannot be met that way, the total excess is minimized instead.

    Returns ``(stages, fits)`` or None when nothing is over budget or nothing was found.
    """
    highspy = highs_core()

    n = P.n
    cap = int(budget) - P.fixed
    mem = P.mem
    lastp = np.maximum(P.last_use, np.arange(n))          # last stage a value is resident
    delta = np.zeros(n + 1, dtype=np.int64)
    np.add.at(delta, np.arange(n), mem)
    np.add.at(delta, np.minimum(lastp, n - 1) + 1, -mem)
    M = np.cumsum(delta)[:n]                              # memory after stage t's compute
    over = M > cap
    if not over.any():
        return None
    scale = float(max(1, int(mem.max(initial=1))))
    ocum = np.concatenate([[0], np.cumsum(over)])
    gaps = []                                            # (u, a, b)
    by_node = [[] for _ in range(n)]
    for u in range(n):
        if not P.recomputable[u] or P.output[u]:
            continue
        uses = [u] + list(P.succs[u])
        for a, b in zip(uses, uses[1:]):
            if b - a >= 2 and ocum[b] - ocum[a + 1] > 0:
                by_node[u].append((a, b, len(gaps)))
                gaps.append((u, a, b))
    if not gaps:
        return None
    ng = len(gaps)
    ext = {}                                             # (w, j) -> column
    rows_r, rows_c, rows_v, lo, hi = [], [], [], [], []

    def row(cols, vals, lb, ub):
        r = len(lo)
        rows_r.extend([r] * len(cols))
        rows_c.extend(cols)
        rows_v.extend(vals)
        lo.append(lb)
        hi.append(ub)

    for k, (u, a, b) in enumerate(gaps):
        for w in P.preds[u]:
            if lastp[w] >= b:
                for (a2, b2, k2) in by_node[w]:
                    if a2 < b < b2:
                        row([k, k2], [1.0, 1.0], -np.inf, 1.0)
            else:
                key = (w, b)
                if key not in ext:
                    ext[key] = ng + len(ext)
                row([k, ext[key]], [1.0, -1.0], -np.inf, 0.0)
    touched = set(np.flatnonzero(over).tolist())
    ext_by_node = {}
    for (w, j), col in ext.items():
        ext_by_node.setdefault(w, []).append((j, col))
    contrib = {}
    for w, lst in ext_by_node.items():
        lst.sort()
        for (j1, c1), (j2, c2) in zip(lst, lst[1:]):
            row([c2, c1], [1.0, -1.0], -np.inf, 0.0)
        k = 0
        for t in range(int(lastp[w]) + 1, lst[-1][0] + 1):
            while lst[k][0] < t:
                k += 1
            contrib.setdefault(t, []).append((lst[k][1], float(mem[w]) / scale))
            touched.add(t)
    saves = {}
    for k, (u, a, b) in enumerate(gaps):
        for t in range(a + 1, b):
            saves.setdefault(t, []).append((k, float(mem[u]) / scale))
    nvar = ng + len(ext)
    mem_rows = []
    for t in sorted(touched):
        cols = [c for c, _ in contrib.get(t, [])] + [c for c, _ in saves.get(t, [])]
        vals = [v for _, v in contrib.get(t, [])] + [-v for _, v in saves.get(t, [])]
        mem_rows.append(len(lo))
        row(cols, vals, -np.inf, (cap - int(M[t])) / scale)
    cost = np.zeros(nvar)
    top = float(P.cost.max(initial=0)) or 1.0
    for k, (u, a, b) in enumerate(gaps):
        cost[k] = P.cost[u] / top + 1e-6
    A_r = np.asarray(rows_r, dtype=np.int32)
    A_c = np.asarray(rows_c, dtype=np.int32)
    A_v = np.asarray(rows_v, dtype=np.float64)
    deadline = time.perf_counter() + max(0.05, time_limit)

    def run(with_slack):
        h = highspy._Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("random_seed", int(seed))
        h.setOptionValue("time_limit", max(0.05, deadline - time.perf_counter()))
        h.setOptionValue("threads", 1)
        ncol = nvar + (len(mem_rows) if with_slack else 0)
        c = np.zeros(ncol)
        c[:nvar] = cost
        ub = np.ones(ncol)
        r, cc, v = A_r, A_c, A_v
        if with_slack:
            big = float(cost.sum()) + 1.0
            c[nvar:] = big
            ub[nvar:] = np.inf
            r = np.concatenate([r, np.asarray(mem_rows, dtype=np.int32)])
            cc = np.concatenate([cc, np.arange(nvar, ncol, dtype=np.int32)])
            v = np.concatenate([v, -np.ones(len(mem_rows))])
        lp = highspy.HighsLp()
        lp.num_col_ = ncol
        lp.num_row_ = len(lo)
        lp.col_cost_ = c
        lp.col_lower_ = np.zeros(ncol)
        lp.col_upper_ = ub
        lp.row_lower_ = np.asarray(lo, dtype=np.float64)
        lp.row_upper_ = np.asarray(hi, dtype=np.float64)
        from scipy.sparse import csc_matrix

        A = csc_matrix((v, (r, cc)), shape=(len(lo), ncol))
        A.sum_duplicates()
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = A.indptr
        lp.a_matrix_.index_ = A.indices
        lp.a_matrix_.value_ = A.data
        integ = [highspy.HighsVarType.kInteger] * nvar
        integ += [highspy.HighsVarType.kContinuous] * (ncol - nvar)
        lp.integrality_ = integ
        h.passModel(lp)
        h.run()
        if h.getInfo().primal_solution_status != int(highspy.kSolutionStatusFeasible):
            return None, h.getModelStatus()
        return np.asarray(h.getSolution().col_value), h.getModelStatus()

    sol, status = run(False)
    fits = sol is not None
    if sol is None and deadline - time.perf_counter() > 0.05:
        sol, status = run(True)
    if sol is None:
        return None
    stages = [[] for _ in range(n)]
    for k, (u, a, b) in enumerate(gaps):
        if sol[k] > 0.5:
            stages[b].append(u)
    for s in stages:
        s.sort()
    return stages, fits


def highs_core():
    """The HiGHS bindings that SciPy vendors (``scipy.optimize._highspy._core``).

    Not the ``highspy`` wheel: it ships its own ``libhighs.so.1`` and OR-Tools ships a different
    one under the same soname, so whichever loads second in a process fails. SciPy's copy is
    linked privately and coexists with OR-Tools; it has the full ``Highs`` class (warm starts,
    callbacks, user solutions).

    Raises:
        ImportError: when this SciPy is too old to vendor it (SciPy < 1.15).
    """
    try:
        from scipy.optimize._highspy import _core
    except ImportError as exc:  # pragma: no cover - SciPy < 1.15
        raise ImportError("the exact solvers need SciPy >= 1.15 (its vendored HiGHS)") from exc
    if not hasattr(_core, "_Highs"):  # pragma: no cover
        raise ImportError("the exact solvers need SciPy >= 1.15 (its vendored HiGHS)")
    return _core
