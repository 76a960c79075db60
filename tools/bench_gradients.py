#!/usr/bin/env python
"""How exact are the rewritten step's gradients? Plain and rewritten float32 steps against a
float64 reference; writes benchmarks/results/gradients.md.

For each zoo model: the plain traced gradients step (float32), the rewritten step of the
checkpoint-all plan (no recomputation: the rewrite machinery alone) and of a plan at a fraction
of the peak (recomputation), all on the same batch and weights, and the same model built in
float64 with those weights. Errors are max |g - g_ref| over all gradients divided by the largest
reference gradient. A rewritten step is as exact as TensorFlow's own when its error against
float64 is of the order of the plain step's: the remaining difference between the two float32
steps is kernel choice and summation order (fused vs unfused kernels), amplified by depth.

    python tools/bench_gradients.py [--models bn_cnn resnet50 ...] [--fraction 0.7]
"""

import argparse
import os
import platform
import subprocess
import sys
import json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# name, batch, input size
MODELS = [("bn_cnn", 16, "32"), ("mobilenet", 4, "64"), ("resnet50", 4, "64"),
          ("vgg16", 4, "64")]

CHILD = r"""
import json, os, sys
import numpy as np
import tensorflow as tf
import keras
from tf_remat.zoo import get_model
from tf_remat.extract import trace_training_step, extract
from tf_remat.rewrite import rewrite
from tf_remat.api import solve_isolated, _synthetic_batch

name, batch, size, frac, strategy, limit, seed = sys.argv[1:8]
batch, frac, limit, seed = int(batch), float(frac), float(limit), int(seed)
keras.utils.set_random_seed(seed)
model, xs, ys = get_model(name, batch, size)
gref = trace_training_step(model, xs, ys, apply_updates=False)
x, y = _synthetic_batch(xs, ys)
snap = [np.array(v.numpy(), copy=True) for v in gref.variables]

def grads(fn, xin=None, variables=None, saved=None):
    # gradients of one call (the step returns loss, *gradients); variables restored after
    out = [t.numpy() for t in fn(x if xin is None else xin, y)]
    for v, s in zip(variables or gref.variables, saved or snap):
        v.assign(s)
    return out[1:]

def extracted(m, spec, run):
    # the gradients-only graph of m and the gradients of its checkpoint-all rewrite
    e = extract(m, input_spec=spec, label_spec=ys, cost_model="flops", verbose=0,
                apply_updates=False)
    full = solve_isolated(e.graph, e.graph.no_remat_peak, "checkpoint-all")
    return e, run(rewrite(e.traced, e.graph, e.op_map, full))

plain = grads(gref.function)
ex, all_ = extracted(model, xs, grads)
g = ex.graph
# the fraction applies to what rematerialization can change (above weights and batch)
# a higher fraction when the solver finds nothing at the first within the time limit
for f in (frac, 0.85, 0.95):
    p = solve_isolated(g, g.fixed_memory + int(f * (g.no_remat_peak - g.fixed_memory)),
                       strategy, time_limit=limit)
    if p.within_budget:
        break
used_frac = f
rem = grads(rewrite(ex.traced, g, ex.op_map, p)) if p.within_budget else None
counts = {}
for v in p.sequence:
    counts[v] = counts.get(v, 0) + 1
recomputed = sum(1 for c in counts.values() if c > 1)

keras.config.set_floatx("float64")
keras.config.set_dtype_policy("float64")
m64, _, _ = get_model(name, batch, size)
for v64, v in zip(m64.variables, model.variables):
    v64.assign(tf.cast(v, v64.dtype))
with tf.GradientTape() as tape:
    pred = m64(tf.cast(x, tf.float64), training=True)
    loss = m64.compute_loss(x=None, y=y, y_pred=pred)
ref = [t.numpy() for t in tape.gradient(loss, m64.trainable_variables)]
# eager float64 draws other dropout masks than the traced steps: no reference there
has_dropout = any("Dropout" in type(l).__name__ for l in model._flatten_layers())
if has_dropout:
    ref = None

scale = max(float(np.abs(r).max()) for r in (ref if ref is not None else plain))

def err(a, b):
    if a is None or b is None:
        return None
    return max(float(np.abs(np.asarray(u, np.float64) - np.asarray(w, np.float64)).max())
               for u, w in zip(a, b)) / scale

# the same comparison in float64: rounding shrinks by ~1e-9, a different computation would not
keras.utils.set_random_seed(seed)
m64b, _, _ = get_model(name, batch, size)
keras.config.set_floatx("float32")
keras.config.set_dtype_policy("float32")
for v64, v in zip(m64b.variables, model.variables):
    v64.assign(tf.cast(v, v64.dtype))
xs64 = tf.TensorSpec(xs.shape, tf.float64)
g64ref = trace_training_step(m64b, xs64, ys, apply_updates=False)
x64 = tf.cast(x, tf.float64)
snap64 = [np.array(v.numpy(), copy=True) for v in g64ref.variables]

def grads64(fn):
    return grads(fn, x64, g64ref.variables, snap64)

plain64 = grads64(g64ref.function)
ex64, all64 = extracted(m64b, xs64, grads64)
G = ex64.graph
q = solve_isolated(G, G.fixed_memory + int(used_frac * (G.no_remat_peak - G.fixed_memory)),
                   strategy, time_limit=limit)
rem64 = grads64(rewrite(ex64.traced, G, ex64.op_map, q)) if q.within_budget else None
scale64 = max(float(np.abs(r).max()) for r in plain64)

def err64(a):
    return None if a is None else max(float(np.abs(u - w).max())
                                      for u, w in zip(a, plain64)) / scale64

print(json.dumps({"model": name, "seed": seed, "f64_all_vs_plain": err64(all64),
                  "f64_remat_vs_plain": err64(rem64), "batch": batch, "input": size, "nodes": g.n,
                  "plain_vs_f64": err(plain, ref), "all_vs_f64": err(all_, ref),
                  "remat_vs_f64": None if rem is None else err(rem, ref),
                  "all_vs_plain": err(all_, plain),
                  "remat_vs_plain": None if rem is None else err(rem, plain),
                  "recomputed": recomputed, "fraction": used_frac, "status": p.status}))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", help="default: " + " ".join(m[0] for m in MODELS))
    ap.add_argument("--fraction", type=float, default=0.7,
                    help="budget of the recomputing plan, a fraction of the no-remat peak")
    ap.add_argument("--strategy", default="auto")
    ap.add_argument("--time-limit", type=float, default=20.0)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3],
                    help="weight seeds (the batch is the same): float32 errors are a sample")
    ap.add_argument("-o", "--output", default=os.path.join(ROOT, "benchmarks", "results",
                                                           "gradients.md"))
    args = ap.parse_args(argv)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TF_CPP_MIN_LOG_LEVEL="2")
    rows = []
    for name, batch, size in [m for m in MODELS if not args.models or m[0] in args.models]:
        for seed in args.seeds:
            proc = subprocess.run([sys.executable, "-c", CHILD, name, str(batch), size,
                                   str(args.fraction), args.strategy, str(args.time_limit),
                                   str(seed)], capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                row = {"model": name, "batch": batch, "input": size, "seed": seed,
                       "error": (proc.stderr.strip().splitlines() or ["?"])[-1][:200]}
            else:
                row = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(row, flush=True)
    with open(args.output, "w") as f:
        f.write(_markdown(rows, args))
    print(f"wrote {args.output}")
    return 0


def _e(v):
    return "-" if v is None else f"{v:.1e}"


def _markdown(rows, args):
    out = ["# Gradient exactness: float32 steps against float64", "",
           f"`python tools/bench_gradients.py --fraction {args.fraction:g} --strategy "
           f"{args.strategy}` on {platform.machine()}, {os.cpu_count()} cores, CPU "
           "(oneDNN on).", "",
           "Same weights (per seed), same synthetic batch. *plain*: the traced Keras gradients "
           "step; *rewrite, no recompute*: the rewritten step of the checkpoint-all plan; "
           f"*rewrite, remat*: a `{args.strategy}` plan at {100 * args.fraction:.0f}% of the "
           "activation memory (the no-remat peak less weights and batch; 85% or 95% where no plan "
           "was found at the first, shown beside the recomputed count). *float64*: the same "
           "model, weights and plans traced and rewritten in float64, against the plain "
           "float64 step. Each error: max |g - g_ref| over every gradient / the largest "
           "float64 gradient.", "",
           "| model | seed | batch | input | nodes | plain vs f64 | rewrite, no recompute vs f64 | "
           "rewrite, remat vs f64 | recomputed nodes | rewrite vs plain (no recompute / "
           "remat) | float64: rewrite vs plain (no recompute / remat) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['seed']} | {r['batch']} | {r['input']} | error: "
                       f"{r['error']} | | | | | |")
            continue
        out.append(f"| {r['model']} | {r['seed']} | {r['batch']} | {r['input']} | {r['nodes']} | "
                   f"{_e(r['plain_vs_f64'])} | {_e(r['all_vs_f64'])} | "
                   f"{_e(r['remat_vs_f64'])} | {r['recomputed']} ({100 * r['fraction']:.0f}%) | "
                   f"{_e(r['all_vs_plain'])} / {_e(r['remat_vs_plain'])} | "
                   f"{_e(r['f64_all_vs_plain'])} / {_e(r['f64_remat_vs_plain'])} |")
    out += ["", "Reading: the last column is the test of exactness: in float64 the rewritten "
            "steps, recomputing or not, agree with the plain step to 1e-13 or better, so they "
            "compute the same function (a copy reading a wrong value would show at full size). "
            "In float32 the rewritten step runs the same fused kernels as the plain one (the "
            "chain orders ops through Identity gates, which Grappler's remapper and oneDNN "
            "fuse across), so without recomputation bn_cnn, MobileNet and VGG16 agree to the "
            "bit. ResNet50 at 64x64 and batch 4 is ill-conditioned in float32: its last "
            "BatchNorms normalize over 16 values per channel, and the plain float32 step is "
            "itself up to a few 1e-2 of the largest gradient away from float64, depending on "
            "the seed; compare the rewritten step's distance from float64 with the plain "
            "step's over the seeds, not one seed. The one graph difference left there is an "
            "add tree: in the plain step Grappler's arithmetic optimizer merges each "
            "projection block's residual add with its two BatchNorm adds into one AddN, which "
            "the chain's ordering prevents in the rewritten step (same sum, other rounding). "
            "Float64 references are left out (-) for models with Dropout: an eager float64 run "
            "draws other masks than the traced steps.", ""]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
