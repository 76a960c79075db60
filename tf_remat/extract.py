"""Keras training step -> costed, solver-sized :class:`~tf_remat.graph.Graph` (+ the op map).

Pipeline::

    trace_training_step  one training step (forward under GradientTape, gradients, optimizer
                         update) traced as a tf.function; its op graph is read back
    _classify            live ops (those that reach the step's outputs or side effects) split into
                         node ops (batch-dependent: reachable from the input batch / labels, a
                         random op or a side effect) and fixed ops (variable reads, constants,
                         shape arithmetic over static shapes, scalar optimizer arithmetic)
    _group               node ops grouped into solver nodes: fused pairs, views, in-place
                         element-wise chains and small values merged, never a merge that makes a
                         cycle
    _account             buffers (views alias their input's buffer), node memory = bytes of the
                         buffers a node creates that a later node reads, edges, fixed memory
    profile              node costs (tf_remat.profile): measured, or estimated from FLOPs

Memory model (what the simulator sees, checked against ``tf.config.experimental.get_memory_info``
on CPU): a node's memory is the bytes of the buffers its ops allocate that outlive the node (read by
another node, or returned). Views (Reshape, Identity, Squeeze, ...) allocate nothing: a reader of a
view also gets an edge from the node that owns the buffer, so the buffer stays resident until its
last reader. An element-wise op that is the only reader of its input runs in place in TensorFlow
(the kernel forwards the input buffer), so it is merged with the input's producer and the pair
costs one buffer. ``fixed_memory`` is every variable the step captures (weights, optimizer slots,
BatchNorm statistics, RNG state, the iteration counter), the input batch and labels, and the live
outputs of fixed ops that are not views (constants, casts of weights).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import json
import os
import re
import sys
import time
from typing import Any

from tf_remat.errors import RematError, UnsupportedOpError, warn
from tf_remat.graph import Graph

__all__ = [
    "TracedStep",
    "OpMap",
    "Extraction",
    "trace_training_step",
    "extract",
    "extract_graph",
    "op_map_path",
    "measure_step",
]

OPMAP_FORMAT = "tf-remat-opmap"
#: oneDNN's CPU allocator serves allocations up to this size from a pool that keeps no
#: statistics (see untracked_below)
_ONEDNN_SMALL_POOL = 256 << 10
_UNTRACKED_BELOW: dict = {}
#: a node's kernel scratch space under this is left out: such buffers come and go from run to
#: run with the kernels' choice of strategy (a node's 0.28 MiB in one run, none in the next),
#: which made graphs of one model differ in their number of nodes; they are well inside the
#: verification margin
_MIN_WORKSPACE = 1 << 20
#: a value computed from variables alone (SGD's ``momentum * m``, a weight's cast) of this size or
#: more is a node, scheduled like any other: as a fixed op it would run at the step's start and
#: stay resident until its reader, at the end (densenet's momentum products: 25 MiB, one per
#: weight, none over 1 MiB)
_MIN_SCHEDULED = 64 << 10
_MAX_OPS = 48  # small-value merging never makes a node of more ops than this
OPMAP_VERSION = 1

# --------------------------------------------------------------------- op tables
#: outputs alias an input's buffer (output i -> input _VIEW_INPUT.get(type, 0), IdentityN: i -> i)
VIEW_OPS = frozenset({
    "Identity", "IdentityN", "Snapshot", "StopGradient", "PreventGradient", "Reshape",
    "Squeeze", "ExpandDims", "EnsureShape", "CheckNumerics", "CheckNumericsV2",
    "DebugIdentity", "DebugIdentityV2",
})
#: ops whose value depends only on the static shape of their inputs (constant-folded by Grappler)
SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank", "BroadcastArgs"})
#: element-wise kernels that forward (reuse) an input buffer when they are its last reader
INPLACE_OPS = frozenset({
    "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Sigmoid", "Tanh", "Softplus", "Softsign",
    "Neg", "Abs", "Exp", "Expm1", "Log", "Log1p", "Sqrt", "Rsqrt", "Square", "Reciprocal",
    "Inv", "Sign", "Floor", "Ceil", "Round", "Erf", "Erfc", "Sin", "Cos", "Mish",
    "Mul", "Add", "AddV2", "Sub", "RealDiv", "Div", "DivNoNan", "MulNoNan", "Maximum",
    "Minimum", "SquaredDifference", "Pow", "FloorDiv", "FloorMod", "BiasAdd", "AddN",
    "ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad", "LeakyReluGrad", "SigmoidGrad",
    "TanhGrad", "SoftplusGrad", "SoftsignGrad", "RsqrtGrad", "SqrtGrad", "ReciprocalGrad",
    "InvGrad", "Select", "SelectV2", "ClipByValue", "BiasAddV1", "GeluGrad", "Gelu",
})
#: contractions the oneDNN / Grappler remapper fuses with a following BiasAdd (+ Add) (+ act.)
CONTRACTION_OPS = frozenset({
    "Conv2D", "Conv3D", "DepthwiseConv2dNative", "MatMul", "BatchMatMul", "BatchMatMulV2",
    "BatchMatMulV3", "_FusedConv2D", "_FusedMatMul",
})
#: activations fused after a contraction / batch norm
ACTIVATION_OPS = frozenset({
    "Relu", "Relu6", "Elu", "LeakyRelu", "Tanh", "Sigmoid", "Selu", "Softplus", "Mish", "Gelu",
})
FUSED_BN_OPS = frozenset({"FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"})
FUSED_BN_GRAD_OPS = frozenset({"FusedBatchNormGrad", "FusedBatchNormGradV2",
                               "FusedBatchNormGradV3"})
#: gradient ops of a weight that oneDNN computes together with BiasAddGrad of the same dy
WEIGHT_GRAD_OPS = frozenset({"Conv2DBackpropFilter", "Conv3DBackpropFilterV2",
                             "DepthwiseConv2dNativeBackpropFilter", "MatMul",
                             "Conv2DBackpropFilterV2"})
#: side effects: run exactly once (never recomputed)
SIDE_EFFECT_OPS = frozenset({
    "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp", "AssignVariableXlaConcatND",
    "RngSkip", "RngReadAndSkip", "StatefulUniform", "StatefulUniformFullInt",
    "StatefulUniformInt", "StatefulStandardNormal", "StatefulStandardNormalV2",
    "StatefulTruncatedNormal", "StatefulRandomBinomial", "RandomUniform", "RandomUniformInt",
    "RandomStandardNormal", "TruncatedNormal", "RandomGamma", "RandomPoisson",
    "RandomPoissonV2", "RandomShuffle", "Multinomial", "ParameterizedTruncatedNormal",
    "Print", "PrintV2", "WriteScalarSummary", "WriteSummary", "WriteHistogramSummary",
    "DestroyResourceOp", "AnonymousSeedGenerator",
})
#: ops that write a resource variable
_VARIABLE_UPDATE = r"ResourceApply|ResourceSparseApply|ResourceScatter|Assign"
_VARIABLE_UPDATE_RE = re.compile(rf"^({_VARIABLE_UPDATE})")
_SIDE_EFFECT_RE = re.compile(rf"^({_VARIABLE_UPDATE}|"
                             r"TensorArrayWrite|TensorArrayScatter|Stack(Push|Pop))")
#: random-number ops (their outputs are per-step values, so they are node ops)
_RANDOM_RE = re.compile(r"(Random|Multinomial|TruncatedNormal|Shuffle)")
_NOT_RANDOM = frozenset({"StatelessRandomGetKeyCounter", "StatelessRandomGetAlg",
                         "StatelessRandomGetKeyCounterAlg", "RandomDataset"})
#: ops that read a variable's current value (a copy run after an update sees the new value)
_VARIABLE_READS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd"})
#: ops that run a function (their reads of a variable are inside it)
_CALL_OPS = frozenset({"PartitionedCall", "StatefulPartitionedCall", "If", "StatelessIf",
                       "Case", "StatelessCase"})
#: stateful-registered ops that are safe to run again (they read, they do not write; a read
#: of a variable the step writes after it is not: :meth:`_Analysis._stale_rereads`)
_HARMLESS_STATEFUL = frozenset({
    "ReadVariableOp", "VarHandleOp", "Placeholder", "Assert", "VarIsInitializedOp",
    "ResourceGather", "ResourceGatherNd", "NoOp",
})


# --------------------------------------------------------------------- public types
@dataclasses.dataclass
class TracedStep:
    """One traced training step.

    Attributes:
        function: the concrete function ``step(x, y)``; it returns the loss (and applies the
            optimizer update) when ``apply_updates`` is True, else ``(loss, *grads)`` with grads
            aligned with ``model.trainable_variables`` (zeros where a variable gets none).
        graph_def: ``function.graph.as_graph_def()``.
        model, loss_fn, optimizer: what the step uses (``loss_fn(y, y_pred)``; when the model's
            compiled loss is used, ``loss_fn`` is ``model.compute_loss``).
        input_spec, label_spec: the fixed-shape specs the step was traced with.
        variables: every ``tf.Variable`` the step captures (weights, optimizer slots, iterations,
            BatchNorm statistics, RNG state), in capture order.
        apply_updates: whether the step applies the optimizer update.
        captures: op name of each resource placeholder in ``function.graph`` -> its variable.
        input_ops, label_ops: names of the placeholders of x and y in ``function.graph``.
        phase_marks: op ids (``op._id``) where the forward pass ended (loss computed) and where
            the gradients ended; ops after the second mark belong to the optimizer.
        predictions: with ``return_predictions``, the structure of ``y_pred`` (symbolic tensors
            of ``function.graph``); the step returns ``(loss, *tf.nest.flatten(y_pred))``
            (after the gradients, if any); None otherwise.
        weighted: whether the labels are ``(y, sample_weight)`` (see
            :func:`trace_training_step`).
        logs: with ``train_step``, the structure the model's ``train_step`` returned (symbolic
            tensors of ``function.graph``); the step returns ``tf.nest.flatten`` of it. None
            otherwise.
    """

    function: Any
    graph_def: Any
    model: Any
    loss_fn: Any
    optimizer: Any
    input_spec: Any
    label_spec: Any
    variables: list
    apply_updates: bool = True
    captures: dict = dataclasses.field(default_factory=dict)
    input_ops: tuple = ()
    label_ops: tuple = ()
    phase_marks: tuple = (0, 0)
    predictions: Any = None
    weighted: bool = False
    logs: Any = None

    @property
    def n_predictions(self) -> int:
        """How many of the step's last outputs are the flattened ``y_pred``."""
        if self.predictions is None:
            return 0
        import tensorflow as tf

        return len(tf.nest.flatten(self.predictions))


