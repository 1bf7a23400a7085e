"""Delay tolerance in the paper's regime (arXiv 2606.30634: 20 tokens per parameter, thousands of steps), reported
as the paper's ratios instead of nats. ``bench/quality.py`` stays the short-run (300-step) table.

    python bench/paper_regime.py [--out DIR] [--parallel 2] [--phases tune,main,ladder,beta1,lambda,syncstart] [--write]

The protocol (``PROTOCOL``; every knob next to the paper's in the report's regime table):

- Llama h64 x 4 layers, 4 heads (2 KV), FFN 192, byte-level BPE of 1,024 tokens, tied embeddings: ``params()``
  parameters, a quarter of them the embedding. 20 tokens per parameter at 1,024 tokens per step (8 x 128) gives
  T ~ 5,100 optimizer steps; a run takes 4-5 minutes on one thread.
- Data: the State of the Union addresses with every 10th speech held out whole (``prepare_default_corpus(...,
  eval_every=10)``): about 3.7M training tokens (the run reads 1.4 epochs of them) and 2,048 held-out blocks of 128
  tokens (262K tokens), the same blocks for every arm, so arms are compared paired.
- Warm-up 10%, cosine to 10%; decoupled weight decay set per learning rate so that its timescale 1/(lr wd) is
  ``WD_TIMESCALE`` (0.4) of the run (AdamW timescale rule, Wang & Aitchison 2024); clip 1.0.
- Learning rates tuned on each optimizer's sync arm at the final length; a grid whose best point is at an edge is
  extended until the optimum is bracketed. Muon's AdamW side (embeddings, norms) runs at AdamW's tuned lr.
- Arms are the exact single-process references (``optimizer.simulate_delay``; equal step for step to the pipeline,
  tests/test_runtime.py), so losses do not depend on machine load: ``--parallel`` runs at once, 1 thread each.

Phases (each reuses finished runs and resumes killed ones from their last checkpoint, so the command can be
re-run after an interruption): ``tune`` (lr grids), ``main`` (AdamW and Muon x sync / delay 1 / delay 1 + EF x 3
seeds), ``ladder`` (complete sync runs at T/8, T/4, T/2 and delayed runs at T/4, T/2: the effective-step fraction and
each gap's exponent in T), ``beta1`` (the first-moment table of the stability model), ``lambda`` (fixed 0.5 / 1 /
1.5, auto and learned at T and T/2), ``syncstart`` (synchronous first 10%). ``--report-only`` runs nothing.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)

from bench.quality import launch, read_run  # noqa: E402

MODEL = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "tie_word_embeddings": True}
VOCAB, SEQ, BATCH = 1024, 128, 8
TOKENS_PER_PARAM = 20
WD_TIMESCALE = 0.4  # 1 / (lr * weight decay) as a fraction of the run
EVAL_BLOCKS = 2048
PHASES = ("tune", "main", "ladder", "beta1", "lambda", "syncstart")
GRIDS = {"adamw": [1e-3, 2e-3, 4e-3, 8e-3], "muon": [2.5e-3, 5e-3, 1e-2, 2e-2]}
# arXiv 2606.30634, 360M, validation loss: sync / delayed / delayed + EF
PAPER = {"muon": (2.578, 2.590, 2.583), "adamw": (2.612, 2.890, 2.640)}
VARIANTS = {  # arm suffix -> overrides on top of the optimizer's base
    "sync": [],
    "delay": ["--optimizer.simulate_delay=1"],
    "delay+EF": ["--optimizer.simulate_delay=1", "--optimizer.delay_correction=error_feedback"],
}


def params() -> tuple[int, int]:
    """(parameters, of which the embedding) of the protocol's model, counted once for the tied head."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**{**MODEL, "vocab_size": VOCAB})
    model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters()), model.get_input_embeddings().weight.numel()


def full_steps() -> int:
    return round(TOKENS_PER_PARAM * params()[0] / (BATCH * SEQ))


def weight_decay(lr: float, steps: int) -> float:
    return 1.0 / (WD_TIMESCALE * steps * lr)


def optimizer_args(opt: str, lr: float, steps: int, adamw_lr: float | None = None) -> list[str]:
    """The optimizer's overrides at peak lr ``lr`` for a run of ``steps``: weight decay from the timescale rule."""
    if opt == "muon":
        side = adamw_lr or lr
        return ["--optimizer.name=muon", f"--optimizer.learning_rate={lr:g}", f"--optimizer.weight_decay={weight_decay(lr, steps):.6g}",
                f"--optimizer.adamw_lr={side:g}", f"--optimizer.adamw_weight_decay={weight_decay(side, steps):.6g}"]
    name = {"adamw": "adamw", "nadam": "nadam"}[opt]
    return [f"--optimizer.name={name}", f"--optimizer.learning_rate={lr:g}", f"--optimizer.weight_decay={weight_decay(lr, steps):.6g}"]


