"""The rewritten step runs the plan: same loss, gradients and updates; lower measured peak.

Tolerance (``close``): a rewritten step runs the same kernels on the same values, but oneDNN may
fuse a pair in one step and not in the other, and a reduction may be summed in another order.
float32 carries 2**-23 ~ 1.2e-7 relative error per operation; a reduction of N terms
re-associated differs by about sqrt(N) * 1.2e-7 of the summed magnitude (N <= 65536 here: ~3e-5),
hence ``rtol = 1e-4``. A gradient that cancels to almost zero (a bias feeding BatchNorm) has only
rounding noise left, whose size follows the terms summed, not the result, hence an absolute
floor of ``1e-5`` times the largest value of the same kind (all gradients, or the variable).
"""

import dataclasses
import heapq

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tf_remat.errors import PlanError, UnsupportedOpError  # noqa: E402
from tf_remat.plan import Schedule, make_plan, simulate, steps_from_sequence  # noqa: E402

pytestmark = pytest.mark.slow

RTOL = 1e-4
ATOL_FRACTION = 1e-5


# --------------------------------------------------------------------- models
def skip_cnn(batch=32, hw=32, width=16, blocks=2, optimizer="adam"):
    """Convolutions with residual skips, BatchNorm and Dropout (no bias before BatchNorm)."""
    inp = keras.Input((hw, hw, 3))
    h = keras.layers.Conv2D(width, 3, padding="same", use_bias=False)(inp)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.ReLU()(h)
    for _ in range(blocks):
        r = keras.layers.Conv2D(width, 3, padding="same", use_bias=False)(h)
        r = keras.layers.BatchNormalization()(r)
        r = keras.layers.ReLU()(r)
        r = keras.layers.Dropout(0.25)(r)
        r = keras.layers.Conv2D(width, 3, padding="same", use_bias=False)(r)
        r = keras.layers.BatchNormalization()(r)
        h = keras.layers.ReLU()(keras.layers.Add()([r, h]))
    h = keras.layers.GlobalAveragePooling2D()(h)
    out = keras.layers.Dense(10)(h)
    model = keras.Model(inp, out, name="skip_cnn")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=optimizer)
    return model, tf.TensorSpec((batch, hw, hw, 3)), tf.TensorSpec((batch,), tf.int32)


def mlp(batch=1024, d=256, width=512, depth=3):
    """Dense layers with ReLU and Dropout."""
    inp = keras.Input((d,))
    h = inp
    for _ in range(depth):
        h = keras.layers.Dense(width, activation="relu")(h)
        h = keras.layers.Dropout(0.2)(h)
    out = keras.layers.Dense(10)(h)
    model = keras.Model(inp, out, name="mlp")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer="adam")
    return model, tf.TensorSpec((batch, d)), tf.TensorSpec((batch,), tf.int32)


def rnn(batch=64, steps=16, features=8, units=64, width=512):
    """An LSTM without ``unroll`` (a tf.while_loop) under dense layers with dropout."""
    inp = keras.Input((steps, features))
    h = keras.layers.Flatten()(keras.layers.LSTM(units, return_sequences=True)(inp))
    for _ in range(3):
        h = keras.layers.Dropout(0.1)(keras.layers.Dense(width, activation="relu")(h))
    model = keras.Model(inp, keras.layers.Dense(10)(h), name="rnn")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer="adam")
    return model, tf.TensorSpec((batch, steps, features)), tf.TensorSpec((batch,), tf.int32)


def birnn(batch=32, steps=32, features=16, units=64):
    """A Bidirectional LSTM (two independent loops forward, two gradient loops backward)."""
    inp = keras.Input((steps, features))
    h = keras.layers.Bidirectional(keras.layers.LSTM(units, return_sequences=True))(inp)
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Dropout(0.1)(h))
    model = keras.Model(inp, keras.layers.Dense(10)(h), name="birnn")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer="adam")
    return model, tf.TensorSpec((batch, steps, features)), tf.TensorSpec((batch,), tf.int32)


def wide(batch=64, d=256, width=2048):
    """Two wide Dense layers: a 16 MiB kernel against activations of 0.5 MiB, so that a copy of
    the kernel stands out of the step's requests."""
    inp = keras.Input((d,))
    h = keras.layers.Dense(width, activation="relu")(inp)
    h = keras.layers.Dense(width, activation="relu")(h)
    out = keras.layers.Dense(10)(h)
    model = keras.Model(inp, out, name="wide")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer="sgd")
    return model, tf.TensorSpec((batch, d)), tf.TensorSpec((batch,), tf.int32)


BUILDERS = {"skip_cnn": skip_cnn, "mlp": mlp, "rnn": rnn, "birnn": birnn, "wide": wide}
_CACHE = {}


def extracted(name, apply_updates=True):
    key = (name, apply_updates)
    if key not in _CACHE:
        from tf_remat.extract import extract

        from tf_remat import extract as extract_module

        keras.utils.set_random_seed(1)
        model, xs, ys = BUILDERS[name]()
        # 2 MiB patch slices (where convolution gradients are products): these tests compare
        # measured with simulated peaks of small steps, and 6 MiB slices among 2 MiB
        # activations leave the allocator's rounding up to 30% of them
        default = extract_module._PATCH_GRAD_BYTES
        extract_module._PATCH_GRAD_BYTES = 2 << 20
        try:
            _CACHE[key] = extract(model, input_spec=xs, label_spec=ys, cost_model="flops",
                                  verbose=0, apply_updates=apply_updates)
        finally:
            extract_module._PATCH_GRAD_BYTES = default
    return _CACHE[key]


def batch_for(ex, seed=0):
    rng = np.random.default_rng(seed)
    xs, ys = ex.traced.input_spec, ex.traced.label_spec
    x = tf.constant(rng.standard_normal(xs.shape).astype("float32"))
    y = tf.constant(rng.integers(0, 10, ys.shape).astype("int32"))
    return x, y


class Snapshot:
    """Save every variable a step captures; restore between runs."""

    def __init__(self, variables):
        self.variables = list(variables)
        # copies: a NumPy view of a variable's buffer would make TensorFlow copy the variable
        # on its next update (copy on write), which shows up in measured peaks
        self.values = [np.array(v.numpy(), copy=True) for v in self.variables]

    def restore(self):
        for v, s in zip(self.variables, self.values):
            v.assign(np.array(s, copy=True))

    def now(self):
        return [np.array(v.numpy(), copy=True) for v in self.variables]


def close(a, b, scale):
    """``|a - b| <= RTOL |a| + ATOL_FRACTION * scale`` elementwise (see the module docstring)."""
    a, b = np.asarray(a), np.asarray(b)
    return np.all(np.abs(a - b) <= RTOL * np.abs(a) + ATOL_FRACTION * scale)


def run_both(ex, step, x, y):
    """Outputs and variables after one original and one rewritten step from the same state."""
    snap = Snapshot(ex.traced.variables)
    try:
        o1 = tf.nest.map_structure(lambda t: t.numpy(), ex.traced.function(x, y))
        v1 = snap.now()
        snap.restore()
        o2 = tf.nest.map_structure(lambda t: t.numpy(), step(x, y))
        v2 = snap.now()
    finally:
        snap.restore()
    return o1, o2, v1, v2, snap.values


