"""Memory-over-schedule plots (no TensorFlow)."""

import pytest

from tf_remat.cli import main
from tf_remat.generators import linear_graph
from tf_remat.plot import memory_curve, plot_memory
from tf_remat.solvers import solve


def test_memory_curve_follows_the_simulator():
    g = linear_graph(12)
    plan = solve(g, int(0.7 * g.no_remat_peak), "chen-sqrtn")
    xs, ys = memory_curve(g, plan)
    assert max(ys) == plan.peak_memory
    assert xs[-1] == pytest.approx(plan.cost)
    assert all(b >= a for a, b in zip(xs, xs[1:]))
    steps_x, _ = memory_curve(g, plan, x="step")
    assert steps_x[-1] == len(plan.sequence)
    with pytest.raises(ValueError):
        memory_curve(g, plan, x="bytes")


def test_plot_file_and_cli(tmp_path):
    g = linear_graph(12)
    plans = [solve(g, g.no_remat_peak, s) for s in ("checkpoint-all", "chen-sqrtn")]
    out = plot_memory(g, plans, tmp_path / "a" / "m.png", budget=int(0.8 * g.no_remat_peak))
    assert (tmp_path / "a" / "m.png").stat().st_size > 1000 and out.endswith("m.png")
    with pytest.raises(ValueError):
        plot_memory(g, [], tmp_path / "x.png")
    gp = tmp_path / "g.json"
    g.save(gp)
    paths = []
    for i, p in enumerate(plans):
        paths.append(str(tmp_path / f"p{i}.json"))
        p.save(paths[-1])
    assert main(["plot", str(gp), *paths, "-o", str(tmp_path / "cli.svg"), "-b", "0.8"]) == 0
    assert (tmp_path / "cli.svg").read_text().startswith("<?xml")
    assert main(["plot", str(gp), str(tmp_path / "missing.json")]) == 2
