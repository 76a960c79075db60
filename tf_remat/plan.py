"""Execution plans and the one memory simulator every solver's result passes through.

A *schedule* is what a solver returns: a compute sequence (node ids, repeats meaning
recomputation) with its status. A :class:`Plan` is the executable form: ``compute``/``free``
steps with the peak memory and cost that :func:`simulate` (never the solver) measured.

Semantics (``DESIGN.md``): memory starts at ``fixed_memory`` with nothing resident;
``compute v`` needs all of v's inputs resident and v not resident, adds ``memory[v]`` and
``cost[v]``; the peak is taken right after each compute, so a node's inputs and its output count
together; ``free v`` needs v resident. At the end every node was computed at least once, every
output is resident, and no non-recomputable node was computed twice.

Example (a 4-node chain):
    >>> from tf_remat.graph import Graph
    >>> g = Graph(cost=(1, 2, 3, 4), memory=(10, 20, 30, 40), edges=((0, 1), (1, 2), (2, 3)))
    >>> steps = steps_from_sequence(g, [0, 1, 2, 3])
    >>> steps  # doctest: +NORMALIZE_WHITESPACE
    (('compute', 0), ('compute', 1), ('free', 0), ('compute', 2), ('free', 1), ('compute', 3),
     ('free', 2))
    >>> sim = simulate(g, steps)
    >>> sim.peak_memory, sim.cost
    (70, 10.0)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Sequence

from tf_remat.errors import PlanError
from tf_remat.graph import Graph

__all__ = [
    "STATUSES",
    "Schedule",
    "Plan",
    "Simulation",
    "simulate",
    "steps_from_sequence",
    "sequence_from_steps",
    "make_plan",
    "minimal_r",
    "sequence_from_rs",
    "plan_from_rs",
    "explain",
    "load_plan",
    "concurrent_groups",
    "adjoin",
    "defer",
    "run_cost",
]

STATUSES = ("optimal", "feasible", "infeasible", "timeout")
FORMAT = "tf-remat-plan"
VERSION = 1


@dataclasses.dataclass(frozen=True)
class Schedule:
    """What a strategy returns.

    Args:
        sequence: node ids in compute order; a repeated id is a recomputation. Empty when the
            strategy found nothing.
        status: ``optimal`` (proven), ``feasible`` (within budget, not proven optimal),
            ``infeasible`` (nothing within budget; ``sequence`` may hold the best over-budget
            one), ``timeout`` (the time limit passed before any plan was found).
        lower_bound: a proven lower bound on the cost of any plan the strategy's model covers
            (for fixed-order solvers: the fixed order), or None.
        solve_seconds: wall time of the solve.
        info: strategy-specific facts (for reports), JSON-able.
    """

    sequence: tuple = ()
    status: str = "feasible"
    lower_bound: float | None = None
    solve_seconds: float = 0.0
    info: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "sequence", tuple(int(v) for v in self.sequence))
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {STATUSES}")


@dataclasses.dataclass(frozen=True)
class Simulation:
    """What :func:`simulate` measured.

    ``timeline[k]`` is the memory right after step k (for plots); ``peak_step`` the step index
    where the peak is reached; ``compute_counts[v]`` how often v is computed.
    """

    peak_memory: int
    cost: float
    timeline: tuple
    peak_step: int
    compute_counts: tuple


@dataclasses.dataclass(frozen=True)
class Plan:
    """An allocate/compute/free execution plan checked by the simulator.

    ``peak_memory`` and ``cost`` are always the simulator's figures for ``steps`` on the graph
    the plan was made for. ``overhead`` is ``cost / total_cost - 1``.
    """

    graph: str
    strategy: str
    budget: int
    status: str
    peak_memory: int
    cost: float
    steps: tuple
    lower_bound: float | None = None
    solve_seconds: float = 0.0
    total_cost: float | None = None
    info: dict = dataclasses.field(default_factory=dict)

    @property
    def overhead(self) -> float | None:
        """Extra compute over running every node once (0.05 = 5%)."""
        if not self.total_cost:
            return None if self.total_cost is None else 0.0
        return self.cost / self.total_cost - 1.0

    @property
    def sequence(self) -> tuple:
        """The compute steps only."""
        return sequence_from_steps(self.steps)

    @property
    def found(self) -> bool:
        """Whether the plan holds any steps at all."""
        return bool(self.steps)

    @property
    def within_budget(self) -> bool:
        return bool(self.steps) and self.peak_memory <= self.budget

    def to_dict(self) -> dict:
        doc = {"format": FORMAT, "version": VERSION, "graph": self.graph,
               "strategy": self.strategy, "budget": self.budget, "status": self.status,
               "peak_memory": self.peak_memory, "cost": self.cost,
               "lower_bound": self.lower_bound, "solve_seconds": round(self.solve_seconds, 4),
               "total_cost": self.total_cost, "overhead": self.overhead,
               "steps": [list(s) for s in self.steps]}
        if self.info:
            doc["info"] = self.info
        return doc

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=None, separators=(",", ":"))
            f.write("\n")

    @classmethod
    def from_dict(cls, doc: dict) -> "Plan":
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise PlanError(f"not a plan document: expected format {FORMAT!r}, "
                            f"found {doc.get('format') if isinstance(doc, dict) else type(doc)!r}")
        steps = []
        for s in doc.get("steps", []):
            if not (isinstance(s, (list, tuple)) and len(s) == 2 and s[0] in ("compute", "free")):
                raise PlanError(f"plan step {s!r} is not ['compute', id] or ['free', id]")
            steps.append((s[0], int(s[1])))
        return cls(graph=doc.get("graph", ""), strategy=doc.get("strategy", ""),
                   budget=int(doc.get("budget", 0)), status=doc.get("status", "feasible"),
                   peak_memory=int(doc.get("peak_memory", 0)), cost=float(doc.get("cost", 0.0)),
                   steps=tuple(steps), lower_bound=doc.get("lower_bound"),
                   solve_seconds=float(doc.get("solve_seconds", 0.0)),
                   total_cost=doc.get("total_cost"), info=doc.get("info", {}))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        try:
            with open(path) as f:
                return cls.from_dict(json.load(f))
        except FileNotFoundError as exc:
            raise PlanError(f"plan file {os.fspath(path)!r} does not exist") from exc
        except json.JSONDecodeError as exc:
            raise PlanError(f"plan file {os.fspath(path)!r} is not valid JSON: {exc}") from exc


def load_plan(path) -> Plan:
    """Read a plan file; same as :meth:`Plan.load`."""
    return Plan.load(path)


# --------------------------------------------------------------------- the simulator
def simulate(graph: Graph, steps: Sequence) -> Simulation:
    """Run ``steps`` on ``graph`` under the exact memory semantics and check every rule.

    Raises:
        PlanError: naming the first step that breaks a rule.
    """
    n = graph.n
    mem_of, cost_of, preds = graph.memory, graph.cost, graph.preds
    resident = bytearray(n)
    counts = [0] * n
    mem = graph.fixed_memory
    peak, peak_step, cost = mem, -1, 0.0
    timeline = []
    for k, step in enumerate(steps):
        try:
            op, v = step
            v = int(v)
        except (TypeError, ValueError) as exc:
            raise PlanError(f"step {k} ({step!r}) is not ('compute'|'free', node)") from exc
        if not 0 <= v < n:
            raise PlanError(f"step {k} names node {v}, but ids run 0..{n - 1}")
        if op == "compute":
            if resident[v]:
                raise PlanError(f"step {k} computes {graph.label(v)}, which is already resident")
            for u in preds[v]:
                if not resident[u]:
                    raise PlanError(f"step {k} computes {graph.label(v)}, but its input "
                                    f"{graph.label(u)} is not resident")
            if counts[v] and not graph.recomputable[v]:
                raise PlanError(f"step {k} computes {graph.label(v)} again, but it is not "
                                "recomputable (stateful)")
            resident[v] = 1
            counts[v] += 1
            mem += mem_of[v]
            cost += cost_of[v]
            if mem > peak:
                peak, peak_step = mem, k
        elif op == "free":
            if not resident[v]:
                raise PlanError(f"step {k} frees {graph.label(v)}, which is not resident")
            resident[v] = 0
            mem -= mem_of[v]
        else:
            raise PlanError(f"step {k} has operation {op!r}; expected 'compute' or 'free'")
        timeline.append(mem)
    never = [v for v in range(n) if not counts[v]]
    if never:
        raise PlanError(f"the plan never computes {len(never)} node(s), "
                        f"e.g. {graph.label(never[0])}")
    gone = [o for o in graph.outputs if not resident[o]]
    if gone:
        raise PlanError(f"output {graph.label(gone[0])} is not resident at the end of the plan")
    return Simulation(peak_memory=int(peak), cost=float(cost), timeline=tuple(timeline),
                      peak_step=peak_step, compute_counts=tuple(counts))


def steps_from_sequence(graph: Graph, sequence: Sequence[int]) -> tuple:
    """Compute steps in ``sequence`` order, each value freed right after its last reader.

    A reader uses the latest copy of each input computed before it, so a copy lives from its
    compute to its last reader before the next recomputation of the same node (outputs' last
    copies live to the end). This is the least memory any plan with this compute sequence can
    use, so every strategy only has to choose the sequence.

    Raises:
        PlanError: if a node is computed before one of its inputs ever was.
    """
    seq = [int(v) for v in sequence]
    n = graph.n
    preds = graph.preds
    latest = [-1] * n       # position of v's newest copy
    free_at = {}            # copy (its compute position) -> position after which it is freed
    for p, v in enumerate(seq):
        if not 0 <= v < n:
            raise PlanError(f"sequence position {p} names node {v}, but ids run 0..{n - 1}")
        for u in preds[v]:
            q = latest[u]
            if q < 0:
                raise PlanError(f"sequence position {p} computes {graph.label(v)} before its "
                                f"input {graph.label(u)} was ever computed")
            free_at[q] = p
        if latest[v] >= 0 and free_at[latest[v]] < latest[v]:
            free_at[latest[v]] = latest[v]
        latest[v] = p
        free_at[p] = p
    for o in graph.outputs:
        if latest[o] >= 0:
            free_at[latest[o]] = math.inf
    frees = {}
    for q, p in free_at.items():
        if p != math.inf:
            frees.setdefault(p, []).append(seq[q])
    steps = []
    for p, v in enumerate(seq):
        steps.append(("compute", v))
        for u in sorted(frees.get(p, ())):
            steps.append(("free", u))
    return tuple(steps)


def sequence_from_steps(steps) -> tuple:
    """The compute steps of a plan, in order."""
    return tuple(int(v) for op, v in steps if op == "compute")


def make_plan(graph: Graph, schedule: Schedule, budget: int, *, strategy: str = "") -> Plan:
    """Turn a strategy's schedule into a :class:`Plan`, measured by the simulator.

    The status is corrected by the simulation: a schedule whose simulated peak is over budget is
    ``infeasible`` whatever the strategy said.
    """
    status = schedule.status
    if schedule.sequence:
        steps = steps_from_sequence(graph, schedule.sequence)
        sim = simulate(graph, steps)
        peak, cost = sim.peak_memory, sim.cost
        if peak > budget:
            status = "infeasible"
        elif status in ("infeasible", "timeout"):
            status = "feasible"
    else:
        steps, peak, cost = (), 0, 0.0
        if status in ("optimal", "feasible"):
            status = "infeasible"
    return Plan(graph=graph.name, strategy=strategy, budget=int(budget), status=status,
                peak_memory=peak, cost=cost, steps=steps, lower_bound=schedule.lower_bound,
                solve_seconds=schedule.solve_seconds, total_cost=graph.total_cost,
                info=dict(schedule.info))


# --------------------------------------------------------------------- Checkmate matrices
def minimal_r(graph: Graph, S) -> list:
    """The least computation R that realizes checkpoint matrix ``S`` (Checkmate, §4.9).

    Stage ``t`` (``0 <= t < n``) must compute ``order[t]``; ``S[t][v]`` says v is resident when
    stage t starts. R[t] holds ``order[t]``, every value stage t+1 is to find resident that
    stage t does not already have, and, recursively, every input of those that is neither
    resident from ``S[t]`` nor computed in the stage.

    Returns:
        R as a list of lists of 0/1, ``R[t][v]``.
    """
    n = graph.n
    T = n
    R = [[0] * n for _ in range(T)]
    preds = graph.preds
    for t in range(T):
        need = [graph.order[t]]
        if t + 1 < T:
            need += [v for v in range(n) if S[t + 1][v] and not S[t][v]]
        stack = list(need)
        while stack:
            v = stack.pop()
            if R[t][v]:
                continue
            R[t][v] = 1
            for u in preds[v]:
                if not S[t][u] and not R[t][u]:
                    stack.append(u)
    return R


def sequence_from_rs(graph: Graph, R) -> tuple:
    """The compute sequence of R: stage by stage, each stage in ``order``."""
    seq = []
    for t in range(len(R)):
        seq.extend(v for v in graph.order if R[t][v])
    return tuple(seq)


def plan_from_rs(graph: Graph, R, S=None, *, budget: int | None = None,
                 strategy: str = "", status: str = "feasible") -> Plan:
    """Checkmate's Algorithm 1 with early deallocation: a plan from (R, S) matrices.

    If ``R`` is None it is :func:`minimal_r` of ``S``. Values are freed right after their last
    reader (which is never later than ``S`` would keep them), so the peak is at most that of
    Checkmate's own deallocation pass.
    """
    if R is None:
        if S is None:
            raise ValueError("plan_from_rs needs R or S")
        R = minimal_r(graph, S)
    sched = Schedule(sequence=sequence_from_rs(graph, R), status=status)
    return make_plan(graph, sched, budget if budget is not None else 2**62, strategy=strategy)


# --------------------------------------------------------------------- explain
def explain(plan: Plan, graph: Graph, *, limit: int = 20) -> str:
    """What the plan keeps and what it recomputes, and what that costs.

    Returns a multi-line text: totals, then the recomputed nodes (most expensive extra cost
    first), then the values held longest (the ones that set the peak).
    """
    from tf_remat._units import format_bytes

    sim = simulate(graph, plan.steps)
    counts = sim.compute_counts
    recomputed = sorted((v for v in range(graph.n) if counts[v] > 1),
                        key=lambda v: -(counts[v] - 1) * graph.cost[v])
    lines = [
        f"plan {plan.strategy or '?'} for {graph.name}: peak {format_bytes(sim.peak_memory)} "
        f"(budget {format_bytes(plan.budget)}, no-remat {format_bytes(graph.no_remat_peak)}), "
        f"cost {sim.cost:.6g} "
        f"({(sim.cost / graph.total_cost - 1) * 100 if graph.total_cost else 0:.2f}% overhead)",
        f"recomputed {len(recomputed)} of {graph.n} nodes:",
    ]
    for v in recomputed[:limit]:
        lines.append(f"  {graph.label(v)}: computed {counts[v]}x, extra cost "
                     f"{(counts[v] - 1) * graph.cost[v]:.6g}, frees {format_bytes(graph.memory[v])}"
                     " between uses")
    if len(recomputed) > limit:
        lines.append(f"  ... and {len(recomputed) - limit} more")
    resident_at_peak = _resident_after(graph, plan.steps, sim.peak_step)
    held = sorted(resident_at_peak, key=lambda v: -graph.memory[v])
    lines.append(f"resident at the peak (step {sim.peak_step}), largest first:")
    for v in held[:limit]:
        lines.append(f"  {graph.label(v)}: {format_bytes(graph.memory[v])}"
                     f"{' (kept, computed once)' if counts[v] == 1 else ''}")
    return "\n".join(lines)


def concurrent_groups(graph: Graph, steps, cap: int | None = None, *,
                      transient: Sequence[int] = (), among=None) -> tuple:
    """Split a plan's computes into runs of adjacent computes that may run in any order or at
    once without the memory passing ``cap`` (default: the plan's own simulated peak).

    A run starts with the memory ``m`` the plan holds before its first compute; while it runs,
    every member may have allocated its output (and its ``transient`` bytes, what it holds only
    while it runs) and none have freed anything, so the memory stays under ``m`` plus all of
    that whatever the order. A compute joins the run while that sum stays within ``cap``, so a
    step that orders only the runs (a run waiting for the whole previous one) never holds more
    than the plan's peak, and the runtime may run the members of a run side by side. A node is
    never in a run twice (its copies would be indistinguishable).

    ``among``: if given, only computes of these nodes share a run (every other compute is a run
    of its own).

    Returns:
        per compute step, in order, the index of its run (non-decreasing from 0).
    """
    sim = simulate(graph, steps)
    if cap is None:
        cap = sim.peak_memory
    if transient and len(transient) != graph.n:
        raise ValueError(f"transient has {len(transient)} entries for {graph.n} nodes")
    extra = transient or (0,) * graph.n
    mem_of = graph.memory
    mem = graph.fixed_memory
    out = []
    run, start, held, members = -1, 0, 0, set()
    for op, v in steps:
        v = int(v)
        if op == "free":
            mem -= mem_of[v]
            continue
        if (run < 0 or v in members or start + held + mem_of[v] + extra[v] > cap
                or (among is not None and (v not in among or not members <= among))):
            run, start, held, members = run + 1, mem, 0, set()
        held += mem_of[v] + extra[v]
        members.add(v)
        out.append(run)
        mem += mem_of[v]
    return tuple(out)


def adjoin(graph: Graph, sequence: Sequence[int], nodes, cap: int | None = None) -> tuple:
    """Move each compute of ``nodes`` next to the compute of ``nodes`` before it, where the two
    are independent and the memory allows, so that a step may run them side by side.

    For a compute of ``w`` at position ``j`` whose previous compute of ``nodes`` is ``u`` at ``i``,
    the computes between them that ``w`` needs (through the copies it reads) move before ``u``,
    ``w`` right after it, the others after ``w``, each keeping its order. Skipped where ``w``
    reads ``u``'s copy (directly or through the moved computes), or where the new order's
    simulated peak passes ``cap`` (default: the sequence's own peak). Every node computes as
    often as before, so the cost is the same.

    What it is for: a static order runs a Bidirectional RNN's two directions one after the
    other, where TensorFlow runs the two loops at once; adjacent and independent, a step
    (:func:`tf_remat.rewrite.rewrite`, ``chain="node"``) lets them overlap again.

    Returns:
        the new compute sequence (``sequence`` itself where nothing moved).
    """
    seq = [int(v) for v in sequence]
    nodes = frozenset(int(v) for v in nodes)
    if len(nodes) < 2:
        return tuple(seq)
    if cap is None:
        cap = simulate(graph, steps_from_sequence(graph, seq)).peak_memory
    preds = graph.preds
    for j in range(len(seq)):
        w = seq[j]
        if w not in nodes:
            continue
        i = next((p for p in range(j - 1, -1, -1) if seq[p] in nodes), None)
        if i is None or i == j - 1 or seq[i] == w:
            continue
        # the computes between u and w that w reads through the copies it takes
        need, stack = set(), [j]
        dependent = False
        while stack:
            p = stack.pop()
            for x in preds[seq[p]]:
                q = _copy_read(seq, x, p)
                if q == i:
                    dependent = True
                    break
                if i < q < j and q not in need:
                    need.add(q)
                    stack.append(q)
            if dependent:
                break
        if dependent:
            continue
        window = range(i + 1, j)
        new = (seq[:i] + [seq[p] for p in window if p in need] + [seq[i], w]
               + [seq[p] for p in window if p not in need] + seq[j + 1:])
        if _fits(graph, new, cap):
            seq = new
    return tuple(seq)


def defer(graph: Graph, sequence: Sequence[int], after, cap: int | None = None) -> tuple:
    """Move the compute of each node ``u`` of ``after`` (a mapping: node -> nodes) to just after
    the last compute of ``after[u]`` that comes later, where nothing between reads ``u``'s copy
    and the new order's simulated peak stays within ``cap`` (default: the sequence's own peak).
    Only nodes computed once move; the cost is unchanged.

    What it is for: a variable's update placed before a node that reads the variable's value
    from before the update (the forward read a backward MatMul holds). TensorFlow then copies
    the variable on write and keeps both buffers until that reader runs, bytes no graph node
    carries, so the simulated peak would be short by them. After the last reader, the update
    finds the buffer unshared. (:func:`tf_remat.rewrite.defer_updates` builds ``after`` from
    a traced step.)

    Returns:
        the new compute sequence (``sequence`` itself where nothing moved).
    """
    seq = [int(v) for v in sequence]
    todo = {int(u): frozenset(int(r) for r in rs) - {int(u)} for u, rs in after.items()}
    todo = {u: rs for u, rs in todo.items() if rs and seq.count(u) == 1}
    if not todo:
        return tuple(seq)
    if cap is None:
        cap = simulate(graph, steps_from_sequence(graph, seq)).peak_memory
    succs = graph.succs
    for u, readers in sorted(todo.items(), key=lambda kv: seq.index(kv[0])):
        i = seq.index(u)
        j = max((p for p in range(i + 1, len(seq)) if seq[p] in readers), default=None)
        if j is None:
            continue
        # a compute in between that reads u's copy would lose it
        if any(seq[p] in succs[u] for p in range(i + 1, j + 1)):
            continue
        new = seq[:i] + seq[i + 1:j + 1] + [u] + seq[j + 1:]
        if _fits(graph, new, cap):
            seq = new
    return tuple(seq)


def _fits(graph: Graph, sequence, cap: int) -> bool:
    """Whether ``sequence`` is a valid plan whose simulated peak stays within ``cap``."""
    try:
        return simulate(graph, steps_from_sequence(graph, sequence)).peak_memory <= cap
    except PlanError:
        return False


def run_cost(graph: Graph, steps, runs=None) -> float:
    """The plan's cost where the computes of a run (``runs``: the run index of each compute,
    :func:`concurrent_groups`) run at once: each run costs its dearest member. A model for runs
    of loops, each running one small kernel after another on one core (a Bidirectional LSTM's
    two loops took 46 ms side by side and 60 one after the other, where the plain step took
    40). Without ``runs``, the plan's cost."""
    cost = graph.cost
    seq = sequence_from_steps(steps)
    if runs is None:
        return float(sum(cost[v] for v in seq))
    if len(runs) != len(seq):
        raise ValueError(f"runs has {len(runs)} entries for {len(seq)} computes")
    dearest = {}
    for r, v in zip(runs, seq):
        dearest[r] = max(dearest.get(r, 0.0), cost[v])
    return float(sum(dearest.values()))


def _copy_read(seq, x, p):
    """The position of the copy of ``x`` a compute at position ``p`` reads (the newest before)."""
    for q in range(p - 1, -1, -1):
        if seq[q] == x:
            return q
    return -1


def _resident_after(graph: Graph, steps, k: int) -> list:
    resident = set()
    for op, v in steps[: k + 1]:
        (resident.add if op == "compute" else resident.discard)(v)
    return sorted(resident)
