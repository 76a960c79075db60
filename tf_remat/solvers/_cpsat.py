"""Run a CP-SAT solve, in this process or, where that would crash, in a child process.

OR-Tools 9.15 and TensorFlow 2.21 each bundle their own abseil and protobuf. Once TensorFlow is
loaded, OR-Tools' native module binds to TensorFlow's copies and ``CpSolver.solve`` (and even
``CpModel.export_to_file``) dies with a segmentation fault, on every model, with or without
callbacks. Loading OR-Tools first avoids it, but a Keras user has imported TensorFlow long
before calling us. HiGHS (through SciPy) is unaffected.

So a strategy that uses CP-SAT calls :func:`run_isolated` first: when TensorFlow is in
``sys.modules`` the whole strategy (model building, solving, decoding) runs in a fresh
interpreter that never loads TensorFlow, fed the graph as JSON. Progress reports stream back
line by line, and a crash there costs the solve, not the user's session.

``TF_REMAT_CPSAT_SUBPROCESS=1`` (or ``0``) forces the choice either way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tf_remat.plan import Schedule
from tf_remat.solvers._child import spawn_module

_ENV = "TF_REMAT_CPSAT_SUBPROCESS"
# a fresh interpreter importing numpy, scipy and OR-Tools takes about a second here
_SPAWN_SECONDS = 1.0


def needs_isolation() -> bool:
    """Whether a CP-SAT solve in this process would meet TensorFlow's native libraries."""
    forced = os.environ.get(_ENV, "").strip()
    if forced:
        return forced not in ("0", "false", "no")
    return "tensorflow" in sys.modules


def run_isolated(strategy: str, graph, budget: int, *, time_limit=None, seed: int = 0,
                 progress=None, **options) -> Schedule | None:
    """Run registered ``strategy`` in a child process when :func:`needs_isolation`.

    Returns the child's Schedule, or None when no isolation is needed (the caller goes on in
    this process). Options must be JSON-serializable (tuples come back as lists and are
    converted by the strategy itself).
    """
    if not needs_isolation():
        return None
    if time_limit is not None:
        time_limit = max(0.05, float(time_limit) - _SPAWN_SECONDS)
    job = {"strategy": strategy, "graph": graph.to_dict(), "budget": int(budget),
           "time_limit": time_limit, "seed": int(seed),
           "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in options.items()}}
    proc = spawn_module("tf_remat.solvers._cpsat", _ENV, stderr=subprocess.PIPE, text=True)
    final = None
    try:
        proc.stdin.write(json.dumps(job))
        proc.stdin.close()
        for line in proc.stdout:
            msg = json.loads(line)
            if "progress" in msg:
                if progress is not None:
                    progress(**msg["progress"])
            else:
                final = msg
        err = proc.stderr.read()
        proc.wait()
    except BaseException:  # KeyboardInterrupt included: never leave a solver running
        proc.kill()
        proc.wait()
        raise
    if final is None:
        tail = [ln for ln in (err or "").strip().splitlines() if ln.strip()][-1:]
        why = f"{strategy} child process exited with code {proc.returncode}"
        if tail:
            why += f": {tail[0]}"
        return Schedule(sequence=(), status="timeout", info={"error": why, "isolated": True})
    if "error" in final:
        from tf_remat.errors import StrategyError

        raise StrategyError(final["error"])
    info = dict(final["info"])
    info["isolated"] = True
    return Schedule(sequence=tuple(final["sequence"]), status=final["status"],
                    lower_bound=final["lower_bound"], solve_seconds=final["solve_seconds"],
                    info=info)


def _child_main() -> int:
    from tf_remat.errors import RematError
    from tf_remat.graph import Graph
    from tf_remat.solvers import get_strategy

    job = json.loads(sys.stdin.read())

    def emit(msg):
        sys.stdout.write(json.dumps(msg,
                                    default=lambda o: o.item() if hasattr(o, "item") else str(o))
                         + "\n")
        sys.stdout.flush()

    def progress(**kw):
        emit({"progress": kw})

    try:
        graph = Graph.from_dict(job["graph"])
        opts = job["options"]
        if isinstance(opts.get("hint"), list):
            opts["hint"] = tuple(opts["hint"])
        strat = get_strategy(job["strategy"])
        s = strat.func(graph, job["budget"], time_limit=job["time_limit"], seed=job["seed"],
                       progress=progress, **opts)
    except RematError as e:
        emit({"error": str(e)})
        return 0
    emit({"sequence": [int(v) for v in s.sequence], "status": s.status,
          "lower_bound": s.lower_bound, "solve_seconds": s.solve_seconds, "info": s.info})
    return 0


if __name__ == "__main__":  # pragma: no cover - exercised through run_isolated in a child
    sys.exit(_child_main())
