#!/usr/bin/env python
"""Where a step's held peak over its requests comes from -> benchmarks/results/allocator.md.

TensorFlow's BFC allocator hands a request a whole free chunk when the chunk is less than twice
the request (:mod:`tf_remat.allocator`). Such a chunk is either one a freed tensor left, or a
whole *region*: the CPU allocator grows its pool by regions of 2, 4, 8, 16 MiB and so on, which
never merge, so a 4.25 MiB activation placed in an empty 8 MiB region holds 8. For one plan this
replays the step's recorded allocations (:func:`tf_remat.allocator.replay`) in pools whose first
region is 2 MiB (TensorFlow's CPU allocator) up to one region larger than the step (as a GPU
allocator without ``allow_growth`` reserves its memory): what stays over the requests in one
large region is the reuse of freed chunks, the rest is the regions.

Each ``--reserve-mib`` value (:func:`tf_remat.reserve_memory` at the process's start, 0 for
none) and each ``--patch-slice-mib`` value runs in a fresh process, with the patch products'
slice size (``tf_remat.extract._PATCH_GRAD_BYTES``, used where convolution gradients are
products: a CPU without oneDNN) set to it, since freed patch slices are chunks later
activations land in.

    python tools/bench_regions.py --module file.py:build --batch 34 --budget-mib 28.35
        [--patch-slice-mib 8 3.5 10.2] [--reserve-mib 0 128] [--regions 2 8 16 64 1024]
        [--strategy moccasin] [--repeats 1] [--time-limit 10] [-o benchmarks/results/allocator.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MIB = 2**20


def one(a: dict) -> dict:
    """The child's work: extract, solve, rewrite, profile one call, replay, measure."""
    import tensorflow as tf

    import tf_remat
    import tf_remat.extract as extract_mod
    from tf_remat.allocator import BFCModel, replay
    from tf_remat.api import (_block, measure_step_peak, solve_isolated, verification_layouts)
    from tf_remat.profile import synthetic_batch
    from tf_remat.rewrite import rewrite
    from tf_remat.training import load_builder

    if a["reserve_mib"]:
        # before anything else is allocated, as a user's program would call it
        tf_remat.reserve_memory(budget_bytes=int(a["reserve_mib"] * MIB))
    if a["patch_slice_mib"] is not None:
        extract_mod._PATCH_GRAD_BYTES = int(a["patch_slice_mib"] * MIB)
    build = load_builder(a["model"], a["module"], input_size=a["input_size"])
    model, ispec, lspec = build(a["batch"])
    ex = extract_mod.extract(model, input_spec=ispec, label_spec=lspec, cost_model="flops",
                             verbose=0)
    graph = ex.graph
    plan = solve_isolated(graph, int(a["budget_mib"] * MIB), a["strategy"],
                          time_limit=a["time_limit"])
    if not plan.within_budget:
        return {"nodes": graph.n, "no_remat": graph.no_remat_peak, "error": "no plan"}
    step = rewrite(ex.traced, graph, ex.op_map, plan)
    x, y = synthetic_batch(ispec, lspec)
    fixed = sum(t.numpy().nbytes for t in tf.nest.flatten((x, y)))
    fixed += sum(v.numpy().nbytes for v in ex.traced.variables)
    saved = [v.numpy() for v in ex.traced.variables]
    _block(step(x, y))  # the first call allocates the function's own state
    events = extract_mod.profiled_memory_events(lambda: _block(step(x, y)))
    for v, s in zip(ex.traced.variables, saved):
        v.assign(s)
    recorded = [(alloc, st.get("addr"), st.get("requested_bytes", 0)) for _, alloc, st in events]
    replays = {}
    for mib in a["regions"]:
        r = replay(recorded, model=BFCModel(initial_region=int(mib * MIB)))
        replays[str(mib)] = r["held_peak_bytes"] + fixed
    requested = replay(recorded)["requested_peak_bytes"] + fixed
    measured = measure_step_peak(step, x, y, variables=ex.traced.variables, runs=2,
                                 ballast=verification_layouts(max(graph.memory)))
    return {"nodes": graph.n, "no_remat": graph.no_remat_peak, "simulated": plan.peak_memory,
            "requested": requested, "replays": replays, "measured": measured["step_peak_bytes"],
            "largest": max(graph.memory)}


