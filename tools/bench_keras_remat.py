#!/usr/bin/env python
"""Keras's own rematerialization (``keras.RematScope``) against ``tf_remat.optimize``;
writes benchmarks/results/keras_remat.md.

Keras 3 ships ``keras.RematScope(mode=...)``: layers created inside it wrap their call in the
backend's recompute-gradient (``tf.recompute_grad`` on TensorFlow), so each wrapped layer keeps
its inputs and recomputes what it holds inside during the backward pass. A user who is out of
memory tries that first, so this is the comparison that decides whether tf-remat is worth
installing. Per model, fresh processes per configuration (the allocator's history is part of
what it measures; three for each plain and RematScope row, whose medians count):

* **plain**: the model as built, Keras's own training step (``model.train_on_batch``);
* **RematScope(mode)** for ``"full"``, ``"activations"`` and ``"larger_than"`` (Keras's default
  threshold): the same layers created inside the scope (the ``keras.Model`` outside it: a
  Functional model created inside is wrapped too, and its call takes ``training=``); for a model
  with BatchNormalization or Dropout, also with those two created outside the scope, since
  TensorFlow's recompute-gradient refuses keyword arguments such as ``training=`` inside a
  ``tf.function``; and compiled with ``run_eagerly=True``, where it accepts them (with the plain
  model run eagerly too, for the eager step's own cost). A configuration that raises is
  reported with its error, as a user trying it would meet it;
* **tf-remat at ...**: the plain model through ``tf_remat.optimize`` (``auto``, verification on),
  then ``model.train_on_batch`` again, which runs the rewritten step: at each RematScope mode's
  measured peak that is under the plain one (the same memory: which costs less time?), and at
  60% of the plain peak.

Every row is measured the same way: ``tf_remat.api.measure_step_peak`` on
``model.train_on_batch`` (two warm-up steps, then eleven; the worst peak, the median time;
weights, optimizer slots and the batch counted, the variables restored after).

    python tools/bench_keras_remat.py [--models resnet mlp convnet] [--time-limit 20]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MIB = 2**20
#: a mode ending in "*" keeps BatchNormalization and Dropout out of the scope: their calls take
#: ``training=``, which TensorFlow's recompute-gradient refuses in a tf.function
#: "eager ..." compiles with run_eagerly=True, where it accepts keyword arguments ("none": no
#: scope, the eager step's own cost)
MODES = ("full", "full*", "activations", "larger_than", "larger_than*", "eager none",
         "eager full", "eager full*")
FRACTION = 0.6
RUNS = 11
_EXEMPT = False


def _training_layer(cls, *args, **kwargs):
    """A layer whose call takes ``training=``, created outside any RematScope when the mode
    asks so (``RematScope(None)`` turns it off within)."""
    import keras

    if _EXEMPT:
        with keras.RematScope(mode=None):
            return cls(*args, **kwargs)
    return cls(*args, **kwargs)


# --------------------------------------------------------------------- models
def resnet():
    """A CIFAR-style residual CNN with BatchNorm and Dropout: what most users train."""
    import keras

    def block(x, f, stride):
        y = keras.layers.Conv2D(f, 3, strides=stride, padding="same", use_bias=False)(x)
        y = _training_layer(keras.layers.BatchNormalization)(y)
        y = keras.layers.Activation("relu")(y)
        y = keras.layers.Conv2D(f, 3, padding="same", use_bias=False)(y)
        y = _training_layer(keras.layers.BatchNormalization)(y)
        if stride != 1 or x.shape[-1] != f:
            x = keras.layers.Conv2D(f, 1, strides=stride, use_bias=False)(x)
            x = _training_layer(keras.layers.BatchNormalization)(x)
        return keras.layers.Activation("relu")(keras.layers.Add()([x, y]))

    inp = keras.Input((32, 32, 3))
    h = keras.layers.Conv2D(32, 3, padding="same")(inp)
    h = _training_layer(keras.layers.BatchNormalization)(h)
    h = keras.layers.ReLU()(h)
    for f, s in ((32, 1), (32, 1), (64, 2), (64, 1), (128, 2)):
        h = block(h, f, s)
    h = keras.layers.GlobalAveragePooling2D()(h)
    h = _training_layer(keras.layers.Dropout, 0.3)(h)
    return inp, keras.layers.Dense(10, activation="softmax")(h), (32, 32, 32, 3)


def mlp():
    """A residual MLP with LayerNorm and GELU, nothing that takes ``training=``; at a batch
    where activations, not weights and Adam's slots, make up most of the step."""
    import keras

    inp = keras.Input((128,))
    h = keras.layers.Dense(256)(inp)
    for _ in range(6):
        r = keras.layers.LayerNormalization()(h)
        r = keras.layers.Dense(1024, activation="gelu")(r)
        r = keras.layers.Dense(256)(r)
        h = keras.layers.Add()([h, r])
    return inp, keras.layers.Dense(10, activation="softmax")(h), (2048, 128)


