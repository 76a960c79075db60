"""MOCCASIN: rematerialization as constraint programming over retention intervals, on CP-SAT.

Each node ``v`` gets up to ``C_v`` *retention intervals* ``[start, end)``: the first one starts
where ``v`` is first computed, every further (optional) one is a recomputation, and the value is
resident over the interval. Memory is one ``AddCumulative`` over all intervals; a computation of
``v`` at time ``s`` needs, for every input ``u``, an interval of ``u`` with ``start < s < end``.
The objective is the cost of the optional intervals present.

Notes:
    Bartan, Li, Teague, Mahajan, Zou, Niyogi: "MOCCASIN: Efficient Tensor Rematerialization for
    Neural Networks", ICML 2023. What differs here, and why:

    * Time is the staged event axis of the paper's fixed-order variant (§2.3): stage ``t``
      has one slot per position ``0..t`` (event ``t(t+1)/2 + p``), stage ``t`` ends with the
      first computation of ``order[t]``, so the model searches exactly Checkmate's staged plans
      (see :mod:`tf_remat.solvers._staged`). ``order=free`` drops the stages: one slot per
      computation and a ``NoOverlap`` of the computations (the paper's general variant).
    * Domains are exact instead of the paper's log-spaced interval lengths (which cut optimal
      plans off): a start is one of the node's own slots, an end is one slot past a reader's
      slot (or the horizon for an output's last copy). Every present recomputation must serve
      a reader; together these remove the slack the paper's model leaves to the search.
    * Precedence uses one literal per (input copy, reader copy): ``x => start_u < start_v <
      end_u``, and each present reader copy needs one of its input's literals. This is the
      paper's own alternative to the reservoir encoding; it has C_u * C_v literals per edge and
      no reservoir expansion (CP-SAT rewrites reservoirs into precedence literals of every event
      pair anyway), and it lets a hint set every variable.
    * Phase 1 (minimize ``max(peak, budget)``) runs only when no first plan is within budget;
      the first plans come from the greedy eviction heuristic, the baselines and the ``hint``
      option, and the model gives each node as many intervals as its first plan needs.
    * With ``C_v`` below the number of stages a node can be computed in, the model is a
      restriction: its bound is not a bound of the fixed-order problem, so it is reported only
      in ``info`` and the plan is never called optimal. Graphs up to ``exact_nodes`` nodes get
      enough intervals to be exact.
"""

from __future__ import annotations

import math

import numpy as np

from tf_remat.errors import StrategyError
from tf_remat.graph import Graph
from tf_remat.plan import Schedule
from tf_remat.solvers import _cpsat, register
from tf_remat.solvers._staged import (Deadline, Positions, Scaling, check_hint, evaluate,
                                      first_occurrence_order, sequence_from_stages,
                                      staged_hints, stages_from_sequence, workers)

__all__ = ["moccasin"]

_OPTIONS = {
    "C": (int, 2, "retention intervals per node (recomputations + 1)"),
    "order": (str, "fixed", "fixed: stages of the graph's order; free: any order; "
                            "hint: stages of the hint's first-computation order"),
    "exact_nodes": (int, 24, "graphs with at most this many nodes get enough intervals for "
                             "an exact model"),
    "presolve": (bool, False, "CP-SAT presolve (slow on this model)"),
    "workers": (int, 0, "CP-SAT workers (0: available cores)"),
    "hint": (tuple, None, "a compute sequence to start from (Python API)"),
}


@register("moccasin", "MOCCASIN retention-interval CP model on CP-SAT (fixed order by stages; "
                      "order=free for any order)", options=_OPTIONS, exact=True)
