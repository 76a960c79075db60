"""Training with (or without) a rewritten step: synthetic data, per-epoch measured logs.

Used by ``tools/train.py`` and ``tf-remat train``. The CSV log has one row per epoch with
``epoch, loss, step_time_s, peak_bytes``: the median wall time of the epoch's steps and the
peak bytes TensorFlow's allocator reported during the epoch.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import statistics
import sys
import time

__all__ = ["load_builder", "load_function", "synthetic_dataset", "EpochLog", "train"]


def load_function(ref: str, what: str = "--module"):
    """The function named by ``path/to/file.py:function``."""
    if ":" not in ref:
        raise ValueError(f"{what} {ref!r} must be path/to/file.py:function")
    path, func = ref.rsplit(":", 1)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} file {path!r} does not exist")
    spec = importlib.util.spec_from_file_location(
        "tf_remat_user_" + os.path.splitext(os.path.basename(path))[0], path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    if not callable(getattr(mod, func, None)):
        raise ValueError(f"{path} has no function {func!r}")
    return getattr(mod, func)


def load_builder(model: str | None = None, module: str | None = None, *, input_size=None,
                 num_classes=None):
    """``build(batch_size) -> (compiled_model, input_spec, label_spec)`` for a zoo name or
    ``path/to/file.py:function``; its ``builder_spec`` attribute (a dict of the arguments) lets
    another process load the same builder."""
    if (model is None) == (module is None):
        raise ValueError("give --model NAME or --module file.py:build (one of them)")
    spec = {"model": model, "module": module, "input_size": input_size,
            "num_classes": num_classes}
    if module is not None:
        fn = load_function(module, "--module")

        def build(batch_size):
            return fn(batch_size)

        build.__name__ = getattr(fn, "__name__", "build")
    else:
        from tf_remat.zoo import get_model

        get_model(model, 1, input_size, num_classes)  # an unknown name or size fails here

        def build(batch_size):
            return get_model(model, batch_size, input_size, num_classes)

        build.__name__ = f"zoo_{model}"
    # what another process needs to load the same builder (tf_remat.batch runs probes so)
    build.builder_spec = spec
    return build


def synthetic_dataset(input_spec, label_spec, *, batches: int = 8, seed: int = 0):
    """A fixed, seeded data set of ``batches`` batches shaped like the specs (learnable:
    labels are a fixed function of the inputs, so the loss can go down)."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    xs, ys = [], []
    n = batches
    x_shape = tuple(input_spec.shape)
    for _ in range(n):
        x = rng.standard_normal(x_shape).astype(input_spec.dtype.as_numpy_dtype)
        xs.append(x)
        ys.append(_labels_for(x, label_spec, rng))
    x = np.concatenate(xs)
    y = np.concatenate(ys)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(x_shape[0], drop_remainder=True)
    return ds


def _labels_for(x, label_spec, rng):
    import numpy as np

    shape = tuple(label_spec.shape)
    dtype = label_spec.dtype.as_numpy_dtype
    b = x.shape[0]
    signal = x.reshape(b, -1)[:, : max(1, min(64, x[0].size))].mean(axis=1)
    if label_spec.dtype.is_integer:
        classes = 10
        per = np.clip(((signal - signal.min()) / (np.ptp(signal) + 1e-9) * classes).astype(int),
                      0, classes - 1)
        return np.broadcast_to(per.reshape((b,) + (1,) * (len(shape) - 1)), shape).astype(dtype)
    return np.broadcast_to(signal.reshape((b,) + (1,) * (len(shape) - 1)), shape).astype(dtype)


def _batch_of(ds):
    spec = ds.element_spec
    first = spec[0] if isinstance(spec, (tuple, list)) else spec
    import tensorflow as tf

    first = tf.nest.flatten(first)[0]
    return first.shape[0] if first.shape.rank else None


class EpochLog:
    """A Keras callback recording per-epoch loss, median step time and measured peak bytes."""

    def __new__(cls, device=None):
        import keras

        from tf_remat.batch import memory_device

        class _EpochLog(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.device = device or memory_device()
                self.rows = []
                from tf_remat.extract import memory_stats_missing

                # a process without memory statistics still trains; its log has no peaks
                self.counting = memory_stats_missing(self.device) is None

            def on_epoch_begin(self, epoch, logs=None):
                import tensorflow as tf

                self._times = []
                if self.counting:
                    tf.config.experimental.reset_memory_stats(self.device)

            def on_train_batch_begin(self, batch, logs=None):
                self._t = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                self._times.append(time.perf_counter() - self._t)

            def on_epoch_end(self, epoch, logs=None):
                import tensorflow as tf

                peak = (int(tf.config.experimental.get_memory_info(self.device)["peak"])
                        if self.counting else None)
                times = self._times[1:] if len(self._times) > 2 else self._times
                self.rows.append({"epoch": epoch + 1,
                                  "loss": float((logs or {}).get("loss", "nan")),
                                  "step_time_s": statistics.median(times) if times else 0.0,
                                  "peak_bytes": peak})

        return _EpochLog()


def train(build, *, batch: int, epochs: int, budget_gb: float | None = None,
          remat: bool = True, strategy: str = "auto", time_limit: float = 60.0,
          batches_per_epoch: int = 8, log: str | None = None, verbose: int = 1,
          dataset=None, plan=None, save_plan: str | None = None,
          margin: float | None = None):
    """Train ``build(batch)``'s model; returns ``(history, rows, step_or_None)``.

    ``plan``: a plan (or its path) to run instead of a first solve (``optimize``'s ``plan=``);
    ``save_plan``: where to write the plan that ran, for the next run's ``plan``;
    ``margin``: ``optimize``'s verification margin (None: its default).

    ``dataset``: a ``tf.data.Dataset`` of ``(x, y)`` batches of size ``batch`` (the last partial
    batch is dropped: the rewritten step is static), or a function ``dataset(batch)`` returning
    one; default: a fixed synthetic data set of ``batches_per_epoch`` batches.
    """
    model, input_spec, label_spec = build(batch)
    step = None
    if remat:
        if budget_gb is None:
            raise ValueError("--budget-gb is required unless --no-remat is given")
        from tf_remat.api import optimize

        step = optimize(model, budget_gb=budget_gb, input_spec=input_spec,
                        label_spec=label_spec, strategy=strategy, time_limit=time_limit,
                        verbose=verbose, plan=plan, margin=margin)
        if save_plan:
            step.plan.save(save_plan)
    elif plan is not None or save_plan:
        raise ValueError("--plan and --save-plan need rematerialization (drop --no-remat)")
    if dataset is None:
        ds = synthetic_dataset(input_spec, label_spec, batches=batches_per_epoch)
    else:
        ds = dataset(batch) if callable(dataset) else dataset
        ds = ds.rebatch(batch, drop_remainder=True) if _batch_of(ds) != batch else ds
    logger = EpochLog()
    history = model.fit(ds, epochs=epochs, callbacks=[logger], verbose=verbose)
    if log:
        os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
        with open(log, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=["epoch", "loss", "step_time_s", "peak_bytes"])
            w.writeheader()
            for row in logger.rows:
                w.writerow(row)
    return history, logger.rows, step
