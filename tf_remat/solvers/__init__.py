"""Strategies: every one is ``solve(graph, budget, *, time_limit=None, seed=0, **options)``.

Strategies are looked up by name in one registry (:func:`get_strategy`); their modules are
imported only when used, so listing strategies never loads OR-Tools or numba. :func:`solve` runs
a strategy and passes its schedule through the simulator in :mod:`tf_remat.plan`, which alone
decides the plan's peak memory, cost and whether it is within budget.

Example:
    >>> from tf_remat.generators import linear_graph
    >>> g = linear_graph(8)
    >>> plan = solve(g, g.no_remat_peak, strategy="checkpoint-all")
    >>> plan.status, plan.peak_memory == g.no_remat_peak
    ('feasible', True)
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import time
from typing import Any, Callable

from tf_remat.errors import StrategyError, InfeasibleBudgetError
from tf_remat.graph import Graph
from tf_remat.plan import Plan, Schedule, make_plan

__all__ = ["Strategy", "get_strategy", "available_strategies", "solve", "register",
           "Progress", "check_plan", "check_time_limit"]


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A named strategy: the solve function, a one-line summary and its options.

    ``options`` maps an option name to ``(type, default, help)``; :func:`solve` checks and
    converts ``--set KEY=VALUE`` strings against it.
    """

    name: str
    func: Callable[..., Schedule]
    summary: str
    options: dict
    exact: bool = False

    def __call__(self, graph, budget, **kwargs):
        return solve(graph, budget, strategy=self, **kwargs)


# name -> (module, function). Modules are imported on first use.
_TABLE = {
    "checkpoint-all": ("tf_remat.solvers.baselines", "checkpoint_all"),
    "chen-sqrtn": ("tf_remat.solvers.baselines", "chen_sqrtn"),
    "chen-greedy": ("tf_remat.solvers.baselines", "chen_greedy"),
    "griewank-logn": ("tf_remat.solvers.baselines", "griewank_logn"),
    "ap-sqrtn": ("tf_remat.solvers.baselines", "ap_sqrtn"),
    "ap-greedy": ("tf_remat.solvers.baselines", "ap_greedy"),
    "linearized-sqrtn": ("tf_remat.solvers.baselines", "linearized_sqrtn"),
    "linearized-greedy": ("tf_remat.solvers.baselines", "linearized_greedy"),
    "checkmate-milp": ("tf_remat.solvers.checkmate", "checkmate_milp"),
    "checkmate-lp-rounding": ("tf_remat.solvers.checkmate", "checkmate_lp_rounding"),
    "moccasin": ("tf_remat.solvers.moccasin", "moccasin"),
    "fastsa": ("tf_remat.solvers.fastsa", "fastsa"),
    "auto": ("tf_remat.solvers.auto", "auto"),
}
_REGISTRY: dict = {}


def register(name: str, summary: str, *, options: dict | None = None, exact: bool = False):
    """Decorator used by strategy modules to enter a function in the registry."""

    def wrap(func):
        _REGISTRY[name] = Strategy(name=name, func=func, summary=summary,
                                   options=dict(options or {}), exact=exact)
        return func

    return wrap


def available_strategies() -> dict:
    """Every strategy whose module imports here: ``{name: Strategy}`` in registry order."""
    out = {}
    for name in _TABLE:
        try:
            out[name] = get_strategy(name)
        except StrategyError:
            continue
    return out


def get_strategy(strategy: str | Callable | Strategy) -> Strategy:
    """Look a strategy up by name (or wrap a callable with the strategy signature).

    Raises:
        StrategyError: for an unknown name, listing the valid ones.
    """
    if isinstance(strategy, Strategy):
        return strategy
    if callable(strategy):
        name = getattr(strategy, "__name__", "custom")
        return Strategy(name=name, func=strategy, summary="user strategy", options={},
                        exact=False)
    if strategy not in _REGISTRY:
        if strategy not in _TABLE:
            raise StrategyError(f"unknown strategy {strategy!r}; valid strategies: "
                                f"{', '.join(_TABLE)}")
        module, _ = _TABLE[strategy]
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name == module:
                raise StrategyError(f"strategy {strategy!r} is not available in this build "
                                    f"({module} is missing)") from exc
            raise StrategyError(f"strategy {strategy!r} needs the package {exc.name!r}; "
                                f"install it with pip install {exc.name}") from exc
        if strategy not in _REGISTRY:
            raise StrategyError(f"{module} did not register strategy {strategy!r}")
    return _REGISTRY[strategy]


def _convert_options(strategy: Strategy, options: dict) -> dict:
    out = {}
    for key, value in options.items():
        if key not in strategy.options:
            valid = ", ".join(f"{k} ({t.__name__}, default {d!r})"
                              for k, (t, d, _) in strategy.options.items()) or "none"
            raise StrategyError(f"strategy {strategy.name!r} has no option {key!r}; "
                                f"its options are: {valid}")
        typ = strategy.options[key][0]
        if isinstance(value, str) and typ is not str:
            try:
                if typ is bool:
                    if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                        raise ValueError(value)
                    value = value.lower() in ("1", "true", "yes")
                else:
                    value = typ(value)
            except ValueError as exc:
                raise StrategyError(f"option {key}={value!r} of strategy {strategy.name!r} "
                                    f"must be a {typ.__name__}") from exc
        out[key] = value
    return out


