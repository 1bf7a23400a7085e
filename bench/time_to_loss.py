"""Time to loss on the default recipe: synchronous 1F1B + Muon against 2BW + Muon + EF (``hf-asyncpp compare``),
both on 2 processes, same recipe, seed and data, the h256 benchmarks' setting of 2 microbatches of 16 sequences per step.

    python -m bench.time_to_loss [--steps 300] [--budgets 1.0,1.1,1.2] [--rounds 1] [--write]

The synchronous arm trains ``--steps``; 2BW trains each budget in ``--budgets`` (a multiple of ``--steps``, its
learning-rate schedule over its own steps: given the same steps 2BW ends slightly above the synchronous loss, so
the question is how many more steps it needs and whether they cost less time than it saves). Each round trains
every arm, one after the other, the order reversed every round; each arm keeps its fastest round (the runs are
deterministic, only the clock differs). Prints, per budget, the time 2BW needs to reach the synchronous run's final
eval loss over the synchronous run's time (target <= 0.8; training time only, evaluations excluded), and
``--write`` puts the table into docs/benchmarks/speed.md (section ``time-to-loss``) and the best budget's curves into
docs/benchmarks/time_to_loss.png.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from hf_asyncpp.cli.compare import ARMS, compare, curve, plot, run_arm, summary

from .report import DOCS

ROOT = Path(__file__).resolve().parent.parent

RECIPE = "recipes/cpu-tiny.yaml"
SETTING = ["--pipeline.num_microbatches=2", "--pipeline.microbatch_size=16"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--budgets", default="1.0,1.1,1.2", help="2BW step budgets, as multiples of --steps")
    ap.add_argument("--eval-steps", type=int, default=25)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    arms = [("sync", args.steps)] + [("2bw", round(args.steps * float(b))) for b in args.budgets.split(",")]
    best: dict[tuple[str, int], tuple[float, Path]] = {}
    with tempfile.TemporaryDirectory() as d:
        for rnd in range(args.rounds):
            order = arms if rnd % 2 == 0 else arms[::-1]
            print(f"round {rnd + 1}/{args.rounds}: {', '.join(f'{n} {k}' for n, k in order)}", flush=True)
            for name, steps in order:
                run = run_arm(str(ROOT / RECIPE), name, Path(d) / f"{name}-{steps}-{rnd}", steps, args.eval_steps, 2, SETTING)
                seconds = curve(run)[1]
                print(f"  {name} {steps} steps: {seconds:.1f} s of training", flush=True)
                if (name, steps) not in best or seconds < best[(name, steps)][0]:
                    best[(name, steps)] = (seconds, run)
        sync = best[("sync", args.steps)][1]
        results = {steps: compare(sync, run) for (name, steps), (_, run) in best.items() if name == "2bw"}
        reached = {k: r for k, r in results.items() if r["ratio"] is not None}
        top = min(reached, key=lambda k: reached[k]["ratio"]) if reached else max(results)
        res = results[top]
        png = DOCS / "time_to_loss.png" if args.write else Path(d) / "time_to_loss.png"
        plot(res, png, f"cpu-tiny, 2 microbatches x 16 sequences, sync {args.steps} / 2BW {top} steps on 2 processes "
                       f"(best of {args.rounds})")
        if not args.write:
            shutil.copy(png, "time_to_loss.png")
    rows = [f"| {ARMS['sync'][0]} | {args.steps} | {res['sync_train_s']:.1f} | 1.00 | {res['target_eval_loss']:.4f} | - |"]
    for steps, r in sorted(results.items()):
        ratio = "not reached" if r["ratio"] is None else f"{r['ratio']:.2f}"
        rows.append(f"| {ARMS['2bw'][0]} | {steps} ({steps / args.steps:.2f}x) | {r['2bw_train_s']:.1f} | "
                    f"{r['step_speedup']:.2f} | {r['2bw_final_eval_loss']:.4f} | {ratio} |")
    best_ratio = "not reached" if res["ratio"] is None else f"{res['ratio']:.2f} (2BW with {top} steps)"
    text = "\n".join([
        "| arm | steps | training s | step rate vs sync | final eval loss | time to the sync final loss / sync time |",
        "|---|---|---|---|---|---|", *rows, "",
        f"- best: {best_ratio} (target <= 0.8)", "", "![time to loss](time_to_loss.png)"])
    print(summary(res) + "\n\n" + text)
    if args.write:
        from .report import write_section

        write_section("time-to-loss", "## Time to loss: 2BW against synchronous 1F1B\n\nCommand: `python -m "
                      f"bench.time_to_loss --steps {args.steps} --budgets {args.budgets} --eval-steps {args.eval_steps} "
                      f"--rounds {args.rounds} --write` ({time.strftime('%Y-%m-%d')}; {RECIPE} {' '.join(SETTING)}, 2 "
                      "processes x 1 thread, same seed and data; 2BW at several step budgets, each its own cosine schedule; "
                      "training time from metrics.jsonl's train_s, evaluations excluded, the crossing interpolated between "
                      "evaluations)\n\n" + text)


if __name__ == "__main__":
    main()
