"""``auto``: an anytime portfolio, the default strategy of :func:`tf_remat.optimize`.

Within the time limit (60 s when none is given) it runs, keeping the cheapest plan the simulator
accepts at every point:

1. the reference order run once (checkpoint-all): when it fits the budget it is optimal (every
   node computed once) and the solve ends; otherwise the best of the chen / articulation-point /
   linearized greedy baselines;
2. FastSA (:mod:`tf_remat.solvers.fastsa`) from the best plan so far: on graphs over
   ``exact_nodes``, 90% of the time left when a baseline fits the budget, ``unfit_share``
   (half) when none does and the graph has at most ``moccasin_nodes``, stopping short of the
   seconds MOCCASIN needs to start (MOCCASIN's first phase, reaching the budget, is then what
   fits a tight budget, and it needs the time: ``benchmarks/results/auto_share.md``);
3. the exact solvers warm-started from the best plan so far: Checkmate's MILP on small graphs
   (it proves the fixed-order optimum), then MOCCASIN on CP-SAT with ``hint=`` the best
   sequence (searching the stages of that plan's order) while time is left; graphs too large
   for MOCCASIN get up to three more (cooler) FastSA runs from the best plan instead, and
   MOCCASIN only when no plan fits yet.

The returned schedule carries the best proven lower bound; ``info`` says what each component
found, which one won, the bound and the gap. Bounds of the fixed-order exact solvers bound plans
that keep the graph's order only: with ``order=free`` (default) a plan may beat them, so they
are reported in ``info`` and ``lower_bound`` is only the cost of computing every node once
unless the winning plan keeps the reference order; with ``order=fixed`` every component keeps
the order and the MILP bound is the schedule's ``lower_bound`` (``optimal`` once met).
"""

from __future__ import annotations

import time

from tf_remat.errors import StrategyError
from tf_remat.graph import Graph
from tf_remat.plan import Schedule
from tf_remat.solvers import get_strategy, register
from tf_remat.solvers._staged import Deadline, check_hint, evaluate

__all__ = ["auto"]

_OPTIONS = {
    "order": (str, "free", "free: FastSA may reorder; fixed: every component keeps the "
                           "graph's order (so the MILP bound applies)"),
    "exact_nodes": (int, 60, "graphs with at most this many nodes get Checkmate's MILP"),
    "moccasin_nodes": (int, 1500, "graphs with at most this many nodes get MOCCASIN after "
                                  "FastSA when time is left (larger ones only while no "
                                  "plan fits)"),
    "hint": (tuple, None, "a compute sequence to start from (Python API)"),
    "unfit_share": (float, 0.5, "FastSA's share of the time left when no baseline fits the "
                                "budget, on graphs over exact_nodes and up to moccasin_nodes "
                                "(MOCCASIN gets the rest; 0.9 when a baseline fits)"),
}

DEFAULT_TIME = 60.0
#: FastSA's share of the time left on graphs over ``exact_nodes`` when a baseline fits the
#: budget (it lowers the cost from there; when none does, ``unfit_share``)
_FASTSA_SHARE = 0.9
_BASELINES = ("chen-greedy", "ap-greedy", "linearized-greedy")


def _keeps_order(graph, seq):
    seen, first = set(), []
    for v in seq:
        if v not in seen:
            seen.add(v)
            first.append(v)
    return tuple(first) == tuple(graph.order)


def reserve_seconds(limit: float) -> float:
    """What ``auto`` keeps back of ``limit`` seconds for building and checking the plan."""
    return min(1.0, 0.05 * limit)


def moccasin_need_seconds(n: int, *, small: bool, large: bool) -> float:
    """The seconds left that ``auto`` requires before it starts MOCCASIN on ``n`` nodes."""
    return 1.0 if small else 5.0 + 0.005 * n if large else 5.0


@register("auto", "anytime portfolio: baseline, FastSA, then exact solvers warm-started from the "
                  "best plan (proven optima on small graphs)", options=_OPTIONS)
