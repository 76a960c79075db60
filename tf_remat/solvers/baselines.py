"""Classic checkpointing heuristics (the baselines of Checkmate, Jain et al. 2020, §6).

All share one engine, :func:`segment_schedule`: run ``order`` once; a *checkpoint* keeps its
value, every other forward value is dropped once the run passes the next checkpoint, and a
later reader of a dropped value recomputes it (and whatever else it needs) from the nearest
kept values. The strategies differ in which nodes may be checkpoints and how many are chosen:

* ``chen-*``: candidates are the forward nodes in order (Chen et al. 2016, for chains);
* ``ap-*``: candidates are the articulation points of the forward graph (Checkmate's
  generalization: keeping one separates the graph, so segments recompute independently);
* ``linearized-*``: candidates are all nodes of the topological order, backward ones included
  (the whole graph treated as one chain);
* ``*-sqrtn``: every ceil(sqrt(k))-th of the k candidates; ``*-greedy``: Chen's greedy rule (a
  checkpoint once the memory since the last one exceeds a threshold b), searched over b for the
  cheapest plan the simulator finds within the budget;
* ``griewank-logn``: binomial checkpointing (Griewank & Walther's revolve) of the forward chain
  with ceil(log2 n) snapshots, its split points computed by dynamic programming here.

Non-recomputable nodes are always kept, so no strategy computes them twice. Every result goes
through the simulator in :func:`tf_remat.solvers.solve`.
"""

from __future__ import annotations

import math
import time

import numpy as np

from tf_remat.graph import Graph
from tf_remat.plan import Schedule, simulate, steps_from_sequence
from tf_remat.solvers import register

__all__ = ["segment_schedule", "revolve_schedule", "checkpoint_all", "chen_sqrtn",
           "chen_greedy", "ap_sqrtn", "ap_greedy", "linearized_sqrtn", "linearized_greedy",
           "griewank_logn"]


# --------------------------------------------------------------------- strategies
@register("checkpoint-all", "keep every value; the reference order run once (no recomputation)")
def checkpoint_all(graph, budget, *, time_limit=None, seed=0, progress=None):
    return Schedule(sequence=graph.order, status="feasible", lower_bound=graph.total_cost,
                    info={"checkpoints": graph.n})


@register("chen-sqrtn", "Chen et al. sqrt(n): every sqrt(k)-th forward node is a checkpoint")
def chen_sqrtn(graph, budget, *, time_limit=None, seed=0, progress=None):
    return _sqrtn(graph, _forward_candidates(graph))


@register("chen-greedy", "Chen et al. greedy: memory-threshold checkpoints over forward nodes, "
                         "threshold searched for the budget")
def chen_greedy(graph, budget, *, time_limit=None, seed=0, progress=None):
    return _greedy(graph, budget, _forward_candidates(graph), time_limit, progress)


@register("ap-sqrtn", "sqrt(n) over articulation points of the forward graph")
def ap_sqrtn(graph, budget, *, time_limit=None, seed=0, progress=None):
    return _sqrtn(graph, _ap_candidates(graph))


@register("ap-greedy", "greedy over articulation points of the forward graph, threshold searched")
def ap_greedy(graph, budget, *, time_limit=None, seed=0, progress=None):
    return _greedy(graph, budget, _ap_candidates(graph), time_limit, progress)


@register("linearized-sqrtn", "sqrt(n) over the whole topological order treated as a chain")
def linearized_sqrtn(graph, budget, *, time_limit=None, seed=0, progress=None):
    return _sqrtn(graph, _linear_candidates(graph))


@register("linearized-greedy", "greedy over the whole topological order treated as a chain, "
                               "threshold searched")
def linearized_greedy(graph, budget, *, time_limit=None, seed=0, progress=None):
    return _greedy(graph, budget, _linear_candidates(graph), time_limit, progress)


@register("griewank-logn", "Griewank-Walther binomial checkpointing with log2(n) snapshots",
          options={"snapshots": (int, 0, "snapshots (0: ceil(log2 n))")})
