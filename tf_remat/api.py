"""``tf_remat.optimize``: a Keras model and a memory budget in, a rematerialized training step out.

Pipeline: :func:`tf_remat.extract.extract` (trace + cost the step) ->
:func:`tf_remat.solvers.solve` (a plan within the budget, checked by the simulator) ->
:func:`tf_remat.rewrite.rewrite` (a static step that runs the plan) -> a measured check: the
step is run once on synthetic data (the model's variables are saved before and restored after)
and, when TensorFlow's measured peak is over the budget, the plan is solved again with the budget
lowered by the measured excess. The simulator counts the bytes the step's kernels request
(``tools/bench_spread.py`` checks this against TensorFlow's profiler); the allocator hands out
whole free chunks up to twice a request, so the measured peak of the same step is above that,
by an amount that changes with what was allocated before.

After ``optimize``, ``model.fit`` trains with the rewritten step (see :meth:`OptimizedStep.attach`).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from tf_remat._units import format_bytes
from tf_remat.errors import InfeasibleBudgetError, RematError, UnsupportedOpError, warn

__all__ = ["optimize", "measure_peak", "OptimizedStep", "detach", "measure_step_peak",
           "step_allocations", "solve_isolated"]

#: attempts at meeting the budget as measured (each solves again with a lower budget)
_MAX_ATTEMPTS = 6
#: ... and solves that found no plan within their budget (the search then bisects back up)
#: do not count, up to this many more solves in all: they measure nothing. On the max-batch
#: test's step three of the six went to them, which left three measured plans, all over the
#: budget, and optimize refused a budget where the next solve's plan measured well within it
#: (in 1 of 10 fresh runs at the budget, and 1 of 10 at 1.05 times it; budget_path.md)
_MAX_NO_PLAN = 3
#: re-solves share this many ``time_limit``s in all once a step within the budget exists;
#: before that, meeting the budget comes first and what they take is not counted (unet_bn at
#: 60%: a first plan over the budget, one whole-limit re-solve within it but not the margin,
#: and that re-solve had spent the share, so the step at 0.95 of its budget was kept untried
#: and measured 1.03 in a fresh process)
_RESOLVE_SHARE = 1.0
#: ... and each (once a step within the budget exists) gets at most this share of one: on
#: CPUs where the measured peak runs 20-30% over the simulated one (kernel scratch space in
#: whole allocator chunks), a step is found within the margin only after several measured
#: attempts, and a shorter solve costs little (the plan's overhead moves by a point or so)
#: while each attempt counts
_RESOLVE_LIMIT = 0.25
#: after a plan measured over the target, the plan that met it may sit far under it at a much
#: higher price (a BiLSTM model at 60%: a 2.5% plan measured 36% over its prediction, the
#: re-solve aimed as far under and its plan, at 137%, measured 0.73 of the budget): up to this
#: many solves aim back up between the two, while the plan met the target with this share of
#: the budget to spare and the plan over it was this many points of overhead cheaper
_MAX_REFINE = 2
_REFINE_ROOM = 0.03
_REFINE_GAIN = 0.05
#: verification aims this fraction under the budget; a plan within the budget but not the
#: margin is taken when no plan within the margin is found. Measured in allocation histories
#: verification never saw (after ``model.fit``, beside fragmented memory), held-out-style
#: models came out up to 5 points above their verified peak (``tools/bench_heldout.py``)
_MEASURE_MARGIN = 0.05
#: ... or half the graph's largest value, when that is more (at most _MAX_MARGIN): the BFC
#: allocator hands a request a whole free chunk of up to twice its size, so one large tensor
#: placed differently moves the peak by up to its own size; with activations of 16% of the
#: budget (the demo's bn_cnn), a step verified at 95% measured 100% in another history
_MEASURE_MARGIN_LARGEST = 0.5
_MAX_MARGIN = 0.15

#: measured runs of the rewritten step per allocator layout when verifying (the largest counts)
_MEASURE_RUNS = 2
#: verification measures the step beside a held "ballast" tensor of these fractions of the
#: graph's largest value, and counts the worst. TensorFlow's BFC allocator hands out a whole
#: free chunk when it is less than twice the request and counts the whole chunk as in use, so
#: the same step measures differently after different allocation histories (bn_cnn at batch
#: 128: +0% to +17% over the simulated peak for a plan, +2% to +22% for the plain step). Most
#: rewritten steps, chained in one order, measure the same peak run after run in one layout,
#: but not all (benchmarks/results/runs.md: resnet50's at batch 16, 40-55 MiB), and Keras's
#: plain step, whose independent ops the executor runs in any order, does not either (vgg16's
#: at batch 12, 196-231 MiB): the worst of _MEASURE_RUNS runs a layout is a sample
_MEASURE_BALLAST = (0.0, 0.6, 1.0)
#: and beside fragmented memory: tensors of these fractions allocated in turn and every other
#: one freed, which leaves free chunks of odd sizes between the held ones
_MEASURE_FRAGMENTS = (0.31, 0.07, 0.45, 0.12, 0.26, 0.05, 0.38, 0.19, 0.09, 0.48, 0.22, 0.15)

#: timed rounds of the plain step against the static order (``time_order``), each round both
#: steps in turn; fewer when they pass _ORDER_SECONDS (ResNet50 at batch 8 on 2 CPU cores takes
#: 1.5 s a step). With 5 rounds, three ``optimize`` calls on the transformer in one process
#: timed the same static order at +7.2%, +26.6% and +10.9% (the benchmark, +14.0%), so a small
#: step, whose rounds are cheap, gets up to 15. 60 were tried (rewrite.md): they steady the
#: median within one stretch of time (bn_cnn's blocks of 15 ranged +1.8% to +9.4%, medians of
#: 60 +3.0% to +3.2%), but the price moves between stretches: the transformer's static order
#: ran +23-26% over the plain step for most of a minute in one process, +9-10% in others; 60
#: rounds in three optimize calls said +22% where the benchmark's rounds after them saw +10%
_ORDER_ROUNDS = 15
_ORDER_MIN_ROUNDS = 3
_ORDER_WARMUP = 3
_ORDER_SECONDS = 20.0


def _closest(budget: int) -> int:
    """How close under a plan that measured over the target a re-solve may still aim: 0.5% of
    the budget, in whole bytes like the aims, so the midpoint between that plan's simulated
    peak and a failed aim 1% under it is still tried (as a float, rounding decided whether it
    was: on skip_cnn at batch 128, 611429 bytes under against 611429.12)."""
    return int(0.005 * budget)


def verification_margin(budget: int, largest: int) -> float:
    """The fraction of ``budget`` that ``optimize`` keeps free when it verifies a plan whose
    graph's largest value is ``largest`` bytes."""
    return min(_MAX_MARGIN, max(_MEASURE_MARGIN, _MEASURE_MARGIN_LARGEST * largest / budget))


def verification_budget(target: int, largest: int) -> int:
    """The budget whose verification target (the budget less :func:`verification_margin`) is
    ``target`` bytes, for a graph whose largest value is ``largest`` bytes: the margin's
    formula solved for the budget."""
    return int(max(target / (1 - _MEASURE_MARGIN),
                   min(target / (1 - _MAX_MARGIN), target + _MEASURE_MARGIN_LARGEST * largest)))


def verification_layouts(largest: int) -> list:
    """The ``ballast`` argument of :func:`measure_step_peak` with which ``optimize`` verifies a
    plan whose graph's largest value is ``largest`` bytes."""
    return ([int(f * largest) for f in _MEASURE_BALLAST] +
            [tuple(int(f * largest) for f in _MEASURE_FRAGMENTS)])


