
import pytest

from tf_remat.errors import PlanError
from tf_remat.generators import linear_graph, random_dag
from tf_remat.graph import Graph
from tf_remat.plan import (Plan, Schedule, adjoin, concurrent_groups, defer, explain, make_plan,
                           minimal_r, plan_from_rs, run_cost, sequence_from_rs, simulate,
                           steps_from_sequence)

CHAIN = Graph(cost=(1, 2, 3, 4), memory=(10, 20, 30, 40), edges=((0, 1), (1, 2), (2, 3)))


def test_simulator_semantics_by_hand():
    steps = [("compute", 0), ("compute", 1), ("free", 0), ("compute", 2), ("free", 1),
             ("compute", 3), ("free", 2)]
    g = CHAIN.replace(fixed_memory=5)
    sim = simulate(g, steps)
    assert sim.timeline == (15, 35, 25, 55, 35, 75, 45)
    assert sim.peak_memory == 75 and sim.peak_step == 5
    assert sim.cost == 10


@pytest.mark.parametrize("steps, words", [
    ([("compute", 1)], "input 0 is not resident"),
    ([("compute", 0), ("compute", 0)], "already resident"),
    ([("free", 0)], "not resident"),
    ([("compute", 0), ("compute", 1), ("compute", 2)], "never computes"),
    ([("compute", 0), ("compute", 1), ("compute", 2), ("compute", 3), ("free", 3)],
     "output 3 is not resident"),
    ([("run", 0)], "operation 'run'"),
    ([("compute", 9)], "ids run 0..3"),
])
def test_simulator_rejects_invalid_plans(steps, words):
    with pytest.raises(PlanError, match=words):
        simulate(CHAIN, steps)


def test_simulator_refuses_recomputing_stateful_node():
    g = CHAIN.replace(recomputable=(True, False, True, True))
    with pytest.raises(PlanError, match="not recomputable"):
        simulate(g, steps_from_sequence(g, [0, 1, 2, 1, 3]))


def test_steps_from_sequence_frees_after_last_reader_and_uses_latest_copy():
    g = linear_graph(3)  # f0 f1 f2 loss b2 b1 b0 ; b_i reads f_i
    seq = [0, 1, 2, 3, 4, 5, 0, 6]  # recompute f0 before b0
    steps = steps_from_sequence(g, seq)
    sim = simulate(g, steps)
    assert sim.compute_counts[0] == 2
    # the first copy of f0 is freed right after f1 is computed
    assert steps[:3] == (("compute", 0), ("compute", 1), ("free", 0))
    with pytest.raises(PlanError, match="before its input"):
        steps_from_sequence(g, [1, 0])


def test_steps_from_sequence_is_memory_minimal_on_small_graphs():
    """No way of placing frees beats ours for the same compute sequence."""
    g = random_dag(7, seed=5)
    seq = list(g.order)
    ours = simulate(g, steps_from_sequence(g, seq)).peak_memory
    assert ours == g.no_remat_peak
    # brute force: frees only at the end are never better
    keep_all = [("compute", v) for v in seq] + [("free", v) for v in range(g.n)
                                                  if v not in g.outputs]
    assert simulate(g, keep_all).peak_memory >= ours


def test_minimal_r_and_plan_from_rs_on_a_chain():
    g = linear_graph(3)
    n = g.n
    # checkpoint nothing forward after its stage: S keeps only backward values and the loss
    S = [[0] * n for _ in range(n)]
    for t in range(1, n):
        for v in g.order[:t]:
            if g.backward[v] or g.names[v] == "loss":
                S[t][v] = 1
        S[t][g.order[t - 1]] = 1
    R = minimal_r(g, S)
    for t in range(n):
        assert R[t][g.order[t]] == 1
    seq = sequence_from_rs(g, R)
    plan = plan_from_rs(g, R, S, strategy="manual")
    sim = simulate(g, plan.steps)
    assert plan.peak_memory == sim.peak_memory
    assert sim.cost > g.total_cost  # forward values were recomputed
    assert list(seq) == list(plan.sequence)


