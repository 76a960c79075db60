#!/usr/bin/env python
"""The path ``optimize`` takes to a budget, and whether a higher budget is an easier one.

For one model and batch size, :func:`tf_remat.optimize` runs at each factor of a budget, each
run in a fresh Python process (as a user's training process starts, with its own allocator
history), and the table gives every attempt: the budget solved for, the plan's simulated peak
and its measured peak. What it shows: the measured peak of a plan is its simulated peak plus an
allocator excess that differs from plan to plan and process to process, and the re-solves step
down by the last plan's excess, so a budget 5% higher can take another path and fail where the
lower one succeeds (issue 5's "optimize is not monotone in the budget").

    python tools/bench_budget_path.py (--model NAME | --module file.py:build) --batch B
        (--budget-gb G | --budget-bytes N) [--factors 1.0 1.05] [--runs 5]
        [--strategy moccasin] [--time-limit 10] [-o benchmarks/results/budget_path.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CHILD = r"""
import json, sys
import tf_remat
import tf_remat.api as api
from tf_remat.errors import InfeasibleBudgetError
from tf_remat.training import load_builder
a = json.loads(sys.argv[1])
# every solve and measurement optimize makes, so a refused run shows its path too
attempts = []
real_solve, real_measure = api.solve_isolated, api.measure_step_peak
def solve(graph, budget, *args, **kwargs):
    plan = real_solve(graph, budget, *args, **kwargs)
    attempts.append({"solve_budget": int(budget), "measured": None,
                     "predicted": plan.peak_memory if plan.within_budget else None})
    return plan
def measure(*args, **kwargs):
    m = real_measure(*args, **kwargs)
    attempts[-1]["measured"] = m["step_peak_bytes"]
    return m
api.solve_isolated, api.measure_step_peak = solve, measure
build = load_builder(a["model"], a["module"], input_size=a["input_size"])
model, ispec, lspec = build(a["batch"])
out = {"budget": a["budget"]}
try:
    step = tf_remat.optimize(model, budget_bytes=a["budget"], input_spec=ispec,
                             label_spec=lspec, strategy=a["strategy"],
                             time_limit=a["time_limit"], verbose=0, cost_model="flops",
                             attach=False, time_order=False)
    rep = step.report
    out.update(result="margin met" if rep["margin_met"] else "at the edge",
               measured=rep["measured_peak_bytes"], attempts=attempts)
except InfeasibleBudgetError as exc:
    out.update(result="refused", measured=exc.min_feasible, attempts=attempts,
               message=str(exc)[:300])
print(json.dumps(out))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a zoo model name")
    src.add_argument("--module", help="file.py:build, build(batch) -> (model, ispec, lspec)")
    ap.add_argument("--input-size", default=None, help="the zoo model's input size")
    ap.add_argument("--batch", type=int, required=True)
    bud = ap.add_mutually_exclusive_group(required=True)
    bud.add_argument("--budget-gb", type=float)
    bud.add_argument("--budget-bytes", type=int)
    ap.add_argument("--factors", type=float, nargs="+", default=[1.0, 1.05])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--strategy", default="moccasin")
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("-o", "--output", default=os.path.join(ROOT, "benchmarks", "results",
                                                           "budget_path.md"))
    args = ap.parse_args(argv)
    budget = args.budget_bytes or int(args.budget_gb * 2**30)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    rows = []
    for f in args.factors:
        for r in range(args.runs):
            job = {"model": args.model, "module": args.module, "input_size": args.input_size,
                   "batch": args.batch, "budget": int(f * budget), "strategy": args.strategy,
                   "time_limit": args.time_limit}
            t = time.perf_counter()
            proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(job)], env=env,
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stderr[-2000:], file=sys.stderr)
                return 1
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            row.update(factor=f, run=r + 1, seconds=time.perf_counter() - t)
            rows.append(row)
            print(_line(row), flush=True)
    text = _markdown(rows, args, budget, env)
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as fh:
        fh.write(text)
    return 0


def _mib(b):
    return "-" if b is None else f"{b / 2**20:.2f}"


def _path(attempts):
    if not attempts:
        return "-"
    return " -> ".join(f"{_mib(a['solve_budget'])}: " + (
        f"{_mib(a['predicted'])}/{_mib(a['measured'])}" if a["predicted"] is not None
        else "no plan") for a in attempts)


def _line(r):
    return (f"x{r['factor']:g} run {r['run']}: {r['result']}, measured {_mib(r['measured'])} "
            f"MiB of {_mib(r['budget'])}; {_path(r['attempts'])} ({r['seconds']:.0f} s)")


def _markdown(rows, args, budget, env):
    what = args.model or args.module
    out = [f"# The path optimize takes to a budget: {what}, batch {args.batch}", "",
           f"`python tools/bench_budget_path.py "
           f"{'--model ' + args.model if args.model else '--module ' + args.module} "
           f"--batch {args.batch} --budget-bytes {budget} --factors "
           f"{' '.join(f'{f:g}' for f in args.factors)} --runs {args.runs} --strategy "
           f"{args.strategy} --time-limit {args.time_limit:g}`, "
           f"{time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
           f"{os.cpu_count()} cores"
           + (f", TF_REMAT_CONV_GRADIENTS={env['TF_REMAT_CONV_GRADIENTS']}"
              if env.get("TF_REMAT_CONV_GRADIENTS") else "") + ".", "",
           "Each run is a fresh process calling `optimize` (cost model `flops`, no static-order "
           "timing). A path lists each attempt as `solve budget: simulated/measured` in MiB; "
           "`no plan`: the solver found none within that budget in its time.", "",
           "| budget | runs | margin met | at the edge | refused | median measured / budget |",
           "|---|---|---|---|---|---|"]
    for f in args.factors:
        rs = [r for r in rows if r["factor"] == f]
        meas = [r["measured"] / r["budget"] for r in rs if r["measured"] is not None]
        median = f"{statistics.median(meas):.3f}" if meas else "-"
        counts = " | ".join(str(sum(r["result"] == k for r in rs))
                            for k in ("margin met", "at the edge", "refused"))
        out.append(f"| x{f:g} ({_mib(int(f * budget))} MiB) | {len(rs)} | {counts} | "
                   f"{median} |")
    out += ["", "| budget | run | result | measured MiB | path | seconds |",
            "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| x{r['factor']:g} | {r['run']} | {r['result']} | {_mib(r['measured'])} "
                   f"| {_path(r['attempts'])} | {r['seconds']:.0f} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