def griewank_logn(graph, budget, *, time_limit=None, seed=0, progress=None, snapshots=0):
    chain = [v for v in graph.forward_nodes if graph.recomputable[v]]
    s = snapshots or max(1, math.ceil(math.log2(max(2, len(chain)))))
    seq = revolve_schedule(graph, s)
    return Schedule(sequence=seq, status="feasible", info={"snapshots": s})


# --------------------------------------------------------------------- engine
def segment_schedule(graph: Graph, checkpoints) -> tuple:
    """The compute sequence that keeps ``checkpoints`` and recomputes the rest on demand.

    Forward values computed since the last checkpoint may be read directly; passing a
    checkpoint in the forward run drops them. A read of a dropped value recomputes it together
    with its dropped ancestors (in order), and during the backward pass those copies are kept
    for later readers. Backward and non-recomputable nodes are never recomputed.

    >>> from tf_remat.generators import linear_graph
    >>> g = linear_graph(4)
    >>> [g.names[v] for v in segment_schedule(g, {1})]
    ['f0', 'f1', 'f2', 'f3', 'loss', 'b3', 'b2', 'b1', 'f0', 'b0']
    """
    keep = set(checkpoints)
    keep.update(v for v in range(graph.n) if not graph.recomputable[v] or graph.backward[v])
    preds, pos = graph.preds, graph.position
    seq: list = []
    live: set = set()
    done: set = set()
    for w in graph.order:
        missing = [u for u in preds[w] if u not in keep and u not in live]
        if missing:
            seq.extend(_closure(missing, preds, pos, keep, live))
        seq.append(w)
        done.add(w)
        if not graph.backward[w]:
            if w in keep:
                live.clear()
            else:
                live.add(w)
    return tuple(seq)


def _closure(targets, preds, pos, keep, live):
    """Dropped ancestors of ``targets`` (themselves included), in order; marks them live."""
    need, stack = set(), list(targets)
    while stack:
        v = stack.pop()
        if v in need:
            continue
        need.add(v)
        stack.extend(u for u in preds[v] if u not in keep and u not in live and u not in need)
    out = sorted(need, key=pos.__getitem__)
    live.update(out)
    return out


def revolve_schedule(graph: Graph, snapshots: int) -> tuple:
    """Binomial checkpointing of the forward chain with ``snapshots`` snapshots.

    ``F[s][l]``, the least forward recomputations to reverse ``l`` chain steps from a kept
    value with ``s`` free snapshots, obeys ``F[s][l] = min_m m + F[s-1][l-m] + F[s][m-1]``
    (advance m steps, keep that value, reverse the upper part with one snapshot fewer, then the
    lower part); ``F[0][l] = l(l+1)/2``. The forward run keeps the split points of the top level;
    a backward read of a dropped value advances from the nearest kept value below it, keeping
    the split points of that level, which is Griewank & Walther's revolve on the chain. Values a
    backward node reads that the chain view does not provide are recomputed as in
    :func:`segment_schedule`.
    """
    chain = [v for v in graph.forward_nodes if graph.recomputable[v]]
    n = len(chain)
    if n < 2 or snapshots < 1:
        return tuple(graph.order)
    split = _revolve_splits(n, snapshots)
    index = {v: i for i, v in enumerate(chain)}
    preds, pos = graph.preds, graph.position
    always = {v for v in range(graph.n) if not graph.recomputable[v] or graph.backward[v]}
    stored: set = set()
    # top-level split points kept by the forward run
    c, l, s = -1, n, snapshots
    while l > 1 and s > 0:
        m = int(split[s, l])
        stored.add(chain[c + m])
        c, l, s = c + m, l - m, s - 1
    seq: list = []
    live: set = set()
    for w in graph.order:
        if graph.backward[w]:
            # transient copies serve this backward node only; stored ones stay
            live = {v for v in live if v in stored or v in always}
            for u in preds[w]:
                if u in always or u in live:
                    continue
                if u in index:
                    seq.extend(_advance(index[u], chain, stored, live, always, split,
                                        snapshots, preds, pos))
                if u not in live:
                    seq.extend(_closure([u], preds, pos, always | stored, live))
        else:
            missing = [u for u in preds[w] if u not in always and u not in live]
            if missing:
                seq.extend(_closure(missing, preds, pos, always | stored, live))
            live.add(w)
        seq.append(w)
        if not graph.backward[w]:
            live.add(w)
        # stored values above the point the backward pass has reached are dead weight
    return tuple(seq)