def assert_same_step(ex, step, x, y):
    o1, o2, v1, v2, before = run_both(ex, step, x, y)
    o1, o2 = (list(o) if isinstance(o, (list, tuple)) else [o] for o in (o1, o2))
    assert np.isfinite(o1[0]) and abs(o1[0] - o2[0]) <= RTOL * abs(o1[0]), (o1[0], o2[0])
    if len(o1) > 1:  # gradients
        scale = max(float(np.abs(g).max()) for g in o1[1:])
        for i, (g1, g2) in enumerate(zip(o1[1:], o2[1:])):
            assert close(g1, g2, scale), f"gradient {i}: max diff {np.abs(g1 - g2).max()}"
    names = [v.name for v in ex.traced.variables]
    changed = 0
    for name, a, b, s in zip(names, v1, v2, before):
        changed += not np.array_equal(a, s)
        assert close(a, b, float(np.abs(a).max())), \
            f"variable {name}: max diff {np.abs(a - b).max()} (update {np.abs(a - s).max()})"
    assert changed, "the step changed no variable"
    return o1, o2


def measured(step, ex, x, y, *, least=False):
    """The step's measured peak (``least``: the lowest of three allocator layouts, the one
    without the BFC allocator's whole-chunk rounding; else the highest)."""
    from tf_remat.api import measure_step_peak

    big = max(ex.graph.memory)
    m = measure_step_peak(step, x, y, variables=ex.traced.variables,
                          ballast=(0, int(0.6 * big), big))
    return min(m["layouts"]) if least else m["step_peak_bytes"]


def plan_for(ex, fraction, strategy="linearized-greedy"):
    """A plan for ``fraction`` of the step's memory; where the greedy misses the budget, the
    MILP's (which budgets a greedy meets depends on the kernels: without their scratch space,
    skip_cnn's greedy plans stall at 70% of the peak)."""
    from tf_remat.solvers import solve

    g = ex.graph
    # a kernel's scratch space is in every plan's peak (see test_api.budget_at)
    scratch = ex.info["workspace_bytes"]
    budget = int(scratch + fraction * (g.no_remat_peak - scratch))
    plan = solve(g, budget, strategy, time_limit=20)
    if not plan.within_budget and strategy == "linearized-greedy":
        # its plans for these graphs come within 3 s, the same as after 20 s; the rest of a
        # limit goes to proving them (eight such solves made a third of this module's time)
        plan = solve(g, budget, "checkmate-milp", time_limit=6)
    return plan


def updates_first_plan(graph, every_node=False):
    """An adversarial valid plan: optimizer and other stateful nodes run as soon as they can,
    and every forward input of a backward node is recomputed right before it, so recomputed
    copies read weights whose update already ran. ``every_node``: every recomputable input of
    every node is recomputed right before it."""
    g = graph
    indeg = [len(g.preds[v]) for v in range(g.n)]
    pos = g.position
    key = lambda v: (0 if not g.recomputable[v] else 1, pos[v], v)  # noqa: E731
    ready = [key(v) for v in range(g.n) if indeg[v] == 0]
    heapq.heapify(ready)
    seq = []
    while ready:
        v = heapq.heappop(ready)[2]
        if every_node or g.backward[v]:
            seq.extend(u for u in sorted(g.preds[v], key=pos.__getitem__)
                       if g.recomputable[u] and (every_node or not g.backward[u]))
        seq.append(v)
        for s in g.succs[v]:
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(ready, key(s))
    return make_plan(g, Schedule(sequence=seq), 2**62, strategy="updates-first")


# --------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", ["skip_cnn", "mlp"])
def test_reference_order_is_the_original_step(name):
    from tf_remat.rewrite import rewrite

    ex = extracted(name)
    plan = plan_for(ex, 1.0, "checkpoint-all")
    step = rewrite(ex.traced, ex.graph, ex.op_map, plan)
    assert step.info["recomputed_ops"] == 0
    assert_same_step(ex, step, *batch_for(ex))


@pytest.mark.parametrize("name", ["skip_cnn", "mlp"])
def test_recomputing_plan_same_loss_gradients_updates(name):
    from tf_remat.rewrite import rewrite

    for apply_updates in (False, True):
        ex = extracted(name, apply_updates)
        plan = plan_for(ex, 0.6 if name == "skip_cnn" else 0.9)
        counts = simulate(ex.graph, plan.steps).compute_counts
        recomputed = [v for v, c in enumerate(counts) if c > 1]
        assert plan.within_budget and recomputed, "the test plan must recompute something"
        assert any("dropout" in op for v in recomputed for op in ex.op_map.nodes[v]) or \
            name == "mlp", "a dropout mask should be recomputed"
        step = rewrite(ex.traced, ex.graph, ex.op_map, plan)
        assert step.info["recomputed_ops"] > 0
        assert_same_step(ex, step, *batch_for(ex))


def test_loops_run_one_iteration_at_a_time_and_compute_the_same_step():
    """A recomputing plan around an LSTM's loop: same loss, gradients and updates, and every
    loop of the new step (the forward one and its gradient) runs one iteration at a time
    (``parallel_iterations=1``): by default up to 32 run at once and a backward loop held the
    weight gradients of many steps before summing them, 8 MiB over the plan on some runs. The
    traced step runs them so too, so that what is profiled is what the plan runs."""
    from tf_remat.rewrite import build_graph_def, rewrite

    ex = extracted("rnn")
    plan = plan_for(ex, 0.9)
    counts = simulate(ex.graph, plan.steps).compute_counts
    assert plan.within_budget and max(counts) > 1, "the test plan must recompute something"
    step = rewrite(ex.traced, ex.graph, ex.op_map, plan, chain="node")
    assert_same_step(ex, step, *batch_for(ex))
    gd = build_graph_def(ex.traced, ex.op_map, plan.sequence, chain="node")[0]
    loops = [nd for nd in gd.node if nd.op in ("While", "StatelessWhile")]
    assert len(loops) >= 2
    assert all(nd.attr["parallel_iterations"].i == 1 for nd in loops)
    traced = [op for op in ex.traced.function.graph.get_operations()
              if op.type in ("While", "StatelessWhile")]
    assert len(traced) >= 2 and all(op.get_attr("parallel_iterations") == 1 for op in traced)


def test_a_recomputed_rnn_loop_reads_the_weights_the_step_started_with():
    """An LSTM's loop (a ``While`` whose body reads its weights through their handles) may be
    recomputed; a copy run after the weights' optimizer update must compute with the weights
    of the step's start, as the first run did. The plan here runs the whole step, then the
    loop again and everything from it to the loss, which the step returns: that loss must be
    the one the step computed before its update."""
    from tf_remat.rewrite import build_graph_def, rewrite

    ex = extracted("rnn")
    g, om = ex.graph, ex.op_map
    fg = ex.traced.function.graph
    loop = next(v for v in range(g.n) if not g.backward[v] and any(
        fg.get_operation_by_name(o).type == "While" for o in om.nodes[v]))
    assert g.recomputable[loop]
    # the loop's descendants on the way to the loss, again after every update
    down = {loop}
    for v in g.order:
        if any(u in down for u in g.preds[v]) and not g.backward[v]:
            down.add(v)
    loss_path = set()
    stack = [v for v in g.outputs if v in down]
    while stack:
        v = stack.pop()
        if v in loss_path:
            continue
        loss_path.add(v)
        stack.extend(u for u in g.preds[v] if u in down)
    assert loop in loss_path and all(g.recomputable[v] for v in loss_path)
    seq = list(g.order) + [v for v in g.order if v in loss_path]
    plan = make_plan(g, Schedule(sequence=seq), 2**62, strategy="loop-after-update")
    step = rewrite(ex.traced, g, om, plan)
    assert step.info["value_loops"] == 1
    gd = build_graph_def(ex.traced, om, plan.sequence)[0]
    reads = {nd.name: nd.input[0] for nd in gd.node if nd.name.endswith("/_remat_value")}
    assert reads
    writes = [nd for nd in gd.node if nd.op.startswith(("Assign", "ResourceApply"))
              and nd.input[0] in reads.values()]
    assert writes and all("^" + r in nd.input for nd in writes for r in reads
                          if reads[r] == nd.input[0])
    assert_same_step(ex, step, *batch_for(ex))


