"""Delay tolerance in the paper's regime (arXiv 2606.30634: 20 tokens per parameter, thousands of steps), reported
as the paper's ratios instead of nats. ``bench.quality`` stays the short-run (300-step) table.

    python -m bench.paper_regime [--out DIR] [--parallel 2] [--phases tune,main,ladder,beta1,lambda,syncstart] [--write]
    python -m bench.paper_regime --phases moe-tune,moe-main,moe-ladder [--out DIR] [--parallel 2] [--write]

The first is the dense study (its phases are the default), the second its MoE arm; either writes the
whole section, both models' tables, from whatever has finished.

The protocol (``PROTOCOL``; every knob next to the paper's in the report's regime table):

- Llama h64 x 4 layers, 4 heads (2 KV), FFN 192, byte-level BPE of 1,024 tokens, tied embeddings: ``params()``
  parameters, a quarter of them the embedding. 20 tokens per parameter at 1,024 tokens per step (8 x 128) gives
  T ~ 5,100 optimizer steps; a run takes 4-5 minutes on one thread.
- Data: the State of the Union addresses with every 10th speech held out whole (``prepare_default_corpus(...,
  eval_every=10)``): about 3.7M training tokens (the run reads 1.4 epochs of them) and 2,048 held-out blocks of 128
  tokens (262K tokens), the same blocks for every arm, so arms are compared paired.
- Warm-up 10%, cosine to 10%; decoupled weight decay set per learning rate so that its timescale 1/(lr wd) is
  ``WD_TIMESCALE`` (0.4) of the run (AdamW timescale rule, Wang & Aitchison 2024); clip 1.0.
- Data order: a full shuffle of the documents each epoch (``SHUFFLE_BUFFER``): the corpus is chronological, and a
  1,000-document buffer left eras of speeches in training order, which made the held-out loss rise mid-run.
- Learning rates tuned on each optimizer's sync arm at the final length; a grid whose best point is at an edge is
  extended until the optimum is bracketed. Muon's AdamW side (embeddings, norms) runs at ``MUON_ADAMW_LR``.
- Arms are the exact single-process references (``optimizer.simulate_delay``; equal step for step to the pipeline,
  tests/test_runtime.py), so losses do not depend on machine load: ``--parallel`` runs at once, 1 thread each.

Phases (each reuses finished runs and resumes killed ones from their last checkpoint, so the command can be
re-run after an interruption): ``tune`` (lr grids), ``main`` (AdamW and Muon x sync / delay 1 / delay 1 + EF x 3
seeds), ``ladder`` (complete sync runs at T/8, T/4, T/2 and delayed runs at T/4, T/2, those at T/4 and T/2 with 3
seeds: the effective-step fraction and each gap's exponent in T), ``beta1`` (the first-moment table of the stability model), ``lambda`` (fixed 0.5 / 1 /
1.5, auto and learned at T and T/2), ``syncstart`` (synchronous first 10%). ``--report-only`` runs nothing.

The MoE arm (``MOE_MODEL``, ``MOE_PHASES``): a Qwen3-MoE with the dense model's shape and active parameters (8 experts
of FFN 96, top-2: a token's expert FFN is the dense 192), T from 20 tokens per ACTIVE parameter (``count_params``),
everything else the dense protocol's. ``moe-tune`` (3-point grids about the dense lrs, extended until bracketed),
``moe-main`` (AdamW and Muon x sync / delay 1 / delay 1 + EF x 3 seeds), ``moe-ladder`` (complete sync runs at T/8,
T/4, T/2, seed 0: R4). Its runs go to ``--out``/moe, its summaries to ``RESULTS``/moe, each with the router's balance
over the run (``router_balance``: the aux loss and each expert's share of the tokens, which the single-process engine
records per step in metrics.jsonl). A MoE run takes about 1.4x a dense one (measured 2026-11-27, interleaved steps).

Finished arms are summarised in ``bench/results/paper_regime/`` (``RESULTS``, committed: the held-out curve and final
loss, the training loss, lambda; the tuned learning rates, the noise scales): the run folders under ``--out`` hold
the checkpoints a killed arm resumes from, the summaries are what a later session, on another machine, goes on from.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from hf_asyncpp.figures import pyplot

from .quality import launch, read_run

ROOT = Path(__file__).resolve().parent.parent

MODEL = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "tie_word_embeddings": True}
VOCAB, SEQ, BATCH = 1024, 128, 8
TOKENS_PER_PARAM = 20
WD_TIMESCALE = 0.4  # 1 / (lr * weight decay) as a fraction of the run
EVAL_BLOCKS = 2048
PHASES = ("tune", "main", "ladder", "beta1", "lambda", "syncstart", "lambda-seeds")
# the lambda arms rerun with seeds 1 and 2 at T/4, where one seed's spread is widest (AdamW 0.14 nats, Muon 0.019):
# the fixed lambdas and the learned rule compared on 3-seed means (lambda 1's seeds are the ladder's)
SEEDED_LAMBDAS = ("0.5", "1", "1.5", "learned-lr")
# the learned lambda's variants: name -> (its step ``ef_lambda_lr``, ``ef_lambda_schedule``, tag suffix). The default
# step; a quarter of it (does the overshoot at T/2 go?); the default and 2.5x it times the lr schedule's factor (the
# step large early, small late, as the two constant steps asked for)
LEARNED = {"learned": (0.02, "constant", ""), "learned-slow": (0.005, "constant", "-step0.005"),
           "learned-lr": (0.02, "lr", "-lrsched"), "learned-lr-fast": (0.05, "lr", "-step0.05-lrsched")}
GRIDS = {"adamw": [2e-3, 4e-3, 8e-3, 1.6e-2], "muon": [2.5e-3, 5e-3, 1e-2, 2e-2]}
# Muon's AdamW side (embeddings, norms) at the best AdamW lr of a first sweep at T (1e-3 .. 1.6e-2, 2026-11-25), so
# that both grids run at once; not Muon's own lr (the 300-step table ran its AdamW side at Muon's 1e-2)
MUON_ADAMW_LR = 8e-3
# Finished arms are kept here, in the repository, as small summaries (final and curve of the held-out loss, the
# training loss, lambda), with the tuned learning rates and the noise scales: the run folders under --out hold
# checkpoints and do not outlive a machine, the summaries do, so a later session goes on from them
RESULTS = ROOT / "bench" / "results" / "paper_regime"
SHUFFLE_BUFFER = 10_000  # more documents than the corpus has (about 6,000): a full shuffle per epoch
# arXiv 2606.30634, 360M, validation loss: sync / delayed / delayed + EF
PAPER = {"muon": (2.578, 2.590, 2.583), "adamw": (2.612, 2.890, 2.640)}
VARIANTS = {  # arm suffix -> overrides on top of the optimizer's base
    "sync": [],
    "delay": ["--optimizer.simulate_delay=1"],
    "delay+EF": ["--optimizer.simulate_delay=1", "--optimizer.delay_correction=error_feedback"],
}
# The MoE arm: a Qwen3-MoE of the dense model's shape whose ACTIVE parameters are the dense model's: 8
# experts of FFN 96, top-2, so a token's expert FFN is the dense FFN's 2 x 96 = 192 (plus the router and Qwen3's QK
# norms: +0.8%); 2.7x the dense model's parameters in all. The package's MoE options: the router aux loss in the
# model's config (coefficient 0.001, recipes/moe-2b.yaml's and Qwen3's), the top-k weights renormalised (Qwen3's),
# expert stacks 3-D (Muon orthogonalises each expert's gate, up and down matrices apart), the routers on Muon's
# AdamW side.
MOE_MODEL = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
             "moe_intermediate_size": 96, "decoder_sparse_step": 1, "norm_topk_prob": True,
             "output_router_logits": True, "router_aux_loss_coef": 0.001, "max_position_embeddings": 128,
             "tie_word_embeddings": True}
# 3 points about the dense model's tuned lrs (adamw 0.016, muon 0.01), extended by x2 until the optimum is bracketed
MOE_GRIDS = {"adamw": [8e-3, 1.6e-2, 3.2e-2], "muon": [5e-3, 1e-2, 2e-2]}
MOE_PHASES = ("moe-tune", "moe-main", "moe-ladder")
# arXiv 2606.30634, 10B MoE on 200B tokens: sync / delayed / delayed + EF (the sync hyperparameters)
PAPER_MOE = (1.906, 1.911, 1.906)
ROUTER_POINTS = 100  # windows of the run in a summary's router balance


@dataclass(frozen=True)
class ParamCounts:
    """A model's parameters, the tied head counted once. ``active``: what one token's forward uses, the routed
    experts counted at top_k / num_experts (the tokens-per-parameter rule counts these, the paper's MoE too)."""

    total: int
    active: int
    embedding: int
    experts: int  # the routed experts' stacks, all of them


@dataclass(frozen=True)
class ModelSpec:
    """One model of the study: its config, its first lr grids, and the folder (under ``--out`` and ``RESULTS``) of
    its runs and summaries: the dense model's are at the top, where they have always been."""

    name: str
    config: dict
    grids: dict
    folder: str


DENSE = ModelSpec("dense", MODEL, GRIDS, "")
MOE = ModelSpec("moe", MOE_MODEL, MOE_GRIDS, "moe")


def count_params(config: dict) -> ParamCounts:
    """Total, active, embedding and routed-expert parameters of ``config`` at the protocol's vocabulary (built on the
    meta device). A routed expert parameter is a 3-D stack of an ``experts`` module; a token uses top_k of its
    num_experts matrices."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**{**config, "vocab_size": VOCAB})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in f".{n}" and p.dim() == 3)
    share = cfg.num_experts_per_tok / cfg.num_experts if experts else 1.0
    return ParamCounts(total, round(total - experts * (1 - share)), model.get_input_embeddings().weight.numel(), experts)


def params() -> tuple[int, int]:
    """(parameters, of which the embedding) of the dense protocol's model, counted once for the tied head."""
    c = count_params(MODEL)
    return c.total, c.embedding


def full_steps(config: dict = MODEL) -> int:
    """T: 20 tokens per (active) parameter at the protocol's batch."""
    return round(TOKENS_PER_PARAM * count_params(config).active / (BATCH * SEQ))


def weight_decay(lr: float, steps: int) -> float:
    return 1.0 / (WD_TIMESCALE * steps * lr)


def optimizer_args(opt: str, lr: float, steps: int) -> list[str]:
    """The optimizer's overrides at peak lr ``lr`` for a run of ``steps``: weight decay from the timescale rule."""
    if opt == "muon":
        side = MUON_ADAMW_LR
        return ["--optimizer.name=muon", f"--optimizer.learning_rate={lr:g}", f"--optimizer.weight_decay={weight_decay(lr, steps):.6g}",
                f"--optimizer.adamw_lr={side:g}", f"--optimizer.adamw_weight_decay={weight_decay(side, steps):.6g}"]
    name = {"adamw": "adamw", "nadam": "nadam"}[opt]
    return [f"--optimizer.name={name}", f"--optimizer.learning_rate={lr:g}", f"--optimizer.weight_decay={weight_decay(lr, steps):.6g}"]


class Bench:
    """The study of one model (``spec``): its runs under ``out`` (the MoE's in ``out/moe``), its summaries under
    ``RESULTS`` (``RESULTS/moe``); both models read the same corpus, ``out/corpus``."""

    def __init__(self, out: Path, parallel: int, report_only: bool, spec: ModelSpec = DENSE):
        self.spec, self.parallel, self.report_only = spec, parallel, report_only
        self.out = out / spec.folder if spec.folder else out
        self.T = full_steps(spec.config)
        self.train_files, self.eval_files = self._corpus(out)
        self.results = RESULTS / spec.folder if spec.folder else RESULTS
        lrs = self.results / "lrs.json" if (self.results / "lrs.json").exists() else self.out / "lrs.json"
        self.lrs: dict[str, float] = json.loads(lrs.read_text()) if lrs.exists() else {}

    def _corpus(self, out: Path) -> tuple[list[str], list[str]]:
        from hf_asyncpp.data.corpus import prepare_default_corpus

        return prepare_default_corpus(out / "corpus", eval_every=10)

    def run_dir(self, tag: str, steps: int, seed: int) -> Path:
        return self.out / f"T{steps}" / f"{tag}-seed{seed}"

    def job(self, tag: str, args: list[str], steps: int, seed: int = 0) -> tuple:
        return (tag, args, steps, seed)

    def summary_file(self, tag: str, steps: int, seed: int) -> Path:
        return self.results / f"T{steps}" / f"{tag}-seed{seed}.json"

    def train_args(self, args: list[str], steps: int, seed: int) -> list[str]:
        """scripts/pretrain.py's overrides for an arm (``args``: its optimizer's) of ``steps`` steps: the protocol."""
        return ["--model.config=" + json.dumps(self.spec.config), f"--model.vocab_size={VOCAB}",
                "--data.train_files=" + json.dumps(self.train_files), "--data.eval_files=" + json.dumps(self.eval_files),
                f"--data.seq_len={SEQ}", f"--data.eval_blocks={EVAL_BLOCKS}", f"--data.shuffle_buffer={SHUFFLE_BUFFER}",
                "--pipeline.schedule=none", "--pipeline.num_stages=1", "--pipeline.num_microbatches=1",
                f"--pipeline.microbatch_size={BATCH}", f"--training.max_steps={steps}", f"--training.seed={seed}",
                f"--training.eval_steps={max(1, steps // 10)}", f"--training.save_steps={max(1, steps // 10)}",
                f"--training.logging_steps={max(1, steps // 100)}", "--training.warmup_steps=0.1",
                "--training.lr_scheduler_type=cosine_with_min_lr", "--training.lr_scheduler_kwargs={min_lr_rate: 0.1}",
                "--optimizer.delay_correction=none", *args]

    def run(self, job: tuple, may_launch: bool = True) -> dict | None:
        """A finished arm's summary: kept, read from its finished run folder, or run (resumed) now; None where it has
        not finished and ``--report-only`` (or ``may_launch`` False: an arm of a phase not asked for) says not to
        run it."""
        tag, args, steps, seed = job
        kept = self.summary_file(tag, steps, seed)
        if kept.exists():
            return json.loads(kept.read_text())
        out = self.run_dir(tag, steps, seed)
        if not (out / "final_eval.json").exists():
            if self.report_only or not may_launch:
                return None
            launch(f"{self.spec.name} {tag} T={steps}", seed, out, self.train_args(args, steps, seed))
        r = read_run(tag, seed, out)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        r.update(tag=tag, steps=steps, lr=float(next(a.split("=")[1] for a in args
                                                                   if a.startswith("--optimizer.learning_rate="))))
        r["lambda"] = [(row["step"], row["ef_lambda"]) for row in rows if "ef_lambda" in row]
        r["train"] = r["train"][:: max(1, len(r["train"]) // 100)]  # about 100 points: the summary stays small
        if any("expert_tokens" in row for row in rows):
            r["router"] = router_balance(rows)
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text(json.dumps(r))
        return json.loads(kept.read_text())  # the same types (lists, not tuples) whether just run or kept

    def measure(self, results: dict) -> None:
        """Once per finished sync run at T/4 and T (seed 0): its gradient noise scale (``bench.noise_scale``); and the
        training text's token count (for the epochs)."""
        from .noise_scale import measure

        path = self.results / "noise_scale.json"
        known = json.loads(path.read_text()) if path.exists() else {}
        for opt in ("adamw", "muon"):
            for k in ("T/4", "T"):
                steps = self.lengths()[k]
                key = f"{opt} sync, end of a {k} run"
                r = results.get((self.arm(opt, "sync", steps)[0], steps, 0))
                if r and key not in known and (self.run_dir(r["tag"], steps, 0) / "tokenizer").exists():
                    known[key] = measure(self.run_dir(r["tag"], steps, 0))
        path.write_text(json.dumps(known, indent=1))
        tok_file = self.results / "train_tokens.json"
        tok_dir = next((d for key in results if (d := self.run_dir(*key) / "tokenizer").exists()), None)
        if not tok_file.exists() and tok_dir is not None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(tok_dir)
            n = sum(len(tok(json.loads(line)["text"]).input_ids) + 1 for f in self.train_files
                    for line in Path(f).read_text().splitlines())
            tok_file.write_text(json.dumps({"tokens": n}))

    def tuning_jobs(self) -> list[tuple]:
        """The finished points of the lr grids (for the report)."""
        out = []
        for opt in ("adamw", "muon"):
            names = {d.name.removesuffix(".json") for root in (self.out, self.results)
                     for d in (root / f"T{self.T}").glob(f"{opt}-lr*-sync-seed0*")}
            for name in sorted(names):
                lr = float(name[len(opt) + 3:].split("-")[0])
                out.append(self.job(f"{opt}-lr{lr:g}-sync", optimizer_args(opt, lr, self.T), self.T))
        return out

    def run_all(self, jobs: list[tuple], may_launch: bool = True) -> list[dict]:
        with ThreadPoolExecutor(self.parallel) as ex:
            return [r for r in ex.map(lambda j: self.run(j, may_launch), jobs) if r is not None]

    # ------------------------------------------------------------------ phases

    def tune(self) -> None:
        """Each optimizer's sync arm over its grid at T (seed 0), both grids at once; a grid whose best point is at an
        edge is extended by x2 past it until the optimum is bracketed."""
        grids = {opt: list(g) for opt, g in self.spec.grids.items()}
        while True:
            jobs = [self.job(f"{opt}-lr{lr:g}-sync", optimizer_args(opt, lr, self.T), self.T) for opt, g in grids.items() for lr in g]
            res = {(r["tag"]): r["final"] for r in self.run_all(jobs)}
            if len(res) < len(jobs):
                return
            grown = False
            for opt, g in grids.items():
                finals = [res[f"{opt}-lr{lr:g}-sync"] for lr in g]
                best = finals.index(min(finals))
                if best in (0, len(g) - 1):
                    g.insert(0, g[0] / 2) if best == 0 else g.append(g[-1] * 2)
                    grown = True
                else:
                    self.lrs[opt] = g[best]
            if not grown:
                break
        self.results.mkdir(parents=True, exist_ok=True)
        (self.results / "lrs.json").write_text(json.dumps(self.lrs))

    def arm(self, opt: str, variant: str, steps: int, extra: list[str] = (), tag: str | None = None,
            lr_opt: str | None = None) -> tuple[str, list[str]]:
        lr = self.lrs[lr_opt or opt]
        base = optimizer_args(opt, lr, steps)
        return (tag or f"{opt}-lr{lr:g}-{variant}"), base + VARIANTS[variant] + list(extra)

    def main_jobs(self, seeds=(0, 1, 2)) -> list[tuple]:
        """AdamW and Muon x sync / delay 1 / delay 1 + EF (lambda 1) at T."""
        return [self.job(*self.arm(opt, v, self.T), self.T, seed) for seed in seeds for opt in ("adamw", "muon")
                for v in VARIANTS]

    def lengths(self) -> dict[str, int]:
        return {"T/8": round(self.T / 8), "T/4": round(self.T / 4), "T/2": round(self.T / 2), "T": self.T}

    def sync_ladder_jobs(self) -> list[tuple]:
        """Complete sync runs at T/8, T/4 and T/2 (seed 0), each with its own schedule and weight-decay timescale:
        with T, the ladder a delayed arm's effective-step fraction (R4) is read from."""
        L = self.lengths()
        return [self.job(*self.arm(opt, "sync", L[k]), L[k]) for k in ("T/8", "T/4", "T/2") for opt in ("adamw", "muon")]

    def ladder_jobs(self, seeds=(0,)) -> list[tuple]:
        """Complete runs (each with its own schedule and weight-decay timescale) at fractions of T: sync at T/8
        (seed 0), T/4, T/2 (with T: the ladder the effective-step fraction is read from), delayed at T/4, T/2 (with T:
        each gap's exponent in T, per seed)."""
        L = self.lengths()
        return [self.job(*self.arm(opt, v, L[k]), L[k], seed) for seed in seeds for k in ("T/4", "T/2", "T/8")
                for opt in ("adamw", "muon") for v in (VARIANTS if k != "T/8" else ("sync",))
                if k != "T/8" or seed == 0]

    def beta1_arms(self, steps: int) -> dict[str, tuple[str, list[str]]]:
        """The first-moment table at ``steps`` (seed 0): heavy-ball AdamW at beta1 0.5 and 0.9, a Nesterov first
        moment (NAdam, constant beta1, decoupled decay, AdamW's lr) at 0.9 and 0.95, Muon with and without Nesterov,
        each sync and delayed; EF at lambda 0.5 and 1 on NAdam 0.9."""
        out = {}
        for label, opt, extra, lr_opt in (("AdamW beta1 0.5", "adamw", ["--optimizer.adam_beta1=0.5"], None),
                                          ("AdamW beta1 0.9", "adamw", [], None),
                                          ("NAdam beta1 0.9", "nadam", ["--optimizer.adam_beta1=0.9"], "adamw"),
                                          ("NAdam beta1 0.95", "nadam", ["--optimizer.adam_beta1=0.95"], "adamw"),
                                          ("Muon Nesterov", "muon", [], None),
                                          ("Muon heavy-ball", "muon", ["--optimizer.nesterov=false"], None)):
            slug = "".join(e.split("=")[0].rsplit(".", 1)[1][:5] + e.split("=")[1] for e in extra)
            for v in ("sync", "delay") + (("delay+EF",) if opt == "nadam" and extra[0].endswith("0.9") else ()):
                lams = ([0.5, 1.0] if v == "delay+EF" else [None])
                for lam in lams:
                    more = extra + ([f"--optimizer.ef_lambda={lam}"] if lam is not None else [])
                    name = f"{label} {v}" + (f" lambda={lam:g}" if lam is not None else "")
                    tag = (f"{opt}{'-' + slug if slug else ''}-lr{self.lrs[lr_opt or opt]:g}-{v}"
                           + (f"-lam{lam:g}" if lam is not None and lam != 1.0 else ""))
                    out[name] = self.arm(opt, v, steps, more, tag=tag if (slug or lam) else None, lr_opt=lr_opt)
        return out

    def lambda_arms(self, steps: int) -> dict[str, tuple[str, list[str]]]:
        out = {}
        for opt in ("adamw", "muon"):
            for lam in ("0.5", "1", "1.5", "auto", *LEARNED):
                extra = [] if lam == "1" else [f"--optimizer.ef_lambda={lam.split('-')[0]}"]
                tag = None if lam == "1" else f"{opt}-lr{self.lrs[opt]:g}-delay+EF-lam{lam}"
                if lam in LEARNED:
                    rate, schedule, suffix = LEARNED[lam]
                    extra += [f"--optimizer.ef_lambda_lr={rate}", f"--optimizer.ef_lambda_schedule={schedule}"]
                    tag = f"{opt}-lr{self.lrs[opt]:g}-delay+EF-lamlearned{suffix}"
                out[f"{opt} lambda {lam}"] = self.arm(opt, "delay+EF", steps, extra, tag=tag)
        return out

    def syncstart_arms(self, steps: int) -> dict[str, tuple[str, list[str]]]:
        """Synchronous through the warm-up (10%), then delayed, with and without EF."""
        k = round(0.1 * steps)
        return {f"{opt} {v} sync-start": self.arm(opt, v, steps, [f"--optimizer.delay_start_step={k}"],
                                                  tag=f"{opt}-lr{self.lrs[opt]:g}-{v}-start{k}")
                for opt in ("adamw", "muon") for v in ("delay", "delay+EF")}


# ---------------------------------------------------------------------------- the router's balance


def expert_load(rows: list[dict]) -> list[list[float]]:
    """Per layer, each expert's load over the step records ``rows`` (their ``expert_tokens`` summed): its share of the
    tokens routed times the number of experts, so 1 is a uniform share and 2 twice it."""
    layers = [[sum(col) for col in zip(*layer)] for layer in zip(*(r["expert_tokens"] for r in rows))]
    return [[len(c) * x / max(1, sum(c)) for x in c] for c in layers]


def balance(rows: list[dict]) -> tuple[float, float, float, float]:
    """(mean aux loss, load CV, most loaded expert, least loaded expert) over ``rows``: the CV is the sd over experts
    of the load (whose mean is 1), averaged over layers; the extremes are over all layers' experts."""
    load = expert_load(rows)
    cv = _mean([statistics.pstdev(layer) for layer in load])
    return (round(_mean([r["router_aux_loss"] for r in rows]), 5), round(cv, 5), round(max(map(max, load)), 4),
            round(min(map(min, load)), 4))


def router_balance(rows: list[dict], points: int = ROUTER_POINTS) -> dict:
    """The router's balance over a run, from its metrics.jsonl step records (``router_aux_loss``, ``expert_tokens``):
    ``windows`` [last step, aux loss, load CV, most and least loaded expert] (``balance``) per window of about
    1/``points`` of the run; ``final`` the same over its last 10%, and ``final_load`` the load per layer and expert
    there. Windows, not steps: a step routes 1,024 tokens x top-2 over 8 experts per layer, too few for one step's
    shares to say much."""
    steps = [r for r in rows if "expert_tokens" in r]
    size = max(1, len(steps) // points)
    tail = steps[int(0.9 * len(steps)):]
    return {"windows": [[w[-1]["step"], *balance(w)] for w in (steps[i:i + size] for i in range(0, len(steps), size))],
            "final": dict(zip(("aux", "cv", "max", "min"), balance(tail))),
            "final_load": [[round(x, 4) for x in layer] for layer in expert_load(tail)]}


# ---------------------------------------------------------------------------- the stability model's prediction


def ceiling(kind: str, beta: float, delayed: bool, lam: float) -> float:
    """Largest lr x sharpness at which momentum SGD on a scalar quadratic stays stable (spectral radius < 1):
    kind ``hb`` (heavy ball: AdamW's first moment, Muon without Nesterov) or ``nest`` (Nesterov: NAdam, Muon),
    synchronous or with a one-step delay, with the EF extrapolation ``lam``: the characteristic polynomial of the delayed momentum recursion."""
    import numpy as np

    def transition(a):  # state [x_t, x_{t-1}, m_{t-1}, u_{t-1}]
        g = a * np.array([0, 1, 0, 0.] if delayed else [1, 0, 0, 0.])
        m = beta * np.array([0, 0, 1, 0.]) + (1 - beta) * g
        u = m if kind == "hb" else (1 - beta) * g + beta * m
        x = np.array([1, 0, 0, 0.]) - u - lam * (u - np.array([0, 0, 0, 1.]))
        return np.vstack([x, [1, 0, 0, 0], m, u])

    for a in np.exp(np.linspace(np.log(1e-3), np.log(200), 3000)):
        if max(abs(np.linalg.eigvals(transition(a)))) >= 1 - 1e-9:
            return float(a)
    return float("inf")


PREDICTION = """Prediction (stated before the runs, from the stability model): a delayed heavy-ball first moment is
stable only up to lr x sharpness ~ 1 whatever beta1, while its synchronous ceiling grows with beta1 (6 at 0.5, 38 at
0.9), so the delay costs AdamW more the higher its beta1 (the gap shrinks as beta1 falls to 0.5); a Nesterov first
moment keeps a much higher delayed ceiling (2.5 at 0.9, 3.75 at 0.95), so NAdam's gap is smaller than AdamW's at the
same beta1 and smaller at 0.95 than at 0.9; Muon without Nesterov loses part of its tolerance (its gap grows); on
NAdam 0.9, EF's lambda 0.5 raises the delayed ceiling more than lambda 1 (3.9 against 3.5), so it should close more."""


# ---------------------------------------------------------------------------- report


def _mean(xs):
    return statistics.mean(xs) if xs else float("nan")


def _sd(xs):
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def _pm(xs, fmt: str = ".4f", signed: bool = True) -> str:
    """``mean ± sd`` of ``xs`` (one value: itself)."""
    f = ("+" if signed else "") + fmt
    return f"{_mean(xs):{f}}" + (f" ± {_sd(xs):{fmt}}" if len(xs) > 1 else "")


def effective_fraction(loss: float, ladder: list[tuple[int, float]], steps: int) -> float | None:
    """The length of a complete synchronous run reaching ``loss`` (log-linear between ladder points), over ``steps``;
    1.0 when ``loss`` is at or below the ladder's last point (the ladder ends at T: a run as good as the synchronous
    one, or better, reads 1); None above its first point or without two points."""
    pts = sorted(ladder)
    if len(pts) < 2:
        return None
    if loss <= pts[-1][1]:
        return 1.0
    for (s0, l0), (s1, l1) in zip(pts, pts[1:]):
        if l1 <= loss <= l0 and l0 > l1:
            return math.exp(math.log(s0) + (l0 - loss) / (l0 - l1) * (math.log(s1) - math.log(s0))) / steps
    return None


def exponent(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of log(gap) against log(T): the gap falls like T^slope (None with a non-positive gap)."""
    pts = [(math.log(t), math.log(g)) for t, g in points if g > 0]
    if len(pts) < 2 or len(pts) < len(points):
        return None
    mx, my = _mean([x for x, _ in pts]), _mean([y for _, y in pts])
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def arm_table(b: "Bench", results: dict) -> tuple[list[str], dict]:
    """The sync / delay / delay + EF table at T (final eval loss, mean ± sd over seeds; gaps paired by seed) and each
    arm's ratios: its mean gap, relative gap (R3), the share of the delay gap EF closes (R2, on the seeds both arms
    have) and the effective-step fraction (R4: the length of a complete sync run reaching the arm's loss, read per
    seed from that seed's own sync ladder (T/8 .. T, the lengths it has), then averaged: a seed's loss against
    another seed's ladder would mix the seeds' spread into it). An arm with no finished seed reads "not run", an
    optimizer whose lr is not tuned yet "not tuned yet"."""
    T, L = b.T, b.lengths()
    get = lambda tag, steps, seed=0: results.get((tag, steps, seed))  # noqa: E731
    tag = lambda opt, v, steps: b.arm(opt, v, steps)[0]  # noqa: E731
    lines = ["| optimizer | arm | seeds | eval loss | gap to sync | relative gap (R3) | EF closes (R2) | effective steps (R4) |",
             "|---|---|---|---|---|---|---|---|"]
    ratios = {}
    for opt in ("adamw", "muon"):
        if opt not in b.lrs:
            lines += [f"| {opt} | {v} | 0 | not tuned yet |  |  |  |  |" for v in VARIANTS]
            continue
        sync = {sd: r["final"] for sd in (0, 1, 2) if (r := get(tag(opt, "sync", T), T, sd))}
        ladders = {sd: [(L[k], r["final"]) for k in ("T/8", "T/4", "T/2", "T")
                        if (r := get(tag(opt, "sync", L[k]), L[k], sd))] for sd in (0, 1, 2)}
        gaps = {}
        for v in VARIANTS:  # sync, delay, then delay+EF: EF's share needs the delay arm's gaps
            finals = {sd: r["final"] for sd in (0, 1, 2) if (r := get(tag(opt, v, T), T, sd))}
            g = gaps[v] = {sd: finals[sd] - sync[sd] for sd in finals if sd in sync}
            if not finals:
                lines.append(f"| {opt} | {v} | 0 | not run |  |  |  |  |")
                continue
            vals = list(finals.values())
            common = sorted(set(g) & set(gaps.get("delay", {})))
            closed = (1 - _mean([g[k] for k in common]) / _mean([gaps["delay"][k] for k in common])
                      if v == "delay+EF" and common else None)
            effs = [e for sd, loss in finals.items() if (e := effective_fraction(loss, ladders[sd], T)) is not None]
            eff = _mean(effs) if v != "sync" and effs else None
            ratios[(opt, v)] = {"gap": _mean(list(g.values())) if g else None, "closed": closed, "eff": eff,
                                "rel": _mean(list(g.values())) / _mean([sync[sd] for sd in g]) if g else None}
            lines.append(f"| {opt} | {v} | {len(vals)} | {_pm(vals, signed=False)} | "
                         + (_pm(list(g.values())) if v != "sync" and g else "") + " | "
                         + (f"{ratios[(opt, v)]['rel']:+.2%}" if v != "sync" and g else "") + " | "
                         + (f"{closed:.0%}" if closed is not None else "") + " | "
                         + (f"{eff:.2f}" + (f" ({len(effs)} of {len(vals)} seeds)" if len(effs) != len(vals) else "")
                            if eff is not None else ("" if v == "sync" else "no ladder")) + " |")
    return lines, ratios


def report(b: "Bench", results: dict, extras: dict) -> str:
    """``results``: (tag, steps, seed) -> run; ``extras``: table name -> {row name: (tag, steps)}."""
    T, L = b.T, b.lengths()
    n_params, n_embed = params()
    get = lambda tag, steps, seed=0: results.get((tag, steps, seed))  # noqa: E731
    tag = lambda opt, v, steps: b.arm(opt, v, steps)[0]  # noqa: E731
    lines = []
    tok_file = b.results / "train_tokens.json"
    epochs = (T * BATCH * SEQ / json.loads(tok_file.read_text())["tokens"]) if tok_file.exists() else None
    noise = json.loads((b.results / "noise_scale.json").read_text()) if (b.results / "noise_scale.json").exists() else {}
    lines += ["### The regime", "",
              "| knob | paper (360M) | this protocol | the 300-step table |", "|---|---|---|---|",
              f"| parameters (embedding share) | 360M | {n_params:,} ({n_embed / n_params:.0%}) | 2.10M (25%) |",
              f"| optimizer steps T | about 20-40K | {T:,} | 300 |",
              f"| tokens per step | 180K-360K | {BATCH * SEQ:,} ({BATCH} x {SEQ}) | 4,096 |",
              f"| tokens per parameter | 20 | {T * BATCH * SEQ / n_params:.1f} | 0.59 |",
              "| epochs of the training text | < 1 | " + (f"{epochs:.2f}" if epochs else "?") + " | 0.3 |",
              f"| weight-decay timescale 1/(lr wd) / T | about 0.25-0.5 | {WD_TIMESCALE} | 11 (AdamW) |",
              "| warm-up, schedule | 10%, cosine to 10% | 10%, cosine to 10% | 10%, cosine to 10% |",
              f"| paired eval tokens | large | {EVAL_BLOCKS * SEQ:,} | 16K |",
              "| gradient noise scale B_simple (tokens; McCandlish et al.) | - | "
              + ("; ".join(f"{v['b_simple_tokens']:,.0f} ({k})" for k, v in noise.items()) or "?") + " | - |",
              "", f"Learning rates (tuned on each sync arm at T, seed 0): {b.lrs}.", ""]
    for opt in ("adamw", "muon"):
        grid = sorted((r["lr"], r["final"]) for (t, st, sd), r in results.items()
                      if st == T and sd == 0 and t.startswith(f"{opt}-lr") and t.endswith("-sync"))
        if grid:
            lines.append(f"- {opt} sync at T: " + ", ".join(f"lr {lr:g} -> {f:.4f}" for lr, f in grid))
    table, ratios = arm_table(b, results)
    lines += ["", "### Sync, delay, delay + EF at T (final eval loss, mean ± sd over seeds; gaps paired by seed)", ""]
    lines += table
    a, m = ratios.get(("adamw", "delay"), {}), ratios.get(("muon", "delay"), {})
    lines += ["", "### The paper's ratios", "", "| ratio | paper | ours | reproduces? |", "|---|---|---|---|"]
    if a.get("gap") and m.get("gap") is not None:
        r1 = m["gap"] / a["gap"]
        lines.append(f"| R1 Muon gap / AdamW gap | 0.043 | {r1:.3f} | " + ("yes (Muon far more tolerant)" if 0 < r1 < 0.2 else "no: Muon more tolerant, less so than in the paper"
                     if 0 < r1 < 1 else "no: Muon not more tolerant") + " |")
    for opt, paper_closed, paper_rel in (("muon", 0.58, 0.0047), ("adamw", 0.90, 0.106)):
        e, d = ratios.get((opt, "delay+EF"), {}), ratios.get((opt, "delay"), {})
        if e.get("closed") is not None:
            lines.append(f"| R2 share of {opt}'s gap EF closes | {paper_closed:.0%} | {e['closed']:.0%} | "
                         f"{'yes' if abs(e['closed'] - paper_closed) < 0.15 else 'no'} |")
        if d.get("rel") is not None:
            lines.append(f"| R3 {opt} relative gap | {paper_rel:.2%} | {d['rel']:.2%} | "
                         f"{'same order' if 0.3 < d['rel'] / paper_rel < 3 else 'no'} |")
        if d.get("eff") is not None:
            lines.append(f"| R4 {opt} effective-step fraction (delayed) | about {0.94 if opt == 'muon' else 0.25} "
                         f"(read off its figure) | {d['eff']:.2f} | |")
    # exponents, per seed (a seed's three complete runs give its own fit)
    lines += ["", "### The gap against the run length (complete runs, each with its own schedule; mean ± sd over "
              "seeds, gaps paired by seed)", "",
              "| optimizer | arm | seeds | gap at T/4 | gap at T/2 | gap at T | exponent (gap ~ T^k), per seed | "
              "exponent of the mean gaps |", "|---|---|---|---|---|---|---|---|"]
    for opt in ("adamw", "muon"):
        for v in ("delay", "delay+EF"):
            per_seed = {}
            for sd in (0, 1, 2):
                for k in ("T/4", "T/2", "T"):
                    d, sy = get(tag(opt, v, L[k]), L[k], sd), get(tag(opt, "sync", L[k]), L[k], sd)
                    if d and sy:
                        per_seed.setdefault(sd, {})[k] = d["final"] - sy["final"]
            if not per_seed:
                continue
            full = {sd: g for sd, g in per_seed.items() if len(g) == 3}
            cells = []
            for k in ("T/4", "T/2", "T"):
                vals = [g[k] for g in per_seed.values() if k in g]
                cells.append(_pm(vals) if vals else "")
            fits = [e for g in full.values() if (e := exponent([(L[k], g[k]) for k in ("T/4", "T/2", "T")])) is not None]
            mean_fit = exponent([(L[k], _mean([g[k] for g in full.values()])) for k in ("T/4", "T/2", "T")]) \
                if full else None
            fit_cell = (_pm(fits, ".2f", signed=False) + (f" ({len(fits)} of {len(full)} seeds: a gap <= 0 has none)"
                                                           if len(fits) < len(full) else "")) if fits else ""
            lines.append(f"| {opt} | {v} | {len(full)} | " + " | ".join(cells) + f" | {fit_cell} | "
                         + ("" if mean_fit is None else f"{mean_fit:.2f}") + " |")
    lines += extra_tables(b, results, extras)
    png = b.out / "paper_regime.png"
    _plot(b, results, png)
    return "\n".join(lines), png


def extra_tables(b: "Bench", results: dict, extras: dict) -> list[str]:
    lines = []
    beta = extras.get("beta1", {})
    if beta:
        steps = next(iter(beta.values()))[2]
        lines += ["", f"### The first moment under delay (T/4 = {steps} steps, seed 0)", "", PREDICTION, "",
                  "Stability ceilings (lr x sharpness) of the model: " + "; ".join(
                      f"{k} {bt}: sync {ceiling(k, bt, False, 0):.1f}, delayed {ceiling(k, bt, True, 0):.2f}"
                      for k, bt in (("hb", 0.5), ("hb", 0.9), ("nest", 0.9), ("nest", 0.95))), "",
                  "| arm | sync | delayed | gap | EF lambda 0.5 | EF lambda 1 |", "|---|---|---|---|---|---|"]
        labels = dict.fromkeys(n.rsplit(" ", 1)[0] for n in beta if n.endswith((" sync", " delay")))
        for label in labels:
            s_, d_ = (results.get((beta[f"{label} {v}"][0], steps, 0)) for v in ("sync", "delay"))
            efs = [results.get((beta[n][0], steps, 0)) if (n := f"{label} delay+EF lambda={x}") in beta else None
                   for x in ("0.5", "1")]
            cell = lambda r: f"{r['final']:.4f}" if r else "-"  # noqa: E731
            gap = f"{d_['final'] - s_['final']:+.4f}" if s_ and d_ else "-"
            lines.append(f"| {label} | {cell(s_)} | {cell(d_)} | {gap} | "
                         + " | ".join(f"{r['final'] - s_['final']:+.4f}" if r and s_ else "-" for r in efs) + " |")
    lam = extras.get("lambda", {})
    if lam:
        lines += ["", "### EF's lambda: fixed, auto (cosine) and learned (hypergradient), seed 0", "",
                  "Gap to sync. The tolerance is one seed's spread at the arm's own length: the sd over 3 seeds of the "
                  "delay + EF (lambda 1) gap at that length (the ladder's seeds); in brackets the verdict against the "
                  "spread at T, the stricter reading used before the ladder had 3 seeds at every length.", "",
                  "| optimizer | length | 0.5 | 1 | 1.5 | auto | " + " | ".join(LEARNED) + " |",
                  "|---|---|---|---|---|---|" + "---|" * len(LEARNED)]
        verdicts = ["", "The learned lambda's variants (" + "; ".join(
            f"{k}: step {r:g}{' x the lr schedule' if sch == 'lr' else ''}" for k, (r, sch, _) in LEARNED.items())
            + "): lambda at the end, and whether the gap is within one seed's spread of the best fixed lambda's.", "",
            "| optimizer | length | best fixed (sd) | " + " | ".join(LEARNED) + " |", "|---|---|---|" + "---|" * len(LEARNED)]
        def spread(opt, steps):
            keys = [((b.arm(opt, "delay+EF", steps)[0], steps, s), (b.arm(opt, "sync", steps)[0], steps, s)) for s in (0, 1, 2)]
            return _sd([results[e]["final"] - results[y]["final"] for e, y in keys if e in results and y in results])
        for (opt, steps), arms_ in sorted(_by_opt_len(lam).items()):
            sync = results.get((b.arm(opt, "sync", steps)[0], steps, 0))
            cells, gaps, ends = [], {}, {}
            for x in ("0.5", "1", "1.5", "auto", *LEARNED):
                r = results.get((arms_.get(x), steps, 0))
                if r and sync:
                    gaps[x] = r["final"] - sync["final"]
                    if r.get("lambda"):
                        ends[x] = f"{r['lambda'][-1][1]:.2f}"
                cells.append(f"{gaps[x]:+.4f}" if x in gaps else "-")
            fixed = [gaps[x] for x in ("0.5", "1", "1.5") if x in gaps]
            sd, sd_t = spread(opt, steps), spread(opt, b.T)
            verdict = lambda x: "-" if x not in gaps or len(fixed) < 3 else (  # noqa: E731
                ("yes" if gaps[x] <= min(fixed) + sd else "no") + (" (" + ("yes" if gaps[x] <= min(fixed) + sd_t else "no")
                                                                     + ")"))
            lines.append(f"| {opt} | {steps} | " + " | ".join(cells) + " |")
            best = f"{min(fixed):+.4f} ({sd:.4f}; at T {sd_t:.4f})" if len(fixed) == 3 else "-"
            verdicts.append(f"| {opt} | {steps} | {best} | "
                            + " | ".join(f"{verdict(x)}, lambda {ends.get(x, '-')}" for x in LEARNED) + " |")
        lines += verdicts + seeded_lambdas(b, results, lam)
    ss = extras.get("syncstart", {})
    if ss:
        lines += ["", "### Sync start: synchronous through the warm-up (10%), then delayed (seed 0)", "",
                  "| optimizer | arm | length | gap, delayed from step 0 | gap, sync start |", "|---|---|---|---|---|"]
        for name, (t, _, steps) in ss.items():
            opt, v = name.split()[:2]
            r, plain = results.get((t, steps, 0)), results.get((b.arm(opt, v, steps)[0], steps, 0))
            sync = results.get((b.arm(opt, "sync", steps)[0], steps, 0))
            if r and plain and sync:
                lines.append(f"| {opt} | {v} | {steps} | {plain['final'] - sync['final']:+.4f} | {r['final'] - sync['final']:+.4f} |")
    return lines


def seeded_lambdas(b: "Bench", results: dict, lam: dict) -> list[str]:
    """The lambda comparison at T/4 on 3 seeds (``lambda-seeds``): mean gap to sync and its sd over seeds per lambda,
    and whether the learned rule's mean is within one seed's spread (the sd of lambda 1's gaps) of the best fixed
    lambda's mean."""
    rows = []
    for (opt, steps), arms_ in sorted(_by_opt_len(lam).items()):
        if steps != b.lengths()["T/4"]:
            continue
        gaps = {}
        for x in SEEDED_LAMBDAS:
            pairs = [(results.get((arms_.get(x), steps, s)), results.get((b.arm(opt, "sync", steps)[0], steps, s)))
                     for s in (0, 1, 2)]
            gaps[x] = [r["final"] - y["final"] for r, y in pairs if r and y]
        if any(len(v) < 3 for v in gaps.values()):
            continue
        fixed = {x: _mean(gaps[x]) for x in ("0.5", "1", "1.5")}
        best = min(fixed, key=fixed.get)
        ok = _mean(gaps["learned-lr"]) <= fixed[best] + _sd(gaps["1"])
        rows.append(f"| {opt} | {steps} | " + " | ".join(_pm(gaps[x]) for x in SEEDED_LAMBDAS)
                    + f" | {'yes' if ok else 'no'} (best fixed: lambda {best}; spread {_sd(gaps['1']):.4f}) |")
    if not rows:
        return []
    return ["", "The same at T/4 on 3 seeds (seeds 1 and 2 added for the fixed lambdas and learned-lr; mean gap ± sd "
            "over seeds):", "", "| optimizer | length | " + " | ".join(f"lambda {x}" for x in SEEDED_LAMBDAS)
            + " | learned-lr within one seed's spread of the best fixed? |", "|---|---|" + "---|" * (len(SEEDED_LAMBDAS) + 1)] + rows


def _by_opt_len(lam: dict) -> dict:
    out = {}
    for name, (t, _, steps) in lam.items():
        opt, _, x = name.split()[:3]
        out.setdefault((opt, steps), {})[x] = t
    return out


def _plot(b: "Bench", results: dict, path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for opt, color in (("adamw", "tab:blue"), ("muon", "tab:red")):
        for v, style in (("sync", "-"), ("delay", "--"), ("delay+EF", ":")):
            r = results.get((b.arm(opt, v, b.T)[0], b.T, 0))
            if r:
                axes[0].plot(*zip(*r["curve"][1:]), style, color=color, label=f"{opt} {v}")
    for (t, steps, seed), r in sorted(results.items()):
        if r.get("lambda") and seed == 0:
            variant = t.split("lamlearned", 1)[-1] if "lamlearned" in t else ""
            axes[1].plot(*zip(*r["lambda"]), label=f"{t.split('-')[0]}{variant} T={steps}", lw=1)
    axes[0].set_title(f"held-out loss, T = {b.T} (seed 0)")
    axes[1].set_title("learned EF lambda")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def moe_report(moe: "Bench", results: dict, dense: "Bench", dense_results: dict) -> tuple[str, Path | None]:
    """The MoE arm's part of the section: its model beside the dense one, what each optimizer does with it, its sync /
    delay / delay + EF table, the router's balance per arm and the paper's ratios for the MoE beside the dense model's
    and the paper's (its 360M dense and 10B MoE rows), from whatever has finished (the rest reads "not run"); and its
    figure, None before any arm has finished at T."""
    cfg, c, d = MOE_MODEL, count_params(MOE_MODEL), count_params(MODEL)
    E, k = cfg["num_experts"], cfg["num_experts_per_tok"]
    sides = optimizer_sides(cfg)
    lines = ["### The MoE arm: a Qwen3-MoE in the same protocol", "",
             f"Qwen3-MoE h{cfg['hidden_size']} x {cfg['num_hidden_layers']} layers, {cfg['num_attention_heads']} heads "
             f"({cfg['num_key_value_heads']} KV, head dim {cfg['head_dim']}, QK norms), {E} experts of FFN "
             f"{cfg['moe_intermediate_size']} in every layer, top-{k} (weights renormalised), tied embeddings: a token's "
             f"experts are the dense model's FFN ({k} x {cfg['moe_intermediate_size']} = {k * cfg['moe_intermediate_size']}), "
             "so its active parameters are the dense model's, and T follows them (20 tokens per active parameter). "
             "Everything else is the dense protocol's: data and its order, batch, warm-up, cosine, the weight-decay "
             "timescale, the eval blocks, the exact single-process references.", "",
             "| | dense (Llama) | MoE (Qwen3-MoE) |", "|---|---|---|",
             f"| parameters, total | {d.total:,} | {c.total:,} ({c.total / d.total:.1f}x) |",
             f"| active per token | {d.active:,} | {c.active:,} ({c.active / d.active:.3f}x) |",
             f"| embedding (share of total / of active) | {d.embedding:,} ({d.embedding / d.total:.0%} / "
             f"{d.embedding / d.active:.0%}) | {c.embedding:,} ({c.embedding / c.total:.0%} / {c.embedding / c.active:.0%}) |",
             f"| routed experts (share of total) | - | {c.experts:,} ({c.experts / c.total:.0%}) |",
             f"| optimizer steps T | {dense.T:,} | {moe.T:,} |",
             f"| tokens per active parameter | {dense.T * BATCH * SEQ / d.active:.1f} | {moe.T * BATCH * SEQ / c.active:.1f} |",
             f"| router aux loss coefficient (model config) | - | {cfg['router_aux_loss_coef']:g} |", "",
             "What the optimizers do with it (`hf_asyncpp.optim.builder.classify_parameters`): Muon orthogonalises "
             f"{sides['muon']:,} parameters: the attention matrices and every expert's matrices on their own (the 3-D "
             "stacks `gate_up_proj` (E, 2I, H), split into gate and up by `optimizer.muon_split_fused`, and `down_proj` "
             "(E, H, I): one batched Newton-Schulz over the experts); its AdamW side "
             f"(lr {MUON_ADAMW_LR:g}) holds the embedding, the norms and the routers ({sides['router']:,} parameters, "
             "the paper's hybrid), the routers with weight decay. The AdamW arms put everything on AdamW.", ""]
    if not {"adamw", "muon"} <= set(moe.lrs):
        lines += ["Learning rates: not tuned yet (`--phases moe-tune`)."]
    else:
        lines += [f"Learning rates (tuned on each sync arm at T, seed 0): {moe.lrs}.", ""]
    for opt in ("adamw", "muon"):
        grid = sorted((r["lr"], r["final"]) for (t, st, sd), r in results.items()
                      if st == moe.T and sd == 0 and t.startswith(f"{opt}-lr") and t.endswith("-sync"))
        if grid:
            lines.append(f"- {opt} sync at T: " + ", ".join(f"lr {lr:g} -> {f:.4f}" for lr, f in grid))
    table, ratios = arm_table(moe, results)
    lines += ["", "### MoE: sync, delay, delay + EF at T (final eval loss, mean ± sd over seeds; gaps paired by seed)", ""]
    lines += table + [""] + router_table(moe, results) + [""] + ratios_beside(arm_table(dense, dense_results)[1], ratios)
    if not any(steps == moe.T for _, steps, _ in results):
        return "\n".join(lines), None
    png = moe.out / "paper_regime_moe.png"
    _plot_moe(moe, results, png)
    return "\n".join(lines), png


def optimizer_sides(config: dict) -> dict[str, int]:
    """Parameters of ``config``'s model by the kind the optimizer builder gives them (``muon``, ``adamw``,
    ``adamw_no_decay``), and ``router``: those of its routers (all on the AdamW side)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_asyncpp.optim.builder import classify_parameters

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**config, "vocab_size": VOCAB}))
    kinds, sizes = classify_parameters(model), dict(model.named_parameters())
    out = {kind: sum(sizes[n].numel() for n, x in kinds.items() if x == kind) for kind in ("muon", "adamw", "adamw_no_decay")}
    routers = {n for n, m in model.named_modules() if type(m).__name__.lower().endswith("router")}
    out["router"] = sum(p.numel() for n, p in sizes.items() if n.rpartition(".")[0] in routers)
    return out


def _at(windows: list, step: float) -> list:
    """The router window whose last step is nearest ``step``."""
    return min(windows, key=lambda w: abs(w[0] - step))


def router_table(b: "Bench", results: dict) -> list[str]:
    """Per arm at T: the aux loss and the load's CV over the last 10% of the run (mean over seeds; against sync paired
    by seed), the CV's course (at 10% and 50% of the run: a drifting router's grows), the most and least loaded
    expert."""
    E, k = MOE_MODEL["num_experts"], MOE_MODEL["num_experts_per_tok"]
    lines = ["### MoE: the router's balance per arm", "",
             f"The aux loss is the model's load-balancing loss before its coefficient (transformers' Switch loss: {k}.0 "
             f"when the load is uniform, more as it concentrates); an expert's load is its share of a layer's routed "
             f"tokens times {E} (1: uniform), the CV its sd over the experts (mean over the {MOE_MODEL['num_hidden_layers']} "
             "layers), the extremes over all layers; over the run's last 10% unless said. Mean over seeds; against "
             "sync, paired by seed.", "",
             "| optimizer | arm | seeds | aux loss | aux vs sync | load CV at 10% / 50% / end | CV vs sync | most / least loaded expert |",
             "|---|---|---|---|---|---|---|---|"]
    for opt in ("adamw", "muon"):
        for v in VARIANTS:
            if opt not in b.lrs:
                lines.append(f"| {opt} | {v} | 0 | not tuned yet |  |  |  |  |")
                continue
            runs = {sd: r["router"] for sd in (0, 1, 2) if (r := results.get((b.arm(opt, v, b.T)[0], b.T, sd))) and "router" in r}
            if not runs:
                lines.append(f"| {opt} | {v} | 0 | not run |  |  |  |  |")
                continue
            sync = {sd: r["router"] for sd in (0, 1, 2) if (r := results.get((b.arm(opt, "sync", b.T)[0], b.T, sd))) and "router" in r}
            fin = lambda key, rs: [x["final"][key] for x in rs.values()]  # noqa: E731
            vs = lambda key: _pm([runs[sd]["final"][key] - sync[sd]["final"][key] for sd in runs if sd in sync])  # noqa: E731
            course = [_mean([_at(x["windows"], f * b.T)[2] for x in runs.values()]) for f in (0.1, 0.5)]
            lines.append(f"| {opt} | {v} | {len(runs)} | {_pm(fin('aux', runs), signed=False)} | "
                         + (vs("aux") if v != "sync" and set(runs) & set(sync) else "") + " | "
                         + " / ".join(f"{x:.3f}" for x in course) + f" / {_mean(fin('cv', runs)):.3f} | "
                         + (vs("cv") if v != "sync" and set(runs) & set(sync) else "") + " | "
                         + f"{_mean(fin('max', runs)):.2f} / {_mean(fin('min', runs)):.2f} |")
    return lines


def ratios_beside(dense: dict, moe: dict) -> list[str]:
    """The paper's ratios R1-R4 for the MoE beside the dense model's, and the paper's 360M dense and 10B MoE rows (the
    paper's MoE has one optimizer's row, sync / delayed / delayed + EF: R2 and R3 only)."""
    ps, pd, pe = PAPER_MOE

    def r1(r):
        a, m = r.get(("adamw", "delay"), {}).get("gap"), r.get(("muon", "delay"), {}).get("gap")
        return m / a if a and m is not None else None

    def cell(x, fmt):
        return "not run" if x is None else format(x, fmt)

    get = lambda r, opt, v, key: r.get((opt, v), {}).get(key)  # noqa: E731
    rows = [("R1 Muon's gap / AdamW's gap", "0.043", r1(dense), "-", r1(moe), ".3f")]
    for opt, closed, rel, eff in (("muon", "58%", "0.47%", "about 0.94"), ("adamw", "90%", "10.60%", "about 0.25")):
        moe_paper = opt == "muon"  # the paper's MoE row: its (Muon) method's
        rows += [(f"R2 share of {opt}'s gap EF closes", closed, get(dense, opt, "delay+EF", "closed"),
                  f"{(pd - pe) / (pd - ps):.0%}" if moe_paper else "-", get(moe, opt, "delay+EF", "closed"), ".0%"),
                 (f"R3 {opt}'s relative gap", rel, get(dense, opt, "delay", "rel"),
                  f"{(pd - ps) / ps:.2%}" if moe_paper else "-", get(moe, opt, "delay", "rel"), "+.2%"),
                 (f"R4 {opt}'s effective-step fraction (delayed)", f"{eff} (read off its figure)",
                  get(dense, opt, "delay", "eff"), "-", get(moe, opt, "delay", "eff"), ".2f")]
    lines = ["### The paper's ratios: MoE beside dense", "",
             f"The paper's MoE: 10B parameters on 200B tokens, sync / delayed / delayed + EF {ps} / {pd} / {pe} with the "
             "sync hyperparameters (its optimizer is not named in our notes; Muon, the paper's method, is assumed for "
             "the R2 and R3 cells). R4 needs the MoE's sync ladder (`moe-ladder`).", "",
             "| ratio | paper, 360M dense | ours, dense | paper, 10B MoE | ours, MoE |", "|---|---|---|---|---|"]
    for name, paper_dense, ours_dense, paper_moe, ours_moe, fmt in rows:
        lines.append(f"| {name} | {paper_dense} | {cell(ours_dense, fmt)} | {paper_moe} | {cell(ours_moe, fmt)} |")
    return lines


def _plot_moe(b: "Bench", results: dict, path: Path) -> None:
    """Seed 0 of each MoE arm at T: the held-out loss, the router's aux loss and the load's CV over training."""
    plt = pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for opt, color in (("adamw", "tab:blue"), ("muon", "tab:red")):
        for v, style in (("sync", "-"), ("delay", "--"), ("delay+EF", ":")):
            r = results.get((b.arm(opt, v, b.T)[0], b.T, 0)) if opt in b.lrs else None
            if not r:
                continue
            axes[0].plot(*zip(*r["curve"][1:]), style, color=color, label=f"{opt} {v}")
            if "router" in r:
                steps, aux, cv = zip(*((w[0], w[1], w[2]) for w in r["router"]["windows"]))
                axes[1].plot(steps, aux, style, color=color, label=f"{opt} {v}", lw=1)
                axes[2].plot(steps, cv, style, color=color, label=f"{opt} {v}", lw=1)
    for ax, title in zip(axes, (f"MoE held-out loss, T = {b.T} (seed 0)", "router aux loss (uniform: "
                                f"{MOE_MODEL['num_experts_per_tok']})", "expert load CV (mean over layers)")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # nothing run yet: an empty frame, no legend
            ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _unique(jobs: list[tuple]) -> list[tuple]:
    """``jobs`` without repeats (the same tag, length and seed), in order."""
    seen, out = set(), []
    for j in jobs:
        if (j[0], j[2], j[3]) not in seen:
            seen.add((j[0], j[2], j[3]))
            out.append(j)
    return out


def dense_jobs(b: "Bench", phases: list[str], extras: dict) -> list[tuple]:
    """The dense study's runs of ``phases`` in priority order (cheap tables first, then the seeds): a cut-short
    session leaves the least undone."""
    seeded = [b.job(t, a_, st, seed) for n, (t, a_, st) in extras["lambda"].items() if n.endswith("@T/4")
              and n.split()[2] in SEEDED_LAMBDAS for seed in (1, 2)]
    jobs = []
    want = lambda phase, k=None: [b.job(t, a_, st) for n, (t, a_, st) in extras[phase].items()  # noqa: E731
                                  if phase in phases and (k is None or n.endswith("@" + k))]
    if "main" in phases:
        jobs += b.main_jobs(seeds=(0,))
    if "ladder" in phases:
        jobs += b.ladder_jobs()
    jobs += want("beta1") + want("lambda", "T/4") + want("syncstart")
    if "main" in phases:
        jobs += b.main_jobs(seeds=(1, 2))
    jobs += want("lambda", "T/2")
    if "ladder" in phases:
        jobs += b.ladder_jobs(seeds=(1, 2))
    if "lambda-seeds" in phases:
        jobs += seeded
    return _unique(jobs)


def moe_jobs(b: "Bench", phases: list[str]) -> list[tuple]:
    """The MoE arm's runs of ``phases`` after its tuning, in priority order: the main arms' seed 0, the sync ladder,
    the main arms' seeds 1 and 2 (none before both learning rates are tuned)."""
    if not {"adamw", "muon"} <= set(b.lrs):
        return []
    jobs = b.main_jobs(seeds=(0,)) if "moe-main" in phases else []
    jobs += b.sync_ladder_jobs() if "moe-ladder" in phases else []
    jobs += b.main_jobs(seeds=(1, 2)) if "moe-main" in phases else []
    return _unique(jobs)


def _missing(jobs: list[tuple], results: dict) -> list[str]:
    return [f"{t} T={st} seed {sd}" for t, _, st, sd in jobs if (t, st, sd) not in results]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "runs" / "paper_regime"))
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--phases", default=",".join(PHASES),
                    help=f"comma-separated, of {', '.join(PHASES + MOE_PHASES)} (default: the dense study's)")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    phases = args.phases.split(",")
    unknown = [x for x in phases if x not in PHASES + MOE_PHASES]
    if unknown:
        raise SystemExit(f"--phases: unknown {unknown}; known: {', '.join(PHASES + MOE_PHASES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    b = Bench(out, args.parallel, args.report_only)
    moe = Bench(out, args.parallel, args.report_only, MOE)
    if args.report_only and not {"adamw", "muon"} <= set(b.lrs):
        raise SystemExit(f"{out}: the learning rates are not tuned yet (the tune phase writes lrs.json)")
    print(f"T = {b.T} steps; model {count_params(MODEL)}; MoE T = {moe.T} steps, {count_params(MOE_MODEL)}", flush=True)
    if "tune" in phases:
        b.tune()
    if "moe-tune" in phases:
        moe.tune()
    L = b.lengths()
    extras = {"beta1": {n: (t, args_, L["T/4"]) for n, (t, args_) in b.beta1_arms(L["T/4"]).items()},
              "lambda": {f"{n} @{k}": (t, args_, L[k]) for k in ("T/4", "T/2") for n, (t, args_) in b.lambda_arms(L[k]).items()},
              "syncstart": {n: (t, args_, L["T/2"]) for n, (t, args_) in b.syncstart_arms(L["T/2"]).items()}}
    # the phases asked for run (dense first); every other finished arm of either model is read for the report
    asked, moe_asked = dense_jobs(b, phases, extras), moe_jobs(moe, phases)
    done = b.run_all(asked + b.tuning_jobs())
    moe_done = moe.run_all(moe_asked + moe.tuning_jobs())
    keys = {(j[0], j[2], j[3]) for j in asked}
    done += b.run_all([j for j in dense_jobs(b, PHASES, extras) if (j[0], j[2], j[3]) not in keys], may_launch=False)
    moe_all = moe_jobs(moe, MOE_PHASES)
    moe_keys = {(j[0], j[2], j[3]) for j in moe_asked}
    moe_done += moe.run_all([j for j in moe_all if (j[0], j[2], j[3]) not in moe_keys], may_launch=False)
    results = {(r["tag"], r["steps"], r["seed"]): r for r in done}
    moe_results = {(r["tag"], r["steps"], r["seed"]): r for r in moe_done}
    b.measure(results)
    text, png = report(b, results, extras)
    missing = _missing(asked, results)
    if missing:
        text += f"\n\nNot run yet ({len(missing)} of {len(asked)}): " + "; ".join(missing) + "."
    moe_text, moe_png = moe_report(moe, moe_results, b, results)
    moe_missing = _missing(moe_all, moe_results)
    if moe_missing:
        moe_text += f"\n\nMoE arms not run yet ({len(moe_missing)} of {len(moe_all)}): " + "; ".join(moe_missing) + "."
    print(text + "\n\n" + moe_text)
    if args.write:
        from .report import DOCS, write_section

        (DOCS / "paper_regime.png").write_bytes(png.read_bytes())
        if moe_png is not None:
            (DOCS / "paper_regime_moe.png").write_bytes(moe_png.read_bytes())
        shown = " ".join(a for a in sys.argv[1:] if a != "--report-only")
        write_section("paper-regime", "## Delay tolerance in the paper's regime (20 tokens per parameter, "
                      f"{b.T:,} steps)\n\nCommands, each resumable (a re-run reuses the finished arms and resumes "
                      "killed ones from their last checkpoint), two runs at a time (`--parallel 2`), 1 thread each, "
                      "single-process exact delay references: the dense study `python -m bench.paper_regime --out DIR "
                      "--write`; the MoE arm `python -m bench.paper_regime --phases moe-tune,moe-main,moe-ladder --out "
                      "DIR --write`; `--report-only --write` rewrites this section from the summaries committed in "
                      f"`bench/results/paper_regime/`. This text: `python -m bench.paper_regime {shown}` "
                      f"({time.strftime('%Y-%m-%d')}).\n\n" + text
                      + "\n\n![eval loss and learned lambda](paper_regime.png)\n\n" + moe_text
                      + ("\n\n![MoE: eval loss and the router's balance](paper_regime_moe.png)" if moe_png else ""))


if __name__ == "__main__":
    main()
