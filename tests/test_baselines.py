import math

import pytest

from conftest import shared_graph
from strategy_testing import run_strategy_test
from tf_remat.errors import StrategyError
from tf_remat.generators import linear_graph, random_dag, random_layered_graph
from tf_remat.graph import Graph
from tf_remat.solvers import get_strategy, solve

BASELINES = ["checkpoint-all", "chen-sqrtn", "chen-greedy", "griewank-logn", "ap-sqrtn",
             "ap-greedy", "linearized-sqrtn", "linearized-greedy"]


def _graphs():
    yield linear_graph(40)
    yield random_layered_graph(80, seed=4)
    yield random_dag(50, backward_fraction=0.45, stateful_fraction=0.15, seed=2)
    # a residual training graph with non-recomputable (stateful) forward nodes
    n = 30
    fwd_edges = [(i, i + 1) for i in range(n - 1)] + [(i, i + 3) for i in range(0, n - 3, 3)]
    g = random_dag(2 * n, seed=9)
    edges = list(fwd_edges) + [(n - 1, n)] + [(n + k, n + k + 1) for k in range(n - 1)]
    edges += [(n - 1 - k, n + k) for k in range(n)]
    yield Graph(cost=g.cost, memory=g.memory, edges=edges,
                backward=[v >= n for v in range(2 * n)],
                recomputable=[v % 7 != 3 for v in range(2 * n)], name="residual_train")


@pytest.mark.parametrize("strategy", BASELINES)
@pytest.mark.parametrize("fraction", [1.0, 0.7])
def test_every_baseline_gives_valid_simulated_plans(strategy, fraction):
    for g in _graphs():
        run_strategy_test(strategy, g, int(fraction * g.no_remat_peak))


@pytest.mark.parametrize("strategy", BASELINES)
def test_baselines_on_published_graph(strategy):
    g = Graph.load(shared_graph("resnet50_b256_224x224_train"))
    plan = run_strategy_test(strategy, g, int(0.8 * g.no_remat_peak))
    assert plan.found


def test_checkpoint_all_is_the_no_remat_peak():
    g = random_layered_graph(60, seed=1)
    plan = solve(g, g.no_remat_peak, "checkpoint-all")
    assert plan.peak_memory == g.no_remat_peak and plan.cost == g.total_cost


def test_chen_sqrtn_memory_grows_as_sqrt_n():
    peaks = [solve(linear_graph(n), 10**9, "chen-sqrtn").peak_memory for n in (16, 64, 256)]
    assert peaks[1] <= 2.2 * peaks[0] and peaks[2] <= 2.2 * peaks[1]
    assert peaks[2] < 256 / 4  # far below the linear no-remat peak
    costs = [solve(linear_graph(n), 10**9, "chen-sqrtn").overhead for n in (16, 64, 256)]
    assert all(c <= 0.5 + 1e-9 for c in costs)  # each forward value recomputed at most once


def test_griewank_memory_grows_logarithmically():
    peaks = [solve(linear_graph(n), 10**9, "griewank-logn").peak_memory for n in (64, 256, 1024)]
    assert peaks[2] - peaks[0] <= 2 * math.log2(1024 / 64) + 2
    assert peaks[2] < solve(linear_graph(1024), 10**9, "chen-sqrtn").peak_memory


def test_greedy_meets_a_budget_sqrtn_ignores():
    g = linear_graph(64)
    budget = int(0.5 * g.no_remat_peak)
    plan = solve(g, budget, "chen-greedy")
    assert plan.status == "feasible" and plan.peak_memory <= budget
    # cheaper than the budget-oblivious sqrt(n) plan
    assert plan.cost <= solve(g, budget, "chen-sqrtn").cost


def test_budget_below_lower_bound_is_infeasible_with_reason():
    g = linear_graph(8)
    plan = solve(g, g.budget_lower_bound - 1, "chen-greedy")
    assert plan.status == "infeasible"
    assert "least any plan can reach" in plan.info["message"]


def test_unknown_strategy_and_option_are_named():
    with pytest.raises(StrategyError, match="valid strategies: checkpoint-all"):
        get_strategy("revolve")
    with pytest.raises(StrategyError, match="no option 'x'.*snapshots"):
        solve(linear_graph(4), 100, "griewank-logn", x=1)
    with pytest.raises(StrategyError, match="must be a int"):
        solve(linear_graph(4), 100, "griewank-logn", snapshots="many")
