"""Extraction of a Keras training step into a solver graph: structure, memory, profiling, CLI."""

import collections
import json
import os

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tf_remat.errors import RematError, UnsupportedOpError  # noqa: E402
from tf_remat.graph import Graph  # noqa: E402

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------- small models
def small_cnn():
    inp = keras.Input((32, 32, 3))
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inp)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Dropout(0.3)(h)
    h = keras.layers.Conv2D(64, 3, padding="same")(h)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Activation("relu")(h)
    h = keras.layers.Flatten()(h)
    out = keras.layers.Dense(10)(h)
    m = keras.Model(inp, out, name="small_cnn")
    m.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              optimizer="adam")
    return m, (64, 32, 32, 3)


def res_block():
    inp = keras.Input((32, 32, 16))
    h = inp
    for _ in range(2):
        r = keras.layers.Conv2D(16, 3, padding="same")(h)
        r = keras.layers.BatchNormalization()(r)
        r = keras.layers.ReLU()(r)
        r = keras.layers.Conv2D(16, 3, padding="same")(r)
        h = keras.layers.Add()([r, h])
        h = keras.layers.ReLU()(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    out = keras.layers.Dense(10)(h)
    m = keras.Model(inp, out, name="res_block")
    m.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              optimizer="sgd")
    return m, (64, 32, 32, 16)


def mlp():
    inp = keras.Input((512,))
    h = keras.layers.Dense(1024, activation="relu")(inp)
    h = keras.layers.Dense(1024, activation="relu")(h)
    out = keras.layers.Dense(10)(h)
    m = keras.Model(inp, out, name="mlp")
    m.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              optimizer="adam")
    return m, (256, 512)


BUILDERS = {"small_cnn": small_cnn, "res_block": res_block, "mlp": mlp}
_CACHE = {}


def extracted(name, cost_model="flops"):
    key = (name, cost_model)
    if key not in _CACHE:
        from tf_remat.extract import extract

        model, shape = BUILDERS[name]()
        _CACHE[key] = extract(model, input_spec=tf.TensorSpec(shape),
                              label_spec=tf.TensorSpec((shape[0],), tf.int32),
                              cost_model=cost_model, verbose=0)
    return _CACHE[key]


def batch_dependent_ops(ex):
    """Live ops reachable from the batch / labels through data edges (static shape ops aside)."""
    from tf_remat.extract import SHAPE_OPS

    g = ex.traced.function.graph
    live = set(ex.op_map.fixed_ops) | {o for ops in ex.op_map.nodes for o in ops}
    start = [g.get_operation_by_name(n) for n in ex.traced.input_ops + ex.traced.label_ops]
    seen, stack = set(), list(start)
    while stack:
        op = stack.pop()
        for t in op.outputs:
            for c in t.consumers():
                if c.name in seen or c.name not in live or c.type in SHAPE_OPS:
                    continue
                seen.add(c.name)
                stack.append(c)
    return seen


# --------------------------------------------------------------------- structure
@pytest.mark.parametrize("name", list(BUILDERS))
def test_graph_valid_and_solver_sized(name, tmp_path):
    ex = extracted(name)
    g = ex.graph
    assert isinstance(g, Graph)
    assert 5 <= g.n <= 400, g.n
    assert g.n < sum(len(o) for o in ex.op_map.nodes)  # ops really were grouped
    assert len(ex.op_map.nodes) == g.n
    assert all(m >= 0 for m in g.memory) and g.fixed_memory > 0
    assert g.no_remat_peak > g.fixed_memory
    assert any(g.backward) and not all(g.backward)
    # a node with no ops holds a kernel's scratch space (extract.with_workspace_nodes): free
    assert all((c > 0) == bool(ops) for c, ops in zip(g.cost, ex.op_map.nodes))
    assert all(g.names[v].endswith("/workspace") for v in range(g.n) if not ex.op_map.nodes[v])
    # JSON round trip of graph and op map
    path = tmp_path / "g.json"
    ex.save(path)
    assert Graph.load(path) == g
    from tf_remat.extract import OpMap, op_map_path

    assert op_map_path(path) == str(tmp_path / "g.ops.json")
    assert OpMap.load(op_map_path(path)) == ex.op_map
    # what a node holds only while it runs: nothing for a workspace node (no ops)
    assert len(ex.op_map.transient) == g.n and min(ex.op_map.transient) >= 0
    assert all(not t for t, ops in zip(ex.op_map.transient, ex.op_map.nodes) if not ops)


def test_transient_bytes_are_what_a_node_frees_before_it_ends():
    """BatchNorm's moments: the squared differences (one activation's size) are reduced to the
    variance inside the node, so no later node reads them; the node's memory leaves them out
    and its transient bytes count them."""
    ex = extracted("small_cnn")
    act = 64 * 32 * 32 * 32 * 4
    names = {nd: v for v, ops in enumerate(ex.op_map.nodes) for nd in ops}
    sq = [names[o] for o in names if o.endswith("moments/SquaredDifference")]
    assert sq, "the model's BatchNorm should compute squared differences"
    v = sq[0]
    assert ex.op_map.transient[v] >= act
    assert ex.graph.memory[v] < act


@pytest.mark.parametrize("name", list(BUILDERS))
def test_no_recomputable_stateful_op(name):
    from tf_remat.extract import _is_side_effect

    ex = extracted(name)
    g = ex.traced.function.graph
    stateful_nodes = 0
    for v, ops in enumerate(ex.op_map.nodes):
        if any(_is_side_effect(g.get_operation_by_name(o).type) for o in ops):
            stateful_nodes += 1
            assert not ex.graph.recomputable[v], ex.graph.names[v]
    assert stateful_nodes > 0  # optimizer updates (and BatchNorm statistics) are nodes
    assert any(ex.graph.recomputable)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_op_map_covers_batch_dependent_ops_once(name):
    ex = extracted(name)
    g = ex.traced.function.graph
    counts = {}
    for ops in ex.op_map.nodes:
        for o in ops:
            counts[o] = counts.get(o, 0) + 1
    assert all(c == 1 for c in counts.values())
    assert not set(counts) & set(ex.op_map.fixed_ops)
    missing = batch_dependent_ops(ex) - set(counts) - set(ex.op_map.sink_ops) \
        - set(ex.op_map.bypass_ops)
    assert not missing, sorted(missing)[:5]
    # fixed ops never read a node op (they run once, before anything else), except shape ops
    # whose values are static (given in the op map)
    node_ops = set(counts)
    for name_ in ex.op_map.fixed_ops:
        op = g.get_operation_by_name(name_)
        if any(t.op.name in node_ops for t in op.inputs):
            assert name_ in ex.op_map.static_shapes, name_
            value = ex.op_map.static_shapes[name_]
            assert value == [tf.get_static_value(t).tolist() if op.type != "ShapeN"
                             else op.inputs[k].shape.as_list()
                             for k, t in enumerate(op.outputs)]
        assert not any(c.name in node_ops for c in op.control_inputs), name_
    # each node's ops are in a topological order
    for ops in ex.op_map.nodes:
        pos = {o: i for i, o in enumerate(ops)}
        for o in ops:
            for t in g.get_operation_by_name(o).inputs:
                if t.op.name in pos:
                    assert pos[t.op.name] < pos[o]


@pytest.mark.parametrize("name", list(BUILDERS))
def test_fusable_pairs_share_a_node(name):
    ex = extracted(name)
    g = ex.traced.function.graph
    node_of = ex.op_map.node_of()
    pairs = 0
    for o in node_of:
        op = g.get_operation_by_name(o)
        if op.type == "BiasAdd" and op.inputs[0].op.type in ("Conv2D", "MatMul"):
            assert node_of[o] == node_of[op.inputs[0].op.name], o
            pairs += 1
        if op.type == "BiasAddGrad":
            dy = op.inputs[0]
            for c in dy.consumers():
                if c.type == "Conv2DBackpropFilter":
                    assert node_of[c.name] == node_of[o], o
                    pairs += 1
    assert pairs > 0


def test_views_allocate_nothing():
    ex = extracted("small_cnn")
    from tf_remat.extract import VIEW_OPS

    g = ex.traced.function.graph
    for bufs in ex.op_map.buffers:
        for tensor_name, _ in bufs:
            assert g.get_tensor_by_name(tensor_name).op.type not in VIEW_OPS


# --------------------------------------------------------------------- errors
def test_unknown_batch_dimension_is_a_clear_error():
    from tf_remat.extract import extract

    model, shape = mlp()
    with pytest.raises(UnsupportedOpError, match=r"input_spec.*unknown dimension 0"):
        extract(model, input_spec=tf.TensorSpec((None, 512)),
                label_spec=tf.TensorSpec((None,), tf.int32), cost_model="flops", verbose=0)


def test_data_dependent_shape_names_the_tensor():
    from tf_remat.extract import extract

    class Positive(keras.layers.Layer):
        def call(self, x):
            return tf.reshape(tf.boolean_mask(x, x > 0), (-1, 1))

    inp = keras.Input((8,))
    h = keras.layers.Dense(8)(inp)
    h = Positive(name="positive")(h)
    out = keras.layers.Dense(1)(h)
    model = keras.Model(inp, out)
    with pytest.raises(UnsupportedOpError, match=r"tensor '[^']*positive[^']*'.*unknown"):
        extract(model, input_spec=tf.TensorSpec((4, 8)), label_spec=tf.TensorSpec((4, 1)),
                loss="mse", optimizer="sgd", cost_model="flops", verbose=0)


