"""The exact solvers: Checkmate MILP, its LP relaxation with rounding, MOCCASIN on CP-SAT.

The fixed-order optimum is the cheapest *staged* plan of ``graph.order`` within budget (stage t
first computes ``order[t]`` after recomputing earlier nodes, each once, in order): on graphs of
up to six nodes it is found here by enumerating every staged sequence through the simulator.
"""

import itertools
import os
import random
import time

import pytest

from conftest import ROOT, load_tool, shared_graph
from strategy_testing import run_strategy_test
from tf_remat.errors import StrategyError
from tf_remat.generators import linear_graph, random_dag, random_layered_graph
from tf_remat.graph import Graph
from tf_remat.plan import simulate, steps_from_sequence
from tf_remat.solvers._staged import sequence_from_stages
from tf_remat.solvers import solve

EXACT = ["checkmate-milp", "moccasin"]
FRACTIONS = [0.9, 0.8, 0.7]


def training_dag(k, seed=0, p=0.3, stateful=0.0, fixed=0):
    """A small training graph: a random forward DAG, a loss, one gradient per forward node
    reading the gradients of its readers, its own value and its inputs."""
    rng = random.Random(seed)
    fedges = []
    for v in range(1, k):
        fedges.append((v - 1, v))
        fedges.extend((u, v) for u in range(max(0, v - 4), v - 1) if rng.random() < p)
    loss, bid = k, (lambda v: 2 * k - v)
    edges = list(fedges) + [(k - 1, loss)]
    for v in range(k):
        readers = [bid(w) for a, w in fedges if a == v] or [loss]
        edges += [(g, bid(v)) for g in readers] + [(v, bid(v))]
        edges += [(a, bid(v)) for a, b in fedges if b == v]
    n = 2 * k + 1
    return Graph(cost=[rng.randint(1, 9) for _ in range(n)],
                 memory=[rng.randint(1, 9) for _ in range(n)], edges=edges,
                 backward=[v > k for v in range(n)],
                 recomputable=[rng.random() >= stateful for _ in range(n)],
                 fixed_memory=fixed, outputs=[bid(0)], name=f"train_dag_k{k}_s{seed}")


def staged_optimum(g, budget):
    """Cheapest staged plan of g.order within budget, by enumeration (None if there is none)."""
    order, n, best = g.order, g.n, None

    def rec(t, seq):
        nonlocal best
        if t == n:
            sim = simulate(g, steps_from_sequence(g, seq))
            if sim.peak_memory <= budget and (best is None or sim.cost < best):
                best = sim.cost
            return
        again = [p for p in range(t) if g.recomputable[order[p]]]
        for r in range(len(again) + 1):
            for sub in itertools.combinations(again, r):
                rec(t + 1, seq + [order[p] for p in sub] + [order[t]])

    rec(0, [])
    return best


def _tiny_graphs():
    yield linear_graph(4)
    yield training_dag(4, seed=0, stateful=0.15, fixed=5)
    yield training_dag(6, seed=2, stateful=0.15, fixed=5)
    yield training_dag(7, seed=4)
    yield random_dag(14, p=0.5, max_back=4, seed=5, backward_fraction=0.4,
                     stateful_fraction=0.2).replace(fixed_memory=3)


@pytest.mark.parametrize("g", list(_tiny_graphs()), ids=lambda g: g.name)
def test_exact_strategies_agree_and_are_optimal(g):
    for f in FRACTIONS:
        budget = int(f * g.no_remat_peak)
        plans = {s: run_strategy_test(s, g, budget) for s in EXACT}
        if budget < g.budget_lower_bound:
            assert all(p.status == "infeasible" for p in plans.values())
            continue
        if plans["checkmate-milp"].status == "infeasible":
            # the budget is below this order's least peak: both must say so
            assert all(not p.within_budget for p in plans.values())
            continue
        costs = {s: p.cost for s, p in plans.items()}
        for s, p in plans.items():
            assert p.status == "optimal", (s, f, p.status, p.info)
            assert p.peak_memory <= budget
            assert p.lower_bound is not None and p.lower_bound <= p.cost + 1e-9
        assert abs(costs["checkmate-milp"] - costs["moccasin"]) <= 1e-9, (f, costs)
        lp = run_strategy_test("checkmate-lp-rounding", g, budget)
        assert lp.peak_memory <= budget and lp.cost >= costs["moccasin"] - 1e-9
        assert lp.lower_bound is not None and lp.lower_bound <= costs["moccasin"] + 1e-9