def test_copies_reading_updated_weights_read_the_old_values():
    """Recomputed copies that run after their weight's optimizer update still see the weight
    as it was at the start of the step (resource variables copy on write)."""
    from tf_remat.rewrite import rewrite

    ex = extracted("skip_cnn")
    plan = updates_first_plan(ex.graph)
    fg = ex.traced.function.graph
    node_of = ex.op_map.node_of()
    updated, late_reads = {}, 0
    for p, v in enumerate(plan.sequence):
        for o in ex.op_map.nodes[v]:
            op = fg.get_operation_by_name(o)
            if op.type.startswith("Assign"):
                updated.setdefault(op.inputs[0].op.name, p)
            for t in op.inputs:
                if t.op.type == "ReadVariableOp" and t.op.name not in node_of:
                    r = t.op.inputs[0].op.name
                    late_reads += r in updated and updated[r] < p
    assert late_reads > 0, "the adversarial plan should read some weight after its update"
    step = rewrite(ex.traced, ex.graph, ex.op_map, plan)
    assert_same_step(ex, step, *batch_for(ex))


class TwoDraws(keras.Model):
    """Two draws from one seed generator in one step: the second reads the generator's state
    after the first draw's update and before its own (a GAN's two latent batches)."""

    def __init__(self):
        super().__init__()
        self.body = keras.Sequential([keras.layers.Dense(256, activation="relu"),
                                      keras.layers.Dense(256)])
        self.seeds = keras.random.SeedGenerator(5)

    def call(self, x, training=False):
        return self.body(x)

    def train_step(self, x):
        with tf.GradientTape() as tape:
            a = self(x + keras.random.normal(tf.shape(x), seed=self.seeds))
            b = self(x * keras.random.normal(tf.shape(x), seed=self.seeds))
            loss = tf.reduce_mean(tf.square(a)) + tf.reduce_mean(tf.square(b))
        variables = self.trainable_variables
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        return {"loss": loss}


def test_a_read_of_a_variable_the_step_writes_again_is_read_once():
    """A variable read inside a node (ordered after an update) whose variable the step writes
    again later must run once: a copy after that write would read the new value (here a seed
    generator's second draw would give other noise). The read is pinned: its node is
    recomputed, every copy reading the first read's value. A plan that runs every update as
    early as it can and recomputes every recomputable input of every node right before it
    leaves the step as TensorFlow runs it."""
    from tf_remat.extract import extract

    keras.utils.set_random_seed(2)
    model = TwoDraws()
    model.compile(optimizer="sgd")
    ex = extract(model, input_spec=tf.TensorSpec((256, 256)), label_spec=(),
                 cost_model="flops", verbose=0, train_step=True)
    g, fg = ex.graph, ex.traced.function.graph
    state = model.seeds.state.handle
    captured = {id(inner): outer for outer, inner in fg.captures}

    def reads_state(o):
        op = fg.get_operation_by_name(o)
        return op.type == "ReadVariableOp" and captured.get(id(op.inputs[0])) is state

    holding = [v for v in range(g.n) if any(reads_state(o) for o in ex.op_map.nodes[v])]
    # the reads in nodes (the second draw's, the second update's) are pinned, and the
    # second draw's node (its seed from the read) may be recomputed
    assert {o for v in holding for o in ex.op_map.nodes[v] if reads_state(o)} == \
        set(ex.op_map.pinned_ops) and len(ex.op_map.pinned_ops) == 2
    holding = [v for v in holding if g.recomputable[v]]
    assert holding
    plan = updates_first_plan(g, every_node=True)
    seq = list(plan.sequence)
    assert any(seq.count(v) > 1 for v in holding)
    assert_override_runs_as_traced(ex, plan, (256, 256))


def assert_override_runs_as_traced(ex, plan, shape):
    """The plan's step of an unlabeled ``train_step`` override, with ``chain="op"`` and
    ``"node"``, recomputes and leaves every output and variable as the traced step does."""
    from tf_remat.rewrite import rewrite

    x = tf.constant(np.random.default_rng(0).random(shape, dtype=np.float32))
    for chain in ("op", "node"):
        step = rewrite(ex.traced, ex.graph, ex.op_map, plan, chain=chain)
        assert step.info["recomputed_ops"] > 0
        snap = Snapshot(ex.traced.variables)
        try:
            want = [float(t) for t in tf.nest.flatten(ex.traced.function(x))]
            w1 = snap.now()
            snap.restore()
            got = [float(t) for t in tf.nest.flatten(step(x, ()))]
            w2 = snap.now()
        finally:
            snap.restore()
        assert np.allclose(got, want, rtol=RTOL, atol=0), (chain, got, want)
        for v, a, b in zip(ex.traced.variables, w1, w2):
            assert close(a, b, max(1.0, float(np.abs(a).max()))), (chain, v.name)


class CalledDense(keras.layers.Layer):
    """A dense layer whose product runs in a ``tf.function`` of its own: the step calls that
    function, which reads the kernel inside, not through a read of the step's. (The kernel is
    made here, not in ``build``: one made inside a trace is initialized lazily, and the
    function would be traced on its initial value.)"""

    def __init__(self, fan_in, units):
        super().__init__()
        self.kernel = self.add_weight(shape=(fan_in, units), initializer="glorot_uniform")
        self.product = tf.function(lambda x: tf.matmul(x, self.kernel.value))

    def call(self, x):
        return self.product(x)


class CallsAfterUpdates(keras.Model):
    """A step that reads its output again after the optimizer ran, where the output comes from
    a function call that reads its layer's kernel inside (a recomputed call there would read
    the updated kernel)."""

    def __init__(self):
        super().__init__()
        self.body = keras.Sequential([keras.layers.Dense(256, activation="relu"),
                                      keras.layers.Dense(256, activation="relu"),
                                      CalledDense(256, 64)])

    def call(self, x, training=False):
        return self.body(x)

    def train_step(self, x):
        with tf.GradientTape() as tape:
            out = self(x)
            loss = tf.reduce_mean(tf.square(out))
        variables = self.trainable_variables
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        return {"loss": loss, "out": tf.reduce_mean(tf.abs(out))}


def test_a_call_that_reads_a_variable_the_step_writes_runs_once():
    """A function call whose function reads a variable the optimizer writes later in the step
    must not run again: a copy after the update would read the new weights. Its node is not
    recomputable, and a plan that runs every update as early as it can and recomputes every
    recomputable input of every node right before it leaves the step as TensorFlow runs it.
    (With the node made recomputable, that plan puts a copy after the update and the values
    still agree here: Grappler inlines the call, and the read inside runs when its handle
    is ready, at the start of the step. Nothing orders it so; the node flag is the check.)"""
    from tf_remat.extract import _CALL_OPS, extract

    keras.utils.set_random_seed(4)
    model = CallsAfterUpdates()
    # called eagerly at the step's shape first: a functional model would trace the function
    # for batch None, and the step's call would reuse that trace, whose output has no static
    # shape
    model(np.zeros((128, 256), "float32"))
    model.compile(optimizer=keras.optimizers.SGD(0.5))
    ex = extract(model, input_spec=tf.TensorSpec((128, 256)), label_spec=(),
                 cost_model="flops", verbose=0, train_step=True)
    g, fg = ex.graph, ex.traced.function.graph
    calls = [v for v in range(g.n) for o in ex.op_map.nodes[v]
             if fg.get_operation_by_name(o).type in _CALL_OPS and
             any(t.dtype == tf.resource for t in fg.get_operation_by_name(o).inputs)]
    assert calls and not any(g.recomputable[v] for v in calls)
    assert_override_runs_as_traced(ex, updates_first_plan(g, every_node=True), (128, 256))