def test_a_py_function_whose_gradient_has_no_shape_says_what_to_do():
    from tf_remat.extract import extract

    def doubled(t):
        y = tf.py_function(lambda a: 2 * a, [t], tf.float32)
        y.set_shape(t.shape)  # the forward output's shape; its gradient's stays unknown
        return y

    inp = keras.Input((8,))
    h = keras.layers.Lambda(doubled, output_shape=lambda s: s)(keras.layers.Dense(8)(inp))
    model = keras.Model(inp, keras.layers.Dense(1)(h))
    with pytest.raises(UnsupportedOpError, match=r"EagerPyFunc.*write the layer with "
                                                 r"TensorFlow ops"):
        extract(model, input_spec=tf.TensorSpec((4, 8)), label_spec=tf.TensorSpec((4, 1)),
                loss="mse", optimizer="sgd", cost_model="flops", verbose=0)


def test_missing_loss_is_a_clear_error():
    from tf_remat.extract import extract

    inp = keras.Input((4,))
    model = keras.Model(inp, keras.layers.Dense(2)(inp))
    with pytest.raises(RematError, match="loss"):
        extract(model, input_spec=tf.TensorSpec((2, 4)), label_spec=tf.TensorSpec((2,)),
                cost_model="flops", verbose=0)


# --------------------------------------------------------------------- memory vs TensorFlow
def measured_peak_layouts(ex, fractions=(0.0, 0.15, 0.3, 0.45, 0.6, 0.8, 1.0, 1.4, 2.0, 3.0),
                          step=None):
    """The step's measured peak beside a held ballast of each fraction of its largest value.

    TensorFlow's BFC allocator hands out a free chunk less than twice a request whole and counts
    all of it, so one step measures up to ~25% more after some allocation histories than after
    others, while runs in one history are identical. Each ballast is another history; the lowest
    peak is the one without that rounding, the figure the simulator models. Ten layouts: late in
    a full-suite process, whose pool earlier tests' models have cut up, all five of an earlier
    set measured small_cnn's step 8.4 MiB (19%) over its prediction, which it measures within
    1-4% of alone.
    """
    from tf_remat.api import measure_step_peak
    from tf_remat.extract import _random_like

    x = _random_like(ex.traced.input_spec, seed=1)
    y = _random_like(ex.traced.label_spec, seed=2, labels=10)
    big = max(ex.graph.memory)
    m = measure_step_peak(step or ex.traced.function, x, y, variables=ex.traced.variables,
                          ballast=[int(f * big) for f in fractions])
    # the step's own growth: without its variables and batch, which the caller adds back
    return [p - m["owned_bytes"] for p in m["layouts"]]


def requested_peak(step, x, y, variables):
    """The peak of the bytes ``step``'s kernels request (the quantity the simulator models),
    with the variables and the batch, which the step does not allocate, added."""
    from tf_remat.api import step_allocations

    got = step_allocations(step, x, y, variables=variables)
    return got["requested_peak_bytes"] + got["owned_bytes"] + sum(
        int(np.prod(t.shape)) * t.dtype.size for t in tf.nest.flatten((x, y)))


