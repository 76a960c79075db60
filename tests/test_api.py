"""``tf_remat.optimize``: the public path from a Keras model and a budget to a training step.

Budgets are taken as the held-out check takes them: a fraction of the *measured* peak of the
model's plain training step. Tolerances are those of ``test_rewrite`` (see its docstring).
"""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import tf_remat  # noqa: E402
from tf_remat.errors import InfeasibleBudgetError  # noqa: E402
from test_rewrite import Snapshot, close, mlp, skip_cnn  # noqa: E402

pytestmark = pytest.mark.slow

FAST = dict(strategy="linearized-greedy", cost_model="flops", verbose=0, time_limit=20)


def fresh(builder, seed=3):
    keras.utils.set_random_seed(seed)
    return builder()


def data(xs, ys, n=None, seed=0):
    rng = np.random.default_rng(seed)
    n = n or xs.shape[0]
    x = rng.standard_normal((n,) + tuple(xs.shape[1:])).astype("float32")
    y = rng.integers(0, 10, (n,) + tuple(ys.shape[1:])).astype("int32")
    return x, y


def baseline_peak(model, xs, ys):
    """Measured peak of the model's plain training step (the variables are restored)."""
    from tf_remat.api import measure_step_peak
    from tf_remat.extract import trace_training_step

    ref = trace_training_step(model, xs, ys)
    x, y = data(xs, ys)
    return ref, measure_step_peak(ref.function, tf.constant(x), tf.constant(y),
                                  variables=ref.variables)["step_peak_bytes"]


def model_state(model):
    return [v.numpy().copy() for v in model.variables]


@pytest.mark.parametrize("builder, fraction", [(skip_cnn, 0.65), (mlp, 0.9)])
def test_optimized_step_trains_like_keras(builder, fraction):
    model, xs, ys = fresh(builder)
    ref, base = baseline_peak(model, xs, ys)
    budget = int(fraction * base)
    step = tf_remat.optimize(model, budget_bytes=budget, input_spec=xs, label_spec=ys, **FAST)
    rep = step.report
    assert rep["status"] in ("optimal", "feasible")
    assert rep["predicted_peak_bytes"] <= rep["solve_budget_bytes"] <= budget
    assert rep["measured_peak_bytes"] <= 1.05 * budget
    assert rep["recomputed_nodes"] > 0
    x, y = (tf.constant(a) for a in data(xs, ys, seed=1))
    variables = list({id(v): v for v in list(ref.variables) +
                      list(step.rewritten.traced.variables)}.values())
    snap = Snapshot(variables)
    try:
        l1 = float(ref.function(x, y))
        after1 = snap.now()
        snap.restore()
        l2 = float(step(x, y))
        after2 = snap.now()
    finally:
        snap.restore()
    assert abs(l1 - l2) <= 1e-4 * abs(l1)
    names = [v.name for v in variables]
    assert any("moving_mean" in n for n in names) or builder is mlp
    for n, a, b, s in zip(names, after1, after2, snap.values):
        assert close(a, b, float(np.abs(a).max())), (n, np.abs(a - b).max(), np.abs(a - s).max())
    measured = step.measure(x, y)["step_peak_bytes"]
    assert measured <= 1.05 * budget
    assert measured < 0.95 * base


def test_gradients_match_the_plain_gradients():
    from tf_remat.extract import trace_training_step

    model, xs, ys = fresh(skip_cnn)
    _, base = baseline_peak(model, xs, ys)
    step = tf_remat.optimize(model, budget_bytes=int(0.65 * base), input_spec=xs,
                             label_spec=ys, attach=False, **FAST)
    ref = trace_training_step(model, xs, ys, apply_updates=False)
    x, y = (tf.constant(a) for a in data(xs, ys, seed=2))
    snap = Snapshot(ref.variables)
    try:
        g1 = [t.numpy() for t in ref.function(x, y)[1:]]
        snap.restore()
        g2 = [t.numpy() for t in step.gradients(x, y)]
    finally:
        snap.restore()
    assert len(g2) == len(model.trainable_variables)
    scale = max(float(np.abs(g).max()) for g in g1)
    for i, (a, b) in enumerate(zip(g1, g2)):
        assert a.shape == b.shape == tuple(model.trainable_variables[i].shape)
        assert close(a, b, scale), (i, np.abs(a - b).max())