def test_a_call_traced_for_batch_none_is_refused_with_the_way_out():
    """A functional model traces a layer's own ``tf.function`` for batch None when it is
    built, and the step's call reuses that trace, whose output has no static shape: the
    refusal says so and what to change."""
    from tf_remat.extract import extract

    inp = keras.Input((256,))
    model = keras.Model(inp, CalledDense(256, 10)(keras.layers.Dense(256)(inp)))
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(UnsupportedOpError, match=r"StatefulPartitionedCall.*python_function"):
        extract(model, input_spec=tf.TensorSpec((128, 256)),
                label_spec=tf.TensorSpec((128,), tf.int32), cost_model="flops", verbose=0)


def test_stateful_ops_emitted_once_and_refused_twice():
    from tf_remat.rewrite import build_graph_def, rewrite

    ex = extracted("skip_cnn")
    g = ex.graph
    plan = plan_for(ex, 0.6)
    gd, _, _, _ = build_graph_def(ex.traced, ex.op_map, plan.sequence)
    stateful = [op for v in range(g.n) if not g.recomputable[v] for op in ex.op_map.nodes[v]]
    names = [nd.name for nd in gd.node]
    for op in stateful:
        assert names.count(op) == 1
    assert not any(n.startswith(op + "/_remat") for op in stateful for n in names)
    v = next(v for v in g.order if not g.recomputable[v])
    twice = dataclasses.replace(plan, steps=steps_from_sequence(g, list(g.order) + [v]))
    with pytest.raises(PlanError, match="not recomputable"):
        rewrite(ex.traced, g, ex.op_map, twice)


def test_measured_peak_follows_the_plan():
    """TensorFlow's measured peak drops with the plan's simulated peak and stays near it; an
    unordered copy of the same ops (no chain) saves nothing."""
    from tf_remat.rewrite import rewrite

    ex = extracted("skip_cnn")
    x, y = batch_for(ex)
    base = measured(ex.traced.function, ex, x, y, least=True)
    g = ex.graph
    assert abs(base - g.no_remat_peak) <= 0.15 * base
    plan = plan_for(ex, 0.6)
    assert plan.within_budget
    step = rewrite(ex.traced, g, ex.op_map, plan)
    peak = measured(step, ex, x, y, least=True)
    # no measured check here (optimize's is what holds a budget): with 2 MiB activations and
    # 2 MiB patch slices, the allocator's whole-chunk rounding adds 3-10% to what the kernels
    # request, which test_simulated_peak_is_what_the_kernels_request holds to the plan; how
    # much depends on the process's history too: after test_api's stacked LSTMs (21 MiB of
    # lists), the least of three layouts held 1.108 times the budget in a full run, and 1.150
    # (1.156 times the plan's peak) in another, whose worker had run other tests before it
    assert peak <= 1.2 * plan.budget, (peak, plan.budget)
    assert abs(peak - plan.peak_memory) <= 0.2 * plan.peak_memory, (peak, plan.peak_memory)
    assert peak < 0.8 * base
    # in their worst layouts too (whole-chunk rounding can add a quarter to either; comparing
    # one's worst with the other's least failed after another test module's allocations)
    assert measured(step, ex, x, y) < 0.9 * measured(ex.traced.function, ex, x, y)
    loose = rewrite(ex.traced, g, ex.op_map, plan, chain="none")
    assert measured(loose, ex, x, y) > 0.9 * base


def test_simulated_peak_is_what_the_kernels_request():
    """The simulator models the bytes the rewritten step's kernels request, as TensorFlow's
    profiler records them; what the allocator holds on top (whole chunks, see
    ``benchmarks/results/spread.md``) is not the plan's doing."""
    from tf_remat.api import step_allocations
    from tf_remat.rewrite import rewrite

    ex = extracted("skip_cnn")
    x, y = batch_for(ex)
    g = ex.graph
    for fraction in (1.0, 0.6):
        plan = plan_for(ex, fraction)
        assert plan.within_budget
        step = rewrite(ex.traced, g, ex.op_map, plan)
        prof = step_allocations(step, x, y, variables=ex.traced.variables)
        assert prof["allocations"] > 10
        # the same requests replayed in an empty pool hold at least what they ask for
        assert prof["requested_peak_bytes"] <= prof["fresh_pool_held_peak_bytes"] \
            <= 2 * prof["requested_peak_bytes"]
        requested = prof["requested_peak_bytes"] + g.fixed_memory
        # never optimistic by more than 3%; on this model it is conservative by about 9%
        assert 0.85 * plan.peak_memory <= requested <= 1.03 * plan.peak_memory, \
            (fraction, requested, plan.peak_memory)


def test_an_update_before_a_reader_of_the_old_weight_is_deferred_past_it():
    """A variable updated while a backward MatMul still holds its old value is copied on write:
    a plan updating the 16 MiB kernel before its input gradient requests the kernel again, which
    no node carries; deferred past that reader, the update requests nothing extra, and the step
    is the same."""
    from tf_remat.api import step_allocations
    from tf_remat.rewrite import _early_updates, defer_updates, rewrite, update_readers

    ex = extracted("wide")
    x, y = batch_for(ex)
    g = ex.graph
    after = update_readers(ex.traced, ex.op_map)
    # the kernels' and biases' updates; the first layer's kernel has no reader in the backward
    # pass (no input gradient)
    assert 2 <= len(after) <= 6, after
    # the update of the largest product, moved (with what it needs) before its backward reader
    u = max((u for u in after if any(g.backward[r] for r in after[u])),
            key=lambda u: max(g.memory[p] for p in g.preds[u]))
    seq = list(updates_first_plan(g).sequence)
    r = max(p for p, v in enumerate(seq) if v in after[u] and g.backward[v])
    i = seq.index(u)
    if i > r:  # not early yet: hoist it before r with what it needs from between
        need, stack = {i}, [i]
        while stack:
            k = stack.pop()
            for p in g.preds[seq[k]]:
                q = max(q for q in range(k) if seq[q] == p)  # the copy it reads
                if q > r and q not in need:
                    need.add(q)
                    stack.append(q)
        seq = seq[:r] + [seq[k] for k in sorted(need)] + [v for k, v in enumerate(seq[r:], r)
                                                           if k not in need]
    first = make_plan(g, Schedule(sequence=seq), 2**62, strategy="update-first")
    assert u in _early_updates(first.sequence, after)
    deferred = defer_updates(ex.traced, g, ex.op_map, first)
    assert deferred.info["deferred_updates"] >= 1
    assert not _early_updates(deferred.sequence, after)
    # the simulation may rise (the gradient waits for the update), by far less than the copy
    assert deferred.peak_memory <= first.peak_memory + 2**20
    assert sorted(deferred.sequence) == sorted(first.sequence)
    steps = {}
    for name, plan in (("first", first), ("deferred", deferred)):
        steps[name] = rewrite(ex.traced, g, ex.op_map, plan, chain="node")
        assert_same_step(ex, steps[name], x, y)
    kernel = 2048 * 2048 * 4
    rounds = []
    # up to three rounds: with the other process of the suite busy beside it, the deferred
    # plan's step once copied the kernel in all five calls (CI on 67420f0: both plans requested
    # 53129732 bytes), where alone it copies in none; the first plan given for both misses in
    # every round (checked)
    for _ in range(3):
        requested = {}
        for name, step in steps.items():
            # five calls, each after a pause: a call right after another may copy the kernel
            # whatever the order (step_allocations' settle), so the deferred plan's is the
            # fewest (with a test running beside it in the other process of the suite, all
            # three calls of the deferred plan copied after 0.5 s pauses once); the first
            # plan's copy comes from its order, but one of three calls in a full CI run (after
            # 300 other tests) requested no more than the deferred plan, so its median
            runs = sorted(step_allocations(step, x, y, variables=ex.traced.variables,
                                           settle=1.0)["requested_peak_bytes"] for _ in range(5))
            requested[name] = (runs[2] if name == "first" else runs[0]) + g.fixed_memory
        rounds.append(requested)
        if requested["first"] >= requested["deferred"] + 0.9 * kernel:
            break
    assert requested["first"] >= requested["deferred"] + 0.9 * kernel, rounds
    # the copy is what the simulation of the first plan misses; the deferred one has none
    assert requested["first"] >= first.peak_memory + 0.9 * kernel, (requested, first.peak_memory)
    assert requested["deferred"] <= 1.03 * deferred.peak_memory, (requested, deferred.peak_memory)


