#!/usr/bin/env python
"""Can a plan's held peak be predicted? -> benchmarks/results/allocator.md.

TensorFlow's measured peak counts the BFC allocator's chunks, not the bytes requested (see
:mod:`tf_remat.allocator`). This asks whether that gap is a property of the plan, which a
planner could price, or of the allocation history, which it cannot. For one held-out-style
model (``tools/bench_heldout.py``'s builders), plans are solved at several budgets and, for
each, it prints:

* **simulated**: :func:`tf_remat.plan.simulate`'s peak (fixed memory included);
* **model held**: the plan's own buffers (the op map's per-node buffers, a workspace node as
  one request) allocated and freed in plan order through :class:`tf_remat.allocator.BFCModel`,
  in an empty pool, plus the fixed memory: what a planner could compute without TensorFlow;
* **requested / held / empty-pool**: one profiled run of the rewritten step
  (:func:`tf_remat.api.step_allocations`; the variables and the batch added): what its kernels
  asked for, what the allocator gave them, and what the same requests hold in an empty pool;
* **layouts**: the step's measured peak in each of ``optimize``'s verification layouts (no
  ballast, ballast of 0.6 and 1.0 of the largest value, fragmented), worst of 2 runs each.

If the model's held peak ranked the plans as their measured peaks do, a solver could aim at
it. Usage:
    python tools/bench_allocator.py --model siamese --fractions 0.62,0.66,0.7,0.75,0.8 \\
        -o benchmarks/results/allocator.md
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

MIB = 2**20


def plan_events(graph, op_map, plan):
    """The plan's buffers as ``replay`` events: a compute allocates each buffer its node's
    values take (one request of the node's memory where the op map lists none: a workspace
    node), a free frees them."""
    events, copy = [], {}
    for op, v in plan.steps:
        bufs = [b for _, b in op_map.buffers[v]] if op_map.buffers and op_map.buffers[v] \
            else ([graph.memory[v]] if graph.memory[v] > 0 else [])
        if op == "compute":
            copy[v] = copy.get(v, 0) + 1
            events += [(True, (v, copy[v], i), b) for i, b in enumerate(bufs)]
        else:
            events += [(False, (v, copy[v], i), 0) for i in range(len(bufs))]
    return events


def _spearman(a, b) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)  # ties share their mean rank


def run(name, fractions, time_limit):
    import numpy as np
    import tensorflow as tf

    import bench_heldout
    import keras
    from tf_remat.allocator import replay
    from tf_remat.api import (measure_step_peak, solve_isolated, step_allocations,
                              verification_layouts)
    from tf_remat.extract import extract
    from tf_remat.rewrite import rewrite

    keras.utils.set_random_seed(1)
    model, xs, ys = bench_heldout.MODELS[name]()
    ex = extract(model, input_spec=xs, label_spec=ys)
    g, om = ex.graph, ex.op_map
    xa, ya = bench_heldout._data(xs, ys, model)
    x, y = tf.nest.map_structure(tf.constant, (xa, ya))
    batch = sum(int(np.prod(t.shape)) * t.dtype.size for t in tf.nest.flatten((x, y)))
    big = max(g.memory)
    rows = []
    for seed, frac in enumerate(fractions):
        plan = solve_isolated(g, int(frac * g.no_remat_peak), "auto", time_limit=time_limit,
                              seed=seed)
        if not plan.within_budget:
            print(f"{name} {frac}: no plan", file=sys.stderr, flush=True)
            continue
        model_held = replay(plan_events(g, om, plan))["held_peak_bytes"] + g.fixed_memory
        step = rewrite(ex.traced, g, om, plan)
        a = step_allocations(step, x, y, variables=ex.traced.variables)
        own = a["owned_bytes"] + batch
        m = measure_step_peak(step, x, y, variables=ex.traced.variables, runs=2,
                              ballast=verification_layouts(big))
        row = {"fraction": frac, "simulated": plan.peak_memory, "model_held": model_held,
               "requested": a["requested_peak_bytes"] + own,
               "held": a["held_peak_bytes"] + own,
               "empty_pool": a["fresh_pool_held_peak_bytes"] + own, "layouts": m["layouts"]}
        rows.append(row)
        print(f"{name} {frac}: " + ", ".join(
            f"{k} {v / MIB:.2f}" for k, v in row.items() if k not in ("fraction", "layouts"))
              + " layouts " + " ".join(f"{v / MIB:.2f}" for v in row["layouts"]),
              file=sys.stderr, flush=True)
    return {"model": name, "nodes": g.n, "no_remat": g.no_remat_peak,
            "largest": big, "rows": rows}


def table(res) -> str:
    lines = [f"`{res['model']}`: {res['nodes']} nodes, no-remat peak "
             f"{res['no_remat'] / MIB:.2f} MiB, largest value {res['largest'] / MIB:.2f} MiB.",
             "",
             "| plan for | simulated | model held | requested | held | empty-pool held | "
             "layouts: none / 0.6 / 1.0 / fragmented | worst / requested |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lay = " / ".join(f"{v / MIB:.2f}" for v in r["layouts"])
        lines.append(f"| {100 * r['fraction']:.0f}% of no-remat | {r['simulated'] / MIB:.2f} | "
                     f"{r['model_held'] / MIB:.2f} | {r['requested'] / MIB:.2f} | "
                     f"{r['held'] / MIB:.2f} | {r['empty_pool'] / MIB:.2f} | {lay} | "
                     f"{max(r['layouts']) / r['requested']:.2f} |")
    rows = res["rows"]
    if len(rows) > 2:
        worst = [max(r["layouts"]) for r in rows]
        lines += ["", "Rank correlation (Spearman) with the worst measured layout: "
                  f"model held {_spearman([r['model_held'] for r in rows], worst):+.2f}, "
                  f"empty-pool held {_spearman([r['empty_pool'] for r in rows], worst):+.2f}, "
                  f"simulated {_spearman([r['simulated'] for r in rows], worst):+.2f}. "
                  f"Spread of one plan over the layouts (largest/smallest): "
                  + ", ".join(f"{max(r['layouts']) / min(r['layouts']):.2f}" for r in rows)
                  + "."]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="siamese")
    p.add_argument("--fractions", default="0.62,0.64,0.66,0.7,0.75,0.8",
                   help="solve budgets, fractions of the graph's no-remat peak")
    p.add_argument("--time-limit", type=float, default=15.0)
    p.add_argument("-o", "--output", default=None, help="write the table (markdown) here")
    args = p.parse_args(argv)
    res = run(args.model, [float(f) for f in args.fractions.split(",")], args.time_limit)
    import tensorflow as tf

    text = table(res)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write("# Does the plan decide what the allocator holds?\n\nMachine: "
                    f"{platform.machine()}, {os.cpu_count()} CPUs; Python "
                    f"{platform.python_version()}, TensorFlow {tf.__version__}. Generated by "
                    "`tools/bench_allocator.py`; MiB, fixed memory (variables, batch) "
                    "included.\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