def auto(graph: Graph, budget: int, *, time_limit=None, seed: int = 0, progress=None,
         order: str = "free", exact_nodes: int = 60, moccasin_nodes: int = 1500,
         hint=None, unfit_share: float = 0.5) -> Schedule:
    if order not in ("free", "fixed"):
        raise StrategyError(f"option order={order!r} of strategy 'auto' must be free or fixed")
    if not 0 < unfit_share <= 1:
        raise StrategyError(f"option unfit_share={unfit_share!r} of strategy 'auto' must be "
                            f"over 0 and at most 1")
    hint = check_hint(hint, graph)
    reference = evaluate(graph, graph.order)
    if reference is None or reference[0] > budget:
        from tf_remat.solvers.fastsa import compile_kernel

        compile_kernel()  # FastSA will run: its one-time compilation is not the portfolio's time
    limit = DEFAULT_TIME if time_limit is None else float(time_limit)
    deadline = Deadline(limit, reserve=reserve_seconds(limit))
    start = time.perf_counter()
    fixed = order == "fixed"
    n = graph.n
    total = graph.total_cost
    best = None             # dict(seq, peak, cost, by)
    runs = []
    fixed_lb = None         # best bound proven for plans of the reference order
    fixed_optimal = False

    def consider(seq, by):
        nonlocal best
        if not seq:
            return False
        if fixed and not _keeps_order(graph, seq):
            return False
        r = evaluate(graph, seq)   # the simulator; None when invalid (stateful recomputed ...)
        if r is None:
            return False
        peak, cost = r
        if peak > budget:
            # over the budget, the lowest peak is the best: it is what an infeasible solve
            # reports as the smallest budget reached (FastSA's max(peak, budget) * cost kept a
            # 21.9 MiB plan of a 39-node step where the MILP had found one of 20.9)
            if best is None or (best["peak"] > budget and
                                (peak, cost) < (best["peak"], best["cost"])):
                best = {"seq": tuple(seq), "peak": peak, "cost": cost, "by": by}
            return False
        if best is None or best["peak"] > budget or cost < best["cost"] - 1e-12 * abs(cost):
            best = {"seq": tuple(seq), "peak": peak, "cost": cost, "by": by}
            if progress is not None:
                progress(cost=cost, peak=peak, message=f"best plan from {by}")
            return True
        return False

    def run(name, share_s, **opts):
        nonlocal fixed_lb, fixed_optimal
        strat = get_strategy(name)
        t = time.perf_counter()
        tl = max(0.05, min(share_s, deadline.left()))
        try:
            off = opts.pop("seed_offset", 0)
            s = strat.func(graph, budget, time_limit=tl, seed=seed + off, progress=None, **opts)
        except Exception as exc:  # noqa: BLE001 - a failing component must not sink the portfolio
            runs.append({"strategy": name, "error": f"{type(exc).__name__}: {exc}"})
            return None
        took = time.perf_counter() - t
        r = evaluate(graph, s.sequence) if s.sequence else None
        entry = {"strategy": name, "status": s.status, "seconds": round(took, 3)}
        if s.info.get("mutations_per_second"):
            entry["mutations_per_second"] = s.info["mutations_per_second"]
        if s.info.get("runs"):
            entry["runs"] = s.info["runs"]
        if s.info.get("escalated_runs"):
            entry["escalated_runs"] = s.info["escalated_runs"]
        if r is not None:
            entry.update(peak=int(r[0]), cost=r[1])
        if strat.exact and s.lower_bound is not None and opts.get("order", "fixed") == "fixed":
            entry["lower_bound"] = s.lower_bound
            if fixed_lb is None or s.lower_bound > fixed_lb:
                fixed_lb = s.lower_bound
            if s.status == "optimal":
                fixed_optimal = True
        entry["improved"] = consider(s.sequence, name)
        runs.append(entry)
        if progress is not None and fixed_lb is not None and fixed:
            progress(lower_bound=fixed_lb)
        return s

    # 1. baselines
    consider(graph.order, "checkpoint-all")
    if best is not None and best["peak"] <= budget:
        return Schedule(sequence=best["seq"], status="optimal", lower_bound=total,
                        solve_seconds=time.perf_counter() - start,
                        info={"winner": "checkpoint-all", "lower_bound": total, "gap": 0.0,
                              "runs": [{"strategy": "checkpoint-all", "cost": total}]})
    if hint is not None:
        consider(hint, "hint")
    # the greedy baselines take seconds on graphs of thousands of nodes and ignore short limits:
    # there, only the fast one runs and FastSA gets the time
    baselines = _BASELINES if (n <= 2000 or limit >= 30) else ("ap-greedy",)
    for name in baselines:
        if deadline.left() <= 0:
            break
        run(name, max(0.2, 0.03 * limit))
    # 2. FastSA
    small = n <= exact_nodes
    if deadline.left() > 0:
        # (over moccasin_nodes, where MOCCASIN runs only while nothing fits and was not in the
        # comparison behind the half share, FastSA keeps 90%)
        fits = best is not None and best["peak"] <= budget
        left = deadline.left()
        fs_time = left * (0.25 if small else _FASTSA_SHARE
                          if fits or n > moccasin_nodes else unfit_share)
        if not (small or fits or n > moccasin_nodes):
            # MOCCASIN, which reaches tight budgets, starts only with its need left: a FastSA
            # that spends its whole share at a short limit would leave it under that (10 s on
            # random_layered_n250 at 0.628 of its peak: FastSA's seven runs took 4.3 s of 4.5
            # and MOCCASIN, which had fitted it, did not start); never over unfit_share, and
            # FastSA keeps a quarter of the time when MOCCASIN could not start anyway
            need = moccasin_need_seconds(n, small=False, large=False)
            fs_time = min(fs_time, max(0.25 * left, left - need - 0.5))
        fs_opts = {"order": order}
        if small:
            fs_opts["iterations"] = 400_000
        if fits:
            fs_opts["hint"] = best["seq"]
        elif n > moccasin_nodes:
            # FastSA's added runs at a steeper slope, or its three runs where the time pays
            # for them, would spend all of its 90% when nothing fits, and MOCCASIN, which
            # fitted InceptionV3 (below), needs what is left after
            fs_opts.update(escalate=0, restarts=1)
        run("fastsa", fs_time, **fs_opts)
    # 3. exact solvers, warm-started
    if small and deadline.left() > 0.2:
        h = best["seq"] if best is not None and _keeps_order(graph, best["seq"]) else None
        opts = {"hint": h} if h is not None and best["peak"] <= budget else {}
        run("checkmate-milp", deadline.left() * 0.7, **opts)
    # a graph too large for MOCCASIN's cost search still gets it when nothing fits yet: its
    # stages reach budgets where FastSA's objective settles over the budget (InceptionV3's
    # 1717-node step: FastSA stops at 232-241 MiB for a 225 MiB budget; MOCCASIN, run here
    # with 15 s left, fits it in 11-13 s), and a plan over the budget is no plan
    # (its first plans take seconds per thousand nodes before CP-SAT starts: 6-8 s each on a
    # 2169-node graph, so a larger graph needs more time left)
    fits = best is not None and best["peak"] <= budget
    need = moccasin_need_seconds(n, small=small, large=n > moccasin_nodes)
    if not fixed_optimal and (n <= moccasin_nodes or not fits) and deadline.left() > need:
        if fits:
            same = _keeps_order(graph, best["seq"])
            mopts = {"hint": best["seq"], "order": "fixed" if same else "hint"}
        else:
            mopts = {"order": "fixed"}
        run("moccasin", deadline.left(), **mopts)
    # large graphs (no exact solver): more FastSA runs from the best plan while time is left
    rerun = 0
    while (n > moccasin_nodes and rerun < 3 and deadline.left() > 5.0
           and best is not None and best["peak"] <= budget):
        rerun += 1
        run("fastsa", deadline.left(), order=order, hint=best["seq"], t0=0.005,
            restarts=1, seed_offset=rerun)
    elapsed = time.perf_counter() - start
    info = {"runs": runs, "order": order}
    if best is None:
        return Schedule(sequence=(), status="timeout", solve_seconds=elapsed, info=info)
    info["winner"] = best["by"]
    keeps = _keeps_order(graph, best["seq"])
    lb = total
    if fixed_lb is not None:
        info["fixed_order_lower_bound"] = fixed_lb
        if keeps and fixed_lb > lb:
            # every plan of the reference order costs at least this; a plan that keeps the order
            # is compared against it (with order=free a reordered plan may still be cheaper)
            lb = fixed_lb if fixed else lb
    info["lower_bound"] = lb
    feasible = best["peak"] <= budget
    if feasible:
        info["gap"] = (best["cost"] - lb) / best["cost"] if best["cost"] > 0 else 0.0
    status = "infeasible"
    if feasible:
        status = "optimal" if best["cost"] <= lb * (1 + 1e-9) + 1e-12 else "feasible"
    return Schedule(sequence=best["seq"], status=status, lower_bound=lb, solve_seconds=elapsed,
                    info=info)