def test_make_plan_marks_over_budget_infeasible_and_roundtrips(tmp_path):
    g = linear_graph(4)
    plan = make_plan(g, Schedule(sequence=g.order), budget=g.no_remat_peak - 1, strategy="x")
    assert plan.status == "infeasible"
    ok = make_plan(g, Schedule(sequence=g.order), budget=g.no_remat_peak, strategy="x")
    assert ok.status == "feasible" and ok.overhead == 0
    p = tmp_path / "plan.json"
    ok.save(p)
    back = Plan.load(p)
    assert back.steps == ok.steps and back.peak_memory == ok.peak_memory
    empty = make_plan(g, Schedule(sequence=(), status="timeout"), budget=10)
    assert empty.status == "timeout" and not empty.found


def test_plan_load_errors(tmp_path):
    p = tmp_path / "p.json"
    p.write_text('{"format": "tf-remat-plan", "steps": [["jump", 1]]}')
    with pytest.raises(PlanError, match="jump"):
        Plan.load(p)
    with pytest.raises(PlanError, match="does not exist"):
        Plan.load(tmp_path / "none.json")


def test_explain_lists_recomputed_nodes():
    g = linear_graph(3)
    plan = make_plan(g, Schedule(sequence=[0, 1, 2, 3, 4, 5, 0, 6]), budget=10**9)
    text = explain(plan, g)
    assert "recomputed 1 of 7 nodes" in text
    assert "0 (f0): computed 2x" in text