def moccasin(graph: Graph, budget: int, *, time_limit=None, seed: int = 0, progress=None,
             C: int = 2, order: str = "fixed", exact_nodes: int = 24, presolve: bool = False,
             workers: int = 0, hint=None) -> Schedule:
    """Solve with the MOCCASIN CP model; see the module notes for the formulation.

    Returns a Schedule whose ``lower_bound`` is CP-SAT's best bound when the model is exact for
    the fixed order (enough intervals per node), ``optimal`` only when CP-SAT proved it so.
    """
    if C < 1:
        raise StrategyError(f"option C={C} of strategy 'moccasin' must be >= 1")
    if order not in ("fixed", "free", "hint"):
        raise StrategyError(f"option order={order!r} of strategy 'moccasin' must be one of "
                            "fixed, free, hint")
    hint = check_hint(hint, graph)
    isolated = _cpsat.run_isolated("moccasin", graph, budget, time_limit=time_limit, seed=seed,
                                   progress=progress, C=C, order=order, exact_nodes=exact_nodes,
                                   presolve=presolve, workers=workers, hint=hint)
    if isolated is not None:
        return isolated
    deadline = Deadline(time_limit, reserve=_reserve(graph, time_limit))
    base_order = graph.order
    if order == "hint" and hint is not None:
        base_order = first_occurrence_order(hint, graph.n) or graph.order
    P = Positions(graph, base_order)
    fixed_is_graph = tuple(int(v) for v in P.order) == tuple(graph.order)
    cands = staged_hints(graph, P, budget, hint=hint, deadline=deadline)
    if order == "free" and hint is not None:
        ev = evaluate(graph, hint)
        if ev is not None:  # any order will do: keep the sequence itself
            cands.insert(0, (ev[0] <= budget, ev[1], ev[0], None, "hint", hint))
            cands.sort(key=lambda c: (not c[0], c[1] if c[0] else c[2]))
    model = _Model(graph, P, budget, C=C, free=(order == "free"), exact_nodes=exact_nodes,
                   cands=cands)
    sched = model.run(deadline=deadline, seed=seed, progress=progress, presolve=presolve,
                      num_workers=workers, bound_valid=fixed_is_graph and order != "free")
    if hint is not None and order == "fixed" and stages_from_sequence(P, hint) is None:
        # its first computations leave graph.order: order=hint or order=free can use it
        sched.info["hint"] = "not staged in graph.order, ignored"
    return sched


def _reserve(graph, time_limit):
    """Seconds kept back from the limit for building the plan and writing it."""
    if time_limit is None:
        return 0.0
    return min(0.25 * time_limit, 0.05 + 0.002 * graph.n + 0.02 * time_limit)