@dataclasses.dataclass
class OpMap:
    """Node id -> the TensorFlow ops (names in ``traced.function.graph``) it runs, in order.

    Attributes:
        nodes: per node, its op names in a topological order (fused pairs adjacent).
        fixed_ops: live ops in no node: variable reads, constants, shape arithmetic over static
            shapes, scalar optimizer arithmetic, variable handles, the inputs' placeholders.
            They depend only on each other, never on a node op.
        dead_ops: ops that reach neither an output nor a side effect (TensorFlow prunes them).
        sink_ops: NoOps that only gather the step's side effects as control inputs of its
            returned tensors (plumbing: a rewritten step makes its own).
        outputs: the step's output tensor names, in order.
        static_shapes: the fixed shape ops (Shape, ShapeN, Size, Rank, BroadcastArgs) that
            read a node's tensor: op name -> the values of its outputs (lists of ints), known
            statically; a rewritten step replaces them by constants. They are the only fixed
            ops that read a node op.
        bypass_ops: identity ops in no node (a multi-input IdentityN that Keras puts over all
            gradients): op name -> its input tensor names; a reader of output i reads input i.
            Grappler removes such an identity, so keeping it would add a barrier the original
            step does not have.
        buffers: per node, ``[tensor name, bytes]`` for each buffer counted in its memory.
        transient: per node, the bytes of the buffers its ops create that no other node reads
            (a BatchNorm's squared differences before their mean): held only while the node
            runs, so the graph does not count them, but nodes run side by side hold theirs at
            once (see :func:`tf_remat.plan.concurrent_groups`). Empty: unknown.
        pinned_ops: variable reads in nodes whose variable the step writes again after them
            (small ones: a seed generator's state): a recomputed copy of their node reads
            the first read's value instead of reading the variable again.
    """

    nodes: tuple
    fixed_ops: tuple = ()
    dead_ops: tuple = ()
    sink_ops: tuple = ()
    outputs: tuple = ()
    buffers: tuple = ()
    static_shapes: dict = dataclasses.field(default_factory=dict)
    bypass_ops: dict = dataclasses.field(default_factory=dict)
    transient: tuple = ()
    pinned_ops: tuple = ()

    def __post_init__(self):
        self.sink_ops = tuple(map(str, self.sink_ops))
        self.pinned_ops = tuple(map(str, self.pinned_ops))
        self.bypass_ops = {str(k): [str(t) for t in v] for k, v in dict(self.bypass_ops).items()}
        self.static_shapes = {str(k): [list(map(int, o)) if isinstance(o, (list, tuple))
                                       else int(o) for o in v]
                              for k, v in dict(self.static_shapes).items()}
        self.nodes = tuple(tuple(str(o) for o in ops) for ops in self.nodes)
        self.fixed_ops = tuple(map(str, self.fixed_ops))
        self.dead_ops = tuple(map(str, self.dead_ops))
        self.outputs = tuple(map(str, self.outputs))
        self.buffers = tuple(tuple((str(t), int(b)) for t, b in bufs) for bufs in self.buffers)
        self.transient = tuple(int(b) for b in self.transient)
        if self.transient and len(self.transient) != len(self.nodes):
            raise RematError(f"the op map has {len(self.nodes)} nodes but transient bytes for "
                             f"{len(self.transient)}")

    @property
    def n(self) -> int:
        return len(self.nodes)

    def node_of(self) -> dict:
        """Op name -> node id."""
        return {op: i for i, ops in enumerate(self.nodes) for op in ops}

    def to_dict(self) -> dict:
        return {"format": OPMAP_FORMAT, "version": OPMAP_VERSION,
                "nodes": [list(ops) for ops in self.nodes], "fixed_ops": list(self.fixed_ops),
                "dead_ops": list(self.dead_ops), "sink_ops": list(self.sink_ops),
                "outputs": list(self.outputs),
                "buffers": [[list(b) for b in bufs] for bufs in self.buffers],
                "static_shapes": self.static_shapes, "bypass_ops": self.bypass_ops,
                "transient": list(self.transient), "pinned_ops": list(self.pinned_ops)}

    def save(self, path: str | os.PathLike) -> None:
        """Write the op map as JSON (by convention ``<graph>.ops.json`` beside the graph)."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, separators=(",", ":"))
            f.write("\n")

    @classmethod
    def from_dict(cls, doc: dict) -> "OpMap":
        if not isinstance(doc, dict) or doc.get("format") != OPMAP_FORMAT:
            raise RematError(f"not an op map document (expected format {OPMAP_FORMAT!r})")
        return cls(nodes=doc["nodes"], fixed_ops=doc.get("fixed_ops", ()),
                   dead_ops=doc.get("dead_ops", ()), sink_ops=doc.get("sink_ops", ()),
                   outputs=doc.get("outputs", ()),
                   buffers=doc.get("buffers", ()),
                   static_shapes=doc.get("static_shapes", {}),
                   bypass_ops=doc.get("bypass_ops", {}),
                   transient=doc.get("transient", ()),
                   pinned_ops=doc.get("pinned_ops", ()))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "OpMap":
        try:
            with open(path) as f:
                return cls.from_dict(json.load(f))
        except FileNotFoundError as exc:
            raise RematError(f"op map file {os.fspath(path)!r} does not exist") from exc


@dataclasses.dataclass
class Extraction:
    """What :func:`extract` returns: the solver graph, its op map and the traced step.

    ``info`` holds facts for reports: op counts, profiling time, cost model, cache hits.
    """

    graph: Graph
    op_map: OpMap
    traced: TracedStep
    info: dict = dataclasses.field(default_factory=dict)
    # static-order steps built from it, by chain (tf_remat.rewrite.static_order_step): the step
    # costs trace one and optimize times the same one, and a rewrite takes seconds on big graphs
    static_steps: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def save(self, path: str | os.PathLike) -> None:
        """Write the graph JSON to ``path`` and the op map beside it (:func:`op_map_path`)."""
        self.graph.save(path)
        self.op_map.save(op_map_path(path))


def op_map_path(graph_path: str | os.PathLike) -> str:
    """``model.json`` -> ``model.ops.json`` (where the op map of a saved graph lives)."""
    path = os.fspath(graph_path)
    root = path[:-5] if path.endswith(".json") else path
    return root + ".ops.json"


# --------------------------------------------------------------------- public API
def _check_no_distribution(model) -> None:
    """A model built under a ``tf.distribute`` strategy gets a clear refusal: its variables
    are mirrored across replicas, and a step traced here runs on one device, with no
    all-reduce of the gradients (TensorFlow's own message said only to enter a scope)."""
    import tensorflow as tf

    found = getattr(model, "_distribute_strategy", None)
    if found is None and tf.distribute.has_strategy():
        found = tf.distribute.get_strategy()
    if found is None:
        for v in model.variables:
            if isinstance(getattr(v, "value", v), tf.distribute.DistributedValues):
                found = "a tf.distribute strategy"
                break
    if found is not None:
        name = found if isinstance(found, str) else type(found).__name__
        raise UnsupportedOpError(
            f"the model was built under {name}: tf-remat rewrites a one-device training "
            f"step and does not split it across replicas or all-reduce its gradients; build "
            f"and compile the model outside the strategy's scope (one device), and call "
            f"tf_remat.optimize outside it too")


def trace_training_step(model, input_spec, label_spec, *, loss=None, optimizer=None,
                        apply_updates: bool = True, return_predictions: bool = False,
                        conv_gradients: str | None = None,
                        weighted: bool = False, train_step: bool = False) -> TracedStep:
    """Trace one training step of ``model`` as a ``tf.function`` with fixed input shapes.

    Args:
        model: a built (or buildable) Keras 3 model, TensorFlow backend.
        input_spec, label_spec: ``tf.TensorSpec`` (or nested structures of them) of the input
            batch and the labels; every dimension, the batch one included, must be known.
        loss: a Keras loss (name, object or callable ``loss(y_true, y_pred)``); default: the
            model's compiled loss (``model.compute_loss``, regularization losses included).
        optimizer: a Keras optimizer or its name; default: the model's compiled optimizer.
        apply_updates: trace the optimizer update too (the step returns the loss) or not (the
            step returns ``(loss, *grads)``).
        return_predictions: also return the model's outputs ``y_pred`` (flattened, last), for
            compiled metrics; see ``TracedStep.predictions``.
        conv_gradients: ``"matmul"`` or ``"tensorflow"`` (see :func:`conv_gradients_mode`, the
            default); ``"tensorflow"`` traces the step exactly as Keras runs it: TensorFlow's
            convolution gradients, no broadcast gradients sunk into their readers
            (:func:`_sink_broadcasts`), no gradient sums chained (:func:`_chain_sums`) and
            loops that run up to 32 iterations at once (:func:`_serial_loops`), all done
            otherwise.
        weighted: the labels are a pair ``(y, sample_weight)`` and the loss weighs each sample
            as ``model.fit(sample_weight=...)`` (or ``class_weight=``) would: ``label_spec`` is
            then ``(spec of y, spec of the weights)``.
        train_step: trace ``model.train_step`` itself, the step ``model.fit`` runs (a
            subclass's override included: its own losses, gradients, updates and metrics), on
            ``(x, y)``, ``(x, y, sample_weight)``, or ``x`` alone where ``label_spec`` is
            ``()`` (no labels, as ``fit(x)`` passes them); the step returns its logs flattened (see
            ``TracedStep.logs``). Its loss and optimizer are the model's: ``loss`` and
            ``optimizer`` must be None, and the model compiled. Every ``tf.GradientTape``
            gradient it takes gets the convolution gradients and the edits below.

    Returns:
        A :class:`TracedStep`. Nothing is run, and no variable changes value.

    Raises:
        UnsupportedOpError: a spec has an unknown dimension, or the model has no loss /
            optimizer to train with.

    Example:
        >>> traced = trace_training_step(model, tf.TensorSpec((8, 32, 32, 3)),
        ...                              tf.TensorSpec((8,), tf.int32))  # doctest: +SKIP
    """
    import tensorflow as tf
    import keras

    check_specs(input_spec, label_spec)
    if not train_step and label_spec == ():
        _check_spec(label_spec, "label_spec")  # only a train_step may take no labels
    _check_no_distribution(model)
    _build_model(model, input_spec)
    if train_step:
        _check_train_step(model, loss, optimizer, apply_updates)
        loss_fn, compiled_loss = None, True
    else:
        loss_fn, compiled_loss = _resolve_loss(model, loss)
    if optimizer is None:
        optimizer = getattr(model, "optimizer", None)
        if optimizer is None:
            if apply_updates:
                raise UnsupportedOpError(
                    "no optimizer: pass optimizer=... or compile the model with one "
                    "(model.compile(optimizer='adam', loss=...))")
    elif not isinstance(optimizer, keras.optimizers.Optimizer):
        optimizer = keras.optimizers.get(optimizer)
    trainable = list(model.trainable_variables)
    if not trainable:
        raise UnsupportedOpError("the model has no trainable variables; nothing to train")
    if optimizer is not None and not optimizer.built:
        optimizer.build(trainable)

    marks = {}
    patch_filters = (conv_gradients or conv_gradients_mode()) == "matmul"
    # "tensorflow" promises the step exactly as Keras runs it
    sink = serial = conv_gradients != "tensorflow"

    def _n_ops():
        ops_now = tf.compat.v1.get_default_graph().get_operations()
        return max((op._id for op in ops_now), default=0)  # noqa: SLF001 (ids are monotone)

    if weighted and not (isinstance(label_spec, (tuple, list)) and len(label_spec) == 2):
        raise UnsupportedOpError("weighted=True takes label_spec as a pair (spec of the labels, "
                                 "spec of the sample weights)")

    # an embedding's gradient is IndexedSlices; some optimizers (Keras's RMSprop and Adagrad)
    # update from them through tf.unique and conds whose shapes depend on the batch's ids, which
    # no static plan can size. Such a step is traced again with the gradients made dense: their
    # untouched rows are zeros, which these element-wise updates turn into the sparse path's
    # result (slots decay as the sparse path's dense slot arithmetic does, the weight moves by
    # 0). Rows hit by several ids differ: Keras squares each occurrence's slice before summing
    densify = {"on": False, "sparse": False}

    def edited(take):
        """The gradients ``take()`` traces, with the convolution gradients of
        :func:`_matmul_conv_gradients` and the edits below (on the ops it adds)."""
        start = _n_ops()
        marks.setdefault("forward", start)
        with _matmul_conv_gradients(patch_filters):
            grads = take()
        flat = tf.nest.flatten(grads)
        if sink:
            try:
                flat = _sink_broadcasts(tf.compat.v1.get_default_graph(), start, flat)
            except (ValueError, TypeError, KeyError, tf.errors.OpError) as exc:
                # every edit leaves a graph of the same values (a new reader computes what the
                # old one did), so a failure midway costs memory, never correctness
                warn(f"tf-remat: BatchNorm-style broadcast gradients left as "
                     f"TensorFlow builds them ({type(exc).__name__}: {exc})")
            try:
                flat = _chain_sums(tf.compat.v1.get_default_graph(), start, flat)
            except (ValueError, TypeError, KeyError, tf.errors.OpError) as exc:
                warn(f"tf-remat: gradient sums left as TensorFlow builds them "
                     f"({type(exc).__name__}: {exc})")
        densify["sparse"] = densify["sparse"] or any(
            isinstance(g, tf.IndexedSlices) for g in flat)
        marks["backward"] = _n_ops()
        return tf.nest.pack_sequence_as(grads, list(flat))

    def model_step(x, y):
        # the step model.fit runs: the model's train_step on (x, y[, sample_weight])
        # without labels (label_spec ()) fit passes x alone, as Keras's data adapters do
        data = (x, *y) if weighted else x if label_spec == () else (x, y)
        with _tape_gradients(edited, densify):
            logs = model.train_step(data)
        logs = tf.nest.map_structure(tf.convert_to_tensor, logs)
        if not tf.nest.flatten(logs):
            raise UnsupportedOpError(f"{type(model).__name__}.train_step returned no tensors "
                                     f"(Keras's returns its metrics' results): return the "
                                     f"loss at least, e.g. {{'loss': loss}}")
        if "forward" not in marks:
            raise UnsupportedOpError(f"{type(model).__name__}.train_step took no gradient with "
                                     f"tf.GradientTape: tf-remat plans a step that does")
        marks["logs"] = logs
        _serial_loops(serial)
        return tuple(tf.nest.flatten(logs))

    def step(x, y):
        sw = None
        if weighted:
            y, sw = y
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            if compiled_loss:
                value = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sw,
                                           training=True)
            else:
                # loss_fn is a keras Loss (keras_loss), which takes the weights
                value = loss_fn(y, y_pred, sample_weight=sw)
                if model.losses:
                    value = value + tf.add_n([tf.cast(v, value.dtype) for v in model.losses])
            scaled = optimizer.scale_loss(value) if (
                optimizer is not None and hasattr(optimizer, "scale_loss")) else value
        grads = edited(lambda: tape.gradient(scaled, trainable))
        preds = ()
        if return_predictions:
            marks["predictions"] = y_pred
            preds = tuple(tf.nest.flatten(y_pred))
        if apply_updates:
            if densify["on"]:
                grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                         for g in grads]
            pairs = [(g, v) for g, v in zip(grads, trainable) if g is not None]
            optimizer.apply_gradients(pairs)
            _serial_loops(serial)
            return (value, *preds) if preds else value
        # dense gradients (an embedding's IndexedSlices would be three outputs)
        grads = [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
                 for g, v in zip(grads, trainable)]
        _serial_loops(serial)
        return (value, *grads, *preds)

    def trace():
        densify["sparse"] = False
        try:
            # a train_step is traced as Keras traces it for fit: with autograph, which its
            # Python control flow over tensors may need
            fn = tf.function(model_step, autograph=True) if train_step else \
                tf.function(step, autograph=False)
            with _phased_transposed_convs(patch_filters):
                return fn.get_concrete_function(input_spec, label_spec)
        except (TypeError, ValueError) as exc:
            raise UnsupportedOpError(f"tracing the training step failed: {exc}") from exc

    concrete = trace()
    if apply_updates and densify["sparse"] and _update_has_unknown_shapes(
            concrete.graph, marks["backward"]):
        densify["on"] = True
        marks.clear()
        concrete = trace()
        warn(f"tf-remat: {type(optimizer).__name__} updates from a sparse (IndexedSlices) "
             "gradient, an embedding's, through shapes that depend on the ids in the batch; "
             "the step makes that gradient dense (its memory is planned). It updates as Keras "
             "does when no id repeats within a batch; a repeated id's second-moment slot gets "
             "the square of its summed gradient, as in dense training, where Keras 3 sums the "
             "squares of its occurrences")
    graph = concrete.graph
    handles = {id(v.handle): v for v in concrete.variables if hasattr(v, "handle")}
    captures = {}
    for external, internal in graph.captures:
        var = handles.get(id(external))
        if var is not None:
            captures[internal.op.name] = var
    placeholders = [t.op.name for t in graph.inputs[:len(tf.nest.flatten(input_spec))
                                                    + len(tf.nest.flatten(label_spec))]]
    n_x = len(tf.nest.flatten(input_spec))
    return TracedStep(function=concrete, graph_def=graph.as_graph_def(), model=model,
                      loss_fn=loss_fn, optimizer=optimizer, input_spec=input_spec,
                      label_spec=label_spec, variables=list(concrete.variables),
                      apply_updates=apply_updates, captures=captures,
                      input_ops=tuple(placeholders[:n_x]), label_ops=tuple(placeholders[n_x:]),
                      phase_marks=(marks.get("forward", 0), marks.get("backward", 0)),
                      predictions=marks.get("predictions"), weighted=weighted,
                      logs=marks.get("logs"))


def _serial_loops(enabled: bool = True) -> None:
    """Run the ``tf.while_loop``s of the step being traced one iteration at a time, as the
    rewritten step runs them (``rewrite._LOOP_PARALLEL``), so that what is profiled (each
    node's time, what a loop's body holds while it runs: :func:`_loop_body_transients`) is
    what the plan will run; by default iterations run up to 32 at once, as far ahead of each
    other as their data allows. The values are the same. Loops nested in a loop's body keep
    their setting."""
    import tensorflow as tf
    from tensorflow.core.framework import attr_value_pb2

    if not enabled:
        return
    for op in tf.compat.v1.get_default_graph().get_operations():
        if op.type in ("While", "StatelessWhile") and op.get_attr("parallel_iterations") > 1:
            op._set_attr("parallel_iterations", attr_value_pb2.AttrValue(i=1))  # noqa: SLF001


def _check_train_step(model, loss, optimizer, apply_updates):
    """What tracing ``model.train_step`` needs (see :func:`trace_training_step`)."""
    name = type(model).__name__
    if not apply_updates:
        raise UnsupportedOpError(f"{name}.train_step applies its own update: a gradients-only "
                                 f"step cannot be taken from it")
    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
        raise UnsupportedOpError(f"{name}.train_step trains with model.optimizer: compile the "
                                 f"model first (model.compile(optimizer=..., ...)), or trace "
                                 f"Keras's default step from loss= and optimizer= "
                                 f"(train_step=False)")
    if loss is not None or optimizer is not None:
        raise UnsupportedOpError(f"{name}.train_step computes its loss and update with the "
                                 f"model's own (model.compile's loss and optimizer): leave "
                                 f"loss= and optimizer= None, or trace Keras's default step "
                                 f"from them (train_step=False)")


@contextlib.contextmanager
def _tape_gradients(edited, densify):
    """While tracing a model's ``train_step``, every ``tf.GradientTape.gradient`` it calls
    goes through ``edited`` (:func:`trace_training_step`'s gradient edits); an embedding's
    IndexedSlices are made dense when ``densify["on"]``."""
    import tensorflow as tf

    cls = tf.GradientTape
    original = cls.gradient

    def gradient(tape, target, sources, *args, **kwargs):
        grads = edited(lambda: original(tape, target, sources, *args, **kwargs))
        if densify["on"]:
            grads = tf.nest.map_structure(
                lambda g: tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g,
                grads)
        return grads

    cls.gradient = gradient
    try:
        yield
    finally:
        cls.gradient = original


def _update_has_unknown_shapes(graph, after: int) -> bool:
    """Whether an op traced after op id ``after`` (the optimizer update) has an output of a
    shape that is not static."""
    return any(not t.shape.is_fully_defined()
               for op in graph.get_operations() if op._id > after  # noqa: SLF001
               for t in op.outputs)


def overrides_train_step(model) -> str | None:
    """The name of the class whose ``train_step`` overrides Keras's, or None."""
    for cls in type(model).__mro__:
        if "train_step" in vars(cls):
            return None if cls.__module__.startswith(("keras.", "tf_keras.")) else \
                cls.__qualname__
    return None


def extract(model, *, input_spec, label_spec, loss=None, optimizer=None,
            cost_model: str = "profile", batch_size: int | None = None, verbose: int = 1,
            apply_updates: bool = True, name: str | None = None,
            return_predictions: bool = False, weighted: bool = False,
            train_step: bool | None = None) -> Extraction:
    """Trace a training step and turn it into a costed solver :class:`Graph` plus its op map.

    Args:
        model, input_spec, label_spec, loss, optimizer, apply_updates, return_predictions,
            weighted, train_step: as in :func:`trace_training_step`, but ``train_step=None``
            (the default) traces the model's own ``train_step`` when its class overrides
            Keras's and a full step is traced (as ``tf_remat.optimize`` does), and
            ``label_spec=None`` stands for no labels there.
        cost_model: ``"profile"`` (each node's ops measured alone on the current device, GPU
            if TensorFlow sees one, cached on disk; see :mod:`tf_remat.profile`), ``"step"``
            (on a CPU, those costs replaced by each node's share of the time in a profiler trace of
            the step run in a static order, :func:`tf_remat.profile.step_costs`; the isolated
            ones where the step cannot run or on a GPU) or ``"flops"`` (an estimate from FLOPs
            and bytes moved, no measurement; coarse, for machines where profiling is not
            wanted).
        batch_size: if given, replaces the first dimension of both specs.
        verbose: 0 silent, 1 a progress bar while profiling.
        name: the graph's name (default: the model's name and batch size).

    Returns:
        An :class:`Extraction` (``graph``, ``op_map``, ``traced``, ``info``).

    Raises:
        UnsupportedOpError: an unknown dimension (the message names the tensor), or an op whose
            output shape TensorFlow cannot infer statically.
    """
    if train_step is None:
        train_step = apply_updates and overrides_train_step(model) is not None
    if label_spec is None and train_step:
        label_spec = ()
    if batch_size is not None:
        input_spec = _with_batch(input_spec, batch_size)
        label_spec = _with_batch(label_spec, batch_size)
    if cost_model not in ("step", "profile", "flops"):
        raise ValueError(f"cost_model must be 'step', 'profile' or 'flops', got "
                         f"{cost_model!r}")
    t0 = time.perf_counter()
    traced = trace_training_step(model, input_spec, label_spec, loss=loss, optimizer=optimizer,
                                 apply_updates=apply_updates,
                                 return_predictions=return_predictions, weighted=weighted,
                                 train_step=train_step)
    t1 = time.perf_counter()
    analysis = _Analysis(traced)
    op_map, graph_fields = analysis.build()
    t2 = time.perf_counter()
    from tf_remat import profile as _profile

    if cost_model in ("step", "profile"):
        costs, pinfo = _profile.profile_nodes(traced, op_map, verbose=verbose)
    else:
        costs, pinfo = _profile.flops_costs(traced, op_map)
    t3 = time.perf_counter()
    scratch = measure_workspace(traced, op_map)
    inter = [b if b >= _MIN_WORKSPACE else 0 for b in analysis.intermediate]
    # one node holds both while its node runs: the workspace node stands beside the node's
    # inputs and output in the simulator, whichever of the two is larger
    workspace = [max(a, b) for a, b in zip(scratch, inter)]
    graph_fields, op_map, costs = with_workspace_nodes(graph_fields, op_map, costs, workspace)
    t4 = time.perf_counter()
    batch = _first_dim(input_spec)
    gname = name or f"{_safe_name(model.name)}_b{batch}"
    graph = Graph(cost=costs, name=gname, **graph_fields)
    info = {"ops": len(traced.function.graph.get_operations()),
            "node_ops": sum(len(o) for o in op_map.nodes), "fixed_ops": len(op_map.fixed_ops),
            "dead_ops": len(op_map.dead_ops), "nodes": graph.n, "edges": len(graph.edges),
            "trace_seconds": t1 - t0, "group_seconds": t2 - t1, "cost_seconds": t3 - t2,
            "workspace_nodes": sum(1 for b in workspace if b),
            "workspace_bytes": max(scratch, default=0),
            "intermediate_bytes": max(inter, default=0), "workspace_seconds": t4 - t3,
            "cost_model": cost_model, "loops": forward_loops(traced, op_map),
            "loop_bytes": loop_memory(traced, op_map), **pinfo}
    ex = Extraction(graph=graph, op_map=op_map, traced=traced, info=info)
    if cost_model == "step":
        step_costs, sinfo = _profile.step_costs(ex)
        info.update(sinfo)
        if step_costs is not None:
            ex.graph = graph.replace(cost=tuple(step_costs))
        elif verbose:
            print(f"tf-remat: node costs measured alone, not in the step: {sinfo['step_costs']}",
                  file=sys.stderr)
    return ex


def _forward_whiles(traced: TracedStep, op_map: OpMap) -> list:
    """The forward pass's ``tf.while_loop`` ops that the step runs and that pass TensorLists
    (variant tensors) on."""
    import tensorflow as tf

    live = {name for ops in op_map.nodes for name in ops}
    fwd = traced.phase_marks[0]
    return [op for op in traced.function.graph.get_operations()
            if op.type in ("While", "StatelessWhile") and op.name in live
            and op._id <= fwd and any(t.dtype == tf.variant for t in op.outputs)]  # noqa: SLF001


def forward_loops(traced: TracedStep, op_map: OpMap) -> list:
    """Names of the forward pass's ``tf.while_loop`` ops that pass values to the backward pass
    in TensorLists the graph cannot size (:func:`loop_list_bytes`: a loop with no static trip
    count, or a list that is not one tensor per iteration).

    Such a loop keeps every iteration's values for its gradient in TensorLists, variant
    tensors with no static size: the graph counts none of their memory. ``optimize`` warns and
    relies on its measurement. A Keras RNN layer's loop (its sequence length is static) is
    sized and is not listed (see :func:`loop_memory`)."""
    import tensorflow as tf

    return [op.name for op in _forward_whiles(traced, op_map)
            if any(t.dtype == tf.variant and k not in loop_list_bytes(op)
                   for k, t in enumerate(op.outputs))]


def loop_memory(traced: TracedStep, op_map: OpMap) -> dict:
    """``{loop op name: bytes}``: what each forward ``tf.while_loop`` that runs once keeps in
    TensorLists for the backward pass, as the graph counts it. A loop that may not run again
    (one that draws random numbers or writes state in its body, :func:`recomputable_loop`)
    keeps these lists from the loop to its gradient in every plan: they bound the budget from
    below. A Keras RNN's loop, which only computes and reads its weights, may be recomputed
    before its gradient and is not listed."""
    out = {}
    for op in _forward_whiles(traced, op_map):
        if not _non_recomputable(op, forward=True):
            continue
        b = sum(loop_list_bytes(op).values())
        if b:
            out[op.name] = int(b)
    return out


