#!/usr/bin/env python
"""Benchmark extraction on the model zoo -> benchmarks/results/extract.md.

Per model, in a fresh process (so the allocator holds nothing else): trace + group + profile
with an empty profile cache (``profiling s``), the same profile again from the cache
(``cached s``), then the original ``tf.function`` step run on random data: median step time over
the runs vs the predicted step time (sum of node costs), and TensorFlow's peak
(``reset_memory_stats`` + ``get_memory_info('CPU:0')['peak']``, median, min-max over the runs) vs
the predicted no-rematerialization peak (``graph.no_remat_peak``).

Usage:
    python tools/bench_extract.py                       # every model, default batches
    python tools/bench_extract.py --models resnet50 vgg16 --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

#: (model, batch, input size) sized for a 2-core CPU with 24 GiB
DEFAULT_CASES = [
    ("bn_cnn", 64, None),
    ("transformer", 8, None),
    ("mobilenet", 8, None),
    ("resnet50", 8, None),
    ("vgg16", 4, None),
    ("vgg19", 4, None),
    ("unet", 2, None),
    ("fcn8", 2, None),
    ("segnet", 2, None),
]

NOTES = """\
## How to read this

* **ops**: ops in the traced step (`tf.function` graph: forward, gradients, optimizer update);
  **nodes**: solver nodes after grouping (fused pairs, views, in-place chains, small values).
* **profiling s**: per-node measurement on this CPU with an empty cache (distinct node
  signatures only); **cached s**: the same from the disk cache.
* **step pred / meas**: sum of node costs vs the median wall time of the original step.
* **peak pred / meas**: `graph.no_remat_peak` vs TensorFlow's measured peak of the original
  step (median of the runs; min-max beside it). The CPU allocator's statistics in TF 2.21 leave
  out allocations under 256 KiB and the executor's order changes from run to run (2 inter-op
  threads, cost-model-driven inlining), so the measured peak of one model moves by up to one or
  two activation buffers between runs; the table gives the spread.
* Targets: step time within +-25%, peak within +-15% (of the median).

## Misses, and what is known about them

* **Peak**: every model but bn_cnn is within +-15% (-12% .. +8%). bn_cnn misses by 0.3 points
  (-15.3%). A FULL_TRACE of the same step run through a v1 Session puts TensorFlow's peak where
  the reference order puts it (the Adam update of `fc1` overlapping the convolution backward)
  and at the predicted size (79-80 MiB). Run as a `tf.function`, the measured peak is 87-94 MiB.
  The extra memory probably comes from inter-op parallelism letting temporaries of two branches
  coexist, but this is not verified. A sequential reference order cannot represent that
  overlap.
* **Step time, small nodes (bn_cnn +110%, transformer +125%, segnet +31%)**: profiling runs every
  node alone as its own function call. These models consist of hundreds of sub-millisecond nodes
  (BatchNorm / LayerNorm arithmetic, attention reshapes, per-variable optimizer updates). For
  each such node the measured call time still contains fixed costs that the empty-function
  baseline does not remove. Waking the intra-op thread pool and per-call oneDNN primitive setup
  are the likely ones (not measured separately). Summed over hundreds of nodes, these costs
  dominate. The models whose time is in large convolutions (VGG16/19, U-Net, MobileNet) land
  within +-17%.
* **Step time, fcn8 (+77%)**: the cost sits in a few huge nodes: fc6, a 7x7x512x4096
  convolution, and the 16x16 stride-8 transposed convolution. They are slower alone than inside
  the step. Not investigated further. One hypothesis is a different oneDNN algorithm or weight
  reorder per call.
* **Step time, resnet50 (-36%)**: the sum of node costs is short of the measured step. Not
  investigated. Two candidates: the ~7,800 fixed ops (variable reads, shape arithmetic, scalar
  optimizer math) carry no cost in the graph, and isolated runs reuse warm caches.
* Relative costs (which node is expensive) are what the solvers use. The absolute sum matters
  only for reported overheads.
