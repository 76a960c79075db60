import json
import subprocess
import sys

import pytest

from conftest import shared_graph
from tf_remat._units import parse_budget
from tf_remat.cli import main
from tf_remat.generators import linear_graph
from tf_remat.plan import Plan, simulate


def run(*args):
    return subprocess.run([sys.executable, "-m", "tf_remat", *args], capture_output=True,
                          text=True)


@pytest.fixture
def graph_file(tmp_path):
    g = linear_graph(20).replace(fixed_memory=3)
    path = tmp_path / "g.json"
    g.save(path)
    return g, str(path)


def test_info_json_keys(graph_file, capsys):
    g, path = graph_file
    assert main(["info", path, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["no_remat_peak"] == g.no_remat_peak
    assert info["total_cost"] == g.total_cost
    assert info["budget_lower_bound"] == g.budget_lower_bound
    assert info["nodes"] == g.n and info["edges"] == len(g.edges)


def test_info_on_published_graph():
    out = run("info", shared_graph("random_layered_n250"), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["no_remat_peak"] == 146840


@pytest.mark.parametrize("budget", ["0.7", "1.0"])
def test_solve_writes_plan_that_resimulates(graph_file, tmp_path, budget):
    g, path = graph_file
    out = tmp_path / "plan.json"
    code = main(["solve", path, "--budget", budget, "--strategy", "chen-greedy", "-o", str(out)])
    assert code == 0
    plan = Plan.load(out)
    sim = simulate(g, plan.steps)
    assert sim.peak_memory == plan.peak_memory <= parse_budget(budget, g.no_remat_peak)
    assert sim.cost == plan.cost


def test_solve_infeasible_exits_3_and_writes_over_budget_plan(graph_file, tmp_path, capsys):
    g, path = graph_file
    out = tmp_path / "plan.json"
    code = main(["solve", path, "--budget", "0.2", "--strategy", "checkpoint-all",
                 "-o", str(out)])
    assert code == 3
    err = capsys.readouterr().err
    assert "least any plan can reach" in err or "no plan within the budget" in err
    plan = Plan.load(out)
    assert plan.status == "infeasible" and plan.peak_memory > plan.budget


def test_cyclic_graph_exits_2_naming_the_cycle(tmp_path):
    doc = {"format": "tf-remat-graph", "version": 1, "name": "cyc",
           "nodes": [{"id": i, "name": f"op{i}", "cost": 1, "memory": 1} for i in range(3)],
           "edges": [[0, 1], [1, 2], [2, 1]]}
    p = tmp_path / "cyc.json"
    p.write_text(json.dumps(doc))
    out = run("solve", str(p), "--budget", "0.9", "--strategy", "checkpoint-all", "-o",
              str(tmp_path / "x.json"))
    assert out.returncode == 2
    assert "cycle" in out.stderr and "1 (op1) -> 2 (op2) -> 1 (op1)" in out.stderr


@pytest.mark.parametrize("args, words", [
    (["--budget", "lots"], "is not a number"),
    (["--budget", "3XB"], "unknown unit"),
    (["--budget", "0.9", "--strategy", "nope"], "unknown strategy 'nope'"),
    (["--budget", "0.9", "--strategy", "griewank-logn", "--set", "x"], "KEY=VALUE"),
])
def test_bad_input_exits_2(graph_file, args, words, capsys):
    _, path = graph_file
    assert main(["solve", path, *args]) == 2
    assert words in capsys.readouterr().err


def test_missing_graph_file_exits_2(tmp_path, capsys):
    assert main(["info", str(tmp_path / "nope.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_simulate_and_explain(graph_file, tmp_path, capsys):
    g, path = graph_file
    out = tmp_path / "plan.json"
    assert main(["solve", path, "--budget", "0.6", "-s", "chen-sqrtn", "-o", str(out)]) in (0, 3)
    capsys.readouterr()
    assert main(["simulate", path, str(out), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["valid"] and res["peak_memory"] == Plan.load(out).peak_memory
    assert main(["explain", path, str(out)]) == 0
    assert "recomputed" in capsys.readouterr().out


def test_strategies_lists_the_registry(capsys):
    assert main(["strategies"]) == 0
    text = capsys.readouterr().out
    for name in ("checkpoint-all", "chen-greedy", "griewank-logn", "linearized-sqrtn"):
        assert name in text


def test_budget_units():
    assert parse_budget("12884901888") == 12884901888
    assert parse_budget("12GB") == 12 * 10**9
    assert parse_budget("11.3GiB") == int(11.3 * 2**30)
    with pytest.raises(ValueError, match="negative"):
        parse_budget("-5GiB")
    assert parse_budget("0.8", 146840) == 117472
    with pytest.raises(ValueError, match="fraction"):
        parse_budget("0.8")


def test_a_plan_for_another_graph_is_named_as_such(graph_file, tmp_path, capsys):
    g, path = graph_file
    other = tmp_path / "other.json"
    linear_graph(9).save(other)
    plan = tmp_path / "p.json"
    assert main(["solve", str(other), "--budget", "0.9", "--strategy", "chen-greedy", "-q",
                 "-o", str(plan)]) == 0
    capsys.readouterr()
    for cmd in (["simulate", path, str(plan)], ["explain", path, str(plan)],
                ["plot", path, str(plan), "-o", str(tmp_path / "m.png")]):
        assert main(cmd) == 2, cmd
        err = capsys.readouterr().err
        assert f"is a plan for graph 'linear_n9', not for '{g.name}'" in err, err


def test_output_cut_short_by_its_reader_is_no_error(tmp_path):
    # ``tf-remat explain ... | head``: the reader leaves, a BrokenPipeError's traceback did
    g = linear_graph(3000)  # an explanation longer than a pipe's 64 KiB buffer
    path, plan = tmp_path / "g.json", tmp_path / "p.json"
    g.save(path)
    assert main(["solve", str(path), "--budget", "0.3", "--strategy", "chen-sqrtn", "-q",
                 "-o", str(plan)]) == 0
    proc = subprocess.run(f"{sys.executable} -m tf_remat explain {path} {plan} --limit 3000 "
                          f"| head -1", shell=True, capture_output=True, text=True)
    assert proc.stdout.startswith("plan chen-sqrtn"), proc
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("argv, flag", [
    (["demo", "--batch", "0"], "--batch: '0' is not over zero"),
    (["demo", "--epochs", "-1"], "--epochs: '-1' is not over zero"),
    (["solve", "g.json", "-b", "1", "--time-limit", "-2"], "--time-limit: '-2' is not over zero"),
    (["max-batch", "--model", "bn_cnn", "--budget-gb", "0"], "--budget-gb: '0' is not over"),
    (["max-batch", "--model", "bn_cnn", "--budget-gb", "1", "--start", "x"],
     "--start: 'x' is not an integer"),
])
def test_counts_and_seconds_not_over_zero_are_refused_at_once(argv, flag, capsys):
    # ``demo --batch 0`` ran the default batch and reported success; ``--time-limit -2``
    # failed minutes later, after the plain step was measured
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err
