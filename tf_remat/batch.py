"""Largest batch size whose training step fits a memory budget, plain and rematerialized.

A user's ``build(batch_size)`` returns ``(compiled_model, input_spec, label_spec)``. For each
candidate batch size the plain step (checkpoint all) and the rewritten step are *run* and their
peak memory measured as TensorFlow counts it, in a fresh process when the builder can be loaded
there again; a size is reported only after such a run stayed within the budget less
``optimize``'s verification margin in each of its allocator layouts, plain and rewritten alike
(a rematerialized size in three runs, each solving anew: see ``confirm``).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import shutil
import tempfile
import time

from tf_remat._units import format_bytes

__all__ = ["MaxBatchResult", "max_batch_size", "memory_device"]


@dataclasses.dataclass
class MaxBatchResult:
    """``plain_batch`` / ``remat_batch``: largest sizes confirmed within ``budget_bytes``
    (0 if even the smallest tried does not fit); ``probes`` every measurement made;
    ``complete`` False when the search stopped at its ``deadline``, the sizes then being the
    largest confirmed by then: each fits, a larger one may too (``plain_complete``: the plain
    search had finished, so ``plain_batch`` is its answer)."""

    plain_batch: int
    remat_batch: int
    budget_bytes: int
    probes: list
    complete: bool = True
    plain_complete: bool = True

    @property
    def ratio(self) -> float | None:
        return self.remat_batch / self.plain_batch if self.plain_batch else None

    def to_dict(self) -> dict:
        return {"plain_batch": self.plain_batch, "remat_batch": self.remat_batch,
                "budget_bytes": self.budget_bytes, "complete": self.complete}


def memory_device() -> str:
    """'GPU:0' when TensorFlow sees a GPU, else 'CPU:0' (where TF's peak counters also work)."""
    import tensorflow as tf

    return "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"


def _plain_step(model, optimizer):
    """Keras's training step for a compiled model: its compiled loss (a loss per output and
    ``model.losses`` included, as ``train_step`` computes it), the gradients, the update; for
    a model whose class overrides ``train_step``, that (``step(x, ())`` without labels), as
    ``tf_remat.optimize`` plans it."""
    import tensorflow as tf

    from tf_remat.extract import overrides_train_step

    if overrides_train_step(model):
        return tf.function(lambda x, y: model.train_step((x, y) if y != () else x))

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            pred = model(x, training=True)
            loss = model.compute_loss(x=x, y=y, y_pred=pred, training=True)
            # a LossScaleOptimizer (mixed precision) unscales what apply_gradients gets
            scaled = optimizer.scale_loss(loss) if hasattr(optimizer, "scale_loss") else loss
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def _probe(build, batch, budget, *, remat, strategy, time_limit, verbose, cost_model,
           save_plan=None, margin=None):
    """Measured step peak at this batch (plain or rewritten), or None when no plan fits;
    whether the step sits at the budget's edge (within the budget, not within ``optimize``'s
    verification margin: see below); and, when no plan fits, the least any plan reached
    (``InfeasibleBudgetError.min_feasible``: measured when a plan measured over, else the
    solver's best), or None. ``margin``: ``optimize``'s (None: its default), for both steps.

    The figure is :func:`tf_remat.api.measure_step_peak`'s ``step_peak_bytes``: the step's own
    peak (its variables, optimizer slots, batch and temporaries), so memory the process still
    holds from earlier probes does not count against this one. The plain step's is the worst
    of ``optimize``'s verification layouts (over the budget, the first layout over it: the
    rest are not run); the rewritten step was verified in those by
    ``optimize``, and its figure is one more run.
    """
    import keras

    from tf_remat.api import measure_step_peak
    from tf_remat.errors import InfeasibleBudgetError, RematError
    from tf_remat.profile import synthetic_batch

    keras.backend.clear_session()
    gc.collect()
    model, input_spec, label_spec = build(batch)
    # no labels (a train_step that takes x alone): the steps take () for them
    x, y = synthetic_batch(input_spec, () if label_spec is None else label_spec)
    t0 = time.perf_counter()
    if remat:
        from tf_remat.api import optimize

        try:
            step = optimize(model, budget_bytes=budget, input_spec=input_spec,
                            label_spec=label_spec, strategy=strategy, time_limit=time_limit,
                            verbose=0, cost_model=cost_model, attach=False, _probe=True,
                            margin=margin,
                            # a probe asks whether the size fits, not what it costs: timing
                            # the static order traces and runs a plain Keras step beside it
                            time_order=False)
        except InfeasibleBudgetError as exc:
            return None, time.perf_counter() - t0, False, exc.min_feasible
        except RematError as exc:
            if verbose:
                print(f"  batch {batch}: {exc}")
            return None, time.perf_counter() - t0, False, None
        peak = step.measure(x, y)["step_peak_bytes"]
        if save_plan:
            step.plan.save(save_plan)
        # a size counts as fitting only when its step stayed within optimize's margin in every
        # layout it was verified in: a step that optimize kept only because nothing got
        # within the margin sits at the budget's edge, and another process's allocator
        # history puts it over (the size is then reported as one it cannot keep)
        edge = not step.report.get("margin_met", True)
    else:
        from tf_remat.api import _MEASURE_RUNS, verification_layouts, verification_margin

        opt = model.optimizer
        opt.build(model.trainable_variables)
        step = _plain_step(model, opt)
        variables = [getattr(v, "value", v) for v in list(model.variables) + list(opt.variables)
                     + list(model.metrics_variables)]
        # held to what a rewritten size is held to: the worst of optimize's verification
        # layouts, within its margin. Once measured in one layout against the budget alone,
        # a plain size could count where a plan at the same peak could not (fcn8 and vgg16,
        # whose fixed memory is 95-96% of the budget, tied on that), and the margin stands
        # for allocation histories a plain step meets as much as a rewritten one
        largest = _largest_value(step, x, y)
        # a layout over the budget settles it: the rest are not run (each layout is three
        # steps, and a size too large is measured only until it is seen not to fit)
        peak = measure_step_peak(step, x, y, variables=variables, runs=_MEASURE_RUNS,
                                 ballast=verification_layouts(largest),
                                 stop_above=budget)["step_peak_bytes"]
        if margin is None:
            margin = verification_margin(budget, largest)
        edge = budget * (1 - margin) < peak <= budget
    return peak, time.perf_counter() - t0, edge, None


def _largest_value(step, x, y) -> int:
    """Bytes of the largest tensor the traced ``step(x, y)`` computes (a weight's gradient
    included): what :func:`tf_remat.api.verification_margin` and the verification layouts
    scale with, from the step's own graph, without tracing it for a solver."""
    from tf_remat.extract import tensor_bytes

    graph = step.get_concrete_function(x, y).graph
    return max((tensor_bytes(out) for op in graph.get_operations() for out in op.outputs),
               default=0)


#: the child that runs one probe in a fresh process (see ``_probe_isolated``)
_CHILD = """
import json, sys
from tf_remat.batch import _probe
from tf_remat.training import load_builder
a = json.loads(sys.argv[1])
if a.pop("reserve", None):
    from tf_remat.api import reserve_memory
    from tf_remat.errors import RematError
    try:
        reserve_memory(budget_bytes=a["budget"])
    except RematError as exc:
        print("tf-remat-probe-error " + str(exc), flush=True)
        sys.exit(3)
build = load_builder(a["model"], a["module"], input_size=a["input_size"],
                     num_classes=a["num_classes"])
result = _probe(build, a["batch"], a["budget"], remat=a["remat"], strategy=a["strategy"],
                time_limit=a["time_limit"], verbose=a["verbose"],
                cost_model=a["cost_model"], save_plan=a.get("save_plan"),
                margin=a.get("margin"))
print("tf-remat-probe " + json.dumps(list(result)), flush=True)
"""


#: what a probe's process prints when it ran out of memory
_OOM_ERRORS = ("ResourceExhaustedError", "MemoryError")  # MemoryError: OutOfMemoryError too


class _DeadlineReached(Exception):
    """The search's ``deadline`` passed before a probe began, or while one ran in its process."""


def _probe_isolated(spec: dict, batch, budget, reserve=False, timeout=None, **kw):
    """:func:`_probe` in a fresh Python process: what a user's own process would measure;
    ``reserve``: the process calls :func:`tf_remat.reserve_memory` with the budget first;
    ``timeout``: seconds before the process is killed and :class:`_DeadlineReached` raised.

    Within one process the allocator keeps every region it grew, so the search's earlier
    probes change what later ones measure: TensorFlow's BFC allocator hands a request a whole
    free chunk of up to twice its size and counts all of it, and which requests meet such
    chunks depends on the regions there are. A residual CNN at 4.5 MiB activations and a
    30.7 MiB budget: one plan measured 26.7 MiB in the search's process and 32-37 MiB in fresh
    ones, and the same plan measures within a few percent in every fresh process.
    """
    import json
    import subprocess
    import sys

    from tf_remat.errors import RematError

    args = dict(spec, batch=int(batch), budget=int(budget), reserve=bool(reserve), **kw)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(args)],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:  # run() has killed the probe's process
        raise _DeadlineReached() from None
    lines = proc.stdout.splitlines()
    for line in reversed(lines):
        if line.startswith("tf-remat-probe "):
            if kw.get("verbose"):
                for ln in lines:
                    if not ln.startswith("tf-remat-probe "):
                        print(ln)
            return tuple(json.loads(line[len("tf-remat-probe "):]))
        if line.startswith("tf-remat-probe-error "):  # not the size: the search cannot go on
            raise RematError(f"the probe at batch {batch} failed in its process: "
                             f"{line[len('tf-remat-probe-error '):]}")
    # out of memory in its own process (TensorFlow's error, or killed by the system): the size
    # does not fit, and the search goes on, where in a shared process it would have ended
    if proc.returncode < 0 or any(e in proc.stderr for e in _OOM_ERRORS):
        return None, time.perf_counter() - t0, False, None
    tail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    raise RematError(f"the probe at batch {batch} ({'remat' if kw.get('remat') else 'plain'}) "
                     f"failed in its process: {tail}")