class Progress:
    """Progress lines on stderr for solves that run longer than a second.

    A strategy calls ``progress(cost=..., lower_bound=..., peak=...)`` whenever its incumbent or
    bound moves; this prints at most twice a second and forwards each event to the user's
    callback.
    """

    def __init__(self, name: str, graph: Graph, *, verbose: int = 1, callback=None,
                 stream=None):
        self.name, self.graph, self.verbose, self.callback = name, graph, verbose, callback
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()
        self._last_print = 0.0
        self.best_cost = None
        self.lower_bound = None
        self.time_to_best = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def __call__(self, *, cost=None, lower_bound=None, peak=None, message=None):
        t = self.elapsed()
        if cost is not None and (self.best_cost is None or cost < self.best_cost - 1e-12):
            self.best_cost, self.time_to_best = cost, t
        if lower_bound is not None:
            self.lower_bound = lower_bound
        event = {"strategy": self.name, "elapsed": t, "cost": self.best_cost,
                 "lower_bound": self.lower_bound, "peak": peak, "message": message}
        if self.callback is not None:
            self.callback(event)
        if self.verbose and t > 1.0 and (t - self._last_print >= 0.5 or message):
            self._last_print = t
            total = self.graph.total_cost or 1.0
            parts = [f"[{self.name}] {t:7.1f}s"]
            if self.best_cost is not None:
                parts.append(f"incumbent overhead {100 * (self.best_cost / total - 1):.3f}%")
            if self.lower_bound is not None:
                parts.append(f"bound {100 * (self.lower_bound / total - 1):.3f}%")
            if message:
                parts.append(message)
            print("  ".join(parts), file=self.stream, flush=True)


def check_time_limit(time_limit) -> None:
    """A ValueError unless ``time_limit`` is None (no limit) or a number of seconds over zero;
    callers that trace a model first (``optimize``, ``max_batch_size``) check it up front."""
    if time_limit is not None and not time_limit > 0:
        raise ValueError(f"time_limit must be a positive number of seconds or None (no "
                         f"limit), got {time_limit!r}")


def solve(graph: Graph, budget: int, strategy: str | Callable | Strategy = "auto", *,
          time_limit: float | None = None, seed: int = 0, callback=None, verbose: int = 0,
          **options: Any) -> Plan:
    """Solve ``graph`` under ``budget`` bytes with ``strategy`` and return the simulated Plan.

    Args:
        graph: the graph.
        budget: peak memory allowed, bytes, ``fixed_memory`` included.
        strategy: a registered name (see ``tf-remat strategies``) or a callable with the
            strategy signature.
        time_limit: seconds; strategies return the best plan found by then.
        seed: for randomized strategies; the same seed gives the same plan.
        callback: called with a dict (strategy, elapsed, cost, lower_bound, peak, message) as
            the solve progresses.
        verbose: 0 silent; 1 progress lines on stderr for solves over a second.
        **options: strategy options (``tf-remat strategies`` lists them).

    Returns:
        A :class:`~tf_remat.plan.Plan` whose ``peak_memory``/``cost`` are the simulator's and
        whose status is ``infeasible`` whenever the peak exceeds the budget.

    Raises:
        StrategyError: unknown strategy or option.
    """
    strat = get_strategy(strategy)
    opts = _convert_options(strat, options)
    budget = int(budget)
    if budget < 0:
        raise ValueError(f"budget must be >= 0 bytes, got {budget}")
    check_time_limit(time_limit)
    progress = Progress(strat.name, graph, verbose=verbose, callback=callback)
    start = time.perf_counter()
    if budget < graph.budget_lower_bound:
        from tf_remat._units import format_bytes

        v = graph.bottleneck()
        sched = Schedule(sequence=graph.order, status="infeasible", info={
            "message": f"budget {format_bytes(budget)} is below "
                       f"{format_bytes(graph.budget_lower_bound)}, the least any plan can reach "
                       f"(node {graph.label(v)} with its inputs, plus fixed memory)"})
    else:
        sched = strat.func(graph, budget, time_limit=time_limit, seed=seed, progress=progress,
                           **opts)
    elapsed = time.perf_counter() - start
    if not sched.solve_seconds:
        sched = dataclasses.replace(sched, solve_seconds=elapsed)
    info = dict(sched.info)
    if progress.time_to_best is not None:
        info.setdefault("time_to_best", round(progress.time_to_best, 4))
    sched = dataclasses.replace(sched, info=info)
    return make_plan(graph, sched, budget, strategy=strat.name)


def check_plan(plan: Plan, graph: Graph) -> Plan:
    """Return ``plan`` if it is within budget, else raise :class:`InfeasibleBudgetError`."""
    from tf_remat._units import format_bytes

    if plan.within_budget:
        return plan
    if plan.steps:
        least = plan.peak_memory
        msg = (f"budget {format_bytes(plan.budget)} could not be met: the best plan "
               f"{plan.strategy} found peaks at {format_bytes(least)}")
    else:
        least = graph.budget_lower_bound
        msg = f"strategy {plan.strategy} found no plan within budget {format_bytes(plan.budget)}"
    lb = graph.budget_lower_bound
    if plan.budget < lb:
        msg += (f"; no plan can go below {format_bytes(lb)} (node "
                f"{graph.label(graph.bottleneck())} with its inputs, plus fixed memory)")
    msg += "; raise the budget, lower the batch size, or give the solver more time"
    raise InfeasibleBudgetError(msg, budget=plan.budget, min_feasible=max(least, lb), plan=plan)