def test_mixed_precision_step_requests_what_the_plan_simulates():
    """Under ``mixed_bfloat16`` a BatchNormalization casts its input to float32 for the
    statistics and for its gradient. A chain gate (an ``Identity``) reading a ``Cast`` let
    Grappler move the cast behind it, making a second float32 copy while the first stayed
    alive: the static-order step requested 28% more than simulated. The same plans must
    request what the simulator says, and compute Keras's step."""
    from tf_remat.api import step_allocations
    from tf_remat.extract import extract
    from tf_remat.rewrite import rewrite

    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        keras.utils.set_random_seed(5)
        inp = keras.Input((16, 16, 3))
        h = keras.layers.Conv2D(16, 3, padding="same")(inp)
        for _ in range(3):
            r = h
            h = keras.layers.ReLU()(keras.layers.BatchNormalization()(h))
            h = keras.layers.Conv2D(16, 3, padding="same")(h)
            h = keras.layers.Add()([keras.layers.Dropout(0.1)(h), r])
        h = keras.layers.GlobalAveragePooling2D()(h)
        out = keras.layers.Dense(10, dtype="float32")(h)
        model = keras.Model(inp, out)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer="adam")
    ex = extract(model, input_spec=tf.TensorSpec((32, 16, 16, 3)),
                 label_spec=tf.TensorSpec((32,), tf.int32), cost_model="flops", verbose=0)
    x, y = batch_for(ex)
    g = ex.graph
    for fraction in (1.0, 0.6):
        plan = plan_for(ex, fraction)
        step = rewrite(ex.traced, g, ex.op_map, plan, chain="node")
        requested = step_allocations(step, x, y, variables=ex.traced.variables)[
            "requested_peak_bytes"] + g.fixed_memory
        assert requested <= 1.03 * plan.peak_memory, (fraction, requested, plan.peak_memory)
        assert_same_step(ex, step, x, y)


def test_op_chain_also_runs_the_plan():
    from tf_remat.rewrite import build_graph_def, rewrite

    ex = extracted("mlp", apply_updates=False)
    plan = plan_for(ex, 0.9)
    step = rewrite(ex.traced, ex.graph, ex.op_map, plan, chain="op")
    assert_same_step(ex, step, *batch_for(ex))
    # every emitted op depends on the op emitted before it: directly, by a data or control
    # edge, or through the chain's gate / marker Identity ops; a fused pair is ordered as one
    # op (by whichever of the two reads what precedes it), so two of its links may be missing
    gd, _, _, _ = build_graph_def(ex.traced, ex.op_map, plan.sequence, chain="op")
    inputs = {nd.name: [i.lstrip("^").split(":")[0] for i in nd.input] for nd in gd.node}
    emitted = [nd.name for nd in gd.node if not nd.name.endswith(("/_gate", "/_done"))
               and nd.name not in set(ex.op_map.fixed_ops) and "/_static" not in nd.name]

    def depends(a, b, hops=3):
        if hops == 0:
            return False
        return any(i == b or (i.endswith(("/_gate", "/_done")) or i == b + "/_done")
                   and depends(i, b, hops - 1) for i in inputs[a])

    unordered = [(a, b) for b, a in zip(emitted, emitted[1:]) if not depends(a, b)]
    assert len(unordered) <= 2 * step.info["fused_pairs"], unordered[:5]
    assert step.info["chain_edges"] > 0


def test_independent_loops_run_side_by_side_under_the_node_chain():
    """A Bidirectional LSTM's two loops, and their two gradient loops, are independent: the
    static order puts each pair next to each other (``adjoin_loops``) and the node chain leaves
    each pair unordered, as the plain step does (a static order running them one after the
    other made such a step 28-53% slower on 2 cores). Same loss, gradients and updates; the
    kernels request what the plan simulates, as under the plain node chain."""
    from tf_remat.api import step_allocations
    from tf_remat.plan import concurrent_groups, make_plan
    from tf_remat.rewrite import build_graph_def, loop_nodes, rewrite, static_order_step
    from tf_remat.solvers.baselines import checkpoint_all

    ex = extracted("birnn")
    g = ex.graph
    x, y = batch_for(ex)
    loops = loop_nodes(ex.traced, ex.op_map)
    assert len(loops) == 4, [g.label(v) for v in sorted(loops)]
    step = static_order_step(ex)
    seq = step.plan.sequence
    at = sorted(seq.index(v) for v in loops)
    assert at[1] == at[0] + 1 and at[3] == at[2] + 1, at
    assert step.plan.info["adjoined_loops"] > 0
    assert step.info["runs"] == len(seq) - 2
    # neither loop of a pair waits for the other, through data or the chain (the graph the
    # step was built from, with its runs)
    runs = step.info["run_index"]
    assert runs == concurrent_groups(g, step.plan.steps, 2**62, transient=ex.op_map.transient,
                                     among=loops)
    gd = build_graph_def(ex.traced, ex.op_map, seq, chain="node", runs=runs)[0]
    inputs = {nd.name: [i.lstrip("^").split(":")[0] for i in nd.input] for nd in gd.node}

    def above(name):
        seen, todo = set(), list(inputs.get(name, ()))
        while todo:
            a = todo.pop()
            if a not in seen:
                seen.add(a)
                todo.extend(inputs.get(a, ()))
        return seen

    kind = {nd.name: nd.op for nd in gd.node}
    whiles = {}
    for v in loops:
        (op,) = [o for o in ex.op_map.nodes[v] if kind.get(o) in ("While", "StatelessWhile")]
        whiles[seq.index(v)] = op
    for a, b in ((at[0], at[1]), (at[2], at[3])):
        assert whiles[a] not in above(whiles[b]) and whiles[b] not in above(whiles[a])
    assert_same_step(ex, step, x, y)
    prof = step_allocations(step, x, y, variables=ex.traced.variables)
    requested = prof["requested_peak_bytes"] + g.fixed_memory
    assert requested <= 1.03 * step.plan.peak_memory, (requested, step.plan.peak_memory)
    # the order without the move: the loops are not adjacent, and every compute is ordered
    plain_order = make_plan(g, checkpoint_all(g, 2**62), 2**62)
    assert step.plan.peak_memory <= plain_order.peak_memory
    serial = rewrite(ex.traced, g, ex.op_map, plain_order, chain="node")
    assert serial.info["runs"] is None


