"""Tokens/s of the default recipe (recipes/cpu-tiny.yaml): one process (no pipeline) and the README's main job
(2BW on 2 stages, 2 processes x 1 thread, Muon + EF), each a real run of scripts/pretrain.py.

    python bench/default_recipe.py [--steps 60] [--rounds 3] [--write]

The arms run one at a time, once per round, the order rotated every round so that slow phases of a shared machine
hit all arms alike; each reports its best round. Targets (issue 14): the main job at least 1.8x one process with
one thread, i.e. at least 0.9 of the no-bubble limit (twice that rate). The best 2BW run's own profile
(pipeline_profile.json) then feeds the simulator's prediction at p = 4, 8, 16 (bench/predict_scaling.py).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)


def run(cmd: list[str], out: Path) -> tuple[float, dict | None]:
    """(median tokens/s past the first third of the run, the run's pipeline_profile.json if it wrote one)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_EVALUATE_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stdout[-2000:] + r.stderr[-2000:])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [row["tokens_per_s"] for row in rows if "tokens_per_s" in row]
    prof = out / "pipeline_profile.json"
    return statistics.median(rates[len(rates) // 3:]), (json.loads(prof.read_text()) if prof.exists() else None)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    common = [f"--training.max_steps={args.steps}", "--training.export=false", "--training.report_to=none",
              "--training.eval_steps=0", "--training.save_steps=0", "--data.eval_blocks=8"]
    single = lambda threads: ["--pipeline.schedule=none", "--pipeline.num_stages=1", f"--training.torch_threads={threads}"]
    arms = {
        "one_thread": [sys.executable, "scripts/pretrain.py", "recipes/cpu-tiny.yaml", *common, *single(1)],
        "two_threads": [sys.executable, "scripts/pretrain.py", "recipes/cpu-tiny.yaml", *common, *single(2)],
        "two_bw": [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "recipes/accelerate/cpu-2proc.yaml",
                   "scripts/pretrain.py", "recipes/cpu-tiny.yaml", *common],
    }
    best: dict[str, tuple[float, dict | None]] = {}
    seen: dict[str, list[float]] = {}
    names = list(arms)
    with tempfile.TemporaryDirectory() as d:
        for rnd in range(args.rounds):
            order = names[rnd % len(names):] + names[: rnd % len(names)]
            print(f"round {rnd + 1}/{args.rounds}: {', '.join(order)}", flush=True)
            for name in order:
                out = Path(d) / f"{name}-{rnd}"
                tps, prof = run([*arms[name], f"--training.output_dir={out}"], out)
                seen.setdefault(name, []).append(tps)
                if name not in best or tps > best[name][0]:
                    best[name] = (tps, prof)
    one_thread, two_threads, two_bw = (best[k][0] for k in names)
    rng = lambda k: f"{min(seen[k]):,.0f}-{max(seen[k]):,.0f}"
    table = "\n".join([
        f"| run of recipes/cpu-tiny.yaml (1.3M-parameter Llama, 4,096 tokens per step) | tokens/s (best of {args.rounds}) | range |",
        "|---|---|---|",
        f"| 1 process, 1 thread, no pipeline (`--pipeline.schedule=none`) | {one_thread:,.0f} | {rng('one_thread')} |",
        f"| 1 process, 2 threads, no pipeline | {two_threads:,.0f} | {rng('two_threads')} |",
        f"| the README's main job: 2BW on 2 stages, 2 processes x 1 thread, Muon + EF | {two_bw:,.0f} "
        f"({two_bw / one_thread:.2f}x one thread) | {rng('two_bw')} |",
        "",
        f"- the main job / one process, one thread = {two_bw / one_thread:.2f} (target >= 1.8)",
        f"- the main job / no-bubble limit (2 x one thread, {2 * one_thread:,.0f} tokens/s) = {two_bw / (2 * one_thread):.2f} "
        "(target >= 0.9)",
    ])
    prof = best["two_bw"][1]
    if prof is not None:
        from bench.predict_scaling import report

        stages = prof["stages"]
        table += ("\n\nThe best main-job run's own profile (pipeline_profile.json): " + "; ".join(
            f"stage {s['stage']} busy {s['busy_share']:.0%}, F {s['forward_ms']:.1f} ms, B {s['backward_ms']:.1f} ms, "
            f"STEP {s['step_ms']:.1f} ms" for s in stages) + "\n\nPredicted by the simulator from it:\n\n"
            + report([s["seconds"] for s in stages], [s["counts"] for s in stages]))
    print(table)
    if args.write:
        from bench.report import write_section

        write_section("default", f"## Default recipe\n\nCommand: `python bench/default_recipe.py --steps {args.steps} "
                      f"--rounds {args.rounds} --write` ({time.strftime('%Y-%m-%d')}; per run the median tokens/s of its "
                      f"logged steps after the first third, best of the interleaved rounds)\n\n{table}",
                      first=True)


if __name__ == "__main__":
    main()
