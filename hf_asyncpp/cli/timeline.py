"""Draw a pipeline schedule's simulated timeline as a PNG (a row per stage: forward, backward, step, idle).

    hf-asyncpp timeline --schedule 2bw --stages 4 --microbatches 8 --steps 3 --out figures/

``pipedream`` updates after every microbatch: it runs steps x microbatches steps of one microbatch (the
same data). ``--print-actions`` also prints each stage's action list. The virtual-stage schedules (``interleaved1f1b``,
``zbv``, ``dualpipev``: planner only) draw a row per rank (``--stages`` ranks of 2 stages each), each stage costing
``--forward`` / ``--backward`` over its stages per rank, so a rank does the work a one-stage schedule's stage does.

``--head H``: the output layer and loss cost H more in the last stage's forward (2 H more in its backward); with
``--vocab-parallel`` they are shared by every stage instead (``pipeline.vocab_parallel``): each stage runs a VOCAB
pass per microbatch costing 3 H / stages (its shard's forward and backward), drawn in green:

    hf-asyncpp timeline --schedule 2bw --stages 4 --microbatches 8 --head 0.5 --vocab-parallel
"""
import argparse
import os
import sys

from . import at_least
from ..schedules.actions import format_actions
from ..schedules.records import SCHEDULES, VIRTUAL_SCHEDULES, get_schedule, schedule_actions
from ..schedules.simulator import Costs, simulate
from ..schedules.timeline import plot_timeline


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hf-asyncpp timeline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedule", default="2bw", choices=[*SCHEDULES, *VIRTUAL_SCHEDULES])
    ap.add_argument("--stages", type=at_least(1), default=4)
    ap.add_argument("--microbatches", type=at_least(1), default=8, help="per step")
    ap.add_argument("--steps", type=at_least(1), default=3, help="steps to draw (the steady-state bubble needs 3)")
    ap.add_argument("--forward", type=float, default=1.0, help="cost of a forward")
    ap.add_argument("--backward", type=float, default=2.0, help="cost of a backward")
    ap.add_argument("--step-cost", type=float, default=0.5, help="cost of an optimizer step")
    ap.add_argument("--reduce", type=float, default=0.0, help="latency of a step's gradient reduction")
    ap.add_argument("--comm", type=float, default=0.0, help="latency of one transfer")
    ap.add_argument("--head", type=float, default=0.0,
                    help="cost of the output layer and loss's forward on the last stage (its backward twice that)")
    ap.add_argument("--vocab-parallel", action="store_true",
                    help="the vocabulary layers shared by every stage: a VOCAB pass per microbatch of 3 x head / stages")
    ap.add_argument("--reduce-scope", default="global", choices=["global", "stage"],
                    help="global: a STEP waits for every stage's reduction (global grad norm, as the executor)")
    ap.add_argument("--print-actions", action="store_true")
    ap.add_argument("--out", default=None, metavar="DIR",
                    help="folder for the PNG, created if missing (default: the current directory)")
    ap.add_argument("--png", default=None, metavar="FILE", help="the PNG's own path (default: <schedule>.png in --out)")
    args = ap.parse_args(argv)
    if args.out and args.out.lower().endswith(".png") and not args.png:  # the spelling of earlier versions
        args.out, args.png = None, args.out

    sched = get_schedule(args.schedule)
    pd = sched.one_update_per_microbatch
    m, steps = (1, args.steps * args.microbatches) if pd else (args.microbatches, args.steps)
    acts = schedule_actions(args.schedule, args.stages, m, steps, vocab_parallel=args.vocab_parallel)
    if args.print_actions:
        print(format_actions(acts))
    v = sched.stages_per_rank
    n = args.stages * v  # model stages
    head = 0.0 if args.vocab_parallel else args.head  # on the last stage, unless shared
    costs = Costs([args.forward / v] * (n - 1) + [args.forward / v + head],
                  [args.backward / v] * (n - 1) + [args.backward / v + 2 * head], args.step_cost, args.reduce,
                  args.comm, vocab=3 * args.head / args.stages if args.vocab_parallel else 0.0)
    res = simulate(acts, costs, args.schedule, m, reduce_scope=args.reduce_scope)
    out = args.png or os.path.join(args.out or "", f"{args.schedule}.png")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    scope = "" if args.reduce_scope == "global" else ", stage-local reductions"
    vocab = (f"; head {args.head:g} {'shared (VOCAB)' if args.vocab_parallel else 'on the last stage'}"
             if args.head or args.vocab_parallel else "")
    title = (f"{args.schedule}: p={args.stages}, m={m}, {steps} steps; F={args.forward:g} B={args.backward:g} "
             f"step={args.step_cost:g} reduce={args.reduce:g} comm={args.comm:g}{scope}{vocab}")
    plot_timeline(res, out, title)
    steady = ("steady-state bubble n/a (no steady state: draw --steps 3 or more)" if res.steady_bubble != res.steady_bubble
              else f"steady-state bubble {res.steady_bubble:.1%}")  # nan: too few steps to have a steady state
    print(f"{args.schedule}: makespan {res.makespan:g}, bubble {res.bubble:.1%}, {steady}, "
          f"{res.throughput:.3f} microbatches per unit time, peak in-flight {res.peak_inflight}, "
          f"peak versions {res.peak_versions} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