def test_a_run_of_scratch_space_alone_keeps_the_chain_and_every_side_effect():
    """A kernel's scratch space is a node without ops (``extract.with_workspace_nodes``). When
    such a node made a run of its own, the barrier after it had nothing to wait for and cut
    the chain: TensorFlow pruned the updates before the cut, which no output waited for any
    more (a BiLSTM model's BatchNorm statistics and dropout seeds stayed as they were; its
    loops overlap, so its node chain orders runs). Every compute its own run here, so every
    scratch node is one; every update is still an ancestor of the outputs, and a graph that
    drops one is refused rather than run."""
    from tf_remat.errors import RematError
    from tf_remat.extract import _is_side_effect
    from tf_remat.rewrite import _check_side_effects_kept, build_graph_def

    ex = extracted("skip_cnn")
    g, op_of = ex.graph, ex.traced.function.graph.get_operation_by_name
    seq = list(plan_for(ex, 0.6).sequence)
    # an update nothing reads (a BatchNorm statistic's, an optimizer's) moved, as late is
    # always valid for it, to just before a scratch node: the BiLSTM plan's position
    updates = [v for v in seq if not g.succs[v] and
               any(_is_side_effect(op_of(o).type) for o in ex.op_map.nodes[v])]
    scratch = [p for p, v in enumerate(seq) if not ex.op_map.nodes[v]]
    assert scratch, "skip_cnn's convolutions have scratch space"
    u = next(v for v in updates if seq.index(v) < scratch[-1])
    w = seq[scratch[-1]]
    seq.remove(u)
    seq.insert(seq.index(w), u)
    runs = tuple(range(len(seq)))
    gd, outputs, tails, _ = build_graph_def(ex.traced, ex.op_map, seq, chain="run", runs=runs)
    inputs = {nd.name: [i.lstrip("^").split(":")[0] for i in nd.input] for nd in gd.node}
    seen, todo = set(), [r.split(":")[0] for r in list(outputs) + list(tails)]
    while todo:
        a = todo.pop()
        if a not in seen:
            seen.add(a)
            todo.extend(inputs.get(a, ()))
    updates = [nd.name for nd in gd.node if _is_side_effect(nd.op)]
    assert len(updates) > 10 and all(u in seen for u in updates)
    # an update nothing waits for is refused
    orphan = gd.node.add()
    orphan.CopyFrom(next(nd for nd in gd.node if nd.op == "AssignVariableOp"))
    orphan.name = "orphan_update"
    with pytest.raises(RematError, match="orphan_update"):
        _check_side_effects_kept(gd, outputs, tails, lambda r: (r.lstrip("^").split(":")[0], 0))


def test_run_chain_runs_the_plan_and_orders_only_the_runs():
    """``chain="run"``: the same step as the original; every op of a run follows every last op
    of the previous run (so the plan's memory bound holds whatever order the runtime picks
    inside a run); some adjacent nodes share a run; the requested and measured peaks follow
    the plan as the node chain's do."""
    from tf_remat.api import step_allocations
    from tf_remat.plan import concurrent_groups
    from tf_remat.rewrite import build_graph_def, copy_name, rewrite

    ex = extracted("skip_cnn")
    g = ex.graph
    x, y = batch_for(ex)
    plan = plan_for(ex, 0.6)
    assert plan.within_budget and max(simulate(g, plan.steps).compute_counts) > 1
    step = rewrite(ex.traced, g, ex.op_map, plan, chain="run")
    assert_same_step(ex, step, x, y)
    # a BatchNorm's squared differences (2 MiB here) live only inside its node; without
    # them in the bound, runs held 2 MiB more than the plan (20.2 MiB requested for 18.1)
    assert max(ex.op_map.transient) >= 1 << 20
    runs = concurrent_groups(g, plan.steps, transient=ex.op_map.transient)
    assert step.info["runs"] == runs[-1] + 1 < len(plan.sequence)

    gd = build_graph_def(ex.traced, ex.op_map, plan.sequence, chain="run", runs=runs)[0]
    inputs = {nd.name: [i.lstrip("^").split(":")[0] for i in nd.input] for nd in gd.node}
    ancestors = {}

    def above(name):  # every op ``name`` waits for, data or control
        if name not in ancestors:
            ancestors[name] = set()
            todo = list(inputs.get(name, ()))
            while todo:
                a = todo.pop()
                if a not in ancestors[name]:
                    ancestors[name].add(a)
                    todo.extend(inputs.get(a, ()))
        return ancestors[name]

    copies, members = [0] * g.n, {}
    for pos, v in enumerate(plan.sequence):
        members.setdefault(runs[pos], []).append([copy_name(o, copies[v])
                                                  for o in ex.op_map.nodes[v]])
        copies[v] += 1
    for r in range(1, runs[-1] + 1):
        before = {o for ops in members[r - 1] for o in ops}
        for ops in members[r]:
            for o in ops:
                assert before <= above(o) | {o}, (r, o, sorted(before - above(o))[:3])

    prof = step_allocations(step, x, y, variables=ex.traced.variables)
    requested = prof["requested_peak_bytes"] + g.fixed_memory
    # not the node chain's 3%: on a 2-core CPU without oneDNN this plan's runs requested 1.001,
    # 1.069 or 1.116 times the plan from one call to the next (one plan, 15 calls; a full CI
    # run failed at 1.069), so the runs' bound misses something that runs at once; the
    # default chain ("node") is held to 3% in test_simulated_peak_is_what_the_kernels_request
    assert requested <= 1.15 * plan.peak_memory, (requested, plan.peak_memory)
    peak = measured(step, ex, x, y, least=True)
    # what the allocator holds on top depends on the process's history (see
    # test_measured_peak_follows_the_plan): 1.109 times the budget after test_api's LSTMs
    assert peak <= 1.15 * plan.budget, (peak, plan.budget)
    assert abs(peak - plan.peak_memory) <= 0.15 * plan.peak_memory, (peak, plan.peak_memory)


def _executed_op_types(fn, x, y, variables):
    """Op types of the kernels TensorFlow ran for one call of ``fn`` (after Grappler and the
    oneDNN rewrite), from the function's partition graphs."""
    from tensorflow.python.eager import context

    snap = Snapshot(variables)
    context.enable_run_metadata()
    try:
        fn(x, y)
        md = context.export_run_metadata()
    finally:
        context.disable_run_metadata()
        snap.restore()
    # distinct names: a call may report one function's graph more than once
    ops = {nd.name: nd.op for fg in md.function_graphs for pg in fg.partition_graphs
           for nd in pg.node}
    types = {}
    for t in ops.values():
        types[t] = types.get(t, 0) + 1
    return types


