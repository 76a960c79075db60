"""`tf-remat demo`, the README's first command: both modes, run as a user runs them."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, tmp_path, timeout):
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, "-m", "tf_remat", "demo", *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_graph_demo_solves_the_bundled_graph_with_every_strategy(tmp_path):
    proc = _run(["--graph", "bundled", "--time-limit", "2", "--quiet"], tmp_path, 300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "budget" in out and "(80%)" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "strategy" not in line]
    names = {r.split("|")[1].strip() for r in rows}
    assert {"checkpoint-all", "chen-greedy", "checkmate-milp", "moccasin", "fastsa",
            "auto"} <= names
    # the reference order alone cannot meet 80% of its own peak
    ckpt = next(r for r in rows if r.split("|")[1].strip() == "checkpoint-all")
    assert "infeasible" in ckpt


def test_training_demo_trains_within_the_budget(tmp_path):
    pytest.importorskip("tensorflow")
    # 0.8 of the measured plain peak: headroom for the CPU's run-to-run spread of peaks
    proc = _run(["--batch", "32", "--epochs", "1", "--budget", "0.8", "--time-limit", "5",
                 "-o", "mem.png", "--quiet"], tmp_path, 600)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-2000:]
    assert "demo passed" in out
    assert "gradients match" in out
    assert (tmp_path / "mem.png").stat().st_size > 1000
