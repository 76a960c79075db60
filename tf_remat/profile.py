"""Node costs for an extracted graph: measured on this machine, or estimated from FLOPs.

``cost_model="profile"`` (:func:`profile_nodes`): every node's ops are run in isolation on the
current device (the GPU when TensorFlow sees one, else the CPU). For each distinct node signature
(op types, attributes, input shapes and dtypes, the values of constant inputs) a small
``tf.function`` is built from the node's NodeDefs, with placeholders for the inputs it reads from
other nodes (filled with random values of the right shape and dtype: floats in [0.5, 1.5),
integers 0 unless the value is static, e.g. a shape) and fresh variables for the variables it
updates, so the model's own variables never change. It is run ``warmup`` times, then ``runs``
times; the cost is the median minus the cost of calling an empty function with as many inputs.
Identical signatures are measured once (a ResNet's repeated blocks cost one measurement), and
results are cached on disk, keyed by the device, TensorFlow version, oneDNN setting and the
signature, in ``$TF_REMAT_CACHE`` (default ``~/.cache/tf_remat``).

``cost_model="step"`` (:func:`step_costs`, what ``tf_remat.optimize`` uses): those costs, then,
on a CPU, each node's share of the step's time where the step runs it: the graph is rewritten in
a static order with nothing recomputed and traced by ``tf.profiler`` for a few runs (the
variables restored after each). Alone, a node measures more than its kernels take in the step,
and unevenly: on a 2-core AMD EPYC the transformer's softmax kernel took 0.69 ms alone and
0.43-0.54 ms in the step, its softmax and dropout nodes cost 2-3 times their in-step time and
its MatMuls 1.2 times, and two fresh profiles of it summed to 410 and 328 ms (the step's
kernels: 175-210 ms). That priced the recomputation the solver chose at 0.5-0.7 of what it cost
in the step.

``cost_model="flops"`` (:func:`flops_costs`): no measurement. Each op costs
``flops / FLOP_RATE + bytes_moved / BANDWIDTH + OP_OVERHEAD`` with rough constants for a CPU
core pair or a GPU (contractions counted exactly, everything else as memory traffic). It ranks
nodes sensibly but its absolute seconds can be off by 2x or more; use it where profiling is not
wanted (CI, a machine busy with other work) and ``step`` for real plans.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import tempfile
import time
import weakref

__all__ = ["profile_nodes", "step_costs", "op_seconds", "traced_op", "flops_costs", "cache_dir",
           "device_key", "node_signature"]

_CACHE_VERSION = 1
#: rough throughput constants of the ``flops`` cost model, per device kind
FLOPS_MODEL = {
    "CPU": {"flop_rate": 60e9, "bandwidth": 8e9, "op_overhead": 4e-6},
    "GPU": {"flop_rate": 15e12, "bandwidth": 1.0e12, "op_overhead": 8e-6},
}
_MIN_OP_SECONDS = 1e-6  # a profiled node never costs less than this per op


def cache_dir() -> str:
    """Where profiles are cached: ``$TF_REMAT_CACHE`` or ``~/.cache/tf_remat``."""
    return os.environ.get("TF_REMAT_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "tf_remat")


def device_key() -> str:
    """What a cached cost depends on besides the node: device, TF version, oneDNN, threads."""
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU")
    if gpus:
        try:
            details = tf.config.experimental.get_device_details(
                tf.config.list_physical_devices("GPU")[0])
            dev = "GPU:" + str(details.get("device_name", "gpu"))
        except Exception:  # noqa: BLE001
            dev = "GPU"
    else:
        dev = "CPU:" + _cpu_model() + f":{os.cpu_count()}cores"
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "default")
    threads = (tf.config.threading.get_inter_op_parallelism_threads(),
               tf.config.threading.get_intra_op_parallelism_threads())
    return f"{dev}|tf{tf.__version__}|onednn={onednn}|threads={threads}"


def profile_nodes(traced, op_map, *, verbose: int = 1, runs: int = 5, warmup: int = 2,
                  cache: bool = True, directory: str | None = None):
    """Measure each node of ``op_map`` on the current device.

    Returns:
        ``(costs, info)``: seconds per node, and facts (``profile_seconds``, ``signatures``,
        ``measured``, ``cache_hits``, ``profile_failures``, ``device``).
    """
    import tensorflow as tf

    t0 = time.perf_counter()
    fgraph = traced.function.graph
    dkey = device_key()
    path = os.path.join(directory or cache_dir(),
                        "costs-" + hashlib.sha1(dkey.encode()).hexdigest()[:16] + ".json")
    table = _load_cache(path) if cache else {}
    specs, sigs = [], []
    for ops in op_map.nodes:
        # no ops: a kernel's scratch space (extract.with_workspace_nodes), which costs nothing
        spec = _NodeSpec(fgraph, ops, traced) if ops else None
        specs.append(spec)
        sigs.append(spec.signature if ops else None)
    unique = [s for s in dict.fromkeys(sigs) if s is not None]
    todo = [s for s in unique if s not in table]
    first = {}
    for spec in specs:
        if spec is not None:
            first.setdefault(spec.signature, spec)
    bar = None
    if verbose and todo:
        import keras

        print(f"profiling {len(todo)} node signatures ({len(unique) - len(todo)} cached, "
              f"{len(specs)} nodes) on {dkey.split('|')[0]}")
        bar = keras.utils.Progbar(len(todo), unit_name="signature")
    failures = []
    overhead = _Overhead()
    fresh = {}
    last_save = time.perf_counter()
    for k, sig in enumerate(todo):
        spec = first[sig]
        try:
            seconds = spec.measure(runs=runs, warmup=warmup, overhead=overhead)
        except Exception as exc:  # noqa: BLE001 (one odd node must not stop the profile)
            failures.append(f"{spec.ops[0]}: {type(exc).__name__}: {str(exc)[:200]}")
            seconds = None
        if seconds is not None:
            table[sig] = seconds
            fresh[sig] = seconds
        if bar is not None:
            bar.update(k + 1)
        if cache and fresh and time.perf_counter() - last_save > 30:
            _save_cache(path, dkey, table)
            last_save = time.perf_counter()
    if cache and fresh:
        _save_cache(path, dkey, table)
    est = None
    costs = []
    for spec, sig in zip(specs, sigs):
        if spec is None:
            costs.append(0.0)
            continue
        c = table.get(sig)
        if c is None:  # the node could not be run alone: fall back to the estimate
            if est is None:
                est = _FlopsModel()
            c = est.node_cost(spec.op_objs)
        costs.append(max(float(c), _MIN_OP_SECONDS * len(spec.ops)))
    del tf
    return costs, {"profile_seconds": time.perf_counter() - t0, "signatures": len(unique),
                   "measured": len(fresh), "cache_hits": len(unique) - len(todo),
                   "profile_failures": failures, "device": dkey, "cache_file": path}


def step_costs(extraction, *, reps: int = 5, warmup: int = 2):
    """Node costs from the step itself: the extraction's graph run in a static order with
    nothing recomputed (:func:`tf_remat.rewrite.static_order_step`), ``reps`` times under
    TensorFlow's profiler, each op's share of the step's time summed over its node.

    A node's ops cost less in the step than alone: on a 2-core AMD EPYC the transformer's
    isolated costs summed to 2.2 times the kernels the ordered step ran, and not evenly (its
    softmax and dropout nodes 2-3 times, its MatMuls 1.2), so the recomputation of the nodes
    the solver found cheapest was priced at 0.5-0.7 of what it took in the step. An op's share
    (:func:`op_seconds` with ``share=True``) divides each instant among the kernels running
    then and gives the executor's time between kernels to the kernel it started next: summed
    kernel times count twice what runs side by side (an LSTM step's loop bodies ran kernels
    whose times summed to 1.5-2.5 times the step's), and the time between kernels belongs to
    the ops that wait on it (a loop pays it per iteration). A node none of whose ops appear in
    the trace (Grappler merged them into another node's op under a name not traced back) keeps
    its isolated cost, scaled by the median ratio of the traced nodes. The order traced runs
    every node after the one before (``overlap_loops=False``): a loop's cost is what it takes
    alone, which :func:`tf_remat.plan.run_cost` turns into the time of a plan whose loops
    overlap where its memory allows.

    CPU only: on a GPU the profiler's host events time kernel launches, not kernels. The
    step runs on a synthetic batch and every variable it captures is restored after each run
    (untimed), so the model's weights, optimizer slots and RNG state do not change.

    Returns:
        ``(costs, info)``: seconds per node (None when the step could not be traced: on a GPU,
        out of memory, a profiler session already running; ``info["step_costs"]`` says why).
    """
    import tensorflow as tf

    from tf_remat.extract import block, restore_variables, snapshot_variables
    from tf_remat.rewrite import static_order_step

    t0 = time.perf_counter()
    if tf.config.list_logical_devices("GPU"):
        return None, {"step_costs": "not traced: on a GPU the trace times kernel launches"}
    traced, op_map, graph = extraction.traced, extraction.op_map, extraction.graph
    variables = traced.variables
    saved = snapshot_variables(variables)
    try:
        step = static_order_step(extraction, overlap_loops=False)
        x, y = synthetic_batch(traced.input_spec, traced.label_spec)
        seconds, wall = op_seconds(lambda: block(step(x, y)), reps=reps, warmup=warmup,
                                   reset=lambda: restore_variables(variables, saved),
                                   share=True)
    except Exception as exc:  # noqa: BLE001 (the isolated costs stand in; lose nothing)
        return None, {"step_costs": f"not traced: {type(exc).__name__}: {str(exc)[:200]}"}
    finally:
        restore_variables(variables, saved)
    node_of = {name: i for i, ops in enumerate(op_map.nodes) for name in ops}
    per = [0.0] * graph.n
    unmatched = 0.0
    for name, sec in seconds.items():
        op = traced_op(name, node_of)
        if op is None:
            unmatched += sec
        else:
            per[node_of[op]] += sec
    iso = graph.cost
    ratios = [per[i] / iso[i] for i, ops in enumerate(op_map.nodes)
              if ops and per[i] > 0 and iso[i] > 0]
    scale = statistics.median(ratios) if ratios else 1.0
    untraced = [i for i, ops in enumerate(op_map.nodes) if ops and per[i] == 0]
    for i in untraced:
        per[i] = iso[i] * scale
    costs = [max(c, _MIN_OP_SECONDS * len(ops)) if ops else 0.0
             for c, ops in zip(per, op_map.nodes)]
    return costs, {"step_costs": "traced", "step_trace_seconds": time.perf_counter() - t0,
                   "step_wall_seconds": wall, "step_unmatched_seconds": unmatched,
                   "step_untraced_nodes": len(untraced),
                   "isolated_over_step": 1 / scale if scale else None}


_RUN_EVENT = "tf_remat.op_seconds"  # the profiler event around each traced call


def op_seconds(run, *, reps: int = 5, warmup: int = 2, reset=None, share: bool = False):
    """Seconds per call of ``run()`` that each op's kernels ran, from a ``tf.profiler`` trace
    of ``reps`` calls (per op, the median over the calls of its time in each); and the seconds
    per call: the least of up to three untraced calls before them (the profiler adds its own
    time to every kernel). Those follow ``warmup - 1`` (at least one) calls not timed; a call
    over a second is timed once and traced twice. ``reset()``, when given, runs after every
    call, untimed and outside the traced calls (restoring the variables).

    ``share=True``: each op's share of the call's time instead of its kernels' durations.
    Every instant of a traced call between its first kernel's start and its last one's end is
    divided among the kernels running then, a stretch with none running goes to the kernel
    that starts after it, and the shares are scaled to sum to the untraced call's time.

    The host events named ``op_name:OpType`` are the CPU kernels (on a GPU they time the
    launches). Op names inside a rewritten step (the function ``remat``) lose that prefix.
    """
    import glob
    import shutil
    import tempfile

    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    reset = reset or (lambda: None)
    for _ in range(max(1, warmup - 1)):
        run()  # the first call builds and optimizes the function
        reset()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
        reset()
        if times[-1] > 1.0:  # a slow step (a big model on a CPU): fewer calls
            reps = min(reps, 2)
            break
    logdir = tempfile.mkdtemp(prefix="tf_remat_trace_")
    try:
        tf.profiler.experimental.start(logdir)
        try:
            for _ in range(reps):
                with tf.profiler.experimental.Trace(_RUN_EVENT):
                    run()
                reset()
        finally:
            tf.profiler.experimental.stop()
        space = xplane_pb2.XSpace()
        found = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
        if not found:
            raise RuntimeError("the profiler wrote no trace")
        with open(found[0], "rb") as f:
            space.ParseFromString(f.read())
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    calls, kernels = [], []
    for plane in space.planes:
        meta = {k: v.name for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            base = line.timestamp_ns * 1000
            for e in line.events:
                full = meta.get(e.metadata_id, "")
                start = base + e.offset_ps
                if full == _RUN_EVENT:
                    calls.append((start, start + e.duration_ps))
                    continue
                name, sep, kind = full.partition(":")
                # "EagerLocalExecute: __inference_...", "ExecutorState::Process" and the like
                # are calls and the executor, not kernels
                if not sep or not name or not kind.isidentifier() or \
                        name.startswith("__inference"):
                    continue
                name = name[len("remat/"):] if name.startswith("remat/") else name
                kernels.append((start, start + e.duration_ps, name))
    if len(calls) != reps:
        raise RuntimeError(f"the trace holds {len(calls)} of the {reps} calls")
    calls.sort()
    kernels.sort()
    per_call = [{} for _ in calls]
    k = 0
    for c, (lo, hi) in enumerate(calls):
        while k < len(kernels) and kernels[k][0] < lo:
            k += 1  # a kernel outside the calls (reset's): not the step's
        inside = []
        while k < len(kernels) and kernels[k][0] <= hi:
            inside.append(kernels[k])
            k += 1
        spent = _shares(inside) if share else [(n, (e - s) * 1e-12) for s, e, n in inside]
        for name, sec in spent:
            per_call[c][name] = per_call[c].get(name, 0.0) + sec
    # the median over the calls, so that a burst of load on this machine during one call
    # does not price an op
    names = {name for d in per_call for name in d}
    ops = {name: statistics.median(d.get(name, 0.0) for d in per_call) for name in names}
    if share:
        total = sum(ops.values())
        ops = {name: sec * min(times) / total for name, sec in ops.items()} if total else ops
    return ops, min(times)


def _shares(kernels):
    """``[(name, seconds)]``: each kernel's share of the time from the first kernel's start to
    the last one's end (``kernels``: ``(start_ps, end_ps, name)`` sorted by start). Each
    stretch is split evenly among the kernels running in it; a stretch with none running is
    given to the kernel that starts at its end."""
    bounds = sorted([(s, 1, i) for i, (s, _, _) in enumerate(kernels)]
                    + [(e, 0, i) for i, (_, e, _) in enumerate(kernels)])
    got = [0.0] * len(kernels)
    active, idle, last = set(), 0, None
    for t, starts, i in bounds:
        if last is not None and t > last:
            if active:
                each = (t - last) / len(active)
                for j in active:
                    got[j] += each
            else:
                idle += t - last
        if starts:
            got[i] += idle
            idle = 0
            if kernels[i][1] > t:  # a zero-length kernel's end sorted before its start
                active.add(i)
        else:
            active.discard(i)
        last = t
    return [(n, g * 1e-12) for (_, _, n), g in zip(kernels, got)]


def traced_op(name: str, known) -> str | None:
    """The op of ``known`` a traced kernel name belongs to: the name itself; a Grappler
    rewrite's ``scope/ArithmeticOptimizer/FoldTransposeIntoMatMul_MatMul_1`` is
    ``scope/MatMul_1`` (the optimizer's segment and the rewrite's leading tokens dropped);
    else the longest known prefix at a ``/`` (an op named below the one it came from)."""
    if name in known:
        return name
    parts = name.split("/")
    for k, part in enumerate(parts[:-1]):
        if part.endswith("Optimizer"):
            scope, toks = parts[:k], "/".join(parts[k + 1:]).split("_")
            for j in range(1, len(toks)):
                cand = "/".join(scope + ["_".join(toks[j:])])
                if cand in known:
                    return cand
            break
    for k in range(len(parts) - 1, 0, -1):
        cand = "/".join(parts[:k])
        if cand in known:
            return cand
    return None


def synthetic_batch(input_spec, label_spec):
    """Inputs shaped like the specs: normal floats, zero integers (valid labels and token ids
    for any class count). Memory does not depend on the values."""
    import tensorflow as tf

    def make(spec):
        if spec.dtype.is_floating:
            return tf.random.stateless_normal(spec.shape, seed=(1, 2), dtype=spec.dtype)
        return tf.zeros(spec.shape, spec.dtype)

    return tf.nest.map_structure(make, input_spec), tf.nest.map_structure(make, label_spec)


def flops_costs(traced, op_map):
    """Estimated seconds per node from FLOPs and bytes moved (no measurement).

    Returns:
        ``(costs, info)``.
    """
    fgraph = traced.function.graph
    model = _FlopsModel()
    costs = [model.node_cost([fgraph.get_operation_by_name(n) for n in ops]) if ops else 0.0
             for ops in op_map.nodes]
    return costs, {"flops_model": dict(model.constants), "device_kind": model.kind}


def node_signature(traced, ops) -> str:
    """The cache key of one node (op types, attributes, shapes, constant inputs)."""
    return _NodeSpec(traced.function.graph, ops, traced).signature


# --------------------------------------------------------------------- implementation
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _load_cache(path):
    try:
        with open(path) as f:
            doc = json.load(f)
        if doc.get("version") == _CACHE_VERSION:
            return dict(doc.get("costs", {}))
    except (OSError, ValueError):
        pass
    return {}


def _save_cache(path, dkey, table):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    current = _load_cache(path)  # another process may have added entries meanwhile
    current.update(table)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({"version": _CACHE_VERSION, "device": dkey, "costs": current}, f)
    os.replace(tmp, path)


class _Overhead:
    """Seconds to call an (almost) empty function with k inputs, measured once per k."""

    def __init__(self):
        self.cache = {}

    def __call__(self, k_in: int) -> float:
        import tensorflow as tf

        k = max(1, min(k_in, 64))
        if k not in self.cache:
            specs = [tf.TensorSpec((), tf.float32)] * k
            fn = tf.function(lambda *xs: tf.add_n(list(xs)) if len(xs) > 1 else xs[0] + 1.0)
            cf = fn.get_concrete_function(*specs)
            args = [tf.constant(1.0)] * k
            for _ in range(5):
                cf(*args)
            times = []
            for _ in range(21):
                t = time.perf_counter()
                cf(*args)
                times.append(time.perf_counter() - t)
            self.cache[k] = statistics.median(times)
        return self.cache[k]


_SKIP_ATTRS = ("_class", "_output_shapes",
               "_read_only_resource_inputs", "_has_manual_control_dependencies")


class _NodeSpec:
    """One node's ops as a standalone subgraph: signature, build, measure."""

    def __init__(self, fgraph, ops, traced):
        self.fgraph = fgraph
        self.traced = traced
        self.ops = list(ops)
        self.op_objs = [fgraph.get_operation_by_name(n) for n in self.ops]
        local = {op.name: i for i, op in enumerate(self.op_objs)}
        self.local = local
        self.externals = []    # (tensor, kind) kind: 'ph' | 'const' | 'static' | 'res'
        ext_index = {}
        parts = []
        for op in self.op_objs:
            ins = []
            for t in op.inputs:
                src = t.op
                if src.name in local:
                    ins.append(("i", local[src.name], t.value_index))
                    continue
                if t.name not in ext_index:
                    ext_index[t.name] = len(self.externals)
                    self.externals.append((t, self._kind(t)))
                k = ext_index[t.name]
                tt, kind = self.externals[k]
                ins.append(("e", k, kind, t.dtype.name, tuple(t.shape.as_list()
                                                              if t.shape.rank is not None
                                                              else ()), self._value_key(tt, kind)))
            ctrl = tuple(sorted(local[c.name] for c in op.control_inputs if c.name in local))
            attrs = []
            for key in sorted(op.node_def.attr):
                if key in _SKIP_ATTRS or key.startswith("_"):
                    continue
                attrs.append((key, op.node_def.attr[key].SerializeToString(deterministic=True)))
            outs = tuple((o.dtype.name, tuple(o.shape.as_list()) if o.shape.rank is not None
                          else None) for o in op.outputs)
            parts.append((op.type, tuple(ins), ctrl, tuple(attrs), outs))
        self.signature = hashlib.sha1(repr(parts).encode()).hexdigest()

    def _kind(self, t):
        import tensorflow as tf

        if t.dtype == tf.resource:
            return "res"
        if t.op.type == "Const":
            return "const"
        if not (t.dtype.is_floating or t.dtype.is_complex) and self._static(t) is not None:
            return "static"
        return "ph"

    def _static(self, t):
        """The value of an integer input that depends only on static shapes, or None."""
        memo = _FOLDED.setdefault(self.fgraph, {})
        if t.name not in memo:
            v = _shape_value(t)
            memo[t.name] = v if v is not None else _fold(t)
        return memo[t.name]

    def _value_key(self, t, kind):
        if kind == "const":
            return hashlib.sha1(t.op.node_def.attr["value"].SerializeToString(
                deterministic=True)).hexdigest()[:16]
        if kind == "static":
            v = self._static(t)
            return hashlib.sha1(repr(v.tolist()).encode()).hexdigest()[:16]
        if kind == "res":
            var = self.traced.captures.get(t.op.name)
            if var is not None:
                return (var.dtype.name, tuple(var.shape.as_list()))
        return None

    # ---------------------------------------------------------- build + run
    def build(self):
        """A concrete function running the node's ops, its arguments and captured variables."""
        import tensorflow as tf
        from tensorflow.core.framework import graph_pb2

        gd = graph_pb2.GraphDef()
        names = {}
        feeds = []     # (placeholder name, value)
        variables = []
        input_map = {}
        for k, (t, kind) in enumerate(self.externals):
            if kind in ("const", "static"):
                if kind == "const":
                    _copy_node(gd, t.op, f"ext{k}")
                    names[t.name] = f"ext{k}:{t.value_index}" if t.value_index else f"ext{k}"
                else:
                    val = self._static(t)
                    nd = gd.node.add()
                    nd.CopyFrom(_const_node_def(f"ext{k}", val, t.dtype))
                    names[t.name] = f"ext{k}"
                continue
            if kind == "res":
                var = self.traced.captures.get(t.op.name)
                if var is None:
                    raise RuntimeError(f"resource input {t.name} is not a captured variable")
                fresh = tf.Variable(_random_value(var.shape, var.dtype), trainable=False)
                variables.append(fresh)
                nd = gd.node.add()
                nd.name = f"ext{k}"
                nd.op = "Placeholder"
                nd.attr["dtype"].type = tf.resource.as_datatype_enum
                names[t.name] = f"ext{k}"
                input_map[f"ext{k}:0"] = ("var", fresh)
                continue
            nd = gd.node.add()
            nd.name = f"ext{k}"
            nd.op = "Placeholder"
            nd.attr["dtype"].type = t.dtype.as_datatype_enum
            nd.attr["shape"].shape.CopyFrom(t.shape.as_proto())
            names[t.name] = f"ext{k}"
            feeds.append((f"ext{k}:0", _random_value(t.shape, t.dtype)))
        needs_library = False
        for i, op in enumerate(self.op_objs):
            nd = _copy_node(gd, op, f"op{i}")
            for a in nd.attr.values():
                if a.HasField("func") or a.list.func:
                    needs_library = True
            for t in op.inputs:
                if t.op.name in self.local:
                    j = self.local[t.op.name]
                    nd.input.append(f"op{j}:{t.value_index}" if t.value_index else f"op{j}")
                else:
                    nd.input.append(names[t.name])
            for c in op.control_inputs:
                if c.name in self.local:
                    nd.input.append(f"^op{self.local[c.name]}")
        if needs_library:
            gd.library.CopyFrom(self.traced.graph_def.library)
        gd.versions.CopyFrom(self.traced.graph_def.versions)
        # what to return: every output read outside the node, else a token after the ops
        returned = []
        for i, op in enumerate(self.op_objs):
            for o in op.outputs:
                if o.dtype in (tf.resource, tf.variant):
                    continue
                if any(c.name not in self.local for c in o.consumers()) or not o.consumers():
                    returned.append(f"op{i}:{o.value_index}")
        no_output_ops = [f"op{i}" for i, op in enumerate(self.op_objs) if not op.outputs]
        ph_names = [n for n, _ in feeds]
        values = [v for _, v in feeds]
        specs = [tf.TensorSpec(v.shape, v.dtype) for v in values]

        def body(*args):
            imap = dict(zip(ph_names, args))
            graph = tf.compat.v1.get_default_graph()
            for key, (_, var) in input_map.items():
                imap[key] = graph.capture(var.handle)
            got = tf.graph_util.import_graph_def(
                gd, input_map=imap, return_elements=returned + no_output_ops, name="n")
            tensors = got[:len(returned)]
            side = got[len(returned):]
            with tf.control_dependencies(side + [t.op for t in tensors]):
                token = tf.constant(0)
            return tensors + [token]

        fn = tf.function(body, autograph=False).get_concrete_function(*specs)
        return fn, values, variables

    def measure(self, *, runs, warmup, overhead):
        import tensorflow as tf

        fn, values, variables = self.build()
        sync = getattr(getattr(tf.test, "experimental", None), "sync_devices", None)
        gpu = bool(tf.config.list_logical_devices("GPU"))

        def call():
            out = fn(*values)
            if gpu and sync is not None:
                sync()
            return out

        t = time.perf_counter()
        call()
        first = time.perf_counter() - t
        if first > 1.0:  # a slow node: fewer repetitions
            warmup, runs = 1, 3
        for _ in range(max(0, warmup - 1)):
            call()
        times = []
        for _ in range(runs):
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        med = statistics.median(times)
        base = overhead(len(values))
        del variables
        return max(med - base, _MIN_OP_SECONDS * len(self.ops))


# tensor values folded per traced graph (weakly keyed: a graph's entries go with it)
_FOLDED = weakref.WeakKeyDictionary()
_FOLD_MAX_OPS = 64


def _shape_value(t):
    import numpy as np
    import tensorflow as tf

    op = t.op
    if op.type == "ShapeN":
        shape = op.inputs[t.value_index].shape
        return np.array(shape.as_list(), t.dtype.as_numpy_dtype) \
            if shape.is_fully_defined() else None
    if op.type in ("Shape", "Size", "Rank") and op.inputs[0].shape.is_fully_defined():
        s = op.inputs[0].shape
        val = {"Shape": s.as_list(), "Size": s.num_elements(), "Rank": s.rank}[op.type]
        return np.array(val, t.dtype.as_numpy_dtype)
    try:
        return tf.get_static_value(t)
    except Exception:  # noqa: BLE001
        return None


def _fold(t):
    """Evaluate ``t`` when every path up from it ends in constants or static shapes.

    ``tf.get_static_value`` stops at ops such as ``StridedSlice`` or ``Mul`` of a shape
    (Keras's loss reshapes, dilated convolutions' paddings); a node fed zeros there fails to
    run alone (a reshape to zero elements), so its cost would be a guess.
    """
    import tensorflow as tf
    from tensorflow.core.framework import graph_pb2

    n = t.shape.num_elements()
    if t.dtype.is_floating or t.dtype in (tf.resource, tf.variant) or n is None or n > 4096:
        return None
    order, leaves, seen = [], {}, set()

    def visit(op):
        if op.name in seen:
            return True
        seen.add(op.name)
        if (len(seen) > _FOLD_MAX_OPS or op.type in ("Placeholder", "ReadVariableOp")
                or op.op_def.is_stateful or op.control_inputs):
            return False
        for x in op.inputs:
            if x.name in leaves:
                continue
            v = _shape_value(x) if not x.dtype.is_floating else None
            if v is not None:
                leaves[x.name] = v
            elif not visit(x.op):
                return False
        order.append(op)
        return True

    try:
        if not visit(t.op):
            return None
        gd = graph_pb2.GraphDef()
        names = {}
        index = {op.name: i for i, op in enumerate(order)}
        for k, (name, v) in enumerate(leaves.items()):
            gd.node.add().CopyFrom(_const_node_def(f"leaf{k}", v,
                                                   t.graph.get_tensor_by_name(name).dtype))
            names[name] = f"leaf{k}"
        for i, op in enumerate(order):
            nd = _copy_node(gd, op, f"op{i}")
            for x in op.inputs:
                nd.input.append(names.get(x.name) or f"op{index[x.op.name]}:{x.value_index}")
        fetch = f"op{index[t.op.name]}:{t.value_index}"

        def body():
            return tf.graph_util.import_graph_def(gd, return_elements=[fetch], name="f")[0]

        # wrap_function, not a tf.function per fold: TensorFlow counts every new tf.function
        # traced from this one place as a retrace and logged a warning about it to the user
        return tf.compat.v1.wrap_function(body, [])().numpy()
    except Exception:  # noqa: BLE001 (anything odd: the node is fed zeros, as before)
        return None


def _copy_node(gd, op, name):
    """A copy of ``op``'s NodeDef in ``gd`` under ``name``: no inputs, device or
    graph-bound attributes (the caller wires the inputs)."""
    nd = gd.node.add()
    nd.CopyFrom(op.node_def)
    nd.name, nd.device = name, ""
    del nd.input[:]
    for key in _SKIP_ATTRS:
        if key in nd.attr:
            del nd.attr[key]
    return nd


def _const_node_def(name, value, dtype):
    import tensorflow as tf

    with tf.Graph().as_default():
        c = tf.constant(value, dtype, name=name)
        nd = c.op.node_def
    return nd


def _random_value(shape, dtype):
    import numpy as np
    import tensorflow as tf

    shape = tuple(shape.as_list()) if hasattr(shape, "as_list") else tuple(shape)
    if dtype.is_floating:
        v = np.random.default_rng(0).random(size=shape, dtype=np.float32) + 0.5
        return tf.cast(tf.constant(v), dtype)
    if dtype.is_bool:
        return tf.constant(np.random.default_rng(0).integers(0, 2, size=shape).astype(bool))
    if dtype.is_complex:
        return tf.zeros(shape, dtype)
    return tf.zeros(shape, dtype)


class _FlopsModel:
    """``flops / rate + bytes / bandwidth + overhead`` per op (see module docstring)."""

    def __init__(self):
        from tf_remat.extract import current_device_kind

        self.kind = current_device_kind()
        self.constants = FLOPS_MODEL[self.kind]

    def node_cost(self, ops) -> float:
        c = self.constants
        total = 0.0
        for op in ops:
            fl, by = _op_flops_bytes(op)
            total += fl / c["flop_rate"] + by / c["bandwidth"] + c["op_overhead"]
        return total


def _numel(t) -> int:
    n = t.shape.num_elements() if t.shape.rank is not None else None
    return int(n or 0)


def _op_flops_bytes(op):
    from tf_remat.extract import tensor_bytes

    by = sum(tensor_bytes(t) for t in op.inputs) + sum(tensor_bytes(t) for t in op.outputs)
    t = op.type
    try:
        if t in ("Conv2D", "Conv3D", "_FusedConv2D"):
            k = op.inputs[1].shape.as_list()
            return 2.0 * _numel(op.outputs[0]) * _prod(k[:-1]), by
        if t in ("Conv2DBackpropInput", "Conv3DBackpropInputV2"):
            k = op.inputs[1].shape.as_list()
            return 2.0 * _numel(op.inputs[2]) * _prod(k[:-1]), by
        if t in ("Conv2DBackpropFilter", "Conv3DBackpropFilterV2"):
            k = op.outputs[0].shape.as_list()
            return 2.0 * _numel(op.inputs[2]) * _prod(k[:-1]), by
        if t.startswith("DepthwiseConv2dNative"):
            k = (op.inputs[1] if "Filter" not in t else op.outputs[0]).shape.as_list()
            big = max(_numel(o) for o in list(op.inputs) + list(op.outputs))
            return 2.0 * big * k[0] * k[1] * max(1, k[3] if len(k) > 3 else 1), by
        if t in ("MatMul", "_FusedMatMul"):
            a = op.inputs[0].shape.as_list()
            ta = op.get_attr("transpose_a")
            kdim = a[0] if ta else a[1]
            return 2.0 * _numel(op.outputs[0]) * kdim, by
        if t.startswith("BatchMatMul"):
            a = op.inputs[0].shape.as_list()
            adj = op.get_attr("adj_x")
            kdim = a[-2] if adj else a[-1]
            return 2.0 * _numel(op.outputs[0]) * kdim, by
    except Exception:  # noqa: BLE001 (unknown attrs: count as memory traffic)
        pass
    return float(max((_numel(o) for o in op.outputs), default=0)), by


def _prod(xs):
    p = 1
    for x in xs:
        p *= int(x or 1)
    return p