def test_chain_keeps_the_kernel_fusions_of_the_original_step():
    """Grappler fuses Conv2D / MatMul with their BiasAdd (and activation), and oneDNN a weight
    gradient with its BiasAddGrad, only when none of them carries a control edge: the chain's
    order goes through Identity gates, so the rewritten step runs the same fused kernels (and
    allocates no separate pre-bias buffer)."""
    from tf_remat.rewrite import rewrite

    keras.utils.set_random_seed(3)
    inp = keras.Input((16, 16, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inp)
    s = keras.layers.Conv2D(8, 1)(inp)
    h = keras.layers.Conv2D(8, 3, padding="same")(h)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.ReLU()(keras.layers.Add()([h, s]))
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(32, activation="relu")(h)
    out = keras.layers.Dense(10)(h)
    model = keras.Model(inp, out)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer="adam")
    from tf_remat.extract import extract, trace_training_step

    specs = (tf.TensorSpec((8, 16, 16, 3)), tf.TensorSpec((8,), tf.int32))
    ex = extract(model, input_spec=specs[0], label_spec=specs[1], cost_model="flops", verbose=0)
    x, y = batch_for(ex)
    # a function's kernels are reported on its first call only, and extract already ran the
    # traced step once (to measure kernel scratch space): trace the plain step afresh
    plain_step = trace_training_step(model, *specs)
    plain = _executed_op_types(plain_step.function, x, y, plain_step.variables)
    for frac, strategy, chain in ((1.0, "checkpoint-all", "op"), (0.7, "linearized-greedy", "op"),
                                  (0.7, "linearized-greedy", "node"),
                                  (0.7, "linearized-greedy", "run")):
        plan = plan_for(ex, frac, strategy)
        step = rewrite(ex.traced, ex.graph, ex.op_map, plan, chain=chain)
        new = _executed_op_types(step.function, x, y, ex.traced.variables)
        for t in ("BiasAdd", "BiasAddGrad", "Relu", "Conv2D", "MatMul"):
            assert new.get(t, 0) <= plain.get(t, 0), (strategy, chain, t, plain, new)
        fused = [t for t in plain if "Fused" in t or "WithBias" in t]
        assert fused and all(new.get(t, 0) >= plain[t] for t in fused), (chain, plain, new)


def random_order_plan(graph, seed):
    """A plan computing every node once in a random topological order (what a reordering
    solver may return): each node follows some node other than its reference predecessor."""
    g = graph
    rng = np.random.default_rng(seed)
    indeg = [len(g.preds[v]) for v in range(g.n)]
    ready = [v for v in range(g.n) if indeg[v] == 0]
    seq = []
    while ready:
        v = ready.pop(int(rng.integers(len(ready))))
        seq.append(v)
        for s in g.succs[v]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    return make_plan(g, Schedule(sequence=seq), 2**62, strategy=f"random-order-{seed}")


def test_reordered_plans_keep_each_weight_gradient_fused_with_its_bias_gradient(monkeypatch):
    """oneDNN merges a Conv2DBackpropFilter and the BiasAddGrad of the same output gradient into
    one kernel unless one of them alone carries the chain's edge. In orders where the pair's
    node follows the producer of the weight gradient's input (not of the shared gradient), a
    gate on the bias gradient alone left the pair unfused, and so did a chain edge between a
    projection shortcut's gradients and its branch's (oneDNN paired the shortcut's bias
    gradient with the branch's weight gradient): in float32 a reassociation, under
    ``mixed_bfloat16`` a bias gradient 50-95% off the fused kernel's (the unfused bfloat16
    BiasAddGrad loses the sum's precision)."""
    from tf_remat.extract import extract, trace_training_step
    from tf_remat.rewrite import rewrite

    # TensorFlow's own convolution gradients, whose pairs oneDNN fuses (with oneDNN off they
    # are the default's products, and there is no Conv2DBackpropFilter to pair)
    monkeypatch.setenv("TF_REMAT_CONV_GRADIENTS", "tensorflow")
    keras.utils.set_random_seed(3)
    inp = keras.Input((16, 16, 3))
    h = keras.layers.Conv2D(8, 3, padding="same")(inp)
    for width in (8, 8, 16):
        # the last block's biased projection shortcut and its branch's last convolution read
        # one output gradient: two weight and two bias gradients that oneDNN pairs as it likes
        r = h if width == h.shape[-1] else keras.layers.Conv2D(width, 1)(h)
        h = keras.layers.ReLU()(keras.layers.BatchNormalization()(h))
        h = keras.layers.Conv2D(width, 3, padding="same")(keras.layers.Dropout(0.2)(h))
        h = keras.layers.Add()([h, r])
    out = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h))
    model = keras.Model(inp, out)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer="adam")
    specs = (tf.TensorSpec((16, 16, 16, 3)), tf.TensorSpec((16,), tf.int32))
    ex = extract(model, input_spec=specs[0], label_spec=specs[1], cost_model="flops", verbose=0)
    x, y = batch_for(ex)
    # the weight and bias gradients reading one output gradient are one node (whatever pairs
    # oneDNN makes, no chain edge falls between them)
    by_dy = {}
    for op in ex.traced.function.graph.get_operations():
        if op.type == "BiasAddGrad" or op.type == "Conv2DBackpropFilter":
            by_dy.setdefault(op.inputs[-1].name, []).append(op.name)
    shared = [ops for ops in by_dy.values() if len(ops) == 4]
    assert len(shared) == 1, by_dy
    node_of = ex.op_map.node_of()
    assert len({node_of[o] for o in shared[0]}) == 1, shared
    plain_step = trace_training_step(model, *specs)
    plain = _executed_op_types(plain_step.function, x, y, plain_step.variables)
    pairs = plain.get("_MklNativeConv2DBackpropFilterWithBias", 0)
    if not pairs:
        pytest.skip("this TensorFlow does not fuse weight and bias gradients (oneDNN off)")
    # the forward inputs of every backward node recomputed right before it (the weight
    # gradient's input then comes from the op the pair follows), and random orders
    cases = [(updates_first_plan(ex.graph), c) for c in ("node", "op", "run")]
    cases += [(random_order_plan(ex.graph, seed), c) for seed, c in ((0, "node"), (1, "op"))]
    for plan, chain in cases:
        step = rewrite(ex.traced, ex.graph, ex.op_map, plan, chain=chain)
        new = _executed_op_types(step.function, x, y, ex.traced.variables)
        # (at least: in Keras's step oneDNN may pair two of the shared gradient's four ops in
        # a way that leaves the other two unfused)
        assert new.get("_MklNativeConv2DBackpropFilterWithBias", 0) >= pairs, \
            (plan.strategy, chain, new)
        assert_same_step(ex, step, x, y)


def test_chain_keeps_grapplers_rewrite_of_a_residual_sum():
    """A BatchNorm's output (``x * scale + shift``) added to a projection with a bias: Keras's
    step runs Grappler's rewrite of that sum of sums (``AddN`` of the full-size terms, then the
    shift), which needs the inner addition to have one reader and no control edge. The chain
    must not be that edge, or the rewritten step sums in another order and a ReLU turns the
    rounding into different gradients (1% in one layer of a subclassed residual net). Here the
    rewritten gradients are bit for bit the plain step's."""
    from tf_remat.extract import extract, trace_training_step
    from tf_remat.rewrite import rewrite

    keras.utils.set_random_seed(2)
    inp = keras.Input((16, 16, 8))
    h = keras.layers.ReLU()(keras.layers.Conv2D(8, 3, padding="same")(inp))
    r = keras.layers.BatchNormalization()(keras.layers.Conv2D(16, 3, padding="same",
                                                              use_bias=False)(h))
    h = keras.layers.ReLU()(keras.layers.Add()([r, keras.layers.Conv2D(16, 1)(h)]))
    out = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h))
    model = keras.Model(inp, out)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer="adam")
    specs = (tf.TensorSpec((16, 16, 16, 8)), tf.TensorSpec((16,), tf.int32))
    ex = extract(model, input_spec=specs[0], label_spec=specs[1], cost_model="flops",
                 verbose=0, apply_updates=False)
    x, y = batch_for(ex)
    plain = trace_training_step(model, *specs, apply_updates=False)
    step = rewrite(ex.traced, ex.graph, ex.op_map, plan_for(ex, 1.0, "checkpoint-all"),
                   chain="node")
    g1 = [t.numpy() for t in plain.function(x, y)[1:]]
    g2 = [t.numpy() for t in step(x, y)[1:]]
    assert all(np.array_equal(a, b) for a, b in zip(g1, g2))