def test_fit_uses_the_rewritten_step(tmp_path):
    model, xs, ys = fresh(skip_cnn)
    _, base = baseline_peak(model, xs, ys)
    step = tf_remat.optimize(model, budget_bytes=int(0.65 * base), input_spec=xs,
                             label_spec=ys, **FAST)
    batches = []

    class Count(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            batches.append(float(logs["loss"]))

    before = model_state(model)
    x, y = data(xs, ys, n=2 * xs.shape[0] + 8)  # two full batches and a partial one
    calls = []
    original_call = step.__class__.__call__

    def counting_call(self, a, b):
        calls.append(int(a.shape[0]))
        return original_call(self, a, b)

    step.__class__.__call__ = counting_call
    try:
        history = model.fit(x, y, batch_size=xs.shape[0], epochs=2, verbose=0,
                            callbacks=[Count()], shuffle=False)
    finally:
        step.__class__.__call__ = original_call
    assert len(history.history["loss"]) == 2
    assert all(np.isfinite(history.history["loss"]))
    assert len(batches) == 6
    assert calls == [xs.shape[0], xs.shape[0], 8] * 2
    assert model.train_function == step._keras_train_function
    after = model_state(model)
    assert any(not np.array_equal(a, b) for a, b in zip(before, after))
    assert step.attached
    step.detach()
    assert not step.attached and "make_train_function" not in model.__dict__
    history = model.fit(x, y, batch_size=xs.shape[0], epochs=1, verbose=0)
    assert model.train_function != step._keras_train_function
    assert len(history.history["loss"]) == 1


def test_infeasible_budget_raises_and_changes_nothing():
    model, xs, ys = fresh(skip_cnn)
    model.optimizer.build(model.trainable_variables)
    before = model_state(model)
    with pytest.raises(InfeasibleBudgetError) as info:
        tf_remat.optimize(model, budget_bytes=2**20, input_spec=xs, label_spec=ys, **FAST)
    err = info.value
    assert err.budget == 2**20 and err.min_feasible > 2**20
    assert "smallest peak" in str(err) and "MiB" in str(err)
    after = model_state(model)
    assert len(before) == len(after)
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    assert "make_train_function" not in model.__dict__
    # the smallest budget the message names is reachable
    step = tf_remat.optimize(model, budget_bytes=int(err.min_feasible * 1.02), input_spec=xs,
                             label_spec=ys, attach=False, **{**FAST, "verify": False})
    assert step.report["predicted_peak_bytes"] <= err.min_feasible * 1.02


def test_budget_arguments_and_saved_artifacts(tmp_path):
    model, xs, ys = fresh(mlp)
    with pytest.raises(ValueError, match="exactly one"):
        tf_remat.optimize(model, input_spec=xs, label_spec=ys, **FAST)
    with pytest.raises(ValueError, match="exactly one"):
        tf_remat.optimize(model, 1.0, budget_bytes=10, input_spec=xs, label_spec=ys, **FAST)
    with pytest.raises(ValueError, match="positive"):
        tf_remat.optimize(model, budget_gb=-1, input_spec=xs, label_spec=ys, **FAST)
    step = tf_remat.optimize(model, budget_gb=1.0, input_spec=xs, label_spec=ys, attach=False,
                             **FAST)
    rep = step.report
    for key in ("strategy", "status", "budget_bytes", "predicted_peak_bytes",
                "baseline_peak_bytes", "predicted_overhead", "solve_seconds"):
        assert key in rep
    assert rep["budget_bytes"] == 2**30 and rep["strategy"] == "linearized-greedy"
    assert rep["baseline_peak_bytes"] == step.graph.no_remat_peak
    step.plan.save(tmp_path / "plan.json")
    step.graph.save(tmp_path / "graph.json")
    g = tf_remat.load_graph(tmp_path / "graph.json")
    p = tf_remat.load_plan(tmp_path / "plan.json")
    assert tf_remat.simulate(g, p.steps).peak_memory == rep["predicted_peak_bytes"]
    assert not step.attached and "make_train_function" not in model.__dict__