def test_step_allocations_nets_out_a_replaced_variable_buffer():
    # an update whose result becomes the variable's buffer frees the old one, which was
    # allocated before the step: the step's net memory is the same after it, so 1 MiB more
    # after the update peaks at 1 MiB (counting the new buffer alone made it 2; InceptionV3's
    # momentum updates so looked 72 MiB over their plan)
    from tf_remat.api import step_allocations

    mib = 2**20
    v = tf.Variable(tf.ones([mib // 4]))

    @tf.function
    def step(x, y):
        v.assign(v * 2.0)
        with tf.control_dependencies([v.read_value()]):
            return tf.reduce_sum(x * 3.0) + y

    got = step_allocations(step, tf.ones([mib // 4]), tf.constant(1.0), variables=[v])
    assert mib <= got["requested_peak_bytes"] < 1.1 * mib, got
    assert float(v[0]) == 1.0  # restored


@pytest.mark.skipif(bool(tf.config.list_logical_devices("GPU")), reason="CPU memory model")
@pytest.mark.parametrize("name", list(BUILDERS))
def test_predicted_peak_matches_tensorflow(name):
    # Other tests' models live in this process too, so the step's own peak is the growth over
    # what was allocated before it, plus the step's resident memory (variables, batch).
    from tf_remat.rewrite import rewrite
    from tf_remat.solvers import solve

    ex = extracted(name)
    g = ex.graph
    # the graph's own order, run as a rewritten step runs it: one op after another
    plan = solve(g, g.no_remat_peak, "checkpoint-all")
    assert plan.peak_memory == g.no_remat_peak
    step = rewrite(ex.traced, g, ex.op_map, plan)
    # what the simulator models is what the kernels request: 0.997-0.998 of it on small_cnn
    # and res_block, 0.94 on the mlp (a conservative 2 MiB), the same in every run
    from tf_remat.extract import _random_like

    x = _random_like(ex.traced.input_spec, seed=1)
    y = _random_like(ex.traced.label_spec, seed=2, labels=10)
    requested = requested_peak(step, x, y, ex.traced.variables)
    assert 0.9 * g.no_remat_peak <= requested <= 1.03 * g.no_remat_peak, \
        (g.no_remat_peak, requested)
    # what the allocator holds is at least the requests: its whole-chunk rounding moves it
    # with the process's history (late in a full-suite run, all five layouts of an earlier
    # version of this test measured small_cnn 19% over, which alone measures within 1-4%)
    peaks = [p + g.fixed_memory for p in measured_peak_layouts(ex, step=step)]
    scratch = ex.info["workspace_bytes"]
    assert min(peaks) >= 0.85 * g.no_remat_peak, (g.no_remat_peak, peaks)
    # the allocator's rounding only ever adds, and less than the request each time: a chunk is
    # handed out whole only when it is under twice the request (one full-suite run measured
    # +63% in its worst layout)
    assert max(peaks) < 2 * g.no_remat_peak, (g.no_remat_peak, peaks)
    # the plain step runs independent ops side by side: without oneDNN, two filter-gradient
    # convolutions at once hold two ~27 MiB scratch buffers, which no sequential order does;
    # and its executor picks its own order, whose peak may be lower than the reference
    # order's (res_block: 0.87 of it, 0.79 once BatchNorm gradients no longer materialize
    # their broadcasts, which lowered the executor's peak and not the reference order's), or
    # higher by one value held beside the order's (res_block on 2 cores: 36.06 MiB against
    # 32.07, exactly one 4 MiB activation more, in every run here; one CI run measured 36.98)
    plain = min(p + g.fixed_memory for p in measured_peak_layouts(ex))
    assert 0.75 * g.no_remat_peak <= plain <= (1.15 * g.no_remat_peak + max(g.memory)
                                               + 2 * scratch), \
        (g.no_remat_peak, plain, max(g.memory), scratch)


@pytest.mark.skipif(bool(tf.config.list_logical_devices("GPU")), reason="CPU memory model")
def test_values_of_variables_alone_are_scheduled_not_held():
    # SGD with momentum computes momentum * m for every weight from variables alone; TensorFlow
    # runs those products at the start of the step and holds them to the update at its end (a
    # third copy of the weights). As nodes they wait until just before their update.
    from tf_remat.extract import extract
    from tf_remat.rewrite import rewrite
    from tf_remat.solvers import solve

    inp = keras.Input((256,))
    h = inp
    for _ in range(8):
        h = keras.layers.Dense(1024, activation="relu", use_bias=False)(h)
    model = keras.Model(inp, keras.layers.Dense(10)(h), name="deep_mlp")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.SGD(0.01, momentum=0.9))
    ex = extract(model, input_spec=tf.TensorSpec((16, 256)),
                 label_spec=tf.TensorSpec((16,), tf.int32), cost_model="flops", verbose=0)
    g = ex.graph
    weights = sum(int(v.numpy().nbytes) for v in model.trainable_variables)
    # weights, momenta, the batch; no products
    assert g.fixed_memory < 2 * weights + 2**20, (g.fixed_memory, weights)
    for v in range(g.n):  # a node reading no other node runs right before its first reader
        if not g.preds[v] and g.succs[v]:
            first = min(g.position[s] for s in g.succs[v])
            assert all(not g.preds[u] for u in g.order[g.position[v]:first]), g.label(v)
    plan = solve(g, g.no_remat_peak, "checkpoint-all")
    step = rewrite(ex.traced, g, ex.op_map, plan)
    rewritten = min(measured_peak_layouts(ex, step=step))
    plain = min(measured_peak_layouts(ex))
    # measured on one CPU: 21.0 against 33.6 MiB over the variables and batch (weights 29 MiB)
    assert rewritten < plain - 0.25 * weights, (rewritten, plain, weights)


def test_convolution_gradients_as_products_equal_tensorflows(monkeypatch):
    """``TF_REMAT_CONV_GRADIENTS=matmul`` (the default where oneDNN is off) traces Conv2D
    gradients as patch products and flipped convolutions where they apply (NHWC, no dilation,
    no groups, 'SAME' or 'VALID'; strided layers through a zero-dilated output gradient), and
    Conv2DTranspose kernel gradients as patch products too, and TensorFlow's kernels elsewhere;
    a Conv2DTranspose layer's forward op (a Conv2DBackpropInput, ~24 MiB of scratch without
    oneDNN) is one convolution over its output's phases. With the patch limit at 1 MiB the
    first layers' patches come in slices of the batch. Same sums in another order: float32
    reassociation over at most 8x32x32x9 terms, so 1e-5 of the largest (the loss too)."""
    from tf_remat import extract as extract_module
    import numpy as np

    from tf_remat.extract import trace_training_step

    def build():
        keras.utils.set_random_seed(0)
        inp = keras.Input((32, 32, 16))
        h = keras.layers.Conv2D(32, 3, padding="same")(inp)
        h = keras.layers.Conv2D(32, 3, strides=2, padding="same", activation="relu")(h)
        h = keras.layers.Conv2D(48, 1)(h)
        h = keras.layers.Conv2D(48, 1, strides=2, activation="relu")(h)
        h = keras.layers.Conv2D(16, 3, padding="valid")(h)
        h = keras.layers.Conv2D(16, (3, 2), strides=(2, 1), padding="same")(h)
        h = keras.layers.Conv2D(16, 4, strides=3, padding="same")(h)
        h = keras.layers.Conv2D(16, 3, padding="same", groups=2)(h)
        h = keras.layers.Conv2DTranspose(16, 3, strides=2, padding="same")(h)
        h = keras.layers.Conv2DTranspose(8, 2, strides=2, activation="relu")(h)
        m = keras.Model(inp, keras.layers.Dense(10)(keras.layers.Flatten()(h)))
        m.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer="sgd")
        return m

    x = tf.random.stateless_normal((8, 32, 32, 16), seed=(1, 2))
    y = tf.constant(np.arange(8) % 10, tf.int32)
    monkeypatch.setattr(extract_module, "_PATCH_GRAD_BYTES", 1 << 20)
    # the phase form wherever it applies (extract measures per layer which peaks lower)
    monkeypatch.setattr(extract_module, "_phases_lighter", lambda *a, **k: True)
    grads, types = {}, {}
    for m in ("tensorflow", "matmul"):
        monkeypatch.setenv("TF_REMAT_CONV_GRADIENTS", m)
        t = trace_training_step(build(), tf.TensorSpec(x.shape), tf.TensorSpec((8,), tf.int32),
                                apply_updates=False)
        grads[m] = [g.numpy() for g in t.function(x, y)]
        types[m] = collections.Counter(op.type for op in t.function.graph.get_operations())
    assert len(grads["tensorflow"]) == len(grads["matmul"]) == 1 + 2 * 11  # loss, 11 layers
    for a, b in zip(grads["tensorflow"], grads["matmul"]):
        assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(a)), a.shape
    assert types["matmul"]["MatMul"] > types["tensorflow"]["MatMul"]
    # the transposed layers' forward ops, and every input gradient (the first layer's is
    # traced, and pruned: nothing reads it) but the grouped layer's, which is XLA's
    assert types["tensorflow"]["Conv2DBackpropInput"] == 2 + 7
    assert types["matmul"]["Conv2DBackpropInput"] == 0
    assert "ExtractImagePatches" not in types["tensorflow"]
    # no filter gradient is TensorFlow's kernel (the grouped layer runs as an XLA cluster on CPU)
    assert types["tensorflow"]["Conv2DBackpropFilter"] == 9
    assert types["matmul"]["Conv2DBackpropFilter"] == 0
    # 7 layers' patches, the first two's (4.5 and 2.25 MiB) in 8 and 3 slices of the batch;
    # a transposed layer is one convolution over its phases' shared window: the first's 2x2
    # (patches), the second's 1x1 (its input is the patch matrix)
    assert types["matmul"]["ExtractImagePatches"] == 7 + 7 + 1


def test_a_transposed_convolution_as_one_convolution_over_its_phases_is_tensorflows():
    """``_phase_transposed_conv`` (a Conv2DTranspose or Conv3DTranspose layer's forward op
    where oneDNN is off) against TensorFlow's Conv2DBackpropInput and Conv3DBackpropInputV2:
    kernels of 1 to 5 (some not square), strides of 1 to 3 (some differing by axis, some over
    the kernel: phases no tap reaches), 'SAME' and 'VALID', sizes the stride does not divide.
    Same products summed in another order."""
    import itertools

    import numpy as np

    from tf_remat.extract import _phase_transposed_conv

    rng = np.random.default_rng(0)

    def check(x_shape, kernel, strides, padding):
        nd = len(kernel)
        conv, op = (tf.nn.conv2d, tf.raw_ops.Conv2DBackpropInput) if nd == 2 else \
            (tf.nn.conv3d, tf.raw_ops.Conv3DBackpropInputV2)
        y = conv(tf.zeros(x_shape), tf.zeros([*kernel, 3, 4]), strides=[1, *strides, 1],
                 padding=padding)
        g = tf.constant(rng.standard_normal(y.shape.as_list()), tf.float32)
        w = tf.constant(rng.standard_normal([*kernel, 3, 4]), tf.float32)
        ref = op(input_sizes=x_shape, filter=w, out_backprop=g, strides=[1, *strides, 1],
                 padding=padding)
        got = _phase_transposed_conv(x_shape, w, g, padding, strides)
        assert got is not None and got.shape == ref.shape
        err = float(tf.reduce_max(tf.abs(ref - got)))
        assert err <= 1e-5 * float(tf.reduce_max(tf.abs(ref))), (kernel, strides, padding)

    cases = 0
    for k, s, padding, size in itertools.product([1, 2, 3, 4, 5], [1, 2, 3], ["SAME", "VALID"],
                                                 [5, 8]):
        for kh, kw, sh, sw in [(k, k, s, s), (k, max(1, k - 1), s, max(1, s - 1))]:
            if padding == "VALID" and max(kh, kw) > size:
                continue
            check([2, size, size + 1, 3], (kh, kw), (sh, sw), padding)
            cases += 1
    assert cases >= 100
    # in three dimensions, the phases of every axis at once
    for kernel, strides, padding in [((3, 3, 3), (2, 2, 2), "SAME"), ((2, 3, 1), (1, 2, 3),
                                     "SAME"), ((3, 2, 4), (2, 1, 2), "VALID"),
                                     ((1, 1, 1), (2, 2, 1), "VALID"), ((4, 4, 2), (3, 2, 1),
                                     "SAME"), ((3, 3, 3), (1, 1, 1), "SAME")]:
        check([2, 5, 6, 7, 3], kernel, strides, padding)


def test_the_phase_form_is_taken_where_it_peaks_lower(monkeypatch):
    """``_phases_lighter`` takes the phase form where it peaks lower than TensorFlow's kernel,
    and only there (not where it is merely faster: the choice is made before the budget is
    known), and TensorFlow's kernel where a measurement fails; the measurements stubbed, so
    that the rule, not this CPU, is what is checked; one measurement per shape."""
    from tf_remat import extract as extract_module

    calls = []

    def measured(peaks):
        def fake(fns, shapes, dtype, device):
            calls.append(shapes)
            return peaks
        return fake

    w, g = tf.zeros([3, 3, 3, 4, 8]), tf.zeros([2, 4, 4, 4, 8])
    for peaks, taken in [([5 << 20, 1 << 20], True), ([1 << 20, 1 << 20], False),
                         ([1 << 20, (1 << 20) + 1], False), (None, False)]:
        extract_module._PHASES_CHOICE.clear()
        monkeypatch.setattr(extract_module, "_peaks_on_zeros", measured(peaks))
        for _ in range(2):
            assert extract_module._phases_lighter([2, 8, 8, 8, 4], w, g, "SAME",
                                                  (2, 2, 2)) is taken, peaks
    assert len(calls) == 4
    extract_module._PHASES_CHOICE.clear()


def test_conv3d_gradients_as_products_equal_tensorflows(monkeypatch):
    """Conv3D gradients as products (forced here: ``optimize`` measures per layer which takes
    less memory) equal TensorFlow's kernels': filter gradients as one 2-D patch product per
    depth tap, input gradients as flipped stride-1 Conv3Ds of the zero-dilated output gradient;
    'SAME' and 'VALID', strides per axis, even and uneven kernels, 1x1x1 layers; Conv3DTranspose
    layers' forward ops as one Conv3D over their outputs' phases (forced too) and their kernel
    gradients as the same products. Same sums in another order: float32 reassociation, so 1e-5
    of the largest."""
    import numpy as np

    from tf_remat import extract as extract_module
    from tf_remat.extract import trace_training_step

    def build():
        keras.utils.set_random_seed(0)
        inp = keras.Input((7, 12, 12, 8))
        h = keras.layers.Conv3D(16, 3, padding="same")(inp)
        h = keras.layers.Conv3D(16, 3, strides=2, padding="same", activation="relu")(h)
        h = keras.layers.Conv3D(12, 1)(h)
        h = keras.layers.Conv3D(12, 1, strides=(1, 2, 2), activation="relu")(h)
        h = keras.layers.Conv3D(8, (2, 3, 3), padding="valid")(h)
        h = keras.layers.Conv3D(8, (3, 2, 1), strides=(2, 1, 1), padding="same")(h)
        h = keras.layers.Conv3D(8, 2, strides=3, padding="same")(h)
        h = keras.layers.Conv3DTranspose(8, 3, strides=2, padding="same")(h)
        h = keras.layers.Conv3DTranspose(4, 2, strides=(1, 2, 2), activation="relu")(h)
        m = keras.Model(inp, keras.layers.Dense(10)(keras.layers.Flatten()(h)))
        m.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer="sgd")
        return m

    x = tf.random.stateless_normal((4, 7, 12, 12, 8), seed=(1, 2))
    y = tf.constant(np.arange(4) % 10, tf.int32)
    monkeypatch.setattr(extract_module, "_PATCH_GRAD_BYTES", 1 << 18)
    monkeypatch.setattr(extract_module, "_conv3d_products_smaller", lambda *a, **k: True)
    monkeypatch.setattr(extract_module, "_phases_lighter", lambda *a, **k: True)
    grads, types = {}, {}
    for m in ("tensorflow", "matmul"):
        monkeypatch.setenv("TF_REMAT_CONV_GRADIENTS", m)
        t = trace_training_step(build(), tf.TensorSpec(x.shape), tf.TensorSpec((4,), tf.int32),
                                apply_updates=False)
        grads[m] = [g.numpy() for g in t.function(x, y)[1:]]
        types[m] = collections.Counter(op.type for op in t.function.graph.get_operations())
    for a, b in zip(grads["tensorflow"], grads["matmul"]):
        assert np.max(np.abs(a - b)) <= 1e-5 * max(np.max(np.abs(a)), 1e-30), a.shape
    # (the first layer's input gradient is traced too, and pruned: nothing reads it); the two
    # transposed layers are Conv3DBackpropInputV2 ops run forward by TensorFlow, whose input
    # gradients are Conv3Ds, and phase Conv3Ds here, whose gradients are products
    assert types["tensorflow"]["Conv3DBackpropFilterV2"] == 7 + 2
    assert types["tensorflow"]["Conv3DBackpropInputV2"] == 7 + 2
    assert types["matmul"]["Conv3DBackpropFilterV2"] == 0
    assert types["matmul"]["Conv3DBackpropInputV2"] == 0
    # the flipped ones, and the phase convolutions, each with its input gradient (flipped)
    assert types["matmul"]["Conv3D"] == types["tensorflow"]["Conv3D"] - 2 + 7 + 2 * 2


def test_broadcast_gradients_are_sunk_into_their_readers(monkeypatch):
    """A BatchNorm's reduce_mean gradients (Tile to the activation's shape, then divided and
    scaled) run on the per-channel values and reach the full-size gradients as broadcasts:
    no Tile is left in the solver's nodes, the step's gradients are Keras's (the same
    element-wise ops, one AddN summed in another order: float32 reassociation of three terms,
    so 1e-5 of the largest), and the step needs less memory than with the Tiles."""
    import numpy as np

    from tf_remat import extract as extract_module
    from tf_remat.extract import extract, trace_training_step

    monkeypatch.setenv("TF_REMAT_CONV_GRADIENTS", "tensorflow")
    model, shape = small_cnn()
    xs, ys = tf.TensorSpec(shape), tf.TensorSpec((shape[0],), tf.int32)
    x = tf.random.stateless_normal(shape, seed=(3, 4))
    y = tf.constant(np.arange(shape[0]) % 10, tf.int32)
    sunk = trace_training_step(model, xs, ys, apply_updates=False)
    keras_step = trace_training_step(model, xs, ys, apply_updates=False,
                                     conv_gradients="tensorflow")
    variables = list({id(v): v for v in sunk.variables + keras_step.variables}.values())
    saved = [v.numpy().copy() for v in variables]
    grads = {}
    for name, t in (("sunk", sunk), ("keras", keras_step)):
        grads[name] = [g.numpy() for g in t.function(x, y)[1:]]
        for v, value in zip(variables, saved):  # the same dropout mask for both
            v.assign(value)
    for a, b in zip(grads["keras"], grads["sunk"]):
        assert np.max(np.abs(a - b)) <= 1e-5 * max(np.max(np.abs(a)), 1e-30), a.shape

    without_tiles = extract(model, input_spec=xs, label_spec=ys, cost_model="flops", verbose=0)
    fg = without_tiles.traced.function.graph
    node_types = collections.Counter(fg.get_operation_by_name(o).type
                                     for ops in without_tiles.op_map.nodes for o in ops)
    assert node_types["Tile"] == 0
    monkeypatch.setattr(extract_module, "_sink_broadcasts", lambda graph, first, g: g)
    tiled = extract(model, input_spec=xs, label_spec=ys, cost_model="flops", verbose=0)
    fg = tiled.traced.function.graph
    assert sum(fg.get_operation_by_name(o).type == "Tile"
               for ops in tiled.op_map.nodes for o in ops) >= 4  # two per BatchNorm
    assert without_tiles.graph.no_remat_peak < tiled.graph.no_remat_peak


def test_a_gradient_of_many_terms_is_summed_one_term_at_a_time(monkeypatch):
    """A static TimeDistributed slices its input once per frame, and each slice's gradient is
    the whole input's size: TensorFlow's one AddN of the eight needs them all at once. Summed
    in a chain, the solver reaches far lower, the rewritten step requests what the plan says
    (no rewrite merges the chain back), and the gradients are Keras's."""
    from tf_remat import extract as extract_module
    from tf_remat.extract import CHAIN_SUM, extract, tensor_bytes, trace_training_step
    from tf_remat.rewrite import rewrite
    from tf_remat.solvers import solve

    keras.utils.set_random_seed(3)
    inp = keras.Input((8, 16, 16, 3))
    h = keras.layers.TimeDistributed(keras.layers.Conv2D(16, 3, padding="same"))(inp)
    h = keras.layers.TimeDistributed(keras.layers.Conv2D(8, 3, padding="same",
                                                         activation="relu"))(h)
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.TimeDistributed(
        keras.layers.GlobalAveragePooling2D())(h))
    model = keras.Model(inp, keras.layers.Dense(4)(h))
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
    xs, ys = tf.TensorSpec((16, 8, 16, 16, 3)), tf.TensorSpec((16,), tf.int32)
    term = 16 * 8 * 16 * 16 * 16 * 4  # one frame's slice gradient: 2 MiB

    chained = extract(model, input_spec=xs, label_spec=ys, cost_model="flops", verbose=0)
    fg = chained.traced.function.graph
    ops = [fg.get_operation_by_name(o) for node in chained.op_map.nodes for o in node]
    assert sum(CHAIN_SUM in o.name for o in ops) == 14  # two sliced inputs, 7 links each
    assert not any(o.type == "AddN" and tensor_bytes(o.outputs[0]) >= term for o in ops)
    monkeypatch.setattr(extract_module, "_chain_sums", lambda graph, first, g: g)
    summed = extract(model, input_spec=xs, label_spec=ys, cost_model="flops", verbose=0)
    monkeypatch.undo()
    floor = summed.graph.budget_lower_bound
    assert chained.graph.budget_lower_bound <= floor - 4 * term

    # a plan under the floor of the one AddN, run: its kernels request what it simulates
    plan = solve(chained.graph, floor - 2 * term, "moccasin", time_limit=20)
    assert plan.within_budget
    step = rewrite(chained.traced, chained.graph, chained.op_map, plan, chain="node")
    x = tf.random.stateless_normal(xs.shape, seed=(1, 2))
    y = tf.constant(np.arange(16) % 4, tf.int32)
    got = requested_peak(step, x, y, chained.traced.variables)
    assert got <= 1.03 * plan.peak_memory, (got, plan.peak_memory)
    assert got < floor

    # the gradients: Keras's own (TensorFlow's kernels and its AddN)
    mine = trace_training_step(model, xs, ys, apply_updates=False)
    keras_step = trace_training_step(model, xs, ys, apply_updates=False,
                                     conv_gradients="tensorflow")
    g1 = [g.numpy() for g in mine.function(x, y)[1:]]
    g2 = [g.numpy() for g in keras_step.function(x, y)[1:]]
    for a, b in zip(g1, g2):
        assert np.max(np.abs(a - b)) <= 1e-5 * max(np.max(np.abs(b)), 1e-30), a.shape


def test_a_failed_broadcast_sinking_leaves_a_correct_step(monkeypatch):
    """If re-pointing a reader fails midway (some readers sunk, some not), the trace goes on
    with a warning and the step's gradients are still Keras's."""
    import numpy as np

    from tf_remat import extract as extract_module
    from tf_remat.extract import trace_training_step

    monkeypatch.setenv("TF_REMAT_CONV_GRADIENTS", "tensorflow")
    calls = []
    real = extract_module._redirect

    def fail_on_second(old, new):
        calls.append(old.name)
        if len(calls) == 2:
            raise ValueError("injected")
        real(old, new)

    monkeypatch.setattr(extract_module, "_redirect", fail_on_second)
    # (the chained sums re-point readers too; their failure is the same kind of edit)
    monkeypatch.setattr(extract_module, "_chain_sums", lambda graph, first, g: g)
    model, shape = small_cnn()
    xs, ys = tf.TensorSpec(shape), tf.TensorSpec((shape[0],), tf.int32)
    with pytest.warns(UserWarning, match="injected"):
        partial = trace_training_step(model, xs, ys, apply_updates=False)
    keras_step = trace_training_step(model, xs, ys, apply_updates=False,
                                     conv_gradients="tensorflow")
    assert len(calls) == 2
    x = tf.random.stateless_normal(shape, seed=(5, 6))
    y = tf.constant(np.arange(shape[0]) % 10, tf.int32)
    variables = list({id(v): v for v in partial.variables + keras_step.variables}.values())
    saved = [v.numpy().copy() for v in variables]
    grads = []
    for t in (partial, keras_step):
        grads.append([g.numpy() for g in t.function(x, y)[1:]])
        for v, value in zip(variables, saved):
            v.assign(value)
    for a, b in zip(grads[1], grads[0]):
        assert np.max(np.abs(a - b)) <= 1e-5 * max(np.max(np.abs(a)), 1e-30), a.shape


def test_first_axis_slices_are_views_of_their_input(monkeypatch):
    """A range (or one entry) of the first axis, every other axis whole, rows a multiple of 64
    bytes: TensorFlow's slice kernels return a view of the input's buffer, which then lives as
    long as the slice; the graph must count it so (a sliced filter gradient's batch slices)."""
    from tf_remat.extract import _first_axis_slice_view

    @tf.function
    def f(x, z):
        return (x[2:5], tf.slice(x, [1, 0], [3, 16]), x[3],            # views
                x[:, 1:3], x[::2], z[1:4], x[..., :])                 # copies (or not slices)

    graph = f.get_concrete_function(tf.TensorSpec((8, 16)), tf.TensorSpec((8, 3))).graph
    slices = [op for op in graph.get_operations() if op.type in ("StridedSlice", "Slice")]
    assert [_first_axis_slice_view(op) for op in slices] == [True, True, True] + [False] * 4

    # in a step: the sliced filter gradients' batch slices join the node owning their input
    from tf_remat import extract as extract_module

    inp = keras.Input((16, 16, 8))
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inp)
    h = keras.layers.Conv2D(16, 3, padding="same")(h)
    model = keras.Model(inp, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h)))
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer="sgd")
    monkeypatch.setattr(extract_module, "_PATCH_GRAD_BYTES", 1 << 20)  # 5 slices of 229 KiB
    monkeypatch.setenv("TF_REMAT_CONV_GRADIENTS", "matmul")
    ex = extract_module.extract(model, input_spec=tf.TensorSpec((64, 16, 16, 8)),
                                label_spec=tf.TensorSpec((64,), tf.int32), cost_model="flops",
                                verbose=0)
    sliced = [op for ops in ex.op_map.nodes for op in ops if "strided_slice" in op]
    assert sliced
    assert not any(name.split("(")[0].rsplit("/", 1)[-1].startswith("strided_slice")
                   for name in ex.graph.names)