def test_invalid_plan_and_mismatched_op_map_are_refused():
    from tf_remat.errors import RematError
    from tf_remat.rewrite import rewrite

    ex = extracted("mlp")
    g = ex.graph
    plan = plan_for(ex, 1.0, "checkpoint-all")
    broken = dataclasses.replace(plan, steps=plan.steps[1:])
    with pytest.raises(PlanError):
        rewrite(ex.traced, g, ex.op_map, broken)
    other = extracted("skip_cnn").op_map
    with pytest.raises(RematError, match="op map"):
        rewrite(ex.traced, g, other, plan)
    with pytest.raises(ValueError, match="chain"):
        rewrite(ex.traced, g, ex.op_map, plan, chain="sometimes")


def test_float64_recomputing_step_is_exact():
    """In float64 rounding shrinks by ~1e9, so a rewritten step that computes the same function
    must agree with the original to ~1e-12, fusions and summation order notwithstanding; a
    copy reading a wrong value (an updated weight, another dropout mask, a stale copy) would
    not. This separates rounding from error where float32 (``close``) cannot: deep models at
    initialization amplify float32 rounding to 1e-2 of the largest gradient (ResNet50,
    benchmarks/results/gradients.md)."""
    from tf_remat.extract import extract
    from tf_remat.rewrite import rewrite

    # the loss takes floatx when compiled, the layers the dtype policy
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        keras.utils.set_random_seed(3)
        model, xs, ys = skip_cnn(batch=16, hw=16)
    finally:
        keras.config.set_floatx("float32")
        keras.config.set_dtype_policy("float32")
    xs = tf.TensorSpec(xs.shape, tf.float64)
    for apply_updates in (False, True):
        ex = extract(model, input_spec=xs, label_spec=ys, cost_model="flops", verbose=0,
                     apply_updates=apply_updates)
        # the greedy's reach depends on the kernels' scratch (26 MiB without oneDNN and with
        # TensorFlow's convolution gradients, ~0 otherwise): the first fraction it meets
        for fraction in (0.6, 0.7, 0.8, 0.9):
            plan = plan_for(ex, fraction)
            counts = simulate(ex.graph, plan.steps).compute_counts
            if plan.within_budget and max(counts) > 1:
                break
        assert plan.within_budget and max(counts) > 1
        step = rewrite(ex.traced, ex.graph, ex.op_map, plan)
        rng = np.random.default_rng(0)
        x = tf.constant(rng.standard_normal(xs.shape))
        y = tf.constant(rng.integers(0, 10, ys.shape).astype("int32"))
        o1, o2, v1, v2, before = run_both(ex, step, x, y)
        o1, o2 = (list(o) if isinstance(o, (list, tuple)) else [o] for o in (o1, o2))
        assert o1[0].dtype == np.float64
        assert abs(o1[0] - o2[0]) <= 1e-12 * abs(o1[0])
        if len(o1) > 1:
            scale = max(float(np.abs(g).max()) for g in o1[1:])
            err = max(float(np.abs(a - b).max()) for a, b in zip(o1[1:], o2[1:]))
            assert err <= 1e-10 * scale, err / scale
        for a, b in zip(v1, v2):
            assert np.allclose(a, b, rtol=1e-10, atol=1e-12 * max(1.0, float(np.abs(a).max())))


def test_measuring_beside_a_ballast_reports_each_layout():
    """``measure_step_peak`` runs the step beside held tensors of the given sizes (so the
    allocator's free chunks differ), or beside fragmented memory (a tuple of sizes, every other
    one freed), and counts the worst; the ballast itself is not counted."""
    from tf_remat.api import measure_step_peak, verification_layouts

    ex = extracted("skip_cnn")
    x, y = batch_for(ex)
    big = max(ex.graph.memory)
    layouts = verification_layouts(big)
    assert layouts[:3] == [0, int(0.6 * big), big] and len(layouts[3]) > 2
    snap = Snapshot(ex.traced.variables)
    m = measure_step_peak(ex.traced.function, x, y, variables=ex.traced.variables, runs=1,
                          ballast=(0, big // 2, big, layouts[3]))
    assert len(m["layouts"]) == 4
    assert m["step_peak_bytes"] == max(m["layouts"])
    # a held ballast is memory from before the step: it must not show in the step's peak
    assert min(m["layouts"]) >= 0.8 * ex.graph.no_remat_peak
    # ... and the whole-chunk rounding stays under half the step, plus a chunk for the kernel
    # scratch (without oneDNN a 27 MiB im2col buffer, half of this step: one history gave +62%)
    assert max(m["layouts"]) <= 1.5 * ex.graph.no_remat_peak + ex.info["workspace_bytes"]
    assert all(np.array_equal(a, b) for a, b in zip(snap.values, snap.now()))


@pytest.mark.parametrize("outer", [False, True], ids=["eager", "in_tf_function"])
def test_grappler_does_not_move_a_backward_product_into_the_forward_pass(outer):
    """GELU's derivative multiplies the output gradient by a forward value and then by a
    constant. Grappler's constant folding (and its arithmetic optimizer) rewrote
    ``(g * m) * c`` into ``g * (c * m)`` whenever the inner product had one reader (with the
    dependency optimizer on, also once the chain's ``/_done`` identity on it became a control
    edge), and ``c * m``, reading forward values only, ran in the forward pass and was held
    until the backward one: a GELU MLP's recomputing plans measured 6-29% over their
    simulation. The inner product now has a second reader, and the dependency optimizer is
    off for the step, also when a user's ``tf.function`` calls it (it is not inlined there)."""
    from tf_remat import solve
    from tf_remat.api import step_allocations
    from tf_remat.extract import extract
    from tf_remat.rewrite import rewrite

    keras.utils.set_random_seed(0)
    inp = keras.Input((64,))
    h = keras.layers.Dense(128)(inp)
    for _ in range(4):
        r = keras.layers.LayerNormalization()(h)
        r = keras.layers.Dense(512, activation="gelu")(r)
        h = keras.layers.Add()([h, keras.layers.Dense(128)(r)])
    model = keras.Model(inp, keras.layers.Dense(10)(h))
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer="adam")
    batch = 1024
    ex = extract(model, input_spec=tf.TensorSpec((batch, 64)),
                 label_spec=tf.TensorSpec((batch,), tf.int32), cost_model="flops", verbose=0)
    g = ex.graph
    plan = solve(g, g.fixed_memory + (g.no_remat_peak - g.fixed_memory) // 2, "fastsa",
                 time_limit=10, seed=0)
    assert len(plan.sequence) > g.n  # it recomputes
    step = rewrite(ex.traced, g, ex.op_map, plan)
    x = tf.random.stateless_normal((batch, 64), seed=(1, 2))
    y = tf.zeros((batch,), tf.int32)
    fn = tf.function(lambda a, b: step.function(a, b)) if outer else step.function
    got = step_allocations(fn, x, y, variables=ex.traced.variables)
    measured = got["requested_peak_bytes"] + got["owned_bytes"] + (x.shape[0] * 64 + batch) * 4
    # each pushed-down product is a 2 MiB (1024 x 512) buffer, 6-9% of this plan's peak
    assert measured <= 1.03 * plan.peak_memory, (measured, plan.peak_memory)
