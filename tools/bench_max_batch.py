#!/usr/bin/env python
"""Largest trainable batch per zoo model, plain vs rematerialized; writes max_batch.md.

For each model the budget less ``optimize``'s verification margin is the measured peak of the
plain training step at a reference batch size ``b0`` (so the plain search lands at about
``b0``); then :func:`tf_remat.max_batch_size` searches both sizes, every reported size
confirmed by measured runs of the step within the budget less that margin. Each model runs in
its own process, so memory left over by one cannot count against the next. Memory is
TensorFlow's allocator count on the device used (CPU here unless a GPU is seen).

    python tools/bench_max_batch.py [--models bn_cnn resnet50 ...] [--strategy S]
        [--time-limit S] [--budget-mib M] [--reserve] [-o benchmarks/results/max_batch.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# name, input size, reference batch b0, largest batch tried
MODELS = [
    ("bn_cnn", "32", 16, 256),
    ("transformer", "64", 8, 128),
    ("mobilenet", "64", 8, 128),
    ("resnet50", "64", 4, 64),
    ("vgg16", "64", 4, 64),
    ("unet", "64", 2, 32),
    ("segnet", "64", 2, 32),
    ("fcn8", "64", 2, 32),
    ("vgg19", "64", 4, 64),
]

CHILD = r"""
import json, sys, time
from tf_remat.batch import _probe, max_batch_size, memory_device
from tf_remat.training import load_builder
t = time.perf_counter()
name, size, b0, top, strategy, limit, budget, reserve, deadline = sys.argv[1:10]
b0, top, limit, budget = int(b0), int(top), float(limit), int(budget)
build = load_builder(name, input_size=size)
# the largest of three measurements (one step's peak moves by up to ~25% run to run), plus 2%,
# as the budget less optimize's verification margin (the plain probes are held to it too), so
# that the plain search's own measurement at b0 fits and the plain batch is not understated
ref = budget
if not ref:
    from tf_remat.api import verification_budget
    from tf_remat.batch import _largest_value, _plain_step
    from tf_remat.profile import synthetic_batch
    peak = 1.02 * max(_probe(build, b0, 1 << 62, remat=False, strategy=strategy,
                             time_limit=limit, verbose=0, cost_model="flops")[0]
                      for _ in range(3))
    model, ispec, lspec = build(b0)
    model.optimizer.build(model.trainable_variables)
    x, y = synthetic_batch(ispec, () if lspec is None else lspec)
    big = _largest_value(_plain_step(model, model.optimizer), x, y)
    del model, x, y
    ref = verification_budget(int(peak), big)
# what is left of the model's time once the budget is measured: a search stopped there
# reports the sizes it confirmed, where a search killed at the limit reported none
r = max_batch_size(build, budget_bytes=ref, strategy=strategy, time_limit=limit, start=b0,
                   max_batch=top, verbose=1, reserve=reserve == "1",
                   deadline=max(1.0, float(deadline) - (time.perf_counter() - t)))