def forward_list_bytes(ex) -> dict:
    """``{loop op: bytes}`` the graph counts for each forward loop's TensorLists."""
    from tf_remat.extract import loop_list_bytes

    fg = ex.traced.function.graph
    out = {}
    for op in fg.get_operations():
        if op.type == "While" and op._id <= ex.traced.phase_marks[0]:  # noqa: SLF001
            b = sum(loop_list_bytes(op).values())
            if b:
                out[op.name] = b
    return out


class _LoopLayer(keras.layers.Layer):
    """Three tanh(h @ w) steps in a tf.while_loop, with or without a static trip count."""

    def __init__(self, maximum_iterations=None, **kw):
        super().__init__(**kw)
        self.maximum_iterations = maximum_iterations

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], shape[-1]), initializer="orthogonal")

    def call(self, x):
        _, h = tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, tf.tanh(h @ self.w)),
                             (tf.constant(0), x), maximum_iterations=self.maximum_iterations)
        return h


def loop_model(maximum_iterations=None):
    keras.utils.set_random_seed(0)
    inp = keras.Input((32,))
    h = _LoopLayer(maximum_iterations, name="looped")(keras.layers.Dense(32)(inp))
    model = keras.Model(inp, keras.layers.Dense(3)(h))
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer="adam")
    return model


