"""Errors a user can act on.

Every error the library raises on purpose derives from :class:`RematError`, so callers can
catch by meaning (a bad graph, an unreachable budget, an unsupported op, a solver that ran out of
time) or catch everything of ours at once.
"""

__all__ = [
    "RematError",
    "GraphError",
    "PlanError",
    "InfeasibleBudgetError",
    "UnsupportedOpError",
    "SolverTimeoutError",
    "StrategyError",
]


class RematError(Exception):
    """Root of all tf-remat errors."""


class GraphError(RematError, ValueError):
    """The computation graph is malformed (cycle, unknown id, negative size, bad order...)."""


class PlanError(RematError, ValueError):
    """An execution plan does not fit its graph (reads a value that is not resident, ...)."""


class StrategyError(RematError, ValueError):
    """An unknown strategy name or an option the strategy does not take."""


class InfeasibleBudgetError(RematError):
    """No plan fits the memory budget.

    Attributes:
        budget: the budget asked for, in bytes.
        min_feasible: the smallest peak any plan found reaches (or a proven lower bound), bytes.
        plan: the best over-budget plan found, or None.
    """

    def __init__(self, message, *, budget=None, min_feasible=None, plan=None):
        super().__init__(message)
        self.budget = budget
        self.min_feasible = min_feasible
        self.plan = plan


class UnsupportedOpError(RematError):
    """The traced training step holds an op or tensor tf-remat cannot schedule."""


class SolverTimeoutError(RematError):
    """A solver hit its time limit without finding any plan."""
