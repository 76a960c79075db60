"""The ``tf-remat`` command line: parses arguments and calls the library, nothing more.

Exit codes: 0 success; 2 bad input (the message names what to change); 3 no plan within the
budget (an over-budget plan is still written when one was found).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tf_remat._units import format_bytes, parse_budget

__all__ = ["main"]

EXIT_BAD_INPUT = 2
EXIT_INFEASIBLE = 3


def main(argv=None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    from tf_remat.errors import RematError

    try:
        return int(args.func(args) or 0)
    except (RematError, ValueError, FileNotFoundError) as exc:
        print(f"tf-remat {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"tf-remat {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader left (``tf-remat explain ... | head``): nothing more to say, and stdout's
        # flush at exit would raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


# --------------------------------------------------------------------- commands
def cmd_info(args) -> int:
    from tf_remat.graph import Graph

    g = Graph.load(args.graph)
    info = {"name": g.name, "nodes": g.n, "edges": len(g.edges),
            "no_remat_peak": g.no_remat_peak, "total_cost": g.total_cost,
            "budget_lower_bound": g.budget_lower_bound, "fixed_memory": g.fixed_memory,
            "backward_nodes": sum(g.backward),
            "non_recomputable_nodes": g.n - sum(g.recomputable)}
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"graph               {g.name}")
    print(f"nodes / edges       {g.n} / {len(g.edges)} "
          f"({info['backward_nodes']} backward, {info['non_recomputable_nodes']} not recomputable)")
    print(f"no-remat peak       {g.no_remat_peak} B ({format_bytes(g.no_remat_peak)})")
    print(f"budget lower bound  {g.budget_lower_bound} B ({format_bytes(g.budget_lower_bound)})")
    print(f"fixed memory        {g.fixed_memory} B ({format_bytes(g.fixed_memory)})")
    print(f"total cost          {g.total_cost:.6g}")
    return 0


def cmd_solve(args) -> int:
    from tf_remat.graph import Graph
    from tf_remat.solvers import solve

    g = Graph.load(args.graph)
    budget = parse_budget(args.budget, g.no_remat_peak)
    options = _parse_sets(args.set)
    plan = solve(g, budget, args.strategy, time_limit=args.time_limit, seed=args.seed,
                 verbose=0 if args.quiet else 1, **options)
    if plan.steps and args.output:
        plan.save(args.output)
    line = _plan_line(g, plan)
    if plan.within_budget:
        print(line)
        return 0
    msg = plan.info.get("message") or "no plan within the budget was found"
    print(f"tf-remat solve: {msg} (budget {budget} B = {format_bytes(budget)}, "
          f"lower bound {g.budget_lower_bound} B)", file=sys.stderr)
    if plan.steps:
        print(f"tf-remat solve: the best plan found peaks at {plan.peak_memory} B "
              f"({format_bytes(plan.peak_memory)})"
              + (f"; written with status {plan.status} to {args.output}" if args.output else ""),
              file=sys.stderr)
    return EXIT_INFEASIBLE


def cmd_simulate(args) -> int:
    from tf_remat.graph import Graph
    from tf_remat.plan import simulate

    g = Graph.load(args.graph)
    plan = _plan_for(g, args.plan)
    sim = simulate(g, plan.steps)
    overhead = sim.cost / g.total_cost - 1 if g.total_cost else 0.0
    result = {"valid": True, "peak_memory": sim.peak_memory, "cost": sim.cost,
              "overhead": overhead, "budget": plan.budget,
              "within_budget": sim.peak_memory <= plan.budget}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"valid plan: peak {sim.peak_memory} B ({format_bytes(sim.peak_memory)}), "
              f"cost {sim.cost:.6g}, overhead {100 * overhead:.3f}%, "
              f"budget {plan.budget} B ({'within' if result['within_budget'] else 'OVER'})")
    return 0


def cmd_explain(args) -> int:
    from tf_remat.graph import Graph
    from tf_remat.plan import explain

    g = Graph.load(args.graph)
    print(explain(_plan_for(g, args.plan), g, limit=args.limit))
    return 0


def cmd_strategies(args) -> int:
    from tf_remat.solvers import _TABLE, get_strategy
    from tf_remat.errors import StrategyError

    width = max(map(len, _TABLE))
    for name in _TABLE:
        try:
            s = get_strategy(name)
        except StrategyError as exc:
            print(f"{name:<{width}}  (unavailable: {exc})")
            continue
        opts = ", ".join(f"{k}={d!r}" for k, (t, d, _) in s.options.items()
                         if t in (int, float, str, bool))
        print(f"{name:<{width}}  {s.summary}" + (f"  [options: {opts}]" if opts else ""))
    return 0


def cmd_tradeoff(args) -> int:
    from tf_remat.graph import Graph
    from tf_remat.solvers import _TABLE, get_strategy
    from tf_remat import tradeoff as T

    if bool(args.graph) == bool(args.model):
        raise ValueError("give a GRAPH file or --model NAME (one of them)")
    if args.model:
        from tf_remat.extract import extract_graph
        from tf_remat.zoo import model_specs

        model, input_spec, label_spec = model_specs(args.model, batch_size=args.batch,
                                                    input_size=args.input)
        g = extract_graph(model, input_spec=input_spec, label_spec=label_spec,
                          cost_model=args.cost_model, verbose=0 if args.quiet else 1)
    else:
        g = Graph.load(args.graph)
    fractions = T.parse_budget_range(args.budgets)
    strategies = args.strategies or [s for s in _TABLE if s != "auto"]
    for s in strategies:
        get_strategy(s)  # unknown names fail before any solving
    points = T.tradeoff(g, fractions, strategies, time_limit=args.time_limit,
                        verbose=0 if args.quiet else 1)
    out = args.output or os.path.join("benchmarks", "results", f"tradeoff_{g.name}.png")
    table_path = os.path.splitext(out)[0] + ".md"
    print(T.write_table(g, points, table_path))
    T.plot_tradeoff(g, points, out)
    print(f"wrote {out} and {table_path}")
    return 0


def cmd_max_batch(args) -> int:
    from tf_remat.batch import max_batch_size
    from tf_remat.training import load_builder

    build = load_builder(args.model, args.module, input_size=args.input)
    result = max_batch_size(build, budget_gb=args.budget_gb, strategy=args.strategy,
                            time_limit=args.time_limit, start=args.start,
                            max_batch=args.max, cost_model=args.cost_model,
                            verbose=0 if args.json else 1, confirm=args.confirm,
                            save_plan=args.save_plan, reserve=args.reserve,
                            deadline=args.deadline, confirm_each=args.confirm_each,
                            margin=args.margin)
    if args.json:
        print(json.dumps(result.to_dict()))
    return 0


def cmd_extract(args) -> int:
    import time

    from tf_remat.extract import extract, op_map_path
    from tf_remat.zoo import model_specs

    t0 = time.perf_counter()
    if args.module is not None:
        from tf_remat.training import load_builder

        if args.input is not None or args.classes is not None:
            raise ValueError("--input and --classes are for zoo models; a --module builder "
                             "sets its own shapes")
        model, input_spec, label_spec = load_builder(module=args.module)(args.batch)
    else:
        model, input_spec, label_spec = model_specs(args.model, batch_size=args.batch,
                                                    input_size=args.input,
                                                    num_classes=args.classes)
    ex = extract(model, input_spec=input_spec, label_spec=label_spec,
                 cost_model=args.cost_model, verbose=0 if args.quiet else 1)
    out = args.output or f"{ex.graph.name}.json"
    ex.save(out)
    g, info = ex.graph, ex.info
    print(f"{g.name}: {info['ops']} ops -> {g.n} nodes, {len(g.edges)} edges; no-remat peak "
          f"{g.no_remat_peak} B ({format_bytes(g.no_remat_peak)}), fixed "
          f"{format_bytes(g.fixed_memory)}, total cost {g.total_cost:.4g} s "
          f"({args.cost_model}); {time.perf_counter() - t0:.1f} s")
    print(f"wrote {out} and {op_map_path(out)}")
    return 0


def cmd_plot(args) -> int:
    from tf_remat.graph import Graph
    from tf_remat.plot import plot_memory

    g = Graph.load(args.graph)
    plans = [_plan_for(g, p) for p in args.plans]
    budget = parse_budget(args.budget, g.no_remat_peak) if args.budget else None
    out = plot_memory(g, plans, args.output, budget=budget, x=args.x)
    print(f"wrote {out}")
    return 0


def cmd_demo(args) -> int:
    from tf_remat.demo import run_demo

    return run_demo(args)


# --------------------------------------------------------------------- helpers
def positive(kind):
    """An argparse type: a number of ``kind`` over zero (a batch size, epochs, seconds), so
    that 0 or -2 is refused at once by name, not taken as "the default" or found minutes in."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not over zero")
        return value

    return parse


