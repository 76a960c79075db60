"""Start a solver module in a fresh interpreter (the CP-SAT and HiGHS child processes)."""

from __future__ import annotations

import os
import subprocess
import sys


def spawn_module(module: str, env_var: str, **popen_kwargs) -> subprocess.Popen:
    """``python -m module`` with stdin / stdout pipes, never a fork: the caller may have
    TensorFlow loaded. ``env_var`` is set to ``0`` in the child so that it does not isolate
    itself again."""
    env = dict(os.environ)
    env[env_var] = "0"
    # the child imports this very copy of tf_remat, installed or not
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env, **popen_kwargs)
