"""Does logging drain the pipeline? 2BW tokens/s of the default recipe with ``logging_steps: 1`` against
``logging_steps: 1000``, each a real run of scripts/pretrain.py under accelerate (2 processes x 1 thread), in
interleaved rounds, best per arm; and the simulator's figure at p = m = 2, 4, 8 for the drain points a run still
has (evaluations/checkpoints every 100 steps) against the old behaviour (a drain every ``logging_steps``).

    python -m bench.streaming [--steps 40] [--rounds 2] [--write]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def trainer_run(logging_steps: int, steps: int, out: Path) -> float:
    """Tokens/s of the training loop (the rate since training started, read from the last step's record)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "recipes/accelerate/cpu-2proc.yaml",
           "scripts/pretrain.py", "recipes/cpu-tiny.yaml", f"--training.max_steps={steps}", "--training.export=false",
           "--training.report_to=none", "--training.eval_steps=0", "--training.save_steps=0", "--data.eval_blocks=8",
           f"--training.logging_steps={logging_steps}", f"--training.output_dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_EVALUATE_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stdout[-2000:] + r.stderr[-2000:])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row["tokens_per_s"] for row in rows if "tokens_per_s" in row][-1]


def simulated(p: int, m: int, ends: list[int]) -> float:
    """Steps per unit time of 2BW (F = 1, B = 2) drained after each step in ``ends`` (the last one ends the run)."""
    from hf_asyncpp.schedules import TWO_BW, Costs, simulate

    t, start = 0.0, 0
    for end in ends:
        t += simulate(TWO_BW.actions(p, m, end - start, first_step=start), Costs(1, 2), TWO_BW).makespan
        start = end
    return ends[-1] / t


def trainer_drains(logging_steps: int, total: int = 200) -> list[int]:
    """Where the trainer drains a run of the default recipe (eval and save every 100 steps)."""
    from hf_asyncpp.config.recipe import load_recipe
    from hf_asyncpp.run.trainer import drain_points

    recipe = load_recipe(ROOT / "recipes/cpu-tiny.yaml", [f"--training.max_steps={total}",
                                                        f"--training.logging_steps={logging_steps}"])
    return drain_points(0, recipe)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    best = {1: 0.0, 1000: 0.0}
    with tempfile.TemporaryDirectory() as d:
        for r in range(args.rounds):
            for every in (1, 1000) if r % 2 == 0 else (1000, 1):
                tps = trainer_run(every, args.steps, Path(d) / f"r{r}-{every}")
                best[every] = max(best[every], tps)
                print(f"round {r}: logging_steps {every}: {tps:,.0f} tokens/s", flush=True)
    rows = ["| 2BW run of recipes/cpu-tiny.yaml, 2 processes x 1 thread | tokens/s (best of "
            f"{args.rounds}) |", "|---|---|",
            f"| `logging_steps: 1` | {best[1]:,.0f} ({best[1] / best[1000]:.3f}x) |",
            f"| `logging_steps: 1000` | {best[1000]:,.0f} |"]
    sim = ["| p = m | now: `logging_steps: 1` / `1000` | now, relative to an unbroken stream | before: `logging_steps: 10` "
           "| before: `logging_steps: 1` |", "|---|---|---|---|---|"]
    for p in (2, 4, 8):
        stream = simulated(p, p, [200])
        now1, now1000 = simulated(p, p, trainer_drains(1)), simulated(p, p, trainer_drains(1000))
        old10, old1 = simulated(p, p, list(range(10, 201, 10))), simulated(p, p, list(range(1, 201)))
        sim.append(f"| {p} | {now1 / now1000:.3f} | {now1000 / stream:.3f} | {old10 / stream:.3f} | {old1 / stream:.3f} |")
    body = ("## Streaming: logging never drains the pipeline\n\n"
            f"Command: `python -m bench.streaming --steps {args.steps} --rounds {args.rounds} --write` "
            f"({time.strftime('%Y-%m-%d')}; the arms interleaved in one run, eval and checkpoints off, the rate since "
            "training started as recorded in the last step's `tokens_per_s`)\n\n" + "\n".join(rows) +
            "\n\nThe trainer cuts the stream only at evaluations, checkpoints and the end, so `logging_steps` changes "
            "neither the action lists nor the numbers (`tests/test_launch.py::test_logging_steps_change_nothing_computed`"
            " checks bit-identical losses and weights). Simulator, 200 steps of 2BW with F = 1, B = 2, the drain points "
            "of the trainer for the default recipe's evaluations and checkpoints (every 100 steps), against the trainer "
            "before this change, which drained at every `logging_steps` point too (throughput relative to one unbroken "
            "stream):\n\n" + "\n".join(sim))
    print(body)
    if args.write:
        from .report import write_section

        write_section("streaming", body)


if __name__ == "__main__":
    main()
