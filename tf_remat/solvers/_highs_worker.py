"""Run the Checkmate model's HiGHS solves in a child process that is killed at the deadline.

HiGHS looks at the clock (its ``time_limit`` and the interrupt callbacks) only in some phases.
On a model of about 10M nonzeros (``random_layered_n500``) presolve, the root LP and cut
separation run for 10-25 s without a check, so ``checkmate-milp`` with ``time_limit=60`` took
57-83 s, ending "Interrupted by user" long after the callback was asked to stop it. Native code
cannot be stopped from another thread, only its process can. So with a time limit and a model
above :data:`ISOLATE_NONZEROS`, :class:`HighsWorker` builds the model and runs HiGHS in a fresh
interpreter (``python -m``, never a fork: the caller may have TensorFlow loaded, and the child
never imports it). The child streams every improving incumbent (as stages) and the dual bound
back; at the deadline the parent kills it and keeps the last of them.

``TF_REMAT_HIGHS_SUBPROCESS=1`` (or ``0``) forces the choice either way.

Protocol: pickled messages. The parent writes the job (graph, order, budget) and then solve
requests to the child's stdin; the child answers on a duplicate of its original stdout (fd 1
then points at stderr, so nothing HiGHS prints can corrupt the stream) with ``("ready", s)``,
``("incumbent", {...})``, ``("bound", {...})``, ``("done", result)`` or ``("error", text)``.
"""

from __future__ import annotations

import math
import os
import pickle
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time

from tf_remat.solvers._child import spawn_module

__all__ = ["HighsWorker", "should_isolate", "ISOLATE_NONZEROS"]

_ENV = "TF_REMAT_HIGHS_SUBPROCESS"
#: below this many nonzeros HiGHS's unchecked phases last well under a second (n=100 layered
#: graph: 230k nonzeros, within 0.1 s of a 3 s limit), which a child process (about a second of
#: interpreter start-up) would not be worth
ISOLATE_NONZEROS = 200_000


def should_isolate(nonzeros: int, time_limit) -> bool:
    """Whether a HiGHS solve of a model this large must run in a killable child process."""
    forced = os.environ.get(_ENV, "").strip().lower()
    if forced:
        return forced not in ("0", "false", "no")
    return time_limit is not None and nonzeros > ISOLATE_NONZEROS


