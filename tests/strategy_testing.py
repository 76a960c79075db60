"""The test every strategy must pass (the Keras ``run_layer_test`` habit)."""

from tf_remat.plan import simulate, sequence_from_steps
from tf_remat.solvers import solve


def run_strategy_test(strategy, graph, budget, *, time_limit=None, check_seed=True, **options):
    """Plan valid, simulator figures reported, within budget unless marked infeasible,
    non-recomputable nodes computed once, and the same seed gives the same plan."""
    plan = solve(graph, budget, strategy, time_limit=time_limit, seed=0, **options)
    assert plan.status in ("optimal", "feasible", "infeasible", "timeout")
    if not plan.steps:
        assert plan.status in ("infeasible", "timeout")
        return plan
    sim = simulate(graph, plan.steps)  # raises on any invalid step
    assert sim.peak_memory == plan.peak_memory
    assert abs(sim.cost - plan.cost) <= 1e-9 * max(1.0, abs(sim.cost))
    if plan.status in ("optimal", "feasible"):
        assert plan.peak_memory <= budget, (strategy, plan.peak_memory, budget)
    else:
        assert plan.peak_memory > budget
    for v in range(graph.n):
        if not graph.recomputable[v]:
            assert sim.compute_counts[v] == 1, f"{strategy} recomputed stateful node {v}"
    if plan.lower_bound is not None and plan.status == "optimal":
        assert plan.lower_bound <= plan.cost * (1 + 1e-9) + 1e-9
    if check_seed:
        again = solve(graph, budget, strategy, time_limit=time_limit, seed=0, **options)
        assert sequence_from_steps(again.steps) == sequence_from_steps(plan.steps)
    return plan
