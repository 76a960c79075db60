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

__all__ = ["linear_graph", "random_layered_graph", "random_dag"]


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
