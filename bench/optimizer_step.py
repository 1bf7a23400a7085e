"""The optimizer step's share of each stage's time, Muon against AdamW, on the README's main job (recipes/cpu-tiny.yaml,
2BW on 2 stages, 2 processes x 1 thread): per stage, the step's time against the stage's forward + backward time per
step, from each run's own profile (pipeline_profile.json: mean F, B and STEP times of the run).

    python -m bench.optimizer_step [--steps 40] [--write]

Arms: Muon and AdamW, each with and without the EF correction, and Muon with its Newton-Schulz iteration in
bfloat16 (``optimizer.ns_dtype``; ``auto`` picks float32 on a CPU, where bfloat16 matmuls are emulated).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from .default_recipe import run

ARMS = {
    "Muon + EF (the main job; ns_dtype auto = float32 here)": ["--optimizer.name=muon"],
    "Muon": ["--optimizer.name=muon", "--optimizer.delay_correction=none"],
    "Muon + EF, ns_dtype bfloat16": ["--optimizer.name=muon", "--optimizer.ns_dtype=bfloat16"],
    "AdamW + EF": ["--optimizer.name=adamw"],
    "AdamW": ["--optimizer.name=adamw", "--optimizer.delay_correction=none"],
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    common = [f"--training.max_steps={args.steps}", "--training.export=false", "--training.report_to=none",
              "--training.eval_steps=0", "--training.save_steps=0", "--data.eval_blocks=8"]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for i, (name, over) in enumerate(ARMS.items()):
            out = Path(d) / f"arm{i}"
            tps, prof = run([sys.executable, "scripts/pretrain.py", "recipes/cpu-tiny.yaml", *common, *over,
                             f"--training.output_dir={out}"], out)
            print(f"{name}: {tps:,.0f} tokens/s", flush=True)
            for s in prof["stages"]:
                m = s["counts"]["F"] / s["counts"]["STEP"]  # microbatches per step, as the run did them
                fb = m * (s["forward_ms"] + s["backward_ms"])
                rows.append(f"| {name} | {s['stage']} | {fb:.0f} | {s['step_ms']:.1f} | {s['step_ms'] / fb:.0%} | "
                            f"{tps:,.0f} |")
    table = "\n".join(["| optimizer | stage | forward + backward per step (ms) | optimizer step (ms) | step / (F + B) | "
                       "tokens/s |", "|---|---|---|---|---|---|", *rows])
    print(table)
    if args.write:
        from .report import write_section

        write_section("optimizer-step", "## The optimizer step against forward + backward, per stage\n\nCommand: "
                      f"`python -m bench.optimizer_step --steps {args.steps} --write` ({time.strftime('%Y-%m-%d')}; "
                      "recipes/cpu-tiny.yaml, 2BW on 2 stages, 2 processes x 1 thread, 4 microbatches of 8 x 128 tokens "
                      "per step; each run's own profile, one run per arm)\n\n" + table)


if __name__ == "__main__":
    main()