@pytest.mark.parametrize("g", [training_dag(2, seed=1, fixed=2), linear_graph(2),
                               training_dag(2, seed=3, stateful=0.3)], ids=lambda g: g.name)
def test_brute_force_fixed_order_optimum(g):
    # a 6-node graph too: the forward chain of a 3-layer net with a shared input
    for f in (1.0, 0.9, 0.8, 0.7, 0.6):
        budget = int(f * g.no_remat_peak)
        best = staged_optimum(g, budget)
        for s in EXACT + ["checkmate-lp-rounding"]:
            plan = solve(g, budget, s)
            if best is None:
                assert not plan.within_budget
                continue
            assert plan.within_budget and plan.cost >= best - 1e-9
            if s in EXACT:
                assert plan.status == "optimal" and abs(plan.cost - best) <= 1e-9, (s, f)
            if plan.lower_bound is not None:
                assert plan.lower_bound <= best + 1e-9, (s, f, plan.lower_bound, best)


def test_brute_force_six_nodes_with_a_stateful_node():
    edges = [(0, 1), (1, 2), (0, 2), (2, 3), (1, 4), (3, 4), (0, 5), (4, 5)]
    g = Graph(cost=[3, 1, 4, 1, 5, 9], memory=[5, 3, 6, 2, 4, 1], edges=edges,
              recomputable=[True, True, False, True, True, True], fixed_memory=1)
    for f in (0.9, 0.8):
        budget = int(f * g.no_remat_peak)
        best = staged_optimum(g, budget)
        for s in EXACT:
            plan = run_strategy_test(s, g, budget)
            if best is None:
                assert plan.status == "infeasible"
            else:
                assert plan.status == "optimal" and plan.cost == pytest.approx(best)
                assert plan.lower_bound <= best + 1e-9


def test_lower_bounds_never_exceed_milp_optimum_under_time_limits():
    g = random_layered_graph(40, seed=3)
    budget = int(0.8 * g.no_remat_peak)
    opt = solve(g, budget, "checkmate-milp")
    assert opt.status == "optimal"
    for s in ("checkmate-milp", "checkmate-lp-rounding", "moccasin"):
        p = solve(g, budget, s, time_limit=2)
        assert p.within_budget and p.cost >= opt.cost - 1e-9
        if p.lower_bound is not None:
            assert p.lower_bound <= opt.cost + 1e-9


def test_time_limit_is_honoured_with_a_feasible_plan_and_a_bound():
    g = random_layered_graph(150, seed=7)
    budget = int(0.8 * g.no_remat_peak)
    for s in ("checkmate-milp", "moccasin"):
        start = time.perf_counter()
        p = solve(g, budget, s, time_limit=3)
        took = time.perf_counter() - start
        assert took < 3 + 1.5, (s, took)
        assert p.within_budget and p.status in ("feasible", "optimal")
        if p.status == "optimal":
            assert p.lower_bound is not None


def test_time_limit_is_strict_on_a_model_highs_cannot_finish():
    # about 1.1M nonzeros: HiGHS's presolve and root LP run for seconds without looking at the
    # clock, so the solve runs in a child process that is killed at the deadline
    g = random_layered_graph(200, seed=7)
    budget = int(0.8 * g.no_remat_peak)
    for s in ("checkmate-milp", "checkmate-lp-rounding"):
        start = time.perf_counter()
        p = run_strategy_test(s, g, budget, time_limit=2, check_seed=False)
        took = time.perf_counter() - start
        assert took < 2 + 1.5, (s, took, p.info)
        assert p.within_budget and p.status in ("feasible", "optimal"), (s, p.status)


