"""Tokens/s of the default recipe (recipes/cpu-tiny.yaml): one process (no pipeline) and the README's main job
(2BW on 2 stages, 2 processes x 1 thread, Muon + EF), each a real run of scripts/pretrain.py.

    python -m bench.default_recipe [--steps 60] [--rounds 3] [--write]

The arms run one at a time, once per round, the order rotated every round so that slow phases of a shared machine
hit all arms alike; each reports its best round. Targets: the main job at least 1.8x one process with
one thread, i.e. at least 0.9 of the no-bubble limit (twice that rate). The best 2BW run's own profile
(pipeline_profile.json) then feeds the simulator's prediction at p = 4, 8, 16 (``predict``). ``--write`` replaces
the ``default`` section of docs/benchmarks/speed.md. ``run`` (one command, its steady rate and profile) is shared with
``bench.optimizer_step``.
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

from hf_asyncpp.plan.search import steady_step_time
from hf_asyncpp.schedules.records import ONE_F_ONE_B, TWO_BW
from hf_asyncpp.schedules.simulator import Costs

ROOT = Path(__file__).resolve().parent.parent


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


def whole_model(seconds: list[dict], counts: list[dict]) -> dict[str, float]:
    """Per microbatch forward and backward, per step the optimizer step: summed over the measured stages."""
    c = Costs.from_measured(seconds, counts)
    return {"F": sum(c.forward), "B": sum(c.backward), "STEP": sum(c.step)}


def predict(seconds: list[dict], counts: list[dict], ps=(4, 8, 16), comm_s: float = 0.0) -> list[dict]:
    """The simulator at p = 4, 8, 16 (m = p and 2p, steady state) on a measured run's per-action costs: the whole
    model's cost per microbatch cut into p equal stages (the measured split's imbalance is not carried over); a
    transfer takes ``comm_s``, the reduction is free, per-action overhead that grows with p is not modelled, so
    the ratios are what the schedule allows, an upper bound for the executor. (``hf-asyncpp plan`` answers the same
    question for a recipe from its FLOPs or ``--measure``; this one starts from a run's own profile.)"""
    tot = whole_model(seconds, counts)
    rows = []
    for p in ps:
        for m in (p, 2 * p):
            costs = Costs(forward=tot["F"] / p, backward=tot["B"] / p, step=tot["STEP"] / p, comm=comm_s)
            t2, bubble2 = steady_step_time(TWO_BW, p, m, costs, "global")
            t1, bubble1 = steady_step_time(ONE_F_ONE_B, p, m, costs, "global")
            limit = (m * (tot["F"] + tot["B"]) + tot["STEP"]) / p
            rows.append({"p": p, "m": m, "2bw_s": t2, "1f1b_s": t1, "2bw_bubble": bubble2, "1f1b_bubble": bubble1,
                         "2bw_over_1f1b": t1 / t2, "2bw_over_limit": limit / t2})
    return rows


def report(seconds: list[dict], counts: list[dict], comm_s: float = 0.0) -> str:
    """``predict`` as a table, with its assumptions."""
    rows, tot = predict(seconds, counts, comm_s=comm_s), whole_model(seconds, counts)
    lines = [f"Measured whole-model costs: forward {tot['F'] * 1e3:.1f} ms and backward {tot['B'] * 1e3:.1f} ms per "
             f"microbatch, optimizer step {tot['STEP'] * 1e3:.1f} ms per step, cut into p equal stages; transfers "
             f"{comm_s * 1e3:g} ms each, reductions free, per-action overhead not modelled (an upper bound).", "",
             "| p | m | 2bw s/step | 1f1b s/step | 2bw bubble | 1f1b bubble | 2bw / 1f1b | 2bw / no-bubble limit |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['p']} | {r['m']} | {r['2bw_s']:.3f} | {r['1f1b_s']:.3f} | {r['2bw_bubble']:.1%} | "
              f"{r['1f1b_bubble']:.1%} | {r['2bw_over_1f1b']:.2f} | {r['2bw_over_limit']:.2f} |" for r in rows]
    return "\n".join(lines)


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
        stages = prof["stages"]
        table += ("\n\nThe best main-job run's own profile (pipeline_profile.json): " + "; ".join(
            f"stage {s['stage']} busy {s['busy_share']:.0%}, F {s['forward_ms']:.1f} ms, B {s['backward_ms']:.1f} ms, "
            f"STEP {s['step_ms']:.1f} ms" for s in stages) + "\n\nPredicted by the simulator from it:\n\n"
            + report([s["seconds"] for s in stages], [s["counts"] for s in stages]))
    print(table)
    if args.write:
        from .report import write_section

        write_section("default", f"## Default recipe\n\nCommand: `python -m bench.default_recipe --steps {args.steps} "
                      f"--rounds {args.rounds} --write` ({time.strftime('%Y-%m-%d')}; per run the median tokens/s of its "
                      f"logged steps after the first third, best of the interleaved rounds)\n\n{table}",
                      first=True)


if __name__ == "__main__":
    main()
