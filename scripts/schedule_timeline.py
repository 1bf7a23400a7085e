"""Draw a pipeline schedule's simulated timeline as a PNG (a row per stage; forward, backward, step, idle).

    python scripts/schedule_timeline.py --schedule 2bw --stages 4 --microbatches 8 --steps 3 --out docs/schedules/2bw.png
"""
import argparse
import os
import sys

sys.path[0] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedule", default="2bw", choices=["gpipe", "1f1b", "2bw", "pipedream"])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--forward", type=float, default=1.0, help="cost of a forward")
    ap.add_argument("--backward", type=float, default=2.0, help="cost of a backward")
    ap.add_argument("--step-cost", type=float, default=0.5, help="cost of an optimizer step")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from hf_asyncpp.schedules import schedule_actions
    from hf_asyncpp.simulator import Costs, plot_timeline, simulate

    m = 1 if args.schedule == "pipedream" else args.microbatches
    steps = args.steps * args.microbatches if args.schedule == "pipedream" else args.steps
    acts = schedule_actions(args.schedule, args.stages, m, steps)
    res = simulate(acts, Costs(args.forward, args.backward, args.step_cost), args.schedule, m)
    out = args.out or f"docs/schedules/{args.schedule}.png"
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    plot_timeline(res, out, f"{args.schedule}: p={args.stages}, m={m}, {steps} steps")
    print(f"{args.schedule}: makespan {res.makespan:.1f}, bubble {res.bubble:.1%}, steady-state bubble {res.steady_bubble:.1%}, "
          f"peak in-flight {res.peak_inflight}, peak versions {res.peak_versions} -> {out}")


if __name__ == "__main__":
    main()