print(json.dumps({"model": name, "input": size, "b0": b0, "budget": ref,
                  "plain": r.plain_batch, "remat": r.remat_batch, "probes": len(r.probes),
                  "complete": r.complete, "plain_complete": r.plain_complete,
                  "trail": [[p["batch"], p["remat"], p["fits"], p["confirm"], p["seconds"]]
                            for p in r.probes],
                  "seconds": time.perf_counter() - t, "device": memory_device()}))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", help="default: " + " ".join(m[0] for m in MODELS))
    ap.add_argument("--strategy", default="auto")
    ap.add_argument("--time-limit", type=float, default=20.0, help="seconds per solve")
    ap.add_argument("--model-timeout", type=float, default=1200.0,
                    help="seconds for one model's whole search: the search stops there and "
                         "reports the sizes it confirmed by then, marked >=")
    ap.add_argument("--budget-mib", type=float, default=None,
                    help="this budget for every model, not one measured at b0 (to compare "
                         "runs at one budget)")
    ap.add_argument("--reserve", action="store_true",
                    help="each probe's process calls tf_remat.reserve_memory with the budget "
                         "first (max-batch --reserve)")
    ap.add_argument("-o", "--output", default=os.path.join(ROOT, "benchmarks", "results",
                                                           "max_batch.md"))
    args = ap.parse_args(argv)
    wanted = [m for m in MODELS if not args.models or m[0] in args.models]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TF_CPP_MIN_LOG_LEVEL="2")
    rows = []
    for name, size, b0, top in wanted:
        cmd = [sys.executable, "-c", CHILD, name, size, str(b0), str(top), args.strategy,
               str(args.time_limit), str(int((args.budget_mib or 0) * 2**20)),
               "1" if args.reserve else "0",
               # the search's own deadline, a minute inside the limit: the child's start
               # (importing TensorFlow) and the probe stopped at the deadline take that
               str(args.model_timeout - 60)]
        t = time.perf_counter()
        # a session of its own: at the limit the probe's process it started goes too, not
        # only the search's (an orphaned probe would measure on beside the next model)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env, start_new_session=True)
        try:  # the limit is a backstop: the search stops itself a minute inside it
            out, err = proc.communicate(timeout=args.model_timeout + 120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            row = {"model": name, "input": size, "b0": b0, "seconds": time.perf_counter() - t,
                   "error": f"search not finished in {args.model_timeout:g} s",
                   "progress": _progress(err)}
        except BaseException:  # Ctrl-C: its own session does not see the terminal's signal
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        else:
            row = _row(proc.returncode, out, err, name, size, b0, time.perf_counter() - t)
        rows.append(row)
        print(_line(row), flush=True)
        # written after every model: a long run stopped part way keeps what it measured
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            f.write(_markdown(rows, args))
    print(f"wrote {args.output}")
    return 0


def _row(returncode, stdout, stderr, name, size, b0, seconds):
    """The child's JSON line, or an error row with its last stderr line."""
    if returncode != 0:
        lines = stderr.strip().splitlines() or ["?"]
        # the error, not the last warning TensorFlow printed
        errors = [line for line in lines if re.match(r"\s*[\w.]*(Error|Exception)\b", line)]
        err = (errors or lines)[-1].strip()[:160]
        if returncode < 0:
            err = f"killed by signal {-returncode}; last line: {err}"
        return {"model": name, "input": size, "b0": b0, "error": err, "seconds": seconds}
    return json.loads(stdout.strip().splitlines()[-1])


def _progress(stderr):
    """The probes a search had finished, from its progress lines (``max-batch N  T s ...``):
    what a search stopped by the time limit leaves to report."""
    lines = (re.match(r"max-batch \d+\s+([\d.]+)s (.*)", ln) for ln in (stderr or "").splitlines())
    return [f"{m[2]} (at {float(m[1]):.0f} s)" for m in lines if m]


def _mib(b):
    return f"{b / 2**20:.1f}"


def _line(r):
    if "error" in r:
        return "\n  ".join([f"{r['model']}: error {r['error']}"] + r.get("progress", []))
    ratio = r["remat"] / r["plain"] if r["plain"] else float("nan")
    least = "" if r.get("complete", True) else "at least "
    plain = ("" if r.get("plain_complete", True) else least) + str(r["plain"])
    return (f"{r['model']} {r['input']}: budget {_mib(r['budget'])} MiB, plain {plain}, "
            f"remat {least}{r['remat']} ({ratio:.2f}x), {r['probes']} probes, "
            f"{r['seconds']:.0f} s" + ("" if least == "" else ", stopped at the deadline"))


def _trail(trail):
    def one(t):
        batch, remat, fits, confirm = t[:4]
        secs = f" ({t[4]:.0f} s)" if len(t) > 4 else ""
        return f"{batch}{'c' if confirm else ''}{'+' if fits else '-'}{secs}"

    plain = " ".join(one(t) for t in trail if not t[1])
    remat = " ".join(one(t) for t in trail if t[1])
    return f"plain {plain}; remat {remat}"


def _markdown(rows, args):
    out = ["# Largest batch within a memory budget: plain step vs rematerialized", "",
           f"`python tools/bench_max_batch.py --strategy {args.strategy} --time-limit "
           f"{args.time_limit:g}"
           + (f" --budget-mib {args.budget_mib:g}" if args.budget_mib else "")
           + (" --reserve" if args.reserve else "")
           + f"` on {platform.machine()}, {os.cpu_count()} cores "
           f"(shared with other jobs while it ran; sizes are memory facts, not timings).", "",
           ("Budget: given. " if args.budget_mib else "Budget: the budget less "
            "`optimize`'s verification margin is 1.02x the largest of three measured peaks "
            "of the plain step at batch b0. ")
           + "Every size below was confirmed by running the step and reading TensorFlow's "
           "allocator peak (`get_memory_info`) within the budget less that margin, in each "
           "of `optimize`'s allocator layouts. Costs for the solver: `flops`.", "",
           "| model | input | b0 | budget MiB | plain batch | remat batch | ratio | probes "
           "| search s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['input']} | {r['b0']} | - | - | - | - | - | "
                       f"{r['seconds']:.0f} (error: {r['error']}) |")
            continue
        ratio = f"{r['remat'] / r['plain']:.2f}x" if r["plain"] else "-"
        least = "" if r.get("complete", True) else ">="
        plain = ("" if r.get("plain_complete", True) else least) + str(r["plain"])
        out.append(f"| {r['model']} | {r['input']} | {r['b0']} | {_mib(r['budget'])} | "
                   f"{plain} | {least}{r['remat']} | {ratio} | {r['probes']} | "
                   f"{r['seconds']:.0f} |")
    devices = {r["device"] for r in rows if "device" in r} or {"?"}
    out += ["", "Device: " + ", ".join(sorted(devices)) + ".", ""]
    if not all(r.get("complete", True) for r in rows):
        out += [f">= n: the search stopped at its deadline ({args.model_timeout - 60:g} s, a "
                "minute inside `--model-timeout`) with n the largest size that passed all its "
                "probes by then; a larger size may fit too.", ""]
    for r in rows:
        if r.get("progress"):
            out += [f"{r['model']}, the probes finished before the limit:", ""]
            out += [f"* {p}" for p in r["progress"]] + [""]
    trails = [r for r in rows if r.get("trail")]
    if trails:
        out += ["Probes in order (+ fits, - does not; c: a confirmation; each probe's seconds):",
                ""]
        out += [f"* {r['model']}: {_trail(r['trail'])}" for r in trails]
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
