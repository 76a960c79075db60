#!/usr/bin/env python
"""Train a zoo model or your own with tf_remat.optimize + model.fit on synthetic data.

    python tools/train.py --model small_cnn --batch 64 --epochs 3 --budget-gb 0.25 --log run.csv
    python tools/train.py --module my_model.py:build --batch 32 --epochs 3 --no-remat
    python tools/train.py --module my_model.py:build --data my_model.py:dataset --batch 32 ...

``build(batch_size)`` returns ``(compiled_model, input_spec, label_spec)``; ``dataset(batch_size)``
(optional) returns a ``tf.data.Dataset`` of ``(x, y)`` batches. The CSV log has one row
per epoch: epoch, loss, step_time_s (median measured), peak_bytes (measured).
"""

import argparse
import os
import sys

# run from a checkout without installing
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    from tf_remat.cli import positive

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="zoo model name (tf-remat models lists them)")
    src.add_argument("--module", help="path/to/file.py:build")
    p.add_argument("--batch", type=positive(int), required=True)
    p.add_argument("--epochs", type=positive(int), default=3)
    p.add_argument("--budget-gb", type=positive(float), default=None, help="GiB (2**30 bytes)")
    p.add_argument("--no-remat", action="store_true", help="train the plain step")
    p.add_argument("--strategy", default="auto")
    p.add_argument("--time-limit", type=positive(float), default=60.0)
    p.add_argument("--batches-per-epoch", type=positive(int), default=8)
    p.add_argument("--input", default=None, help="HxW for zoo models")
    p.add_argument("--data", default=None,
                   help="path/to/file.py:function returning a tf.data.Dataset of (x, y) "
                        "(default: fixed synthetic data)")
    p.add_argument("--plan", default=None,
                   help="plan JSON to run instead of a first solve (from --save-plan or "
                        "step.plan.save): the same plan measures the same in every run")
    p.add_argument("--save-plan", default=None, help="write the plan that ran here (JSON)")
    p.add_argument("--reserve", action="store_true",
                   help="call tf_remat.reserve_memory with the budget before the model is "
                        "built (measure with and without: it is not a gain on every step)")
    p.add_argument("--margin", type=float, default=None,
                   help="fraction of the budget the measured step must leave free (default: "
                        "optimize's 5-15%%; 0: any step within the budget, often cheaper, "
                        "with no room for other allocation histories)")
    p.add_argument("--log", default=None, help="CSV file, one row per epoch")
    p.add_argument("--verbose", type=int, default=1)
    args = p.parse_args(argv)

    from tf_remat.errors import RematError
    from tf_remat.training import load_builder, load_function, train

    try:
        if args.reserve:
            if args.budget_gb is None:
                raise ValueError("--reserve reserves the budget: give --budget-gb too")
            from tf_remat.api import reserve_memory

            reserve_memory(budget_gb=args.budget_gb)
        build = load_builder(args.model, args.module, input_size=args.input)
        dataset = load_function(args.data, "--data") if args.data else None
        _, rows, step = train(build, batch=args.batch, epochs=args.epochs,
                              budget_gb=args.budget_gb, remat=not args.no_remat,
                              strategy=args.strategy, time_limit=args.time_limit,
                              batches_per_epoch=args.batches_per_epoch, log=args.log,
                              verbose=args.verbose, dataset=dataset, plan=args.plan,
                              save_plan=args.save_plan, margin=args.margin)
    except (RematError, ValueError, FileNotFoundError) as exc:
        print(f"train.py: error: {exc}", file=sys.stderr)
        return 2
    print("epoch,loss,step_time_s,peak_bytes")
    for r in rows:
        peak = "" if r["peak_bytes"] is None else r["peak_bytes"]  # no memory statistics
        print(f"{r['epoch']},{r['loss']:.6f},{r['step_time_s']:.4f},{peak}")
    if step is not None:
        print({k: v for k, v in step.report.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