def convnet():
    """A VGG-style CNN without BatchNorm or Dropout."""
    import keras

    inp = keras.Input((64, 64, 3))
    h = inp
    for f in (32, 64, 128):
        h = keras.layers.Conv2D(f, 3, padding="same", activation="relu")(h)
        h = keras.layers.Conv2D(f, 3, padding="same", activation="relu")(h)
        h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return inp, keras.layers.Dense(10, activation="softmax")(h), (16, 64, 64, 3)


MODELS = {"resnet": resnet, "mlp": mlp, "convnet": convnet}
#: the models with BatchNormalization or Dropout, for which the "*" modes differ
TRAINING_LAYERS = {"resnet"}


# ------------------------------------------------------------------ one case
def run_case(name: str, mode: str | None, budget: int | None, time_limit: float) -> dict:
    """Build ``name`` (inside ``RematScope(mode)`` when given), optimize it for ``budget`` bytes
    when given, and measure ``model.train_on_batch``."""
    import keras
    import tensorflow as tf

    import tf_remat
    from tf_remat.api import measure_step_peak

    keras.utils.set_random_seed(0)
    row = {"model": name, "mode": mode, "budget": budget}
    try:
        global _EXEMPT
        _EXEMPT = bool(mode) and mode.endswith("*")
        eager = bool(mode) and mode.startswith("eager ")
        if eager:
            mode = mode[len("eager "):]
        if mode:
            # the layers inside the scope, the model outside: a Functional model created
            # inside is itself wrapped, and its call takes training=
            with keras.RematScope(mode=mode.rstrip("*") if mode != "none" else None):
                inputs, outputs, shape = MODELS[name]()
        else:
            inputs, outputs, shape = MODELS[name]()
        model = keras.Model(inputs, outputs)
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                      run_eagerly=eager)
        x = tf.random.uniform(shape)
        y = tf.random.uniform(shape[:1], 0, 10, dtype=tf.int32)
        plain_fn = None
        if budget is not None:
            # Keras's own train function, kept to time against the rewritten one in turns
            model.train_on_batch(x, y)
            plain_fn = model.train_function
            t = time.perf_counter()
            step = tf_remat.optimize(model, budget_bytes=budget, input_spec=tf.TensorSpec(shape),
                                     label_spec=tf.TensorSpec(shape[:1], tf.int32),
                                     time_limit=time_limit, verbose=0)
            row["optimize_seconds"] = time.perf_counter() - t
            row["predicted_overhead"] = step.report["predicted_overhead"]
            row["traced_plain"] = step.report["baseline_peak_bytes"]
        model.train_on_batch(x, y)  # builds the optimizer's slots before they are counted
        variables = list(model.variables) + list(model.optimizer.variables)
        m = measure_step_peak(lambda a, b: model.train_on_batch(a, b), x, y,
                              variables=variables, runs=RUNS, warmup=2)
        if plain_fn is not None:
            row["paired_ratio"] = _paired_ratio(model.train_function, plain_fn, x, y,
                                                variables)
    except Exception as e:  # reported in the table: what a user trying it would meet
        text = re.sub(r"\x1b\[[0-9;]*m", "", " ".join(str(e).split()))  # Keras's bold
        row["error"] = f"{type(e).__name__}: {text}"[:220]
        return row
    row.update(peak=m["step_peak_bytes"], seconds=m["seconds"])
    return row


def _paired_ratio(fn, reference, x, y, variables, rounds=15):
    """Median over rounds of ``fn``'s step time over ``reference``'s, the two run in turns
    (which first alternates), the variables restored after: a ratio that the machine's load
    moves far less than two separate medians."""
    import numpy as np

    from tf_remat.extract import block, restore_variables, snapshot_variables

    saved = snapshot_variables(variables)
    ratios = []
    try:
        for r in range(rounds + 2):
            times = {}
            for f in ((fn, reference) if r % 2 else (reference, fn)):
                t = time.perf_counter()
                block(f(iter([(x, y, None)])))
                times[f] = time.perf_counter() - t
            if r >= 2:  # the first two rounds warm both up
                ratios.append(times[fn] / times[reference])
    finally:
        restore_variables(variables, saved)
    return float(np.median(ratios))


# ---------------------------------------------------------------------- table
def _mib(b):
    return f"{b / MIB:.1f}"


def _label(mode: str) -> str:
    eager = mode.startswith("eager ")
    mode = mode[len("eager "):] if eager else mode
    text = "plain" if mode == "none" else f'RematScope("{mode.rstrip("*")}")'
    if mode.endswith("*"):
        text += ", BatchNorm and Dropout outside it"
    return text + (", run_eagerly=True" if eager else "")


