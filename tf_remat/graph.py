"""The computation graph every solver takes: nodes with cost and output size, edges, an order.

A :class:`Graph` is an immutable dataclass of plain numbers and tuples. It is validated when it is
built, so every other stage may assume a well-formed DAG whose ``order`` is topological.

Example:
    >>> g = Graph(cost=(1, 1, 1, 1), memory=(4, 4, 4, 4), edges=((0, 1), (1, 2), (2, 3)))
    >>> g.n, g.outputs, g.no_remat_peak
    (4, (3,), 8)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from functools import cached_property
from typing import Any

from tf_remat.errors import GraphError

__all__ = ["Graph", "load_graph"]

FORMAT = "tf-remat-graph"
VERSION = 1


@dataclasses.dataclass(frozen=True, eq=True)
class Graph:
    """A DAG of values to compute.

    Args:
        cost: per node, the time (or any additive unit) to compute it once.
        memory: per node, bytes of its output (integers, so the simulator is exact).
        edges: ``(u, v)`` pairs: v reads u's output.
        order: a topological order, the reference schedule; defaults to ids ascending.
        outputs: nodes that must be resident at the end; defaults to the sinks.
        fixed_memory: bytes always resident (parameters, optimizer slots, the input batch).
        backward: per node, whether it belongs to the backward pass.
        recomputable: per node, whether it may be computed more than once.
        names: per node, a human-readable name.
        name: the graph's name.

    Raises:
        GraphError: on any inconsistency; the message names the offending node or edge.
    """

    cost: tuple
    memory: tuple
    edges: tuple = ()
    order: tuple | None = None
    outputs: tuple | None = None
    fixed_memory: int = 0
    backward: tuple | None = None
    recomputable: tuple | None = None
    names: tuple | None = None
    name: str = "graph"

    def __post_init__(self):
        n = len(self.cost)
        put = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        put("cost", tuple(float(c) for c in self.cost))
        if len(self.memory) != n:
            raise GraphError(f"memory has {len(self.memory)} entries but cost has {n}; "
                             "give one of each per node")
        mem = []
        for i, m in enumerate(self.memory):
            if isinstance(m, float) and not m.is_integer():
                m = math.ceil(m)
            mem.append(int(m))
        put("memory", tuple(mem))
        for i in range(n):
            if not math.isfinite(self.cost[i]) or self.cost[i] < 0:
                raise GraphError(f"node {self._label(i)} has cost {self.cost[i]}; "
                                 "costs must be finite and >= 0")
            if self.memory[i] < 0:
                raise GraphError(f"node {self._label(i)} has memory {self.memory[i]}; "
                                 "memory must be >= 0 bytes")
        edges = []
        seen = set()
        for e in self.edges:
            if len(e) != 2:
                raise GraphError(f"edge {e!r} is not a (source, target) pair")
            u, v = int(e[0]), int(e[1])
            for x in (u, v):
                if not 0 <= x < n:
                    raise GraphError(f"edge ({u}, {v}) names node {x}, but ids run 0..{n - 1}")
            if u == v:
                raise GraphError(f"edge ({u}, {v}) is a self-loop: a cycle of one node "
                                 f"({self._label(u)})")
            if (u, v) not in seen:
                seen.add((u, v))
                edges.append((u, v))
        put("edges", tuple(edges))
        for key, default in (("backward", False), ("recomputable", True)):
            val = getattr(self, key)
            val = (default,) * n if val is None else tuple(bool(x) for x in val)
            if len(val) != n:
                raise GraphError(f"{key} has {len(val)} entries for {n} nodes")
            put(key, val)
        names = (tuple(str(i) for i in range(n)) if self.names is None
                 else tuple(map(str, self.names)))
        if len(names) != n:
            raise GraphError(f"names has {len(names)} entries for {n} nodes")
        put("names", names)
        if self.fixed_memory < 0:
            raise GraphError(f"fixed_memory is {self.fixed_memory}; it must be >= 0 bytes")
        put("fixed_memory", int(self.fixed_memory))
        cycle = self._find_cycle()
        if cycle:
            path = " -> ".join(self._label(i) for i in cycle + [cycle[0]])
            raise GraphError(f"the graph has a cycle: {path}; a computation graph must be acyclic")
        order = tuple(range(n)) if self.order is None else tuple(int(i) for i in self.order)
        if sorted(order) != list(range(n)):
            missing = sorted(set(range(n)) - set(order))
            extra = sorted(set(order) - set(range(n)))
            dup = len(order) - len(set(order))
            raise GraphError(
                f"order must list every node id 0..{n - 1} exactly once "
                f"(missing {missing[:5]}, unknown {extra[:5]}, {dup} repeated)")
        pos = [0] * n
        for p, v in enumerate(order):
            pos[v] = p
        for u, v in self.edges:
            if pos[u] > pos[v]:
                raise GraphError(
                    f"order is not topological: node {self._label(v)} comes before its input "
                    f"{self._label(u)}; give a topological order or omit 'order'")
        put("order", order)
        sinks = tuple(i for i in order if not self.succs[i])
        outputs = sinks if self.outputs is None else tuple(int(i) for i in self.outputs)
        for o in outputs:
            if not 0 <= o < n:
                raise GraphError(f"output {o} is not a node id (ids run 0..{n - 1})")
        put("outputs", tuple(dict.fromkeys(outputs)))

    # ----------------------------------------------------------------- structure
    @property
    def n(self) -> int:
        """Number of nodes."""
        return len(self.cost)

    @cached_property
    def preds(self) -> tuple:
        """``preds[v]``: the nodes v reads, as a sorted tuple."""
        p = [[] for _ in range(len(self.cost))]
        for u, v in self.edges:
            p[v].append(u)
        return tuple(tuple(sorted(x)) for x in p)

    @cached_property
    def succs(self) -> tuple:
        """``succs[u]``: the nodes that read u, as a sorted tuple."""
        s = [[] for _ in range(len(self.cost))]
        for u, v in self.edges:
            s[u].append(v)
        return tuple(tuple(sorted(x)) for x in s)

    @cached_property
    def position(self) -> tuple:
        """``position[v]``: index of v in ``order``."""
        pos = [0] * self.n
        for p, v in enumerate(self.order):
            pos[v] = p
        return tuple(pos)

    @property
    def total_cost(self) -> float:
        """Cost of computing every node once."""
        return float(sum(self.cost))

    @cached_property
    def no_remat_peak(self) -> int:
        """Peak of ``order`` run once with every value freed right after its last reader."""
        from tf_remat.plan import simulate, steps_from_sequence  # plan imports graph

        return simulate(self, steps_from_sequence(self, self.order)).peak_memory

    @cached_property
    def structure_digest(self) -> str:
        """A short hash of what a plan's validity and memory depend on: the nodes' memory, the
        edges, the order, the outputs, what may be recomputed and the fixed memory. Not costs
        or names: a profile and Keras's layer names differ between runs of the same model."""
        return _digest((self.memory, tuple(sorted(self.edges)), self.order, tuple(self.outputs),
                        tuple(bool(r) for r in self.recomputable), self.fixed_memory))

    @property
    def topology_digest(self) -> str:
        """:attr:`structure_digest` without the memory: equal for the same step traced at
        another batch size, whose plans are then valid here (their peaks differ)."""
        return _digest((self.n, tuple(sorted(self.edges)), self.order, tuple(self.outputs),
                        tuple(bool(r) for r in self.recomputable)))

    @cached_property
    def budget_lower_bound(self) -> int:
        """No plan of any order can peak below this many bytes.

        The largest of: a node's output with all its inputs resident, and all outputs resident
        at the end, each plus ``fixed_memory``.
        """
        per_node = max((self.memory[v] + sum(self.memory[u] for u in self.preds[v])
                        for v in range(self.n)), default=0)
        at_end = sum(self.memory[o] for o in self.outputs)
        return self.fixed_memory + max(per_node, at_end)

    def bottleneck(self) -> int:
        """The node whose compute step sets :attr:`budget_lower_bound` (for error messages)."""
        return max(range(self.n),
                   key=lambda v: self.memory[v] + sum(self.memory[u] for u in self.preds[v]))

    @cached_property
    def forward_nodes(self) -> tuple:
        """Nodes not marked ``backward``, in ``order``."""
        return tuple(v for v in self.order if not self.backward[v])

    def articulation_points(self) -> tuple:
        """Articulation points of the forward part, taken as an undirected graph, in ``order``.

        These are the natural checkpoint candidates: keeping one cuts the forward graph in two.
        """
        fwd = set(self.forward_nodes)
        adj = {v: [] for v in fwd}
        for u, v in self.edges:
            if u in fwd and v in fwd:
                adj[u].append(v)
                adj[v].append(u)
        found = _articulation_points(adj)
        return tuple(v for v in self.order if v in found)

    def _label(self, i: int) -> str:
        names = self.names
        if names is not None and i < len(names) and str(names[i]) != str(i):
            return f"{i} ({names[i]})"
        return str(i)

    def label(self, i: int) -> str:
        """``"id (name)"`` for messages."""
        return self._label(i)

    def _find_cycle(self) -> list:
        n = len(self.cost)
        succ = [[] for _ in range(n)]
        for u, v in self.edges:
            succ[u].append(v)
        color = [0] * n  # 0 new, 1 on stack, 2 done
        parent = [-1] * n
        for root in range(n):
            if color[root]:
                continue
            stack = [(root, iter(succ[root]))]
            color[root] = 1
            while stack:
                node, it = stack[-1]
                nxt = next(it, None)
                if nxt is None:
                    color[node] = 2
                    stack.pop()
                elif color[nxt] == 0:
                    color[nxt] = 1
                    parent[nxt] = node
                    stack.append((nxt, iter(succ[nxt])))
                elif color[nxt] == 1:
                    cycle = [node]
                    while cycle[-1] != nxt:
                        cycle.append(parent[cycle[-1]])
                    return cycle[::-1]
        return []

    # ----------------------------------------------------------------- JSON
    def to_dict(self) -> dict:
        """The native JSON document (format ``tf-remat-graph`` version 1)."""
        nodes = []
        for i in range(self.n):
            c = self.cost[i]
            nodes.append({"id": i, "name": self.names[i],
                          "cost": int(c) if c.is_integer() else c,
                          "memory": self.memory[i], "backward": self.backward[i],
                          "recomputable": self.recomputable[i]})
        return {"format": FORMAT, "version": VERSION, "name": self.name, "nodes": nodes,
                "edges": [list(e) for e in self.edges], "order": list(self.order),
                "outputs": list(self.outputs), "fixed_memory": self.fixed_memory}

    def save(self, path: str | os.PathLike) -> None:
        """Write the native JSON format to ``path``."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    @classmethod
    def from_dict(cls, doc: dict, *, name: str | None = None) -> "Graph":
        """Build from a native document or a networkx node-link document (as published)."""
        if not isinstance(doc, dict):
            raise GraphError("a graph document must be a JSON object")
        if doc.get("format") == FORMAT:
            return _from_native(doc)
        if "nodes" in doc and ("links" in doc or "edges" in doc) and "format" not in doc:
            return _from_node_link(doc, name=name)
        raise GraphError(
            f"unrecognized graph document (format={doc.get('format')!r}); expected "
            f"{{'format': '{FORMAT}', ...}} or networkx node-link JSON with 'nodes' and 'links'")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Graph":
        """Read a graph file, native or networkx node-link (both published field conventions)."""
        try:
            with open(path) as f:
                doc = json.load(f)
        except FileNotFoundError as exc:
            raise GraphError(f"graph file {os.fspath(path)!r} does not exist") from exc
        except json.JSONDecodeError as exc:
            raise GraphError(f"graph file {os.fspath(path)!r} is not valid JSON: {exc}") from exc
        stem = os.path.splitext(os.path.basename(os.fspath(path)))[0]
        return cls.from_dict(doc, name=stem)

    def replace(self, **changes: Any) -> "Graph":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def load_graph(path):
    """Read a graph file; same as :meth:`Graph.load`."""
    return Graph.load(path)


# --------------------------------------------------------------------- helpers
def _from_native(doc: dict) -> Graph:
    if doc.get("version", 1) != VERSION:
        raise GraphError(f"graph format version {doc.get('version')} is not supported "
                         f"(this tf-remat reads version {VERSION})")
    nodes = doc.get("nodes")
    if not isinstance(nodes, list):
        raise GraphError("graph document has no 'nodes' list")
    n = len(nodes)
    by_id = {}
    for k, node in enumerate(nodes):
        if "id" not in node:
            raise GraphError(f"node #{k} has no 'id'")
        i = node["id"]
        if not isinstance(i, int) or not 0 <= i < n:
            raise GraphError(f"node id {i!r} is out of range: ids must be 0..{n - 1}")
        if i in by_id:
            raise GraphError(f"node id {i} appears twice")
        for key in ("cost", "memory"):
            if key not in node:
                raise GraphError(f"node {i} has no '{key}'")
        by_id[i] = node
    ordered = [by_id[i] for i in range(n)]
    edges = doc.get("edges", [])
    return Graph(
        cost=[x["cost"] for x in ordered], memory=[x["memory"] for x in ordered],
        edges=[tuple(e) for e in edges], order=doc.get("order"), outputs=doc.get("outputs"),
        fixed_memory=doc.get("fixed_memory", 0),
        backward=[x.get("backward", False) for x in ordered],
        recomputable=[x.get("recomputable", True) for x in ordered],
        names=[x.get("name", str(x["id"])) for x in ordered], name=doc.get("name", "graph"))


def _from_node_link(doc: dict, *, name: str | None) -> Graph:
    nodes = doc["nodes"]
    links = doc.get("links", doc.get("edges"))
    if not nodes:
        raise GraphError("graph has no nodes")
    first = nodes[0]
    key = "id" if "id" in first else "name"
    if "duration" in first:
        cost_key, mem_key = "duration", "out_cost"
    elif "cost_cpu" in first:
        cost_key, mem_key = "cost_cpu", "cost_ram"
    else:
        raise GraphError("node-link graph nodes need 'duration'/'out_cost' or "
                         "'cost_cpu'/'cost_ram' fields")
    raw_ids = [nd.get(key) for nd in nodes]
    if any(r is None for r in raw_ids):
        raise GraphError(f"every node needs an '{key}'")
    try:
        raw_sorted = sorted(raw_ids)
    except TypeError:
        raw_sorted = list(raw_ids)
    index = {r: i for i, r in enumerate(raw_sorted)}
    if len(index) != len(raw_ids):
        raise GraphError("node ids repeat in the node-link document")
    ordered = [None] * len(nodes)
    for nd in nodes:
        ordered[index[nd[key]]] = nd

    def endpoint(link, a, b):
        v = link.get(a, link.get(b))
        if v not in index:
            raise GraphError(f"link {link} names node {v!r}, which is not in 'nodes'")
        return index[v]

    edges = [(endpoint(l, "source", "0"), endpoint(l, "target", "1")) for l in links]
    meta = doc.get("graph") or {}
    order = meta.get("order")
    if order is not None:
        order = [index[r] if r in index else index.get(int(r), -1) for r in order]
    gname = meta.get("name") or name or "graph"
    names = [str(nd.get("name", nd.get(key))) for nd in ordered]
    fixed = sum(int(nd.get("param_cost", 0) or 0) for nd in ordered)
    return Graph(cost=[nd[cost_key] for nd in ordered], memory=[nd[mem_key] for nd in ordered],
                 edges=edges, order=order, fixed_memory=fixed,
                 backward=[nd.get("backward", False) for nd in ordered],
                 names=names, name=str(name or gname))


def _articulation_points(adj: dict) -> set:
    """Iterative Hopcroft-Tarjan on an undirected adjacency dict."""
    disc, low, result = {}, {}, set()
    t = 0
    for root in adj:
        if root in disc:
            continue
        disc[root] = low[root] = t
        t += 1
        children = 0
        stack = [(root, None, iter(adj[root]))]
        while stack:
            v, parent, it = stack[-1]
            w = next(it, None)
            if w is None:
                stack.pop()
                if stack:
                    p = stack[-1][0]
                    low[p] = min(low[p], low[v])
                    if stack[-1][1] is not None and low[v] >= disc[p]:
                        result.add(p)
                continue
            if w == parent:
                continue
            if w in disc:
                low[v] = min(low[v], disc[w])
            else:
                disc[w] = low[w] = t
                t += 1
                if v == root:
                    children += 1
                stack.append((w, v, iter(adj[w])))
        if children > 1:
            result.add(root)
    return result


def _digest(parts) -> str:
    import hashlib

    return hashlib.sha1(repr(parts).encode()).hexdigest()[:16]
