"""Memory over the schedule, one line per plan, against the budget (Checkmate's Figure 1).

Every line comes from the simulator (:func:`tf_remat.plan.simulate`): the memory resident after
each step, plotted against the time the schedule has spent (cumulative node cost), so a plan
that recomputes more ends further right. No TensorFlow.

Example:
    >>> from tf_remat.generators import linear_graph
    >>> from tf_remat.solvers import solve
    >>> g = linear_graph(16)
    >>> plans = [solve(g, g.no_remat_peak, "checkpoint-all"),
    ...          solve(g, g.no_remat_peak, "chen-sqrtn")]
    >>> plot_memory(g, plans, "/tmp/memory.png")  # doctest: +SKIP
"""

from __future__ import annotations

import os
from typing import Sequence

from tf_remat.graph import Graph
from tf_remat.plan import Plan, simulate

__all__ = ["plot_memory", "memory_curve"]


def memory_curve(graph: Graph, plan: Plan, *, x: str = "cost") -> tuple:
    """``(xs, ys)`` of the plan's memory as a step function.

    Args:
        x: ``"cost"`` (cumulative compute cost, the graph's unit: seconds for extracted
            graphs) or ``"step"`` (compute steps done).

    Each compute occupies ``[t, t + cost]`` at the memory right after it (its output and its
    inputs resident together, the simulator's peak rule); a free lowers the memory at ``t``.
    """
    if x not in ("cost", "step"):
        raise ValueError(f"x must be 'cost' or 'step', got {x!r}")
    sim = simulate(graph, plan.steps)
    xs, ys = [0.0], [float(graph.fixed_memory)]
    t = 0.0
    for (op, v), mem in zip(plan.steps, sim.timeline):
        if op == "compute":
            xs.append(t)
            ys.append(float(mem))
            t += graph.cost[v] if x == "cost" else 1.0
            xs.append(t)
            ys.append(float(mem))
        else:
            xs.append(t)
            ys.append(float(mem))
    return xs, ys


def plot_memory(graph: Graph, plans: Sequence[Plan], path: str | os.PathLike, *,
                budget: int | None = None, labels: Sequence[str] | None = None,
                x: str = "cost", title: str | None = None) -> str:
    """Draw memory over the schedule for each plan and write the figure to ``path``.

    Args:
        graph: the graph the plans were made for.
        plans: one line each.
        path: output file (PNG, PDF or SVG, by extension).
        budget: bytes, drawn as a dashed line; default: the plans' own budgets (one line when
            they agree).
        labels: legend entries (default: strategy, peak and overhead of each plan).
        x: ``"cost"`` or ``"step"`` (see :func:`memory_curve`).
        title: default: the graph's name.

    Returns:
        The path written.

    Raises:
        PlanError: a plan does not fit the graph.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    plans = list(plans)
    if not plans:
        raise ValueError("give at least one plan to plot")
    if labels is not None and len(labels) != len(plans):
        raise ValueError(f"{len(labels)} labels for {len(plans)} plans")
    peak_all = max([p.peak_memory for p in plans] + [graph.fixed_memory, 1])
    budgets = [budget] if budget is not None else sorted({p.budget for p in plans
                                                          if 0 < p.budget < 2**60})
    top = max([peak_all] + budgets)
    unit, scale = _unit(top)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    total = graph.total_cost or 1.0
    for i, plan in enumerate(plans):
        xs, ys = memory_curve(graph, plan, x=x)
        if labels is not None:
            label = labels[i]
        else:
            overhead = plan.cost / total - 1 if x == "cost" else (plan.overhead or 0.0)
            over = budget if budget is not None else plan.budget
            label = (f"{plan.strategy or 'plan'}: peak {plan.peak_memory / scale:.3g} {unit}, "
                     f"+{100 * overhead:.1f}% compute"
                     + (" (over budget)" if plan.peak_memory > over else ""))
        ax.plot(xs, [y / scale for y in ys], lw=1.2, label=label)
    for b in budgets:
        ax.axhline(b / scale, ls="--", lw=1.0, color="black",
                   label=f"budget {b / scale:.3g} {unit}")
    if graph.fixed_memory:
        ax.axhline(graph.fixed_memory / scale, ls=":", lw=0.8, color="gray",
                   label=f"fixed {graph.fixed_memory / scale:.3g} {unit}")
    ax.set_xlabel("time (cumulative node cost)" if x == "cost" else "compute steps")
    ax.set_ylabel(f"memory ({unit})")
    ax.set_ylim(bottom=0)
    ax.set_title(title if title is not None else graph.name)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _unit(n: float):
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return unit, scale
    return "B", 1