def extract_graph(model, *, input_spec, label_spec, loss=None, optimizer=None,
                  cost_model: str = "step", verbose: int = 1) -> Graph:
    """The solver :class:`Graph` of one training step of ``model`` (see :func:`extract`).

    Costs are in seconds, memory in bytes; ``graph.save(path)`` writes the native JSON.

    Example:
        >>> g = tf_remat.extract_graph(model, input_spec=tf.TensorSpec((8, 224, 224, 3)),
        ...                            label_spec=tf.TensorSpec((8,), tf.int32))  # doctest: +SKIP
        >>> g.no_remat_peak  # doctest: +SKIP
    """
    return extract(model, input_spec=input_spec, label_spec=label_spec, loss=loss,
                   optimizer=optimizer, cost_model=cost_model, verbose=verbose).graph


def profiled_memory_events(run) -> list:
    """Call ``run()`` once under TensorFlow's profiler; its allocator events, in time order.

    Each event is ``(time_ps, is_allocation, stats)``; ``stats`` holds the profiler's fields:
    ``addr``, ``requested_bytes`` (what the kernel asked for), ``allocation_bytes`` (the chunk
    the allocator handed out), ``tf_op`` (the op that allocated), ``region_type`` (``output``
    for an op's result, ``temp`` for its scratch space), ``shape``. Empty when TensorFlow keeps
    no memory statistics for the device.
    """
    import tempfile

    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    with tempfile.TemporaryDirectory(prefix="tf_remat_trace_") as logdir:
        tf.profiler.experimental.start(logdir)
        try:
            run()
        finally:
            tf.profiler.experimental.stop()
        space = xplane_pb2.XSpace()
        for d, _, files in os.walk(logdir):
            for f in files:
                if f.endswith(".xplane.pb"):
                    with open(os.path.join(d, f), "rb") as fh:
                        space.ParseFromString(fh.read())
    events = []
    for plane in space.planes:
        stat_name = {k: m.name for k, m in plane.stat_metadata.items()}
        event_name = {k: m.name for k, m in plane.event_metadata.items()}
        for line in plane.lines:
            for ev in line.events:
                what = event_name.get(ev.metadata_id, "")
                if what not in ("MemoryAllocation", "MemoryDeallocation"):
                    continue
                st = {}
                for s in ev.stats:
                    kind = s.WhichOneof("value")
                    st[stat_name.get(s.metadata_id)] = (
                        stat_name.get(s.ref_value) if kind == "ref_value"
                        else getattr(s, kind) if kind else 0)
                events.append((line.timestamp_ns * 1000 + ev.offset_ps,
                               what == "MemoryAllocation", st))
    events.sort(key=lambda e: e[0])
    return events


def measure_workspace(traced: TracedStep, op_map: OpMap, *, x=None, y=None) -> list:
    """Per node, the scratch bytes its kernels allocate while it runs, from one run of the
    traced step under TensorFlow's profiler (the variables are restored after).

    A kernel's scratch space (``temp`` allocations) is freed before the node ends, so it is no
    value of the graph; but it is memory the step holds while the node runs, and some kernels
    need a lot: without oneDNN, TensorFlow's CPU Conv2DBackpropFilter takes a ~30 MB im2col
    buffer whatever the layer's size; on a GPU, cuDNN takes convolution workspaces. The
    figure is the most a node's ops can hold at once: each op's own most, summed over the
    heaviest set of the node's ops none of which waits for another (:func:`_concurrent_most`),
    rounded as the allocator counts (0 under 1 MiB: see ``_MIN_WORKSPACE``). All zeros when
    TensorFlow keeps no memory statistics for the device or the profiler is busy.
    """
    kind = current_device_kind()
    ws = [0] * op_map.n
    if memory_stats_missing(f"{kind}:0"):
        return ws
    if x is None:
        x = _random_like(traced.input_spec, seed=1)
    if y is None:
        y = _random_like(traced.label_spec, seed=2, labels=_num_classes(traced))
    saved = snapshot_variables(traced.variables)
    run = lambda: block(traced.function(x, y))  # noqa: E731
    try:
        run()  # the first call builds kernels and allocates the function's own state
        events = profiled_memory_events(run)
    except Exception as exc:  # noqa: BLE001 (a profiler already running, say: costs nothing)
        warn(f"tf-remat: kernel scratch space not measured ({exc}); the plan counts "
             "none")
        return ws
    finally:
        restore_variables(traced.variables, saved)
    node_of = op_map.node_of()
    # a variable update's "temp" allocation is a copy on write of the variable (a read of it
    # was still referenced), which becomes the variable's buffer rather than scratch; whether
    # it happens depends on which ops the free-running executor had finished, so it came and
    # went between runs of one model (an MLP's graph had 52, 53 or 54 nodes), and a plan saved
    # from one run did not fit the next. The measured check sees it when a plan's order makes it
    updates = {op.name for op in traced.function.graph.get_operations()
               if _VARIABLE_UPDATE_RE.match(op.type)}
    # per op, the most scratch it holds at once; a node's figure is then what its ops can hold
    # together. The rewritten step orders nodes, not the ops inside one (chain="node"), so two
    # of a node's kernels that do not depend on each other may run at once: without oneDNN,
    # the filter gradients of a shared layer's two calls (22 and 10 MiB of scratch) did in a
    # rewritten siamese step and not in the profiled run, whose figure was the larger alone
    live, held, per_op = {}, {}, {}
    per_op.update(_loop_body_transients(events, node_of, traced.function.graph, kind))
    for _, alloc, st in events:
        o = st.get("tf_op")
        if alloc:
            if node_of.get(o) is None or st.get("region_type") != "temp" or o in updates:
                continue
            b = counted_bytes(int(st.get("requested_bytes", 0)), kind)
            live[st.get("addr")] = (o, b)
            held[o] = held.get(o, 0) + b
            per_op[o] = max(per_op.get(o, 0), held[o])
        elif st.get("addr") in live:
            o, b = live.pop(st.get("addr"))
            held[o] -= b
    by_node = {}
    for o, b in per_op.items():
        by_node.setdefault(node_of[o], {})[o] = b
    for v, temps in by_node.items():
        ws[v] = _concurrent_most(temps, set(op_map.nodes[v]), traced.function.graph)
    return [b if b >= _MIN_WORKSPACE else 0 for b in ws]


def _loop_body_transients(events, node_of, graph, kind) -> dict:
    """``{While op name: bytes}``: the most that a ``tf.while_loop``'s body and condition held
    at once, of what they allocated and freed before the loop ended.

    Inside a loop every kernel's buffers, outputs or scratch, are the loop's own: the profiler
    names their ops ``<loop>/body/_<k>/<op>``, no op of the graph's nodes. Those that outlive
    the loop are what its TensorLists keep (counted as the loop's outputs,
    :func:`loop_list_bytes`); the rest come and go with each iteration and the executor runs
    a body's ops freely, so the figure is what this run held, not a bound. A ConvLSTM2D's
    gradient loop held about 36 MiB so (its eight convolutions' patch products, taken
    together), which the plan did not count: it simulated 112 MiB and measured 145."""
    loops = {op.name for op in graph.get_operations()
             if op.type in ("While", "StatelessWhile") and op.name in node_of}
    if not loops:
        return {}

    def loop_of(op_name):
        if not op_name or op_name in node_of:
            return None
        for marker in ("/body/", "/cond/"):
            head = op_name.split(marker, 1)[0]
            if head != op_name and head in loops:
                return head
        return None

    owner, end = {}, {}  # addr -> (loop, bytes, allocated at); loop -> its last event's time
    for t, _, st in events:
        loop = loop_of(st.get("tf_op"))
        if loop is not None:
            end[loop] = t
    freed = {}  # (addr, allocated at) -> freed at
    for t, alloc, st in events:
        a = st.get("addr")
        if alloc:
            loop = loop_of(st.get("tf_op"))
            if loop is not None:
                owner[a] = (loop, counted_bytes(int(st.get("requested_bytes", 0)), kind), t)
        elif a in owner:
            freed[(a, owner[a][2])] = t
            owner.pop(a)
    # the rewritten step runs a loop's iterations one at a time (rewrite._LOOP_PARALLEL), the
    # profiled step up to 32 at once: of one body op's buffers live together (other
    # iterations'), only the largest counts
    owner, sizes, held, most = {}, {}, {}, {}

    def change(loop, op, b, sign):
        live = sizes.setdefault((loop, op), collections.Counter())
        before = max(live, default=0)
        live[b] += sign
        if not live[b]:
            del live[b]
        held[loop] = held.get(loop, 0) + max(live, default=0) - before
        most[loop] = max(most.get(loop, 0), held[loop])

    for t, alloc, st in events:
        a = st.get("addr")
        loop = loop_of(st.get("tf_op")) if alloc else None
        if alloc and loop is not None:
            b = counted_bytes(int(st.get("requested_bytes", 0)), kind)
            gone = freed.get((a, t))
            if gone is not None and gone <= end[loop]:  # freed inside the loop
                owner[a] = (loop, st.get("tf_op"), b)
                change(loop, st.get("tf_op"), b, 1)
        elif not alloc and a in owner:
            change(*owner.pop(a), -1)
    return most


#: a node with more scratch-taking ops than this counts them all at once
_ANTICHAIN_OPS = 12


def _concurrent_most(temps: dict, members: set, graph) -> int:
    """The most of ``temps`` (op name -> bytes) that ops of one node can hold at once: the
    heaviest set of them none of which depends on another through the node's ops (an
    antichain). Orders through ops outside the node are not looked for, so the figure errs
    high, never low."""
    ops = sorted(temps)
    if len(ops) == 1:
        return temps[ops[0]]
    if len(ops) > _ANTICHAIN_OPS:
        return sum(temps.values())
    by_name = {o: graph.get_operation_by_name(o) for o in members}
    below = {}
    for o in ops:
        seen, todo = set(), [o]
        while todo:
            for r in _consumers(by_name[todo.pop()]):
                if r.name in members and r.name not in seen:
                    seen.add(r.name)
                    todo.append(r.name)
        below[o] = seen
    best = 0
    for mask in range(1, 1 << len(ops)):
        chosen = [o for i, o in enumerate(ops) if mask >> i & 1]
        if all(b not in below[a] for a in chosen for b in chosen):
            best = max(best, sum(temps[o] for o in chosen))
    return best


def _consumers(op):
    """The ops that read an output of ``op`` or wait for it by a control edge."""
    return ([c for t in op.outputs for c in t.consumers()]
            + list(op._control_outputs))  # noqa: SLF001


def variable_bytes(var, device_kind: str) -> int:
    """A variable's bytes as the device's allocator counts them; a ``tf.Variable`` or a Keras 3
    variable (whose shape is a tuple and dtype a string)."""
    import tensorflow as tf

    n = tf.TensorShape(var.shape).num_elements() or 0
    return counted_bytes(int(n) * tf.as_dtype(var.dtype).size, device_kind)


def snapshot_variables(variables) -> list:
    """The variables' values as private NumPy copies, for :func:`restore_variables`. Copies,
    not views: a NumPy view of a variable's buffer makes TensorFlow copy the variable when the
    step updates it (copy on write), which the step itself would not do."""
    import numpy as np

    return [np.array(v.numpy(), copy=True) for v in variables]


def restore_variables(variables, values):
    """Assign saved values back; each from a private copy, so no NumPy array outside shares
    the variable's new buffer (which would make the next update copy it)."""
    import numpy as np

    for v, s in zip(variables, values):
        v.assign(np.array(s, copy=True))


def block(out):
    """Wait for a step's outputs (their values are read back)."""
    import tensorflow as tf

    for t in tf.nest.flatten(out):
        if hasattr(t, "numpy"):
            t.numpy()


def with_workspace_nodes(fields: dict, op_map: OpMap, costs, workspace) -> tuple:
    """Give each node with scratch space a zero-cost node before it that holds it.

    Node ``w`` (memory: the scratch bytes) reads what ``v`` reads, and only ``v`` reads ``w``;
    so whenever ``v`` is computed, ``w`` is resident beside ``v``'s inputs and output, and it
    is freed right after. That is the scratch space's lifetime in the step, expressed in the
    graph every solver and the simulator already understand, with no new term in any of them.
    Ids are renumbered so that ascending ids stay a topological order; ``w``'s op list is
    empty (a rewritten step emits nothing for it).

    Returns ``(fields, op_map, costs)``.
    """
    n = len(costs)
    if not any(workspace):
        return fields, op_map, list(costs)
    new_id, old_of = [0] * n, []
    for v in range(n):
        if workspace[v]:
            old_of.append(("ws", v))
        new_id[v] = len(old_of)
        old_of.append(("node", v))
    preds = [[] for _ in range(n)]
    for u, v in fields["edges"]:
        preds[v].append(u)
    ws_id = {v: new_id[v] - 1 for v in range(n) if workspace[v]}
    edges = [(new_id[u], new_id[v]) for u, v in fields["edges"]]
    for v, w in ws_id.items():
        edges += [(new_id[u], w) for u in preds[v]]
        edges.append((w, new_id[v]))

    def expand(values, ws_value):
        return [ws_value(v) if what == "ws" else values[v] for what, v in old_of]

    names = fields.get("names") or [str(v) for v in range(n)]
    out = dict(fields)
    out.update(
        memory=expand(fields["memory"], lambda v: int(workspace[v])),
        edges=sorted(edges), order=list(range(len(old_of))),
        outputs=[new_id[o] for o in fields["outputs"]],
        backward=expand(fields["backward"], lambda v: fields["backward"][v]),
        recomputable=expand(fields["recomputable"], lambda v: True),
        names=expand(names, lambda v: f"{names[v]}/workspace"))
    m = dataclasses.replace(
        op_map, nodes=expand(op_map.nodes, lambda v: ()),
        buffers=expand(op_map.buffers, lambda v: ()) if op_map.buffers else op_map.buffers,
        transient=expand(op_map.transient, lambda v: 0) if op_map.transient else ())
    return out, m, expand(list(costs), lambda v: 0.0)


def memory_stats_missing(device: str) -> str | None:
    """Why TensorFlow cannot count ``device``'s memory in this process, or None when it can.

    TensorFlow keeps allocator statistics (``get_memory_info``) for the CPU only when its CPU
    allocator is the BFC allocator; ``import tf_remat`` asks for it, but TensorFlow decides when
    it creates its first tensor, which may have happened before.
    """
    import tensorflow as tf

    try:
        tf.config.experimental.get_memory_info(device)
        return None
    except ValueError:
        pass
    if device.upper().startswith("CPU"):
        return (f"TensorFlow keeps no memory statistics for {device} in this process: its CPU "
                "allocator is not the BFC allocator (TensorFlow's default only where it turns "
                "oneDNN on, which depends on the CPU). Set the environment variable "
                "TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow creates its first tensor: "
                "import tf_remat before building the model, or export it in the shell")
    return f"TensorFlow keeps no memory statistics for {device} in this process"


def require_memory_stats(device: str) -> None:
    """Raise :class:`~tf_remat.errors.RematError` saying what to change when TensorFlow cannot
    count ``device``'s memory (see :func:`memory_stats_missing`)."""
    why = memory_stats_missing(device)
    if why:
        raise RematError(why)


def measure_step(traced: TracedStep, *, runs: int = 5, x=None, y=None) -> dict:
    """Run the traced step on random data; measured peak memory (bytes) and median step time.

    The peak is ``tf.config.experimental.get_memory_info(device)['peak']`` after
    ``reset_memory_stats`` around one step, on the device the step runs on ('GPU:0' if visible,
    else 'CPU:0'): everything the allocator holds, the variables and the batch included.

    Warning: with ``apply_updates`` the model's variables are updated ``runs + 2`` times.
    """
    import numpy as np
    import tensorflow as tf

    device = "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"
    require_memory_stats(device)
    if x is None:
        x = _random_like(traced.input_spec, seed=1)
    if y is None:
        y = _random_like(traced.label_spec, seed=2, labels=_num_classes(traced))
    fn = traced.function
    out = fn(x, y)  # warm-up: kernels built, Grappler run
    del out
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        out = fn(x, y)
        _ = tf.nest.map_structure(lambda a: a.numpy(), out)
        times.append(time.perf_counter() - t)
        del out
    tf.config.experimental.reset_memory_stats(device)
    before = tf.config.experimental.get_memory_info(device)["current"]
    out = fn(x, y)
    _ = tf.nest.map_structure(lambda a: a.numpy(), out)
    del out
    info = tf.config.experimental.get_memory_info(device)
    return {"device": device, "peak_bytes": int(info["peak"]), "current_before": int(before),
            "step_seconds": float(np.median(times)), "times": times}


# --------------------------------------------------------------------- helpers
def _build_model(model, input_spec):
    """Create every layer's variables, as ``model.fit`` does before its first step.

    ``model.build(shape)`` alone leaves a subclassed model's layers without variables (Keras
    marks the model built and warns), so the model is called symbolically on the spec, which
    builds each layer as the call reaches it and allocates nothing for the batch."""
    import keras
    from keras.src import backend

    layers = list(model._flatten_layers(include_self=True))
    if all(layer.built for layer in layers):
        return
    import tensorflow as tf

    symbolic = tf.nest.map_structure(lambda s: keras.KerasTensor(s.shape, s.dtype), input_spec)
    try:
        backend.compute_output_spec(model, symbolic, training=False)
    except Exception as exc:  # noqa: BLE001
        if not model.built:  # a model whose own build() makes its variables
            try:
                model.build(tf.nest.map_structure(lambda s: s.shape, input_spec))
            except Exception:  # noqa: BLE001
                pass
        if model.trainable_variables:
            return  # built enough to train; a layer the call never reaches stays unbuilt
        raise UnsupportedOpError(
            f"the model could not be built from input_spec ({type(exc).__name__}: {exc}); "
            f"call it on one batch (model(x)), or build its layers (a keras.Input at the "
            f"head of each sub-model, as for a GAN's, whose model has no call), before "
            f"optimize") from exc


def _leaf_name(what, i, n):
    return what if n == 1 else f"{what} (leaf {i})"


def _check_spec(spec, what):
    import tensorflow as tf

    leaves = tf.nest.flatten(spec)
    if not leaves:
        raise UnsupportedOpError(f"{what} is empty: give a tf.TensorSpec (or a list, tuple or "
                                 f"dict of them) with every dimension known")
    for i, s in enumerate(leaves):
        if not isinstance(s, tf.TensorSpec):
            # a shape tuple given where a spec belongs flattens to its integers
            hint = ""
            if isinstance(spec, (tuple, list)) and all(isinstance(v, int) for v in leaves):
                hint = f"; a shape is given as tf.TensorSpec({tuple(spec)})"
            raise UnsupportedOpError(
                f"{_leaf_name(what, i, len(leaves))} must be a tf.TensorSpec (or a list, tuple "
                f"or dict of them), such as tf.TensorSpec((32, 224, 224, 3)); got "
                f"{type(s).__name__} {s!r}{hint}")
        if not s.shape.is_fully_defined():
            dims = [d for d, v in enumerate(s.shape.as_list() if s.shape.rank is not None
                                            else [None]) if v is None]
            raise UnsupportedOpError(
                f"{_leaf_name(what, i, len(leaves))} has shape {s.shape} with an unknown "
                f"dimension {dims[0]}; tf-remat needs static shapes: give every dimension, the "
                f"batch size included (e.g. tf.TensorSpec((32, ...)))")


