"""Time to loss on the default recipe: synchronous 1F1B + Muon against 2BW + Muon + EF (``hf-asyncpp compare``),
both on 2 processes, same recipe, seed and data, the issue-14 setting of 2 microbatches of 16 sequences per step.

    python bench/time_to_loss.py [--steps 300] [--rounds 2] [--write]

Each round trains both arms, one after the other, the order swapped every round; each arm keeps its fastest round
(least training time for the same steps: the runs are deterministic, so only the clock differs between rounds).
Prints the time 2BW needs to reach the synchronous run's final eval loss over the synchronous run's time (target
<= 0.8; training time only, evaluations excluded) and ``--write`` puts the table into docs/benchmarks.md and the
curves into docs/time_to_loss.png.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)

from hf_asyncpp.cli.compare import ARMS, compare, curve, plot, run_arm, summary  # noqa: E402 (after the path set-up)

RECIPE = "recipes/cpu-tiny.yaml"
SETTING = ["--pipeline.num_microbatches=2", "--pipeline.microbatch_size=16"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-steps", type=int, default=25)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    names = list(ARMS)
    best: dict[str, tuple[float, Path]] = {}
    with tempfile.TemporaryDirectory() as d:
        for rnd in range(args.rounds):
            order = names if rnd % 2 == 0 else names[::-1]
            print(f"round {rnd + 1}/{args.rounds}: {', '.join(order)}", flush=True)
            for name in order:
                run = run_arm(str(ROOT / RECIPE), name, Path(d) / f"{name}-{rnd}", args.steps, args.eval_steps, 2, SETTING)
                seconds = curve(run)[1]
                print(f"  {name}: {seconds:.1f} s of training", flush=True)
                if name not in best or seconds < best[name][0]:
                    best[name] = (seconds, run)
        res = compare(best["sync"][1], best["2bw"][1])
        png = ROOT / "docs" / "time_to_loss.png" if args.write else Path(d) / "time_to_loss.png"
        plot(res, png, f"cpu-tiny, 2 microbatches x 16 sequences, {args.steps} steps on 2 processes (best of {args.rounds})")
        if not args.write:
            shutil.copy(png, "time_to_loss.png")
    ratio = "not reached" if res["ratio"] is None else f"{res['ratio']:.2f}"
    text = "\n".join([
        "| arm | training s | final eval loss |", "|---|---|---|",
        f"| {ARMS['sync'][0]} | {res['sync_train_s']:.1f} | {res['target_eval_loss']:.4f} |",
        f"| {ARMS['2bw'][0]} | {res['2bw_train_s']:.1f} ({res['step_speedup']:.2f}x the step rate) | "
        f"{res['2bw_final_eval_loss']:.4f} |", "",
        f"- time 2BW needs to reach the synchronous run's final eval loss / the synchronous run's time = {ratio} "
        "(target <= 0.8)", "", "![time to loss](time_to_loss.png)"])
    print(summary(res) + "\n\n" + text)
    if args.write:
        from bench.report import write_section

        write_section("time-to-loss", "## Time to loss: 2BW against synchronous 1F1B\n\nCommand: `python "
                      f"bench/time_to_loss.py --steps {args.steps} --eval-steps {args.eval_steps} --rounds {args.rounds} "
                      f"--write` ({time.strftime('%Y-%m-%d')}; {RECIPE} {' '.join(SETTING)}, 2 processes x 1 thread, "
                      "same seed and data; training time from metrics.jsonl's train_s, evaluations excluded, the "
                      "crossing interpolated between evaluations)\n\n" + text)


if __name__ == "__main__":
    main()
