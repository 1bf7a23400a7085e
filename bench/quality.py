"""The paper's table at our scale: final eval loss of {AdamW, Muon} x {sync, delay 1, delay 1 + EF},
and Muon under PipeDream's variable delay at 8 stages, all single-process exact delay simulations
(``optimizer.simulate_delay``) with the same model, data order and hyperparameters per optimizer.

    python bench/quality.py [--steps 300] [--seeds 0] [--parallel 2] [--write]

Each arm is a real run of scripts/pretrain.py (1 thread); ``--parallel`` arms run at once. The learning
rate of each optimizer is its sync arm's (``--adamw-lr``, ``--muon-lr``; ``--sweep`` tunes them on the sync
arms first) and is used unchanged for that optimizer's delayed arms. Writes runs/quality/*, a loss-curve
PNG and (``--write``) the quality section of docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)
MODEL = ("--model.config={model_type: llama, hidden_size: 128, intermediate_size: 384, num_hidden_layers: 8, "
         "num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 256, tie_word_embeddings: true}")


def arms(adamw_lr: float, muon_lr: float) -> dict[str, list[str]]:
    a = ["--optimizer.name=adamw", f"--optimizer.learning_rate={adamw_lr}"]
    # Muon's AdamW side (embeddings, norms) shares Muon's lr: with match_rms_adamw scaling one lr serves both
    m = ["--optimizer.name=muon", f"--optimizer.learning_rate={muon_lr}", f"--optimizer.adamw_lr={muon_lr}"]
    d1, ef = ["--optimizer.simulate_delay=1"], ["--optimizer.delay_correction=error_feedback"]
    # PipeDream: one update per microbatch, so the microbatch is the whole step's batch (same tokens per update)
    pd = ["--optimizer.simulate_delay=pipedream", "--pipeline.num_stages=8", "--pipeline.num_microbatches=1",
          "--pipeline.microbatch_size=32"]
    return {"adamw sync": a, "adamw delay-1": a + d1, "adamw delay-1 + EF": a + d1 + ef,
            "muon sync": m, "muon delay-1": m + d1, "muon delay-1 + EF": m + d1 + ef, "muon pipedream p=8": m + pd}


def run_arm(name: str, overrides: list[str], steps: int, seed: int, out_root: Path) -> dict:
    lr = next(o.split("=", 1)[1] for o in overrides if o.startswith("--optimizer.learning_rate="))
    # the directory names the arm, its lr and seed: a finished arm is reused by the sweep and by later runs
    out = out_root / f"{name.replace(' ', '_').replace('+', 'plus').replace('=', '')}-lr{float(lr):g}-seed{seed}"
    final = out / "final_eval.json"
    if not final.exists():
        cmd = [sys.executable, str(ROOT / "scripts/pretrain.py"), str(ROOT / "recipes/cpu-tiny.yaml"), MODEL,
               "--pipeline.schedule=none", "--pipeline.num_stages=1", "--pipeline.num_microbatches=4",
               "--pipeline.microbatch_size=8", f"--training.max_steps={steps}", f"--training.seed={seed}",
               f"--training.output_dir={out}", "--training.eval_steps=50", "--training.save_steps=0",
               "--training.torch_threads=1", "--training.report_to=none", "--data.eval_blocks=128",
               "--optimizer.delay_correction=none", *overrides]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_EVALUATE_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
        t0 = time.time()
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"arm {name} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
        print(f"  {name} (seed {seed}) done in {time.time() - t0:.0f}s", flush=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_loss" in r]
    return {"name": name, "seed": seed, "final": evals[-1]["eval_loss"], "curve": [(r["step"], r["eval_loss"]) for r in evals],
            "train": [(r["step"], r["loss"]) for r in rows if "loss" in r]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--adamw-lr", type=float, default=3e-3)
    ap.add_argument("--muon-lr", type=float, default=3e-3)
    ap.add_argument("--sweep", default=None, help="comma-separated lrs tried on the sync arms first, e.g. 1e-3,3e-3,1e-2")
    ap.add_argument("--out", default=str(ROOT / "runs" / "quality"))
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    out_root = Path(args.out)
    subprocess.run([sys.executable, str(ROOT / "scripts/prepare_data.py")], check=True, cwd=ROOT)
    lrs = {"adamw": args.adamw_lr, "muon": args.muon_lr}
    if args.sweep:
        grid = [float(x) for x in args.sweep.split(",")]
        jobs = [(f"{opt} sync", arms(lr, lr)[f"{opt} sync"], args.steps, seeds[0], out_root)
                for opt in ("adamw", "muon") for lr in grid]
        with ThreadPoolExecutor(args.parallel) as ex:
            res = list(ex.map(lambda j: run_arm(*j), jobs))
        for opt in ("adamw", "muon"):
            tried = [(r["final"], lr) for r, (name, *_), lr in zip(res, jobs, grid * 2) if name.startswith(opt)]
            lrs[opt] = min(tried)[1]
            print(f"{opt} sync: " + ", ".join(f"lr {lr:g} -> {f:.4f}" for f, lr in tried), flush=True)
        print(f"tuned on the sync arms: {lrs}")
    jobs = [(name, ov, args.steps, seed, out_root) for seed in seeds for name, ov in arms(lrs["adamw"], lrs["muon"]).items()]
    with ThreadPoolExecutor(args.parallel) as ex:
        results = list(ex.map(lambda j: run_arm(*j), jobs))
    table = report(results, lrs, args, out_root)
    print(table)
    if args.write:
        write_section(table)


def report(results, lrs, args, out_root: Path) -> str:
    import statistics

    names = list(dict.fromkeys(r["name"] for r in results))
    mean = {n: statistics.mean(r["final"] for r in results if r["name"] == n) for n in names}
    sd = {n: (statistics.stdev([r["final"] for r in results if r["name"] == n]) if len(args.seeds.split(",")) > 1 else 0.0) for n in names}
    lines = ["| arm | final eval loss | gap to sync | gap % | share of the gap closed by EF |", "|---|---|---|---|---|"]
    gaps = {}
    for n in names:
        opt = n.split()[0]
        sync = mean[f"{opt} sync"]
        gap = mean[n] - sync
        gaps[n] = gap
        closed = ""
        if n.endswith("+ EF"):
            base = gaps.get(f"{opt} delay-1")
            closed = f"{(base - gap) / base:.0%}" if base and base > 0 else "n/a (no delay gap)"
        pm = f" ± {sd[n]:.4f}" if sd[n] else ""
        lines.append(f"| {n} | {mean[n]:.4f}{pm} | {gap:+.4f} | {gap / sync:+.2%} | {closed} |")
    a_gap, m_gap = gaps["adamw delay-1"], gaps["muon delay-1"]
    lines += ["", "Targets (the paper's ordering at our scale):",
              f"- AdamW's delay gap >= 5x Muon's: {a_gap:+.4f} vs {m_gap:+.4f} -> "
              + (f"{a_gap / m_gap:.1f}x" if m_gap > 0 else "Muon shows no gap"),
              f"- EF closes >= 60% of AdamW's gap: {(a_gap - gaps['adamw delay-1 + EF']) / a_gap:.0%}" if a_gap > 0 else "- AdamW shows no delay gap",
              f"- Muon delayed within 0.5% of Muon sync: {m_gap / mean['muon sync']:+.2%}",
              f"- constant delay better than PipeDream's variable delay (8 stages): muon delay-1 {mean['muon delay-1']:.4f} vs pipedream {mean['muon pipedream p=8']:.4f}",
              "", f"Learning rates ({'tuned on the sync arms over ' + args.sweep if args.sweep else 'given, not swept'}; "
              f"shared by each optimizer's arms): {lrs}; seeds {args.seeds}; {args.steps} steps of 4,096 tokens."]
    _plot(results, out_root / "quality_curves.png")
    docs_png = ROOT / "docs" / "quality_curves.png"
    docs_png.write_bytes((out_root / "quality_curves.png").read_bytes())
    lines.append("\n![eval loss curves](quality_curves.png)")
    return "\n".join(lines)


def _plot(results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        if r["seed"] != results[0]["seed"]:
            continue
        style = "-" if "sync" in r["name"] else ("--" if "EF" not in r["name"] else ":")
        axes[0].plot(*zip(*r["curve"]), style, marker="o", ms=3, label=r["name"])
        steps, losses = zip(*r["train"])
        k = 10
        smooth = [sum(losses[max(0, i - k):i + 1]) / len(losses[max(0, i - k):i + 1]) for i in range(len(losses))]
        axes[1].plot(steps, smooth, style, label=r["name"], lw=1)
    axes[0].set_title("held-out loss")
    axes[1].set_title("training loss (moving average)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylim(top=min(8, axes[0].get_ylim()[1]))
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_section(table: str) -> None:
    from bench.report import write_section as write

    write("quality", f"## Delay tolerance: the paper's table at our scale\n\nCommand: `python bench/quality.py "
          f"{' '.join(sys.argv[1:])}` ({time.strftime('%Y-%m-%d')}; Llama h128 x 8 layers, 2.6M parameters, "
          f"default corpus, single-process exact delay simulation)\n\n{table}")


if __name__ == "__main__":
    main()
