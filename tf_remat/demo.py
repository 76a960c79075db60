"""``tf-remat demo``: the main job on a bundled example.

With TensorFlow installed it trains a bundled Keras model with and without rematerialization
(:mod:`tf_remat.demo_train`); ``--graph`` (or no TensorFlow) solves a bundled graph at a
fraction of its no-rematerialization peak with every strategy and prints the table.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

from tf_remat._units import format_bytes, parse_budget

__all__ = ["run_demo", "solver_table", "bundled_graph_path"]

_EXAMPLES = os.path.join(os.path.dirname(__file__), "examples")


def bundled_graph_path(name: str = "random_layered_n100.json") -> str:
    """Path of a graph shipped with the package."""
    return os.path.join(_EXAMPLES, name)


def run_demo(args) -> int:
    graph = getattr(args, "graph", None)
    wants_graph = graph is not None
    if not wants_graph and importlib.util.find_spec("tensorflow") is not None:
        try:
            from tf_remat.demo_train import run_training_demo
        except ModuleNotFoundError as exc:
            if exc.name != "tf_remat.demo_train":
                raise
        else:
            return run_training_demo(args)
    path = graph if graph and graph != "bundled" else bundled_graph_path()
    return solver_table(path, getattr(args, "budget", None) or "0.8",
                        time_limit=getattr(args, "time_limit", None) or 10.0)


def solver_table(path: str, budget="0.8", *, time_limit: float = 10.0, strategies=None,
                 stream=None) -> int:
    """Solve the graph at ``path`` with every strategy and print a table; 0 if any fits."""
    from tf_remat.graph import Graph
    from tf_remat.errors import StrategyError
    from tf_remat.solvers import _TABLE, solve

    stream = stream or sys.stdout
    g = Graph.load(path)
    b = parse_budget(budget, g.no_remat_peak)
    print(f"graph {g.name}: {g.n} nodes, {len(g.edges)} edges, no-remat peak "
          f"{g.no_remat_peak} B; budget {b} B ({100 * b / g.no_remat_peak:.0f}%), "
          f"time limit {time_limit:g} s per strategy\n", file=stream)
    header = f"| {'strategy':<22} | {'status':<10} | {'peak (B)':>12} | {'peak %':>7} | " \
             f"{'overhead %':>10} | {'solve s':>8} |"
    print(header, file=stream)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|", file=stream)
    fits = 0
    for name in strategies or list(_TABLE):
        try:
            t0 = time.perf_counter()
            plan = solve(g, b, name, time_limit=time_limit)
            dt = time.perf_counter() - t0
        except StrategyError as exc:
            print(f"| {name:<22} | unavailable: {exc}", file=stream)
            continue
        fits += plan.within_budget
        print(f"| {name:<22} | {plan.status:<10} | {plan.peak_memory:>12} | "
              f"{100 * plan.peak_memory / g.no_remat_peak:>7.1f} | "
              f"{100 * (plan.overhead or 0):>10.3f} | {dt:>8.2f} |", file=stream)
    print(f"\n{fits} strategies met the budget {format_bytes(b)}; peaks and costs are the "
          "simulator's.", file=stream)
    return 0 if fits else 3