def test_loops_without_a_static_trip_count_are_reported():
    """A tf.while_loop with no static trip count keeps TensorLists the graph cannot size:
    ``info["loops"]`` names it (``optimize`` warns); with ``maximum_iterations`` its lists are
    sized (``info["loop_bytes"]``): three (64, 32) float32 values kept per list."""
    from tf_remat.extract import extract

    infos, sized = {}, {}
    for mi in (None, 3):
        ex = extract(loop_model(mi), input_spec=tf.TensorSpec((64, 32)),
                     label_spec=tf.TensorSpec((64,), tf.int32), cost_model="flops", verbose=0)
        infos[mi] = ex.info
        sized[mi] = forward_list_bytes(ex)
    assert len(infos[None]["loops"]) == 1 and "looped" in infos[None]["loops"][0]
    assert infos[None]["loop_bytes"] == {}
    assert infos[3]["loops"] == []
    # the loop only computes: it may be recomputed, so no plan must hold its lists
    assert infos[3]["loop_bytes"] == {}
    (name, kept), = sized[3].items()
    assert "looped" in name and kept >= 3 * 64 * 32 * 4 and kept % (3 * 64 * 32 * 4) == 0


@pytest.mark.parametrize("layer", ["LSTM", "SimpleRNN"])
def test_rnn_loop_memory_is_counted(layer):
    """A Keras RNN without ``unroll`` runs a tf.while_loop whose sequence length is static:
    what it keeps for its gradient (gates and states of every time step, in TensorLists) is
    sized, so the step's simulated peak is the measured one (for the LSTM it was a third of it
    when the lists counted nothing; for the SimpleRNN 1.45 times it when its state, kept in the
    output sequence, as the step's result and as the next step's input, counted three times);
    unrolled, there is no loop at all. Measured: the step rewritten in its own order, which
    runs loops one iteration at a time; Keras's runs up to 32 at once, and how far they run
    ahead depends on the machine's load (on a loaded machine the SimpleRNN's plain step
    measured more than 1/0.85 of the simulated peak). What is compared is the peak of the
    bytes its kernels request, the quantity the simulator models: the allocator's chunks
    around this 2 MiB step held 1.01-1.27 times it, with the history of the process (a
    full-suite CI run measured 1.23 times in all five ballast layouts), while the requests
    came to 0.998 of it in every run here."""
    from tf_remat.extract import extract
    from tf_remat.rewrite import rewrite
    from tf_remat.solvers import solve

    infos, graphs = {}, {}
    for unroll in (False, True):
        keras.utils.set_random_seed(0)
        inp = keras.Input((32, 16))
        h = getattr(keras.layers, layer)(128, return_sequences=True, unroll=unroll)(inp)
        model = keras.Model(inp, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h)))
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer="adam")
        ex = extract(model, input_spec=tf.TensorSpec((32, 32, 16)),
                     label_spec=tf.TensorSpec((32,), tf.int32), cost_model="flops", verbose=0)
        infos[unroll], graphs[unroll] = ex.info, ex.graph
        if not unroll:
            sized = forward_list_bytes(ex)
            plan = solve(ex.graph, ex.graph.no_remat_peak, "checkpoint-all")
            step = rewrite(ex.traced, ex.graph, ex.op_map, plan)
            x = tf.random.stateless_normal((32, 32, 16), seed=(1, 2))
            measured = requested_peak(step.function, x, tf.zeros((32,), tf.int32),
                                      ex.traced.variables)
    assert infos[False]["loops"] == [] and infos[True]["loops"] == []
    (name, kept), = sized.items()
    # at least each of the 32 steps' state, (32, 128) float32 (an LSTM keeps 4 gates more)
    assert layer.lower()[:4] in name.replace("_", "") and kept >= 32 * 32 * 128 * 4
    assert infos[False]["loop_bytes"] == {} and infos[True]["loop_bytes"] == {}
    # the simulator rounds buffers to 256 bytes and models the small-allocation pool: a few
    # percent either way, where an uncounted or thrice-counted list is a third or 1.45 times
    assert 0.92 * measured <= graphs[False].no_remat_peak <= 1.08 * measured, (
        graphs[False].no_remat_peak, measured)