def test_highs_worker_is_killed_at_the_deadline_and_keeps_incumbents():
    from tf_remat.solvers._highs_worker import HighsWorker
    from tf_remat.solvers._staged import Deadline, Positions, staged_hints
    from tf_remat.solvers.checkmate import CheckmateModel

    class Deaf(HighsWorker):
        # the child is told it has 60 s more than it has: it never stops by itself, as HiGHS
        # does not in presolve or the root LP of a big model
        def _send(self, msg):
            if msg.get("end") is not None:
                msg = dict(msg, end=msg["end"] + 60)
            super()._send(msg)

    g = random_layered_graph(40, seed=3)  # HiGHS takes seconds to prove this one optimal
    budget = int(0.8 * g.no_remat_peak)
    P = Positions(g)
    warm = staged_hints(g, P, budget, baselines=False, gap_limit=0.5)[0][3]
    seen = []
    with Deaf(g, P.order, budget) as w:
        start = time.perf_counter()
        res = w.solve(integral=True, deadline=Deadline(2.0), warm=warm, total=g.total_cost,
                      model=CheckmateModel(P, budget), progress=lambda **k: seen.append(k))
        took = time.perf_counter() - start
        assert took < 2.0 + 0.5, took
        if res["status"] == "optimal":  # a very fast machine: nothing left to test
            return
        assert res["status"] == "timeout" and res["info"]["isolated"] is True
        assert res["info"]["highs_status"] == "killed at the time limit"
        # the incumbents streamed before the kill are kept: a plan of this graph in budget
        assert res["stages"] is not None and any(e["cost"] is not None for e in seen)
        seq = sequence_from_stages(P, res["stages"])
        sim = simulate(g, steps_from_sequence(g, seq))
        assert sim.peak_memory <= budget
        assert res["bound"] is None or res["bound"] <= res["objective"]
        # and a later solve on the killed child says so at once
        again = w.solve(integral=False, deadline=Deadline(5))
        assert again["s"] is None and again["info"]["highs_status"] == "not run"


def test_highs_worker_closed_twice_reaps_its_child_once():
    """close() runs at a deadline and again on __exit__: one thread reaps the child and closes
    its pipe (two raced on CI: "I/O operation on closed file" in the second)."""
    from tf_remat.solvers._highs_worker import HighsWorker
    from tf_remat.solvers._staged import Positions

    g = random_layered_graph(10, seed=1)
    with HighsWorker(g, Positions(g).order, g.no_remat_peak) as w:
        w.close()
        reaper = w._reaper
    assert w._reaper is reaper
    reaper.join(10)
    assert not reaper.is_alive() and w.proc.returncode is not None and w.proc.stdin.closed


def test_checkmate_falls_back_to_first_plan_when_highs_child_dies(monkeypatch):
    import signal

    from tf_remat.solvers import checkmate
    from tf_remat.solvers._highs_worker import HighsWorker

    class Dying(HighsWorker):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.proc.send_signal(signal.SIGKILL)  # what the kernel's OOM killer does

    monkeypatch.setenv("TF_REMAT_HIGHS_SUBPROCESS", "1")
    monkeypatch.setattr(checkmate, "HighsWorker", Dying)
    g = random_layered_graph(40, seed=3)
    budget = int(0.8 * g.no_remat_peak)
    for s in ("checkmate-milp", "checkmate-lp-rounding"):
        p = solve(g, budget, s, time_limit=10)
        assert p.within_budget and p.status == "feasible", (s, p.status)
        assert "SIGKILL" in p.info.get("error", ""), p.info


def test_moccasin_reaches_published_optimum_on_bundled_graph():
    from tf_remat.demo import bundled_graph_path

    g = Graph.load(bundled_graph_path())
    # about a second on an idle machine (benchmarks/results/solvers.md); the limit is generous
    # because this asserts the plan's quality, not the speed, and CI machines are shared
    p = solve(g, int(0.9 * g.no_remat_peak), "moccasin", time_limit=30)
    assert p.within_budget and p.overhead <= 0.0080


def test_published_fcn8_within_targets():
    g = Graph.load(shared_graph("fcn_8_vgg_b32_416x608_train"))
    for f, target in ((0.9, 0.0003), (0.8, 0.0015)):
        p = solve(g, int(f * g.no_remat_peak), "moccasin", time_limit=5)
        assert p.within_budget and p.overhead <= target + 1e-6


