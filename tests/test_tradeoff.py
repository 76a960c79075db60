
import pytest

from tf_remat.cli import main
from tf_remat.generators import linear_graph
from tf_remat.plan import simulate
from tf_remat.solvers import solve
from tf_remat.tradeoff import parse_budget_range, tradeoff, write_table


def test_tradeoff_points_are_valid_plans_and_monotone_for_greedy():
    g = linear_graph(30)
    fr = parse_budget_range("0.4:1.0:0.2")
    assert fr == [0.4, 0.6, 0.8, 1.0]
    pts = tradeoff(g, fr, ["chen-greedy", "checkpoint-all"], time_limit=5, verbose=0)
    assert len(pts) == 8
    for p in pts:
        if p.overhead is not None:
            plan = solve(g, p.budget, p.strategy, time_limit=5)
            sim = simulate(g, plan.steps)
            assert sim.peak_memory <= p.budget
            assert abs(sim.cost / g.total_cost - 1 - p.overhead) < 1e-12
    greedy = {p.fraction: p.overhead for p in pts if p.strategy == "chen-greedy"}
    assert greedy[1.0] == 0.0 and greedy[0.4] is not None and greedy[0.4] > 0
    ck = {p.fraction: p.overhead for p in pts if p.strategy == "checkpoint-all"}
    assert ck[1.0] == 0.0 and ck[0.4] is None
    text = write_table(g, pts)
    assert "| 40% |" in text and "| - |" in text


def test_tradeoff_cli_writes_png_and_table(tmp_path, capsys):
    g = linear_graph(20)
    path = tmp_path / "g.json"
    g.save(path)
    out = tmp_path / "curve.png"
    code = main(["tradeoff", str(path), "--budgets", "0.5,0.75,1.0", "--strategies",
                 "chen-greedy", "griewank-logn", "-o", str(out), "-q"])
    assert code == 0
    assert out.exists() and out.stat().st_size > 5000
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (tmp_path / "curve.md").read_text()
    assert "chen-greedy" in table and "| 75% |" in table


@pytest.mark.parametrize("bad", ["0.4:1.0", "1:0.5:0.1", "a,b", "0.5:1:0"])
def test_bad_budget_ranges(bad):
    with pytest.raises(ValueError):
        parse_budget_range(bad)
