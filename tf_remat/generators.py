"""Graph generators: linear training chains and random layered DAGs (no TensorFlow).

Example:
    >>> g = linear_graph(3)
    >>> g.n, [g.names[v] for v in g.order][:4], g.outputs
    (7, ['f0', 'f1', 'f2', 'loss'], (6,))
"""

from __future__ import annotations

import math
import random

from tf_remat.graph import Graph

__all__ = ["linear_graph", "random_layered_graph", "random_dag", "transformer_graph"]


def linear_graph(n: int, *, cost: float = 1.0, memory: int = 1, fixed_memory: int = 0,
                 name: str | None = None) -> Graph:
    """A linear training graph: n forward nodes, a loss, n backward nodes (Chen et al. 2016).

    Forward ``f_i`` reads ``f_{i-1}``; the loss reads ``f_{n-1}``; the gradient ``b_i`` reads the
    next gradient (``b_{i+1}`` or the loss) and the forward value ``f_i`` it differentiates.
    Ids: forward 0..n-1, loss n, backward n+1..2n (``b_{n-1}`` first). The output is ``b_0``.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    N = 2 * n + 1
    edges = [(i, i + 1) for i in range(n)]       # f chain and f_{n-1} -> loss
    bid = lambda i: 2 * n - i                     # noqa: E731 ; b_{n-1} -> n+1, b_0 -> 2n
    for i in range(n):
        prev = n if i == n - 1 else bid(i + 1)
        edges.append((prev, bid(i)))
        edges.append((i, bid(i)))
    names = [f"f{i}" for i in range(n)] + ["loss"] + [f"b{n - 1 - k}" for k in range(n)]
    return Graph(cost=[cost] * N, memory=[memory] * N, edges=edges,
                 backward=[False] * (n + 1) + [True] * n, names=names,
                 fixed_memory=fixed_memory, name=name or f"linear_n{n}")


def random_layered_graph(n: int, *, width: float = 0.35, width_noise: float = 0.75,
                         edge_density: float = 0.2, skip_density: float = 0.14, seed: int = 0,
                         name: str | None = None) -> Graph:
    """A random layered DAG as in Gagrani et al. 2022, Appendix A.

    Node 0 is the single source, node 1 the single sink; inner nodes are numbered layer by
    layer. Adjacent layers are joined by contiguous windows spread evenly over the larger layer;
    skip edges (about ``skip_density`` of all edges) jump two or more layers ahead. Costs are
    integers in [0, 1000) (source and sink 0); output sizes are right-skewed multiples of 10.
    """
    if n < 3:
        raise ValueError(f"a random layered graph needs n >= 3, got {n}")
    rng = random.Random(seed)
    L = max(3, math.ceil(math.sqrt(n * (1 / width - 1))))
    inner = n - 2
    mean = inner / max(1, L - 2)
    lo, hi = max(1, int(mean * (1 - width_noise))), max(1, int(math.ceil(mean * (1 + width_noise))))
    widths = []
    while sum(widths) < inner:
        widths.append(min(rng.randint(lo, hi), inner - sum(widths)))
    layers, nid = [[0]], 2
    for w in widths:
        layers.append(list(range(nid, nid + w)))
        nid += w
    layers.append([1])
    edges = set()
    for a, b in zip(layers, layers[1:]):
        big, small, big_is_src = (a, b, True) if len(a) >= len(b) else (b, a, False)
        count = round(len(a) * len(b) * edge_density + (1 - edge_density) * len(big))
        count = min(max(count, len(big)), len(a) * len(b))
        for k, node in enumerate(big):
            deg = count // len(big) + (1 if k < count % len(big) else 0)
            deg = max(1, min(deg, len(small)))
            centre = (k + 0.5) / len(big) * len(small)
            start = int(round(centre - deg / 2))
            start = min(max(start, 0), len(small) - deg)
            for j in range(start, start + deg):
                edges.add((node, small[j]) if big_is_src else (small[j], node))
    n_skip = round(len(edges) * skip_density / (1 - skip_density))
    nl = len(layers)
    if nl >= 5:
        for _ in range(n_skip):
            ls = rng.randint(1, nl - 4)
            lt = rng.randint(ls + 2, nl - 2)
            src_layer, dst_layer = layers[ls], layers[lt]
            i = rng.randrange(len(src_layer))
            frac = min(0.999, (i + 0.5) / len(src_layer) + 0.2 * rng.random() - 0.1)
            j = min(len(dst_layer) - 1, max(0, int(frac * len(dst_layer))))
            edges.add((src_layer[i], dst_layer[j]))
    cost = [0] * n
    memory = [0] * n
    for v in range(n):
        cost[v] = 0 if v in (0, 1) else rng.randrange(1000)
        memory[v] = int(min(7500, max(10, round(rng.gammavariate(1.2, 1625) / 10) * 10)))
    order = [v for layer in layers for v in layer]
    return Graph(cost=cost, memory=memory, edges=sorted(edges), order=order,
                 name=name or f"random_layered_n{n}_s{seed}")


def random_dag(n: int, *, p: float = 0.2, max_back: int = 6, seed: int = 0,
               backward_fraction: float = 0.0, stateful_fraction: float = 0.0) -> Graph:
    """A small random DAG in topological id order, for tests.

    Each node reads up to ``max_back`` earlier nodes with probability ``p`` each (and always its
    predecessor, so the graph is connected). A tail fraction can be marked ``backward`` and a
    random fraction non-recomputable.
    """
    rng = random.Random(seed)
    edges = []
    for v in range(1, n):
        edges.append((v - 1, v))
        for u in range(max(0, v - max_back), v - 1):
            if rng.random() < p:
                edges.append((u, v))
    nb = int(n * backward_fraction)
    return Graph(cost=[rng.randint(1, 20) for _ in range(n)],
                 memory=[rng.randint(1, 50) for _ in range(n)], edges=edges,
                 backward=[v >= n - nb for v in range(n)],
                 recomputable=[rng.random() >= stateful_fraction for _ in range(n)],
                 name=f"random_dag_n{n}_s{seed}")


def transformer_graph(layers: int = 4, *, batch: int = 8, seq: int = 512, hidden: int = 1024,
                      heads: int = 16, mlp_ratio: int = 4, vocab: int = 32000,
                      dropout: bool = True, bytes_per_value: int = 4, flops_per_s: float = 1e14,
                      bytes_per_s: float = 1e12, name: str | None = None) -> Graph:
    """A training graph of a stack of transformer blocks (attention + MLP): forward, loss,
    backward, one weight-gradient node per linear layer.

    Each block is ``ln1, q, k, v, scores, softmax, [dropout], attend, proj, add, ln2, fc1, gelu,
    fc2, add`` (15 ops with dropout); activations are ``batch*seq*hidden`` values (``mlp_ratio``
    times that in the MLP) and attention scores ``batch*heads*seq*seq``. Costs are seconds of a
    roofline model: matmul flops at ``flops_per_s``, element-wise ops at ``bytes_per_s``. The
    gradient ``d(v)`` of every forward op reads the gradients of v's readers and what their local
    derivatives need (their inputs; the output too for softmax, gelu and layer norm); the
    gradient of a linear layer's weight reads its input and the gradient of its output and is
    an output of the graph (kept for the optimizer), with parameters and two optimizer slots in
    ``fixed_memory``. Dropout nodes are not recomputable (a new mask would differ). About
    36 nodes per layer: ``layers=224`` gives 8,000+ nodes.
    """
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    B = bytes_per_value
    act = batch * seq * hidden * B
    names, cost, memory, recomp, kind = [], [], [], [], []
    inputs = []            # forward inputs per node

    def add(nm, mem, c, ins, k, rc=True):
        names.append(nm)
        memory.append(int(mem))
        cost.append(float(c))
        recomp.append(rc)
        inputs.append(list(ins))
        kind.append(k)
        return len(names) - 1

    def ew(nbytes):  # element-wise op: read + write
        return 2 * nbytes / bytes_per_s

    def mm(m, k, n_):
        return 2.0 * m * k * n_ / flops_per_s + (m * k + k * n_ + m * n_) * B / bytes_per_s

    tokens = batch * seq
    params = 0
    linears = []           # (node, weight bytes)
    x = add("embed", act, ew(act), [], "embed")
    scores = batch * heads * seq * seq * B
    hd = hidden // heads
    for i in range(layers):
        p = f"l{i}/"
        ln1 = add(p + "ln1", act, ew(act), [x], "ln")
        q = add(p + "q", act, mm(tokens, hidden, hidden), [ln1], "linear")
        k = add(p + "k", act, mm(tokens, hidden, hidden), [ln1], "linear")
        v = add(p + "v", act, mm(tokens, hidden, hidden), [ln1], "linear")
        sc = add(p + "scores", scores, mm(batch * heads * seq, hd, seq), [q, k], "matmul")
        sm = add(p + "softmax", scores, ew(scores), [sc], "softmax")
        a_in = sm
        if dropout:
            a_in = add(p + "attn_dropout", scores, ew(scores), [sm], "dropout", rc=False)
        at = add(p + "attend", act, mm(batch * heads * seq, seq, hd), [a_in, v], "matmul")
        o = add(p + "proj", act, mm(tokens, hidden, hidden), [at], "linear")
        x1 = add(p + "add1", act, ew(act), [x, o], "add")
        ln2 = add(p + "ln2", act, ew(act), [x1], "ln")
        f1 = add(p + "fc1", act * mlp_ratio, mm(tokens, hidden, hidden * mlp_ratio), [ln2],
                 "linear")
        ge = add(p + "gelu", act * mlp_ratio, ew(act * mlp_ratio), [f1], "gelu")
        f2 = add(p + "fc2", act, mm(tokens, hidden * mlp_ratio, hidden), [ge], "linear")
        x = add(p + "add2", act, ew(act), [x1, f2], "add")
        for node, w in ((q, hidden * hidden), (k, hidden * hidden), (v, hidden * hidden),
                        (o, hidden * hidden), (f1, hidden * hidden * mlp_ratio),
                        (f2, hidden * hidden * mlp_ratio)):
            linears.append((node, w * B))
            params += w * B
    lnf = add("ln_final", act, ew(act), [x], "ln")
    logit_bytes = tokens * vocab * B
    logits = add("logits", logit_bytes, mm(tokens, hidden, vocab), [lnf], "linear")
    linears.append((logits, hidden * vocab * B))
    params += hidden * vocab * B
    loss = add("loss", B, ew(logit_bytes), [logits], "loss")
    n_fwd = len(names)
    readers = [[] for _ in range(n_fwd)]
    for w in range(n_fwd):
        for u in inputs[w]:
            readers[u].append(w)
    saves_output = {"softmax", "gelu", "ln", "loss"}
    grad = {}
    outputs = []
    dloss = add("d/loss", B, 0.0, [loss], "grad")
    grad[loss] = dloss
    for u in range(n_fwd - 2, -1, -1):     # reverse order; the loss's gradient is the seed
        ins = []
        for w in readers[u]:
            ins.append(grad[w])
            ins.extend(inputs[w])
            if kind[w] in saves_output:
                ins.append(w)
        ins = [a for a in dict.fromkeys(ins) if a != u] + [u] if kind[u] in saves_output \
            else list(dict.fromkeys(ins))
        if kind[u] == "embed":
            g = add("d/" + names[u], act, ew(act) * len(readers[u]), ins, "grad")
        else:
            g = add("d/" + names[u], memory[u], sum(cost[w] for w in readers[u]), ins, "grad")
        grad[u] = g
        if kind[u] == "embed":
            outputs.append(g)
    # weight gradients right after the output gradient of their layer
    order = list(range(n_fwd))
    extra_after = {}
    for node, wbytes in linears:
        dw = add("dW/" + names[node], wbytes, cost[node], [inputs[node][0], grad[node]],
                 "wgrad")
        extra_after.setdefault(grad[node], []).append(dw)
        outputs.append(dw)
    order.append(dloss)
    for u in range(n_fwd - 2, -1, -1):
        order.append(grad[u])
        order.extend(extra_after.get(grad[u], ()))
    for g in extra_after.get(dloss, ()):
        order.insert(order.index(dloss) + 1, g)
    # the logits' weight gradient reads grad[logits], already placed; keep topological order
    order = _topo_fix(order, inputs)
    edges = [(u, v) for v in range(len(names)) for u in inputs[v]]
    n = len(names)
    return Graph(cost=cost, memory=memory, edges=edges, order=order, outputs=outputs,
                 fixed_memory=3 * params + batch * seq * 4 * 2,
                 backward=[v >= n_fwd for v in range(n)], recomputable=recomp, names=names,
                 name=name or f"transformer_l{layers}")


def _topo_fix(order, inputs):
    """``order`` made topological by moving each node after its inputs (stable otherwise)."""
    placed, out, waiting = set(), [], {}
    pending = {}
    for v in order:
        missing = [u for u in inputs[v] if u not in placed]
        if missing:
            pending[v] = set(missing)
            for u in missing:
                waiting.setdefault(u, []).append(v)
            continue
        stack = [v]
        while stack:
            x = stack.pop()
            placed.add(x)
            out.append(x)
            for w in waiting.pop(x, ()):
                pending[w].discard(x)
                if not pending[w]:
                    del pending[w]
                    stack.append(w)
    if pending:
        raise ValueError("order could not be made topological")
    return out