class _Model:
    """The CP-SAT model, its hints and the decoding of its solutions."""

    def __init__(self, graph, P, budget, *, C, free, exact_nodes, cands):
        self.graph, self.P, self.budget, self.free = graph, P, budget, free
        n = P.n
        self.n = n
        self.scale = Scaling(P, budget)
        self.cands = cands
        self.T = n * n
        # copies each node may need
        cmax = np.array([n - p for p in range(n)], dtype=np.int64)
        exact = (not free) and n <= exact_nodes
        self.cnum = np.empty(n, dtype=np.int64)
        hint_counts = np.zeros(n, dtype=np.int64)
        if cands:
            seq = _cand_sequence(P, cands[0])
            np.add.at(hint_counts, P.pos[np.asarray(seq, dtype=np.int64)], 1)
            hint_counts = np.maximum(hint_counts - 1, 0)
        for p in range(n):
            if not P.recomputable[p] or (not P.succs[p] and not P.output[p]):
                self.cnum[p] = 1
            elif exact:
                self.cnum[p] = cmax[p]
            else:
                self.cnum[p] = min(int(cmax[p]), max(C, 1 + int(hint_counts[p])))
        if free:
            self.cnum = np.maximum(self.cnum, 1)
            self.T = int(self.cnum.sum())
        self.exact = (not free) and bool(np.all((self.cnum >= cmax) | ~P.recomputable
                                                | self._dead()))
        self.max_extra = self.cnum - 1

    def _dead(self):
        P = self.P
        return np.array([not P.succs[p] and not P.output[p] for p in range(self.n)])

    # ------------------------------------------------------------------ build
    def ev(self, s, p):
        """Time of slot p of stage s (fixed order): stage-major, n slots per stage."""
        return s * self.n + p

    def build(self, cap_var=False):
        from ortools.sat.python import cp_model

        P, n, T, free = self.P, self.n, self.T, self.free
        m = cp_model.CpModel()
        self.m = m
        cnum = self.cnum
        self.start, self.stage, self.end, self.lit, self.itv, self.size = [], [], [], [], [], []
        mem = self.scale.mem
        true = m.new_constant(1)
        for p in range(n):
            st, sg, en, li, iv, sz = [], [], [], [], [], []
            for i in range(int(cnum[p])):
                if free:
                    s = m.new_int_var(0, T - 1, f"s{p}_{i}")
                    g = s
                    e = m.new_int_var(1, T, f"e{p}_{i}")
                else:
                    if i == 0:
                        g = p
                        s = self.ev(p, p)
                    else:
                        g = m.new_int_var(p + i, n - 1, f"g{p}_{i}")
                        s = g * n + p
                    lo = self.ev(p + i, p) + 1
                    e = m.new_int_var(lo, T, f"e{p}_{i}")
                lit = true if i == 0 else m.new_bool_var(f"l{p}_{i}")
                size = m.new_int_var(1, T, f"z{p}_{i}")
                if i == 0:
                    itv = m.new_interval_var(s, size, e, f"i{p}_{i}")
                else:
                    itv = m.new_optional_interval_var(s, size, e, lit, f"i{p}_{i}")
                st.append(s)
                sg.append(g)
                en.append(e)
                li.append(lit)
                iv.append(itv)
                sz.append(size)
            self.start.append(st)
            self.stage.append(sg)
            self.end.append(en)
            self.lit.append(li)
            self.itv.append(iv)
            self.size.append(sz)
        for p in range(n):
            li, st, en = self.lit[p], self.start[p], self.end[p]
            k = int(cnum[p])
            for i in range(1, k):
                if i >= 2:
                    m.add_implication(li[i], li[i - 1])
                m.add(st[i] >= en[i - 1]).only_enforce_if(li[i])
            if P.output[p]:
                for i in range(k):
                    if i + 1 < k:
                        m.add(en[i] == T).only_enforce_if([li[i], li[i + 1].Not()])
                    else:
                        m.add(en[i] == T).only_enforce_if(li[i])
        if free:
            comp = []
            for p in range(n):
                for i in range(int(cnum[p])):
                    if i == 0:
                        comp.append(m.new_fixed_size_interval_var(self.start[p][i], 1, f"c{p}"))
                    else:
                        comp.append(m.new_optional_fixed_size_interval_var(
                            self.start[p][i], 1, self.lit[p][i], f"c{p}_{i}"))
            m.add_no_overlap(comp)
        # precedence: literal x[u,i,v,j] = copy i of u serves copy j of v
        self.x = {}
        serves = [[[] for _ in range(int(cnum[u]))] for u in range(n)]
        for (u, v) in P.edges:
            u, v = int(u), int(v)
            for j in range(int(cnum[v])):
                opts = []
                for i in range(int(cnum[u])):
                    if not free and (u + i > n - 1 or (j == 0 and u + i > v)):
                        continue
                    x = m.new_bool_var(f"x{u}_{i}_{v}_{j}")
                    self.x[u, i, v, j] = x
                    opts.append(x)
                    serves[u][i].append(x)
                    if i > 0:
                        m.add_implication(x, self.lit[u][i])
                    if j > 0:
                        m.add_implication(x, self.lit[v][j])
                    if free:
                        m.add(self.start[u][i] + 1 <= self.start[v][j]).only_enforce_if(x)
                    elif i > 0:
                        m.add(self.stage[u][i] <= self.stage[v][j]).only_enforce_if(x)
                    m.add(self.end[u][i] >= self.start[v][j] + 1).only_enforce_if(x)
                if j == 0:
                    m.add_bool_or(opts)
                else:
                    m.add_bool_or(opts).only_enforce_if(self.lit[v][j])
        for u in range(n):
            if P.output[u]:
                continue
            for i in range(1 if not free else 0, int(cnum[u])):
                if serves[u][i]:
                    if i == 0:
                        m.add_bool_or(serves[u][i])
                    else:
                        m.add_bool_or(serves[u][i]).only_enforce_if(self.lit[u][i])
        # memory
        itvs, dem = [], []
        for p in range(n):
            if mem[p] > 0:
                for i in range(int(cnum[p])):
                    itvs.append(self.itv[p][i])
                    dem.append(int(mem[p]))
        cap = int(self.scale.cap)
        if cap_var:
            hi = max(cap, int(sum(dem)))
            self.tau = m.new_int_var(cap, hi, "tau")
            m.add_cumulative(itvs, dem, self.tau)
        else:
            self.tau = None
            m.add_cumulative(itvs, dem, cap)
        cost = self.scale.cost
        terms, coefs = [], []
        for p in range(n):
            for i in range(1, int(cnum[p])):
                if cost[p] > 0:
                    terms.append(self.lit[p][i])
                    coefs.append(int(cost[p]))
        self.obj_terms, self.obj_coefs = terms, coefs
        return m

    # ------------------------------------------------------------------ hints
    def copies_from_sequence(self, seq):
        """Per position, the copies of a sequence: lists of (start, end, readers)."""
        P, n, free, T = self.P, self.n, self.free, self.T
        copies = [[] for _ in range(n)]
        if free:
            times = list(range(len(seq)))
        else:
            stages = stages_from_sequence(P, seq, repair=False)
            if stages is None:
                return None
            times = []
            for t, s in enumerate(stages):
                times.extend(self.ev(t, p) for p in s)
                times.append(self.ev(t, t))
        latest = [-1] * n
        for k, v in enumerate(seq):
            p = int(P.pos[v])
            tm = times[k]
            for u in P.preds[p]:
                c = copies[u][latest[u]]
                c[1] = max(c[1], tm + 1)
                c[2].append((p, len(copies[p])))
            copies[p].append([tm, tm + 1, []])
            latest[p] = len(copies[p]) - 1
        for p in range(n):
            if P.output[p]:
                copies[p][-1][1] = T
        return copies

    def add_hint(self, seq):
        """Hint every variable from a compute sequence; False if it does not fit the model."""
        P, n, m = self.P, self.n, self.m
        seq = _drop_useless(P, seq)
        copies = self.copies_from_sequence(seq)
        if copies is None:
            return False
        for p in range(n):
            if len(copies[p]) > self.cnum[p]:
                return False
        m.clear_hints()
        served = set()
        for u in range(n):
            for i, (s, e, readers) in enumerate(copies[u]):
                for (v, j) in readers:
                    served.add((u, i, v, j))
        for p in range(n):
            k = int(self.cnum[p])
            for i in range(k):
                present = i < len(copies[p])
                if i > 0:
                    m.add_hint(self.lit[p][i], present)
                if present:
                    s, e, _ = copies[p][i]
                elif self.free:
                    s, e = 0, 1
                else:
                    s = self.ev(p + i, p)
                    e = s + 1
                if self.free:
                    m.add_hint(self.start[p][i], s)
                elif i > 0:
                    m.add_hint(self.stage[p][i], s // self.n)
                m.add_hint(self.end[p][i], e)
                m.add_hint(self.size[p][i], max(1, e - s))
        for key, x in self.x.items():
            m.add_hint(x, key in served)
        return True

    # ------------------------------------------------------------------ solve
    def run(self, *, deadline, seed, progress, presolve, num_workers, bound_valid):
        from ortools.sat.python import cp_model

        graph, P = self.graph, self.P
        total = graph.total_cost
        info = {"C": int(np.max(self.cnum)) if self.n else 0, "exact_model": self.exact,
                "order": "free" if self.free else "fixed"}
        best = None  # (cost, seq, within)
        if self.cands:
            c0 = self.cands[0]
            seq0 = _cand_sequence(P, c0)
            best = (c0[1], seq0, c0[0], c0[2]) if seq0 else None
            info["first_plan"] = c0[4]
            if progress is not None and c0[0]:
                progress(cost=c0[1], peak=c0[2], message=f"first plan from {c0[4]}")
        solver_status = None
        lb = None
        # small exact models are solved in seconds by one worker, deterministically (the same
        # seed gives the same plan); larger ones use every core
        nw = num_workers or (1 if self.exact and self.n <= 24 else workers())
        within_hint = best is not None and best[2]

        def params(solver, left):
            prm = solver.parameters
            prm.num_workers = nw
            prm.random_seed = seed
            prm.cp_model_presolve = presolve
            prm.log_search_progress = False
            if math.isfinite(left):
                prm.max_time_in_seconds = max(0.01, left)

        # small graphs: HiGHS decides the budget (CP-SAT cannot refute one on this model: a
        # 15-node graph just below its fixed-order minimum peak takes it minutes)
        if not within_hint and not self.free and self.n <= 60 and deadline.left() > 0:
            refuted, found = self._milp_feasibility(deadline, seed)
            info["feasibility"] = "refuted by HiGHS" if refuted else (
                "plan from HiGHS" if found else "undecided")
            if refuted and bound_valid:
                solver_status = "infeasible"
            if found is not None:
                best = found
                within_hint = True
        # phase 1: reach the budget when no first plan does
        if not within_hint and solver_status is None and deadline.left() > 0:
            self.build(cap_var=True)
            if best is not None:
                self.add_hint(best[1])
            self.m.minimize(self.tau)
            solver = cp_model.CpSolver()
            params(solver, deadline.left())
            st = solver.solve(self.m)
            if st in (cp_model.OPTIMAL, cp_model.FEASIBLE):
                seq = self.decode(solver)
                ev = evaluate(graph, seq)
                if ev is not None and (best is None or ev[0] < best[3] or
                                       (ev[0] <= self.budget and not best[2])):
                    best = (ev[1], seq, ev[0] <= self.budget, ev[0])
            info["phase1_status"] = solver.status_name(st)
            if st == cp_model.INFEASIBLE:
                solver_status = "infeasible"
        # phase 2: minimize cost within the budget
        if best is not None and best[2] and deadline.left() > 0:
            self.build(cap_var=False)
            self.m.minimize(cp_model.LinearExpr.weighted_sum(self.obj_terms, self.obj_coefs))
            hinted = self.add_hint(best[1])
            info["hinted"] = hinted
            solver = cp_model.CpSolver()
            params(solver, deadline.left())
            cb = _incumbent_reporter(self, progress, total, bound_valid and self.exact)
            st = solver.solve(self.m, cb) if cb is not None else solver.solve(self.m)
            info["status"] = solver.status_name(st)
            if st in (cp_model.OPTIMAL, cp_model.FEASIBLE):
                seq = self.decode(solver)
                ev = evaluate(graph, seq)
                if ev is not None and ev[0] <= self.budget and ev[1] <= best[0]:
                    best = (ev[1], seq, True, ev[0])
                bound = solver.best_objective_bound
                info["model_bound"] = total + bound * self.scale.cost_unit
                if self.exact and bound_valid:
                    lb = min(total + self.scale.true_bound(bound, self.max_extra), best[0])
                if st == cp_model.OPTIMAL and self.exact and bound_valid:
                    if lb is not None and best[0] <= lb * (1 + 1e-9) + 1e-12:
                        solver_status = "optimal"
            elif st == cp_model.INFEASIBLE and self.exact and bound_valid:
                solver_status = "infeasible"
        if best is None or best[1] is None:
            return Schedule(sequence=(), status=solver_status or "timeout", lower_bound=lb,
                            info=info)
        status = solver_status if solver_status == "optimal" else (
            "feasible" if best[2] else "infeasible")
        return Schedule(sequence=best[1], status=status, lower_bound=lb, info=info)

    def _milp_feasibility(self, deadline, seed):
        """``(refuted, plan)``: the Checkmate MILP on a small graph, as a feasibility check."""
        from tf_remat.solvers.checkmate import CheckmateModel

        cm = CheckmateModel(self.P, self.budget)
        cm.build()
        left = deadline.left()
        sub = Deadline(min(left, max(2.0, 0.5 * left)) if math.isfinite(left) else None)
        res = cm.solve(integral=True, deadline=sub, seed=seed)
        if res["status"] == "infeasible":
            return True, None
        if res["stages"] is None:
            return False, None
        seq = sequence_from_stages(self.P, res["stages"])
        ev = evaluate(self.graph, seq)
        if ev is None or ev[0] > self.budget:
            return False, None
        return False, (ev[1], seq, True, ev[0])

    def decode(self, solver):
        P = self.P
        events = []
        for p in range(self.n):
            for i in range(int(self.cnum[p])):
                if i == 0 or solver.boolean_value(self.lit[p][i]):
                    s = self.start[p][i]
                    events.append((s if isinstance(s, int) else solver.value(s), p))
        events.sort()
        return tuple(int(P.order[p]) for _, p in events)


def _incumbent_reporter(model, progress, total, bound_valid):
    """A CP-SAT solution callback forwarding incumbents to ``progress`` (None without one)."""
    if progress is None:
        return None
    from ortools.sat.python import cp_model

    class _Reporter(cp_model.CpSolverSolutionCallback):
        def on_solution_callback(self):
            cost = total + self.objective_value * model.scale.cost_unit
            lb = None
            if bound_valid:
                lb = total + model.scale.true_bound(self.best_objective_bound, model.max_extra)
            progress(cost=cost, lower_bound=lb)

    return _Reporter()


def _cand_sequence(P, cand):
    """The compute sequence of a first-plan candidate (stages, or a free-order sequence)."""
    if len(cand) > 5:
        return tuple(cand[5])
    return sequence_from_stages(P, cand[3])


def _drop_useless(P, seq):
    """Remove recomputations whose value no one reads (and that are not an output's last)."""
    seq = list(seq)
    while True:
        n = P.n
        latest = [-1] * n
        used = [False] * len(seq)
        first = [True] * len(seq)
        seen = [False] * n
        for k, v in enumerate(seq):
            p = int(P.pos[v])
            for u in P.preds[p]:
                used[latest[u]] = True
            if seen[p]:
                first[k] = False
            seen[p] = True
            latest[p] = k
        for p in range(n):
            if P.output[p] and latest[p] >= 0:
                used[latest[p]] = True
        drop = [k for k in range(len(seq)) if not used[k] and not first[k]]
        if not drop:
            return tuple(seq)
        ds = set(drop)
        seq = [v for k, v in enumerate(seq) if k not in ds]
