"""Tokens/s of the default recipe (recipes/cpu-tiny.yaml): one process (no pipeline) and the README's main job
(2BW on 2 stages, 2 processes x 1 thread), each a real run of scripts/pretrain.py, measured one after the other.

    python bench/default_recipe.py [--steps 60] [--write]
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


def run(cmd: list[str], out: Path) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_EVALUATE_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stdout[-2000:] + r.stderr[-2000:])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [row["tokens_per_s"] for row in rows if "tokens_per_s" in row]
    return statistics.median(rates[len(rates) // 3:])  # past the first chunks (warm-up)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    common = [f"--training.max_steps={args.steps}", "--training.export=false", "--training.report_to=none",
              "--training.eval_steps=0", "--training.save_steps=0", "--data.eval_blocks=8"]
    with tempfile.TemporaryDirectory() as d:
        single = Path(d) / "single"
        one_thread = run([sys.executable, "scripts/pretrain.py", "recipes/cpu-tiny.yaml", *common, "--pipeline.schedule=none",
                          "--pipeline.num_stages=1", "--training.torch_threads=1", f"--training.output_dir={single}"], single)
        single2 = Path(d) / "single2"
        two_threads = run([sys.executable, "scripts/pretrain.py", "recipes/cpu-tiny.yaml", *common, "--pipeline.schedule=none",
                           "--pipeline.num_stages=1", "--training.torch_threads=2", f"--training.output_dir={single2}"], single2)
        pipe = Path(d) / "pipe"
        two_bw = run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "recipes/accelerate/cpu-2proc.yaml",
                      "scripts/pretrain.py", "recipes/cpu-tiny.yaml", *common, f"--training.output_dir={pipe}"], pipe)
    table = "\n".join([
        "| run of recipes/cpu-tiny.yaml (1.3M-parameter Llama, 4,096 tokens per step) | tokens/s |", "|---|---|",
        f"| 1 process, 1 thread, no pipeline (`--pipeline.schedule=none`) | {one_thread:,.0f} |",
        f"| 1 process, 2 threads, no pipeline | {two_threads:,.0f} |",
        f"| the README's main job: 2BW on 2 stages, 2 processes x 1 thread, Muon + EF | {two_bw:,.0f} ({two_bw / one_thread:.2f}x one thread) |",
    ])
    print(table)
    if args.write:
        from bench.report import write_section

        write_section("default", f"## Default recipe\n\nCommand: `python bench/default_recipe.py --steps {args.steps} --write` "
                      f"({time.strftime('%Y-%m-%d')}; median tokens/s of the logged chunks after the first third)\n\n{table}",
                      first=True)


if __name__ == "__main__":
    main()