"""


def run_case(name, batch, input_size, runs):
    import statistics

    import tensorflow as tf

    from tf_remat import profile as P
    from tf_remat.extract import _random_like, extract
    from tf_remat.zoo import get_model

    model, xs, ys = get_model(name, batch, input_size)
    t = time.perf_counter()
    ex = extract(model, input_spec=xs, label_spec=ys, cost_model="profile", verbose=0)
    extract_s = time.perf_counter() - t
    t = time.perf_counter()
    P.profile_nodes(ex.traced, ex.op_map, verbose=0)
    cached_s = time.perf_counter() - t
    g = ex.graph
    classes = 2 if name == "transformer" else None
    x = _random_like(xs, seed=1, labels=None if not xs.dtype.is_integer else 100)
    y = _random_like(ys, seed=2, labels=classes or (ex.traced.model.outputs[0].shape[-1]))
    fn = ex.traced.function
    fn(x, y).numpy()
    times, peaks = [], []
    for _ in range(runs):
        tf.config.experimental.reset_memory_stats("CPU:0")
        t = time.perf_counter()
        fn(x, y).numpy()
        times.append(time.perf_counter() - t)
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
    return {"model": name, "batch": batch, "input": input_size, "ops": ex.info["ops"],
            "node_ops": ex.info["node_ops"], "nodes": g.n, "edges": len(g.edges),
            "profile_s": ex.info["profile_seconds"], "extract_s": extract_s,
            "cached_s": cached_s, "signatures": ex.info["signatures"],
            "failures": len(ex.info["profile_failures"]),
            "pred_step": g.total_cost, "meas_step": statistics.median(times),
            "pred_peak": g.no_remat_peak, "meas_peak": statistics.median(peaks),
            "meas_peak_min": min(peaks), "meas_peak_max": max(peaks),
            "fixed": g.fixed_memory}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", help="zoo names (default: all)")
    p.add_argument("--runs", type=int, default=7, help="step runs per model")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "extract.md"))
    p.add_argument("--from-json", help="re-render the report from a saved results JSON")
    p.add_argument("--one", nargs=3, metavar=("MODEL", "BATCH", "INPUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            write_report(json.load(f), args.out)
        return 0
    if args.one:
        name, batch, size = args.one
        res = run_case(name, int(batch), None if size == "-" else size, args.runs)
        print("RESULT " + json.dumps(res))
        return 0
    cases = [c for c in DEFAULT_CASES if not args.models or c[0] in args.models]
    results = []
    for name, batch, size in cases:
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TF_REMAT_CACHE=cache, TF_CPP_MIN_LOG_LEVEL="2")
            cmd = [sys.executable, os.path.abspath(__file__), "--runs", str(args.runs),
                   "--one", name, str(batch), size or "-"]
            t = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not line:
                print(f"{name}: FAILED\n{proc.stderr[-2000:]}", file=sys.stderr)
                results.append({"model": name, "batch": batch, "error":
                                proc.stderr.strip().splitlines()[-1][:200] if proc.stderr
                                else "failed"})
                continue
            res = json.loads(line[0][7:])
            res["wall_s"] = time.perf_counter() - t
            results.append(res)
            print(f"{name}: {res['nodes']} nodes, step {res['pred_step']:.3f}/"
                  f"{res['meas_step']:.3f} s, peak {res['pred_peak'] / 2**20:.0f}/"
                  f"{res['meas_peak'] / 2**20:.0f} MiB", flush=True)
    write_report(results, args.out)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.out}")
    return 0


def write_report(results, path):
    import platform

    import tensorflow as tf

    from tf_remat.profile import device_key

    mib = 2 ** 20
    lines = ["# Extraction benchmark", "",
             f"Machine: {device_key()}; Python {platform.python_version()}, "
             f"TensorFlow {tf.__version__}. Generated by `tools/bench_extract.py`.", "",
             "| model | batch | ops | nodes | profiling s | cached s | step pred s | "
             "step meas s | step err | peak pred MiB | peak meas MiB (min-max) | peak err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['batch']} | failed: {r['error']} |"
                         + " |" * 9)
            continue
        se = r["pred_step"] / r["meas_step"] - 1
        pe = r["pred_peak"] / r["meas_peak"] - 1
        flag = lambda e, lim: f"{100 * e:+.1f}%" + ("" if abs(e) <= lim else " **miss**")  # noqa
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['ops']} | {r['nodes']} | "
            f"{r['profile_s']:.1f} | {r['cached_s']:.2f} | {r['pred_step']:.3f} | "
            f"{r['meas_step']:.3f} | {flag(se, 0.25)} | {r['pred_peak'] / mib:.0f} | "
            f"{r['meas_peak'] / mib:.0f} ({r['meas_peak_min'] / mib:.0f}-"
            f"{r['meas_peak_max'] / mib:.0f}) | {flag(pe, 0.15)} |")
    lines += ["", NOTES]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
