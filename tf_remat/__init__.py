"""tf-remat: rematerialization schedules that make TensorFlow/Keras training fit in less memory.

The core (graphs, strategies, plans) imports no TensorFlow; ``optimize``, ``measure_peak``,
``reserve_memory``, ``extract_graph`` and ``max_batch_size`` load it on first use.
"""

import os as _os

# TensorFlow counts CPU memory (``get_memory_info('CPU:0')``, which ``optimize`` verifies plans
# with) only when its CPU allocator is the BFC allocator, its default only where it turns oneDNN
# on, which depends on the CPU: on an AVX2-only AMD EPYC it does not, and ``optimize`` could
# measure nothing. TensorFlow reads this when it creates the allocator, at the first tensor, so
# it takes effect when tf_remat is imported before the model is built.
_os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

from tf_remat import errors  # noqa: E402
from tf_remat.errors import (GraphError, InfeasibleBudgetError, PlanError, RematError,  # noqa: E402
                             SolverTimeoutError, StrategyError, UnsupportedOpError)
from tf_remat.graph import Graph, load_graph  # noqa: E402
from tf_remat.plan import Plan, Schedule, explain, load_plan, simulate  # noqa: E402
from tf_remat.solvers import available_strategies, get_strategy, solve  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Graph", "Plan", "Schedule", "load_graph", "load_plan", "simulate", "explain",
    "solve", "get_strategy", "available_strategies",
    "optimize", "measure_peak", "reserve_memory", "extract_graph", "max_batch_size",
    "RematError", "GraphError", "PlanError", "InfeasibleBudgetError", "UnsupportedOpError",
    "SolverTimeoutError", "StrategyError", "errors",
]

# TensorFlow-backed entry points, imported lazily so the core stays TensorFlow-free.
_LAZY = {
    "optimize": ("tf_remat.api", "optimize"),
    "measure_peak": ("tf_remat.api", "measure_peak"),
    "reserve_memory": ("tf_remat.api", "reserve_memory"),
    "extract_graph": ("tf_remat.extract", "extract_graph"),
    "max_batch_size": ("tf_remat.batch", "max_batch_size"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'tf_remat' has no attribute {name!r}")
