#!/usr/bin/env python
"""How the plan's order is imposed: node chain vs concurrent runs -> benchmarks/results/chain.md.

The rewritten step must run the plan's order, or TensorFlow runs recomputed copies as soon as
their inputs exist and nothing is saved. ``chain="node"`` orders every node after the one before
it: a total order, so independent ops that the plain step runs side by side (two at a time on
two cores) run one after another. ``chain="run"`` cuts the plan into runs of adjacent computes
that may run in any order or at once without the memory passing the plan's simulated peak
(:func:`tf_remat.plan.concurrent_groups`) and orders only the runs.

Per model, in a fresh process: the graph is extracted (profiled costs); for each fraction of the
graph's simulated no-remat peak a plan is solved (1.0: no recomputation); the plan is rewritten
with each chain, and the table gives the simulated peak, what the kernels request (TensorFlow's
profiler), the measured peak (median of 3), the step time over the plain step's (median of
``--runs`` rounds, the three steps in a shuffled order each round) and the update error.

Usage:
    python tools/bench_chain.py                                  # the four default models
    python tools/bench_chain.py --models transformer --fractions 1.0,0.7 --runs 15
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

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(ROOT))
sys.path.insert(0, ROOT)

DEFAULT_CASES = [("transformer", 8), ("bn_cnn", 64), ("mobilenet", 8), ("resnet50", 8)]
FRACTIONS = (1.0, 0.7, 0.5)
CHAINS = ("node", "run")
MIB = 2**20


def run_case(name, batch, fractions, time_limit, runs):
    import numpy as np

    from bench_rewrite import _batch, _interleaved_times, _Snapshot
    from tf_remat.api import measure_step_peak, step_allocations
    from tf_remat.extract import extract, trace_training_step
    from tf_remat.plan import concurrent_groups, make_plan
    from tf_remat.rewrite import rewrite
    from tf_remat.solvers import solve
    from tf_remat.solvers.baselines import checkpoint_all
    from tf_remat.zoo import get_model

    model, xs, ys = get_model(name, batch, None)
    ex = extract(model, input_spec=xs, label_spec=ys, verbose=0)
    g = ex.graph
    plain = trace_training_step(model, xs, ys)
    x, y = _batch(xs, ys, model)
    variables = list({id(v): v for v in list(plain.variables) +
                      list(ex.traced.variables)}.values())
    state = _Snapshot(variables)
    ref = _update(plain.function, x, y, state)
    base = statistics.median(
        measure_step_peak(plain.function, x, y, variables=variables)["step_peak_bytes"]
        for _ in range(3))
    out = {"model": name, "batch": batch, "nodes": g.n, "plain_peak": base,
           "no_remat_peak": g.no_remat_peak, "rows": []}
    for frac in fractions:
        budget = int(frac * g.no_remat_peak)
        if frac >= 1.0:
            plan = make_plan(g, checkpoint_all(g, budget), budget, strategy="checkpoint-all")
        else:
            plan = solve(g, budget, "auto", time_limit=time_limit)
        row = {"fraction": frac, "simulated": plan.peak_memory, "status": plan.status,
               "predicted_overhead": plan.overhead}
        if not plan.within_budget:
            out["rows"].append(row)
            continue
        row["runs"] = max(concurrent_groups(g, plan.steps, transient=ex.op_map.transient)) + 1
        row["computes"] = len(plan.sequence)
        fns = {"plain": plain.function}
        for chain in CHAINS:
            step = rewrite(ex.traced, g, ex.op_map, plan, chain=chain)
            fns[chain] = step
            state.restore()
            req = step_allocations(step, x, y, variables=variables)["requested_peak_bytes"]
            state.restore()
            peaks = [measure_step_peak(step, x, y, variables=variables)["step_peak_bytes"]
                     for _ in range(3)]
            state.restore()
            row[chain] = {"requested": req + g.fixed_memory, "measured": statistics.median(peaks),
                          "edges": step.info["chain_edges"]}
            new = _update(step, x, y, state)
            scale = max(float(np.abs(a).max()) for a in ref)
            row[chain]["update_err"] = max(float(np.abs(a - b).max())
                                           for a, b in zip(ref, new)) / scale
        times = _interleaved_times(fns, x, y, state, runs)
        for chain in CHAINS:
            row[chain]["overhead"] = times[chain] / times["plain"] - 1
        row["t_plain"] = times["plain"]
        out["rows"].append(row)
        print(f"[{name}] {json.dumps(row)}", file=sys.stderr, flush=True)
    return out


def _update(fn, x, y, state):
    """What one step changes in every variable (the state restored after)."""
    import numpy as np

    fn(x, y)
    delta = [np.asarray(v.numpy(), dtype=np.float64) - np.asarray(b, dtype=np.float64)
             for v, b in zip(state.variables, state.values)
             if np.issubdtype(np.asarray(b).dtype, np.floating)]
    state.restore()
    return delta


def table(results) -> str:
    lines = ["| model | batch | plan | simulated MiB | runs / computes | requested MiB node / run "
             "| measured MiB node / run | overhead pred | overhead node | overhead run | "
             "update err node / run |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        if "error" in res:
            lines.append(f"| {res['model']} | {res['batch']} | error: {res['error']} |" + " |" * 8)
            continue
        for r in res["rows"]:
            head = f"| {res['model']} | {res['batch']} | {100 * r['fraction']:.0f}% |"
            if "runs" not in r:
                lines.append(f"{head} {r['status']} |" + " |" * 7)
                continue
            n, u = r["node"], r["run"]

            def err(c):
                return f"{c['update_err']:.1e}"

            lines.append(
                f"{head} {r['simulated'] / MIB:.1f} | {r['runs']} / {r['computes']} | "
                f"{n['requested'] / MIB:.1f} / {u['requested'] / MIB:.1f} | "
                f"{n['measured'] / MIB:.1f} / {u['measured'] / MIB:.1f} | "
                f"{100 * r['predicted_overhead']:.1f}% | {100 * n['overhead']:+.1f}% | "
                f"{100 * u['overhead']:+.1f}% | {err(n)} / {err(u)} |")
    return "\n".join(lines)


NOTES = """\
## How to read this