def optimize(model, budget_gb: float | None = None, *, budget_bytes: int | None = None,
             input_spec, label_spec, loss=None, optimizer=None, strategy="auto",
             time_limit: float | None = 60.0, verbose: int = 1, cost_model: str = "step",
             verify: bool = True, attach: bool = True, chain: str = "node",
             plan=None, time_order: bool = True,
             sample_weight_spec=None, train_step: bool | None = None,
             margin: float | None = None, _probe: bool = False) -> "OptimizedStep":
    """Rematerialize ``model``'s training step to fit ``budget_gb`` GiB of peak memory.

    Args:
        model: a Keras 3 model (TensorFlow backend); compiled, or pass ``loss`` and
            ``optimizer``.
        budget_gb: the budget in GiB (2**30 bytes, as GPU memory is quoted): the whole step's
            peak as TensorFlow counts it (weights, optimizer slots, the batch, activations).
        budget_bytes: the budget in bytes, instead of ``budget_gb``.
        input_spec, label_spec: ``tf.TensorSpec`` (or nests of them) with every dimension known,
            the batch size included. ``label_spec=None`` for a model whose own ``train_step``
            takes unlabeled batches (``fit(x)`` passes it ``x`` alone: an autoencoder, a GAN);
            the step is then called ``step(x)``.
        loss, optimizer: default: what ``model.compile`` set.
        strategy: a solver strategy name (``tf-remat strategies``) or callable.
        time_limit: seconds the solver may take for the first plan. When the measured check
            sends it back (nine solves at most, six of them measured; a solve that finds no
            plan within its budget measures nothing): until a step within the budget is found,
            each re-solve gets the whole limit; after, each gets a quarter of it, and these stop
            once they have spent one more ``time_limit`` in all. None: no limit.
        verbose: 0 silent; 1 progress and a summary line.
        cost_model: ``"step"`` (each node's share of the time in a profiler trace of the step run
            in a static order, on a CPU; on a GPU, or where the step cannot run, ``"profile"``'s
            costs), ``"profile"`` (each node's ops measured alone here, cached) or
            ``"flops"`` (an estimate; no measurement). See :func:`tf_remat.extract.extract`.
        verify: run the rewritten step (variables saved and restored) in four allocator
            layouts and re-solve with a lower budget while the worst measured peak is over the
            budget less a margin (:func:`verification_margin`).
        margin: the fraction of the budget verification keeps free, in place of
            :func:`verification_margin` (5%, or half the graph's largest value where that is
            more, at most 15%): a plan is accepted when its step measures within the budget
            less it, and solved again lower while none does. 0 accepts any step measured
            within the budget in all four layouts, often a cheaper plan, with no room for
            other allocation histories (after ``model.fit``, beside other tensors, the
            held-out models measured up to 5 points above their verified peak). Where the
            allocator's chunks put plan after plan just over the default's target, the plan
            kept can be far dearer than one within the budget (bn_cnn at 50% on a CPU: 108%
            predicted overhead with the default, 50% with none, whose step then measured
            0.994 of the budget; ``benchmarks/results/margin.md``). More than the default
            leaves room for what the process allocates besides.
        attach: make ``model.fit`` train with the rewritten step (undo with ``step.detach()``);
            a model never compiled is compiled with ``loss`` and ``optimizer`` for it.
        chain: how the plan's order is imposed (see :func:`tf_remat.rewrite.rewrite`).
        plan: a :class:`~tf_remat.plan.Plan`, or the path of one saved from ``step.plan``, for
            this model's step at this batch size: it is run instead of a first solve. The
            solver does not give the same plan twice, and a plan measures within a few percent
            in every fresh process (the allocator's layout differs), so reusing one that was
            verified repeats its peak to within that. It is checked against the traced step (same
            nodes, memory and edges, else ``PlanError``) and verified as a solved plan is, but
            kept when it measures within the budget (a run may have kept it as the best
            within the budget, not the margin); over the budget, ``optimize`` solves as it
            would without it (``report["plan_source"]`` says which plan runs, and
            ``report["given_plan_measured_bytes"]`` what the given one measured).
        time_order: time the plain step (as Keras runs it) against the graph run in a static
            order with nothing recomputed (3 to 15 paired rounds, no more after 20 s): running
            any static order costs time by itself, since TensorFlow no longer runs independent
            ops side by side, and the solver's costs do not see it. ``report["predicted_overhead"]``
            then counts it with the recomputation (see :class:`OptimizedStep`).
        sample_weight_spec: a ``tf.TensorSpec`` of per-sample weights (``(batch,)`` for
            ``model.fit(class_weight=...)``): the step solved here weighs the loss by them, as
            ``model.fit(sample_weight=...)`` does, so ``fit`` with weights trains with it (a
            call without weights runs it with weights of one, which weigh as none). Without
            it, the first step called with weights gets its own plan, solved then.
        train_step: trace the model's own ``train_step`` (True), the step ``model.fit`` runs
            with everything its override does (other losses, several tapes, its own metrics),
            or Keras's default step from ``model(x, training=True)``, ``compute_loss`` and the
            optimizer (False). None (the default): the model's own when its class overrides
            Keras's ``train_step``. With a ``train_step``, ``loss`` and ``optimizer`` must be
            None (it uses the compiled ones), ``step(x, y)`` returns its logs, and
            ``step.gradients`` is not available (the update is the step's own).

    Returns:
        An :class:`OptimizedStep`: ``step(x, y)`` runs one training step (optimizer update
        included) and returns the loss; ``step.gradients(x, y)``; ``step.report``,
        ``step.plan``, ``step.graph``.

    Raises:
        InfeasibleBudgetError: no plan fits the budget; the message (and ``min_feasible``)
            gives the smallest budget found reachable. The model is left as it was.
        UnsupportedOpError: a spec is not a ``tf.TensorSpec`` with every dimension known, the
            specs disagree on the batch size, the step cannot be traced with static shapes
            (the message names the tensor), there is no loss / optimizer, or the model was
            built under a ``tf.distribute`` strategy (the rewritten step is a one-device step),
            or Keras runs on another backend than TensorFlow.
        ValueError: a budget, ``time_limit`` or ``chain`` that is not valid.
        TypeError: ``model`` is not a Keras 3 ``keras.Model``.

    Example:
        >>> step = tf_remat.optimize(model, budget_gb=16,
        ...                          input_spec=tf.TensorSpec((32, 224, 224, 3)),
        ...                          label_spec=tf.TensorSpec((32,), tf.int32))  # doctest: +SKIP
        >>> loss = step(x, y)                                                    # doctest: +SKIP
        >>> model.fit(dataset.batch(32), epochs=3)   # trains with the step    # doctest: +SKIP
    """
    from tf_remat.rewrite import CHAINS
    from tf_remat.solvers import check_time_limit

    # each argument checked before minutes of tracing and profiling, not after
    if chain not in CHAINS:
        raise ValueError(f"chain must be one of {CHAINS}, got {chain!r}")
    train_step, label_spec = _check_model_and_specs(model, input_spec, label_spec, train_step,
                                                    sample_weight_spec)
    check_time_limit(time_limit)
    budget = _budget_bytes(budget_gb, budget_bytes)
    if margin is not None and not 0 <= margin < 1:
        raise ValueError(f"margin must be a fraction of the budget in [0, 1), got {margin!r}")
    strategy = _resolve_strategy(strategy, verbose)
    given = _given_plan(plan)  # a missing or malformed file fails before any tracing
    if sample_weight_spec is not None:
        sample_weight_spec = _weight_spec(sample_weight_spec)
    opts = dict(loss=loss, optimizer=optimizer, strategy=strategy, time_limit=time_limit,
                verbose=verbose, cost_model=cost_model, verify=verify, chain=chain, plan=given,
                time_order=time_order, sample_weight_spec=sample_weight_spec, probe=_probe,
                train_step=bool(train_step), margin=margin)
    step = OptimizedStep(model, budget, input_spec, label_spec, opts)
    step._primary()  # extract, solve, rewrite, verify; raises before any change to the model
    if verbose:
        print(step.summary(), file=sys.stderr, flush=True)
    if attach:
        step.attach()
    return step


def _check_model_and_specs(model, input_spec, label_spec, train_step, sample_weight_spec=None):
    """Refuse a model or specs no step can be traced from; ``(train_step, label_spec)`` resolved
    as :func:`optimize` takes them (``label_spec=None``: no labels, ``()``)."""
    import keras

    from tf_remat.extract import check_specs, overrides_train_step

    if not isinstance(model, keras.Model):
        kind = type(model).__module__.split(".")[0]
        raise TypeError(f"model must be a Keras 3 model (keras.Model, TensorFlow backend), got "
                        f"{type(model).__name__}"
                        + (" from tf_keras (Keras 2): build it with keras 3's layers"
                           if kind == "tf_keras" else ""))
    if keras.backend.backend() != "tensorflow":
        raise UnsupportedOpError(f"tf-remat rewrites TensorFlow training steps, and Keras runs "
                                 f"on the {keras.backend.backend()!r} backend: set "
                                 f"KERAS_BACKEND=tensorflow before keras is imported")
    if train_step is None:
        train_step = overrides_train_step(model) is not None
    if label_spec is None:
        # a train_step may take unlabeled batches (an autoencoder, a GAN): fit passes it x
        if not train_step:
            raise UnsupportedOpError(
                "label_spec is None: Keras's default step computes its loss from labels; give "
                "label_spec=tf.TensorSpec(...) (the labels' shape, with the batch size), or "
                "train a model whose own train_step takes unlabeled batches")
        if sample_weight_spec is not None:
            raise UnsupportedOpError("sample_weight_spec weighs labeled samples: give "
                                     "label_spec too, or leave sample_weight_spec None")
        label_spec = ()
    check_specs(input_spec, label_spec)
    return bool(train_step), label_spec


#: a pool whose peak use was over this before :func:`reserve_memory` has grown past the BFC
#: allocator's first region (2 MiB on the CPU): smaller regions exist, where allocations land
#: first
_RESERVE_LATE_BYTES = 2 << 20


