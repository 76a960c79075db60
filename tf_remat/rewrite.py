"""Plan -> a static TensorFlow training step that runs the plan, recomputation included.

The traced step's op graph (``TracedStep.graph_def``) is copied into a new GraphDef:

* **fixed ops** (variable reads, constants, shape arithmetic, scalar optimizer math; see
  :class:`~tf_remat.extract.OpMap`) are copied once, unchanged and unordered: they depend on no
  batch value, and TensorFlow runs them at the start of the step;
* for each ``compute v`` of the plan, the ops of node ``v`` are emitted; the first computation
  keeps the original op names, the k-th recomputation gets fresh copies named
  ``<op>/_remat<k>``. Every input is rewired to the *current* copy of its producer (the newest
  copy computed before this point), which is the simulator's rule (:mod:`tf_remat.plan`);
* every emitted op runs after the op emitted before it (the *chain*), so the executor runs the
  ops exactly in plan order. Without the chain TensorFlow runs a copy as soon as its inputs
  exist (and Grappler's common-subexpression pass merges the copies back), so nothing is saved.
  An op that reads its predecessor needs no edge. Otherwise the edge leaves the predecessor
  through an ``Identity`` reading it (``/_done``) and reaches the op through an ``Identity`` on
  one of its inputs from outside its node (``/_gate``), never touching either op: Grappler's
  remapper fuses no Conv2D / MatMul, BiasAdd or activation that has a control edge, and a
  chain of plain control edges left ResNet50's step with 15 unfused Conv2D + BiasAdd pairs.
  A weight gradient and the BiasAddGrad of the same output gradient (which oneDNN fuses) both
  follow the same predecessor, so nothing is ordered between them;
* ``chain="node"`` orders nodes instead of ops (a node's ops may run side by side, and so may
  two adjacent loops that neither reads, where the memory allows: :func:`adjoin_loops`), and
  ``chain="run"`` orders only *runs* of adjacent computes (:func:`tf_remat.plan.concurrent_groups`):
  the memory before a run plus every member's output and transient bytes stays within the
  plan's simulated peak, so the runtime may run a run's members in any order or at once (as the
  plain step runs independent ops, two at a time on two cores) without holding more than the
  plan; each run waits for every last op of the previous one through one ``NoOp``;
* shape ops that read a batch tensor (``OpMap.static_shapes``) become constants, Keras's
  gradient ``IdentityN`` barrier is bypassed (``OpMap.bypass_ops``), dead ops and the original
  side-effect sink are left out (a chained dead op would be kept alive), and the outputs get a
  control input on the last op of the chain, so every side effect has run when they are returned.

The step runs with Grappler's dependency optimizer off for its own graph (the call's options;
the user's other functions keep theirs): with it on, an op whose order rested on reading the
op before it could lose that edge to a later rewrite and run as soon as its forward inputs
existed (:class:`_Ordered`).

The GraphDef is imported with :func:`tf.compat.v1.wrap_function` (no automatic control
dependencies are added to it) with the step's inputs mapped to new arguments and every captured
tensor (variable handles included) mapped to the live object it captured, so the new step reads
and updates the model's own variables.

Correctness (see ``tests/test_rewrite.py``):

* every copy reads weights through the fixed ``ReadVariableOp`` of the original step, which the
  original automatic control dependencies order before the variable's update; a read value that
  is still referenced when its variable is updated is kept (resource variables copy on write),
  so no copy reads an updated weight (the copy costs memory no node carries, so ``optimize``
  moves such an update after the reader where it can: :func:`defer_updates`). A read inside a
  node (ordered after an update: a GAN's second pass through the updated discriminator, a seed
  generator's second draw) is copied with its node, unless the step writes its variable again
  later (``_Analysis._stale_rereads`` in :mod:`tf_remat.extract`): then a small read (a seed)
  is pinned (``OpMap.pinned_ops``: every copy reads the first read's value) and a node with a
  large one is not recomputable;
* ops in non-recomputable nodes (optimizer and BatchNorm statistics updates, RNG state) are
  emitted once: :func:`tf_remat.plan.simulate` refuses a plan that computes them twice;
* stateless random ops (Keras dropout) read their seed from a fixed or a pinned read of the
  seed variable, so a recomputed dropout mask equals the first one.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from tf_remat.errors import PlanError, RematError
from tf_remat.extract import (CHAIN_SUM, _VARIABLE_UPDATE_RE, _is_side_effect, _loop_function,
                              loop_resource_passthrough)
from tf_remat.plan import (Plan, adjoin, concurrent_groups, defer, simulate,
                           steps_from_sequence)

__all__ = ["RewrittenStep", "rewrite", "static_order_step", "build_graph_def", "copy_name",
           "loop_nodes", "adjoin_loops", "update_readers", "defer_updates"]

#: suffix of the k-th recomputed copy of an op
_COPY = "/_remat"
#: loop ops whose iterations the rewritten step runs at most this many at a time
_LOOP_OPS = ("While", "StatelessWhile")
_LOOP_PARALLEL = 1
#: the ways the plan's order is imposed (see :func:`rewrite`)
CHAINS = ("op", "node", "run", "none")


def copy_name(op_name: str, k: int) -> str:
    """Name of the k-th copy of an op (k = 0: the original name)."""
    return op_name if k == 0 else f"{op_name}{_COPY}{k}"


@dataclasses.dataclass
class RewrittenStep:
    """A training step that runs a plan.

    Call it like the traced step: ``step(x, y)`` returns what ``traced.function`` returns (the
    loss, or ``(loss, *grads)`` for a gradients-only trace) and applies the same updates.

    Attributes:
        function: the step as a function of the flattened inputs and labels (the imported
            concrete function's attributes pass through).
        traced, plan, graph, op_map: what it was built from.
        info: facts for reports: ops emitted, copies, chain edges, build seconds.
    """

    function: Any
    traced: Any
    plan: Plan
    graph: Any
    op_map: Any
    info: dict = dataclasses.field(default_factory=dict)

    def __call__(self, x, y):
        import tensorflow as tf

        args = tf.nest.flatten(x) + tf.nest.flatten(y)
        out = self.function(*args)
        if isinstance(out, (list, tuple)) and len(out) == 1:
            return out[0]
        return out


def static_order_step(extraction, chain: str = "node", *,
                      overlap_loops: bool = True) -> "RewrittenStep":
    """The extracted graph rewritten with nothing recomputed, in topological order, chained as
    ``chain``: what running the step in any static order costs by itself. Under the node chain
    its independent loops are next to each other and overlap (:func:`adjoin_loops`), unless
    ``overlap_loops`` is False: then every compute is ordered, what a plan whose memory leaves
    no room for two loops at once costs. Built once per chain and kept on the extraction (its
    costs do not enter the rewrite, so the step costs replacing them leave it valid)."""
    from tf_remat.plan import make_plan
    from tf_remat.solvers.baselines import checkpoint_all

    key = chain if overlap_loops or chain != "node" else "node-serial"
    if key == "node-serial" and key not in extraction.static_steps:
        overlapped = static_order_step(extraction, chain)
        if overlapped.info.get("run_index") is None:  # nothing overlaps: the same step
            extraction.static_steps[key] = overlapped
    if key not in extraction.static_steps:
        graph = extraction.graph
        budget = 2**62  # checkpoint-all needs none; the plan only orders
        plan = make_plan(graph, checkpoint_all(graph, budget), budget, strategy="checkpoint-all")
        if key == "node":
            # the order without rematerialization holds no more than its own peak
            plan = adjoin_loops(extraction.traced, graph, extraction.op_map, plan,
                                cap=plan.peak_memory)
        extraction.static_steps[key] = rewrite(extraction.traced, graph, extraction.op_map,
                                               plan, chain=chain, overlap_loops=overlap_loops)
    return extraction.static_steps[key]


def loop_nodes(traced, op_map) -> frozenset:
    """The nodes that run a loop (a ``While`` or ``StatelessWhile`` op)."""
    kind = {nd.name: nd.op for nd in traced.graph_def.node}
    return frozenset(v for v, ops in enumerate(op_map.nodes)
                     if any(kind.get(o) in _LOOP_OPS for o in ops))


def adjoin_loops(traced, graph, op_map, plan: Plan, cap: int | None = None) -> Plan:
    """``plan`` with each loop's compute moved next to the loop computed before it where the two
    are independent and the plan's budget allows (or ``cap``: :func:`tf_remat.plan.adjoin`), so
    that ``chain="node"`` runs them side by side; ``plan`` itself where nothing moved.

    Why: a loop runs one small kernel after another, on one core at a time, and the plain
    step runs independent loops (a Bidirectional RNN's two directions, forward and backward)
    at once. A static order running them one after the other made the bilstm model's step
    28-53% slower on 2 cores; ops that are not loops parallelize inside their kernels.
    """
    loops = loop_nodes(traced, op_map)
    if len(loops) < 2 or not plan.steps:
        return plan
    seq = plan.sequence
    # within what the plan was solved for (its peak may rise to it): at 90% of bilstm's step,
    # a plan's forward loops stayed apart at its own peak
    new = adjoin(graph, seq, loops, cap=_plan_cap(plan) if cap is None else cap)
    if new == tuple(seq):
        return plan
    steps = steps_from_sequence(graph, new)
    sim = simulate(graph, steps)
    moved = sum(a != b for a, b in zip(seq, new))
    return dataclasses.replace(plan, steps=steps, peak_memory=sim.peak_memory, cost=sim.cost,
                               info={**plan.info, "adjoined_loops": moved})


def _plan_cap(plan: Plan) -> int:
    """What a plan's computes moved after the solve (loops side by side, deferred updates) may
    hold: what the plan was solved for."""
    return max(plan.peak_memory, plan.budget)


def update_readers(traced, op_map) -> dict:
    """Node -> the other nodes that read, from before the step writes them, a variable the node
    updates: the consumers of the step's fixed ``ReadVariableOp`` of that variable (through
    the fixed and bypass ops that pass it on). Nodes that update no such variable are absent."""
    nodes = traced.graph_def.node
    fixed = set(op_map.fixed_ops) | set(op_map.bypass_ops)
    node_of = op_map.node_of()

    def source(ref):
        return ref.split(":", 1)[0] if not ref.startswith("^") else None

    consumers = {}
    for nd in nodes:
        for r in nd.input:
            name = source(r)
            if name is not None:
                consumers.setdefault(name, []).append(nd.name)
    # per variable handle, the nodes reading its fixed reads
    readers = {}
    for nd in nodes:
        if nd.op != "ReadVariableOp" or nd.name not in fixed or not nd.input:
            continue
        found, stack, seen = readers.setdefault(source(nd.input[0]), set()), [nd.name], set()
        while stack:
            for c in consumers.get(stack.pop(), ()):
                if c in node_of:
                    found.add(node_of[c])
                elif c in fixed and c not in seen:
                    seen.add(c)
                    stack.append(c)
    out = {}
    for nd in nodes:
        if nd.name in node_of and _VARIABLE_UPDATE_RE.match(nd.op) and nd.input:
            rs = readers.get(source(nd.input[0]), set()) - {node_of[nd.name]}
            if rs:
                out.setdefault(node_of[nd.name], set()).update(rs)
    return {u: frozenset(rs) for u, rs in out.items()}


def defer_updates(traced, graph, op_map, plan: Plan, cap: int | None = None) -> Plan:
    """``plan`` with each variable update that comes before a reader of the variable's old
    value moved after that reader, where nothing between needs the update and the peak stays
    within what the plan was solved for (or ``cap``: :func:`tf_remat.plan.defer`); ``plan``
    itself where nothing moved.

    Why: before it, TensorFlow copies the variable on write and holds the old buffer for the
    reader, bytes the simulator does not see; a reordering solver (FastSA) places an update
    there when that frees its gradient sooner (one of bn_cnn's at 50%)."""
    after = update_readers(traced, op_map)
    if not after or not plan.steps:
        return plan
    seq = plan.sequence
    early = _early_updates(seq, after)
    if not early:
        return plan
    new = defer(graph, seq, after, cap=_plan_cap(plan) if cap is None else cap)
    left = _early_updates(new, after)
    info = {**plan.info, "deferred_updates": len(early) - len(left)}
    if left:
        # the measured check sees their copies; the report says why a plan measured more
        info["updates_copied_on_write"] = len(left)
    if new == tuple(seq):
        return dataclasses.replace(plan, info=info)
    steps = steps_from_sequence(graph, new)
    sim = simulate(graph, steps)
    return dataclasses.replace(plan, steps=steps, peak_memory=sim.peak_memory, cost=sim.cost,
                               info=info)


def _early_updates(seq, after) -> list:
    """The update nodes of ``after`` computed before one of their readers."""
    last = {v: p for p, v in enumerate(seq)}
    return [u for u, rs in after.items() if u in last
            and any(last.get(r, -1) > seq.index(u) for r in rs)]


def rewrite(traced, graph, op_map, plan: Plan, *, chain: str = "op",
            overlap_loops: bool = True) -> RewrittenStep:
    """Build the training step that runs ``plan``.

    Args:
        traced: the :class:`~tf_remat.extract.TracedStep` the graph was extracted from.
        graph: the solver :class:`~tf_remat.graph.Graph`.
        op_map: its :class:`~tf_remat.extract.OpMap`.
        plan: a plan for ``graph`` (checked by the simulator here).
        chain: ``"op"`` (every node op follows the previous one), ``"node"`` (a node's first ops
            follow the previous node's last ops; ops inside a node may run in parallel, and so
            may adjacent loops that the memory before them plus both loops' outputs and scratch
            keeps within the plan's budget, unless ``overlap_loops`` is False: see
            :func:`adjoin_loops`),
            ``"run"`` (the plan's computes are cut into runs whose members may run in any order
            or at once without the memory passing the plan's simulated peak,
            :func:`tf_remat.plan.concurrent_groups`; a run's first ops follow all of the
            previous run's last ops) or ``"none"`` (no ordering; for experiments only:
            TensorFlow then ignores the plan).

    Returns:
        A :class:`RewrittenStep`.

    Raises:
        PlanError: the plan does not fit the graph (the simulator's message).
        RematError: the op map and the traced step disagree.
    """
    t0 = time.perf_counter()
    simulate(graph, plan.steps)  # raises PlanError on an invalid plan
    if op_map.n != graph.n:
        raise RematError(f"the op map has {op_map.n} nodes but the graph has {graph.n}; "
                         "they come from different extractions")
    runs = None
    if chain == "run":
        # an op map saved before transient bytes were counted: one compute per run (the node
        # chain), as nothing bounds what nodes run side by side would hold
        runs = (concurrent_groups(graph, plan.steps, transient=op_map.transient)
                if op_map.transient else tuple(range(len(plan.sequence))))
    elif chain == "node" and op_map.transient and overlap_loops:
        loops = loop_nodes(traced, op_map)
        if len(loops) > 1:
            # within what the plan was solved for, not its peak: a backward pair of loops sits
            # at the peak, where the bound (both loops' outputs and scratch, nothing freed) is
            # over the peak by what the solver's order frees between them
            runs = concurrent_groups(graph, plan.steps, _plan_cap(plan),
                                     transient=op_map.transient, among=loops)
            if len(set(runs)) == len(runs):
                runs = None
    gd, outputs, last, info = build_graph_def(traced, op_map, plan.sequence, chain=chain,
                                              runs=runs)
    t1 = time.perf_counter()
    fn = _import(traced, gd, outputs, last)
    info["build_seconds"] = t1 - t0
    info["import_seconds"] = time.perf_counter() - t1
    return RewrittenStep(function=fn, traced=traced, plan=plan, graph=graph, op_map=op_map,
                         info=info)


def build_graph_def(traced, op_map, sequence, *, chain: str = "op", runs=None):
    """The GraphDef of the rewritten step (see the module docstring).

    Args:
        runs: for ``chain="run"``, the run index of each position of ``sequence``
            (:func:`tf_remat.plan.concurrent_groups`); for ``chain="node"``, optional: where
            given, computes of one run (independent loops, :func:`loop_nodes`) may overlap.

    Returns:
        ``(graph_def, output tensor names, names of the ops the outputs wait for, info)``.
    """
    import numpy as np
    import tensorflow as tf
    from tensorflow.core.framework import graph_pb2

    if chain not in CHAINS:
        raise ValueError(f"chain must be one of {CHAINS}, got {chain!r}")
    if chain == "run" and (runs is None or len(runs) != len(sequence)):
        raise ValueError("chain='run' needs the run index of every position of the sequence")
    if chain == "node" and runs is not None and len(runs) != len(sequence):
        raise ValueError("runs must give the run index of every position of the sequence")
    # the node chain with runs is the run chain, whose runs are single computes but for the
    # loops allowed to overlap
    order = "run" if chain == "node" and runs is not None else chain
    src = traced.graph_def
    by_name = {nd.name: nd for nd in src.node}
    op_of = traced.function.graph.get_operation_by_name
    node_of = op_map.node_of()
    drop = set(op_map.sink_ops) | set(op_map.dead_ops)
    bypass = op_map.bypass_ops
    static = op_map.static_shapes
    pinned = set(op_map.pinned_ops)
    n = op_map.n
    current = [-1] * n        # newest copy of each node
    count = [0] * n           # copies made so far

    out = graph_pb2.GraphDef()
    out.versions.CopyFrom(src.versions)
    out.library.CopyFrom(src.library)

    # --- constants for shape ops that read batch tensors
    static_const = {}
    for name, values in static.items():
        nd = by_name[name]
        dtype = _out_dtype(nd)
        for k, value in enumerate(values):
            if value is None:
                raise RematError(f"shape op {name!r} output {k} has no static value")
            cname = f"{name}/_static{k}"
            c = out.node.add()
            c.name = cname
            c.op = "Const"
            c.attr["dtype"].type = dtype.as_datatype_enum
            c.attr["value"].tensor.CopyFrom(
                tf.make_tensor_proto(np.asarray(value, dtype=dtype.as_numpy_dtype)))
            static_const[(name, k)] = cname

    def parse(ref):
        if ref.startswith("^"):
            return ref[1:], -1
        if ":" in ref:
            name, k = ref.rsplit(":", 1)
            return name, int(k)
        return ref, 0

    passthrough = {}

    def loop_handles(name):
        if name not in passthrough:
            nd = by_name.get(name)
            passthrough[name] = (loop_resource_passthrough(op_of(name))
                                 if nd is not None and nd.op in _LOOP_OPS else frozenset())
        return passthrough[name]

    def resolve(ref, own_node, own_copy):
        """The rewritten form of an input reference, or None to drop it."""
        name, k = parse(ref)
        if k >= 0 and k in loop_handles(name):
            # a loop passes a weight's handle on unchanged: its reader (the gradient's
            # VariableShape) reads the handle (as the op map's graph counts it), whichever
            # copy of the loop ran last, and a recomputed copy has a value there instead
            return resolve(by_name[name].input[k], own_node, own_copy)
        if name in bypass:
            if k < 0:
                return None
            return resolve(bypass[name][k], own_node, own_copy)
        if name in static:
            if k < 0:
                return None
            return static_const[(name, k)]
        if name in drop:
            if name in op_map.sink_ops or k < 0:
                return None
            raise RematError(f"op {name!r} is marked dead in the op map but is read")
        v = node_of.get(name)
        if v is None or name in pinned:  # a fixed op, or a read every copy shares
            return ref
        c = own_copy if v == own_node else current[v]
        if c < 0:
            raise PlanError(f"the plan reads node {v} ({name}) before computing it")
        new = copy_name(name, c)
        return "^" + new if k < 0 else (new if k == 0 else f"{new}:{k}")

    # --- fixed ops, copied once
    fixed = set(op_map.fixed_ops)
    for nd in src.node:
        if nd.name in fixed and nd.name not in static:
            c = out.node.add()
            c.CopyFrom(nd)
            ins = [r for r in (resolve(i, None, 0) for i in nd.input) if r is not None]
            del c.input[:]
            c.input.extend(_dedup(ins))

    # --- node ops in plan order, chained
    data_readers = {}         # op -> the ops of the traced step that read its outputs
    for nd in src.node:
        for r in nd.input:
            if not r.startswith("^"):
                data_readers.setdefault(parse(r)[0], []).append(nd.name)
    prev_tail = []            # chain: ops the next emitted ops must follow
    value_reads = {}          # a weight's handle -> the read a recomputed loop takes instead
    loop_functions = {}       # a loop function's name -> its variant that takes values
    emitted = 0
    chain_edges = 0
    fused_pairs = 0
    loops = 0
    in_node_sets = {}
    markers = {}              # chained op -> the op that stands for it in control edges
    partners = {}             # per node: op -> the op it is fused with (both directions)
    run_tails = []            # chain "run": tails of the members of the current run so far
    barriers = 0
    for pos, v in enumerate(sequence):
        if order == "run" and (pos == 0 or runs[pos] != runs[pos - 1]) and run_tails:
            # a new run: its members follow every member of the previous run, through one
            # NoOp when there are several (heads x tails control edges otherwise). A run of
            # scratch-space nodes alone (no ops) leaves the chain where it was: an empty
            # barrier after it cut the chain, and TensorFlow pruned the side effects before
            # the cut (BatchNorm statistics and dropout seed updates of a BiLSTM model)
            prev_tail = _barrier(out, f"tf_remat/run{runs[pos]}", run_tails, markers, op_of)
            barriers += len(set(run_tails)) > 1
            run_tails = []
        ops = op_map.nodes[v]
        k = count[v]
        count[v] += 1
        if not ops:  # a kernel's scratch space (extract.with_workspace_nodes): nothing to run
            current[v] = k
            continue
        if v not in in_node_sets:
            members = set(ops)
            # ops of this node fed by another op of the node (data or control)
            fed = set()
            consumed = set()
            for o in ops:
                for r in by_name[o].input:
                    p, _ = parse(r)
                    if p in members:
                        # (a pinned read is in no copy but the first: what it feeds heads
                        # every copy)
                        if p not in pinned:
                            fed.add(o)
                        consumed.add(p)
            in_node_sets[v] = ([o for o in ops if o not in fed],
                               _chain_tails([o for o in ops if o not in consumed], members,
                                            by_name, data_readers, parse))
        heads, tails = in_node_sets[v]
        partner = partners.get(v)
        if partner is None:
            partner = partners[v] = _fusion_partners(ops, by_name, parse)
        members = set(ops)
        tail_before = {}
        pair_gates = {}       # (tensor, edges) -> the gate a fused pair of this copy reads
        for o in ops:
            if k and o in pinned:
                continue  # the first copy's read, which a later read would not repeat
            nd = by_name[o]
            c = out.node.add()
            c.CopyFrom(nd)
            c.name = copy_name(o, k)
            ins = [r for r in (resolve(i, v, k) for i in nd.input) if r is not None]
            if k and nd.op in _LOOP_OPS:
                ins = _value_loop(out, c, op_of(o), ins, value_reads, loop_functions)
            after = prev_tail
            if chain == "op" and o in partner and partner[o] in tail_before:
                # the second op of a pair the runtime fuses follows what its partner follows:
                # an edge between them (or an op ordered between them) keeps oneDNN from
                # fusing the pair, or makes a cycle once it does
                after = tail_before[partner[o]]
                fused_pairs += 1
            tail_before[o] = after
            shared, theirs = _shared_input(ins, partner.get(o), by_name,
                                           lambda r: resolve(r, v, k))
            if shared is not None and after and (chain == "op" or o in heads or
                                                 partner[o] in heads):
                # a fused pair is ordered as one op (oneDNN's merged kernel takes the weight
                # gradient's inputs and both ops' control edges): no edge when either reads
                # what it follows, else both read one gate on the tensor they share. A gate
                # or an edge on one of them alone leaves the pair unfused (after Grappler
                # turns a gate into control edges), which put a bfloat16 bias gradient 95% off
                # the fused kernel's
                data_from = {parse(r)[0] for r in ins if not r.startswith("^")} | theirs
                extra = [t for t in after if t not in data_from]
                if extra:
                    key = (parse(shared), tuple(extra))
                    if key not in pair_gates:
                        pair_gates[key] = _pass_through(
                            out, c.name + "/_gate", shared, _input_tensor(op_of(o), ins, shared),
                            [_marker(out, t, markers, op_of) for t in extra])
                        chain_edges += len(extra)
                    ins = [pair_gates[key] if r == shared else r for r in ins]
            elif (chain == "op" and after) or (order in ("node", "run") and o in heads and after):
                # an op that already reads a tensor of the op it follows needs no control
                # edge; a redundant edge also stops Grappler's remapper from fusing the two
                data_from = {r.split(":")[0] for r in ins if not r.startswith("^")}
                extra = [t for t in after if t not in data_from]
                if extra:
                    ins = _gate(out, c.name, ins, [_marker(out, t, markers, op_of) for t in extra],
                                op_of(o), lambda r: parse(r)[0].split(_COPY)[0] in members)
                else:
                    ins += ["^" + t for t in extra]
                chain_edges += len(extra)
            del c.input[:]
            c.input.extend(_dedup(ins))
            if "_class" in c.attr:
                del c.attr["_class"]
            if c.op in _LOOP_OPS and c.attr["parallel_iterations"].i > _LOOP_PARALLEL:
                # iterations run ahead of each other by default (up to 32 at once): a backward
                # RNN loop then holds the per-step weight gradients of many steps before they
                # are summed (8 MiB more for a 256-unit LSTM, on some runs and not others);
                # one at a time, a loop holds what the graph counts for it
                c.attr["parallel_iterations"].i = _LOOP_PARALLEL
                loops += 1
            emitted += 1
            if chain == "op":
                if after is prev_tail:
                    prev_tail = [c.name]
                else:
                    prev_tail = prev_tail + [c.name]
        if order == "node":
            prev_tail = [copy_name(o, 0 if o in pinned else k) for o in tails]
        elif order == "run":
            run_tails += [copy_name(o, 0 if o in pinned else k) for o in tails]
        current[v] = k
    if order == "run":
        prev_tail = run_tails
    if chain == "none":
        # no ordering: the outputs wait for every op nothing else reads (side effects included)
        read = set()
        for nd in out.node:
            for r in nd.input:
                read.add(parse(r)[0])
        prev_tail = [nd.name for nd in out.node if nd.name not in read and
                     (nd.name in node_of or _COPY in nd.name)]
    held = _hold_reassociable(out, node_of, markers, op_of, parse)
    if value_reads:
        # the reads a recomputed loop takes run before their weights' updates, so a copy
        # after an update still computes with the step's weights (the update then copies the
        # weight's buffer, which the read still holds)
        for nd in out.node:
            if not _VARIABLE_UPDATE_RE.match(nd.op):
                continue
            for r in list(nd.input):
                read = None if r.startswith("^") else value_reads.get(parse(r)[0])
                if read is not None and "^" + read not in nd.input:
                    nd.input.append("^" + read)
    # --- outputs: the newest copies
    outputs = []
    for t in op_map.outputs:
        r = resolve(t, None, 0)
        outputs.append(r if ":" in r else r + ":0")
    _check_side_effects_kept(out, outputs, prev_tail, parse)
    info = {"node_ops": sum(len(o) for o in op_map.nodes), "ops_emitted": emitted,
            "recomputed_ops": emitted - sum(len(o) for o in op_map.nodes),
            "fixed_ops": len(fixed), "chain": chain, "chain_edges": chain_edges,
            "fused_pairs": fused_pairs, "sequential_loops": loops,
            "value_loops": len(loop_functions) // 2,
            "held_products": held,
            "runs": (runs[-1] + 1 if runs else 0) if order == "run" else None,
            "run_index": tuple(runs) if order == "run" else None,
            "run_barriers": barriers if order == "run" else None,
            "tails": list(prev_tail)}
    return out, outputs, prev_tail, info


def _check_side_effects_kept(out, outputs, tails, parse):
    """Raise when a variable update of the new graph is not an ancestor of its outputs or its
    last ops: TensorFlow prunes such an op, and the step would silently skip it. (An empty
    barrier once cut the chain after a run of scratch-space nodes, and a BiLSTM model's
    BatchNorm statistics and dropout seeds were not updated.)"""
    inputs = {nd.name: nd.input for nd in out.node}
    seen = set()
    stack = [parse(r)[0] for r in list(outputs) + list(tails)]
    while stack:
        name = stack.pop()
        if name in seen or name not in inputs:
            continue
        seen.add(name)
        stack.extend(parse(r)[0] for r in inputs[name])
    lost = [nd.name for nd in out.node
            if _is_side_effect(nd.op) and nd.name not in seen]
    if lost:
        raise RematError(f"the rewritten step would skip {len(lost)} side effect(s) that no "
                         f"output waits for, e.g. {lost[:3]}; this is a bug in tf-remat's "
                         f"rewrite (chain the plan with chain='op' to work around it)")


def _import(traced, gd, outputs, tails):
    """Import ``gd`` as a function of the flattened (x, y), captures mapped to live objects."""
    import tensorflow as tf

    fgraph = traced.function.graph
    arg_specs = tf.nest.flatten(traced.input_spec) + tf.nest.flatten(traced.label_spec)
    arg_names = list(traced.input_ops) + list(traced.label_ops)
    captures = [(ext, internal.name) for ext, internal in fgraph.captures]

    def body(*args):
        g = tf.compat.v1.get_default_graph()
        input_map = {f"{name}:0": a for name, a in zip(arg_names, args)}
        for ext, internal in captures:
            input_map[internal] = g.capture(ext)
        n_out = len(outputs)
        res = tf.graph_util.import_graph_def(
            gd, input_map=input_map, return_elements=list(outputs) + list(tails),
            name="remat")
        outs, tail_ops = res[:n_out], res[n_out:]
        with tf.control_dependencies(tail_ops):
            return [tf.identity(t) for t in outs]

    return _Ordered(tf.compat.v1.wrap_function(body, signature=arg_specs), arg_specs)


class _Ordered:
    """The imported step, called with Grappler's dependency optimizer off for its graph.

    The plan's order rests on data edges wherever an op reads the op it follows, and on
    ``/_done`` identities elsewhere. The dependency optimizer turns an identity that only
    feeds control edges into a ``NoOp``, which leaves the op it read with one data reader;
    Grappler's next pass may then push a constant factor down into that op (``(g * m) * c``
    becomes ``g * (c * m)``), and the op, now reading forward values only, runs as soon as
    they exist (:func:`_hold_reassociable`): in a GELU MLP each layer's ``c * m`` was held
    from its forward pass to its backward one (a recomputing plan measured 135 MiB over the
    step's start against 120 simulated; 121 with the optimizer off). Step times with it off
    were within 2% on ResNet50, MobileNet and a BatchNorm CNN. Grappler reads its options
    from the call (``FunctionCallOptions``, per thread), so the user's own functions keep
    theirs; ``_noinline`` keeps the step a function of its own when it is called inside
    another ``tf.function``, which would otherwise be optimized whole under that function's
    options.
    """

    def __init__(self, function, signature):
        self._function = _not_inlined(function, signature)
        self._options = {}

    def __call__(self, *args):
        from tensorflow.python.eager import context

        ctx = context.context()
        current = ctx.function_call_options
        key = (current.config_proto_serialized, current.executor_type)
        ours = self._options.get(key)
        if ours is None:
            ours = self._options[key] = _without_dependency_optimizer(current)
        ctx.function_call_options = ours
        try:
            return self._function(*args)
        finally:
            ctx.function_call_options = current

    def __getattr__(self, name):
        if name in ("_function", "_options"):  # not set yet (a copy being made)
            raise AttributeError(name)
        return getattr(self._function, name)


def _not_inlined(function, signature):
    """``function`` with the ``_noinline`` attribute, or as it is when TensorFlow's private
    ``WrappedFunction`` constructor has changed."""
    try:
        from tensorflow.python.eager.wrap_function import WrappedFunction

        return WrappedFunction(function.graph, function._variable_holder,
                               attrs={"_noinline": True},
                               signature=signature)
    except Exception:  # pragma: no cover (a TensorFlow without these internals)
        return function


def _without_dependency_optimizer(options):
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
    from tensorflow.python.eager import context

    config = config_pb2.ConfigProto()
    if options.config_proto_serialized:
        config.ParseFromString(options.config_proto_serialized)
    config.graph_options.rewrite_options.dependency_optimization = \
        rewriter_config_pb2.RewriterConfig.OFF
    return context.FunctionCallOptions(executor_type=options.executor_type,
                                       config_proto=config)


_ADDS = frozenset({"Add", "AddV2", "AddN"})


def _chain_tails(tails, members, by_name, readers, parse):
    """The ops of a node that the next node's ops follow: its last ops, except that an addition
    read only by another addition is replaced by its own inputs in the node.

    Grappler's arithmetic optimizer rewrites a tree of additions (a BatchNorm's ``x * scale +
    shift`` feeding a residual ``+``) into one ``AddN`` of the full-size terms plus the
    broadcast ones, but only when every inner addition has a single reader and no control
    edge; the chain's edge from such a tail kept the rewritten step from that rewrite, and a
    subclassed residual net then summed in another order than Keras's step (a ReLU turned
    the rounding into gradients 1% apart in one layer). Its inputs finish no later, and the
    addition itself still runs before the addition that reads it.

    Not so for a link of a chained gradient sum (``extract.CHAIN_SUM``): that chain exists so
    that each term is added, and freed, before the next is computed, and the rewrite would
    turn it back into one ``AddN`` holding every term (a ``TimeDistributed`` input's eight
    slice gradients: 20.6 MiB requested under a 12.9 MiB plan)."""
    out = []
    for t in tails:
        nd = by_name[t]
        rd = readers.get(t, [])
        if nd.op in _ADDS and len(rd) == 1 and by_name[rd[0]].op in _ADDS and \
                CHAIN_SUM not in t:
            inner = [p for p in (parse(r)[0] for r in nd.input if not r.startswith("^"))
                     if p in members]
            if inner:
                out.extend(p for p in inner if p not in out)
                continue
        if t not in out:
            out.append(t)
    return out


def _marker(out, tail, markers, op_of):
    """What a control edge from the chained op ``tail`` leaves from: an ``Identity`` reading its
    first output, or the op itself when it has none. Grappler's remapper fuses no op that has a
    control fanout, so an op ending a fusable pattern (Conv2D + BiasAdd + Relu) must not be the
    source of the chain's edge; the Identity allocates nothing (it forwards the buffer) and runs
    as soon as ``tail`` has."""
    m = markers.get(tail)
    if m is None:
        op = op_of(tail.split(_COPY)[0])
        m = tail
        if op.outputs:
            m = _pass_through(out, tail + "/_done", tail, op.outputs[0], [])
        markers[tail] = m
    return m


#: the operations Grappler reassociates with a constant (constant folding's push-down,
#: the arithmetic optimizer's broadcast minimization), by family
_REASSOCIABLE = {"Mul": "mul", "Div": "mul", "RealDiv": "mul",
                 "Add": "add", "AddV2": "add", "Sub": "add"}


def _hold_reassociable(out, node_of, markers, op_of, parse) -> int:
    """Give each node op that Grappler could re-associate out of its place a second reader.

    In ``p = (x * y) * c`` with ``c`` a constant and ``x * y`` read by ``p`` alone, Grappler
    rewrites the inner op in place to ``c * y`` and ``p`` to ``x * (c * y)``. When the inner op
    ran in the plan's order only because it read ``x`` (a gradient, from the op before it) and
    ``y`` is a forward value, it now runs in the forward pass and its result is held until
    ``p`` runs: each GELU layer's derivative product in a GELU MLP (8 MiB at batch 2048), which
    put its recomputing plans up to 29% over their simulation. Both rewrites leave an op with two
    data readers alone, so the inner op gets a ``/_done`` identity (nothing allocated) that
    ``p`` waits for; it stays because the dependency optimizer, which would turn it into a
    ``NoOp``, is off for the step (:class:`_Ordered`). Returns how many were held."""
    readers = {}
    kind = {nd.name: nd.op for nd in out.node}
    for nd in out.node:
        for r in nd.input:
            if not r.startswith("^"):
                readers.setdefault(parse(r)[0], []).append(nd)
    held = 0
    for nd in list(out.node):
        family = _REASSOCIABLE.get(nd.op)
        if family is None:
            continue
        if nd.name not in node_of and _COPY not in nd.name:
            continue  # a fixed op: it runs at the start anyway
        rs = readers.get(nd.name, [])  # a /_done marker already is a second reader
        if len(rs) != 1 or _REASSOCIABLE.get(rs[0].op) != family:
            continue
        p = rs[0]
        if not any(kind.get(parse(r)[0]) == "Const" for r in p.input if not r.startswith("^")):
            continue
        p.input.append("^" + _marker(out, nd.name, markers, op_of))
        held += 1
    return held


def _barrier(out, name, tails, markers, op_of):
    """What the next run's heads follow: the single tail of the previous run, or a ``NoOp``
    that waits for all of them (nothing for the first run)."""
    tails = list(dict.fromkeys(tails))
    if len(tails) <= 1:
        return tails
    nd = out.node.add()
    nd.name = name
    nd.op = "NoOp"
    nd.input.extend("^" + _marker(out, t, markers, op_of) for t in dict.fromkeys(tails))
    markers[nd.name] = nd.name
    return [nd.name]


def _gate(out, name, ins, deps, op, internal):
    """Order op ``name`` after ``deps`` through an ``Identity`` on one of its data inputs (one
    produced outside its node) carrying the control edges, instead of control edges on the op
    itself: the remapper fuses no op with a control fanin (a Conv2D and its BiasAdd then run
    unfused, slower and with one more buffer). Returns the new input list."""
    data = [r for r in ins if not r.startswith("^")]
    j = next((i for i, r in enumerate(data) if not internal(r)), None)
    if j is None or j >= len(op.inputs):
        return ins + ["^" + d for d in deps]
    ins = list(ins)
    ins[ins.index(data[j])] = _pass_through(out, name + "/_gate", data[j], op.inputs[j], deps)
    return ins


def _shared_input(ins, partner, by_name, resolve):
    """``(ref, ops)``: the data input (as rewritten in ``ins``) that an op shares with its fused
    partner (a BiasAddGrad's output gradient) and the ops the partner reads from; ``(None,
    None)`` when it has no partner."""
    if partner is None:
        return None, None
    theirs = {resolve(r) for r in by_name[partner].input if not r.startswith("^")}
    theirs = {_ref0(r) for r in theirs if r is not None}
    shared = next((r for r in ins if not r.startswith("^") and _ref0(r) in theirs), None)
    return shared, {r.rsplit(":", 1)[0] for r in theirs}


def _ref0(ref):
    """``name:0`` for ``name``: one spelling per tensor."""
    return ref if ":" in ref else ref + ":0"


def _input_tensor(op, ins, ref):
    """``op``'s input tensor (in the traced step) that ``ins``, its rewritten inputs, hold as
    ``ref``."""
    data = [r for r in ins if not r.startswith("^")]
    return op.inputs[data.index(ref)]


def _pass_through(out, name, ref, tensor, deps):
    """A node ``name`` forwarding ``ref`` (a copy of ``tensor``) once ``deps`` have run, for
    the chain's gates and markers; returns its name.

    An ``Identity``, except after a ``Cast``: Grappler's arithmetic optimizer rewrites
    ``Identity(Cast(x))`` into ``Cast(Identity(x))``, a second cast. Under a mixed-precision
    policy (a BatchNormalization casts its bfloat16 input to float32 for the statistics and
    for the gradient) that kept both the bfloat16 input and two float32 copies alive, and a
    small residual net measured 38% over its plan. ``IdentityN`` is not an op that rewrite
    matches."""
    g = out.node.add()
    g.name = name
    if tensor.op.type == "Cast":
        g.op = "IdentityN"
        g.attr["T"].list.type.append(tensor.dtype.as_datatype_enum)
    else:
        g.op = "Identity"
        g.attr["T"].type = tensor.dtype.as_datatype_enum
    g.input.extend([ref] + ["^" + d for d in deps])
    return g.name


def _fusion_partners(ops, by_name, parse):
    """Pairs of sibling ops of one node that the runtime fuses into one kernel although neither
    reads the other: a weight gradient (Conv2DBackpropFilter, MatMul) and the BiasAddGrad of the
    same output gradient (oneDNN's ``_MklConv2DBackpropFilterWithBias``). ``{op: partner}``."""
    from tf_remat.extract import WEIGHT_GRAD_OPS

    found = {}
    readers = {}
    for o in ops:
        nd = by_name[o]
        if nd.op in WEIGHT_GRAD_OPS:
            for r in nd.input:
                if not r.startswith("^"):
                    readers.setdefault(parse(r), []).append(o)
    for o in ops:
        nd = by_name[o]
        if nd.op == "BiasAddGrad" and nd.input:
            for p in readers.get(parse(nd.input[0]), []):
                if p not in found:
                    found[o], found[p] = p, o
                    break
    return found


def _value_loop(out, c, op, ins, value_reads, loop_functions):
    """Make ``c``, a recomputed copy of the loop ``op``, read its weights as values.

    A loop's body reads each weight through the handle the loop passes on; a copy run after
    the weight's update would read the updated weight. The copy takes instead a read of the
    handle that runs before any update (``value_reads``, ordered so by the caller) and runs
    variants of its cond and body whose argument is that value: each ``ReadVariableOp`` of the
    argument becomes an ``Identity``. Returns the copy's inputs."""

    handles = loop_resource_passthrough(op)
    if not handles:
        return ins
    body = _loop_function(op, "body")
    reads = {}          # loop variable -> (dtype, shape) of the weight its body reads
    for k in handles:
        stack = [body.inputs[k]]
        while stack:
            t = stack.pop()
            for r in t.consumers():
                if r.type == "Identity":
                    stack.append(r.outputs[0])
                elif r.type == "ReadVariableOp":
                    reads[k] = (r.get_attr("dtype"), r.outputs[0].shape)
    if not reads:
        return ins
    ins = list(ins)
    for k, (dtype, _) in reads.items():
        handle = ins[k]
        if handle.startswith("^"):
            raise RematError(f"loop {op.name!r}: input {k} is not a weight's handle")
        key = handle.split(":")[0] if handle.endswith(":0") else handle
        if key not in value_reads:
            rd = out.node.add()
            rd.name = f"{key}/_remat_value"
            rd.op = "ReadVariableOp"
            rd.input.append(handle)
            rd.attr["dtype"].type = dtype.as_datatype_enum
            value_reads[key] = rd.name
        ins[k] = value_reads[key]
    ks = {k: dtype for k, (dtype, _) in reads.items()}
    for which in ("cond", "body"):
        name = c.attr[which].func.name
        if name not in loop_functions:
            loop_functions[name] = _value_function(out, name, ks)
        c.attr[which].func.name = loop_functions[name]
    for k, (dtype, shape) in reads.items():
        c.attr["T"].list.type[k] = dtype.as_datatype_enum
        if "output_shapes" in c.attr and k < len(c.attr["output_shapes"].list.shape):
            c.attr["output_shapes"].list.shape[k].CopyFrom(shape.as_proto())
    if "_read_only_resource_inputs" in c.attr:
        keep = [i for i in c.attr["_read_only_resource_inputs"].list.i if i not in ks]
        del c.attr["_read_only_resource_inputs"].list.i[:]
        c.attr["_read_only_resource_inputs"].list.i.extend(keep)
    return ins


def _value_function(out, name, ks):
    """Add to ``out``'s library a variant of the loop function ``name`` whose arguments
    ``ks`` (index -> dtype) are weight values, not handles; its name."""
    from tensorflow.core.framework import function_pb2

    src = next((f for f in out.library.function if f.signature.name == name), None)
    if src is None:
        raise RematError(f"loop function {name!r} is not in the step's library")
    f = function_pb2.FunctionDef()
    f.CopyFrom(src)
    f.signature.name = new = f"{name}_remat_values"
    derived = {}        # reference -> dtype, for tensors that were a converted handle
    for k, dtype in ks.items():
        arg = f.signature.input_arg[k]
        arg.type = dtype.as_datatype_enum
        derived[arg.name] = dtype
        if k in f.arg_attr:
            del f.arg_attr[k]
        if k in f.resource_arg_unique_id:
            del f.resource_arg_unique_id[k]
    renamed = {}        # a ReadVariableOp's output reference -> the Identity's
    done = set()
    grew = True
    while grew:         # a FunctionDef's nodes need not be in topological order
        grew = False
        for nd in f.node_def:
            if nd.name in done:
                continue
            hit = [derived[r] for r in nd.input if r in derived]
            if not hit:
                continue
            dtype = hit[0]
            if nd.op == "ReadVariableOp":
                nd.op = "Identity"
                del nd.attr["dtype"]
                renamed[f"{nd.name}:value:0"] = f"{nd.name}:output:0"
            elif nd.op != "Identity":
                raise RematError(f"loop function {name!r}: {nd.op} {nd.name!r} reads a weight's "
                                 f"handle; only reads can take its value")
            else:
                derived[f"{nd.name}:output:0"] = dtype
            for key in [a for a in nd.attr if a.startswith("_read_only") or a == "_handle_data"]:
                del nd.attr[key]
            nd.attr["T"].type = dtype.as_datatype_enum
            done.add(nd.name)
            grew = True
    for nd in f.node_def:
        for i, r in enumerate(nd.input):
            if r in renamed:
                nd.input[i] = renamed[r]
    for key, r in list(f.ret.items()):
        if r in renamed:
            f.ret[key] = renamed[r]
    for oa in f.signature.output_arg:
        r = f.ret.get(oa.name)
        if r in derived:
            oa.type = derived[r].as_datatype_enum
    out.library.function.add().CopyFrom(f)
    return new


def _out_dtype(nd):
    import tensorflow as tf

    if nd.op == "Rank":
        return tf.int32
    for key in ("out_type", "T"):
        if key in nd.attr:
            return tf.dtypes.as_dtype(nd.attr[key].type)
    return tf.int32


def _dedup(refs):
    """Data inputs as given (an op may read one tensor twice), then distinct control inputs."""
    data = [r for r in refs if not r.startswith("^")]
    ctrl = list(dict.fromkeys(r for r in refs if r.startswith("^")))
    return data + ctrl