def test_what_a_loop_body_holds_while_it_runs_is_counted(monkeypatch):
    """A ConvLSTM2D's gradient loop computes eight convolution gradients per iteration; their
    buffers come and go inside the loop, named after the loop's body, no node of the graph.
    They are counted as the loop's scratch (a workspace node), so the simulated peak of the
    step without rematerialization is near what its kernels request; left out, it was 0.69
    of it without oneDNN (oneDNN's convolution gradients hold little: 1.01 left out, 1.12
    counted). The figure is what the profiled run held, which the rewritten step's
    free-running body need not repeat exactly (1.10 times the requests without oneDNN), so
    the bound is loose above."""
    from tf_remat import extract as extract_module
    from tf_remat.extract import extract, onednn_enabled
    from tf_remat.rewrite import rewrite
    from tf_remat.solvers import solve

    def build():
        keras.utils.set_random_seed(0)
        inp = keras.Input((4, 16, 16, 8))
        h = keras.layers.ConvLSTM2D(32, 3, padding="same")(inp)
        m = keras.Model(inp, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(h)))
        m.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer="adam")
        return m

    x = tf.random.stateless_normal((16, 4, 16, 16, 8), seed=(1, 2))
    y = tf.zeros((16,), tf.int32)
    ratio, loop_scratch = {}, {}
    for counted in (True, False):
        if not counted:
            monkeypatch.setattr(extract_module, "_loop_body_transients", lambda *a: {})
        ex = extract(build(), input_spec=tf.TensorSpec(x.shape),
                     label_spec=tf.TensorSpec((16,), tf.int32), cost_model="flops", verbose=0)
        g = ex.graph
        loop_scratch[counted] = max(
            (g.memory[v] for v in range(g.n)
             if "while_grad" in g.names[v] and g.names[v].endswith("/workspace")), default=0)
        step = rewrite(ex.traced, g, ex.op_map, solve(g, g.no_remat_peak, "checkpoint-all"))
        ratio[counted] = g.no_remat_peak / requested_peak(step.function, x, y,
                                                          ex.traced.variables)
    assert 0.95 <= ratio[True] <= 1.25, ratio
    assert loop_scratch[True] >= loop_scratch[False], loop_scratch
    if not onednn_enabled():
        # TensorFlow's own convolution gradients hold im2col buffers; oneDNN's hold little
        # (there the figures with and without the body's buffers are 1.12 and 1.01)
        assert loop_scratch[True] >= loop_scratch[False] + 4 * 2**20, loop_scratch
        assert ratio[False] <= 0.85, ratio


# --------------------------------------------------------------------- profiling
def test_profile_costs_and_cache_hit(tmp_path, monkeypatch):
    monkeypatch.setenv("TF_REMAT_CACHE", str(tmp_path / "cache"))
    from tf_remat.extract import extract

    model, shape = res_block()
    kw = dict(input_spec=tf.TensorSpec(shape), label_spec=tf.TensorSpec((shape[0],), tf.int32),
              cost_model="profile", verbose=0)
    first = extract(model, **kw)
    assert first.info["measured"] > 0 and first.info["cache_hits"] == 0
    assert not first.info["profile_failures"], first.info["profile_failures"]
    assert os.path.exists(first.info["cache_file"])
    second = extract(model, **kw)
    assert second.info["measured"] == 0
    assert second.info["cache_hits"] == second.info["signatures"]
    assert second.graph.cost == first.graph.cost
    assert second.info["profile_seconds"] < first.info["profile_seconds"]
    # identical nodes (the two ReLU-gradient chains, the optimizer updates) share a signature
    assert first.info["signatures"] < first.graph.n


def test_flops_cost_model_ranks_convolutions_first():
    ex = extracted("small_cnn")
    g = ex.graph
    top = max(range(g.n), key=lambda v: g.cost[v])
    assert "conv" in g.names[top].lower() or "Backprop" in g.names[top]

def test_profile_runs_nodes_fed_by_shape_arithmetic(tmp_path, monkeypatch):
    # a per-step loss reshapes by a Pack of a StridedSlice of a shape, and a dilated causal
    # Conv1D pads by shape arithmetic: integers tf.get_static_value cannot fold; fed zeros,
    # those nodes failed to run alone (a reshape to 0 elements) and their costs were guesses
    monkeypatch.setenv("TF_REMAT_CACHE", str(tmp_path / "cache"))
    from tf_remat.extract import extract

    inp = keras.Input((32, 4))
    h = keras.layers.Conv1D(8, 3, padding="causal", dilation_rate=2, activation="relu")(inp)
    model = keras.Model(inp, keras.layers.Conv1D(5, 1)(h))
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer="sgd")
    ex = extract(model, input_spec=tf.TensorSpec((8, 32, 4)),
                 label_spec=tf.TensorSpec((8, 32), tf.int32), cost_model="profile", verbose=0)
    assert ex.info["measured"] > 0
    assert not ex.info["profile_failures"], ex.info["profile_failures"]



def test_profiled_step_time_is_plausible(monkeypatch, tmp_path):
    from tf_remat.extract import extract, measure_step

    model, shape = small_cnn()
    # the profile and the step are timed seconds apart on a shared machine, and a burst of
    # load on either moves the ratio (one CI run on 2 cores: 71 ms profiled for a 33 ms step,
    # in range in every run before it): up to three fresh profiles, each against a fresh
    # measurement; a unit or counting error is off in every one
    ratios = []
    for attempt in range(3):
        monkeypatch.setenv("TF_REMAT_CACHE", str(tmp_path / f"cache{attempt}"))
        ex = extract(model, input_spec=tf.TensorSpec(shape),
                     label_spec=tf.TensorSpec((shape[0],), tf.int32), verbose=0)
        measured = measure_step(ex.traced, runs=5)["step_seconds"]
        ratios.append(ex.graph.total_cost / measured)
        if 0.5 < ratios[-1] < 2.0:
            break
    assert 0.5 < ratios[-1] < 2.0, ratios


def test_step_costs_come_from_the_step_and_leave_the_model_as_it_was(monkeypatch, tmp_path):
    # BatchNorm statistics, Dropout's seed, Adam's slots and iteration count: the traced runs
    # of the step change all of them, and the costs must not cost the user a training step
    monkeypatch.setenv("TF_REMAT_CACHE", str(tmp_path / "cache"))
    from tf_remat.extract import extract

    model, shape = small_cnn()
    kw = dict(input_spec=tf.TensorSpec(shape),
              label_spec=tf.TensorSpec((shape[0],), tf.int32), verbose=0)
    alone = extract(model, cost_model="profile", **kw)
    before = {id(v): v.numpy().copy() for v in alone.traced.variables}
    ex = extract(model, cost_model="step", **kw)
    info = ex.info
    assert info["step_costs"] == "traced", info["step_costs"]
    assert {id(v) for v in ex.traced.variables} == set(before)
    for v in ex.traced.variables:
        np.testing.assert_array_equal(v.numpy(), before[id(v)], err_msg=v.name)
    # nearly every kernel the step ran is found in a node (Grappler's renames included)
    assert info["step_unmatched_seconds"] <= 0.05 * info["step_wall_seconds"], info
    with_ops = [i for i, ops in enumerate(ex.op_map.nodes) if ops]
    assert info["step_untraced_nodes"] <= 0.1 * len(with_ops), info
    assert all(ex.graph.cost[i] > 0 for i in with_ops)
    assert all(ex.graph.cost[i] == 0 for i, ops in enumerate(ex.op_map.nodes) if not ops)
    # the costs share out the step's time, kernels side by side and the time between included
    assert ex.graph.total_cost == pytest.approx(info["step_wall_seconds"], rel=0.05)
    assert ex.graph.cost != alone.graph.cost
    assert ex.graph.memory == alone.graph.memory and ex.graph.edges == alone.graph.edges
    # the traced static order is kept for optimize's timing of it, not rewritten again
    from tf_remat.rewrite import static_order_step

    # (with no loops to overlap, the order traced and the order timed are one step)
    assert set(ex.static_steps) == {"node", "node-serial"}
    assert static_order_step(ex) is ex.static_steps["node"] is ex.static_steps["node-serial"]


def test_step_costs_fall_back_to_isolated_costs_when_the_step_cannot_be_traced(
        monkeypatch, tmp_path):
    monkeypatch.setenv("TF_REMAT_CACHE", str(tmp_path / "cache"))
    from tf_remat.extract import extract

    model, shape = res_block()
    kw = dict(input_spec=tf.TensorSpec(shape),
              label_spec=tf.TensorSpec((shape[0],), tf.int32), verbose=0)
    alone = extract(model, cost_model="profile", **kw)
    # one profiler session at a time: the user's own trace is running
    tf.profiler.experimental.start(str(tmp_path / "user_trace"))
    try:
        ex = extract(model, cost_model="step", **kw)
    finally:
        tf.profiler.experimental.stop()
    assert ex.info["step_costs"].startswith("not traced"), ex.info["step_costs"]
    assert ex.graph.cost == alone.graph.cost  # the cached isolated costs, unchanged


