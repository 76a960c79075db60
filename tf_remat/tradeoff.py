"""Budget / overhead trade-off curves (Checkmate, Figure 5): one line per strategy.

Each point is a plan the simulator accepted within its budget; budgets no plan of a strategy
meets are left out of that strategy's line (and marked ``-`` in the table).
"""

from __future__ import annotations

import dataclasses
import os
import time

from tf_remat._units import format_bytes
from tf_remat.graph import Graph

__all__ = ["TradeoffPoint", "tradeoff", "parse_budget_range", "write_table", "plot_tradeoff"]


@dataclasses.dataclass(frozen=True)
class TradeoffPoint:
    strategy: str
    fraction: float
    budget: int
    status: str
    peak_memory: int
    overhead: float | None
    solve_seconds: float


def parse_budget_range(text: str) -> list:
    """``"0.4:1.0:0.05"`` -> [0.4, 0.45, ..., 1.0]; ``"0.9,0.8"`` -> [0.9, 0.8].

    >>> parse_budget_range("0.5:0.7:0.1")
    [0.5, 0.6, 0.7]
    """
    text = text.strip()
    if ":" in text:
        parts = text.split(":")
        if len(parts) != 3:
            raise ValueError(f"--budgets {text!r} must be START:STOP:STEP, e.g. 0.4:1.0:0.05")
        lo, hi, step = map(float, parts)
        if step <= 0 or lo <= 0 or hi < lo:
            raise ValueError(f"--budgets {text!r}: need 0 < START <= STOP and STEP > 0")
        out, k = [], 0
        while lo + k * step <= hi + 1e-9:
            out.append(round(lo + k * step, 6))
            k += 1
        return out
    vals = [float(x) for x in text.split(",") if x.strip()]
    if not vals or any(v <= 0 for v in vals):
        raise ValueError(f"--budgets {text!r} must list positive fractions")
    return vals


def tradeoff(graph: Graph, fractions, strategies, *, time_limit: float | None = 10.0,
             seed: int = 0, verbose: int = 1) -> list:
    """Solve ``graph`` at each budget fraction with each strategy; list of TradeoffPoint."""
    from tf_remat.solvers import solve

    points = []
    total = len(fractions) * len(strategies)
    k = 0
    for name in strategies:
        for f in fractions:
            k += 1
            budget = int(f * graph.no_remat_peak)
            t0 = time.perf_counter()
            plan = solve(graph, budget, name, time_limit=time_limit, seed=seed)
            dt = time.perf_counter() - t0
            ok = plan.within_budget
            points.append(TradeoffPoint(name, f, budget, plan.status,
                                        plan.peak_memory if plan.steps else 0,
                                        plan.overhead if ok else None, dt))
            if verbose:
                print(f"[{k}/{total}] {name} at {f:.2f}: {plan.status}"
                      + (f", overhead {100 * plan.overhead:.2f}%" if ok else ""), flush=True)
    return points


def write_table(graph: Graph, points, path: str | None = None) -> str:
    """Markdown table: one row per budget, one column per strategy (overhead %)."""
    strategies = list(dict.fromkeys(p.strategy for p in points))
    fractions = sorted({p.fraction for p in points}, reverse=True)
    by = {(p.strategy, p.fraction): p for p in points}
    lines = [f"# Trade-off: {graph.name}", "",
             f"{graph.n} nodes, no-rematerialization peak {graph.no_remat_peak} B "
             f"({format_bytes(graph.no_remat_peak)}). Cell: compute overhead % of the cheapest "
             "plan within the budget (simulated); `-` none found.", "",
             "| budget | " + " | ".join(strategies) + " |",
             "|---|" + "---|" * len(strategies)]
    for f in fractions:
        cells = []
        for s in strategies:
            p = by.get((s, f))
            cells.append("-" if p is None or p.overhead is None else f"{100 * p.overhead:.2f}")
        lines.append(f"| {100 * f:.0f}% | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(text)
    return text


def plot_tradeoff(graph: Graph, points, path: str) -> str:
    """Overhead (%) against budget (% of the no-remat peak), one line per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in dict.fromkeys(p.strategy for p in points):
        pts = sorted((p.fraction, p.overhead) for p in points
                     if p.strategy == s and p.overhead is not None)
        if pts:
            ax.plot([100 * f for f, _ in pts], [100 * o for _, o in pts], marker="o",
                    markersize=3, label=s)
    ax.set_xlabel("memory budget (% of no-rematerialization peak)")
    ax.set_ylabel("compute overhead (%)")
    ax.set_title(f"{graph.name}: overhead vs budget")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