def check_specs(input_spec, label_spec):
    """Refuse specs a step cannot be traced from, before any tracing: each leaf a
    ``tf.TensorSpec`` with every dimension known, and one batch size (the first dimension)
    across the inputs and the labels; an :class:`UnsupportedOpError` naming the spec
    otherwise. (Labels of another batch size can trace without an error where a loss
    broadcasts them, and the step would train on a wrong loss.)"""
    import tensorflow as tf

    _check_spec(input_spec, "input_spec")
    if label_spec != ():  # (): no labels, for a model's own train_step (optimize's label_spec)
        _check_spec(label_spec, "label_spec")
    sizes = {}
    for what, spec in (("input_spec", input_spec), ("label_spec", label_spec)):
        leaves = tf.nest.flatten(spec)
        for i, s in enumerate(leaves):
            if s.shape.rank:
                sizes.setdefault(int(s.shape[0]),
                                 f"{_leaf_name(what, i, len(leaves))} has shape {s.shape}")
    if len(sizes) > 1:
        raise UnsupportedOpError(f"the specs disagree on the batch size (the first "
                                 f"dimension): {'; '.join(sizes.values())}; give every input "
                                 f"and label the same batch size")


def _with_batch(spec, batch):
    import tensorflow as tf

    def fix(s):
        shape = s.shape.as_list()
        if not shape:
            return s
        return tf.TensorSpec([batch] + shape[1:], s.dtype, s.name)

    return tf.nest.map_structure(fix, spec)


def _first_dim(spec):
    import tensorflow as tf

    s = tf.nest.flatten(spec)[0]
    return s.shape[0] if s.shape.rank else 1


def _safe_name(name):
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(name)) or "model"


def _resolve_loss(model, loss):
    if loss is None:
        if getattr(model, "_compile_loss", None) is not None or getattr(model, "loss", None):
            return model.compute_loss, True
        raise UnsupportedOpError("no loss: pass loss=... or compile the model with one "
                                 "(model.compile(optimizer='adam', loss=...))")
    return keras_loss(loss), False


def keras_loss(identifier):
    """A loss as ``model.compile(loss=identifier)`` would use it: a ``keras.losses.Loss`` that
    reduces to the batch mean. ``keras.losses.get("mse")`` is the per-sample function, whose
    gradient would be the batch's sum (``batch`` times Keras's); compile wraps such functions
    (and any other callable) in a ``Loss``, and so does this."""
    import keras

    name = identifier if isinstance(identifier, str) else None
    if isinstance(identifier, (list, tuple)) or (isinstance(identifier, dict)
                                                 and "class_name" not in identifier):
        raise UnsupportedOpError(
            f"a loss per output ({identifier!r}): compile the model with it "
            f"(model.compile(loss=..., loss_weights=...)) and leave optimize's loss=None, so "
            f"the step uses model.compute_loss as Keras's does")
    if isinstance(identifier, (str, dict)):
        try:
            identifier = keras.losses.get(identifier)
        except ValueError as exc:
            raise UnsupportedOpError(f"unknown loss {name or identifier!r}: {exc}") from exc
    if isinstance(identifier, keras.losses.Loss):
        return identifier
    if not callable(identifier):
        raise UnsupportedOpError(f"loss {identifier!r} is not callable")
    fn = identifier

    class _Wrapped(keras.losses.Loss):
        # Loss.__call__ does the rest: the batch mean, sample weights, masks and dtypes
        def call(self, y_true, y_pred):
            return fn(y_true, y_pred)

    return _Wrapped(name=name or getattr(fn, "__name__", "loss"))


def _num_classes(traced):
    """Integer label ranges valid for the step: per label, the last dimension of the output it
    belongs to (a nest shaped as ``traced.label_spec``), or one range for every label.

    Each label gets its own output's range: a two-output model's second head with 3 classes
    got the first head's 5, and its loss refused labels of 3 and 4 (on a CPU; a GPU's gives
    NaN), so its kernels' scratch space went unmeasured. Labels matched to outputs by name
    (a dict) or by position (a list as long as the outputs); otherwise the smallest range,
    valid for every output."""
    try:
        outputs = list(traced.model.outputs)
    except Exception:  # noqa: BLE001 (subclassed models have no .outputs)
        return 2
    dims = [int(o.shape[-1]) if len(o.shape) and o.shape[-1] else 2 for o in outputs]
    if not dims:
        return 2
    smallest = min(dims)
    names = list(getattr(traced.model, "output_names", None) or [])
    labels = traced.label_spec[0] if traced.weighted else traced.label_spec
    if isinstance(labels, dict) and len(names) == len(dims):
        by_name = dict(zip(names, dims))
        ranges = {k: by_name.get(k, smallest) for k in labels}
    elif isinstance(labels, (list, tuple)) and len(labels) == len(dims):
        ranges = list(dims) if isinstance(labels, list) else tuple(dims)
    else:
        return dims[0] if len(dims) == 1 else smallest
    if traced.weighted:
        return (ranges, 2)  # (the sample weights are floats: any range)
    return ranges


