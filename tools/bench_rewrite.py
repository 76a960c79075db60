#!/usr/bin/env python
"""Benchmark the rewritten step on the model zoo -> benchmarks/results/rewrite.md.

Per model, in a fresh process (so the allocator holds nothing else): the plain training step is
traced and measured (TensorFlow's peak: ``reset_memory_stats`` + ``get_memory_info``, the
step's own bytes: peak - allocated before + the variables and the batch; median step time).
Then, for budgets of 90%, 70% and 50% of that measured peak, ``tf_remat.optimize`` (profiled
costs, verification on) builds the rewritten step, and the table gives:

* the simulated peak of the plan vs the measured peak of the rewritten step vs the budget;
* the predicted overhead (plan cost / sum of node costs - 1) vs the measured one (median step
  time of the rewritten step / median of the plain step - 1, runs interleaved);
* the gradient error: ``step.gradients`` against the plain step's gradients on the same batch
  and state, max |difference| over all gradients relative to the largest gradient value; and
  the loss difference.

Usage:
    python tools/bench_rewrite.py                          # every model, default batches
    python tools/bench_rewrite.py --models bn_cnn resnet50 --strategy moccasin --time-limit 60
    python tools/bench_rewrite.py --json results.jsonl     # raw rows as well
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_extract import DEFAULT_CASES  # noqa: E402 (the CPU-sized cases)

FRACTIONS = (0.9, 0.7, 0.5)
MIB = 2**20


def run_case(name, batch, size, fractions, strategy, time_limit, runs, trace=True,
             margin=None):
    """One model (in this process): baseline, then one row per budget fraction."""
    import numpy as np

    import tf_remat
    from tf_remat.api import measure_step_peak, step_allocations
    from tf_remat.errors import InfeasibleBudgetError, RematError
    from tf_remat.extract import trace_training_step
    from tf_remat.rewrite import static_order_step

    model, xs, ys = _model(name, batch, size)
    batch = int(xs.shape[0])
    ref = trace_training_step(model, xs, ys, conv_gradients="tensorflow")
    gref = trace_training_step(model, xs, ys, apply_updates=False, conv_gradients="tensorflow")
    x, y = _batch(xs, ys, model)
    base_runs = [measure_step_peak(ref.function, x, y, variables=ref.variables)
                 for _ in range(3)]
    base = int(statistics.median(r["step_peak_bytes"] for r in base_runs))
    t_base = [r["seconds"] for r in base_runs]
    out = {"model": name, "batch": batch, "input": size, "baseline_peak": base,
           "baseline_peaks": [r["step_peak_bytes"] for r in base_runs], "rows": []}
    state = _Snapshot(list({id(v): v for v in list(ref.variables) +
                            list(gref.variables)}.values()))
    g_ref = [t.numpy() for t in gref.function(x, y)]
    state.restore()
    floor = None  # the plain step in a static order: no recomputation, the same chain
    for frac in fractions:
        budget = int(frac * base)
        row = {"fraction": frac, "budget": budget}
        t0 = time.perf_counter()
        try:
            step = tf_remat.optimize(model, budget_bytes=budget, input_spec=xs, label_spec=ys,
                                     strategy=strategy, time_limit=time_limit, verbose=0,
                                     attach=False, margin=margin)
        except InfeasibleBudgetError as exc:
            row.update(status="infeasible", min_feasible=exc.min_feasible,
                       message=str(exc)[:300], seconds=time.perf_counter() - t0)
            out["rows"].append(row)
            _emit(row, name)
            continue
        except RematError as exc:
            row.update(status="error", message=str(exc)[:500])
            out["rows"].append(row)
            _emit(row, name)
            continue
        row["optimize_seconds"] = time.perf_counter() - t0
        rep = step.report
        # .get: an unverified step (a device without memory stats) has no measured peak or margin
        row.update({k: rep.get(k) for k in ("strategy", "status", "predicted_peak_bytes",
                                            "baseline_peak_bytes", "predicted_overhead",
                                            "solve_seconds", "measured_peak_bytes", "attempts",
                                            "recomputed_nodes", "nodes", "margin",
                                            "margin_met")})
        # what optimize predicted for each part (the measured ones are static_overhead and
        # recompute_overhead below)
        row["recompute_pred"] = rep.get("recompute_overhead")
        row["static_pred"] = rep.get("static_order_overhead")
        # where loops overlap in the static order: the order without overlap, and how many
        # of this plan's loops share a run with the one before
        row["serial_pred"] = rep.get("serial_order_overhead")
        row["overlapped_loops"] = rep.get("overlapped_loops")
        # updates the solver placed before a reader of the old weight, moved after it / left
        row["deferred_updates"] = rep.get("deferred_updates", 0)
        row["updates_copied_on_write"] = rep.get("updates_copied_on_write", 0)
        state.restore()
        runs_meas = [measure_step_peak(step, x, y, variables=ref.variables) for _ in range(3)]
        peaks = [m["step_peak_bytes"] for m in runs_meas]
        row["peaks"] = peaks
        row["measured_peak"] = int(statistics.median(peaks))
        row["measured_peak_max"] = max(peaks)
        # what the step's kernels asked for (the simulator's quantity) beside what the
        # allocator handed them (what get_memory_info counts): splits a miss into the
        # simulator's error and the allocator's chunk policy
        prof = step_allocations(step, x, y, variables=ref.variables)
        owned = runs_meas[0]["owned_bytes"]  # the variables and the batch
        row["requested_peak"] = prof["requested_peak_bytes"] + owned
        row["held_peak"] = prof["held_peak_bytes"] + owned
        row["fresh_held_peak"] = prof["fresh_pool_held_peak_bytes"] + owned
        if floor is None:  # what optimize's time_order timed, built again to time it here
            floor = static_order_step(step._primary().extraction, step._opts["chain"])
        rounds = {}
        steps = {"plain": ref.function, "static": floor, "remat": step}
        if row["serial_pred"] is not None:
            steps["serial"] = static_order_step(step._primary().extraction, step._opts["chain"],
                                                overlap_loops=False)
        times = _interleaved_times(steps, x, y, state, runs, rounds)
        row["t_plain"], row["t_static"], row["t_remat"] = \
            times["plain"], times["static"], times["remat"]
        row["t_serial"] = times.get("serial")
        row["measured_overhead"] = _paired(rounds, "remat", "plain")
        row["static_overhead"] = _paired(rounds, "static", "plain")
        if "serial" in rounds:
            row["serial_overhead"] = _paired(rounds, "serial", "plain")
        row["recompute_overhead"] = _paired(rounds, "remat", "static")
        # the earlier figure, the medians' ratio, for comparison with earlier runs
        row["medians_overhead"] = times["remat"] / times["plain"] - 1
        # the profiled costs in seconds: every node once, and the plan's sequence
        row["graph_cost"], row["plan_cost"] = step.graph.total_cost, step.plan.cost
        if trace:
            row.update(_copy_kernel_share(floor, step, x, y, state))
        try:
            g_new = [t.numpy() for t in step.gradients(x, y)]
            state.restore()
        except RematError as exc:
            row["gradients"] = f"error: {exc}"[:300]
            g_new = None
        if g_new is not None:
            scale = max(float(np.abs(g).max()) for g in g_ref[1:])
            err = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                      for a, b in zip(g_ref[1:], g_new))
            row["grad_err"] = err / scale if scale else err
            state.restore()
            loss_plain = float(ref.function(x, y))
            state.restore()
            loss_new = float(step(x, y))
            state.restore()
            row["loss_err"] = abs(loss_new - loss_plain) / max(abs(loss_plain), 1e-30)
        out["rows"].append(row)
        _emit(row, name)
        del step
    out["t_base"] = float(np.median(t_base))
    return out


class _Snapshot:
    def __init__(self, variables):
        import numpy as np

        self.variables = variables
        self.values = [np.array(v.numpy(), copy=True) for v in variables]

    def restore(self):
        import numpy as np

        for v, s in zip(self.variables, self.values):
            v.assign(np.array(s, copy=True))


def _model(name, batch, size):
    """A zoo model (batch 4 when None), else one of ``tools/bench_heldout.py``'s (its own
    batch size when None)."""
    from tf_remat.zoo import MODELS, get_model

    if name in MODELS:
        return get_model(name, batch or 4, size)
    import bench_heldout

    if name not in bench_heldout.MODELS:
        raise SystemExit(f"unknown model {name!r}: not in the zoo ({', '.join(MODELS)}) nor "
                         f"in tools/bench_heldout.py")
    build = bench_heldout.MODELS[name]
    return build(batch=batch) if batch else build()


def _batch(xs, ys, model):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)

    def make(spec, labels):
        shape = tuple(spec.shape)
        if spec.dtype.is_integer:
            hi = 2
            if labels:
                try:
                    hi = int(model.outputs[0].shape[-1])
                except Exception:  # noqa: BLE001
                    hi = 2
            else:
                hi = 100
            return tf.constant(rng.integers(0, hi, shape), spec.dtype)
        return tf.constant(rng.standard_normal(shape).astype(spec.dtype.as_numpy_dtype))

    return (tf.nest.map_structure(lambda s: make(s, False), xs),
            tf.nest.map_structure(lambda s: make(s, True), ys))


def _kernel_seconds(fn, x, y, state, reps=3):
    """Seconds per step each op's kernels ran, from a ``tf.profiler`` trace of ``fn``
    (:func:`tf_remat.profile.op_seconds`); the variables are restored after every step."""
    from tf_remat.extract import block
    from tf_remat.profile import op_seconds

    return op_seconds(lambda: block(fn(x, y)), reps=reps, reset=state.restore)[0]


def _copy_kernel_share(floor, step, x, y, state):
    """The recomputed copies' kernel time in the rewritten step, over the kernel time of the
    graph's ops in the static-order step: the recomputation's cost where the step runs it,
    free of the runtime's scheduling and of this machine's load."""
    from tf_remat.profile import traced_op
    from tf_remat.rewrite import _COPY

    names = {o for ops in step._primary().extraction.op_map.nodes for o in ops}
    # a loop body's kernels (``<loop>/body/_k/...``) and Grappler's renamed ops belong to the
    # graph op they are traced back to, in the base as in the copies
    base = sum(t for o, t in _kernel_seconds(floor, x, y, state).items()
               if traced_op(o, names) is not None)
    copies = sum(t for o, t in _kernel_seconds(step, x, y, state).items()
                 if _COPY in o and traced_op(o.split(_COPY)[0], names) is not None)
    return {"kernel_seconds": base, "copy_kernel_seconds": copies,
            "copy_kernel_share": copies / base if base else None}


def _interleaved_times(fns, x, y, state, runs, rounds=None):
    """Median seconds per step of each of ``fns``, in a shuffled order in every round, so that
    the bursts of load on this shared machine do not fall on one step in every round. Pass a
    dict as ``rounds`` to get each step's time in every round too (for :func:`_paired`)."""
    import random

    import tensorflow as tf

    def once(fn):
        t = time.perf_counter()
        out = fn(x, y)
        for o in tf.nest.flatten(out):
            o.numpy()
        dt = time.perf_counter() - t
        state.restore()
        return dt

    for fn in fns.values():
        once(fn)
    rng = random.Random(0)
    times = {k: [] for k in fns}
    for _ in range(runs):
        keys = list(fns)
        rng.shuffle(keys)
        for k in keys:
            times[k].append(once(fns[k]))
    if rounds is not None:
        rounds.update(times)
    return {k: statistics.median(v) for k, v in times.items()}