def table(rows: list) -> str:
    out = ["| model | configuration | peak MiB | vs plain | step ms | vs plain | note |",
           "|---|---|---|---|---|---|---|"]
    plain = {r["model"]: r for r in rows if r["mode"] is None and r["budget"] is None}
    for r in rows:
        p = plain.get(r["model"], {})
        if r["budget"] is not None:
            conf = f"tf-remat at {_mib(r['budget'])} MiB ({r['target']})"
        elif r["mode"]:
            conf = _label(r["mode"])
        else:
            conf = "plain"
        if "error" in r:
            out.append(f"| {r['model']} | {conf} | | | | | fails: {r['error']} |")
            continue
        vs_peak = f"{r['peak'] / p['peak']:.2f}" if "peak" in p else ""
        vs_time = f"{r['seconds'] / p['seconds']:.2f}" if "seconds" in p else ""
        if "paired_ratio" in r:
            vs_time = f"{r['paired_ratio']:.2f} (paired)"
        note = ""
        if len(r.get("peaks", ())) > 1:
            note = (f"median of {len(r['peaks'])} processes; peaks "
                    f"{_mib(r['peaks'][0])}-{_mib(r['peaks'][-1])} MiB")
        if r["budget"] is not None:
            note = (f"predicted overhead {100 * r['predicted_overhead']:.1f}%; "
                    f"peak / budget {r['peak'] / r['budget']:.2f}; "
                    f"optimize {r['optimize_seconds']:.0f} s; simulated without "
                    f"recomputation {_mib(r['traced_plain'])} MiB")
        out.append(f"| {r['model']} | {conf} | {_mib(r['peak'])} | {vs_peak} | "
                   f"{1000 * r['seconds']:.1f} | {vs_time} | {note} |")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--time-limit", type=float, default=20.0)
    p.add_argument("--processes", type=int, default=3,
                   help="fresh processes per plain or RematScope row (the median counts)")
    p.add_argument("-o", "--output", default=os.path.join(ROOT, "benchmarks", "results",
                                                          "keras_remat.md"))
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # child process
    args = p.parse_args(argv)
    if args.case:
        print("RESULT " + json.dumps(run_case(*json.loads(args.case), args.time_limit)),
              flush=True)
        return 0

    def child(name, mode=None, budget=None, target=None):
        t0 = time.perf_counter()
        cmd = [sys.executable, os.path.abspath(__file__), "--case",
               json.dumps([name, mode, budget]), "--time-limit", str(args.time_limit)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        res = next((json.loads(line[7:]) for line in proc.stdout.splitlines()
                    if line.startswith("RESULT ")), None)
        if res is None:
            res = {"model": name, "mode": mode, "budget": budget,
                   "error": f"exit code {proc.returncode}"}
        res["target"] = target
        print(f"{name} {mode or ''} {budget or ''}: done in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr, flush=True)
        return res

    def repeated(name, mode=None):
        """The median of ``args.processes`` fresh processes: Keras's plain step measured
        50.2, 56.2 and 60.5 MiB in three (convnet), so one process is a poor denominator."""
        runs = [child(name, mode)]
        if "error" in runs[0]:
            return runs[0]
        runs += [child(name, mode) for _ in range(args.processes - 1)]
        runs = [r for r in runs if "peak" in r]
        res = dict(runs[0])
        res["peak"] = int(statistics.median(r["peak"] for r in runs))
        res["seconds"] = statistics.median(r["seconds"] for r in runs)
        res["peaks"] = sorted(r["peak"] for r in runs)
        return res

    rows = []
    for name in args.models:
        plain = repeated(name)
        rows.append(plain)
        scoped = [repeated(name, mode) for mode in MODES
                  if name in TRAINING_LAYERS or not mode.endswith("*")]
        rows += scoped
        if "peak" not in plain:
            continue
        # the same memory as each RematScope mode that saved any, then a budget none reaches
        targets = {}
        for r in scoped:
            if "peak" in r and r["peak"] < 0.98 * plain["peak"]:
                targets.setdefault(r["peak"], []).append(f"{_label(r['mode'])}: its peak")
        targets.setdefault(int(FRACTION * plain["peak"]), []).append(
            f"{FRACTION:.0%} of plain")
        for budget in sorted(targets, reverse=True):
            rows.append(child(name, None, int(budget), "; ".join(targets[budget])))

    import tensorflow as tf

    from tf_remat.extract import onednn_enabled

    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
               f"oneDNN {'on' if onednn_enabled() else 'off'}; Python "
               f"{platform.python_version()}, TensorFlow {tf.__version__}, Keras "
               f"{__import__('keras').__version__}")
    text = table(rows)
    doc = ["# Keras's own rematerialization against tf-remat", "",
           f"Machine: {machine}. Generated by `tools/bench_keras_remat.py` (`optimize` with "
           f"`auto`, time limit {args.time_limit:g} s). Peaks are the whole step's "
           f"(weights, optimizer slots, batch, activations), the worst of {RUNS} runs in one "
           f"process; times are medians of those runs. Plain and RematScope rows are the "
           f"medians of {args.processes} such processes, and a tf-remat row's *vs plain* is the "
           "median ratio of its step to Keras's plain one run in turns in its process "
           "(\"paired\").", "", text, ""]
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        f.write("\n".join(doc))
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