class HighsWorker:
    """A child process holding one :class:`~tf_remat.solvers.checkmate.CheckmateModel`.

    It starts building the model at once (so the build overlaps the caller's first plans);
    :meth:`solve` answers like ``CheckmateModel.solve`` (``values`` left out: the child sends
    ``stages`` or ``s``, not the full column vector) and never runs past its deadline.
    """

    def __init__(self, graph, order, budget: int):
        self._err = tempfile.TemporaryFile()
        self.proc = spawn_module("tf_remat.solvers._highs_worker", _ENV, stderr=self._err)
        self.dead = None  # why the child is gone, once it is
        self.build_seconds = None
        self._reaper = None
        self._q = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._send({"graph": graph.to_dict(), "order": [int(v) for v in order],
                    "budget": int(budget)})

    # ---------------------------------------------------------------- plumbing
    def _send(self, msg):
        try:
            pickle.dump(msg, self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self.proc.stdin.flush()
        except OSError:  # the child is gone: the reader reports how
            pass

    def _read(self):
        out = self.proc.stdout
        while True:
            try:
                msg = pickle.load(out)
            except Exception:  # noqa: BLE001 - EOF or a torn message: the child is gone
                self._q.put(("eof", None))
                return
            self._q.put(msg)

    def _exit_reason(self):
        try:
            code = self.proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            code = None
        why = f"the HiGHS child process exited with code {code}"
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            why = f"the HiGHS child process was killed by {name}"
            if code == -signal.SIGKILL:
                why += " (out of memory?)"
        try:
            self._err.seek(0)
            lines = [ln for ln in self._err.read().decode(errors="replace").splitlines()
                     if ln.strip()]
        except OSError:
            lines = []
        if lines:
            why += f": {lines[-1].strip()[:300]}"
        return why

    def close(self):
        """Kill the child (it holds nothing worth a graceful exit) without waiting for it."""
        if self.proc.poll() is None:
            try:
                self.proc.kill()
            except OSError:
                pass
        if self.dead is None:
            self.dead = "closed"
        # freeing a few GiB takes a moment: reap it off the caller's clock, in one thread
        # (close runs again on __exit__, and two reapers closing one pipe race: CI saw
        # "I/O operation on closed file" from the second)
        if self._reaper is None:
            self._reaper = threading.Thread(target=self._reap, daemon=True)
            self._reaper.start()

    def _reap(self):
        try:
            self.proc.wait()
        finally:
            for f in (self.proc.stdin, self._err):
                try:
                    f.close()
                except (OSError, ValueError):  # a broken pipe's flush; closed elsewhere
                    pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---------------------------------------------------------------- solving
    def solve(self, *, integral, deadline, seed=0, progress=None, total=0.0, warm=None,
              allowance=0.0, model=None):
        """One HiGHS solve in the child, returned by ``deadline`` whatever HiGHS is doing.

        ``model`` is this process's (unbuilt) CheckmateModel of the same graph, order and
        budget: its scaling turns objectives into costs for ``progress``. At the deadline the
        child is killed and the last incumbent and bound it streamed are returned
        (``status`` "timeout"); when it died of something else, ``status`` is "error" and
        ``info["error"]`` says how.
        """
        info = {"isolated": True}
        out = {"status": "timeout", "values": None, "objective": None, "bound": None,
               "stages": None, "s": None, "info": info}
        if self.dead is not None:
            info["highs_status"] = "not run"
            if self.dead != "killed at the time limit":
                out["status"] = "error"
                info["error"] = self.dead
            return out
        left = deadline.left()
        hard = time.perf_counter() + left
        # the child's clock: wall time, the one clock two processes agree on everywhere
        self._send({"integral": bool(integral), "end": time.time() + left if
                    math.isfinite(left) else None, "seed": int(seed),
                    "warm": warm, "allowance": float(allowance)})
        t0 = time.perf_counter()
        started = None
        while True:
            wait = hard - time.perf_counter()
            if wait <= 0:
                msg = None
            else:
                try:
                    msg = self._q.get(timeout=min(wait, 3600.0))
                except queue.Empty:
                    msg = None
            if msg is None:
                if math.isfinite(hard) and time.perf_counter() >= hard:
                    self.close()
                    self.dead = "killed at the time limit"
                    info["highs_status"] = "killed at the time limit"
                    break
                continue
            kind, data = msg
            if kind == "ready":
                self.build_seconds = data
                info["build_seconds"] = round(data, 3)
            elif kind == "started":
                started = time.perf_counter()
            elif kind == "incumbent":
                out["stages"] = data["stages"]
                out["objective"] = data["objective"]
                if data["bound"] is not None:
                    out["bound"] = data["bound"]
                if progress is not None and model is not None:
                    self._progress(progress, model, total, data["objective"], out["bound"])
            elif kind == "bound":
                out["bound"] = data["bound"]
                if progress is not None and model is not None:
                    self._progress(progress, model, total, None, data["bound"])
            elif kind == "done":
                res = data
                res["info"].update(info)
                # keep what was streamed when HiGHS's own final answer lacks it
                for key in ("stages", "objective", "bound"):
                    if res[key] is None and out[key] is not None and res["status"] != "infeasible":
                        res[key] = out[key]
                if self.build_seconds is not None:
                    res["info"]["build_seconds"] = round(self.build_seconds, 3)
                return res
            elif kind == "error":
                self.close()
                self.dead = f"the HiGHS child process failed: {data}"
                out["status"] = "error"
                info["error"] = self.dead
                break
            elif kind == "eof":
                self.dead = self._exit_reason()
                self.close()
                out["status"] = "error"
                info["error"] = self.dead
                break
        info["highs_seconds"] = round(time.perf_counter() - (started or t0), 3)
        if integral:
            obj, bound = out["objective"], out["bound"]
            info["mip_gap"] = (abs(obj - bound) / max(abs(obj), 1e-12)
                               if obj is not None and bound is not None else None)
        return out

    @staticmethod
    def _progress(progress, model, total, objective, bound):
        cost = total + objective * model.scale.cost_unit if objective is not None else None
        lbv = total + model.scale.true_bound(bound, model.max_extra) \
            if bound is not None else None
        progress(cost=cost, lower_bound=lbv)


# --------------------------------------------------------------------- the child
def _child_main() -> int:  # pragma: no cover - runs in the child process
    # answers go to the original stdout; fd 1 becomes stderr so that no native print (HiGHS,
    # numpy warnings) can tear a message
    chan = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer

    def emit(kind, data=None):
        pickle.dump((kind, data), chan, protocol=pickle.HIGHEST_PROTOCOL)
        chan.flush()

    try:
        job = pickle.load(inp)
        from tf_remat.graph import Graph
        from tf_remat.solvers._staged import Deadline, Positions
        from tf_remat.solvers.checkmate import CheckmateModel

        t0 = time.perf_counter()
        graph = Graph.from_dict(job["graph"])
        model = CheckmateModel(Positions(graph, job["order"]), job["budget"])
        model.build()
        emit("ready", time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which decides
        emit("error", f"{type(exc).__name__}: {exc}")
        return 1
    while True:
        try:
            req = pickle.load(inp)
        except EOFError:
            return 0
        try:
            left = None if req["end"] is None else max(0.0, req["end"] - time.time())
            emit("started")
            res = model.solve(integral=req["integral"], deadline=Deadline(left),
                              seed=req["seed"], warm=req["warm"], allowance=req["allowance"],
                              report=lambda kind, **data: emit(kind, data))
            res["values"] = None  # millions of columns: the parent needs stages or S only
            emit("done", res)
        except Exception as exc:  # noqa: BLE001
            emit("error", f"{type(exc).__name__}: {exc}")
            return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(_child_main())