* **plan**: the budget as a fraction of the graph's simulated no-remat peak; 100% is the plain
  step's graph in topological order with nothing recomputed (what any static order costs by
  itself), lower ones a `strategy="auto"` plan.
* **runs / computes**: how many runs `chain="run"` cuts the plan's computes into (`"node"`
  orders every compute: as many runs as computes).
* **requested**: the peak of the bytes the step's kernels requested (TensorFlow's profiler,
  `tf_remat.api.step_allocations`) plus the graph's fixed memory; a run never lets it pass the
  simulated peak by construction (the memory before the run plus every member's output).
  **measured**: the allocator's peak (median of 3), whole chunks and fragmentation included.
* **overhead**: median step time over the plain (Keras) step's - 1, the three steps interleaved
  in shuffled rounds; **pred**: what the plan's profiled costs predict for the recomputation.
* **update err**: from the same state and batch, max |change of a variable by the rewritten
  step - its change by the plain step| over all float variables (weights, optimizer slots,
  BatchNorm statistics) / the largest change: float32 reassociation is ~1e-7 .. 1e-5.
"""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=None)
    p.add_argument("--fractions", default=",".join(map(str, FRACTIONS)))
    p.add_argument("--time-limit", type=float, default=20.0)
    p.add_argument("--runs", type=int, default=11)
    p.add_argument("-o", "--output", default=os.path.join(os.path.dirname(ROOT), "benchmarks",
                                                          "results", "chain.md"))
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    fractions = [float(f) for f in args.fractions.split(",")]
    if args.case:
        name, batch = json.loads(args.case)
        print("RESULT " + json.dumps(run_case(name, batch, fractions, args.time_limit,
                                              args.runs)), flush=True)
        return 0
    known = dict(DEFAULT_CASES)
    cases = [(m, known.get(m, 4)) for m in (args.models or known)]
    results = []
    for name, batch in cases:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--case",
                               json.dumps([name, batch]), "--fractions", args.fractions,
                               "--time-limit", str(args.time_limit), "--runs", str(args.runs)],
                              stdout=subprocess.PIPE, text=True)
        res = next((json.loads(line[7:]) for line in proc.stdout.splitlines()
                    if line.startswith("RESULT ")),
                   {"model": name, "batch": batch, "error": f"exit code {proc.returncode}"})
        results.append(res)
        print(f"{name}: done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    import tensorflow as tf

    from tf_remat.extract import onednn_enabled

    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
               f"oneDNN {'on' if onednn_enabled() else 'off'}; "
               f"Python {platform.python_version()}, TensorFlow {tf.__version__}")
    doc = ["# Chain benchmark: node chain vs concurrent runs", "",
           f"Machine: {machine}. `--runs {args.runs}`, solver time limit {args.time_limit:g} s, "
           "profiled costs. Generated by `tools/bench_chain.py`.", "",
           table(results), "", NOTES]
    text = "\n".join(doc)
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
