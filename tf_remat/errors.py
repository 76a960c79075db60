"""Errors a user can act on.

Every error the library raises on purpose derives from :class:`RematError`, so callers can
catch by meaning (a bad graph, an unreachable budget, an unsupported op, a solver that ran out of
time) or catch everything of ours at once.
"""

import os
import sys
import warnings

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


#: packages whose frames a warning skips to reach the line that called into them: the same
#: warning is raised from ``optimize`` and from within ``model.fit`` (through Keras), at
#: depths no fixed ``stacklevel`` fits
_INTERNAL = ("tf_remat", "keras", "tensorflow", "tf_keras")


def _internal_dirs() -> tuple:
    dirs = []
    for name in _INTERNAL:
        mod = sys.modules.get(name)  # only what is loaded: the core imports no TensorFlow
        path = getattr(mod, "__file__", None)
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(dirs)


def warn(message: str, category=UserWarning) -> None:
    """``warnings.warn`` attributed to the first caller outside tf-remat, Keras and TensorFlow
    (the user's ``optimize`` or ``fit`` line), not to a line of ours."""
    dirs = _internal_dirs()
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(dirs):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1 if frame is not None else 2)