def _paired(rounds, a, b):
    """Median over rounds of step ``a``'s time over step ``b``'s in the same round, less one:
    a slow stretch of the machine's load scales both steps of a round alike, where it moves
    the two medians by different amounts when it falls on more rounds of one step."""
    return statistics.median(ta / tb for ta, tb in zip(rounds[a], rounds[b])) - 1


def _emit(row, name):
    short = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
             if k not in ("message", "peaks")}
    print(f"[{name}] {json.dumps(short)}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------- report
def table(results) -> str:
    lines = ["| model | batch | plain peak MiB | budget | budget MiB | status | simulated MiB | "
             "measured MiB | meas/budget | meas vs sim | requested MiB | req vs sim | held MiB | "
             "empty-pool held MiB | overhead pred | static + recompute pred | overhead meas | "
             "diff (pts) | static meas | recompute meas | copies' kernels | grad err | attempts |",
             "|---" * 23 + "|"]
    for res in results:
        if "error" in res:
            lines.append(f"| {res['model']} | {res['batch']} | error: {res['error'][:120]} |"
                         + " |" * 20)
            continue
        for r in res["rows"]:
            head = (f"| {res['model']} | {res['batch']} | {res['baseline_peak'] / MIB:.0f} | "
                    f"{100 * r['fraction']:.0f}% | {r['budget'] / MIB:.0f} |")
            if r.get("status") in ("infeasible", "error"):
                extra = (f"smallest reachable {r['min_feasible'] / MIB:.0f} MiB"
                         if r.get("min_feasible") else r.get("message", "")[:80])
                lines.append(f"{head} {r['status']} ({extra}) |" + " |" * 17)
                continue
            sim, meas = r["predicted_peak_bytes"], r["measured_peak"]
            req = r.get("requested_peak")  # absent in results from before the column
            within = r["measured_peak_max"] <= 1.05 * r["budget"]
            close = abs(meas - sim) <= 0.10 * sim
            dpts = 100 * (r["measured_overhead"] - r["predicted_overhead"])
            share = r.get("copy_kernel_share")
            grad = r.get("grad_err")
            st, rc = r.get("static_pred"), r.get("recompute_pred")
            parts = ("n/a" if st is None or rc is None
                     else f"{100 * st:+.1f}% + {100 * rc:.1f}%")
            if r.get("serial_pred") is not None:
                parts += (f" (serial {100 * r['serial_pred']:+.1f}%, "
                          f"{r['overlapped_loops']} loops overlapped)")
            lines.append(
                f"{head} {r['status']} | {sim / MIB:.0f} | {meas / MIB:.0f} | "
                f"{meas / r['budget']:.2f}{'' if within else ' **over**'} | "
                f"{100 * (meas / sim - 1):+.1f}%{'' if close else ' **miss**'} | "
                f"{_mib(req)} | {_pct(req, sim)} | {_mib(r.get('held_peak'))} | "
                f"{_mib(r.get('fresh_held_peak'))} | "
                f"{100 * r['predicted_overhead']:.1f}% | {parts} | "
                f"{100 * r['measured_overhead']:.1f}% | "
                f"{dpts:+.1f}{'' if abs(dpts) <= 10 else ' **miss**'} | "
                f"{100 * r['static_overhead']:+.1f}%{_serial(r)} | "
                f"{100 * r['recompute_overhead']:.1f}% | "
                f"{'n/a' if share is None else f'{100 * share:.1f}%'} | "
                f"{'n/a' if grad is None else f'{grad:.1e}'} | {r['attempts']}"
                f"{_updates(r)} |")
    return "\n".join(lines)


def _updates(r) -> str:
    """What the attempts column adds on the kept plan's updates (optimize's defer_updates)."""
    moved, left = r.get("deferred_updates"), r.get("updates_copied_on_write")
    parts = [f"{moved} updates deferred"] if moved else []
    parts += [f"{left} copied on write"] if left else []
    return f" ({', '.join(parts)})" if parts else ""


def _serial(r):
    s = r.get("serial_overhead")
    return "" if s is None else f" (serial {100 * s:+.1f}%)"


def _mib(b):
    return "n/a" if b is None else f"{b / MIB:.1f}"


def _pct(b, ref):
    return "n/a" if b is None else f"{100 * (b / ref - 1):+.1f}%"


def times_table(results) -> str:
    """Median step times beside the profiled costs the solver was given (seconds summed over
    nodes, each node's ops timed alone): how far a sum of isolated op times is from a step."""
    lines = ["| model | budget | plain ms | static order ms | rewritten ms | node costs ms | "
             "plan cost ms | node costs / plain | plan cost / rewritten | "
             "overhead from the medians |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for r in res.get("rows", []):
            if "t_plain" not in r or r.get("graph_cost") is None:
                continue
            lines.append(
                f"| {res['model']} | {100 * r['fraction']:.0f}% | {1e3 * r['t_plain']:.1f} | "
                f"{1e3 * r['t_static']:.1f} | {1e3 * r['t_remat']:.1f} | "
                f"{1e3 * r['graph_cost']:.1f} | {1e3 * r['plan_cost']:.1f} | "
                f"{r['graph_cost'] / r['t_plain']:.2f} | {r['plan_cost'] / r['t_remat']:.2f} | "
                f"{100 * (r['t_remat'] / r['t_plain'] - 1):.1f}% |")
    return "\n".join(lines) if len(lines) > 2 else ""


NOTES = """\
## How to read this

* **plain peak**: TensorFlow's measured peak of the plain training step (median of 3 runs):
  allocator peak during the step minus what was allocated before it, plus the variables and the
  batch (the step's own memory; the budget counts the same). Budgets are 90/70/50% of it.
* **simulated**: the plan's peak in the simulator (`plan.peak_memory`); **measured**: the
  rewritten step's peak, measured the same way (median of 3 runs, the variables restored from
  NumPy between them). `optimize` verifies each plan in several allocator layouts (held
  ballasts and fragmented memory, `tf_remat.api.verification_layouts`) and re-solves with a
  lower budget while the worst is over the budget less a margin (**attempts** counts the
  solves, and says how many variable updates the kept plan had before a reader of the old
  weight that `optimize` deferred past it, or left, copied on write; "Run conditions" below
  says which layouts and margin this run had).
* **requested** / **held**: one more run of the rewritten step under TensorFlow's profiler
  (`tf_remat.api.step_allocations`), plus the variables and the batch: the peak of the bytes
  its kernels asked for (what the simulator models; **req vs sim** is the simulator's own
  error) and of the chunks the allocator handed them (TensorFlow's BFC allocator hands over a
  whole free chunk when it is less than twice the request, so held exceeds requested by an
  amount that depends on which chunks are free; measured follows held, not requested).
  **empty-pool held**: the same requests replayed through a model of that allocator
  (`tf_remat.allocator.replay`) in an empty pool: what the step's own allocation pattern
  holds. Held beyond it is what earlier allocations left in the pool.
* **overhead pred**: `report["predicted_overhead"]`, `(1 + static) * (1 + recompute) - 1` from
  the two parts beside it: **static** is the price of running any static order (TensorFlow no
  longer runs independent ops side by side), which `optimize` times itself (`time_order`: the
  plain step against the graph with no recomputation in topological order, chained as the
  rewritten step is, a few paired rounds); **recompute** is plan cost / sum of node costs - 1
  with profiled costs (what the solver minimizes). The three steps run in a shuffled order in
  each of `--runs` rounds, after `optimize` returned. Where independent loops overlap in the
  static order (a Bidirectional RNN's), `optimize` also times the order with every node after
  the one before (**serial**), and the prediction is that order's price, the plan's cost over
  it, less what the plan's runs of overlapped loops save (`tf_remat.api`'s report); **static
  meas** then gives that order's measured price too. **overhead meas**: the median over rounds
  of the rewritten step's time over the plain step's in the same round, - 1 (a slow stretch of
  the machine's load scales a round's steps alike; the ratio of the two medians, this
  column's figure until now and **overhead from the medians** in the second table, moves when it
  falls on more rounds of one step). **static meas**: that static-order step, built again here,
  over the plain step; **recompute meas**: the rewritten step over it, the same way. **copies'
  kernels**: from a `tf.profiler` trace (3 steps each), the kernel time of the recomputed copies
  in the rewritten step over the kernel time of the graph's ops in the static-order step: what
  the recomputation costs where the step runs it, apart from scheduling and this machine's load.
* **grad err**: max |g_rewritten - g_plain| over every gradient, divided by the largest gradient
  value (float32 reassociation: ~1e-7 .. 1e-5 expected).
* Targets: measured peak within the budget (5% slack) and within 10% of simulated; measured
  overhead within 10 points of predicted. An infeasible row gives the smallest budget `optimize`
  found reachable (weights, optimizer slots and the batch alone often exceed 50%).
"""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=None,
                   help="zoo names, or tools/bench_heldout.py's (default: the zoo's)")
    p.add_argument("--batch", type=int, default=None, help="override the batch size")
    p.add_argument("--input", default=None, help="override the input size")
    p.add_argument("--fractions", default=",".join(map(str, FRACTIONS)))
    p.add_argument("--strategy", default=None,
                   help="default: auto when registered, else moccasin")
    p.add_argument("--time-limit", type=float, default=60.0)
    p.add_argument("--runs", type=int, default=7, help="timed runs per step")
    p.add_argument("--no-trace", action="store_true",
                   help="skip the tf.profiler trace of the copies' kernel time")
    p.add_argument("-o", "--output", default=os.path.join(ROOT, "benchmarks", "results",
                                                          "rewrite.md"))
    p.add_argument("--json", default=None, help="also write raw results (JSON lines)")
    p.add_argument("--margin", type=float, default=None,
                   help="optimize's verification margin (default: its own, 5-15%%)")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # child process
    args = p.parse_args(argv)
    fractions = [float(f) for f in args.fractions.split(",")]
    strategy = args.strategy or _default_strategy()
    if args.case:
        name, batch, size = json.loads(args.case)
        res = run_case(name, batch, size, fractions, strategy, args.time_limit, args.runs,
                       trace=not args.no_trace, margin=args.margin)
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    cases = [c for c in DEFAULT_CASES if args.models is None or c[0] in args.models]
    if args.models:
        known = {c[0] for c in DEFAULT_CASES}
        # another zoo model at batch 4, a held-out one (tools/bench_heldout.py) at its own
        cases += [(m, None, None) for m in args.models if m not in known]
    results = []
    for name, batch, size in cases:
        batch = args.batch or batch
        size = args.input or size
        t0 = time.perf_counter()
        cmd = [sys.executable, os.path.abspath(__file__), "--case",
               json.dumps([name, batch, size]), "--fractions", args.fractions,
               "--strategy", strategy, "--time-limit", str(args.time_limit),
               "--runs", str(args.runs)] + (["--no-trace"] if args.no_trace else []) \
            + ([] if args.margin is None else ["--margin", str(args.margin)])
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        res = None
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                res = json.loads(line[7:])
        if res is None:
            res = {"model": name, "batch": batch, "error": f"exit code {proc.returncode}"}
        res["seconds"] = time.perf_counter() - t0
        results.append(res)
        print(f"{name}: done in {res['seconds']:.0f} s", file=sys.stderr, flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(res) + "\n")
    import tensorflow as tf

    from tf_remat.extract import onednn_enabled

    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
               f"oneDNN {'on' if onednn_enabled() else 'off'}; "
               f"Python {platform.python_version()}, TensorFlow {tf.__version__}")
    doc = ["# Rewrite benchmark", "",
           f"Machine: {machine}. Strategy `{strategy}`, time limit {args.time_limit:g} s, "
           f"profiled costs"
           + ("" if args.margin is None else f", verification margin {args.margin:g}")
           + ". Generated by `tools/bench_rewrite.py`.", "",
           table(results), ""]
    times = times_table(results)
    if times:
        doc += ["Step times (medians of the interleaved runs) and the profiled costs:", "",
                times, ""]
    doc.append(NOTES)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        f.write("\n".join(doc))
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


def _default_strategy():
    from tf_remat.solvers import _TABLE, get_strategy
    from tf_remat.errors import StrategyError

    if "auto" in _TABLE:
        try:
            get_strategy("auto")
            return "auto"
        except StrategyError:
            pass
    return "moccasin"


if __name__ == "__main__":
    sys.exit(main())