def reserve_memory(budget_gb: float | None = None, *, budget_bytes: int | None = None,
                   device: str | None = None) -> None:
    """Grow TensorFlow's allocator pool by one region of at least the given size, now. Call it
    at the start of the program, right after ``import tf_remat`` and before building the model.

    TensorFlow's BFC allocator grows its pool by regions that never merge: on the CPU (and on a
    GPU with ``set_memory_growth``) 2 MiB, then 4, 8, 16 MiB and so on, as allocations need
    them. It hands a request a whole free chunk when the chunk is less than twice the request,
    so a 4.25 MiB activation placed in an empty 8 MiB region holds all 8, and a step's measured
    peak (what ``optimize`` verifies plans against) counts it. One region as large as the
    budget, made before anything else, leaves no small regions to land in: the residual CNN of
    ``benchmarks/results/allocator.md`` (batch 34, no oneDNN) measured 38.0-38.2 MiB for plans
    simulated at 27.7-28.2, and 30.4-32.1 MiB after ``reserve_memory`` of 128 or 512 MiB at the
    start of its process, where ``optimize`` then met a 30.72 MiB budget it refuses without.
    Made after the model is built, the region does little: the small ones exist by then, and a
    best-fit allocator fills them first (a warning says so).

    The memory stays with TensorFlow's pool (as all memory it has allocated does), free for the
    process's tensors. On a GPU without memory growth TensorFlow takes one region of nearly all
    of its memory at start, and this changes nothing. The allocator's peak statistic is reset
    after, so the reservation is not counted as use.

    Not a gain for every step: in one large region the chunks freed tensors leave are handed
    whole too, and what TensorFlow's kernels request moved with the reservation as well (the
    held-out ``siamese`` model's plain step measured 92 MiB with 256 MiB reserved against 81
    without, in the worst verification layout; ``seqcnn``'s 66 against 73). Measure both ways
    (:func:`measure_peak` in a fresh process) before counting on it.

    Args:
        budget_gb, budget_bytes: the size (exactly one of them): the budget ``optimize`` will be
            given, or more (weights, optimizer state, data and the step in one region).
        device: 'CPU:0', 'GPU:0', ...; default the device the step runs on ('GPU:0' when
            TensorFlow sees a GPU).

    Raises:
        RematError: TensorFlow keeps no memory statistics for ``device`` in this process (its
            CPU allocator is then not the BFC allocator, and there is no pool to grow), or
            the device cannot hold the size at once.

    Example:
        >>> import tf_remat                                          # doctest: +SKIP
        >>> tf_remat.reserve_memory(budget_gb=8)                     # doctest: +SKIP
        >>> model = build_model()  # then optimize(model, budget_gb=8, ...)  # doctest: +SKIP
    """
    import tensorflow as tf

    from tf_remat.extract import current_device_kind, require_memory_stats

    nbytes = _budget_bytes(budget_gb, budget_bytes)
    device = device or f"{current_device_kind()}:0"
    require_memory_stats(device)
    before = tf.config.experimental.get_memory_info(device)["peak"]
    if before > _RESERVE_LATE_BYTES:
        warn(f"tf-remat: reserve_memory comes after TensorFlow used {format_bytes(before)} on "
             f"{device}: its pool has smaller regions already, where allocations land first, "
             f"so the reservation does little; call it right after import tf_remat, before "
             f"the model is built")
    try:
        with tf.device(device):
            block = tf.zeros([-(-nbytes // 4)], tf.float32)
    except tf.errors.ResourceExhaustedError:
        # not chained: a caller (max-batch's probe process) takes TensorFlow's out-of-memory
        # error for a batch size that does not fit, and this is the budget that does not
        raise RematError(f"reserve_memory could not allocate {format_bytes(nbytes)} on "
                         f"{device}: the device does not hold that much at once; reserve "
                         f"less (the budget is more than it has free)") from None
    del block
    tf.config.experimental.reset_memory_stats(device)


def measure_peak(model, *, input_spec, label_spec, loss=None, optimizer=None,
                 train_step: bool | None = None, runs: int | None = None) -> int:
    """The measured peak memory of ``model``'s plain training step, in bytes, as
    :func:`optimize`'s budget counts it: the step ``model.fit`` would run (no
    rematerialization), on a synthetic batch of the specs' shapes, on the device TensorFlow
    uses; weights, optimizer slots, the batch and activations; memory the process holds for
    other purposes not counted. The variables (the optimizer's included) are saved before and
    restored after, so the model is left as it was.

    The allocator's measured peak moves with what was allocated before the step (see
    :func:`measure_step_peak`), so the step is run in the layouts :func:`optimize` verifies
    plans in and the worst counts: a budget that is a fraction of this figure is that fraction
    of what the plain step can take.

    Args:
        model, input_spec, label_spec, loss, optimizer, train_step: as :func:`optimize` takes
            them (the model compiled, or ``loss`` and ``optimizer`` given).
        runs: measured runs per layout (default: as many as ``optimize`` verifies with).

    Raises:
        tf.errors.ResourceExhaustedError: the plain step does not fit in the device's memory
            (a note says to give ``optimize`` the budget itself).

    Example:
        >>> peak = tf_remat.measure_peak(model, input_spec=xs, label_spec=ys)  # doctest: +SKIP
        >>> step = tf_remat.optimize(model, budget_bytes=int(0.6 * peak),    # doctest: +SKIP
        ...                          input_spec=xs, label_spec=ys)
    """
    import tensorflow as tf

    from tf_remat.extract import extract, trace_training_step
    from tf_remat.profile import synthetic_batch

    train_step, label_spec = _check_model_and_specs(model, input_spec, label_spec, train_step)
    # the largest value sizes the layouts, as optimize's verification sizes them
    graph = extract(model, input_spec=input_spec, label_spec=label_spec, loss=loss,
                    optimizer=optimizer, cost_model="flops", verbose=0,
                    train_step=train_step).graph
    plain = trace_training_step(model, input_spec, label_spec, loss=loss, optimizer=optimizer,
                                conv_gradients="tensorflow", train_step=train_step)
    x, y = synthetic_batch(input_spec, label_spec)
    try:
        m = measure_step_peak(plain.function, x, y, variables=plain.variables,
                              runs=_MEASURE_RUNS if runs is None else max(1, int(runs)),
                              ballast=verification_layouts(max(graph.memory) if graph.n else 0))
    except tf.errors.ResourceExhaustedError as exc:
        # the case tf-remat is for: the error stays TensorFlow's (callers catch it), and says
        # what to do instead
        if hasattr(exc, "add_note"):
            exc.add_note("tf-remat: Keras's step does not fit in this device's memory, so its "
                         "peak cannot be measured here; give optimize the budget itself "
                         "(budget_gb=: the device's memory less what else it holds)")
        raise
    return int(m["step_peak_bytes"])


def detach(model) -> bool:
    """Make ``model.fit`` use Keras's own training step again; True if a step was attached."""
    step = getattr(model, "_tf_remat_step", None)
    if step is None:
        return False
    step.detach()
    return True


# --------------------------------------------------------------------- the step
@dataclasses.dataclass
class _Built:
    """One rewritten step for one batch size (and one of update / gradients-only)."""

    extraction: Any
    plan: Any
    step: Any           # tf_remat.rewrite.RewrittenStep
    solve_budget: int
    measured: dict | None
    attempts: list
    seconds: dict
    order: dict | None = None  # the static order's timed price (_time_static_order)
    target: int | None = None  # the budget less the verification margin
    margin: float | None = None  # that margin, a fraction of the budget


class OptimizedStep:
    """A Keras model's training step rewritten to run a rematerialization plan.

    Attributes:
        model: the model.
        budget_bytes: the budget.
        plan, graph: the :class:`~tf_remat.plan.Plan` and :class:`~tf_remat.graph.Graph` of the
            step at the spec's batch size (``plan.save(path)`` / ``graph.save(path)``).
        report: a dict: ``strategy, status, budget_bytes, predicted_peak_bytes,
            baseline_peak_bytes, predicted_overhead, solve_seconds``; ``verified`` (whether
            the step's peak was measured: not with ``verify=False``, nor when TensorFlow keeps
            no memory statistics for the device) and then ``measured_peak_bytes`` and
            ``margin_met`` (whether it is within the budget less the verification margin,
            ``margin``, a fraction of the budget; False: kept as the best within the budget,
            with a warning); also
            ``nodes, recomputed_nodes, attempts, total_solve_seconds`` (all attempts' solves,
            their processes included), ``extract_seconds, rewrite_seconds``; ``cost_model``
            and, for ``"step"``, ``step_costs`` (``"traced"``, or why each node's isolated
            cost stood in). ``predicted_overhead`` is the recomputation's
            share of the step (plan cost / sum of node costs - 1); running the plan in a static
            order costs more besides, since independent ops no longer run side by side (-16% to
            +34% on the zoo models on a 2-core CPU, ``benchmarks/results/rewrite.md``). With
            ``time_order``, ``static_order_overhead`` is that price as timed against the step
            as Keras runs it (``order_reference`` ``"keras"``; ``"traced"`` where that step ran
            out of memory and the traced step, edited by :func:`~tf_remat.extract.extract`,
            stood in), so it includes what extract's edits cost or save, and
            ``predicted_overhead`` counts both; where loops overlap in the static order, also
            ``serial_order_overhead`` (the price with every node ordered) and
            ``overlapped_loops`` (how many of the plan's loops run beside the one before).
            ``deferred_updates``: how many variable updates the solver had placed before a
            reader of the variable's old value were moved after it
            (:func:`tf_remat.rewrite.defer_updates`); ``updates_copied_on_write``: how many
            could not move within the budget (each copies its variable while that reader waits).
    """

    def __init__(self, model, budget, input_spec, label_spec, opts):
        self.model = model
        self.budget_bytes = int(budget)
        self.input_spec = input_spec
        self.label_spec = label_spec
        self._opts = opts
        # (batch size, the weights' shape and dtype or None) -> _Built
        self._train = {}     # with the optimizer update
        self._grads = {}     # gradients only
        self._attached = False
        self._warned = set()

    # ------------------------------------------------------------ public
    def __call__(self, x, y=None, sample_weight=None):
        """One training step on ``(x, y)`` (optimizer update included); returns the loss (a
        model's own ``train_step``, see ``optimize``: what it returns, its logs).
        ``sample_weight``: per-sample weights of the loss, as in ``model.fit``. ``y`` is None
        for a step optimized without labels (``label_spec=None``)."""
        return self._run(x, y, sample_weight)[0]

    def _run(self, x, y, sample_weight=None):
        """One training step; ``(loss, y_pred or None)`` (y_pred when the model has compiled
        metrics: the step then returns the model's outputs too), or ``(logs, None)`` for a
        model's own ``train_step``."""
        b, args = self._prepare(x, y, sample_weight, apply_updates=True)
        out = b.step(*args)
        traced = b.extraction.traced
        if traced.logs is not None:
            import tensorflow as tf

            out = list(out) if isinstance(out, (list, tuple)) else [out]
            return tf.nest.pack_sequence_as(traced.logs, out), None
        if not traced.n_predictions:
            return out, None
        import tensorflow as tf

        return out[0], tf.nest.pack_sequence_as(traced.predictions, list(out[1:]))

    def gradients(self, x, y, sample_weight=None) -> list:
        """Gradients of the loss on ``(x, y)`` (weighted by ``sample_weight``, when given),
        aligned with ``model.trainable_variables``.

        The variables are not updated by the optimizer; the forward pass's own state updates
        (BatchNorm moving statistics, dropout seed) happen, as in a training step. Built (and
        solved within the same budget) on first use.

        Raises:
            UnsupportedOpError: the step is the model's own ``train_step``, which applies its
                update itself (``optimize(..., train_step=False)`` plans Keras's default step,
                whose gradients this gives).
        """
        if self._opts.get("train_step"):
            raise UnsupportedOpError(
                f"step.gradients: the step optimized is {type(self.model).__name__}.train_step, "
                f"whose gradients are taken and applied inside it; optimize(..., "
                f"train_step=False) plans Keras's default step (model call, compute_loss, "
                f"gradients), whose gradients step.gradients gives")
        b, args = self._prepare(x, y, sample_weight, apply_updates=False)
        out = b.step(*args)
        return list(out[1:])

    @property
    def plan(self):
        return self._primary().plan

    @property
    def graph(self):
        return self._primary().extraction.graph

    @property
    def op_map(self):
        return self._primary().extraction.op_map

    @property
    def rewritten(self):
        """The :class:`~tf_remat.rewrite.RewrittenStep` at the spec's batch size."""
        return self._primary().step

    @property
    def report(self) -> dict:
        b = self._primary()
        plan, graph = b.plan, b.extraction.graph
        from tf_remat.plan import run_cost, simulate

        counts = simulate(graph, plan.steps).compute_counts
        rep = {"strategy": plan.strategy, "plan_source": plan.info.get("plan_source", "solved"),
               "status": plan.status,
               "budget_bytes": self.budget_bytes, "predicted_peak_bytes": plan.peak_memory,
               "baseline_peak_bytes": graph.no_remat_peak,
               "predicted_overhead": plan.overhead, "solve_seconds": plan.solve_seconds,
               "recompute_overhead": plan.overhead,
               "cost_model": b.extraction.info.get("cost_model")}
        if "step_costs" in b.extraction.info:  # "traced", or why the isolated costs stood in
            rep["step_costs"] = b.extraction.info["step_costs"]
        if b.order is not None and plan.overhead is not None:
            s = b.order["static_order_overhead"]
            rep["static_order_overhead"] = s
            rep["order_reference"] = b.order["reference"]
            rep["predicted_overhead"] = (1 + s) * (1 + plan.overhead) - 1
            if "serial_order_overhead" in b.order:
                # loops overlap in the static order, and in this plan where its memory allows
                # (at tight budgets, nowhere: bilstm's step at 70% took +77% where the static
                # order took +16%, and the order with every node after the one before +34%).
                # The node costs are the serial order's (they sum to its time); a run of loops
                # would cost its dearest loop (run_cost), and saves the share of that which the
                # static order's two timings saved (0.7 on 2 cores)
                ss, static = b.order["serial_order_overhead"], b.order["static_step"]
                rep["serial_order_overhead"] = ss
                index = b.step.info.get("run_index")
                rep["overlapped_loops"] = 0 if index is None else len(index) - len(set(index))
                total = graph.total_cost
                modelled = (1 + ss) * (1 - run_cost(graph, static.plan.steps,
                                                    static.info["run_index"]) / total)
                share = min(1.0, max(0.0, (ss - s) / modelled)) if modelled > 0 else 0.0
                saved = plan.cost - run_cost(graph, plan.steps, index)
                rep["predicted_overhead"] = (1 + ss) * (plan.cost - share * saved) / total - 1
            rep["plain_step_seconds"] = b.order["plain_seconds"]
            rep["predicted_step_seconds"] = (b.order["plain_seconds"]
                                             * (1 + rep["predicted_overhead"]))
            rep["time_order_seconds"] = b.order.get("seconds")
        if b.measured is not None:
            rep["measured_peak_bytes"] = b.measured["step_peak_bytes"]
            # within the budget less the verification margin (else kept as the best within
            # the budget: other allocation histories may put it over)
            rep["margin_met"] = b.target is None or rep["measured_peak_bytes"] <= b.target
            rep["margin"] = b.margin
        rep["verified"] = b.measured is not None
        # whether the step is the model's own train_step (optimize's train_step)
        rep["train_step"] = bool(self._opts.get("train_step"))
        rep.update({"solve_budget_bytes": b.solve_budget, "nodes": graph.n,
                    "recomputed_nodes": sum(1 for c in counts if c > 1),
                    "attempts": len(b.attempts),
                    "total_solve_seconds": sum(a.get("solve_seconds", 0) for a in b.attempts),
                    "extract_seconds": b.seconds.get("extract"),
                    "rewrite_seconds": b.seconds.get("rewrite"),
                    "lower_bound_bytes": graph.budget_lower_bound})
        for key in ("deferred_updates", "updates_copied_on_write"):
            if plan.info.get(key):
                rep[key] = plan.info[key]
        if b.attempts and b.attempts[0].get("given"):
            # what the given plan measured here, whichever plan then ran
            rep["given_plan_measured_bytes"] = b.attempts[0]["measured"]
        return rep

    def summary(self) -> str:
        r = self.report
        meas = (f", measured {format_bytes(r['measured_peak_bytes'])}"
                if "measured_peak_bytes" in r else "")
        parts = ""
        if "static_order_overhead" in r:
            rc = r["recompute_overhead"] or 0
            if "serial_order_overhead" in r:
                # the order's price is the plan's here: its loops overlap only where its
                # memory allows, so the parts compose to the prediction only as a whole
                order = (1 + (r["predicted_overhead"] or 0)) / (1 + rc) - 1
                what = "static order, loops overlapped where the memory allows"
            else:
                order, what = r["static_order_overhead"], "static order"
            parts = f" (recomputation {100 * rc:.1f}%, {what} {100 * order:+.1f}%)"
        return (f"tf-remat: {r['strategy']} plan for budget {format_bytes(r['budget_bytes'])}: "
                f"predicted peak {format_bytes(r['predicted_peak_bytes'])}{meas} "
                f"(no rematerialization {format_bytes(r['baseline_peak_bytes'])}), "
                f"{r['recomputed_nodes']} of {r['nodes']} nodes recomputed, predicted overhead "
                f"{100 * (r['predicted_overhead'] or 0):.1f}%{parts}")

    def measure(self, x=None, y=None, *, runs: int = 1) -> dict:
        """Run the step on ``(x, y)`` (synthetic when None) with the variables saved and restored;
        TensorFlow's measured peak (see :func:`measure_step_peak`)."""
        if x is None or (y is None and self.label_spec != ()):
            from tf_remat.profile import synthetic_batch

            b = self._primary()
            # (the specs' third item is the weights alone, which the label pair holds)
            x, y = synthetic_batch(*self._specs(_first_dim(self.input_spec),
                                                self._opts.get("sample_weight_spec"))[:2])
        else:  # the step for this batch's size, as a call on it would run
            b, (x, y) = self._prepare(x, y, None, apply_updates=True)
        return measure_step_peak(b.step, x, y, variables=b.extraction.traced.variables,
                                 runs=runs)

    # ------------------------------------------------------------ model.fit
    def attach(self) -> None:
        """Make ``model.fit`` train with this step (progress bar, callbacks, history as usual).

        Keras's ``make_train_function`` is replaced on this model instance; the train function
        takes each batch from the iterator, runs the rewritten step (a batch of another size,
        such as the last partial one, or of other dimensions the model takes, such as another
        sequence length, gets its own plan within the same budget, built on first
        use: the solved plan's schedule when that batch needs recomputation and its graph
        differs only in memory, else a solve) and updates the model's loss tracker and
        compiled metrics (the step returns the model's outputs when the model was compiled
        with metrics). With ``sample_weight=`` or
        ``class_weight=``, the step weighs the loss as Keras's does; unless ``optimize`` was
        given ``sample_weight_spec``, its plan is solved at the first weighted batch.
        """
        model = self.model
        old = getattr(model, "_tf_remat_step", None)
        if old is not None and old is not self:
            old.detach()
        if not getattr(model, "compiled", True):
            # Keras's fit refuses a model that was never compiled, and optimize traced the
            # loss and optimizer it was given: compile with those (the traced optimizer
            # instance, whose slots the step updates), without XLA, which the step runs
            # without
            model.compile(optimizer=self._traced_optimizer(), loss=self._opts["loss"],
                          jit_compile=False)
            if self._opts["verbose"]:
                print("tf-remat: the model was not compiled; compiled it with the loss and "
                      "optimizer given to optimize, for model.fit", file=sys.stderr,
                      flush=True)
        this = self

        def make_train_function(force=False):
            if (model.optimizer is not this._traced_optimizer()) and model.optimizer is not None \
                    and this._opts.get("optimizer") is None:
                warn("tf-remat: the model was compiled again with another optimizer "
                     "since optimize(); model.fit uses Keras's own step (call "
                     "optimize again)")
                this.detach()
                return model.make_train_function(force=True)
            model.train_function = this._keras_train_function
            return model.train_function

        object.__setattr__(model, "make_train_function", make_train_function)
        object.__setattr__(model, "_tf_remat_step", self)
        model.train_function = None
        self._attached = True
        if _has_compiled_metrics(model) and not self._opts.get("train_step") and not \
                self._primary().extraction.traced.n_predictions:
            self._warn_once("metrics", "tf-remat: the model was compiled with metrics after "
                                       "optimize(); they are not updated by the rewritten step "
                                       "(call optimize again); history holds the loss")

    def detach(self) -> None:
        """Undo :meth:`attach`: ``model.fit`` uses Keras's own training step again."""
        model = self.model
        if "make_train_function" in model.__dict__:
            object.__delattr__(model, "make_train_function")
        if model.__dict__.get("_tf_remat_step") is self:
            object.__delattr__(model, "_tf_remat_step")
        model.train_function = None
        self._attached = False

    @property
    def attached(self) -> bool:
        return self._attached

    def _keras_train_function(self, iterator):
        import tensorflow as tf
        from keras.src.trainers.data_adapters import data_adapter_utils

        model = self.model
        loss = None
        for _ in range(max(1, int(getattr(model, "steps_per_execution", 1) or 1))):
            try:
                data = next(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                if loss is None:
                    raise StopIteration
                break
            x, y, sw = data_adapter_utils.unpack_x_y_sample_weight(data)
            loss, y_pred = self._run(x, y, sw)
            if self._opts.get("train_step"):
                continue  # its own step updated its trackers and metrics: loss is its logs
            tracker = getattr(model, "_loss_tracker", None)
            if tracker is not None:
                n = tf.shape(tf.nest.flatten(x)[0])[0]
                tracker.update_state(loss, sample_weight=n)
            if y_pred is not None:
                metrics = model.compute_metrics(x, y, y_pred, sample_weight=sw)
        if self._opts.get("train_step"):
            return loss
        if y_pred is not None:
            return metrics
        tracker = getattr(model, "_loss_tracker", None)
        if tracker is not None:
            return {"loss": tracker.result()}
        return {"loss": loss}

    # ------------------------------------------------------------ building
    def _traced_optimizer(self):
        return self._primary().extraction.traced.optimizer

    def _primary(self) -> _Built:
        batch = _first_dim(self.input_spec)
        return self._get(batch, apply_updates=True,
                         weights=self._specs(batch, self._opts.get("sample_weight_spec"))[2])

    def _prepare(self, x, y, sample_weight, *, apply_updates):
        """The step for this batch (and these weights, if any), and its arguments."""
        import tensorflow as tf

        batch = _batch_of(x)
        if self.label_spec == ():
            # optimized without labels (label_spec=None): the train_step takes x alone
            if y is not None and tf.nest.flatten(y):
                raise ValueError("the step was optimized without labels (label_spec=None), "
                                 "and labels were given: call step(x), or optimize with a "
                                 "label_spec")
            if sample_weight is not None:
                raise ValueError("sample weights weigh labeled samples, and the step was "
                                 "optimized without labels (label_spec=None)")
            y = ()
        elif y is None:
            raise ValueError("labels y are required: the step was optimized with label_spec "
                             f"{self.label_spec}")
        x, y = self._cast(x, y)
        shapes = self._other_shapes(x, y)
        weights = None
        if sample_weight is not None:
            sw = tf.convert_to_tensor(sample_weight)
            if not sw.dtype.is_floating:
                sw = tf.cast(sw, tf.float32)
            weights = tf.TensorSpec(sw.shape, sw.dtype)
        elif self._opts.get("sample_weight_spec") is not None:
            # weights of one weigh as none (Keras's reductions divide by the count, or by the
            # weights' sum), so the step solved with weights serves unweighted calls too
            weights = self._specs(batch, self._opts["sample_weight_spec"])[2]
            if shapes is not None:
                weights = self._weights_like(weights, y)
            sw = tf.ones(weights.shape, weights.dtype)
        b = self._get(batch, apply_updates=apply_updates, weights=weights, shapes=shapes)
        return b, ((x, y) if weights is None else (x, (y, sw)))

    def _weights_like(self, weights, y):
        """The declared weights' spec for a batch of other dimensions: per-time-step weights
        (``(batch, steps)``, declared as the labels' leading dimensions) follow the labels'
        length; weights per sample stay as they are."""
        import tensorflow as tf

        rank = weights.shape.rank
        if rank < 2:
            return weights
        label, got = tf.nest.flatten(self.label_spec)[0], tf.nest.flatten(y)[0]
        if label.shape.rank >= rank and \
                label.shape.as_list()[1:rank] == weights.shape.as_list()[1:]:
            return tf.TensorSpec(got.shape[:rank], weights.dtype)
        raise ValueError(
            f"sample_weight_spec {weights.shape.as_list()} is not the labels' leading "
            f"dimensions ({label.shape.as_list()[:rank]}), so its shape for labels of shape "
            f"{got.shape.as_list()} is unknown: pass sample_weight= with such a batch")

    def _other_shapes(self, x, y):
        """None when every input and label has its spec's shape but for the batch size;
        else the shapes of all of them (inputs, then labels, flattened), a step's key."""
        import tensorflow as tf

        got = [tuple(t.shape.as_list()) for t in tf.nest.flatten(x) + tf.nest.flatten(y)]
        if all(g[1:] == w[1:] for g, w in zip(got, _spec_shapes(self))):
            return None
        return tuple(got)

    def _specs(self, batch, weights=None, shapes=None):
        """``(input_spec, label_spec, weights)`` at this batch size (or these ``shapes``, see
        :meth:`_other_shapes`); with weights, the label spec is the pair the weighted step
        takes."""
        import tensorflow as tf

        from tf_remat.extract import _with_batch

        ispec = _with_batch(self.input_spec, batch)
        lspec = _with_batch(self.label_spec, batch)
        if shapes is not None:
            leaves = tf.nest.flatten(ispec) + tf.nest.flatten(lspec)
            fixed = [tf.TensorSpec(shape, s.dtype, s.name) for s, shape in zip(leaves, shapes)]
            n = len(tf.nest.flatten(ispec))
            ispec = tf.nest.pack_sequence_as(ispec, fixed[:n])
            lspec = tf.nest.pack_sequence_as(lspec, fixed[n:])
        if weights is None:
            return ispec, lspec, None
        weights = _with_batch(weights, batch)
        return ispec, (lspec, weights), weights

    def _get(self, batch, *, apply_updates, weights=None, shapes=None) -> _Built:
        cache = self._train if apply_updates else self._grads
        key = (batch, None if weights is None
               else (tuple(weights.shape.as_list()), weights.dtype.name))
        if shapes is not None:
            key += (shapes,)
        if key not in cache:
            if cache and self._opts["verbose"]:
                what = _form(batch, shapes) + ("" if weights is None else
                                               f", sample weights of shape {key[1][0]}")
                print(f"tf-remat: {what} (a plan within the same budget is built for it)",
                      file=sys.stderr, flush=True)
            spec_batch = _first_dim(self.input_spec)
            try:
                cache[key] = self._build(batch, apply_updates, weights, shapes)
            except InfeasibleBudgetError as exc:
                if batch == spec_batch and shapes is None:
                    raise
                # met inside model.fit, the bare message reads as if optimize's own budget
                # were wrong: say which batch does not fit, and the usual way out
                if shapes is None:
                    msg = (f"batch size {batch} (optimize solved for {spec_batch}) does not fit "
                           f"the budget: {exc}; or train at batch size {spec_batch} (fit's "
                           f"batch_size, or the dataset's batches)")
                else:
                    msg = (f"{_form(batch, shapes)} (optimize solved for "
                           f"{_form(spec_batch, _spec_shapes(self))}) does not fit the budget: "
                           f"{exc}; or pad or crop the batches to the shapes optimize was given")
                raise InfeasibleBudgetError(msg, budget=exc.budget,
                                            min_feasible=exc.min_feasible,
                                            plan=exc.plan) from None
        return cache[key]

    def _build(self, batch, apply_updates, weights=None, shapes=None) -> _Built:
        from tf_remat.extract import (current_device_kind, extract, memory_stats_missing,
                                      overrides_train_step)
        from tf_remat.profile import synthetic_batch
        from tf_remat.rewrite import adjoin_loops, defer_updates, rewrite

        o = self._opts
        verbose = o["verbose"]
        # without TensorFlow's memory statistics nothing can be measured: the plan still aims
        # under the budget by the margin, and the report says it was not verified
        unmeasurable = o["verify"] and memory_stats_missing(f"{current_device_kind()}:0")
        if unmeasurable:
            self._warn_once("unverified", f"tf-remat: the plan is not verified by measurement. "
                                          f"{unmeasurable}")
        t0 = time.perf_counter()
        ispec, lspec, weights = self._specs(batch, weights, shapes)
        # the plan given and the static order's timing are for the step optimize() builds
        primary = apply_updates and batch == _first_dim(self.input_spec) and (
            (weights is None) == (o.get("sample_weight_spec") is None)) and shapes is None
        step_args = dict(loss=o["loss"], optimizer=o["optimizer"], apply_updates=apply_updates,
                         return_predictions=apply_updates and _has_compiled_metrics(self.model)
                         and not o["train_step"],
                         weighted=weights is not None, train_step=o["train_step"])
        ex = extract(self.model, input_spec=ispec, label_spec=lspec, cost_model=o["cost_model"],
                     verbose=verbose, **step_args)
        t1 = time.perf_counter()
        graph = ex.graph
        budget = self.budget_bytes
        loops = ex.info.get("loops") or []
        if loops:
            self._warn_once("loops", f"tf-remat: {_loops_note(loops)}")
        custom = overrides_train_step(self.model)
        if custom and not o["train_step"]:
            # train_step=False: the step is traced from the model's call, compute_loss and
            # optimizer, as Keras's own train_step runs them; the override's code is not run
            self._warn_once("train_step", f"tf-remat: {custom} overrides train_step, and "
                                          f"optimize(..., train_step=False) planned Keras's "
                                          f"default step instead (model.fit with it attached "
                                          f"runs that): model(x, training=True), compute_loss "
                                          f"(which may be overridden), the gradients and "
                                          f"optimizer.apply_gradients. train_step=None plans "
                                          f"the override, or optimize(..., attach=False) keeps "
                                          f"fit on it")
        if getattr(self.model, "compiled", False) and \
                getattr(self.model, "jit_compile", False) is True:
            # XLA would reorder the plan's ops and merge its copies back into the originals
            self._warn_once("xla", "tf-remat: the model was compiled with jit_compile=True (or "
                                   "'auto' on a GPU); the rewritten step runs without XLA, so "
                                   "random ops such as Dropout draw other values than Keras's "
                                   "XLA-compiled step would (from the same distribution), and "
                                   "other ops differ from it in float32 rounding")
        # the measured peak moves by a few percent from run to run: aim under the budget
        margin = o.get("margin")
        if margin is None:
            margin = verification_margin(budget, max(graph.memory, default=0))
        target = int(budget * (1 - margin))
        # TensorFlow's measured peak is rarely below the simulated one (the allocator rounds
        # up), so a plan simulated above the target would almost never be accepted: solve for
        # the target first, and for the budget itself only when nothing fits the target
        solve_budget = budget
        if o["verify"] and max(target, graph.budget_lower_bound) < budget:
            solve_budget = max(target, graph.budget_lower_bound)
        attempts = []
        best = None        # the lowest measured step within the budget, or the lowest overall
        accepted = None
        rewrite_s = 0.0
        too_high = None    # the lowest solve budget whose plan measured over the budget
        no_plan = None     # the highest solve budget the solver found no plan for
        below_no_plan = False  # whether a solve under no_plan was tried once more
        # the lowest simulated peak of a plan measured over the target: a solve for that much
        # or more may return that plan again, so the next solve aims under it (at batch 48 of
        # the max-batch test three solves in a row returned the one plan, each measured over
        # again: 30 s of a 100 s refusal), and the search stops when that aim would be within
        # 0.5% of the budget under it (budget_path.md)
        low_over = None
        over_cost = None   # the cheapest plan measured over the target
        lo_ok = None       # the highest solve budget whose plan measured within the target
        refines = 0        # solves aiming back up from a plan within the target (_MAX_REFINE)

        def under_low_over(nxt, lo):
            # an aim at or over low_over moves halfway down to ``lo``, a budget the solver
            # found no plan for; or 1% of the budget under low_over when ``lo`` is not under
            # it (a heuristic solve can later find a plan under a budget that had none)
            if low_over is None or nxt < low_over:
                return nxt
            if lo is not None and lo < low_over:
                return (lo + low_over) // 2
            return low_over - int(0.01 * budget)
        plan = None
        limit = o["time_limit"]
        resolve_left = None if limit is None else _RESOLVE_SHARE * limit
        # a given plan is for the training step at the spec's batch size (its graph)
        given = None
        if o.get("plan") is not None and primary:
            given = _adopt_plan(o["plan"], graph, budget)
        elif not primary:
            # another batch size or weighting of a step already solved (fit's last partial
            # batch, its first class_weight) whose graph differs only in memory: that schedule
            # runs here without a solve (one that needs no recomputation is solved: that takes
            # a moment and recomputes nothing)
            # (unverified, a plan is kept when it simulates within the budget, as solved ones)
            given = self._reused_plan(graph, apply_updates, weights,
                                      target if o["verify"] else budget)
            if given is not None and verbose:
                donor = (f"{'the weighted' if given.info['reused_from_weighted'] else 'the'} "
                         f"step at batch size {given.info['reused_from_batch']}")
                print(f"tf-remat: {_form(batch, shapes)}"
                      f"{'' if weights is None else ', weighted,'} runs the plan of {donor} "
                      f"(the same graph; simulated {format_bytes(given.peak_memory)} here)",
                      file=sys.stderr, flush=True)
        for attempt in range(_MAX_ATTEMPTS + _MAX_NO_PLAN if o["verify"] else 1):
            if sum(a["predicted"] is not None for a in attempts) >= _MAX_ATTEMPTS:
                break
            this_limit = limit
            # until a step within the budget exists, meeting it matters more than the time and
            # a re-solve gets the whole limit (the demo's step on a loaded 2-core machine: at a
            # quarter of its 10 s no plan was found for 85-95 MiB, which 10 s found, and
            # optimize gave up on a budget that such a plan meets)
            met = best is not None and best.measured["step_peak_bytes"] <= budget
            if attempt and limit is not None and met:
                if resolve_left < max(1.0, 0.05 * limit):
                    if verbose:
                        print(f"tf-remat: re-solve time ({_RESOLVE_SHARE * limit:g} s) "
                              f"spent; keeping the best step within the budget after "
                              f"{attempt} attempt(s)", file=sys.stderr, flush=True)
                    break
                this_limit = min(_RESOLVE_LIMIT * limit, resolve_left)
            ts = time.perf_counter()
            from_given = attempt == 0 and given is not None
            if from_given:
                plan = given
            else:
                # each attempt its own seed: a heuristic that found nothing once may next time
                plan = solve_isolated(graph, solve_budget, o["strategy"],
                                      time_limit=this_limit, verbose=verbose, seed=attempt)
                # what a later optimize(plan=...) checks the plan against
                plan = dataclasses.replace(plan, info={**plan.info, "plan_source": "solved",
                                                       "graph_digest": graph.structure_digest})
                if plan.within_budget:
                    # no update before a reader of the old value: a copy no node counts
                    plan = defer_updates(ex.traced, graph, ex.op_map, plan)
                if o["chain"] == "node" and plan.within_budget:
                    # independent loops next to each other, for the node chain to overlap
                    plan = adjoin_loops(ex.traced, graph, ex.op_map, plan)
            solve_s = time.perf_counter() - ts
            # (a max-batch probe counts them all: its sizes must fit with fewer tries than the
            # user's own optimize at the size it reports will get)
            if attempt and limit is not None and (met or o.get("probe")):
                resolve_left -= solve_s
            info = {"time_limit": this_limit, "solve_seconds": round(solve_s, 3),
                    "given": from_given}
            if not plan.within_budget and refines:
                break  # no plan on the way back up: the one within the target stays
            if not plan.within_budget:
                if solve_budget >= budget:
                    _raise_infeasible(graph, plan, budget, o, ex.info.get("loop_bytes"))
                attempts.append({"solve_budget": solve_budget, "predicted": None,
                                 "measured": None, **info})
                # the highest budget without a plan bounds the search from below; a failed try
                # under it (see below_no_plan) does not lower that bound
                no_plan = solve_budget if no_plan is None else max(no_plan, solve_budget)
                if too_high is None:
                    nxt = budget  # nothing fits the target: the budget itself (or the error)
                else:
                    # no plan this low: try halfway back up
                    nxt = (solve_budget + too_high) // 2
                    if too_high - nxt < 0.002 * budget:
                        break
                    nxt = under_low_over(nxt, solve_budget)
                    if low_over - nxt < _closest(budget):
                        if verbose:
                            print(f"tf-remat: no plan within {format_bytes(solve_budget)}, "
                                  f"and a plan of {format_bytes(low_over)} measured over "
                                  f"{format_bytes(target)}; stopping",
                                  file=sys.stderr, flush=True)
                        break
                solve_budget = nxt
                continue
            tr = time.perf_counter()
            step = rewrite(ex.traced, graph, ex.op_map, plan, chain=o["chain"])
            rewrite_s += time.perf_counter() - tr
            measured = None
            if o["verify"] and not unmeasurable:
                x, y = synthetic_batch(ispec, lspec)
                big = max(graph.memory) if graph.n else 0
                measured = measure_step_peak(step, x, y, variables=ex.traced.variables,
                                             runs=_MEASURE_RUNS,
                                             ballast=verification_layouts(big))
                del x, y
            attempts.append({"solve_budget": solve_budget, "predicted": plan.peak_memory,
                             "measured": None if measured is None
                             else measured["step_peak_bytes"], **info})
            cand = _Built(ex, plan, step, solve_budget, measured, attempts, {})
            if measured is None:
                accepted = cand
                break
            m = measured["step_peak_bytes"]
            if best is None or m < best.measured["step_peak_bytes"]:
                best = cand
            # a given plan was kept by a run that found it within the budget, perhaps not
            # within the margin (the best there was): within the budget here, it runs again
            if m <= target or (from_given and m <= budget):
                if accepted is None or plan.cost < accepted.plan.cost:
                    accepted = cand
                if from_given or refines >= _MAX_REFINE or over_cost is None or \
                        target - m < _REFINE_ROOM * budget or \
                        (accepted.plan.cost - over_cost) < _REFINE_GAIN * graph.total_cost:
                    break
                lo_ok = solve_budget if lo_ok is None else max(lo_ok, solve_budget)
                # the excess this plan measured over its prediction, rather than the larger
                # one of the plan over the target, sets the aim; under that plan's budget
                nxt = under_low_over(target - (m - plan.peak_memory) - _closest(budget), lo_ok)
                nxt = min(nxt, too_high - _closest(budget))
                if nxt - lo_ok < _closest(budget):
                    break
                refines += 1
                if verbose:
                    print(f"tf-remat: measured peak {format_bytes(m)} is "
                          f"{format_bytes(target - m)} under the target at "
                          f"{100 * (plan.overhead or 0):.3g}% overhead; solving again for "
                          f"{format_bytes(nxt)}", file=sys.stderr, flush=True)
                solve_budget = nxt
                continue
            over_cost = plan.cost if over_cost is None else min(over_cost, plan.cost)
            if refines:
                # over on the way back up: halfway between the two, while that is a step
                too_high = min(too_high, solve_budget)
                low_over = min(low_over, plan.peak_memory)
                nxt = under_low_over((lo_ok + too_high) // 2, lo_ok)
                if refines >= _MAX_REFINE or nxt - lo_ok < _closest(budget):
                    break
                refines += 1
                if verbose:
                    print(f"tf-remat: measured peak {format_bytes(m)} is over "
                          f"{format_bytes(target)}; solving again for {format_bytes(nxt)}",
                          file=sys.stderr, flush=True)
                solve_budget = nxt
                continue
            if from_given and verbose:
                print(f"tf-remat: the {plan.info.get('plan_source', 'given')} plan measures "
                      f"{format_bytes(m)} here, over the "
                      f"budget {format_bytes(budget)}; solving", file=sys.stderr, flush=True)
            too_high = solve_budget if too_high is None else min(too_high, solve_budget)
            low_over = plan.peak_memory if low_over is None else min(low_over, plan.peak_memory)
            excess = m - plan.peak_memory
            nxt = min(target - excess - int(0.005 * budget),
                      solve_budget - int(0.01 * budget))
            if no_plan is not None and nxt <= no_plan:
                if below_no_plan:
                    nxt = (no_plan + too_high) // 2
                else:
                    # a heuristic solve that found no plan proves nothing, and the measured
                    # excess says a plan that far down is what meets the budget: once more
                    # (the demo's step on a loaded machine: no plan at the 97 MiB target in
                    # one solve, every plan above it measuring 12-22 MiB over its prediction)
                    below_no_plan = True
            nxt = max(nxt, graph.budget_lower_bound)
            nxt = under_low_over(nxt, no_plan)
            if nxt >= too_high or too_high - nxt < 0.002 * budget or \
                    low_over - nxt < _closest(budget):
                break
            if verbose:
                print(f"tf-remat: measured peak {format_bytes(m)} is over "
                      f"{format_bytes(target)} (the budget less a {100 * margin:.3g}% "
                      f"margin; predicted {format_bytes(plan.peak_memory)}); "
                      f"solving again for {format_bytes(nxt)}", file=sys.stderr, flush=True)
            solve_budget = nxt
        if accepted is None and best is not None and best.measured["step_peak_bytes"] <= budget:
            accepted = best  # within the budget, not within the margin: the best there is
        if accepted is None and best is not None and not apply_updates:
            # a gradients-only step is for checks, not training: keep the plan, say so
            warn(f"tf-remat: the gradients-only step measures "
                 f"{format_bytes(best.measured['step_peak_bytes'])}, over the budget "
                 f"{format_bytes(budget)}; its gradients are still exact")
            accepted = best
        if accepted is None:
            if best is None:  # pragma: no cover (the first attempt raises)
                _raise_infeasible(graph, plan, budget, o)
            m = best.measured["step_peak_bytes"]
            raise InfeasibleBudgetError(
                f"budget {format_bytes(budget)} could not be met as TensorFlow measures it: the "
                f"best plan found predicts {format_bytes(best.plan.peak_memory)} but measures "
                f"{format_bytes(m)} on this device (after {len(attempts)} attempt(s)); raise "
                f"the budget to at least {format_bytes(m)} or lower the batch size. That "
                f"plan is this error's .plan: optimize(..., budget_bytes=err.min_feasible, "
                f"plan=err.plan) runs it again rather than solving anew (another solve at "
                f"another budget takes another path, and may measure more)"
                + (f". {_loops_note(loops)}" if loops else ""),
                budget=budget, min_feasible=m, plan=best.plan)
        best = accepted
        best.target, best.margin = target, margin
        if best.measured is not None and best.measured["step_peak_bytes"] > target and \
                apply_updates:
            # kept because no plan measured within the margin: other allocation histories
            # (after model.fit, beside other tensors) measured held-out-style steps up to 5
            # points above their verified peak (benchmarks/results/heldout.md)
            self._warn_once("edge", f"tf-remat: the step measures "
                                    f"{format_bytes(best.measured['step_peak_bytes'])}, within "
                                    f"the budget {format_bytes(budget)} but over "
                                    f"{format_bytes(target)} (the budget less a "
                                    f"{100 * margin:.3g}% margin for other allocation "
                                    f"histories), where it may measure a few percent more; "
                                    f"a longer time_limit, or a budget a few percent lower, "
                                    f"finds more room (report['margin_met'] is False)")
        if o.get("time_order") and primary:
            tt = time.perf_counter()
            try:
                best.order = _time_static_order(ex, o["chain"], ispec, lspec, step_args)
                best.order["seconds"] = time.perf_counter() - tt
            except Exception as exc:  # noqa: BLE001 (a price for the report: lose no plan)
                # the plain step, which a user brings because it does not fit, may run out
                # of memory here; the plan found is no less good for that
                self._warn_once("order", f"tf-remat: the static order's price was not timed "
                                         f"({type(exc).__name__}: {str(exc)[:200]}); "
                                         f"predicted_overhead counts the recomputation alone")
        best.seconds = {"extract": t1 - t0, "rewrite": rewrite_s,
                        "total": time.perf_counter() - t0}
        best.attempts = attempts
        return best

    def _reused_plan(self, graph, apply_updates, weights, target):
        """A plan of a built step of the same kind whose graph differs from ``graph`` only in
        memory, re-simulated here; None when none peaks within ``target``, or when ``graph``
        fits ``target`` without recomputation. Steps with the same weighting are tried first;
        a weighted step's graph is often an unweighted one's (the weights are a multiply
        inside the loss's nodes), so ``fit(class_weight=...)`` after an unweighted
        ``optimize`` runs its schedule without a solve where the graphs match."""
        from tf_remat.errors import PlanError

        if graph.no_remat_peak <= target:
            return None
        wkey = None if weights is None else (tuple(weights.shape.as_list()),
                                              weights.dtype.name)
        cache = self._train if apply_updates else self._grads
        for (batch, key, *_), built in sorted(cache.items(),
                                              key=lambda kv: (kv[0][1] != wkey, -kv[0][0])):
            donor = built.extraction.graph
            if donor.topology_digest != graph.topology_digest:
                continue
            try:
                plan = _adopt_plan(built.plan, graph, target, check_digest=False)
            except PlanError:
                continue
            return dataclasses.replace(plan, info={**plan.info, "plan_source": "reused",
                                                   "reused_from_batch": batch,
                                                   "reused_from_weighted": key is not None})
        return None

    def _cast(self, x, y):
        import tensorflow as tf

        from tf_remat.extract import _leaf_name

        sizes = {}  # batch size -> the first tensor seen with it (named only on an error)

        # what the model declares it takes (a functional model's Inputs; None: any size)
        # (in the spec's order only where the spec is one tensor or a flat list of them: a
        # dict's leaves flatten in key order)
        try:
            declared = [getattr(t, "shape", None) for t in self.model.inputs or ()]
        except Exception:  # noqa: BLE001 (a subclassed model declares no inputs)
            declared = []
        flat = isinstance(self.input_spec, tf.TensorSpec) or (
            isinstance(self.input_spec, (list, tuple)) and
            all(isinstance(s, tf.TensorSpec) for s in self.input_spec))
        if not flat or len(declared) != len(tf.nest.flatten(self.input_spec)):
            declared = []

        def cast(t, spec, where, takes=None):
            t = tf.convert_to_tensor(t)
            got, want = t.shape.as_list(), spec.shape.as_list()
            # the rewritten step is static: a batch of other shapes gets a step (and a plan)
            # of its own (_other_shapes), but not another rank, nor a size the model's own
            # input refuses (a reshape's "Input to reshape is a tensor with 960 values")
            fits = takes is None or (len(takes) == len(got) and all(
                d is None or d == g for d, g in zip(list(takes)[1:], got[1:])))
            if len(got) != len(want) or None in got or not fits:
                why = (f"the model's input takes {tuple(takes)}" if not fits else
                       "a batch of another size or other dimensions gets a plan of its own, "
                       "but it must have the spec's rank and a known shape")
                raise ValueError(
                    f"{where} has shape {tuple(got)} where the step was built for "
                    f"{tuple(want)}: the rewritten step is static, and {why}. Reshape or pad "
                    f"it to that shape, or optimize(..., input_spec=..., label_spec=...) "
                    f"with this one")
            if got:
                sizes.setdefault(got[0], where)
            return t if t.dtype == spec.dtype else tf.cast(t, spec.dtype)

        def conform(v, spec, what):
            # a list of inputs reaches the step from model.fit as a tuple (Keras's data
            # adapters make tuples): the nesting must match, the sequence type need not
            try:
                tf.nest.assert_same_structure(v, spec, check_types=False)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"inputs do not match input_spec / label_spec: {exc}") \
                    from exc
            leaves, specs = tf.nest.flatten(v), tf.nest.flatten(spec)
            takes = declared if what == "x" and declared else [None] * len(specs)
            return tf.nest.pack_sequence_as(spec, [
                cast(t, s, _leaf_name(what, i, len(specs)), d)
                for i, (t, s, d) in enumerate(zip(leaves, specs, takes))])

        x = conform(x, self.input_spec, "x")
        y = conform(y, self.label_spec, "y")
        if len(sizes) > 1:
            raise ValueError(f"inputs and labels disagree on the batch size: "
                             f"{'; '.join(f'{w} has batch size {b}' for b, w in sizes.items())}")
        return x, y

    def _warn_once(self, key, message):
        if key not in self._warned:
            self._warned.add(key)
            warn(message)


# --------------------------------------------------------------------- measuring
def measure_step_peak(step, x, y, *, variables=(), runs: int = 1, warmup: int = 1,
                      device: str | None = None, ballast=(0,),
                      stop_above: int | None = None) -> dict:
    """Run ``step(x, y)`` and read TensorFlow's peak memory; the variables are restored after.

    Returns a dict: ``peak_bytes`` (the allocator's peak during the run, everything in the
    process included), ``current_before`` (allocated when the run started), ``owned_bytes``
    (the variables and the batch, which are part of the step's own memory) and
    ``step_peak_bytes = peak - current_before + owned``: the step's peak as the budget counts
    it, without memory the process holds for other purposes. With ``runs > 1`` the largest.
    ``seconds``: the median wall time of the measured runs; ``runs``: every measured run's
    ``step_peak_bytes``, a list per layout run, in order.

    ``ballast``: one entry per allocator layout: a byte size (a tensor of that size is held
    while ``warmup + runs`` steps run; 0: none) or a tuple of sizes (tensors of those sizes are
    allocated in turn and every other one is freed, so the free memory between the held ones is
    fragmented). The worst peak over all layouts counts (``layouts`` gives each one's). The
    allocator's free chunks differ with what else is allocated, and so does the peak it reports
    for the same step (see ``_MEASURE_BALLAST``); a layout that does not fit on the device is
    skipped.

    ``stop_above``: once a run's ``step_peak_bytes`` is over this many bytes, neither the rest
    of its layout's runs nor the layouts after it run (``stopped`` is then True where a layout
    was left out): the worst can only grow, so a caller that
    asks whether the step fits a budget has its answer. The figure is then a lower bound.
    """
    import numpy as np
    import tensorflow as tf

    from tf_remat.extract import (counted_bytes, current_device_kind, require_memory_stats,
                                  snapshot_variables)

    device = device or f"{current_device_kind()}:0"
    require_memory_stats(device)
    kind = device.split(":")[0]
    saved = snapshot_variables(variables)
    owned = _owned_bytes(variables, kind)
    owned += sum(counted_bytes(int(np.prod(t.shape)) * t.dtype.size, kind)
                 for t in tf.nest.flatten((x, y)))
    peaks, befores, times, layouts, per_run = [], [], [], [], []
    stopped = False
    try:
        for i, size in enumerate(ballast):
            hold = None
            sizes = tuple(size) if isinstance(size, (tuple, list)) else (size,)
            if any(b > 0 for b in sizes):
                try:
                    with tf.device(device):
                        hold = [tf.fill([max(1, int(b) // 4)], 1.0) for b in sizes]
                except tf.errors.ResourceExhaustedError:
                    continue
                if len(hold) > 1:
                    hold = hold[::2]
            for _ in range(warmup):
                _block(step(x, y))
            worst = 0
            per_run.append([])
            for _ in range(max(1, runs)):
                gc.collect()
                tf.config.experimental.reset_memory_stats(device)
                before = tf.config.experimental.get_memory_info(device)["current"]
                t = time.perf_counter()
                _block(step(x, y))
                times.append(time.perf_counter() - t)
                peaks.append(int(tf.config.experimental.get_memory_info(device)["peak"]))
                befores.append(int(before))
                per_run[-1].append(int(peaks[-1] - befores[-1] + owned))
                worst = max(worst, per_run[-1][-1])
                if stop_above is not None and worst > stop_above:
                    break
            layouts.append(int(worst))
            del hold
            if stop_above is not None and worst > stop_above:
                stopped = i < len(ballast) - 1
                break
    finally:
        _restore(variables, saved)
    k = int(np.argmax([p - b for p, b in zip(peaks, befores)]))
    return {"device": device, "peak_bytes": peaks[k], "current_before": befores[k],
            "owned_bytes": int(owned), "step_peak_bytes": int(peaks[k] - befores[k] + owned),
            "seconds": float(np.median(times)), "layouts": layouts, "runs": per_run,
            "stopped": stopped}


def _time_static_order(ex, chain, ispec, lspec, step_args=None) -> dict:
    """Median, over paired rounds, of the static-order step's time over the plain step's; the
    variables are restored after every step. The pairs alternate which step runs first, so a
    burst of load on a shared machine falls on both alike. Where independent loops overlap in
    the static order, the order with every node after the one before is timed too
    (``serial_order_overhead``): the node costs are traced in that one.

    The plain step is the one a user runs without tf-remat: traced with ``step_args`` (the
    :func:`~tf_remat.extract.trace_training_step` arguments of ``ex``) as Keras runs it, with
    TensorFlow's own gradient kernels and none of extract's edits, whose price (or saving) the
    static order's then includes: without oneDNN the edited bn_cnn12 ran 7.5% faster than
    Keras's step, and the demo's overhead measured against Keras's came out 11 points under a
    prediction timed against the edited one. Where that step does not fit the device, or
    without ``step_args``, the edited step stands in (``reference`` says which)."""
    import numpy as np
    import tensorflow as tf

    from tf_remat.extract import snapshot_variables, trace_training_step
    from tf_remat.profile import synthetic_batch
    from tf_remat.rewrite import static_order_step

    static = static_order_step(ex, chain)
    # where loops overlap in it, also the order with every node after the one before
    serial = (static_order_step(ex, chain, overlap_loops=False)
              if static.info.get("run_index") is not None else None)
    plain, reference = ex.traced.function, "traced"
    variables = list(ex.traced.variables)
    if step_args is not None:
        keras_step = trace_training_step(ex.traced.model, ispec, lspec,
                                         conv_gradients="tensorflow", **step_args)
        plain, reference = keras_step.function, "keras"
        seen = {id(v) for v in variables}
        variables += [v for v in keras_step.variables if id(v) not in seen]
    x, y = synthetic_batch(ispec, lspec)
    saved = snapshot_variables(variables)

    def once(fn):
        t = time.perf_counter()
        _block(fn(x, y))
        dt = time.perf_counter() - t
        _restore(variables, saved)
        return dt

    try:
        # the first call builds and optimizes the graph, and the next ones may still grow the
        # allocator's pool into fresh pages: with one warm-up call, MobileNet's static order
        # timed +15% here and -3% in the benchmark's later rounds of the same steps
        if reference == "keras":
            try:
                once(plain)
            except tf.errors.ResourceExhaustedError:
                # Keras's kernels take scratch the edited step does not (27 MiB for a
                # convolution's filter gradient without oneDNN)
                plain, reference = ex.traced.function, "traced"
        for _ in range(_ORDER_WARMUP):
            once(plain)
            once(static)
            if serial is not None:
                once(serial)
        ratios, serial_ratios, plains = [], [], []
        t_end = time.perf_counter() + _ORDER_SECONDS
        for r in range(_ORDER_ROUNDS):
            if r >= _ORDER_MIN_ROUNDS and time.perf_counter() > t_end:
                break
            if r % 2:
                ts, tp = once(static), once(plain)
            else:
                tp, ts = once(plain), once(static)
            ratios.append(ts / tp)
            plains.append(tp)
            if serial is not None:
                serial_ratios.append(once(serial) / tp)
    finally:
        _restore(variables, saved)
    out = {"static_order_overhead": float(np.median(ratios)) - 1,
           "plain_seconds": float(np.median(plains)), "rounds": len(ratios),
           "static_step": static, "reference": reference}
    if serial is not None:
        out["serial_order_overhead"] = float(np.median(serial_ratios)) - 1
    return out


def step_allocations(step, x, y, *, variables=(), settle: float = 0.0) -> dict:
    """One run of ``step(x, y)`` under TensorFlow's profiler: what its allocations asked for
    and what the allocator gave them. The variables are restored after.

    ``settle``: seconds to wait between the warm-up call and the profiled one. Called right
    after another call, a step may copy a variable it updates after the variable's last
    reader (copy on write: some reference in TensorFlow's runtime still holds the old buffer):
    a two-layer MLP's step called back to back copied its 16 MiB kernel in 4 to 6 calls of 16,
    with 0.2 s between calls in 1 of 16 (a benchmark running beside it). A pause lets the
    profiled call request what the step itself holds.

    Returns a dict: ``requested_peak_bytes``, the peak over the step of the bytes its kernels
    requested and still hold (the quantity :func:`tf_remat.plan.simulate` models);
    ``held_peak_bytes``, the same for the chunks the allocator handed out (TensorFlow's BFC
    allocator gives a whole free chunk when it is less than twice the request, so this is what
    ``get_memory_info`` counts); ``fresh_pool_held_peak_bytes``, what the same requests would
    hold in an empty pool (:func:`tf_remat.allocator.replay`; the rest of ``held_peak_bytes``
    is what earlier allocations left in the allocator); ``owned_bytes``, the variables, which
    the step does not allocate; ``allocations``, how many allocations the step made. Add
    ``owned_bytes`` and the batch's bytes to compare with a budget. The peaks are of the net
    change over the step, as ``measure_step_peak`` counts it: allocations made during the step,
    less what the step frees of memory allocated before it (the old buffers of the variables
    it updates).
    """
    from tf_remat.allocator import replay
    from tf_remat.extract import (current_device_kind, profiled_memory_events,
                                  require_memory_stats, snapshot_variables)

    kind = current_device_kind()
    require_memory_stats(f"{kind}:0")  # the profiler's memory events come from the same stats
    saved = snapshot_variables(variables)
    owned = _owned_bytes(variables, kind)
    try:
        _block(step(x, y))  # a function's first call allocates its own state: not the step
        if settle > 0:
            time.sleep(settle)
        events = profiled_memory_events(lambda: _block(step(x, y)))
    finally:
        _restore(variables, saved)
    if not events:
        raise RematError("TensorFlow's profiler recorded no memory events for the step")
    live, req, held, best_req, best_held, count = {}, 0, 0, 0, 0, 0
    for _, alloc, st in events:
        if alloc:
            live[st.get("addr")] = (st.get("requested_bytes", 0), st.get("allocation_bytes", 0))
            req += live[st.get("addr")][0]
            held += live[st.get("addr")][1]
            count += 1
        elif st.get("addr") in live:
            r, h = live.pop(st.get("addr"))
            req -= r
            held -= h
        else:
            # memory allocated before the step and freed in it: a variable's old buffer, once
            # its update's new one (allocated here) replaces it. Counting the new buffer and
            # not this free put InceptionV3's requests 72 MiB over the simulated peak, which
            # counts a variable once; net, they were within 0.2% of it
            req -= st.get("requested_bytes", 0)
            held -= st.get("allocation_bytes", 0)
        best_req, best_held = max(best_req, req), max(best_held, held)
    # the same requests in an empty pool: what the step's own pattern costs, apart from what
    # earlier allocations left in the allocator
    fresh = replay((alloc, st.get("addr"), st.get("requested_bytes", 0))
                   for _, alloc, st in events)
    return {"requested_peak_bytes": int(best_req), "held_peak_bytes": int(best_held),
            "fresh_pool_held_peak_bytes": fresh["held_peak_bytes"],
            "owned_bytes": int(owned), "allocations": count}


# --------------------------------------------------------------------- solving
def solve_isolated(graph, budget: int, strategy="auto", *, time_limit=None, verbose: int = 0,
                   **options):
    """:func:`tf_remat.solvers.solve` in a fresh Python process that never imports TensorFlow.

    OR-Tools' CP-SAT crashes (segmentation fault in ``Solve``) in a process that imported
    TensorFlow before OR-Tools (google/or-tools#3230; reproduced with TensorFlow 2.21 and
    OR-Tools 9.15), and a Keras user's process has always imported TensorFlow first. The graph
    goes to the child as JSON and the plan comes back as JSON; the child's progress lines go to
    stderr. A callable strategy cannot cross a process boundary and is solved here; so is every
    solve when the environment variable ``TF_REMAT_SOLVE_IN_PROCESS=1`` is set.

    Raises:
        StrategyError: an unknown strategy or option (raised here, before any process starts).
        RematError: the solver process failed (its last stderr lines are in the message).
    """
    from tf_remat.plan import Plan
    from tf_remat.solvers import get_strategy, solve

    if callable(strategy) or os.environ.get("TF_REMAT_SOLVE_IN_PROCESS") == "1":
        return solve(graph, budget, strategy, time_limit=time_limit, verbose=verbose, **options)
    get_strategy(strategy)  # unknown names fail here, with the list of valid ones
    import json

    with tempfile.TemporaryDirectory(prefix="tf_remat_solve_") as tmp:
        gpath = os.path.join(tmp, "graph.json")
        ppath = os.path.join(tmp, "plan.json")
        graph.save(gpath)
        args = {"graph": gpath, "plan": ppath, "budget": int(budget), "strategy": strategy,
                "time_limit": time_limit, "verbose": int(verbose), "options": options}
        apath = os.path.join(tmp, "args.json")
        with open(apath, "w") as f:
            json.dump(args, f)
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                    else "")
        proc = subprocess.run(
            [sys.executable, "-c", "from tf_remat.api import _solve_main; _solve_main()", apath],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE if not verbose else None,
            text=True)
        if proc.returncode != 0 or not os.path.exists(ppath):
            tail = (proc.stderr or "")[-2000:] if not verbose else "(see the output above)"
            raise RematError(f"the solver process for strategy {strategy!r} failed with exit "
                             f"code {proc.returncode}: {tail}")
        plan = Plan.load(ppath)
    # the graph written and read back is the same graph: check the plan against this one
    from tf_remat.plan import simulate

    sim = simulate(graph, plan.steps) if plan.steps else None
    if sim is not None and sim.peak_memory != plan.peak_memory:  # pragma: no cover
        raise RematError("internal error: the plan from the solver process does not match "
                         "the graph")
    return plan


def _solve_main():  # pragma: no cover (runs in the child process)
    import json

    from tf_remat.graph import Graph
    from tf_remat.solvers import solve

    with open(sys.argv[1]) as f:
        a = json.load(f)
    graph = Graph.load(a["graph"])
    plan = solve(graph, a["budget"], a["strategy"], time_limit=a["time_limit"],
                 verbose=a["verbose"], **a["options"])
    plan.save(a["plan"])


# --------------------------------------------------------------------- helpers
def _given_plan(plan):
    """``optimize``'s ``plan=``: None, a Plan, or a path to one."""
    from tf_remat.plan import Plan

    if plan is None or isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, os.PathLike)):
        return Plan.load(plan)
    raise TypeError(f"plan must be a tf_remat.Plan or the path of a saved one, got "
                    f"{type(plan).__name__}")


def _adopt_plan(given, graph, budget, check_digest=True):
    """The given plan re-simulated on this graph, after checking it was made for it."""
    from tf_remat.errors import PlanError
    from tf_remat.plan import simulate

    digest = given.info.get("graph_digest")
    what = (f"plan for {given.graph!r} does not fit this model's step ({graph.name!r}, "
            f"{graph.n} nodes)")
    fix = ("pass a plan saved from tf_remat.optimize of this model, loss and optimizer at "
           "this batch size, or drop plan= to solve")
    if check_digest and digest is not None and digest != graph.structure_digest:
        raise PlanError(f"{what}: it was made for a graph with other nodes, memory or edges; "
                        f"{fix}")
    if not given.steps:
        raise PlanError(f"the given plan for {given.graph!r} has no steps; {fix}")
    try:
        sim = simulate(graph, given.steps)
    except PlanError as exc:
        raise PlanError(f"{what}: {exc}; {fix}") from None
    if sim.peak_memory > budget:
        raise PlanError(f"the given plan peaks at {format_bytes(sim.peak_memory)} on this step, "
                        f"over the budget {format_bytes(budget)}: raise the budget or drop "
                        f"plan= to solve")
    return dataclasses.replace(
        given, budget=int(budget), peak_memory=sim.peak_memory, cost=sim.cost,
        total_cost=graph.total_cost, solve_seconds=0.0,
        info={**given.info, "plan_source": "given", "graph_digest": graph.structure_digest})


#: what ``strategy="auto"`` falls back to while the ``auto`` strategy is not in this build
_AUTO_FALLBACK = "moccasin"


def _resolve_strategy(strategy, verbose):
    """``"auto"`` when its module is missing -> :data:`_AUTO_FALLBACK` (with a warning); other
    names are checked here so an unknown one fails before any tracing."""
    from tf_remat.errors import StrategyError
    from tf_remat.solvers import get_strategy

    if callable(strategy):
        return strategy
    try:
        get_strategy(strategy)
    except StrategyError as exc:
        if strategy != "auto" or "not available" not in str(exc):
            raise
        warn(f"tf-remat: {exc}; using strategy {_AUTO_FALLBACK!r} instead")
        return _AUTO_FALLBACK
    return strategy


def _budget_bytes(budget_gb, budget_bytes) -> int:
    if (budget_gb is None) == (budget_bytes is None):
        raise ValueError("give exactly one of budget_gb (GiB, 2**30 bytes) or budget_bytes")
    value = budget_bytes if budget_bytes is not None else budget_gb * 2**30
    try:
        value = float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the budget must be a number, got {value!r}") from exc
    if not value > 0:
        raise ValueError(f"the budget must be positive, got {value!r}")
    return int(value)


def _raise_infeasible(graph, plan, budget, opts, loop_bytes=None):
    lb = graph.budget_lower_bound
    reach = plan.peak_memory if plan.steps else None
    # a cheap search for the smallest peak any plan reaches, for the message
    for s in ("linearized-greedy", "chen-greedy"):
        try:
            p = solve_isolated(graph, lb, s, time_limit=10, verbose=0)
        except RematError:
            continue
        if p.steps and (reach is None or p.peak_memory < reach):
            reach = p.peak_memory
    if opts.get("strategy") == "auto" and not opts.get("probe") and reach is not None and \
            reach > lb:
        # the greedy baselines' lowest peak can be far above what a solver reaches (the
        # README's conv net: 98 MiB, where auto reached 50.5 in 10 s), and the message tells
        # the user to raise the budget to it (max_batch_size's probes, which only need to know
        # that a size fails, skip this). Aimed 5% over the bound: aimed at the bound itself,
        # MOCCASIN returned a plan 32% over it on that graph, at 1.05 times it one 0.6% over
        limit = 10 if opts.get("time_limit") is None else min(10, opts["time_limit"])
        if opts.get("verbose"):
            print(f"tf-remat: no plan within {format_bytes(budget)}; searching {limit:g} s "
                  f"for the smallest budget a plan reaches", file=sys.stderr, flush=True)
        try:
            p = solve_isolated(graph, int(1.05 * lb), "auto", time_limit=limit, verbose=0)
        except RematError:
            p = None
        if p is not None and p.steps and p.peak_memory < reach:
            reach = p.peak_memory
    reach = max(reach if reach is not None else lb, lb)
    msg = (f"budget {format_bytes(budget)} ({budget} B) is below what any plan found reaches: "
           f"the smallest peak found is {format_bytes(reach)} ({reach} B)")
    if budget < lb:
        msg += (f", and no plan can go below {format_bytes(lb)} (node "
                f"{graph.label(graph.bottleneck())} with its inputs, plus "
                f"{format_bytes(graph.fixed_memory)} of weights, optimizer slots and the batch)")
    msg += (f"; the step without rematerialization peaks at {format_bytes(graph.no_remat_peak)}."
            f" Raise the budget to at least {format_bytes(reach)}, lower the batch size, or "
            f"give the solver more time (strategy {plan.strategy!r}, time_limit="
            f"{opts.get('time_limit')})")
    if loop_bytes:
        msg += (f". The step's tf.while_loop(s) ({_loop_layers(loop_bytes)}) keep "
                f"{format_bytes(sum(loop_bytes.values()))} for the backward pass, which a plan "
                f"must keep until then (such a loop runs once: its body draws random numbers "
                f"or writes state, so a second run would compute other values; draw them "
                f"before the loop and pass them in, as Keras's RNN layers do their dropout "
                f"masks, and the loop may be recomputed)")
    raise InfeasibleBudgetError(msg, budget=budget, min_feasible=reach, plan=plan)


def _loop_layers(loops) -> str:
    """The layers that run the loop ops named in ``loops``, at most four shown."""
    names = sorted({name.rsplit("/while", 1)[0] for name in loops})
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _loops_note(loops) -> str:
    return (f"the step runs {len(loops)} tf.while_loop(s) ({_loop_layers(loops)}) "
            f"whose trip count is not "
            f"static: what such a loop keeps for its gradient is invisible to the plan, which "
            f"counts none of its memory, so only the measured check holds the budget. Give "
            f"the loop a static maximum_iterations (its memory is then counted) or unroll it "
            f"(for an RNN layer, unroll=True makes every time step ops the plan can schedule)")


def _has_compiled_metrics(model) -> bool:
    """Whether ``model.compile(metrics=..., weighted_metrics=...)`` gave metrics to update."""
    cm = getattr(model, "_compile_metrics", None)
    if cm is None:
        return False
    return bool(getattr(cm, "_user_metrics", None) or getattr(cm, "_user_weighted_metrics", None))


def _weight_spec(spec):
    """``optimize``'s ``sample_weight_spec`` as a floating ``tf.TensorSpec`` with the batch
    dimension first; a clear error otherwise."""
    import tensorflow as tf

    if not isinstance(spec, tf.TensorSpec):
        raise ValueError(f"sample_weight_spec must be a tf.TensorSpec, such as "
                         f"tf.TensorSpec((batch,)), got {spec!r}")
    if spec.shape.rank is None or spec.shape.rank < 1 or not spec.shape.is_fully_defined():
        raise ValueError(f"sample_weight_spec needs a known shape with the batch dimension "
                         f"first, such as tf.TensorSpec((batch,)); got {spec}")
    if not spec.dtype.is_floating:
        spec = tf.TensorSpec(spec.shape, tf.float32)
    return spec


def _first_dim(spec) -> int:
    import tensorflow as tf

    s = tf.nest.flatten(spec)[0]
    return int(s.shape[0]) if s.shape.rank else 1


def _form(batch, shapes) -> str:
    """"batch size 8", or the shapes of a batch whose other dimensions differ from the specs."""
    if shapes is None:
        return f"batch size {batch}"
    return "inputs and labels of shapes " + ", ".join(str(s) for s in shapes)


def _spec_shapes(step):
    import tensorflow as tf

    return tuple(tuple(s.shape.as_list()) for s in
                 tf.nest.flatten(step.input_spec) + tf.nest.flatten(step.label_spec))


def _batch_of(x) -> int:
    import tensorflow as tf

    t = tf.nest.flatten(x)[0]
    shape = getattr(t, "shape", None)
    if shape is None or len(shape) == 0:
        return 1
    return int(shape[0])


def _owned_bytes(variables, kind) -> int:
    """Bytes the variables hold as TensorFlow counts them: the step's own, not allocated by it."""
    from tf_remat.extract import variable_bytes

    return sum(variable_bytes(v, kind) for v in variables)


def _restore(variables, values):
    from tf_remat.extract import restore_variables

    restore_variables(variables, values)


def _block(out):
    from tf_remat.extract import block

    block(out)