def table(args, rows) -> str:
    head = ["reserved MiB", "patch slice MiB", "nodes", "no-remat", "simulated", "requested"] + \
        [f"held, first region {m:g} MiB" for m in args.regions] + ["measured (worst layout)"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (reserve_mib, slice_mib), r in rows:
        name = "default" if slice_mib is None else f"{slice_mib:g}"
        if "error" in r:
            out.append(f"| {reserve_mib:g} | {name} | {r['nodes']} | {r['no_remat'] / MIB:.2f} | "
                       f"{r['error']} |")
            continue
        cells = [f"{reserve_mib:g}", name, str(r["nodes"])] + [f"{r[k] / MIB:.2f}" for k in
                                           ("no_remat", "simulated", "requested")]
        cells += [f"{r['replays'][str(m)] / MIB:.2f}" for m in args.regions]
        cells.append(f"{r['measured'] / MIB:.2f}")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--child"]:
        print(json.dumps(one(json.loads(argv[1]))))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a zoo model name")
    src.add_argument("--module", help="file.py:build, build(batch) -> (model, ispec, lspec)")
    p.add_argument("--input-size", type=int, default=None)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--budget-mib", type=float, required=True, help="the solve's budget")
    p.add_argument("--patch-slice-mib", type=float, nargs="+", default=[None])
    p.add_argument("--reserve-mib", type=float, nargs="+", default=[0],
                   help="tf_remat.reserve_memory at the child's start (0: none)")
    p.add_argument("--regions", type=float, nargs="+", default=[2, 8, 16, 64, 1024],
                   help="first region sizes (MiB) to replay the step's allocations in")
    p.add_argument("--repeats", type=int, default=1,
                   help="fresh processes per slice size (each solves again: plans differ)")
    p.add_argument("--strategy", default="moccasin")
    p.add_argument("--time-limit", type=float, default=10.0)
    p.add_argument("-o", "--output", help="append the table (markdown) to this file")
    args = p.parse_args(argv)
    rows = []
    for reserve_mib, slice_mib in [(r, m) for r in args.reserve_mib
                                   for m in args.patch_slice_mib for _ in range(args.repeats)]:
        a = {"reserve_mib": reserve_mib, "model": args.model, "module": args.module,
             "input_size": args.input_size, "batch": args.batch,
             "budget_mib": args.budget_mib, "strategy": args.strategy,
             "time_limit": args.time_limit, "regions": args.regions,
             "patch_slice_mib": slice_mib}
        # a fresh process each: the slice size is read while tracing, and the measured peak
        # depends on the process's allocation history
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                               json.dumps(a)], capture_output=True, text=True)
        if proc.returncode:
            lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
            raise SystemExit(f"child failed: {lines[-1] if lines else proc.returncode}")
        rows.append(((reserve_mib, slice_mib), json.loads(proc.stdout.strip().splitlines()[-1])))
        print(table(args, rows[-1:]).splitlines()[-1], flush=True)
    src = args.module or args.model
    cmd = "python tools/bench_regions.py " + " ".join(argv)
    text = (f"`{cmd}` ({src}, batch {args.batch}, {args.strategy} {args.time_limit:g} s, "
            f"{platform.machine()}, {os.cpu_count()} cores). MiB, the variables and the batch "
            f"included; *held* columns replay one profiled call's allocations after a call "
            f"before it.\n\n{table(args, rows)}\n")
    print("\n" + text)
    if args.output:
        with open(args.output, "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
