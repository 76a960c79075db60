import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
# The published benchmark graphs live beside the checkout in development; a user's clone has none.
SHARED_GRAPHS = os.environ.get("TF_REMAT_SHARED_GRAPHS",
                               os.path.join(ROOT, "..", "shared", "benchmarks", "graphs"))


def load_tool(name):
    """``tools/<name>.py`` as a module (the tools are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools",
                                                                     name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shared_graph(name):
    path = os.path.join(SHARED_GRAPHS, name + ".json")
    if not os.path.exists(path):
        pytest.skip(f"published graph {name} not available (set TF_REMAT_SHARED_GRAPHS)")
    return path