def max_batch_size(build, budget_gb: float | None = None, *, budget_bytes: int | None = None,
                   strategy: str = "auto", time_limit: float = 30.0, start: int = 1,
                   max_batch: int = 4096, cost_model: str = "flops",
                   verbose: int = 1, isolate: bool | None = None,
                   confirm: int = 2, save_plan: str | None = None,
                   reserve: bool = False, deadline: float | None = None,
                   confirm_each: bool | None = None,
                   margin: float | None = None) -> MaxBatchResult:
    """Largest batch sizes that train within the budget, plain and with rematerialization.

    Args:
        build: ``build(batch_size) -> (compiled_model, input_spec, label_spec)``.
        budget_gb: the budget in GiB (2**30 bytes), or give ``budget_bytes``.
        strategy, time_limit: passed to :func:`tf_remat.optimize` for each probe.
        start: the first batch size tried; doubled until a size fails, then bisected.
        max_batch: stop growing here.
        cost_model: op costs for the solver, ``"flops"`` (default: every batch size has new
            shapes, and profiling each would dominate the search; costs only steer which
            values are recomputed, never whether a size fits) or ``"profile"``.
        isolate: run each probe in a fresh Python process, as a user's training process starts
            (see :func:`_probe_isolated`). Needs a ``build`` from
            :func:`tf_remat.training.load_builder` (a zoo name or ``file.py:function``, as the
            command line gives), which a fresh process can load again; the default is True for
            such a ``build`` and False for any other callable, whose probes share this process.
        confirm: probes the rematerialized size must also pass, each solving anew, before it
            is reported; a size that fails one is dropped, and smaller sizes are tried (1, 2,
            4, ... below it, then bisected), each passing ``1 + confirm`` solves. The solver does
            not give the same plan twice, and near the largest size whether a plan fits is
            decided by which allocator chunks its tensors meet: one lucky plan is not a size a
            user's own ``optimize`` call can count on. 0: the search's probe alone.
        save_plan: write the plan of the last probe that fitted at the reported
            rematerialized size here (JSON), for ``optimize(..., plan=)`` or ``train.py
            --plan``: that plan measured within the budget, and measures within a few percent
            of that again.
            Nothing is written when rematerialization found no size above the plain one.
        reserve: probe as a process that calls :func:`tf_remat.reserve_memory` with the
            budget at its start: each probe's process does so before it builds the model
            (without ``isolate``, this process, now). On the CPU that can move the sizes
            either way (see ``reserve_memory``); a user who reserves in training should
            search so too.
        deadline: seconds for the whole search. When it passes, no further probe starts (an
            isolated probe under way is stopped; one in this process finishes first) and the
            result, marked ``complete=False``, holds the largest sizes confirmed by then (a
            rematerialized size that passed its ``1 + confirm`` probes, else the plain size):
            sizes that fit, where a larger one may too. A search near the budget's floor can
            run long (ResNet50 at 64x64 on a CPU: over 30 min, each probe about 100 s, its
            plans a few allocator chunks either side of the budget).
        confirm_each: confirm each rematerialized size as the search meets it (its
            ``1 + confirm`` probes before the next size), instead of the largest alone at the
            end. Costs ``confirm`` more probes for each size that passes, but a search stopped
            by its deadline then reports the largest size it had passed rather than the plain
            one (without it, ResNet50 and vgg16 on a CPU stopped at their plain sizes, with a
            size three times that one probe into its three). The default, None: on with a
            ``deadline``, else off.
        margin: the verification margin every probe is held to (``optimize``'s ``margin``;
            None: its default): search with the margin the training run will use.

    Returns:
        :class:`MaxBatchResult`; both sizes were confirmed by a measured run within the budget
        less the verification margin of :func:`tf_remat.optimize` in each of its allocator
        layouts (a rewritten step in ``1 + confirm`` separate solves), each in a fresh process
        when ``isolate``. A probe within the budget but not the margin is ``at_edge`` in
        ``probes`` and does not count.

    Example:
        >>> r = tf_remat.max_batch_size(build, budget_gb=1.0)   # doctest: +SKIP
        >>> r.plain_batch, r.remat_batch
        (24, 64)
    """
    if (budget_gb is None) == (budget_bytes is None):
        raise ValueError("give exactly one of budget_gb or budget_bytes")
    budget = int(budget_bytes if budget_bytes is not None else budget_gb * 2**30)
    if budget <= 0:
        raise ValueError(f"the budget must be positive, got {budget} bytes")
    if confirm < 0:
        raise ValueError(f"confirm must be >= 0, got {confirm}")
    if deadline is not None and not deadline > 0:
        raise ValueError(f"deadline must be a positive number of seconds, got {deadline}")
    if margin is not None and not 0 <= margin < 1:
        raise ValueError(f"margin must be a fraction of the budget in [0, 1), got {margin!r}")
    if confirm_each is None:
        confirm_each = deadline is not None
    t_start = time.perf_counter()
    from tf_remat.solvers import check_time_limit

    check_time_limit(time_limit)  # once here, not in every probe after its trace
    probes = []
    from tf_remat._progress import bar

    progress = bar(None, "max-batch", verbose)

    spec = getattr(build, "builder_spec", None)
    if isolate is None:
        isolate = spec is not None
    if isolate and spec is None:
        raise ValueError("isolate=True needs a build from tf_remat.training.load_builder (a zoo "
                         "name or 'file.py:function') that a fresh process can load")

    if reserve and not isolate:
        from tf_remat.api import reserve_memory

        reserve_memory(budget_bytes=budget)  # it warns when the pool has grown already
    plans_dir = tempfile.mkdtemp(prefix="tf_remat_max_batch_") if save_plan else None
    fitted = {}  # batch -> the plan file of the last remat probe that fitted at it

    def fits(batch, remat, check=False):
        kw = dict(remat=remat, strategy=strategy, time_limit=time_limit, verbose=verbose,
                  cost_model=cost_model, margin=margin)
        if plans_dir and remat:
            kw["save_plan"] = os.path.join(plans_dir, f"probe{len(probes)}.json")
        left = None if deadline is None else deadline - (time.perf_counter() - t_start)
        if left is not None and left <= 0:
            raise _DeadlineReached()
        if isolate:
            peak, secs, edge, reach = _probe_isolated(spec, batch, budget, reserve=reserve,
                                                      timeout=left, **kw)
        else:
            peak, secs, edge, reach = _probe(build, batch, budget, **kw)
        ok = peak is not None and peak <= budget and not edge
        probes.append({"batch": batch, "remat": remat, "peak_bytes": peak, "fits": ok,
                       "at_edge": edge, "confirm": check, "seconds": round(secs, 2),
                       "reach_bytes": reach})
        if ok and kw.get("save_plan"):
            fitted[batch] = kw["save_plan"]
        if peak is not None:
            outcome = (f"peak {format_bytes(peak)} "
                       + ("fits" if ok else "at the budget's edge" if edge else "over"))
        elif not remat:
            outcome = "out of memory"
        else:  # how far off the size was: a few percent over the budget, or far over it
            outcome = "no plan" + (f" (the least reached {format_bytes(reach)})" if reach
                                   else "")
        progress.update(f"{'remat' if remat else 'plain'} batch {batch}"
                        f"{' (confirm)' if check else ''}: {outcome}")
        return ok

    complete, plain = True, None
    try:
        plain = _search(lambda b: fits(b, False), start, max_batch)
        # only sizes above the plain one are searched: the plain size fits as it is, and a
        # rewritten step probed there first (as this search once did) can measure over the
        # budget for its own allocator luck; the search then fell back to galloping up from 1
        # and reported the plain size alone (benchmarks/results/max_batch.md)
        if confirm_each:
            # all() stops at a size's first failed probe, as _confirmed's trials do
            remat = _search(lambda b: all(fits(b, True, check=i > 0) for i in range(1 + confirm)),
                            start, max_batch, floor=plain)
        else:
            remat = _search(lambda b: fits(b, True), start, max_batch, floor=plain)
            searched = {p["batch"] for p in probes if p["remat"] and p["fits"]}
            remat = _confirmed(lambda b: fits(b, True, check=True), remat, plain, confirm,
                               searched)
    except _DeadlineReached:
        complete, plain_complete = False, plain is not None
        so_far, remat = _confirmed_so_far(probes, 1 + confirm)
        plain = so_far if plain is None else plain
    else:
        plain_complete = True
    remat = max(remat, plain)
    progress.close()
    if not complete and verbose:
        print(f"the search stopped at its deadline ({deadline:g} s) after {len(probes)} "
              f"probes: the sizes below are the largest confirmed by then")
        # a size part way through its probes is no answer, but shows where the search got
        # to (ResNet50 on a CPU without oneDNN: 18 had passed one of three at the deadline)
        runs = _remat_runs(probes)
        part = max((b for b, r in runs.items() if b > remat and all(r)), default=None)
        if part is not None:
            print(f"rematerialized batch {part} passed {len(runs[part])} of the "
                  f"{1 + confirm} probes a size needs, and none failed")
    if plans_dir:
        if remat in fitted:
            shutil.copyfile(fitted[remat], save_plan)
            if verbose:
                print(f"wrote the plan for batch {remat} to {save_plan}")
        elif verbose:
            print(f"no plan written: rematerialization found no size above the plain "
                  f"{plain}{'' if complete else ' before the deadline'}")
        shutil.rmtree(plans_dir, ignore_errors=True)
    result = MaxBatchResult(plain, remat, budget, probes, complete, plain_complete)
    if verbose:
        ratio = f"{result.ratio:.2f}x" if result.ratio else "n/a"
        least = "" if complete else "at least "
        print(f"budget {format_bytes(budget)}: plain batch "
              f"{'' if plain_complete else least}{plain}, with rematerialization "
              f"{least}{remat} ({ratio})")
    return result