def test_a_loop_pays_for_its_iterations_in_the_step_costs(monkeypatch, tmp_path):
    """An LSTM's loops run 32 iterations of small kernels, traced as ``<loop>/body/_k/...``,
    with the executor's time between them: all of it is the loops' (a recomputed loop pays it
    again). The two loop nodes (forward and gradient) carried 0.90 of the costs in two runs."""
    monkeypatch.setenv("TF_REMAT_CACHE", str(tmp_path / "cache"))
    from tf_remat.extract import extract

    keras.utils.set_random_seed(0)
    inp = keras.Input((32, 16))
    h = keras.layers.LSTM(128, return_sequences=True)(inp)
    model = keras.Model(inp, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h)))
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer="adam")
    ex = extract(model, input_spec=tf.TensorSpec((32, 32, 16)),
                 label_spec=tf.TensorSpec((32,), tf.int32), cost_model="step", verbose=0)
    info, graph = ex.info, ex.graph
    assert info["step_costs"] == "traced", info["step_costs"]
    loops = [i for i, ops in enumerate(ex.op_map.nodes)
             if any(o.endswith("/while") or o.endswith("while_grad") for o in ops)]
    assert len(loops) == 2, [ex.op_map.nodes[i] for i in loops]
    # the bodies' kernels (named <loop>/body/_k/...) are traced back to their loops
    assert info["step_unmatched_seconds"] <= 0.05 * info["step_wall_seconds"], info
    assert graph.total_cost == pytest.approx(info["step_wall_seconds"], rel=0.05)
    assert sum(graph.cost[i] for i in loops) >= 0.7 * graph.total_cost, (
        [graph.cost[i] for i in loops], graph.total_cost)


def test_kernels_side_by_side_share_the_time_and_a_wait_goes_to_the_next_kernel():
    from tf_remat.profile import _shares

    ps = 10**12  # the trace's picoseconds, in seconds
    # a alone for 5 s, a and b together 5 s, b alone 5 s, nothing 5 s, c 10 s; two runs of
    # a loop body's op at once (one name) each take their half
    got = _shares([(0, 10 * ps, "a"), (5 * ps, 15 * ps, "b"), (20 * ps, 30 * ps, "c"),
                   (30 * ps, 34 * ps, "d"), (30 * ps, 34 * ps, "d")])
    assert [n for n, _ in got] == ["a", "b", "c", "d", "d"]
    assert [sec for _, sec in got] == pytest.approx([7.5, 7.5, 15.0, 2.0, 2.0])
    assert sum(sec for _, sec in got) == pytest.approx(34.0)  # the span, nothing twice
    # a kernel of zero length takes the wait before it and nothing after: it is not left
    # running beside the next kernels
    got = _shares([(0, 2 * ps, "a"), (4 * ps, 4 * ps, "z"), (4 * ps, 10 * ps, "b")])
    assert [sec for _, sec in got] == pytest.approx([2.0, 2.0, 6.0])


def test_traced_kernel_names_map_back_to_the_ops_of_the_step():
    from tf_remat.profile import traced_op

    known = {"enc/MatMul_1", "enc/add_2", "enc/conv", "dec/Relu"}
    assert traced_op("dec/Relu", known) == "dec/Relu"
    assert traced_op("enc/ArithmeticOptimizer/FoldTransposeIntoMatMul_MatMul_1",
                     known) == "enc/MatMul_1"
    assert traced_op("enc/ArithmeticOptimizer/AddOpsRewrite_Leaf_1_add_2", known) == "enc/add_2"
    assert traced_op("enc/conv/_MklInputConversion", known) == "enc/conv"
    assert traced_op("enc/ArithmeticOptimizer/AddOpsRewrite_add_9", known) is None
    assert traced_op("other/Relu", known) is None


# --------------------------------------------------------------------- API, zoo, CLI
def test_public_extract_graph():
    import tf_remat

    model, shape = mlp()
    g = tf_remat.extract_graph(model, input_spec=tf.TensorSpec((32, 512)),
                               label_spec=tf.TensorSpec((32,), tf.int32), cost_model="flops",
                               verbose=0)
    assert isinstance(g, Graph) and g.n > 3


def test_gradients_only_step_returns_grads():
    from tf_remat.extract import extract

    model, shape = mlp()
    ex = extract(model, input_spec=tf.TensorSpec((32, 512)),
                 label_spec=tf.TensorSpec((32,), tf.int32), cost_model="flops", verbose=0,
                 apply_updates=False)
    assert len(ex.op_map.outputs) == 1 + len(model.trainable_variables)
    assert all(ex.graph.recomputable[v] or True for v in ex.graph.outputs)
    assert not any(o for o in ex.op_map.nodes
                   for name in o if "AssignSub" in name or "AssignAdd" in name)


def test_zoo_names():
    from tf_remat.zoo import MODELS, get_model, parse_input_size

    assert {"vgg16", "vgg19", "mobilenet", "resnet50", "unet", "fcn8", "segnet",
            "transformer", "bn_cnn"} <= set(MODELS)
    with pytest.raises(ValueError, match="vgg16"):
        get_model("alexnet", 4)
    assert parse_input_size("224x160", 32) == (224, 160)
    assert parse_input_size(None, 32) == (32, 32)
    import models

    assert models.get_model is get_model


def test_cli_extract_writes_graph_and_op_map(tmp_path, capsys):
    from tf_remat.cli import main

    out = tmp_path / "bn.json"
    assert main(["extract", "--model", "bn_cnn", "--batch", "4", "--cost-model", "flops",
                 "-q", "-o", str(out)]) == 0
    g = Graph.load(out)
    doc = json.loads((tmp_path / "bn.ops.json").read_text())
    assert len(doc["nodes"]) == g.n
    assert "nodes" in capsys.readouterr().out
    assert main(["extract", "--model", "nope", "-o", str(out)]) == 2


def test_fold_evaluates_shape_arithmetic_without_retracing_warnings(caplog):
    """``_fold`` evaluates what ``tf.get_static_value`` gives up on (arithmetic on a shape), and
    folding many tensors logs nothing: it once traced a new tf.function per tensor, which
    TensorFlow reported to the user as excessive retracing."""
    import logging

    from tf_remat.profile import _fold

    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (4, 6))
        s = tf.shape(x)
        ts = [tf.stack([s[0] * s[1] + k, tf.constant(1)]) for k in range(8)]
    with caplog.at_level(logging.WARNING, logger="tensorflow"):
        got = [_fold(t) for t in ts]
    assert [list(v) for v in got] == [[24 + k, 1] for k in range(8)]
    assert not [r for r in caplog.records if "retracing" in r.getMessage()]


def _siamese(batch=16, hw=16):
    """One conv encoder applied to two images: each shared weight's gradient sums two
    branches."""
    inp = keras.Input((hw, hw, 3))
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inp)
    r = keras.layers.Conv2D(32, 3, strides=2, padding="same")(h)
    s = keras.layers.Conv2D(32, 1, strides=2)(h)
    h = keras.layers.GlobalAveragePooling2D()(keras.layers.Add()([r, s]))
    encoder = keras.Model(inp, h)
    a, b = keras.Input((hw, hw, 3)), keras.Input((hw, hw, 3))
    d = keras.layers.Concatenate()([encoder(a), encoder(b)])
    model = keras.Model([a, b], keras.layers.Dense(2)(d))
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    spec = tf.TensorSpec((batch, hw, hw, 3))
    return model, [spec, spec], tf.TensorSpec((batch,), tf.int32)


def test_a_shared_layers_two_branches_stay_in_separate_nodes(monkeypatch):
    """A shared layer's weight gradient is the sum of one per branch. Were both filter
    gradients merged into the sum's node (each is small), that node would need both branches'
    activations and gradients at once, and no schedule could finish one branch and free its
    values before the other: on a siamese encoder at batch 32 every solver's floor was 18.90
    MiB, where a plan of 15.74 MiB exists once they are apart."""
    from tf_remat import solve
    from tf_remat.extract import extract

    monkeypatch.setenv("TF_REMAT_CONV_GRADIENTS", "tensorflow")
    keras.utils.set_random_seed(0)
    model, xs, ys = _siamese()
    ex = extract(model, input_spec=xs, label_spec=ys, cost_model="flops", verbose=0)
    g = ex.graph
    # with the two filter gradients in the sum's node the best plan of the exact solver was
    # 38% of the way from the lower bound to the no-rematerialization peak; apart, 0.4%
    budget = g.budget_lower_bound + (g.no_remat_peak - g.budget_lower_bound) // 10
    plan = solve(g, budget=budget, strategy="checkmate-milp", time_limit=30)
    assert plan.peak_memory <= budget, (plan.peak_memory, budget, g.budget_lower_bound)