def test_hint_option_and_progress_callback():
    g = random_layered_graph(60, seed=2)
    budget = (g.budget_lower_bound + g.no_remat_peak) // 2
    base = solve(g, budget, "checkmate-lp-rounding", time_limit=3)
    events = []
    for s in ("moccasin", "checkmate-milp"):
        p = solve(g, budget, s, time_limit=3, hint=base.sequence, callback=events.append)
        assert base.within_budget and p.within_budget and p.cost <= base.cost + 1e-9
    assert events and all("elapsed" in e for e in events)
    with pytest.raises(StrategyError):
        solve(g, budget, "moccasin", hint="0,1,2")  # a string is not a compute sequence
    with pytest.raises(StrategyError):
        solve(g, budget, "moccasin", C=0)
    with pytest.raises(StrategyError):
        solve(g, budget, "moccasin", order="sideways")


def test_auto_over_every_budget_returns_the_lowest_peak_found():
    """An infeasible solve reports its peak as the smallest budget reached (optimize's error
    says raise the budget to it), so ``auto`` keeps the lowest peak of its components, not the
    one FastSA's objective max(peak, budget) * cost prefers (44 here where MOCCASIN found 42)."""
    g = training_dag(14, seed=0)
    budget = int(1.01 * g.budget_lower_bound)
    p = solve(g, budget, "auto", time_limit=6)
    assert not p.within_budget
    peaks = [r["peak"] for r in p.info["runs"] if "peak" in r]
    assert p.peak_memory == min(peaks), p.info["runs"]


def test_moccasin_free_order_gives_valid_plans():
    g = training_dag(5, seed=6, fixed=2)
    for f in (0.9, 0.8):
        budget = int(f * g.no_remat_peak)
        if budget < g.budget_lower_bound:
            continue
        fixed = solve(g, budget, "moccasin")
        free = run_strategy_test("moccasin", g, budget, order="free", C=3, check_seed=False,
                                 time_limit=10)
        assert free.within_budget
        assert free.cost <= fixed.cost + 1e-9 or free.status == "feasible"


def test_float_costs_keep_bounds_valid():
    g = training_dag(5, seed=8)
    g = g.replace(cost=[c * 1.37e-3 + 1e-7 * i for i, c in enumerate(g.cost)])
    budget = int(0.8 * g.no_remat_peak)
    plans = [solve(g, budget, s) for s in EXACT]
    if budget >= g.budget_lower_bound:
        assert abs(plans[0].cost - plans[1].cost) <= 1e-9 * plans[0].cost
        for p in plans:
            assert p.lower_bound <= p.cost * (1 + 1e-12)


def test_moccasin_in_a_child_process_matches_in_process(monkeypatch):
    # with TensorFlow loaded CP-SAT must run in a child process (see solvers/_cpsat.py); the
    # answer and the progress reports must be the same as in this process
    g = training_dag(6, seed=2, stateful=0.15, fixed=5)
    budget = int(0.8 * g.no_remat_peak)
    here = run_strategy_test("moccasin", g, budget)
    seen = []
    monkeypatch.setenv("TF_REMAT_CPSAT_SUBPROCESS", "1")
    child = solve(g, budget, strategy="moccasin", callback=seen.append)
    assert child.info.get("isolated") is True
    assert child.status == here.status
    assert abs(child.cost - here.cost) <= 1e-9
    assert child.peak_memory <= budget
    assert any(ev.get("cost") is not None for ev in seen)


def test_bench_auto_share_writes_its_table(tmp_path):
    """The benchmark behind auto's time split runs on a bundled graph and writes a row per
    graph with a cell per share."""
    out = tmp_path / "share.md"
    graph = os.path.join(ROOT, "tf_remat", "examples", "random_layered_n100.json")
    assert load_tool("bench_auto_share").main(
        [graph, "--repeats", "1", "--time-limit", "1", "-o", str(out)]) == 0
    rows = [r for r in out.read_text().splitlines() if r.startswith("| random_layered")]
    assert len(rows) == 1 and rows[0].count("/1 /") == 2


def test_auto_unfit_share_option_is_checked():
    g = training_dag(14, seed=0)
    budget = (g.budget_lower_bound + g.no_remat_peak) // 2
    assert solve(g, budget, "auto", time_limit=1, unfit_share=0.3).within_budget
    for bad in (0, 1.5):
        with pytest.raises(StrategyError, match="unfit_share"):
            solve(g, budget, "auto", unfit_share=bad)
