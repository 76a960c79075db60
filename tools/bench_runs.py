#!/usr/bin/env python
"""Do back-to-back runs of one step, in one allocator layout, measure the same peak?
-> benchmarks/results/runs.md.

``optimize`` verifies a plan, and ``max-batch`` a plain size, by the worst of a few runs in each
of four allocator layouts (:func:`tf_remat.api.verification_layouts`). This measures how much of
the spread those samples see comes from the layout and how much from the run: for each model
(``tf_remat.training.load_builder``'s names) the plain Keras step, as ``max-batch`` probes it, is
run ``--runs`` times after a warm-up in each layout, for ``--rounds`` rounds, each run's peak
read as :func:`tf_remat.api.measure_step_peak` reads it (the allocator's peak less what was
allocated before the run; the variables and batch are not added). Usage:

    python tools/bench_runs.py --models transformer:64:8 vgg16:64:12 bn_cnn:32:16 \\
        -o benchmarks/results/runs.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MIB = 2**20
LAYOUTS = ("none", "0.6", "1.0", "fragmented")


def measure(name: str, size: str, batch: int, rounds: int, runs: int,
            budget: float | None = None) -> dict:
    """``{"plain": [[peaks of layout 0 ...], ...] per round, "remat": ...}`` in bytes; "remat"
    (with ``budget``, a fraction of the plain step's measured peak) is the step
    ``optimize`` builds for that budget, run the same way."""
    import keras

    from tf_remat.batch import _largest_value, _plain_step
    from tf_remat.profile import synthetic_batch
    from tf_remat.training import load_builder

    keras.backend.clear_session()
    model, ispec, lspec = load_builder(name, input_size=size)(batch)
    opt = model.optimizer
    opt.build(model.trainable_variables)
    step = _plain_step(model, opt)
    x, y = synthetic_batch(ispec, () if lspec is None else lspec)
    largest = _largest_value(step, x, y)
    variables = [getattr(v, "value", v) for v in list(model.variables) + list(opt.variables)]
    out = {"plain": _sample(step, x, y, variables, largest, rounds, runs)}
    if budget:
        from tf_remat.api import measure_step_peak, optimize
        from tf_remat.errors import RematError

        # the budget counts the variables and the batch too, as optimize's does
        top = measure_step_peak(step, x, y, variables=variables)["step_peak_bytes"]
        try:
            opt_step = optimize(model, budget_bytes=int(budget * top), input_spec=ispec,
                                label_spec=lspec, attach=False, verbose=0, time_order=False)
        except RematError as exc:  # a budget under the model's floor: the plain rows stand
            print(f"{name}: no rewritten step: {str(exc)[:300]}", flush=True)
            return out
        b = opt_step._primary()
        graph = b.extraction.graph
        out["remat"] = _sample(b.step, x, y, b.extraction.traced.variables,
                               max(graph.memory) if graph.n else 0, rounds, runs)
    return out


def _sample(step, x, y, variables, largest, rounds, runs) -> list:
    from tf_remat.api import measure_step_peak, verification_layouts

    out = []
    for _ in range(rounds):
        r = measure_step_peak(step, x, y, variables=variables, runs=runs,
                              ballast=verification_layouts(largest))
        # the table shows what the step allocated: the variables and batch it holds are not added
        out.append([[v - r["owned_bytes"] for v in layout] for layout in r["runs"]])
    return out


def table(rows) -> str:
    head = ("| model | batch | step | round | " + " | ".join(f"layout {n} (MiB, run by run)"
                                                          for n in LAYOUTS)
            + " | spread within a layout | spread of the layouts' first runs |")
    lines = [head, "|" + "---|" * (4 + len(LAYOUTS) + 2)]
    for name, batch, data in rows:
        for kind, rounds in data.items():
            for r, per in enumerate(rounds):
                within = max(max(p) - min(p) for p in per) / MIB
                firsts = [p[0] for p in per]
                cells = " | ".join(" ".join(f"{v / MIB:.1f}" for v in p) for p in per)
                lines.append(f"| {name} | {batch} | {kind} | {r + 1} | {cells} | {within:.1f} | "
                             f"{(max(firsts) - min(firsts)) / MIB:.1f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["transformer:64:8", "vgg16:64:12",
                                                    "bn_cnn:32:16"],
                   help="name:input_size:batch")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--runs", type=int, default=4, help="measured runs per layout")
    p.add_argument("--budget", type=float, default=None,
                   help="also the step optimize builds for this fraction of the plain peak")
    p.add_argument("-o", "--output", default=None, help="write the table (markdown) here")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    rows = []
    for spec in args.models:
        name, size, batch = spec.split(":")
        rows.append((name, int(batch), measure(name, size, int(batch), args.rounds, args.runs,
                                               args.budget)))
        print(table(rows[-1:]), flush=True)
    within = {k: [max(p) - min(p) for _, _, d in rows for per in d.get(k, ()) for p in per]
              for k in ("plain", "remat")}
    text = (f"# Back-to-back runs of one step in one allocator layout\n\n"
            f"`python tools/bench_runs.py --models {' '.join(args.models)} --rounds "
            f"{args.rounds} --runs {args.runs}"
            + ("" if args.budget is None else f" --budget {args.budget:g}")
            + f"` on {platform.machine()}, {os.cpu_count()} "
            f"cores, {time.perf_counter() - t0:.0f} s. Each cell: the step's peak in each of "
            f"{args.runs} runs after a warm-up, with the layout's ballast held (`optimize`'s "
            f"verification layouts); peaks less what was allocated before each run. plain: "
            f"Keras's step as max-batch probes it; remat: the step `optimize` built for the "
            f"budget.\n\n{table(rows)}\n\nMedian spread of the runs within one layout: "
            + ", ".join(f"{k} {statistics.median(v) / MIB:.2f} MiB" for k, v in within.items()
                        if v) + ".\n")
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