def _advance(i, chain, stored, live, always, split, snapshots, preds, pos):
    """Recompute chain[i] from the nearest stored value below it, storing revolve splits."""
    below = [k for k in range(i - 1, -1, -1) if chain[k] in stored or chain[k] in always]
    c = below[0] if below else -1
    s = snapshots - sum(1 for k in range(c + 1) if chain[k] in stored)
    l = i - c
    targets = []
    while l > 1 and s > 0:
        m = int(split[s, l])
        stored.add(chain[c + m])
        targets.append(chain[c + m])
        c, l, s = c + m, l - m, s - 1
    targets.append(chain[i])
    for v in list(stored):  # stores above i are past: forget them so they free
        if pos[v] > pos[chain[i]]:
            stored.discard(v)
    return _closure(targets, preds, pos, always | (stored - set(targets)), live)


def _revolve_splits(n: int, smax: int):
    """``split[s, l]``: the best first advance for reversing l steps with s snapshots."""
    big = np.iinfo(np.int64).max // 4
    F = np.zeros((smax + 1, n + 1), dtype=np.int64)
    split = np.ones((smax + 1, n + 1), dtype=np.int64)
    ls = np.arange(n + 1)
    F[0] = ls * (ls + 1) // 2
    for s in range(1, smax + 1):
        F[s, 0], F[s, 1] = 0, 1
        for l in range(2, n + 1):
            m = np.arange(1, l)
            vals = m + F[s - 1, l - m] + F[s, m - 1]
            k = int(np.argmin(vals))
            F[s, l] = min(int(vals[k]), big)
            split[s, l] = k + 1
    return split


# --------------------------------------------------------------------- candidate sets
def _forward_candidates(graph):
    return [v for v in graph.forward_nodes if graph.recomputable[v]]


def _ap_candidates(graph):
    aps = [v for v in graph.articulation_points() if graph.recomputable[v]]
    return aps or _forward_candidates(graph)


def _linear_candidates(graph):
    return [v for v in graph.order if graph.recomputable[v]]


def _sqrtn(graph, candidates):
    k = len(candidates)
    if k == 0:
        return Schedule(sequence=graph.order, status="feasible", info={"checkpoints": 0})
    step = max(1, math.ceil(math.sqrt(k)))
    chosen = set(candidates[step - 1::step])
    return Schedule(sequence=segment_schedule(graph, chosen), status="feasible",
                    info={"checkpoints": len(chosen), "candidates": k})


def _greedy(graph, budget, candidates, time_limit, progress):
    """Chen's greedy rule over thresholds b; keep the cheapest plan within budget."""
    start = time.perf_counter()
    mem = [graph.memory[v] for v in candidates]
    total = sum(mem)
    thresholds = set()
    if total:
        lo = max(1, min(m for m in mem if m > 0) if any(mem) else 1)
        for x in np.geomspace(lo, total, 60):
            thresholds.add(int(x))
        root = int(math.sqrt(max(1, len(candidates))))
        thresholds.add(int(total / max(1, root)))
    best = None  # (within, cost, peak, seq, b)
    seen = set()
    for b in sorted(thresholds):
        if time_limit is not None and time.perf_counter() - start > time_limit:
            break
        chosen, acc = [], 0
        for v, m in zip(candidates, mem):
            acc += m
            if acc > b:
                chosen.append(v)
                acc = 0
        key = tuple(chosen)
        if key in seen:
            continue
        seen.add(key)
        seq = segment_schedule(graph, chosen)
        sim = simulate(graph, steps_from_sequence(graph, seq))
        within = sim.peak_memory <= budget
        rank = (not within, sim.cost if within else sim.peak_memory)
        if best is None or rank < best[0]:
            best = (rank, seq, b, len(chosen))
            if progress is not None and within:
                progress(cost=sim.cost, peak=sim.peak_memory)
    if best is None:
        return Schedule(sequence=graph.order, status="feasible", info={"checkpoints": graph.n})
    return Schedule(sequence=best[1], status="feasible",
                    info={"threshold": best[2], "checkpoints": best[3],
                          "candidates": len(candidates)})