class Bench:
    def __init__(self, out: Path, parallel: int, report_only: bool):
        self.out, self.parallel, self.report_only = out, parallel, report_only
        self.T = full_steps()
        self.train_files, self.eval_files = self._corpus()
        self.lrs: dict[str, float] = json.loads((out / "lrs.json").read_text()) if (out / "lrs.json").exists() else {}

    def _corpus(self) -> tuple[list[str], list[str]]:
        from hf_asyncpp.corpus import prepare_default_corpus

        return prepare_default_corpus(self.out / "corpus", eval_every=10)

    def run_dir(self, tag: str, steps: int, seed: int) -> Path:
        return self.out / f"T{steps}" / f"{tag}-seed{seed}"

    def job(self, tag: str, args: list[str], steps: int, seed: int = 0) -> tuple:
        return (tag, args, steps, seed)

    def run(self, job: tuple) -> dict | None:
        tag, args, steps, seed = job
        out = self.run_dir(tag, steps, seed)
        if not (out / "final_eval.json").exists():
            if self.report_only:
                return None
            launch(f"{tag} T={steps}", seed, out, [
                "--model.config=" + json.dumps(MODEL), f"--model.vocab_size={VOCAB}",
                "--data.train_files=" + json.dumps(self.train_files), "--data.eval_files=" + json.dumps(self.eval_files),
                f"--data.seq_len={SEQ}", f"--data.eval_blocks={EVAL_BLOCKS}",
                "--pipeline.schedule=none", "--pipeline.num_stages=1", "--pipeline.num_microbatches=1",
                f"--pipeline.microbatch_size={BATCH}", f"--training.max_steps={steps}", f"--training.seed={seed}",
                f"--training.eval_steps={max(1, steps // 10)}", f"--training.save_steps={max(1, steps // 10)}",
                f"--training.logging_steps={max(1, steps // 100)}", "--training.warmup_steps=0.1",
                "--training.lr_scheduler_type=cosine_with_min_lr", "--training.lr_scheduler_kwargs={min_lr_rate: 0.1}",
                "--optimizer.delay_correction=none", *args])
        r = read_run(tag, seed, out)
        r["steps"] = steps
        return r

    def run_all(self, jobs: list[tuple]) -> list[dict]:
        with ThreadPoolExecutor(self.parallel) as ex:
            return [r for r in ex.map(self.run, jobs) if r is not None]

    # ------------------------------------------------------------------ phases

    def tune(self) -> None:
        """Each optimizer's sync arm over its grid at T (seed 0), the grid extended by x2 past an edge optimum."""
        for opt in ("adamw", "muon"):
            grid = list(GRIDS[opt])
            while True:
                side = self.lrs.get("adamw")
                res = self.run_all([self.job(f"{opt}-lr{lr:g}-sync", optimizer_args(opt, lr, self.T, side), self.T) for lr in grid])
                if len(res) < len(grid):
                    return
                finals = [r["final"] for r in res]
                best = finals.index(min(finals))
                if best == 0:
                    grid.insert(0, grid[0] / 2)
                elif best == len(grid) - 1:
                    grid.append(grid[-1] * 2)
                else:
                    break
            self.lrs[opt] = grid[best]
            print(f"{opt}: " + ", ".join(f"lr {lr:g} -> {f:.4f}" for lr, f in zip(grid, finals)), flush=True)
            (self.out / "lrs.json").write_text(json.dumps(self.lrs))

    def arm(self, opt: str, variant: str, steps: int, extra: list[str] = (), tag: str | None = None,
            lr_opt: str | None = None) -> tuple[str, list[str]]:
        lr = self.lrs[lr_opt or opt]
        base = optimizer_args(opt, lr, steps, self.lrs.get("adamw"))
        return (tag or f"{opt}-lr{lr:g}-{variant}"), base + VARIANTS[variant] + list(extra)

    def main_jobs(self, seeds=(0, 1, 2)) -> list[tuple]:
        """AdamW and Muon x sync / delay 1 / delay 1 + EF (lambda 1) at T, 3 seeds."""
        return [self.job(*self.arm(opt, v, self.T), self.T, seed) for seed in seeds for opt in ("adamw", "muon")
                for v in VARIANTS]

    def ladder_jobs(self) -> list[tuple]:
        """Complete runs (each with its own schedule and weight-decay timescale) at fractions of T, seed 0: sync at
        T/8, T/4, T/2 (with T: the ladder the effective-step fraction is read from), delayed at T/4, T/2 (with T:
        each gap's exponent in T)."""
        jobs = []
        for opt in ("adamw", "muon"):
            for k in (8, 4, 2):
                steps = round(self.T / k)
                for v in VARIANTS if k < 8 else ("sync",):
                    jobs.append(self.job(*self.arm(opt, v, steps), steps))
        return jobs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "runs" / "paper_regime"))
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    b = Bench(out, args.parallel, args.report_only)
    print(f"T = {b.T} steps; model {params()}", flush=True)
    phases = args.phases.split(",")
    if "tune" in phases:
        b.tune()
    jobs = []
    if "main" in phases:
        jobs += b.main_jobs()
    if "ladder" in phases:
        jobs += b.ladder_jobs()
    results = b.run_all(jobs)


if __name__ == "__main__":
    main()