def _confirmed_so_far(probes, times) -> tuple[int, int]:
    """The plain and rematerialized sizes a search stopped part way can report: the largest
    plain size that fitted (one probe is all a plain size gets), and the largest
    rematerialized size that passed ``times`` probes and failed none (0 where none did)."""
    plain = max((p["batch"] for p in probes if not p["remat"] and p["fits"]), default=0)
    remat = max((b for b, r in _remat_runs(probes).items() if len(r) >= times and all(r)),
                default=0)
    return plain, remat


def _remat_runs(probes) -> dict:
    """batch -> whether each rematerialized probe at it fitted, in order."""
    runs = {}
    for p in probes:
        if p["remat"]:
            runs.setdefault(p["batch"], []).append(p["fits"])
    return runs


def _confirmed(fits, found, floor, times, passed=()) -> int:
    """Largest b in (floor, found] whose probes all pass; else ``floor``.

    ``found`` (and every size in ``passed``) already passed the search's probe, so it needs
    ``times`` more; any other size needs ``1 + times``, so every reported size passed the same
    number of solves. A size's trials stop at its first failure. After ``found`` fails, the
    sizes tried gallop down (1, 2, 4, ... below it) to the first that passes, then bisect
    between it and the smallest that failed: a failure is a full ``optimize`` that solves up to
    nine times, and stepping down one size per failure cost the transformer more than 20 min.
    The floor (the plain size) needs no solve.
    """
    passed = set(passed) | {found}

    def ok(b):
        return all(fits(b) for _ in range(times if b in passed else 1 + times))

    if found <= floor:
        return floor
    if ok(found):
        return found
    bad, step, good = found, 1, floor
    while found - step > floor:
        if ok(found - step):
            good = found - step
            break
        bad = found - step
        step *= 2
    return _bisect(ok, good, bad)


def _bisect(fits, lo, hi) -> int:
    """Largest b in [lo, hi) with fits(b), given that lo fits and hi does not."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _search(fits, start, limit, floor=0) -> int:
    """Largest b in [1, limit] with fits(b), assuming monotone; doubling then bisection.

    With ``floor`` > 0, a size known to fit without a probe: the sizes tried start at twice
    it (or at ``start``, if larger), and the result is at least ``floor``.
    """
    if floor >= limit:
        return floor
    lo, hi = floor, None
    b = min(max(start, 2 * floor) if floor else start, limit)
    while True:
        if fits(b):
            lo = b
            if b >= limit:
                break
            # the limit itself is the last size tried: doubling past it would leave the sizes
            # between the last fit and the limit unsearched
            b = min(2 * b, limit)
        else:
            hi = b
            break
    if lo == 0:
        if start == 1:
            return 0
        return _search(fits, 1, min(start, limit) - 1)
    if hi is None:
        return lo
    return _bisect(fits, lo, hi)
