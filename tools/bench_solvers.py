#!/usr/bin/env python
"""Benchmark the strategies on the published graphs and write benchmarks/results/solvers.md.

Every run is the whole ``tf-remat solve`` command in a fresh process (so the times include
start-up, graph loading and writing the plan), and every plan it writes is simulated again here
before it is reported. Published figures are read from the benchmarks README beside the graphs.

Usage (from the repository root):

    python tools/bench_solvers.py --shared ../shared/benchmarks/graphs \
        [--graphs random_layered_n100 ...] [--budgets 0.9 0.8 0.7] \
        [--strategies moccasin checkmate-milp ...] [--time-limit S] [--repeats K] [-o PATH]

``--strategies`` defaults to every registered strategy (``tf-remat strategies``).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tf_remat.graph import Graph  # noqa: E402
from tf_remat.plan import Plan, simulate  # noqa: E402

DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "solvers.md")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", default=os.path.join(ROOT, "..", "shared", "benchmarks",
                                                     "graphs"),
                    help="folder of the published graphs")
    ap.add_argument("--graphs", nargs="+", help="graph file stems (default: every *_train "
                                                "and random_layered_* graph)")
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.9, 0.8, 0.7])
    ap.add_argument("--strategies", nargs="+", help="default: every registered strategy")
    ap.add_argument("--time-limit", type=float, default=30.0, help="seconds per solve")
    ap.add_argument("--repeats", type=int, default=1, help="runs per cell (medians reported)")
    ap.add_argument("--seeds", action="store_true",
                    help="run k of a cell uses seed k (default: seed 0 in every run)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="strategy option for every solve (tf-remat solve --set)")
    ap.add_argument("-o", "--output", default=DEFAULT_OUT)
    ap.add_argument("--quiet", "-q", action="store_true")
    args = ap.parse_args(argv)

    from tf_remat.solvers import available_strategies

    strategies = args.strategies or list(available_strategies())
    paths = _graph_paths(args.shared, args.graphs)
    if not paths:
        print(f"no graphs found in {args.shared}", file=sys.stderr)
        return 2
    published = _published(os.path.join(os.path.dirname(os.path.abspath(args.shared)),
                                         "README.md"))
    rows = []
    started = time.perf_counter()
    for path in paths:
        g = Graph.load(path)
        stem = os.path.splitext(os.path.basename(path))[0]
        for frac in args.budgets:
            budget = int(frac * g.no_remat_peak)
            for strat in strategies:
                runs = [_run(path, g, budget, strat, args.time_limit,
                             seed=k if args.seeds else 0, options=args.set)
                        for k in range(max(1, args.repeats))]
                row = _summarize(stem, g, frac, budget, strat, runs)
                row["published"] = published.get((stem, round(frac * 100)), "")
                rows.append(row)
                if not args.quiet:
                    print(_line(row), flush=True)
    text = _markdown(rows, args, time.perf_counter() - started)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        f.write(text)
    print(f"wrote {args.output}")
    return 0


# --------------------------------------------------------------------- running
def _graph_paths(shared, names):
    if names:
        return [os.path.join(shared, n if n.endswith(".json") else n + ".json") for n in names]
    found = sorted(glob.glob(os.path.join(shared, "*_train.json")))
    found += sorted(glob.glob(os.path.join(shared, "random_layered_*.json")),
                    key=lambda p: int(re.search(r"n(\d+)", p).group(1)))
    return found


def _run(path, g, budget, strategy, time_limit, seed=0, options=()):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plan.json")
        cmd = [sys.executable, "-m", "tf_remat", "solve", path, "--budget", str(budget),
               "--strategy", strategy, "--time-limit", str(time_limit), "--quiet", "-o", out,
               "--seed", str(seed)]
        for kv in options:
            cmd += ["--set", kv]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                                  timeout=2 * time_limit + 60)
            rc, err = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired:
            rc, err = -9, "killed: ran past twice the time limit"
        wall = time.perf_counter() - start
        res = {"wall": wall, "rc": rc, "error": None}
        if not os.path.exists(out):
            res["error"] = (err.strip().splitlines() or ["no plan"])[-1][:120]
            return res
        plan = Plan.load(out)
    sim = simulate(g, plan.steps)  # the simulator here, not the plan's own numbers
    res.update(status=plan.status, peak=sim.peak_memory, cost=sim.cost,
               overhead=sim.cost / g.total_cost - 1 if g.total_cost else 0.0,
               within=sim.peak_memory <= budget, lower_bound=plan.lower_bound,
               time_to_best=plan.info.get("time_to_best"), solve_seconds=plan.solve_seconds,
               rate=plan.info.get("mutations_per_second"))
    return res


def _summarize(stem, g, frac, budget, strat, runs):
    ok = [r for r in runs if r.get("cost") is not None]
    row = {"graph": stem, "nodes": g.n, "fraction": frac, "budget": budget, "strategy": strat,
           "runs": len(runs), "wall": statistics.median(r["wall"] for r in runs)}
    if not ok:
        row.update(status="none", error=runs[0].get("error"))
        return row
    within = [r for r in ok if r["within"]]
    pick = within or ok
    med = lambda key: statistics.median(r[key] for r in pick)  # noqa: E731
    best = min(pick, key=lambda r: r["cost"])
    row.update(status=best["status"] if len(runs) == 1 else
               "/".join(sorted({r["status"] for r in ok})),
               overhead=med("overhead"), best_overhead=best["overhead"],
               peak=int(med("peak")), within=len(within), cost=med("cost"),
               time_to_best=(statistics.median(r["time_to_best"] for r in pick
                                               if r["time_to_best"] is not None)
                             if any(r["time_to_best"] is not None for r in pick) else None))
    rates = [r["rate"] for r in pick if r.get("rate")]
    if rates:
        row["rate"] = statistics.median(rates)
    lbs = [r["lower_bound"] for r in pick if r["lower_bound"] is not None]
    if lbs:
        lb = max(lbs)
        row["lower_bound"] = lb
        row["gap"] = (row["cost"] - lb) / row["cost"] if row["cost"] else 0.0
    return row


# --------------------------------------------------------------------- published figures
_LABELS = [(r"RL n(\d+)", lambda m: f"random_layered_n{m.group(1)}"),
           (r"FCN8", lambda m: "fcn_8_vgg_b32_416x608_train"),
           (r"ResNet50", lambda m: "resnet50_b256_224x224_train")]


def _published(readme):
    """{(graph stem, budget %): 'MILP x / MOCCASIN y / FastSA z'} from the benchmarks README."""
    out = {}
    try:
        with open(readme) as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not cells[1].endswith("%"):
            continue
        stem = None
        for pat, name in _LABELS:
            m = re.search(pat, cells[0])
            if m:
                stem = name(m)
                break
        if stem is None:
            continue
        try:
            pct = int(cells[1].rstrip("%"))
        except ValueError:
            continue
        out[(stem, pct)] = f"MILP {cells[2]}; MOCCASIN {cells[3]}; FastSA {cells[4]}"
    return out


# --------------------------------------------------------------------- report
def _fmt_pct(x, digits=3):
    return "" if x is None else f"{100 * x:.{digits}f}"


def _fmt_s(x):
    return "" if x is None else f"{x:.2f}"


def _line(row):
    if row["status"] == "none":
        return (f"{row['graph']} {row['fraction']:.0%} {row['strategy']}: no plan "
                f"({row.get('error')}) {row['wall']:.1f}s")
    return (f"{row['graph']} {row['fraction']:.0%} {row['strategy']}: {row['status']} "
            f"{_fmt_pct(row['overhead'])}% peak {row['peak'] / row['budget']:.4f}B "
            f"gap {_fmt_pct(row.get('gap'), 2)}% best@{_fmt_s(row['time_to_best'])}s "
            f"total {row['wall']:.1f}s"
            + (f" {row['rate'] / 1e6:.2f}M mutations/s" if row.get("rate") else ""))


def _markdown(rows, args, elapsed):
    cmd = ["python tools/bench_solvers.py --shared", os.path.relpath(args.shared, ROOT)]
    if args.graphs:
        cmd += ["--graphs", *args.graphs]
    cmd += ["--budgets", *[str(b) for b in args.budgets]]
    if args.strategies:
        cmd += ["--strategies", *args.strategies]
    cmd += ["--time-limit", f"{args.time_limit:g}", "--repeats", str(args.repeats)]
    if args.seeds:
        cmd.append("--seeds")
    for kv in args.set:
        cmd += ["--set", kv]
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    out = [
        "# Solver benchmark on the published graphs",
        "",
        f"Reproduce: `{' '.join(cmd)}` ({elapsed / 60:.0f} min on this machine, {ncpu} cores).",
        "",
        "Each cell is the whole `tf-remat solve --time-limit "
        f"{args.time_limit:g}` command in a fresh process; every plan is simulated again. "
        "Overhead = cost / (sum of node costs) - 1, in %; peak as a fraction of the budget; "
        "*best at*: seconds into the solve when the returned plan was found; *total*: wall "
        "clock of the command; *gap*: (cost - lower bound) / cost for strategies that report "
        "a bound. Budgets are fractions of the no-rematerialization peak of the reference "
        "order. Published: Checkmate MILP (Gurobi) and MOCCASIN on a 16-core workstation, "
        "FastSA (C++, one core), overhead % / seconds, from the benchmarks README (FastSA "
        "also changes the order). The machine's cores were shared with other jobs while "
        "these ran, so times are upper bounds. FastSA rows: the number after the status is "
        "the annealing kernel's rate (mutations applied and evaluated per second, one core).",
        "",
    ]
    graphs = list(dict.fromkeys(r["graph"] for r in rows))
    for gname in graphs:
        grows = [r for r in rows if r["graph"] == gname]
        out += [f"## {gname} ({grows[0]['nodes']} nodes)", "",
                "| budget | strategy | status | overhead % | peak / budget | best at s | "
                "total s | gap % | published |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in grows:
            pub = r["published"] if r["strategy"] == grows[0]["strategy"] else ""
            if r["status"] == "none":
                out.append(f"| {r['fraction']:.0%} | {r['strategy']} | no plan "
                           f"({r.get('error') or ''}) | | | | {r['wall']:.1f} | | {pub} |")
                continue
            flag = "" if r["within"] else " (over budget)"
            if r["runs"] > 1:   # overhead and peak are the medians of the runs within it
                flag += f", {r['within']}/{r['runs']} within"
            if r.get("rate"):
                flag += f", {r['rate'] / 1e6:.2f}M/s"
            out.append(
                f"| {r['fraction']:.0%} | {r['strategy']} | {r['status']}{flag} | "
                f"{_fmt_pct(r['overhead'])} | {r['peak'] / r['budget']:.4f} | "
                f"{_fmt_s(r['time_to_best'])} | {r['wall']:.1f} | "
                f"{_fmt_pct(r.get('gap'), 2)} | {pub} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