def _random_like(spec, *, seed, labels=None):
    """Random values shaped as ``spec``; with ``labels`` (a class count, or a nest of counts
    over ``spec``'s top levels, as :func:`_num_classes` gives) values fit for labels."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)

    def make(s, classes=labels):
        shape = s.shape.as_list()
        if s.dtype.is_integer:
            return tf.constant(rng.integers(0, max(classes or 2, 1), size=shape), s.dtype)
        if s.dtype.is_bool:
            return tf.constant(rng.integers(0, 2, size=shape).astype(bool))
        if s.dtype == tf.string:  # raw text into a StringLookup or TextVectorization layer
            return tf.constant(rng.integers(0, 100, size=shape).astype(str).astype(object))
        if labels is not None and len(shape) >= 1:  # float labels: a one-hot-like target
            return tf.constant(rng.random(size=shape).astype(s.dtype.as_numpy_dtype))
        return tf.constant(rng.standard_normal(size=shape).astype(s.dtype.as_numpy_dtype))

    def fill(sub, n):
        # a range per label: each label's (possibly nested) spec with its own count
        if n is None or isinstance(n, int):
            return tf.nest.map_structure(lambda t: make(t, n), sub)
        if isinstance(n, dict):
            return {k: fill(v, n.get(k)) for k, v in sub.items()}
        filled = [fill(a, b) for a, b in zip(sub, n)]
        return filled if isinstance(sub, list) else tuple(filled)

    return fill(spec, labels)


def counted_bytes(nbytes: int, device: str = "CPU") -> int:
    """Bytes an allocation adds to ``get_memory_info``: rounded up to 256 bytes, and nothing
    for allocations the device's statistics leave out (:func:`untracked_below`)."""
    if nbytes <= 0:
        return 0
    if nbytes < untracked_below(device):
        return 0
    return -(-int(nbytes) // 256) * 256


def untracked_below(device: str = "CPU") -> int:
    """Allocations under this many bytes leave TensorFlow's statistics for ``device`` as they
    were: 256 KiB where TensorFlow's CPU allocator is oneDNN's (its pool for small allocations
    keeps no statistics), 0 for the BFC allocator (``TF_CPU_ALLOCATOR_USE_BFC=true``, which
    ``import tf_remat`` sets) and on a GPU. Which allocator TensorFlow made depends on the CPU
    and on the order of imports, so it is measured, once per process: a 64 KiB tensor is
    allocated and the statistics read."""
    if device != "CPU":
        return 0
    if device not in _UNTRACKED_BELOW:
        import tensorflow as tf

        try:
            with tf.device("CPU:0"):
                before = tf.config.experimental.get_memory_info("CPU:0")["current"]
                probe = tf.fill([16 * 1024], 1.0)  # held while the statistics are read
                after = tf.config.experimental.get_memory_info("CPU:0")["current"]
                probe = probe.shape  # frees the tensor
        except ValueError:  # no statistics at all: count everything (what the memory is)
            before, after = 0, 1
        _UNTRACKED_BELOW[device] = _ONEDNN_SMALL_POOL if after == before else 0
    return _UNTRACKED_BELOW[device]


def current_device_kind() -> str:
    """'GPU' when TensorFlow sees a GPU (the step runs there), else 'CPU'."""
    import tensorflow as tf

    return "GPU" if tf.config.list_logical_devices("GPU") else "CPU"


def onednn_enabled() -> bool | None:
    """Whether TensorFlow runs its oneDNN CPU kernels here (on by default only on some CPUs;
    ``TF_ENABLE_ONEDNN_OPTS`` decides). None when this TensorFlow does not say. Without them,
    its own convolution gradients take large scratch buffers (see :func:`measure_workspace`)."""
    try:
        from tensorflow.python.util import _pywrap_util_port
    except ImportError:  # pragma: no cover (a TensorFlow that moved it)
        return None
    return bool(_pywrap_util_port.IsMklEnabled())


#: see _matmul_conv_gradients: a filter gradient is a sum of ``patches^T @ dL/dy`` products over
#: slices of the batch, each patch matrix at most about this large. Smaller slices round better
#: in the allocator (a small step, skip_cnn at batch 32, measured 3-10% over what its kernels
#: requested with 2 MiB slices, up to 30% with 6 MiB ones), but each is a node: with 2 MiB
#: slices the held-out-style "noisy" model (320 nodes instead of 222) missed 60% of its peak,
#: which it met with 8 MiB ones
_PATCH_GRAD_BYTES = 8 << 20
#: ... in at most this many slices; a layer whose slices would be larger keeps TensorFlow's own
#: kernel (without oneDNN, ~27-31 MiB of scratch, small beside such a layer's own tensors)
_PATCH_GRAD_PIECES = 16


def _conv_geometry(op, x, w, y):
    """``(padding, (stride_h, stride_w))`` of a 2-D convolution op (``Conv2D``, or the
    ``Conv2DBackpropInput`` of a transposed convolution) that maps ``x`` by the kernel ``w`` to
    ``y``: NHWC, static shapes, no dilation, no groups, 'SAME' or 'VALID' padding, a floating
    dtype; None otherwise (such a layer keeps TensorFlow's gradient kernels)."""
    import tensorflow as tf

    strides = list(op.get_attr("strides"))
    padding = op.get_attr("padding").decode()
    if op.get_attr("data_format") != b"NHWC" or list(op.get_attr("dilations")) != [1, 1, 1, 1] \
            or strides[0] != 1 or strides[3] != 1 or padding not in ("SAME", "VALID"):
        return None
    if not all(t.shape.is_fully_defined() for t in (x, w, y)):
        return None
    if x.shape[-1] != w.shape[2] or x.dtype not in (tf.float32, tf.float16, tf.bfloat16,
                                                     tf.float64):
        return None
    return padding, (strides[1], strides[2])


def _plain_conv(op, grad):
    """``(x, w, padding, strides)`` of a ``Conv2D`` op that :func:`_conv_geometry` accepts."""
    x, w = op.inputs[0], op.inputs[1]
    geometry = _conv_geometry(op, x, w, grad)
    return None if geometry is None else (x, w, *geometry)


def _patch_filter_gradient(x, w, dy, padding, strides):
    """dL/dW of the convolution ``y = conv(x, w)`` as ``patches(x)^T @ dL/dy`` (None where
    that does not apply); ``w`` is the kernel or its shape.

    For a 1x1 stride-1 convolution the patches are ``x`` itself (a view); otherwise
    ``ExtractImagePatches`` builds them, exactly the bytes the product reads, for one slice of
    the batch at a time when the whole matrix is over ``_PATCH_GRAD_BYTES``: each slice's patches
    wait (a control edge) for the sum so far, so one slice's are live at a time in any order.
    Same sums as the convolution kernel's, in another order (float32 reassociation)."""
    import tensorflow as tf

    sh, sw = strides
    kh, kw, ci, co = w.shape.as_list() if hasattr(w, "shape") else list(w)
    n, ho, wo, _ = dy.shape.as_list()
    if kh == kw == 1 and sh == sw == 1:
        if x.shape.as_list()[:3] != [n, ho, wo]:
            return None
        dw = tf.linalg.matmul(tf.reshape(x, [n * ho * wo, ci]), tf.reshape(dy, [n * ho * wo, co]),
                              transpose_a=True)
        return tf.reshape(dw, [kh, kw, ci, co])
    sample = ho * wo * kh * kw * ci * x.dtype.size  # one sample's patch matrix
    per_piece = max(1, _PATCH_GRAD_BYTES // sample, -(-n // _PATCH_GRAD_PIECES))  # samples
    per_piece = min(per_piece, n)
    if per_piece * sample > _PATCH_GRAD_BYTES:
        return None
    pieces = -(-n // per_piece)
    bounds = [n * i // pieces for i in range(pieces + 1)]
    dw = None
    for lo, hi in zip(bounds, bounds[1:]):
        # after the output gradient exists (from x alone the executor, and the graph's
        # reference order, would build every layer's patches during the forward pass), and
        # after the previous slice's product
        with tf.control_dependencies([dy if dw is None else dw]):
            xs = x if pieces == 1 else x[lo:hi]
            patches = xs[:, ::sh, ::sw, :] if kh == kw == 1 else tf.image.extract_patches(
                xs, sizes=[1, kh, kw, 1], strides=[1, sh, sw, 1], rates=[1, 1, 1, 1],
                padding=padding)
        if patches.shape.as_list()[1:3] != [ho, wo]:
            return None
        rows = (hi - lo) * ho * wo
        part = tf.linalg.matmul(tf.reshape(patches, [rows, kh * kw * ci]),
                                tf.reshape(dy if pieces == 1 else dy[lo:hi], [rows, co]),
                                transpose_a=True)
        dw = part if dw is None else dw + part
    return tf.reshape(dw, [kh, kw, ci, co])


def _flipped_input_gradient(op, grad):
    """dL/dx of an NHWC ``Conv2D`` as a stride-1 convolution of dL/dy (for a strided layer,
    with s - 1 zeros between its entries) with the kernel flipped and its channels swapped, or
    for a 1x1 stride-1 kernel a matrix product (None where neither applies): without oneDNN,
    Conv2DBackpropInput takes scratch of up to ~24 MiB (3x3 and 1x1 layers, strided or not), the
    forward kernel and MatMul none.

    Per spatial axis the layer computes ``y[i] = sum_k x[i*s + k - p] w[k]`` (``p`` the padding
    before), so ``dx[j] = sum_k d[j + p - k] w[k]`` with ``d`` the dilated dL/dy: a correlation
    of ``d``, padded by ``K - 1 - p`` before, with the flipped kernel."""
    import tensorflow as tf

    conv = _plain_conv(op, grad)
    if conv is None:
        return None
    x, w, padding, (sh, sw) = conv
    kh, kw, ci, co = w.shape.as_list()
    n, h, wd, _ = x.shape.as_list()
    _, ho, wo, _ = grad.shape.as_list()
    if kh == kw == 1 and sh == sw == 1:
        dx = tf.linalg.matmul(tf.reshape(grad, [-1, co]), tf.reshape(w, [ci, co]),
                              transpose_b=True)
        return tf.reshape(dx, x.shape)
    d = grad
    if sh > 1 or sw > 1:  # zeros between the entries: (n, ho*sh, wo*sw, co)
        d = tf.reshape(grad, [n, ho, 1, wo, 1, co])
        d = tf.pad(d, [[0, 0], [0, 0], [0, sh - 1], [0, 0], [0, sw - 1], [0, 0]])
        d = tf.reshape(d, [n, ho * sh, wo * sw, co])
    pads = []
    for size, k, s_, o, length in ((h, kh, sh, ho, ho * sh), (wd, kw, sw, wo, wo * sw)):
        before = max((o - 1) * s_ + k - size, 0) // 2 if padding == "SAME" else 0
        lo = k - 1 - before
        hi = size + k - 1 - lo - length
        if lo < 0:
            return None
        pads.append((lo, hi))
    if pads[0][1] < 0 or pads[1][1] < 0:  # trailing entries no output reads
        d = d[:, :ho * sh + min(pads[0][1], 0), :wo * sw + min(pads[1][1], 0), :]
        pads = [(lo, max(hi, 0)) for lo, hi in pads]
    flipped = tf.transpose(tf.reverse(w, axis=[0, 1]), [0, 1, 3, 2])
    dx = tf.nn.conv2d(d, flipped, strides=1,
                      padding=[[0, 0], list(pads[0]), list(pads[1]), [0, 0]])
    return dx if dx.shape == x.shape else None


def _conv2d_gradient(op, grad):
    conv = _plain_conv(op, grad)
    dw = None if conv is None else _patch_filter_gradient(conv[0], conv[1], grad, *conv[2:])
    return _completed(op, grad, _flipped_input_gradient(op, grad), dw)


def _completed(op, grad, dx, dw):
    """``[dx, dw]`` of a convolution op, TensorFlow's gradient standing in for whichever of the
    two is None: the op it makes that nothing reads is dead, and TensorFlow (and extract)
    prune it."""
    if dw is None or dx is None:
        tf_dx, tf_dw = _TF_GRADS[op.type](op, grad)
        dx = tf_dx if dx is None else dx
        dw = tf_dw if dw is None else dw
    return [dx, dw]


def _conv2d_transpose_gradient(op, grad):
    """Gradients of a ``Conv2DBackpropInput`` run forward (a ``Conv2DTranspose`` layer), its
    kernel's as a patch product where that applies. Read as a convolution, the op maps a
    tensor shaped like its output (``grad``) by its kernel to its input, so the kernel's
    gradient is that convolution's filter gradient, ``patches(grad)^T @ input``: TensorFlow's
    is a Conv2DBackpropFilter (~15-30 MiB of scratch without oneDNN)."""
    import tensorflow as tf

    w, small = op.inputs[1], op.inputs[2]
    geometry = _conv_geometry(op, grad, w, small)
    dw = None if geometry is None else _patch_filter_gradient(grad, w, small, *geometry)
    if dw is None:
        return _TF_GRADS["Conv2DBackpropInput"](op, grad)
    padding, (sh, sw) = geometry
    # the input's gradient is TensorFlow's: the forward convolution, which takes no scratch
    return [None, dw, tf.nn.conv2d(grad, w, strides=[1, sh, sw, 1], padding=padding)]


def _plain_conv3d(op, grad):
    """``(x, w, padding, strides)`` of an NDHWC ``Conv3D`` op with static shapes, no dilation,
    'SAME' or 'VALID' padding and a floating dtype; None otherwise."""
    import tensorflow as tf

    x, w = op.inputs[0], op.inputs[1]
    strides = list(op.get_attr("strides"))
    padding = op.get_attr("padding").decode()
    if op.get_attr("data_format") != b"NDHWC" or list(op.get_attr("dilations")) != [1] * 5 \
            or strides[0] != 1 or strides[4] != 1 or padding not in ("SAME", "VALID"):
        return None
    if not all(t.shape.is_fully_defined() for t in (x, w, grad)):
        return None
    if x.shape[-1] != w.shape[3] or x.dtype not in (tf.float32, tf.float16, tf.bfloat16,
                                                     tf.float64):
        return None
    return x, w, padding, tuple(strides[1:4])


def _same_pads(size, k, s, out, padding):
    """(before, after) padding of one spatial axis, as TensorFlow pads it for ``padding``
    (after may be negative: trailing entries no output reads)."""
    before = max((out - 1) * s + k - size, 0) // 2 if padding == "SAME" else 0
    return before, (out - 1) * s + k - size - before


def _depthwise_split_filter_gradient(x, w, dy, padding, strides):
    """dL/dW of a ``Conv3D`` as one 2-D filter gradient (:func:`_patch_filter_gradient`) per
    depth tap of the kernel: ``y[:, t] = sum_k conv2d(x[:, t*s + k - p], w[k])``, so ``dL/dw[k]``
    is the 2-D filter gradient of the frames tap ``k`` reads (the output's frames folded into
    the batch) against dL/dy. One tap's frames (a copy the size of ``x``) and one slice's
    patches are live at a time. None where that does not apply."""
    import tensorflow as tf

    sd, sh, sw = strides
    kd, kh, kw, ci, co = w.shape.as_list()
    n, d, h, wd, _ = x.shape.as_list()
    _, do, ho, wo, _ = dy.shape.as_list()
    before, after = _same_pads(d, kd, sd, do, padding)
    with tf.control_dependencies([dy]):
        xp = x if before == after == 0 else tf.pad(
            x[:, :d + min(after, 0)], [[0, 0], [before, max(after, 0)], [0, 0], [0, 0], [0, 0]])
    dy2 = tf.reshape(dy, [n * do, ho, wo, co])
    taps = []
    for k in range(kd):
        with tf.control_dependencies([dy if not taps else taps[-1]]):
            frames = xp if (kd, sd, do) == (1, 1, xp.shape[1]) else \
                xp[:, k:k + (do - 1) * sd + 1:sd]
            frames = tf.reshape(frames, [n * do, h, wd, ci])
        tap = _patch_filter_gradient(frames, (kh, kw, ci, co), dy2, padding, (sh, sw))
        if tap is None:
            return None
        taps.append(tap)
    return tf.stack(taps)


def _flipped_input_gradient3d(x, w, grad, padding, strides):
    """dL/dx of a ``Conv3D`` as a stride-1 ``Conv3D`` of dL/dy (zeros between its entries for a
    strided layer, padded by ``K - 1 - p`` before) with the kernel flipped and its channels
    swapped, as :func:`_flipped_input_gradient` does in two dimensions: without oneDNN,
    Conv3DBackpropInputV2 takes scratch of many times its output (263 MiB for a 3x3x3 layer of
    8x6x32x32x32), the forward kernel none. None where that does not apply."""
    import tensorflow as tf

    kd, kh, kw = w.shape.as_list()[:3]
    sizes, outs = x.shape.as_list()[1:4], grad.shape.as_list()[1:4]
    d = grad
    for axis, s in enumerate(strides, start=1):  # zeros between the entries, an axis at a time
        if s > 1:  # (Pad takes at most six dimensions)
            shape = d.shape.as_list()
            pads = [[0, 0]] * (len(shape) + 1)
            pads[axis + 1] = [0, s - 1]
            shape[axis] *= s
            d = tf.reshape(tf.pad(tf.expand_dims(d, axis + 1), pads), shape)
    pads, keep = [], []
    for size, k, s, o in zip(sizes, (kd, kh, kw), strides, outs):
        lo = k - 1 - _same_pads(size, k, s, o, padding)[0]
        hi = size + k - 1 - lo - o * s
        if lo < 0:
            return None
        pads.append([lo, max(hi, 0)])
        keep.append(o * s + min(hi, 0))
    if keep != [o * s for o, s in zip(outs, strides)]:
        d = d[:, :keep[0], :keep[1], :keep[2]]
    d = tf.pad(d, [[0, 0], *pads, [0, 0]])
    flipped = tf.transpose(tf.reverse(w, axis=[0, 1, 2]), [0, 1, 2, 4, 3])
    dx = tf.nn.conv3d(d, flipped, strides=[1] * 5, padding="VALID")
    return dx if dx.shape == x.shape else None


#: (shapes, strides, padding, dtype) -> whether the products took less memory than TensorFlow's
#: Conv3D backprop kernels, measured once per process (see _conv3d_products_smaller)
_CONV3D_CHOICE = {}


def _peaks_on_zeros(fns, shapes, dtype, device) -> list | None:
    """Each of ``fns``, called on zeros of ``shapes``, run once to build it and once measured:
    the allocator's peak over what it held before, per function; None where one fails (a
    kernel missing for the dtype). Eager, even while a step is being traced."""
    import tensorflow as tf

    peaks = []
    with tf.init_scope():
        try:
            args = [tf.zeros(k, dtype) for k in shapes]
            for fn in fns:
                _ = [t.numpy() for t in tf.nest.flatten(fn(*args))]  # built, Grappler run
                tf.config.experimental.reset_memory_stats(device)
                before = tf.config.experimental.get_memory_info(device)["current"]
                _ = [t.numpy() for t in tf.nest.flatten(fn(*args))]
                peaks.append(tf.config.experimental.get_memory_info(device)["peak"] - before)
                del _
        except (tf.errors.OpError, ValueError, TypeError, AttributeError):  # (None returned)
            return None
    return peaks


def _conv3d_products_smaller(x, w, dy, padding, strides, filter_only=False) -> bool:
    """Whether a ``Conv3D``'s gradients as products (:func:`_depthwise_split_filter_gradient`,
    :func:`_flipped_input_gradient3d`) peak lower than TensorFlow's backprop kernels, run once
    each on zeros of the layer's shapes with the CPU allocator's statistics.

    Neither always wins, and no formula tells which: TensorFlow's kernels took 263 MiB of
    scratch for a 3x3x3 layer of 8x6x32x32x32 and under 1 MiB for one of 8x8x32x32x16, where
    the products' slices of up to 8 MiB and their padded copies cost more. Without statistics
    (another allocator) the products are taken where one sample's im2col matrix is over 32 MiB;
    so they are, unmeasured, where the batch's would be over 256 MiB (the kernels' scratch,
    when they take it, was 1.5 times that: trying them could exhaust the memory the step is
    being planned to save). ``filter_only`` compares the filter gradients alone (a
    ``Conv3DTranspose`` layer's, whose input gradient is a forward ``Conv3D`` either way).
    """
    import numpy as np
    import tensorflow as tf

    key = (tuple(x.shape.as_list()), tuple(w.shape.as_list()), tuple(dy.shape.as_list()),
           padding, strides, x.dtype.name, filter_only)
    if key in _CONV3D_CHOICE:
        return _CONV3D_CHOICE[key]
    device = "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"
    kd, kh, kw, ci, _ = key[1]
    im2col = int(np.prod(key[2][1:4])) * kd * kh * kw * ci * x.dtype.size  # one sample's
    if memory_stats_missing(device) or im2col * key[2][0] > (256 << 20):
        choice = im2col > (32 << 20) or im2col * key[2][0] > (256 << 20)
        _CONV3D_CHOICE[key] = choice
        return choice
    xs, ws, ys = (tf.TensorSpec(k, x.dtype) for k in key[:3])

    @tf.function(input_signature=[xs, ws, ys], autograph=False)
    def kernels(a, b, d):
        s = [1, *strides, 1]
        dw = tf.raw_ops.Conv3DBackpropFilterV2(input=a, filter_sizes=key[1], out_backprop=d,
                                               strides=s, padding=padding)
        if filter_only:
            return (dw,)
        return (tf.raw_ops.Conv3DBackpropInputV2(input_sizes=key[0], filter=b, out_backprop=d,
                                                 strides=s, padding=padding), dw)

    @tf.function(input_signature=[xs, ws, ys], autograph=False)
    def products(a, b, d):
        dx = None if filter_only else _flipped_input_gradient3d(a, b, d, padding, strides)
        with tf.control_dependencies([dx] if dx is not None else []):
            dw = _depthwise_split_filter_gradient(a, b, d, padding, strides)
        return (dx if dx is not None else tf.zeros(()),
                dw if dw is not None else tf.zeros(()))

    # a kernel missing for the dtype: TensorFlow's gradient, what Keras's step runs
    peaks = _peaks_on_zeros((kernels, products), key[:3], x.dtype, device) or [0, 1]
    choice = peaks[1] < peaks[0]
    _CONV3D_CHOICE[key] = choice
    return choice


def _conv3d_gradient(op, grad):
    """Gradients of a ``Conv3D`` without TensorFlow's CPU backprop kernels where that applies
    (:func:`_depthwise_split_filter_gradient`, :func:`_flipped_input_gradient3d`) and takes less
    memory (:func:`_conv3d_products_smaller`)."""
    conv = _plain_conv3d(op, grad)
    dx = dw = None
    if conv is not None and _conv3d_products_smaller(*conv[:2], grad, *conv[2:]):
        x, w, padding, strides = conv
        dw = _depthwise_split_filter_gradient(x, w, grad, padding, strides)
        dx = _flipped_input_gradient3d(x, w, grad, padding, strides)
    return _completed(op, grad, dx, dw)


def _conv3d_transpose_gradient(op, grad):
    """Gradients of a ``Conv3DBackpropInputV2`` run forward (a ``Conv3DTranspose`` layer), its
    kernel's as products where that takes less memory, as :func:`_conv2d_transpose_gradient`
    does in two dimensions: read as a convolution, the op maps a tensor shaped like its output
    (``grad``) by its kernel to its input, so the kernel's gradient is that convolution's
    filter gradient (:func:`_depthwise_split_filter_gradient`)."""
    import tensorflow as tf

    w, small = op.inputs[1], op.inputs[2]
    strides = list(op.get_attr("strides"))
    padding = op.get_attr("padding").decode()
    dw = None
    if op.get_attr("data_format") == b"NDHWC" and list(op.get_attr("dilations")) == [1] * 5 \
            and strides[0] == strides[4] == 1 and padding in ("SAME", "VALID") \
            and all(t.shape.is_fully_defined() for t in (w, small, grad)) \
            and grad.dtype in (tf.float32, tf.float16, tf.bfloat16, tf.float64) \
            and grad.shape[-1] == w.shape[3] and small.shape[-1] == w.shape[4] \
            and _conv3d_products_smaller(grad, w, small, padding, tuple(strides[1:4]),
                                         filter_only=True):
        dw = _depthwise_split_filter_gradient(grad, w, small, padding, tuple(strides[1:4]))
    if dw is None:
        return _TF_GRADS["Conv3DBackpropInputV2"](op, grad)
    # the input's gradient is TensorFlow's: the forward convolution
    return [None, dw, tf.nn.conv3d(grad, w, strides=strides, padding=padding)]


#: TensorFlow's registered gradient functions, while _matmul_conv_gradients has them swapped
_TF_GRADS = {}
_OWN_GRADS = {"Conv2D": _conv2d_gradient, "Conv2DBackpropInput": _conv2d_transpose_gradient,
              "Conv3D": _conv3d_gradient, "Conv3DBackpropInputV2": _conv3d_transpose_gradient}


@contextlib.contextmanager
def _matmul_conv_gradients(enabled: bool):
    """While tracing a step's gradients, compute convolution gradients without TensorFlow's CPU
    backprop kernels where they apply when ``enabled``: ``Conv2D``'s (:func:`_conv2d_gradient`)
    and the kernel gradient of a ``Conv2DTranspose`` layer's ``Conv2DBackpropInput``
    (:func:`_conv2d_transpose_gradient`).

    Without oneDNN, TensorFlow's Conv2DBackpropFilter allocates an im2col buffer sized to a 30 MB
    working set whatever the layer (27 MiB for a 3x3 layer of 8x16x16x128), and
    Conv2DBackpropInput up to ~24 MiB; a rewritten step's peak can never drop below the largest
    such buffer plus what is live beside it. A filter gradient's patch matrix, taken a slice of
    the batch at a time, is at most 8 MiB (for a 1x1 layer it is the input itself); the forward
    kernel and MatMul take none (a strided layer's input gradient pads its output gradient
    with zeros: stride**2 times that gradient, in place of ~20 MiB). DenseNet121's largest
    scratch went from 27 to 2 MiB and the smallest budget any plan reaches from 84 to 66 MiB.
    The gradient registry entries are swapped for the trace and restored after.
    """
    if not enabled:
        yield
        return
    from tensorflow.python.framework import ops as tf_ops

    registry = tf_ops._gradient_registry._registry  # noqa: SLF001
    entries = {name: registry[name] for name in _OWN_GRADS if name in registry}
    for name, entry in entries.items():
        _TF_GRADS[name] = entry["type"]
        registry[name] = dict(entry, type=_OWN_GRADS[name])
    try:
        yield
    finally:
        registry.update(entries)


@contextlib.contextmanager
def _phased_transposed_convs(enabled: bool):
    """While tracing a step, run a ``Conv2DTranspose`` or ``Conv3DTranspose`` layer's forward
    op (a ``Conv2DBackpropInput`` or ``Conv3DBackpropInputV2``) as the convolution of
    :func:`_phase_transposed_conv` where it applies and peaks lower (:func:`_phases_lighter`),
    when ``enabled``: without oneDNN the 2-D kernel takes up to ~24 MiB of scratch whatever
    the layer's size (a decoder of 1 MiB activations at batch 8 could go no lower than 23 MiB,
    the scratch and the layer's inputs), and the 3-D one 264 MiB for a layer whose output is
    8 MiB. Its gradients are then those of the ops it is made of
    (:func:`_matmul_conv_gradients` turns the convolution's into products). TensorFlow's own
    gradient code calls the same functions (a convolution's input gradient, where
    :func:`_flipped_input_gradient` and its 3-D form do not apply); where this form does not
    apply either, TensorFlow's op is made as before.
    """
    if not enabled:
        yield
        return
    from tensorflow.python.ops import gen_nn_ops

    def phased(original):
        signature = inspect.signature(original)

        def call(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments  # (explicit paddings: 'EXPLICIT', which is refused)
            out = _phase_backprop_input(a["input_sizes"], a["filter"], a["out_backprop"],
                                        a["strides"], a["padding"], a["data_format"],
                                        a["dilations"])
            return original(*args, **kwargs) if out is None else out
        return call

    originals = (gen_nn_ops.conv2d_backprop_input, gen_nn_ops.conv3d_backprop_input_v2)
    gen_nn_ops.conv2d_backprop_input, gen_nn_ops.conv3d_backprop_input_v2 = map(phased,
                                                                                originals)
    try:
        yield
    finally:
        gen_nn_ops.conv2d_backprop_input, gen_nn_ops.conv3d_backprop_input_v2 = originals


def _phase_backprop_input(input_sizes, w, grad, strides, padding, data_format, dilations):
    """:func:`_phase_transposed_conv` for the arguments of ``Conv2DBackpropInput`` or
    ``Conv3DBackpropInputV2``, or None where they are not what it takes (static shapes,
    channels last, no dilation, 'SAME' or 'VALID', a floating dtype)."""
    import tensorflow as tf

    padding = padding.decode() if isinstance(padding, bytes) else str(padding)
    data_format = data_format.decode() if isinstance(data_format, bytes) else str(data_format)
    strides = list(strides)
    rank = len(strides)
    if data_format != {4: "NHWC", 5: "NDHWC"}.get(rank) or list(dilations) != [1] * rank \
            or padding not in ("SAME", "VALID") or strides[0] != 1 or strides[-1] != 1:
        return None
    try:
        w, grad = tf.convert_to_tensor(w), tf.convert_to_tensor(grad)
    except (TypeError, ValueError):
        return None
    size = tf.get_static_value(input_sizes)
    if size is None or len(size) != rank or not (w.shape.is_fully_defined() and
                                                 grad.shape.is_fully_defined()):
        return None
    if w.dtype not in (tf.float32, tf.float16, tf.bfloat16, tf.float64) or \
            grad.dtype != w.dtype or w.shape.rank != rank or grad.shape.rank != rank or \
            int(size[-1]) != w.shape[-2] or grad.shape[-1] != w.shape[-1]:
        return None
    size, strides = [int(d) for d in size], tuple(strides[1:-1])
    if not _phases_lighter(size, w, grad, padding, strides):
        return None
    return _phase_transposed_conv(size, w, grad, padding, strides)


_PHASES_CHOICE = {}


def _phases_lighter(x_shape, w, grad, padding, strides) -> bool:
    """Whether :func:`_phase_transposed_conv` peaks lower than TensorFlow's Conv2DBackpropInput
    (Conv3DBackpropInputV2) for these shapes, each run once on zeros with the CPU allocator's
    statistics. The 2-D kernel's scratch does not grow with the layer (~20 MiB for a small
    U-Net's layers at batch 8), the 3-D one's was 33 times the output at batch 8 and none at
    batch 4, and the phase form holds its output twice while it interleaves it: on a decoder
    whose layers' outputs are 8 MiB and whose kernels took 4 MiB, taking the phases everywhere
    raised the no-rematerialization peak by 26%. Memory alone decides, though the 3-D kernel
    that takes no scratch ran 35 to 70 times slower than the phase form (712 ms against 10 for
    a 3x3x3 stride-2 layer whose output is 4x16x32x32x16): taking the faster form up to two
    outputs heavier made a small 3-D U-Net's rewritten step 3.5 times faster, but refused a
    smaller one's budget that the kernel's graph met (3.85 MiB: its best plan measured 4.0, the
    kernel's 3.5), and the form is chosen here, before the budget is known. No statistics
    (another allocator): TensorFlow's kernel."""
    import tensorflow as tf

    key = (tuple(x_shape), tuple(w.shape.as_list()), tuple(grad.shape.as_list()), padding,
           tuple(strides), w.dtype.name)
    if key in _PHASES_CHOICE:
        return _PHASES_CHOICE[key]
    if memory_stats_missing("CPU:0"):
        _PHASES_CHOICE[key] = False
        return False
    op = tf.raw_ops.Conv2DBackpropInput if len(x_shape) == 4 else \
        tf.raw_ops.Conv3DBackpropInputV2
    ws, gs = tf.TensorSpec(key[1], w.dtype), tf.TensorSpec(key[2], w.dtype)
    kernel = tf.function(lambda a, b: op(
        input_sizes=list(x_shape), filter=a, out_backprop=b, strides=[1, *strides, 1],
        padding=padding), input_signature=[ws, gs], autograph=False)
    phases = tf.function(lambda a, b: _phase_transposed_conv(x_shape, a, b, padding, strides),
                         input_signature=[ws, gs], autograph=False)
    # where one fails: TensorFlow's kernel, what Keras's step runs
    peaks = _peaks_on_zeros((kernel, phases), key[1:3], w.dtype, "CPU:0") or [0, 1]
    _PHASES_CHOICE[key] = peaks[1] < peaks[0]
    return _PHASES_CHOICE[key]


def _phase_taps(size: int, out: int, k: int, s: int, padding: str) -> list:
    """Per output phase ``r`` of one spatial axis of a transposed convolution (the rows
    ``s*q + r`` of its output, ``size`` long, from an input ``out`` long, kernel ``k``, stride
    ``s``): ``(k0, m, a, q)``: the taps ``k0 + s*i`` (``i < m``) reach those rows, output row
    ``q' < q`` reads input rows ``q' + a + i'`` by the taps in reverse."""
    before = max((out - 1) * s + k - size, 0) // 2 if padding == "SAME" else 0
    taps = []
    for r in range(s):
        k0 = (r + before) % s
        m = 0 if k0 >= k else (k - 1 - k0) // s + 1
        taps.append((k0, m, (r + before - k0) // s - m + 1, -(-(size - r) // s)))
    return taps


def _phase_transposed_conv(x_shape, w, grad, padding, strides):
    """What ``Conv2DBackpropInput(x_shape, w, grad)`` (``Conv3DBackpropInputV2``, for 3-D
    shapes) computes, as one stride-1 convolution of ``grad`` whose output channels are the
    ``prod(strides)`` phases of the output (for each, the kernel's taps that reach it, reversed,
    placed in a window all phases share), interleaved ("sub-pixel" form). It takes no scratch
    and reads ``grad`` once, so the backward pass keeps one copy of it (separate convolutions
    per phase kept ``s**2`` padded copies: a U-Net's no-rematerialization peak 26% higher). The
    zeros in the shared window cost multiplications: 1.8x TensorFlow's kernel's for a 3x3 kernel
    of stride 2 (the zero-dilated form of :func:`_flipped_input_gradient`, 4x). 'VALID' on a
    padded copy, so its gradients are products too (:func:`_conv_geometry` takes no explicit
    padding)."""
    import itertools

    import tensorflow as tf

    n, *sizes, ci = x_shape
    nd = len(sizes)
    co = w.shape[-1]
    outs = grad.shape.as_list()[1:-1]
    qs = [-(-size // s) for size, s in zip(sizes, strides)]
    phases = [_phase_taps(size, o, k, s, padding)
              for size, o, k, s in zip(sizes, outs, w.shape.as_list()[:nd], strides)]

    def window(taps):  # (first input row read, rows read) over the phases any tap reaches
        live = [(a, m) for _, m, a, _ in taps if m]
        lo = min(a for a, _ in live)
        return lo, max(a + m for a, m in live) - lo

    windows = [window(taps) for taps in phases]
    blocks = []
    for combo in itertools.product(*phases):
        if any(m == 0 for _, m, _, _ in combo):  # no tap reaches these rows
            blocks.append(tf.zeros([length for _, length in windows] + [co, ci], w.dtype))
            continue
        taps = w[tuple(slice(k0, None, s) for (k0, _, _, _), s in zip(combo, strides))]
        taps = tf.transpose(tf.reverse(taps, axis=list(range(nd))),
                            [*range(nd), nd + 1, nd])
        blocks.append(tf.pad(taps, [[a - lo, length - (a - lo) - m] for (_, m, a, _), (
            lo, length) in zip(combo, windows)] + [[0, 0], [0, 0]]))
    kernel = blocks[0] if len(blocks) == 1 else tf.concat(blocks, axis=nd + 1)
    pads = [[max(0, -lo), max(0, q + lo + length - 1 - o)]
            for (lo, length), q, o in zip(windows, qs, outs)]
    g = tf.pad(grad, [[0, 0], *pads, [0, 0]]) if any(map(any, pads)) else grad
    starts = [lo + before for (lo, _), (before, _) in zip(windows, pads)]
    spans = [q + length - 1 for q, (_, length) in zip(qs, windows)]
    if any(starts) or g.shape.as_list()[1:-1] != spans:
        g = g[(slice(None), *(slice(a, a + m) for a, m in zip(starts, spans)))]
    conv = tf.nn.conv2d if nd == 2 else tf.nn.conv3d
    out = conv(g, kernel, strides=[1] * (nd + 2), padding="VALID")  # (n, *qs, prod(s) * ci)
    if any(s > 1 for s in strides):  # each axis's phases after its rows
        out = tf.transpose(tf.reshape(out, [n, *qs, *strides, ci]),
                           [0, *(j for i in range(nd) for j in (1 + i, 1 + nd + i)),
                            1 + 2 * nd])
    full = [q * s for q, s in zip(qs, strides)]
    out = tf.reshape(out, [n, *full, ci])
    if full != sizes:
        out = out[(slice(None), *(slice(0, size) for size in sizes))]
    return out if out.shape.as_list() == list(x_shape) else None


#: element-wise ops that broadcast their two inputs (inputs named x and y in tf.raw_ops)
_BROADCASTING = frozenset({"Mul", "AddV2", "Add", "Sub", "RealDiv", "Div", "SquaredDifference",
                           "Maximum", "Minimum"})
#: ... and those that may run on a broadcast value's small form when the other input is a scalar
_SCALAR_SAFE = frozenset({"Mul", "AddV2", "Add", "Sub", "RealDiv", "Div"})


def _sink_broadcasts(graph, first_id: int, grads: list) -> list:
    """Stop the backward pass from materializing broadcasts of small values.

    The gradient of a reduction over axes (a BatchNorm's ``reduce_mean`` over batch and space,
    twice: mean and variance) is ``Tile``: a per-channel vector copied to the activation's full
    shape, then divided by the count, scaled, and multiplied into or added to full-size
    gradients, each step a full-size tensor. Element-wise ops commute with broadcasting, so
    here the scalar arithmetic runs on the small value and the full-size readers that
    broadcast (``Mul``, ``AddV2``, ...) read it directly; an ``AddN`` that sums it with
    full-size gradients becomes ``AddN`` of those plus the small value. A reader that needs
    the full tensor keeps the original ops. The dead full-size ops are then pruned with the
    rest (bn_cnn at batch 128: a BatchNorm gradient's node and its inputs went from four
    activations, 64 MiB, to three, and the smallest budget any plan reaches from 75 to 70 MiB,
    now set by a filter gradient's scratch). Values are unchanged (the same element-wise ops
    on the same numbers).

    Runs inside the traced function, on the ops created after ``first_id`` (the backward
    pass); returns ``grads`` with any gradient that was such a sum replaced.
    """
    import tensorflow as tf

    def static(t):
        shape = t.shape
        return tuple(shape.as_list()) if shape.is_fully_defined() else None

    def scalar(t):
        s = static(t)
        return s is not None and all(d == 1 for d in s)

    def key(t):
        return (t.op.name, t.value_index)

    ops = [op for op in graph.get_operations() if op._id > first_id]  # noqa: SLF001
    small = {}  # a full-size tensor's key -> (the tensor, its small form)
    for op in ops:
        if len(op.outputs) != 1 or not op.outputs[0].dtype.is_floating:
            continue
        out = op.outputs[0]
        full = static(out)
        if full is None:
            continue
        if op.type == "Tile":
            s = static(op.inputs[0])
            if s is not None and len(s) == len(full) and s != full and all(
                    a in (1, b) for a, b in zip(s, full)):
                small[key(out)] = (out, op.inputs[0])
            continue
        ins = list(op.inputs)
        if op.type not in _SCALAR_SAFE or not any(key(t) in small for t in ins) or len(ins) != 2:
            continue
        # a scalar on one side: the small form is the same op on the small value
        args = [small[key(t)][1] if key(t) in small else t for t in ins]
        if all(key(t) in small or scalar(t) for t in ins) and \
                not all(scalar(t) for t in args):
            small[key(out)] = (out, getattr(tf.raw_ops, op.type)(
                x=args[0], y=args[1], name=f"{op.name}_small"))
    if not small:
        return grads
    replaced, summed = {}, set()
    for full_out, little in list(small.values()):
        full = static(full_out)
        for c in list(full_out.consumers()):
            if c.outputs and key(c.outputs[0]) in small:
                continue  # runs on the small form itself
            ins = list(c.inputs)
            if c.type in _BROADCASTING and len(ins) == 2:
                k = next(i for i, t in enumerate(ins) if key(t) == key(full_out))
                other = ins[1 - k]
                if key(other) != key(full_out) and static(other) == full:
                    # a new reader (TensorFlow checks an edge's shapes, so the old one cannot
                    # take the small form), ordered as the old one
                    args = [little if i == k else t for i, t in enumerate(ins)]
                    with tf.control_dependencies(c.control_inputs):
                        new = getattr(tf.raw_ops, c.type)(x=args[0], y=args[1],
                                                          name=f"{c.name}_bcast")
                    _redirect(c.outputs[0], new)
                    replaced[key(c.outputs[0])] = new
            elif c.type == "AddN" and c.name not in summed:
                summed.add(c.name)
                fulls = [t for t in ins if key(t) not in small]
                smalls = [small[key(t)][1] for t in ins if key(t) in small]
                if not fulls or any(static(t) != full for t in fulls):
                    continue
                total = fulls[0] if len(fulls) == 1 else tf.raw_ops.AddN(
                    inputs=fulls, name=f"{c.name}_full")
                for t in smalls:
                    total = tf.raw_ops.AddV2(x=total, y=t, name=f"{c.name}_bcast")
                _redirect(c.outputs[0], total)
                replaced[key(c.outputs[0])] = total
    # ordering edges the gradient code put on a full-size value (``with
    # control_dependencies([grad])``) would keep it alive: they wait for its small form
    for full_out, little in small.values():
        _reorder_after(full_out.op, little.op)
    return [replaced.get(key(g), g) if isinstance(g, tf.Tensor) else g for g in grads]


#: an ``AddN`` of at least this many terms of at least _CHAIN_MIN_BYTES each is summed in a chain
#: of additions named with CHAIN_SUM. Not three: the sums of three (a BatchNorm gradient's
#: paths, a residual input's) left every held-out model's smallest reachable peak as it was,
#: and moved its reference order's peak by up to +7% (noisy: 114.5 -> 122.6 MiB)
CHAIN_SUM = "_remat_sum"
_CHAIN_MIN_TERMS = 4
_CHAIN_MIN_BYTES = 1 << 20


def _chain_sums(graph, first_id: int, grads: list) -> list:
    """Sum the backward pass's large ``AddN``s one term at a time.

    A value read by k ops gets k gradients, which the tape sums in one ``AddN`` once the last
    exists, so all k are held at once: a static ``TimeDistributed`` slices its input once per
    frame, and each slice's gradient (``StridedSliceGrad``) is the whole input's size
    (``tools/bench_heldout.py``'s ``timedist``, 8 frames: no plan could go under 100.2 MiB;
    chained, 41.7). As a chain of ``AddV2`` in the ``AddN``'s own input order, each term can
    be freed once added, and the solver decides when each is computed. Up to nine terms the
    values are TensorFlow's CPU ``AddN``'s bit for bit (it adds left to right too); with more,
    it adds in groups of eight, and the two differ in float32 rounding.

    Runs inside the traced function, on the ops created after ``first_id``; returns ``grads``
    with any gradient that was such a sum replaced.
    """
    import tensorflow as tf

    replaced = {}
    for op in [o for o in graph.get_operations() if o._id > first_id]:  # noqa: SLF001
        if op.type != "AddN" or len(op.inputs) < _CHAIN_MIN_TERMS:
            continue
        out = op.outputs[0]
        if not out.dtype.is_floating or not out.shape.is_fully_defined() or \
                tensor_bytes(out) < _CHAIN_MIN_BYTES or \
                any(t.shape != out.shape for t in op.inputs):
            continue
        terms = list(op.inputs)
        with tf.control_dependencies(op.control_inputs):
            total = tf.raw_ops.AddV2(x=terms[0], y=terms[1], name=f"{op.name}{CHAIN_SUM}")
        for t in terms[2:]:
            total = tf.raw_ops.AddV2(x=total, y=t, name=f"{op.name}{CHAIN_SUM}")
        _redirect(out, total)
        replaced[(out.op.name, out.value_index)] = total
    if not replaced:
        return grads
    return [replaced.get((g.op.name, g.value_index), g) if isinstance(g, tf.Tensor) else g
            for g in grads]


def _redirect(old, new) -> None:
    """Every reader of tensor ``old`` (and every op ordered after its op) reads ``new``."""
    for c in list(old.consumers()):
        if c is new.op:
            continue
        for k, t in enumerate(c.inputs):
            if (t.op.name, t.value_index) == (old.op.name, old.value_index):
                c._update_input(k, new)  # noqa: SLF001
    _reorder_after(old.op, new.op)


def _reorder_after(old_op, new_op) -> None:
    """Every op with a control input on ``old_op`` waits for ``new_op`` instead."""
    for c in list(old_op._control_outputs):  # noqa: SLF001
        deps = [new_op if d.name == old_op.name else d for d in c.control_inputs]
        c._remove_all_control_inputs()  # noqa: SLF001
        c._add_control_inputs(deps)  # noqa: SLF001


def conv_gradients_mode() -> str:
    """How :func:`trace_training_step` computes ``Conv2D`` gradients: ``"matmul"`` (filter
    gradients as patch-matrix products, input gradients as flipped convolutions or products, where
    they apply; see :func:`_matmul_conv_gradients`) or ``"tensorflow"`` (its own kernels).

    ``TF_REMAT_CONV_GRADIENTS`` decides when set to either; otherwise ``"matmul"`` on a CPU where
    oneDNN is off (whose kernels take no such scratch), ``"tensorflow"`` elsewhere.
    """
    mode = os.environ.get("TF_REMAT_CONV_GRADIENTS", "").strip().lower()
    if mode in ("matmul", "tensorflow"):
        return mode
    if mode not in ("", "auto"):
        raise ValueError(f"TF_REMAT_CONV_GRADIENTS={mode!r}: use 'matmul', 'tensorflow' or 'auto'")
    return "matmul" if current_device_kind() == "CPU" and onednn_enabled() is False \
        else "tensorflow"


def tensor_bytes(t) -> int:
    """Bytes of a statically shaped tensor (0 for resources, variants, strings)."""
    import tensorflow as tf

    if t.dtype in (tf.resource, tf.variant, tf.string):
        return 0
    n = t.shape.num_elements()
    return 0 if n is None else int(n) * t.dtype.size


def _static_int(t):
    """A scalar int tensor's value when the graph fixes it (through ``Identity`` and the
    ``Max`` over no axes that ``tf.while_loop`` wraps ``maximum_iterations`` in), else None."""
    import numpy as np
    import tensorflow as tf

    for _ in range(8):
        v = tf.get_static_value(t)
        if v is not None:
            return int(v) if np.ndim(v) == 0 else None
        if t.op.type in ("Identity", "Max") and t.op.inputs:
            if t.op.type == "Max" and tf.get_static_value(t.op.inputs[1]) is None:
                return None
            t = t.op.inputs[0]
            continue
        return None
    return None


def loop_list_bytes(op) -> dict:
    """``{output index: bytes}`` for the TensorLists a ``tf.while_loop`` op fills, where the
    graph fixes their size.

    A TensorList is a variant tensor with no static size, but what it holds is known: a
    gradient accumulator (an ``EmptyTensorList`` the body pushes one tensor to per iteration)
    holds the trip count (``maximum_iterations``) times that tensor; a ``TensorListReserve``
    (an RNN's output sequence) its element shape times its length. A pushed tensor that is a
    variable read, an item of another list or a value the loop passes through unchanged shares
    a buffer held anyway and counts nothing; so does a tensor another list keeps already (an
    RNN keeps its state in its output sequence and, for the gradient, both as the step's
    result and as the next step's input)."""
    import numpy as np
    import tensorflow as tf

    if op.type not in ("While", "StatelessWhile"):
        return {}
    variants = [k for k, t in enumerate(op.outputs) if t.dtype == tf.variant]
    if not variants:
        return {}
    try:
        body = _loop_function(op, "body")
    except Exception:  # noqa: BLE001 (no function body to read: leave the lists unsized)
        return {}
    if len(body.outputs) != len(op.outputs) or len(body.inputs) < len(op.outputs):
        return {}
    trip = _static_int(op.inputs[1]) if len(op.inputs) > 1 else None

    def source(t):
        while t.op.type == "Identity" and t.op.inputs:
            t = t.op.inputs[0]
        return t

    invariant = {id(body.inputs[i]) for i in range(len(op.outputs))
                 if source(body.outputs[i]) is body.inputs[i]}
    carried = {id(body.inputs[i]): source(body.outputs[i]) for i in range(len(op.outputs))}

    def buffer(e):
        """The body tensor whose buffer a kept element is: a loop-carried input is the value
        the previous iteration passed on (an RNN keeps its state both ways, and in its output
        sequence too: one buffer, counted once)."""
        e = source(e)
        return carried.get(id(e), e) if id(e) not in invariant else e

    sizes, counted = {}, set()
    for k in variants:
        init = op.inputs[k].op
        if id(body.inputs[k]) in invariant:
            sizes[k] = 0  # the list the loop reads (an RNN's input sequence) is its input's
            continue
        write = source(body.outputs[k]).op
        if write.type not in ("TensorListPushBack", "TensorListSetItem"):
            continue
        e = source(write.inputs[-1])
        if e.op.type in ("ReadVariableOp", "TensorListGetItem") or id(e) in invariant:
            sizes[k] = 0  # shares the buffer of a weight or of another list's item
            continue
        if init.type == "TensorListReserve" and write.type == "TensorListSetItem":
            shape = tf.get_static_value(init.inputs[0])
            n = _static_int(init.inputs[1])
            if shape is None or n is None or np.ndim(shape) != 1 or any(d < 0 for d in shape):
                continue
            each = int(np.prod(shape)) * init.get_attr("element_dtype").size
        elif init.type == "EmptyTensorList" and write.type == "TensorListPushBack" and \
                trip is not None and trip >= 0:
            n, each = trip, tensor_bytes(e)
        else:
            continue
        key = id(buffer(e))
        sizes[k] = 0 if key in counted else int(n) * each
        counted.add(key)
    return sizes


def _first_axis_slice_view(op) -> bool:
    """Whether a ``StridedSlice`` / ``Slice`` takes a range of the first axis (or one entry of
    it) with every other axis whole, one row being a multiple of 64 bytes: TensorFlow's kernels
    then hand out a view of the input's buffer (their "dim 0 slice" case), which keeps the
    whole input alive as long as the slice is. The batch slices of a sliced filter gradient
    (:func:`_patch_filter_gradient`) are such views: counted as copies, a plan freed an 8 MiB
    output gradient that their readers still held."""
    if op.type not in ("StridedSlice", "Slice") or not op.inputs or not op.outputs:
        return False
    src, out = op.inputs[0].shape, op.outputs[0].shape
    if src.rank is None or src.rank < 1 or not (src.is_fully_defined() and
                                                out.is_fully_defined()):
        return False
    shrink = 0
    if op.type == "StridedSlice":
        from tensorflow.python.framework import tensor_util

        strides = tensor_util.constant_value(op.inputs[3])
        shrink = op.get_attr("shrink_axis_mask")
        if strides is None or any(int(v) != 1 for v in strides) or shrink not in (0, 1) or \
                op.get_attr("ellipsis_mask") or op.get_attr("new_axis_mask"):
            return False
    if (out.as_list() if shrink else out.as_list()[1:]) != src.as_list()[1:]:
        return False
    return src[1:].num_elements() * op.inputs[0].dtype.size % 64 == 0


def _is_side_effect(op_type: str) -> bool:
    return op_type in SIDE_EFFECT_OPS or bool(_SIDE_EFFECT_RE.match(op_type))


def _is_random(op_type: str) -> bool:
    return op_type not in _NOT_RANDOM and bool(_RANDOM_RE.search(op_type))


def _loop_function(op, which: str):
    """The FuncGraph of a ``While`` op's ``cond`` or ``body``."""
    return op.graph._get_function(op.get_attr(which).name).graph  # noqa: SLF001


def loop_resource_passthrough(op) -> frozenset:
    """Indices of a ``While``'s resource loop variables its body passes on unchanged (a
    captured variable's handle, as ``while_v2`` passes every capture): output k is input k."""
    import tensorflow as tf

    if op.type not in ("While", "StatelessWhile"):
        return frozenset()
    try:
        body = _loop_function(op, "body")
    except Exception:  # noqa: BLE001 (no function body to read)
        return frozenset()
    if len(body.inputs) < len(op.outputs) or len(body.outputs) != len(op.outputs):
        return frozenset()
    out = set()
    for k, t in enumerate(op.outputs):
        if t.dtype != tf.resource:
            continue
        s = body.outputs[k]
        while s.op.type == "Identity" and s.op.inputs:
            s = s.op.inputs[0]
        if s is body.inputs[k]:
            out.add(k)
    return frozenset(out)


def recomputable_loop(op) -> bool:
    """Whether a forward ``While`` may run again: its cond and body only compute (no random
    op, no state written, no nested loop, condition or call), and touch resources only to
    read the weights whose handles the loop passes on unchanged (a Keras RNN reads its
    kernels so). A recomputed copy reads those weights as values taken before any update
    (:mod:`tf_remat.rewrite`), so it computes what the first run did."""
    import tensorflow as tf

    if op.type != "While":
        return False
    try:
        fns = [_loop_function(op, "cond"), _loop_function(op, "body")]
    except Exception:  # noqa: BLE001 (no function bodies to read)
        return False
    passthrough = loop_resource_passthrough(op)
    for g in fns:
        derived = {id(t) for k, t in enumerate(g.inputs) if t.dtype == tf.resource}
        allowed = {id(g.inputs[k]) for k in passthrough if k < len(g.inputs)}
        if derived - allowed:
            return False
        for o in g.get_operations():
            if any(id(t) in derived for t in o.inputs):
                if o.type == "Identity":
                    derived.add(id(o.outputs[0]))
                    continue
                if o.type != "ReadVariableOp":
                    return False
                continue
            if o.type in ("While", "StatelessWhile") or o.type in _CALL_OPS or \
                    _is_random(o.type) or _non_recomputable(o):
                return False
    return True


def _non_recomputable(op, forward: bool = False) -> bool:
    """Whether ``op`` must run exactly once. ``forward``: the op is in the forward pass, where
    a loop that only computes (:func:`recomputable_loop`) may run again."""
    t = op.type
    if t == "While" and forward and recomputable_loop(op):
        return False
    if _is_side_effect(t):
        return True
    try:
        stateful = op.op_def.is_stateful
    except Exception:  # noqa: BLE001 (ops without an OpDef: function calls)
        stateful = False
    return bool(stateful) and t not in _HARMLESS_STATEFUL and not t.startswith("Stateless")


# --------------------------------------------------------------------- the analysis
class _Analysis:
    """Classification, grouping and memory accounting of one traced step."""

    def __init__(self, traced: TracedStep, device: str | None = None):
        self.traced = traced
        self.device = device or current_device_kind()
        self.fgraph = traced.function.graph
        self.ops = _topological(self.fgraph.get_operations())
        self.index = {op.name: i for i, op in enumerate(self.ops)}
        self.n = len(self.ops)
        # data inputs: list of (producer index, output index); consumers per tensor
        self.inputs = []
        self.consumers = collections.defaultdict(list)  # (i, k) -> [consumer op index]
        self.ctrl_in = []
        self.ctrl_out = collections.defaultdict(list)
        for j, op in enumerate(self.ops):
            ins = []
            for t in op.inputs:
                i = self.index[t.op.name]
                ins.append((i, t.value_index))
                self.consumers[(i, t.value_index)].append(j)
            self.inputs.append(ins)
            cins = [self.index[c.name] for c in op.control_inputs]
            self.ctrl_in.append(cins)
            for c in cins:
                self.ctrl_out[c].append(j)
        self.out_bytes = [[tensor_bytes(t) for t in op.outputs] for op in self.ops]
        # TensorLists: what a forward tf.while_loop keeps for its gradient, an RNN's input
        # sequence as a list (TensorListFromTensor copies every element)
        for j, op in enumerate(self.ops):
            for k, b in loop_list_bytes(op).items():
                self.out_bytes[j][k] = b
            if op.type == "TensorListFromTensor" and op.inputs:
                self.out_bytes[j][0] = tensor_bytes(op.inputs[0])
        self.view = [op.type in VIEW_OPS or _first_axis_slice_view(op) for op in self.ops]
        fwd, bwd = traced.phase_marks
        self.phase = []
        for op in self.ops:
            oid = op._id  # noqa: SLF001
            self.phase.append(0 if oid <= fwd else (1 if oid <= bwd else 2))
        self._loop_edges()

    def _loop_edges(self):
        """Edges of ``tf.while_loop`` ops that say nothing about memory, removed.

        A loop passes its captured weights' handles on unchanged; a reader of such an output
        (the gradient's ``VariableShape``) reads the handle itself, so a plan need not hold
        the loop's lists for it (the rewrite reads the handle too). TensorFlow's automatic
        control edges make the updates of a loop's weights wait for the loop; where an update
        of a loop that may run again (:func:`recomputable_loop`) reads the loop's results
        anyway (through the gradient), that edge orders nothing and, as an edge of the graph,
        would hold the loop's lists until the update. The rewrite keeps
        it on the op, where it names the newest copy. (A path through other control edges
        counts: an optimizer reads a slot after updating it by one.)"""
        for j, op in enumerate(self.ops):
            for k in loop_resource_passthrough(op):
                src = self.inputs[j][k]
                for c in self.consumers.pop((j, k), []):
                    self.inputs[c] = [src if x == (j, k) else x for x in self.inputs[c]]
                    self.consumers[src].append(c)
        for j, op in enumerate(self.ops):
            if self.phase[j] != 0 or op.type != "While" or not self.ctrl_out[j] or \
                    not recomputable_loop(op):
                continue
            # (a slot's update reaches the weight's through a control edge: paths take both)
            reach = set()
            stack = [c for k in range(len(op.outputs)) for c in self.consumers.get((j, k), ())]
            while stack:
                i = stack.pop()
                if i in reach:
                    continue
                reach.add(i)
                stack.extend(c for k in range(len(self.ops[i].outputs))
                             for c in self.consumers.get((i, k), ()))
                stack.extend(self.ctrl_out[i])
            for c in [c for c in self.ctrl_out[j] if c in reach]:
                self.ctrl_out[j].remove(c)
                self.ctrl_in[c] = [i for i in self.ctrl_in[c] if i != j]

    # ---------------------------------------------------------- classification
    def classify(self):
        ops, n = self.ops, self.n
        out_ops = [self.index[t.op.name] for t in self.fgraph.outputs]
        sinks = set(out_ops) | {self.index[o.name] for o in self.fgraph.control_outputs}
        # live: ancestors of sinks through data and control edges
        live = bytearray(n)
        stack = list(sinks)
        for s in stack:
            live[s] = 1
        while stack:
            j = stack.pop()
            for i, _ in self.inputs[j]:
                if not live[i]:
                    live[i] = 1
                    stack.append(i)
            for i in self.ctrl_in[j]:
                if not live[i]:
                    live[i] = 1
                    stack.append(i)
        placeholders = {self.index[name] for name in
                        self.traced.input_ops + self.traced.label_ops}
        self.placeholders = placeholders
        seeds = set(placeholders)
        for j in range(n):
            if not live[j]:
                continue
            t = ops[j].type
            if _is_side_effect(t) or _is_random(t):
                seeds.add(j)
            elif t in ("Const", "Placeholder", "VarHandleOp", "ReadVariableOp"):
                continue
            elif not self.view[j] and t not in SHAPE_OPS and \
                    max(self.out_bytes[j], default=0) >= _MIN_SCHEDULED:
                seeds.add(j)  # a per-step value (a cast of a weight, a mask ...)
        node = bytearray(n)
        stack = []
        for s in seeds:
            if live[s] and s not in placeholders:
                node[s] = 1
            stack.append(s)
        while stack:
            i = stack.pop()
            nxt = [c for k in range(len(ops[i].outputs)) for c in self.consumers[(i, k)]]
            nxt += self.ctrl_out[i]
            for j in nxt:
                if node[j] or not live[j]:
                    continue
                if ops[j].type in SHAPE_OPS and self._static_inputs(j):
                    continue  # a function of static shapes only: constant-folded
                node[j] = 1
                stack.append(j)
        # NoOps that only gather side effects for the step's return are plumbing, not nodes
        out_set = set(out_ops)
        sink_set = set()
        for j in range(n):
            if ops[j].type == "NoOp" and live[j] and not any(
                    c for k in range(len(ops[j].outputs)) for c in self.consumers[(j, k)]):
                if all(c in out_set for c in self.ctrl_out[j]):
                    sink_set.add(j)
                    node[j] = 0
        self.sink_set = sink_set
        # multi-input IdentityN (Keras wraps all gradients in one before the optimizer) is a
        # barrier Grappler removes: its readers read its inputs directly
        bypass = {}
        for j in range(n):
            if node[j] and ops[j].type == "IdentityN" and len(ops[j].inputs) > 1 and \
                    j not in out_set and not self.ctrl_out[j]:
                bypass[j] = [t.name for t in ops[j].inputs]
                for k in range(len(ops[j].outputs)):
                    src = self.inputs[j][k]
                    for c in self.consumers.pop((j, k), []):
                        self.inputs[c] = [src if x == (j, k) else x for x in self.inputs[c]]
                        self.consumers[src].append(c)
                node[j] = 0
        self.bypass = bypass
        for j in range(n):
            if self.ctrl_in[j] and sink_set.intersection(self.ctrl_in[j]):
                self.ctrl_in[j] = [i for i in self.ctrl_in[j] if i not in sink_set]
        self.live, self.node = live, node
        self.out_ops = out_ops
        # static shapes are required of every node op's outputs
        for j in range(n):
            if node[j]:
                for t in ops[j].outputs:
                    if not t.shape.is_fully_defined():
                        # a py_function's gradient is another py_function, whose outputs
                        # carry no shape whatever set_shape gave the forward one
                        hint = (" A tf.py_function's gradient has no static shape: write the "
                                "layer with TensorFlow ops" if ops[j].type in
                                ("EagerPyFunc", "PyFunc", "PyFuncStateless") else "")
                        if ops[j].type in _CALL_OPS:
                            # TensorFlow reuses a trace whose signature covers the call's
                            # (batch None, made when a functional model was built)
                            hint = (" It is the output of a tf.function called inside the "
                                    "model, which reuses a trace made for other shapes (batch "
                                    "None, when a functional model was built): call the plain "
                                    "Python function there (fn.python_function); the step is "
                                    "one tf.function already")
                        raise UnsupportedOpError(
                            f"tensor {t.name!r} (op {ops[j].type}) has shape {t.shape} with an "
                            "unknown dimension even with the batch size fixed; tf-remat needs "
                            "static shapes (ops like Where / Unique / dynamic slicing give "
                            f"data-dependent shapes).{hint}")

    def _stale_rereads(self) -> set:
        """Variable reads inside nodes (ordered after an update by automatic control edges:
        a GAN's second pass reading the updated discriminator, a seed generator's second
        draw) whose variable is written again later in the step. A copy of such a read would
        see the later value (:meth:`build` pins the small ones and keeps nodes with large
        ones from running twice). Accesses to one variable keep their program order in the
        traced graph, so "later" is a higher topological index."""
        def handle(j, k):
            # a resource handle, through any Identity of it, named by its producer
            i, x = self.inputs[j][k]
            while self.ops[i].type == "Identity" and self.inputs[i]:
                i, x = self.inputs[i][0]
            return i, x

        last_write = {}
        for j, op in enumerate(self.ops):
            if not _non_recomputable(op, self.phase[j] == 0):
                continue
            for k, t in enumerate(op.inputs):
                if t.dtype.name == "resource":
                    h = handle(j, k)
                    last_write[h] = max(last_write.get(h, -1), j)
        stale = {j for j, op in enumerate(self.ops)
                 if op.type in _VARIABLE_READS and self.inputs[j]
                 and last_write.get(handle(j, 0), -1) > j}
        # a function call or condition that takes a handle of such a variable reads it inside
        # (a call whose function reads a variable is registered stateful, so runs once anyway;
        # this keeps that from resting on how TensorFlow registers calls)
        stale.update(j for j, op in enumerate(self.ops)
                     if op.type in _CALL_OPS and any(
                         t.dtype.name == "resource" and last_write.get(handle(j, k), -1) > j
                         for k, t in enumerate(op.inputs)))
        return stale

    def _static_inputs(self, j):
        return all(t.shape.is_fully_defined() for t in self.ops[j].inputs)

    # ---------------------------------------------------------- buffers
    def buffers(self):
        """buffer[(i, k)] = (owner op index, output index) following views; -1 owner = fixed."""
        ops = self.ops
        buf = {}

        def root(i, k):
            key = (i, k)
            seen = []
            while key not in buf:
                op = ops[key[0]]
                if self.view[key[0]] and op.inputs:
                    src = self.inputs[key[0]][key[1] if op.type == "IdentityN" else 0]
                    seen.append(key)
                    key = src
                    continue
                buf[key] = key if self.node[key[0]] else None
                break
            r = buf[key]
            for s in seen:
                buf[s] = r
            return r

        for j in range(self.n):
            if self.live[j]:
                for k in range(len(ops[j].outputs)):
                    root(j, k)
        self.buf = buf
        # real readers of each buffer: non-view live consumers of any alias, + step outputs
        readers = collections.defaultdict(set)
        for (i, k), r in buf.items():
            if r is None:
                continue
            for c in self.consumers[(i, k)]:
                if self.live[c] and not self.view[c]:
                    readers[r].add(c)
        for t in self.fgraph.outputs:
            r = buf.get((self.index[t.op.name], t.value_index))
            if r is not None:
                readers[r].add(-1)
        self.readers = readers

    # ---------------------------------------------------------- grouping
    def group(self):
        ops, node = self.ops, self.node
        members = {j: [j] for j in range(self.n) if node[j]}
        rep = {j: j for j in members}
        succ = {j: set() for j in members}
        pred = {j: set() for j in members}
        for j in members:
            for i, _ in self.inputs[j]:
                if node[i] and i != j:
                    succ[i].add(j)
                    pred[j].add(i)
            for i in self.ctrl_in[j]:
                if node[i]:
                    succ[i].add(j)
                    pred[j].add(i)
        # per group facts
        big = {j: max((b for k, b in enumerate(self.out_bytes[j])
                       if self.buf.get((j, k)) == (j, k)), default=0) for j in members}
        stateful = {j: _non_recomputable(ops[j], self.phase[j] == 0) for j in members}
        phase = {j: self.phase[j] for j in members}
        largest = max(big.values(), default=0)
        # groups holding a returned buffer stay resident to the end: keep them small
        pinned = {j: False for j in members}
        for t in self.fgraph.outputs:
            r = self.buf.get((self.index[t.op.name], t.value_index))
            if r is not None:
                pinned[r[0]] = True
        self.small_bytes = small = max(64 << 10, largest // 128)

        def find(j):
            r = rep[j]
            while rep[r] != r:
                r = rep[r]
            rep[j] = r
            return r

        def path_exists(a, b, budget=20000):
            """Is there a path a -> ... -> b of length >= 2 (through other groups)?"""
            stack = [s for s in succ[a] if s != b]
            seen = set(stack)
            steps = 0
            while stack:
                g = stack.pop()
                if g == b:
                    return True
                steps += 1
                if steps > budget:
                    return True  # too expensive to prove: refuse the merge
                for s in succ[g]:
                    if s not in seen:
                        seen.add(s)
                        stack.append(s)
            return False

        def can_merge(a, b):
            if a == b:
                return False
            if b in succ[a]:
                return succ[a] == {b} or pred[b] == {a} or not path_exists(a, b)
            if a in succ[b]:
                return succ[b] == {a} or pred[a] == {b} or not path_exists(b, a)
            return not path_exists(a, b) and not path_exists(b, a)

        def merge(a, b):
            """Merge group b into group a."""
            for s in succ.pop(b):
                pred[s].discard(b)
                if s != a:
                    pred[s].add(a)
                    succ[a].add(s)
            for p in pred.pop(b):
                succ[p].discard(b)
                if p != a:
                    succ[p].add(a)
                    pred[a].add(p)
            succ[a].discard(a)
            pred[a].discard(a)
            members[a].extend(members.pop(b))
            rep[b] = a
            big[a] = max(big[a], big.pop(b))
            stateful[a] = stateful[a] or stateful.pop(b)
            pinned[a] = pinned[a] or pinned.pop(b)
            phase[a] = min(phase[a], phase.pop(b))

        def try_merge(i, j, *, force=False):
            a, b = find(i), find(j)
            if a == b:
                return True
            if not can_merge(a, b):
                if force:
                    self.unfused.append((ops[i].name, ops[j].name))
                return False
            if a in succ[b]:
                a, b = b, a
            merge(a, b)
            return True

        self.unfused = []

        def sole_reader(i, k, j):
            r = self.buf.get((i, k))
            return r is not None and self.readers.get(r) == {j}

        def data_node_inputs(j):
            return [(i, k) for i, k in self.inputs[j] if node[i]]

        # 1. fusions the runtime performs: one node, never separated by a schedule
        for j in list(members):
            t = ops[j].type
            ins = data_node_inputs(j)
            if t in ("BiasAdd", "BiasAddV1") and ins:
                i, k = self.inputs[j][0]
                if node[i] and ops[i].type in CONTRACTION_OPS:
                    try_merge(i, j, force=True)
            elif t in ("Add", "AddV2") and len(ins) == 2:
                for i, k in ins:
                    if ops[i].type in ("BiasAdd",) and sole_reader(i, k, j) and \
                            _same_shape(ops[i].outputs[k], ops[j].outputs[0]):
                        src = self.inputs[i][0][0]
                        if node[src] and ops[src].type in CONTRACTION_OPS:
                            try_merge(i, j, force=True)
                            break
            elif t in ACTIVATION_OPS and ins:
                i, k = self.inputs[j][0]
                if node[i] and sole_reader(i, k, j) and (
                        ops[i].type in ("BiasAdd", "Add", "AddV2") or
                        ops[i].type in FUSED_BN_OPS or ops[i].type in CONTRACTION_OPS):
                    if find(i) != i or ops[i].type in CONTRACTION_OPS or \
                            ops[i].type in FUSED_BN_OPS:
                        try_merge(i, j, force=True)
            elif t == "Mul" and len(ins) == 2:  # swish: x * sigmoid(x)
                (a, ka), (b, kb) = ins
                for s, o in ((a, b), (b, a)):
                    if ops[s].type == "Sigmoid" and self.inputs[s] and \
                            self.inputs[s][0][0] == o:
                        try_merge(s, j, force=True)
            elif t == "BiasAddGrad" and ins:
                # every weight gradient of this output gradient: where two biased layers read
                # one gradient (a projection shortcut's and the branch's last convolution),
                # oneDNN pairs each BiasAddGrad with whichever reads it first, not with its
                # own layer's, so no chain edge may fall between any of them
                dy = self.inputs[j][0]
                for c in self.consumers[dy]:
                    if c != j and node[c] and ops[c].type in WEIGHT_GRAD_OPS:
                        if ops[c].type != "MatMul" or (
                                ops[c].outputs[0].shape.rank == 2 and
                                self.inputs[c][1] == dy):
                            try_merge(c, j, force=True)
            elif t in ("Conv2D", "DepthwiseConv2dNative", "Conv3D") and ins:
                i, k = self.inputs[j][0]
                if node[i] and ops[i].type in ("Pad", "PadV2", "MirrorPad"):
                    try_merge(i, j, force=True)
            elif t in FUSED_BN_GRAD_OPS and ins:
                i, k = self.inputs[j][0]
                if node[i] and ops[i].type in ("ReluGrad", "Relu6Grad", "EluGrad"):
                    try_merge(i, j, force=True)
        # 0. constants made node ops only by a control input join that input's node
        for j in list(members):
            if ops[j].type == "Const" and self.ctrl_in[j]:
                c = [i for i in self.ctrl_in[j] if node[i]]
                if c:
                    try_merge(c[0], j)
        # 2. views join the node that owns their input (they allocate nothing)
        for j in list(members):
            if self.view[j] and ops[j].type != "IdentityN":
                ins = data_node_inputs(j)
                if ins:
                    try_merge(ins[0][0], j)
        # 3. in-place element-wise chains: the reader is the input's only reader
        for j in list(members):
            if ops[j].type not in INPLACE_OPS or stateful[find(j)]:
                continue
            out = ops[j].outputs[0]
            # a chained sum's link joins the term it adds, not the running total: merged
            # along the totals, the whole chain would be one node needing every term at once
            ins = self.inputs[j][1:] if CHAIN_SUM in ops[j].name else self.inputs[j]
            for i, k in ins:
                r = self.buf.get((i, k))
                if r is None or not node[i]:
                    continue
                if self.readers.get(r) == {j} and _same_size(ops[r[0]].outputs[r[1]], out):
                    # also a gradient into the optimizer's first product of it (SGD's
                    # lr * grad), which TensorFlow computes in the gradient's buffer: apart,
                    # the two nodes counted a wide layer's 16 MiB kernel gradient twice
                    same = phase[find(i)] == self.phase[j] or \
                        (phase[find(i)] == 1 and self.phase[j] == 2)
                    if not stateful[find(i)] and same and \
                            not pinned[find(i)] and not pinned[find(j)]:
                        if try_merge(i, j):
                            break

        def big_inputs(g, other):
            """The large buffers group g reads from groups other than g and ``other``."""
            out = set()
            for j in members[g]:
                for i, k in self.inputs[j]:
                    r = self.buf.get((i, k))
                    if r is not None and find(r[0]) not in (g, other) and \
                            self.out_bytes[r[0]][r[1]] > small:
                        out.add(r)
            return out

        # 4. small values join a neighbour along a chain (no cycle possible), within a phase,
        #    never making a node of more than _MAX_OPS ops; a stateful node absorbs only small
        #    producers that exist for it alone; and never two groups that read disjoint sets
        #    of large values: a node needs all its inputs at once, and such a merge (a shared
        #    layer's weight gradients from two branches summed) would hold both branches'
        #    activations and gradients together where a schedule could finish one branch and
        #    free them first (a siamese encoder at batch 32: every solver's floor was 18.90
        #    MiB, and a plan of 15.74 MiB exists once they are apart; heldout.md)
        changed = True
        while changed:
            changed = False
            for g in sorted(members):
                if g not in members or big[g] > small:
                    continue
                target = None
                for cand in ([next(iter(succ[g]))] if len(succ[g]) == 1 else []) + \
                        ([next(iter(pred[g]))] if len(pred[g]) == 1 else []):
                    if phase[cand] != phase[g]:
                        continue
                    if len(members[cand]) + len(members[g]) > _MAX_OPS:
                        continue
                    if (pinned[g] and big[cand] > small) or pinned[cand]:
                        continue
                    downstream = cand in succ[g]
                    if stateful[g] != stateful[cand]:
                        # only a small recomputable producer feeding a stateful node alone
                        if not (stateful[cand] and downstream and succ[g] == {cand}):
                            continue
                    elif stateful[g] and big[cand] > small:
                        continue
                    mine, theirs = big_inputs(g, cand), big_inputs(cand, g)
                    if mine and theirs and not (mine & theirs):
                        continue
                    target = cand
                    break
                if target is None:
                    continue
                a, b = (target, g) if target not in succ[g] else (g, target)
                if target in succ[g]:
                    a, b = g, target  # keep the upstream id as representative
                merge(a, b)
                changed = True
        # 5. an update that reads no batch value (a decoupled weight decay, AdamW's or any
        #    Keras optimizer's with weight_decay=, `v -= v * lr * wd`) joins the variable's
        #    gradient update, with the batch-free product it applies. Alone it depends on the
        #    variable's forward reads only, so a plan may run it before the backward pass,
        #    where the backward MatMuls still hold the weight's old value and TensorFlow
        #    copies the variable on write: eight 2 MiB kernels held twice in resmlp at 60%
        #    (heldout.md), which the simulator does not count. In the gradient update's node
        #    it runs where Keras runs it, after the weight's gradient.
        reached = bytearray(self.n)  # reads the batch, through data or control edges
        stack = list(self.placeholders)
        for j in stack:
            reached[j] = 1
        while stack:
            i = stack.pop()
            for j in [c for k in range(len(ops[i].outputs))
                      for c in self.consumers.get((i, k), ())] + list(self.ctrl_out[i]):
                if not reached[j]:
                    reached[j] = 1
                    stack.append(j)

        def is_batch_free(g):
            return not any(reached[j] for j in members[g])

        def updated(g):
            return {ops[j].inputs[0].name for j in members[g]
                    if _VARIABLE_UPDATE_RE.match(ops[j].type) and ops[j].inputs}

        for g in sorted(members):
            if g not in members or not stateful[g] or not is_batch_free(g):
                continue
            mine = updated(g)
            if not mine:
                continue
            target = next((s for s in sorted(succ[g]) if stateful[s] and not is_batch_free(s)
                           and updated(s) & mine and can_merge(s, g)), None)
            if target is None:
                continue
            producers = [p for p in pred[g] if not stateful[p] and succ[p] == {g}
                         and not pred[p] and is_batch_free(p)]
            merge(target, g)
            for p in producers:
                if can_merge(target, p):
                    merge(target, p)
        self.members, self.succ, self.pred = members, succ, pred
        self.stateful = stateful

    # ---------------------------------------------------------- accounting + graph
    def build(self):
        self.classify()
        self.buffers()
        self.group()
        ops, node = self.ops, self.node
        groups = list(self.members.values())
        for g in groups:
            g.sort()
        # reference order: Kahn's algorithm, ties broken by the first op's creation order
        gid_of_rep = {}
        reps = list(self.members)
        for gi, r in enumerate(reps):
            gid_of_rep[r] = gi
        op_group = {}
        for gi, r in enumerate(reps):
            for j in self.members[r]:
                op_group[j] = gi
        first = [self.members[r][0] for r in reps]
        import heapq

        # TensorFlow's executor runs an op as soon as its inputs exist (a FIFO of ready ops);
        # the reference order does the same, ties broken by creation order
        indeg = [len(self.pred[r]) for r in reps]
        heap = [(0, first[gi], gi) for gi in range(len(reps)) if indeg[gi] == 0]
        heapq.heapify(heap)
        order_old = []
        while heap:
            _, _, gi = heapq.heappop(heap)
            order_old.append(gi)
            for s in self.succ[reps[gi]]:
                sg = gid_of_rep[s]
                indeg[sg] -= 1
                if indeg[sg] == 0:
                    heapq.heappush(heap, (len(order_old), first[sg], sg))
        if len(order_old) != len(reps):
            raise RematError("internal error: grouping produced a cycle")
        # ... except that a node reading no other node (a function of the variables, such as
        # SGD's momentum product) waits until just before its first reader: the executor would
        # run it at the start and hold its value all step, which no plan needs to copy
        pos = {gi: k for k, gi in enumerate(order_old)}
        order_old.sort(key=lambda gi: (
            (min(pos[gid_of_rep[s]] for s in self.succ[reps[gi]]), 0, pos[gi])
            if not self.pred[reps[gi]] and self.succ[reps[gi]] else (pos[gi], 1, 0)))
        new_id = {gi: k for k, gi in enumerate(order_old)}  # ids follow the reference order
        n = len(reps)
        node_ops = [None] * n
        for gi in range(n):
            node_ops[new_id[gi]] = self.members[reps[gi]]
        op_node = {j: new_id[g] for j, g in op_group.items()}
        # edges: data/control dependencies + buffer-owner edges for readers of views
        edges = set()
        memory = [0] * n
        buffers = [[] for _ in range(n)]
        counted = set()
        for v in range(n):
            for j in node_ops[v]:
                for (i, k) in self.inputs[j]:
                    if node[i] and op_node[i] != v:
                        edges.add((op_node[i], v))
                    r = self.buf.get((i, k))
                    if r is not None and op_node[r[0]] != v:
                        edges.add((op_node[r[0]], v))
                        if not self.view[j] and r not in counted:
                            counted.add(r)
                for i in self.ctrl_in[j]:
                    if node[i] and op_node[i] != v:
                        edges.add((op_node[i], v))
        outputs = []
        for t in self.fgraph.outputs:
            i = self.index[t.op.name]
            r = self.buf.get((i, t.value_index))
            if r is not None:
                counted.add(r)
                outputs.append(op_node[r[0]])
            if node[i]:
                outputs.append(op_node[i])
        dev = self.device
        for r in counted:
            v = op_node[r[0]]
            b = counted_bytes(self.out_bytes[r[0]][r[1]], dev)
            memory[v] += b
            buffers[v].append((ops[r[0]].outputs[r[1]].name, b))
        # buffers a node's ops create that no later node reads live only while it runs
        transient = [0] * n
        for v in range(n):
            for j in node_ops[v]:
                if not self.view[j]:
                    transient[v] += sum(counted_bytes(b, dev)
                                        for k, b in enumerate(self.out_bytes[j])
                                        if (j, k) not in counted)
        # fixed memory: variables, the batch, live non-view fixed outputs
        fixed = 0
        seen_vars = set()
        for var in self.traced.variables:
            key = id(var)
            if key not in seen_vars:
                seen_vars.add(key)
                fixed += variable_bytes(var, dev)
        for j in self.placeholders:
            fixed += sum(counted_bytes(b, dev) for b in self.out_bytes[j])
        fixed_ops, dead_ops, sink_ops = [], [], []
        static_shapes = {}
        for j, op in enumerate(ops):
            if node[j]:
                continue
            if j in self.sink_set:
                sink_ops.append(op.name)
                continue
            if j in self.bypass:
                continue
            if not self.live[j]:
                dead_ops.append(op.name)
                continue
            fixed_ops.append(op.name)
            if op.type in SHAPE_OPS and any(node[i] for i, _ in self.inputs[j]):
                static_shapes[op.name] = [_static_shape_value(op, k)
                                          for k in range(len(op.outputs))]
            if j in self.placeholders or self.view[j] or op.type in (
                    "ReadVariableOp", "Placeholder", "VarHandleOp") or op.type in SHAPE_OPS:
                continue
            fixed += sum(counted_bytes(b, dev) for b in self.out_bytes[j])
        backward = [all(self.phase[j] > 0 for j in node_ops[v]) for v in range(n)]
        # a read of a variable written again later: a small one (a seed generator's state,
        # read again by a Dropout layer called twice) is pinned, its copies reading the first
        # read; a copy of a large one would hold the old value beside the new, which the
        # graph does not count, so its node runs once
        stale = self._stale_rereads()
        pinned = {j for j in stale if node[j] and ops[j].type in _VARIABLE_READS and
                  max(self.out_bytes[j], default=0) < _MIN_SCHEDULED}
        recomputable = [not any(_non_recomputable(ops[j], self.phase[j] == 0) or
                                (j in stale and j not in pinned) for j in node_ops[v])
                        for v in range(n)]
        names = [_node_name(ops, node_ops[v]) for v in range(n)]
        op_map = OpMap(nodes=[[ops[j].name for j in node_ops[v]] for v in range(n)],
                       fixed_ops=fixed_ops, dead_ops=dead_ops, sink_ops=sink_ops,
                       outputs=[t.name for t in self.fgraph.outputs], buffers=buffers,
                       static_shapes=static_shapes,
                       bypass_ops={ops[j].name: v for j, v in self.bypass.items()},
                       transient=transient, pinned_ops=[ops[j].name for j in sorted(pinned)])
        fields = dict(memory=memory, edges=sorted(edges), order=list(range(n)),
                      outputs=list(dict.fromkeys(outputs)), fixed_memory=fixed,
                      backward=backward, recomputable=recomputable, names=names)
        self.unfused_pairs = list(self.unfused)
        self.intermediate = [self._intermediate(node_ops[v], counted) for v in range(n)]
        return op_map, fields

    def _intermediate(self, members, counted) -> int:
        """The most a node's own short-lived outputs hold at once while its ops run, in bytes.

        The graph counts a node's buffers that other nodes read; what its ops make and read
        among themselves is held too while it runs: the input gradient of a strided 1x1
        shortcut that the node's AddN sums into another buffer, 4 MiB at siamese's batch 32,
        made plans recomputing around it request 12% over their simulated peak. The ops run in
        order; each output is a new buffer, except that an element-wise kernel
        (``INPLACE_OPS``) forwards an input buffer of the node whose last reader it is and
        whose size matches, as TensorFlow's kernels do when no other reader holds the input;
        a buffer is freed after its last reader. A buffer that ends up as a counted output is
        the node's memory already (a convolution's output that its ReLU forwards). This is a
        model, not a measurement: the figure a profiled run gives depends on which buffers
        the free-running executor happens to forward (a BatchNorm gradient's node held 4 MiB
        in four of six runs and none in two), and the graph must be the same in every process
        for a saved plan to match it.
        """
        ops, dev = self.ops, self.device
        order = sorted(members)  # op creation order: topological
        mine = set(order)
        outs = {(j, k): b for j in order if not self.view[j]
                for k, b in enumerate(self.out_bytes[j])}
        left = {r: {c for c in self.readers.get(r, ()) if c in mine} for r in outs}
        phys, forwarded, events = {}, set(), []
        for j in order:
            if self.view[j]:
                continue
            roots = [self.buf.get(ik) for ik in self.inputs[j]]
            donors = [r for r in dict.fromkeys(roots) if r in outs and left[r] == {j}
                      and r not in forwarded] if ops[j].type in INPLACE_OPS else []
            for k, b in enumerate(self.out_bytes[j]):
                d = next((r for r in donors if outs[r] == b), None)
                if d is not None:
                    donors.remove(d)
                    forwarded.add(d)
                    phys[(j, k)] = phys[d]
                else:
                    phys[(j, k)] = (j, k)
                    events.append((1, (j, k)))
            events.append((0, None))  # the op's outputs and inputs are held together here
            for r in dict.fromkeys(roots):
                if r in left and j in left[r]:
                    left[r].discard(j)
                    if not left[r] and r not in forwarded:
                        events.append((-1, phys[r]))
            for k in range(len(self.out_bytes[j])):
                if not left[(j, k)] and (j, k) not in counted:
                    events.append((-1, phys[(j, k)]))  # read by no op: freed at once
        kept = {phys[r] for r in outs if r in counted}
        live = peak = 0
        for kind, p in events:
            if kind == 0:
                peak = max(peak, live)
            elif p not in kept:
                live += kind * counted_bytes(outs[p], dev)
        return peak


def _topological(ops) -> list:
    """``ops`` (a graph's, in creation order) in a topological order of their data and control
    edges, ties kept in creation order. Creation order alone is one, until
    :func:`_sink_broadcasts` gives existing readers inputs created after them; grouping and the
    rewrite take a node's ops in this order."""
    import heapq

    ops = list(ops)
    pos = {op.name: k for k, op in enumerate(ops)}
    readers = collections.defaultdict(list)
    indeg = [0] * len(ops)
    for k, op in enumerate(ops):
        deps = {pos[t.op.name] for t in op.inputs} | {pos[c.name] for c in op.control_inputs}
        indeg[k] = len(deps)
        for d in deps:
            readers[d].append(k)
    heap = [k for k in range(len(ops)) if indeg[k] == 0]
    heapq.heapify(heap)
    out = []
    while heap:
        k = heapq.heappop(heap)
        out.append(ops[k])
        for r in readers[k]:
            indeg[r] -= 1
            if indeg[r] == 0:
                heapq.heappush(heap, r)
    if len(out) != len(ops):
        raise RematError("internal error: the traced step's ops have a cycle")
    return out


def _static_shape_value(op, k):
    t = op.type
    if t == "ShapeN":
        return op.inputs[k].shape.as_list()
    s = op.inputs[0].shape
    if t == "Shape":
        return s.as_list()
    if t == "Size":
        return int(s.num_elements())
    if t == "Rank":
        return int(s.rank)
    import tensorflow as tf

    value = tf.get_static_value(op.outputs[k])
    return None if value is None else value.tolist()


def _same_size(a, b) -> bool:
    return a.dtype == b.dtype and a.shape.num_elements() == b.shape.num_elements()


def _same_shape(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape


def _node_name(ops, members) -> str:
    """A readable name: the heaviest-looking op's name, shortened."""
    def weight(j):
        t = ops[j].type
        return (t in CONTRACTION_OPS or t in WEIGHT_GRAD_OPS or "Backprop" in t,
                sum(tensor_bytes(o) for o in ops[j].outputs))

    j = max(members, key=weight)
    name = ops[j].name
    return f"{name}" if len(members) == 1 else f"{name}(+{len(members) - 1})"