def recomputing_sequence(g):
    """``g``'s order with a few early nodes recomputed late, before the last reader that
    follows them."""
    seq = list(g.order)
    for v in list(g.order)[: g.n // 3]:
        later = [s for s in g.succs[v] if seq.index(s) > seq.index(v) + 2]
        if later and g.recomputable[v] and all(u in seq[: seq.index(later[-1])]
                                               for u in g.preds[v]):
            seq.insert(seq.index(later[-1]), v)
    return seq


def test_concurrent_groups_by_hand():
    """A diamond 0 -> {1, 2} -> 3: memory 10, 20, 30, 5; the plan peaks at 60 (0, 1 and 2
    resident). 0, 1 and 2 may run at once (at most 60); 3 may not join them (65), and starts
    its own run after 0 is freed."""
    g = Graph(cost=(1, 1, 1, 1), memory=(10, 20, 30, 5), edges=((0, 1), (0, 2), (1, 3), (2, 3)))
    steps = steps_from_sequence(g, [0, 1, 2, 3])
    assert simulate(g, steps).peak_memory == 60
    assert concurrent_groups(g, steps) == (0, 0, 0, 1)
    assert concurrent_groups(g, steps, cap=10**6) == (0, 0, 0, 0)
    # a cap under the plan's peak: a compute that passes it alone is a run of its own
    assert concurrent_groups(g, steps, cap=59) == (0, 0, 1, 2)
    assert concurrent_groups(g, steps, cap=0) == (0, 1, 2, 3)
    # only 1 and 2 may share a run: 0 is a run of its own, as is 3
    assert concurrent_groups(g, steps, among={1, 2}) == (0, 1, 1, 2)
    assert concurrent_groups(g, steps, among={2, 3}) == (0, 1, 2, 3)


def test_adjoin_moves_a_loop_next_to_the_one_before_it():
    """Two loops (1 and 4, memory 5) fed by independent inputs (0, memory 7; 2 -> 3), joined by
    5. In the order 0 1 2 3 4 5, 4 moves next to 1 with what it needs (2, 3) before 1; the cost
    and the computes stay. 3 is then resident beside 0 and 1: the peak goes from 12 to 13, so
    the default cap (the order's own peak) leaves the order as it was."""
    g = Graph(cost=(1, 2, 3, 4, 5, 6), memory=(7, 5, 1, 1, 5, 1),
              edges=((0, 1), (2, 3), (3, 4), (1, 5), (4, 5)))
    seq = (0, 1, 2, 3, 4, 5)
    new = adjoin(g, seq, {1, 4}, cap=100)
    assert new == (0, 2, 3, 1, 4, 5)
    before = simulate(g, steps_from_sequence(g, seq))
    after = simulate(g, steps_from_sequence(g, new))
    assert after.cost == before.cost and sorted(new) == sorted(seq)
    assert (before.peak_memory, after.peak_memory) == (12, 13)
    assert adjoin(g, seq, {1, 4}) == seq
    assert adjoin(g, seq, {1, 4}, cap=13) == new
    # 1 and 4 share a run where the memory before 1 (8) plus both outputs fits the cap
    steps = steps_from_sequence(g, new)
    assert concurrent_groups(g, steps, cap=18, among={1, 4}) == (0, 1, 2, 3, 3, 4)
    assert concurrent_groups(g, steps, cap=17, among={1, 4}) == (0, 1, 2, 3, 4, 5)
    # the run of 1 and 4 costs its dearer member, 5 (the order's costs: 1 3 4 2 5 6)
    assert run_cost(g, steps, (0, 1, 2, 3, 3, 4)) == 1 + 3 + 4 + 5 + 6
    assert run_cost(g, steps) == run_cost(g, steps, (0, 1, 2, 3, 4, 5)) == after.cost == 21


def test_adjoin_leaves_a_loop_that_reads_the_other():
    """4 reads 1 through 3: they cannot run at once, and nothing moves; neither does a single
    loop, or one whose previous loop is already next to it."""
    g = Graph(cost=(1,) * 6, memory=(1, 5, 1, 1, 5, 1),
              edges=((0, 1), (1, 3), (2, 3), (3, 4), (4, 5)))
    seq = (0, 1, 2, 3, 4, 5)
    assert adjoin(g, seq, {1, 4}, cap=100) == seq
    assert adjoin(g, seq, {1}, cap=100) == seq
    g2 = Graph(cost=(1,) * 4, memory=(1, 5, 5, 1), edges=((0, 1), (0, 2), (1, 3), (2, 3)))
    assert adjoin(g2, (0, 1, 2, 3), {1, 2}, cap=100) == (0, 1, 2, 3)


def test_defer_moves_an_update_after_the_reader_of_its_old_value():
    """0 a weight's read, 1 an activation, 2 the weight's gradient, 3 its update (after[3] = {4}:
    4 reads the weight's value from before the update). In the order 0 1 2 3 4 the update moves
    after 4 where the cap allows: the gradient (4 bytes) is then resident while 4 computes, and
    the peak goes from 7 to 9. Not when 4 reads the update, nor for a node computed twice."""
    g = Graph(cost=(1, 2, 3, 4, 5), memory=(1, 2, 4, 0, 3),
              edges=((0, 1), (0, 2), (2, 3), (1, 4)))
    seq = (0, 1, 2, 3, 4)
    before = simulate(g, steps_from_sequence(g, seq))
    assert before.peak_memory == 7
    assert defer(g, seq, {3: {4}}) == seq
    new = defer(g, seq, {3: {4}}, cap=9)
    assert new == (0, 1, 2, 4, 3)
    after = simulate(g, steps_from_sequence(g, new))
    assert after.peak_memory == 9 and after.cost == before.cost
    assert defer(g, seq, {3: {4, 3}, 4: set()}, cap=9) == new  # itself and no readers: ignored
    assert defer(g, new, {3: {4}}, cap=100) == new  # already after its reader
    g2 = Graph(cost=(1,) * 5, memory=(1, 2, 4, 0, 3),
               edges=((0, 1), (0, 2), (2, 3), (1, 4), (3, 4)))
    assert defer(g2, seq, {3: {4}}, cap=100) == seq  # 4 reads 3
    twice = (0, 1, 2, 3, 1, 4)
    assert defer(g, twice, {1: {2}}, cap=100) == twice


def test_adjoin_keeps_every_plan_valid():
    """On random graphs with recomputation, whatever nodes are called loops: the new order is a
    valid plan with the same computes and cost, within the cap. (Every node of these graphs
    reads the one before it, so what moves is a loop that reads an older copy of the chain than
    the loop before it.)"""
    import random

    moved = 0
    for seed in range(6):
        g = random_dag(24, seed=seed)
        seq = recomputing_sequence(g)
        loops = set(random.Random(seed).sample(range(g.n), 10))
        for new in moved_orders(g, seq, lambda cap: adjoin(g, seq, loops, cap=cap)):
            moved += tuple(new) != tuple(seq)
    assert moved >= 6


def moved_orders(g, seq, move):
    """``move(cap)`` at the sequence's own peak and with no cap: each a valid plan with the same
    computes and cost, within the cap. Returns the two new sequences."""
    before = simulate(g, steps_from_sequence(g, seq))
    out = []
    for cap in (before.peak_memory, 10**9):
        new = move(cap)
        after = simulate(g, steps_from_sequence(g, new))  # raises on an invalid plan
        assert sorted(new) == sorted(seq) and after.cost == pytest.approx(before.cost)
        assert after.peak_memory <= cap
        out.append(new)
    return out


def test_defer_keeps_every_plan_valid():
    """On random graphs with recomputation and random readers: the new order is a valid plan
    with the same computes and cost, within the cap, and a node it moved has none of its
    readers after it."""
    import random

    def late(order, u):  # a reader of u's after it
        return any(order.index(u) < p for p, v in enumerate(order) if v in after[u] - {u})

    moved = 0
    for seed in range(8):
        rng = random.Random(seed)
        n = 24  # sparse, unlike random_dag's, whose every node reads the one before it
        edges = [(i, j) for j in range(1, n) for i in rng.sample(range(j), min(j, 2))]
        g = Graph(cost=[rng.uniform(1, 5) for _ in range(n)],
                  memory=[rng.randint(1, 9) for _ in range(n)], edges=edges)
        seq = recomputing_sequence(g)
        after = {u: set(rng.sample(range(n), 3)) for u in rng.sample(range(n), 8)}
        for new in moved_orders(g, seq, lambda cap: defer(g, seq, after, cap=cap)):
            for u in after:
                if seq.count(u) == 1 and late(seq, u) and not late(new, u):
                    moved += 1
    assert moved >= 4, moved


@pytest.mark.parametrize("seed", range(6))
def test_concurrent_groups_never_pass_the_peak(seed):
    """In every run, the memory before its first compute plus every member's output (all
    started, none freed: the most any order or overlap can hold) stays within the plan's peak;
    no node is in a run twice; runs are numbered in order."""
    g = random_dag(14, seed=seed)
    seq = recomputing_sequence(g)
    steps = steps_from_sequence(g, seq)
    sim = simulate(g, steps)
    runs = concurrent_groups(g, steps)
    assert len(runs) == len(seq) and runs[0] == 0
    assert all(b - a in (0, 1) for a, b in zip(runs, runs[1:]))
    assert runs[-1] < len(seq) - 1, "some computes should share a run"
    before = []  # memory before each compute
    mem = g.fixed_memory
    for op, v in steps:
        if op == "compute":
            before.append(mem)
        mem += g.memory[v] if op == "compute" else -g.memory[v]
    for r in set(runs):
        members = [p for p, q in enumerate(runs) if q == r]
        nodes = [seq[p] for p in members]
        assert len(set(nodes)) == len(nodes)
        assert before[members[0]] + sum(g.memory[v] for v in nodes) <= sim.peak_memory