def _plan_for(graph, path):
    """The plan at ``path``, checked against ``graph``: a plan solved for another graph fails
    at some step, and the error then says whose plan it is, not only which step failed."""
    from tf_remat.errors import PlanError
    from tf_remat.plan import Plan, simulate

    plan = Plan.load(path)
    try:
        simulate(graph, plan.steps)
    except PlanError as exc:
        if plan.graph and plan.graph != graph.name:
            raise PlanError(f"{path} is a plan for graph {plan.graph!r}, not for "
                            f"{graph.name!r}: {exc}") from exc
        raise
    return plan


def _parse_sets(items) -> dict:
    out = {}
    for item in items or ():
        if "=" not in item:
            raise ValueError(f"--set {item!r} must look like KEY=VALUE")
        key, value = item.split("=", 1)
        out[key.strip()] = value.strip()
    return out


def _plan_line(g, plan) -> str:
    overhead = plan.overhead or 0.0
    lb = "" if plan.lower_bound is None else f", lower bound {plan.lower_bound:.6g}"
    return (f"{plan.strategy}: {plan.status}, peak {plan.peak_memory} B "
            f"({format_bytes(plan.peak_memory)}) of budget {plan.budget} B, cost {plan.cost:.6g} "
            f"({100 * overhead:.3f}% overhead{lb}), {plan.solve_seconds:.2f} s")


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tf-remat",
                                description="tf-remat: rematerialization schedules that make "
                                            "Keras training fit in less memory")
    from tf_remat import __version__

    p.add_argument("--version", action="version", version=f"tf-remat {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    s = sub.add_parser("info", help="graph facts: nodes, edges, no-remat peak, budget bound")
    s.add_argument("graph")
    s.add_argument("--json", action="store_true", help="one JSON object")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("solve", help="solve a graph under a memory budget, write the plan")
    s.add_argument("graph")
    s.add_argument("--budget", "-b", required=True,
                   help="bytes (12884901888), with a unit (12GB, 11.3GiB) or a fraction of the "
                        "no-rematerialization peak (0.8)")
    s.add_argument("--strategy", "-s", default="auto", help="see `tf-remat strategies`")
    s.add_argument("--time-limit", type=positive(float), default=None, help="seconds")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--set", action="append", metavar="KEY=VALUE", help="strategy option")
    s.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    s.add_argument("-o", "--output", help="plan JSON to write")
    s.set_defaults(func=cmd_solve)

    s = sub.add_parser("simulate", help="validate a plan and print its peak, cost, overhead")
    s.add_argument("graph")
    s.add_argument("plan")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_simulate)

    s = sub.add_parser("explain", help="what a plan keeps and recomputes")
    s.add_argument("graph")
    s.add_argument("plan")
    s.add_argument("--limit", type=int, default=20)
    s.set_defaults(func=cmd_explain)

    s = sub.add_parser("strategies", help="list the strategies")
    s.set_defaults(func=cmd_strategies)

    s = sub.add_parser("tradeoff", help="overhead vs budget curves for several strategies")
    s.add_argument("graph", nargs="?", help="graph file (or use --model)")
    s.add_argument("--model", help="a zoo model name, extracted first")
    s.add_argument("--batch", type=positive(int), default=8, help="batch size for --model")
    s.add_argument("--input", default=None, help="input size HxW for --model")
    s.add_argument("--cost-model", default="step", choices=("step", "profile", "flops"),
                   help="for --model, as in extract")
    s.add_argument("--budgets", default="0.4:1.0:0.05",
                   help="START:STOP:STEP or a comma list of fractions of the no-remat peak")
    s.add_argument("--strategies", nargs="+", help="default: every strategy but auto")
    s.add_argument("--time-limit", type=positive(float), default=10.0, help="seconds per solve")
    s.add_argument("--quiet", "-q", action="store_true")
    s.add_argument("-o", "--output", help="PNG path (the table goes beside it as .md); "
                                          "default benchmarks/results/tradeoff_<graph>.png")
    s.set_defaults(func=cmd_tradeoff)

    s = sub.add_parser("max-batch", help="largest batch that trains within a budget, "
                                         "plain and with rematerialization")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="zoo model name")
    src.add_argument("--module", help="path/to/file.py:build, build(batch) -> "
                                      "(compiled_model, input_spec, label_spec)")
    s.add_argument("--budget-gb", type=positive(float), required=True, help="GiB (2**30 bytes)")
    s.add_argument("--input", default=None, help="input size HxW for zoo models")
    s.add_argument("--strategy", default="auto")
    s.add_argument("--time-limit", type=positive(float), default=30.0, help="seconds per solve")
    s.add_argument("--start", type=positive(int), default=8, help="first batch size tried")
    s.add_argument("--max", type=positive(int), default=4096, help="largest batch size tried")
    s.add_argument("--cost-model", default="flops", choices=("flops", "profile", "step"),
                   help="op costs for the solver (flops: no profiling at every size)")
    s.add_argument("--confirm", type=int, default=2,
                   help="more solves the rematerialized size must pass before it is "
                        "reported (default 2; after a failure, smaller sizes are "
                        "tried 1, 2, 4, ... below it, then bisected)")
    s.add_argument("--save-plan", default=None,
                   help="write the plan that fitted at the reported rematerialized size "
                        "(JSON), for optimize(plan=...) or train.py --plan")
    s.add_argument("--reserve", action="store_true",
                   help="each probe's process calls tf_remat.reserve_memory with the budget "
                        "before it builds the model (as a training script that does so)")
    s.add_argument("--deadline", type=positive(float), default=None,
                   help="seconds for the whole search; when they pass, the largest sizes "
                        "confirmed by then are reported, marked incomplete")
    s.add_argument("--confirm-each", action=argparse.BooleanOptionalAction, default=None,
                   help="pass each rematerialized size's --confirm probes before trying the "
                        "next, so a search stopped at its deadline reports the largest size it "
                        "passed (default: on with --deadline, else the largest size alone is "
                        "confirmed, at the end)")
    s.add_argument("--margin", type=float, default=None,
                   help="fraction of the budget each probe's measured step must leave free "
                        "(default: optimize's, 5-15%%): the one training will use "
                        "(train.py --margin)")
    s.add_argument("--json", action="store_true",
                   help='one line {"plain_batch", "remat_batch", "budget_bytes", "complete"}')
    s.set_defaults(func=cmd_max_batch)

    s = sub.add_parser("extract", help="trace a model's training step into a graph file")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="zoo model: vgg16, vgg19, mobilenet, "
                     "resnet50, unet, fcn8, segnet, transformer, bn_cnn, bn_cnn12")
    src.add_argument("--module", help="your model: path/to/file.py:build, build(batch) -> "
                                      "(compiled_model, input_spec, label_spec)")
    s.add_argument("--batch", type=positive(int), default=8, help="batch size")
    s.add_argument("--input", default=None, help="input size HxW (sequence length for "
                                                 "transformer); default: the model's")
    s.add_argument("--classes", type=positive(int), default=None, help="output classes")
    s.add_argument("--cost-model", default="step", choices=("step", "profile", "flops"),
                   help="step: each node's share of the step's time in a trace of it (CPU; "
                        "on a GPU as profile); profile: each node measured alone here (cached); "
                        "flops: an estimate")
    s.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    s.add_argument("-o", "--output", help="graph JSON to write (default <model>_b<batch>.json);"
                                          " the op map goes beside it as .ops.json")
    s.set_defaults(func=cmd_extract)

    s = sub.add_parser("plot", help="memory over the schedule, one line per plan, vs the budget")
    s.add_argument("graph")
    s.add_argument("plans", nargs="+", metavar="PLAN")
    s.add_argument("-o", "--output", default="memory.png", help="PNG/PDF/SVG to write")
    s.add_argument("--budget", "-b", default=None,
                   help="budget line (bytes, with a unit, or a fraction); default: the plans'")
    s.add_argument("--x", default="cost", choices=("cost", "step"),
                   help="x axis: cumulative node cost (time) or compute steps")
    s.set_defaults(func=cmd_plot)

    s = sub.add_parser("demo", help="the main job on a bundled example")
    s.add_argument("--graph", default=None,
                   help="solve this graph file ('bundled': the bundled one) with every strategy "
                        "instead of training")
    s.add_argument("--budget", default=None,
                   help="fraction of the plain peak or a size (default: 0.6 of the measured "
                        "plain step when training, 0.8 of the no-remat peak with --graph)")
    s.add_argument("--time-limit", type=positive(float), default=None,
                   help="solver seconds (default 30 per solve when training, 10 per strategy "
                        "with --graph)")
    s.add_argument("--model", default=None, help="zoo model to train (default bn_cnn12)")
    s.add_argument("--batch", type=positive(int), default=None, help="batch size (default 128)")
    s.add_argument("--epochs", type=positive(int), default=None,
                   help="epochs of model.fit (default 2)")
    s.add_argument("--strategy", default=None, help="strategy for optimize (default auto)")
    s.add_argument("-o", "--output", default=None,
                   help="memory plot to write (default demo_memory.png)")
    s.add_argument("--quiet", "-q", action="store_true", help="no solver progress")
    s.set_defaults(func=cmd_demo)
    return p


if __name__ == "__main__":
    sys.exit(main())
