"""The BFC allocator model: TensorFlow's placement rules, and replaying a step through them."""

import dataclasses
import random

import pytest

from tf_remat.allocator import BFCModel, replay
from tf_remat.generators import random_layered_graph
from tf_remat.plan import simulate, steps_from_sequence

MIB = 2**20


def test_whole_chunk_when_less_than_twice_the_request():
    m = BFCModel()
    m.free(m.allocate(8 * MIB))
    pool = m.pool_bytes
    m.allocate(5 * MIB)
    assert (m.in_use, m.requested, m.pool_bytes) == (8 * MIB, 5 * MIB, pool)


def test_split_when_at_least_twice_the_request():
    m = BFCModel()
    m.free(m.allocate(8 * MIB))
    a = m.allocate(3 * MIB)
    assert m.in_use == 3 * MIB
    b = m.allocate(5 * MIB)  # the rest of the 8 MiB chunk: no new region
    assert m.in_use == 8 * MIB and b == a + 3 * MIB


def test_rounds_to_256_bytes():
    m = BFCModel()
    m.allocate(1)
    m.allocate(257)
    assert (m.in_use, m.requested) == (256 + 512, 258)


def test_free_merges_neighbours_so_a_larger_request_fits():
    m = BFCModel()
    m.free(m.allocate(64 * MIB))  # one region, so what follows sits side by side
    a, b, c = (m.allocate(4 * MIB) for _ in range(3))
    keep = m.allocate(4 * MIB)
    pool = m.pool_bytes
    m.free(a), m.free(c), m.free(b)  # b's free joins a, b and c into one 12 MiB chunk
    d = m.allocate(12 * MIB)
    assert d == a and m.pool_bytes == pool
    assert m.in_use == 16 * MIB
    m.free(d), m.free(keep)
    assert m.in_use == 0 and m.requested == 0


def test_regions_double_from_2_mib():
    m = BFCModel()
    m.allocate(2 * MIB)
    assert m.pool_bytes == 2 * MIB
    m.allocate(1 * MIB)  # a new region, twice the last
    assert m.pool_bytes == 6 * MIB
    m.allocate(20 * MIB)  # doubled until it fits: 32 MiB
    assert m.pool_bytes == 38 * MIB


def test_best_fit_prefers_the_smallest_chunk_that_fits():
    m = BFCModel()
    big, sep1, small, sep2 = (m.allocate(s) for s in (16 * MIB, MIB, 6 * MIB, MIB))
    m.free(big), m.free(small)
    assert m.allocate(5 * MIB) == small  # 6 MiB < 10: held whole, the 16 MiB chunk untouched
    assert m.in_use == 8 * MIB


def test_zero_bytes_is_no_allocation():
    with pytest.raises(ValueError, match="positive size"):
        BFCModel().allocate(0)
    assert replay([(True, "a", 0), (False, "a", 0)]) == {"requested_peak_bytes": 0,
                                                        "held_peak_bytes": 0}


def test_free_of_unknown_address_raises():
    m = BFCModel()
    a = m.allocate(MIB)
    m.free(a)
    with pytest.raises(ValueError):
        m.free(a)


def _plan_events(g, steps):
    return [(op == "compute", v, g.memory[v]) for op, v in steps]


@pytest.mark.parametrize("seed", range(5))
def test_replay_holds_at_least_what_a_plan_requests(seed):
    g = random_layered_graph(60, seed=seed)
    rng = random.Random(seed)
    g = dataclasses.replace(g, memory=tuple(rng.randrange(1, 4 * MIB) for _ in g.memory))
    steps = steps_from_sequence(g, g.order)
    sim = simulate(g, steps).peak_memory - g.fixed_memory
    out = replay(_plan_events(g, steps))
    assert out["requested_peak_bytes"] == sim
    assert sim <= out["held_peak_bytes"] <= 2 * sim


def test_replay_counts_a_reused_chunk_whole():
    from tf_remat.graph import Graph
    # c (5 MiB) lands in the chunk a (8 MiB) freed, less than twice its size: it holds all 8,
    # so with d the step holds 12 MiB where its values take 9
    g = Graph(cost=(1, 1, 1, 1), memory=(8 * MIB, MIB, 5 * MIB, 4 * MIB),
              edges=((0, 1), (1, 2), (2, 3)))
    steps = steps_from_sequence(g, (0, 1, 2, 3))
    assert simulate(g, steps).peak_memory == 9 * MIB
    for warm in (0, 2):
        m = BFCModel()
        m.free(m.allocate(64 * MIB))  # a pool grown earlier: one 64 MiB region
        out = replay(_plan_events(g, steps), warm_runs=warm, model=m)
        assert out == {"requested_peak_bytes": 9 * MIB, "held_peak_bytes": 12 * MIB}
        assert m.in_use == 0  # what the step still held at its end was freed


def test_replay_ignores_frees_of_memory_from_before_the_step():
    out = replay([(False, "weights", 0), (True, "a", MIB), (False, "a", 0)])
    assert out == {"requested_peak_bytes": MIB, "held_peak_bytes": MIB}


def test_the_allocator_benchmark_replays_a_plans_buffers_as_the_simulator_counts_them():
    """tools/bench_allocator.py's model of a plan: each node's buffers allocated at its compute
    and freed at its free; the bytes requested peak where the simulator's peak is."""
    import types

    from conftest import load_tool
    from tf_remat.graph import Graph
    from tf_remat.plan import make_plan
    from tf_remat.solvers.baselines import checkpoint_all

    bench = load_tool("bench_allocator")
    # a diamond; node 1 has two buffers, node 3 none listed (a workspace node: one request)
    g = Graph(cost=(1, 1, 1, 1, 1), memory=(4096, 3072, 2048, 1024, 512),
              edges=((0, 1), (0, 2), (1, 3), (2, 3), (3, 4)), fixed_memory=100)
    om = types.SimpleNamespace(buffers=(((("a", 4096),), (("b", 1024), ("c", 2048)),
                                         (("d", 2048),), (), (("e", 512),))))
    plan = make_plan(g, checkpoint_all(g, 10**9), 10**9)
    events = bench.plan_events(g, om, plan)
    assert sum(1 for e in events if e[0]) == 6
    assert sorted(e[2] for e in events if e[0]) == [512, 1024, 1024, 2048, 2048, 4096]
    out = replay(events)
    assert out["requested_peak_bytes"] == plan.peak_memory - g.fixed_memory
    assert out["held_peak_bytes"] >= out["requested_peak_bytes"]