def test_a_nodes_intermediate_outputs_are_counted_while_it_runs(monkeypatch):
    """The input gradient of the strided 1x1 shortcut (2 MiB here) is summed into the other
    branch's gradient by the node's own AddN and freed: no other node reads it, so the graph
    counted none of it, and plans recomputing around it asked TensorFlow for more than they
    simulated (siamese at batch 32: 18.28 MiB requested of a 16.33 MiB plan). A workspace node
    now holds it while its node runs, so what the rewritten step's kernels request stays
    within the simulated peak."""
    from tf_remat import solve
    from tf_remat.extract import extract, onednn_enabled, snapshot_variables
    from tf_remat.rewrite import rewrite

    # TensorFlow's convolution gradients where oneDNN runs them (no scratch space); without
    # oneDNN the default's products, since TensorFlow's kernels there take 10-22 MiB of
    # scratch each, and in one full-suite run in three two of them, in nodes the chain
    # orders, were live at once (51.5 MiB requested of a 35.8 MiB plan; not seen alone)
    if onednn_enabled():
        monkeypatch.setenv("TF_REMAT_CONV_GRADIENTS", "tensorflow")
    keras.utils.set_random_seed(0)
    model, xs, ys = _siamese(batch=32, hw=32)
    ex = extract(model, input_spec=xs, label_spec=ys, cost_model="flops", verbose=0)
    g = ex.graph
    assert ex.info["intermediate_bytes"] >= 1 << 20
    budget = g.budget_lower_bound + (g.no_remat_peak - g.budget_lower_bound) // 10
    # (the portfolio: without oneDNN the graph has the products' nodes too, where the MILP
    # found no plan in 30 s)
    plan = solve(g, budget=budget, strategy="auto", time_limit=30)
    assert plan.peak_memory <= budget
    step = rewrite(ex.traced, g, ex.op_map, plan)
    rng = np.random.default_rng(0)
    x = [tf.constant(rng.standard_normal(s.shape), tf.float32) for s in xs]
    y = tf.constant(rng.integers(0, 2, ys.shape), tf.int32)
    before = snapshot_variables(ex.traced.variables)
    requested = requested_peak(step, x, y, ex.traced.variables)
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, ex.traced.variables))
    # the simulator counts 256-byte-rounded buffers and the allocator's small-pool cutoff:
    # what the kernels request is at most a few percent off either way, never a whole buffer
    assert requested <= 1.03 * plan.peak_memory, (requested / 2**20, plan.peak_memory / 2**20)


def test_intermediates_follow_forwarding_and_are_the_same_in_every_trace():
    """The static count of a node's own short-lived outputs: a BatchNorm's squared
    differences (a full-size buffer its reduction reads and frees) count; a convolution's
    output that its ReLU forwards into the node's counted output does not count twice; two
    traces of one model give the same figures (the profiled figure did not: a BatchNorm
    gradient's node held 4 MiB in four of six runs and none in two)."""
    from tf_remat.extract import _Analysis, trace_training_step

    inp = keras.Input((32, 32, 8))
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inp)
    h = keras.layers.BatchNormalization()(h)
    out = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h))
    model = keras.Model(inp, out)
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    xs, ys = tf.TensorSpec((16, 32, 32, 8)), tf.TensorSpec((16,), tf.int32)
    full = 16 * 32 * 32 * 32 * 4
    figures = []
    for _ in range(2):
        a = _Analysis(trace_training_step(model, xs, ys))
        op_map, fields = a.build()
        figures.append(list(a.intermediate))
        seen = set()
        for v, ops in enumerate(op_map.nodes):
            if any("gradient_tape" in o for o in ops):
                continue
            kinds = {a.ops[a.index[name]].type for name in ops}
            if "SquaredDifference" in kinds:
                seen.add("moments")
                assert a.intermediate[v] >= full, (ops, a.intermediate[v])
            if "Relu" in kinds:
                seen.add("relu")
                assert fields["memory"][v] >= full  # the conv's output, forwarded
                assert a.intermediate[v] < full // 4, (ops, a.intermediate[v])
        assert seen == {"moments", "relu"}
    assert figures[0] == figures[1]


def test_a_nodes_scratch_counts_its_ops_that_can_run_at_once():
    """The rewritten step orders nodes, not the ops inside one: two of a node's kernels that
    do not wait for each other may hold their scratch space together (without oneDNN, a
    siamese node's two filter gradients, 22 and 10 MiB, did in the rewritten step and not in
    the profiled run). One that waits for another cannot; an order through ops outside the
    node is not looked for, which errs high."""
    from tf_remat.extract import _concurrent_most

    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (4,), name="x")
        a = tf.identity(x, name="a")            # a and b are independent
        b = tf.negative(x, name="b")
        c = tf.add(a, 1.0, name="c")            # c waits for a
        outside = tf.identity(b, name="outside")
        d = tf.multiply(outside, 2.0, name="d")  # d waits for b through an op of no node
        with tf.control_dependencies([c]):
            e = tf.identity(x, name="e")         # e waits for c by a control edge
        del d, e
    members = {"a", "b", "c", "d", "e"}
    assert _concurrent_most({"a": 5}, members, g) == 5
    assert _concurrent_most({"a": 5, "b": 3}, members, g) == 8
    assert _concurrent_most({"a": 5, "c": 7}, members, g) == 7
    assert _concurrent_most({"a": 5, "b": 3, "c": 7}, members, g) == 10
    assert _concurrent_most({"a": 5, "e": 4}, members, g) == 5
    assert _concurrent_most({"b": 3, "d": 6}, members, g) == 9
    assert _concurrent_most({"b": 3, "d": 6}, members | {"outside"}, g) == 6


def test_a_decoupled_weight_decay_runs_with_its_gradient_update():
    # AdamW's weight decay (v -= v * lr * wd) reads no gradient. As a node of its own it went
    # to the start of the step, where the backward MatMuls still held each kernel's old value,
    # so TensorFlow copied every kernel on write (resmlp at 60%: eight 2 MiB kernels its
    # simulation did not count). In the gradient update's node it runs after the gradient.
    from tf_remat.extract import _random_like, extract
    from tf_remat.rewrite import rewrite
    from tf_remat.solvers import solve

    inp = keras.Input((256,))
    h = inp
    for _ in range(6):
        h = keras.layers.Dense(1024, activation="relu")(h)
    model = keras.Model(inp, keras.layers.Dense(10)(h), name="decayed_mlp")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.AdamW(1e-3, weight_decay=0.01))
    ex = extract(model, input_spec=tf.TensorSpec((16, 256)),
                 label_spec=tf.TensorSpec((16,), tf.int32), cost_model="flops", verbose=0)
    g, om = ex.graph, ex.op_map
    ops = {o.name: o for o in ex.traced.function.graph.get_operations()}
    decays = 0
    for names in om.nodes:
        writes = collections.defaultdict(list)
        for n in names:
            if ops[n].type == "AssignSubVariableOp":
                writes[ops[n].inputs[0].name].append(n)
        for var, updates in writes.items():
            if len(updates) == 2:
                decays += 1
    # every variable's decay and gradient update share a node (before: only the biases and the
    # head's kernel, small values merged into their readers' nodes, 8 of 14)
    assert decays == len(model.trainable_variables), (decays, len(model.trainable_variables))
    plan = solve(g, g.no_remat_peak, "checkpoint-all")
    step = rewrite(ex.traced, g, ex.op_map, plan)
    x = _random_like(ex.traced.input_spec, seed=1)
    y = _random_like(ex.traced.label_spec, seed=2, labels=10)
    requested = requested_peak(step, x, y, ex.traced.variables)
    # before: 96.1 MB requested against 89.0 simulated (1.08), the kernels' copies on write
    assert requested <= 1.03 * g.no_remat_peak, (requested, g.no_remat_peak)


def test_each_label_of_a_multi_output_model_gets_its_own_class_range():
    """The synthetic labels that time a step and measure its kernels' scratch space: a
    two-output model's labels each within their own head's classes. With the first head's
    5 classes for both, the 3-class head's loss refused labels 3 and 4 on a CPU, and the scratch
    space went unmeasured (a warning, and a plan that counts none)."""
    import warnings

    from tf_remat.extract import (_num_classes, _random_like, extract, measure_workspace,
                                  trace_training_step)

    tok = keras.Input((12,), dtype="int32", name="tok")
    h = keras.layers.Embedding(50, 8)(tok)
    pooled = keras.layers.GlobalAveragePooling1D()(h)
    cls = keras.layers.Dense(5, name="cls")(pooled)
    tag = keras.layers.Dense(3, name="tag")(keras.layers.Dense(8)(pooled))
    model = keras.Model({"tok": tok}, {"cls": cls, "tag": tag})
    sparse = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile("sgd", loss={"cls": sparse, "tag": sparse})
    xs = {"tok": tf.TensorSpec((32, 12), tf.int32)}
    ys = {"tag": tf.TensorSpec((32,), tf.int32), "cls": tf.TensorSpec((32,), tf.int32)}
    traced = trace_training_step(model, xs, ys)
    assert _num_classes(traced) == {"cls": 5, "tag": 3}
    y = _random_like(traced.label_spec, seed=2, labels=_num_classes(traced))
    assert 0 <= int(tf.reduce_min(y["tag"])) and int(tf.reduce_max(y["tag"])) <= 2
    assert int(tf.reduce_max(y["cls"])) <= 4
    assert int(tf.reduce_max(y["cls"])) >= 3  # the wider head's whole range is still used
    # labels as a list, by position; weighted, the weights beside them
    lists = trace_training_step(model, xs, [ys["cls"], ys["tag"]])
    assert _num_classes(lists) == [5, 3]
    weighted = trace_training_step(model, xs, (ys, tf.TensorSpec((32,))), weighted=True)
    assert _num_classes(weighted) == ({"cls": 5, "tag": 3}, 2)
    y, w = _random_like(weighted.label_spec, seed=2, labels=_num_classes(weighted))
    assert int(tf.reduce_max(y["tag"])) <= 2 and w.dtype == tf.float32
    ex = extract(model, input_spec=xs, label_spec=ys, cost_model="flops", verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "kernel scratch space not measured" before
        measure_workspace(ex.traced, ex.op_map)
