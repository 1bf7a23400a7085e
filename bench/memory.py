"""The planner's memory against what each stage of the real executor holds, term by term.

    python -m bench.memory [--only NAME,...] [--write]
    python -m bench.memory --per-param [--write]

Per configuration (tiny dense Llama and Qwen3-MoE on 2 stages, fp32 / bf16 autocast, with and without activation
checkpointing, 2BW / 1F1B, AdamW / Muon + error feedback) two gloo processes train 3 steps with
``PipelineEngine.track_memory`` and return ``memory_report()``; ``plan_memory`` predicts the same terms without
allocating. The agreement is over the terms the executor measures: the recomputation's one layer (checkpointing)
and the reducer's buckets (data parallelism; none here) are planned only. Why measure: the formula's activation
coefficients were fitted on CPU autocast (transformers 5.23); a different kernel or version moves them.
``tests/test_memory_plan.py`` checks two configurations of its own the same way (``testing.stage_memory_report``,
``memtrack.agreement``).

``--write`` replaces the ``memory`` (or, with ``--per-param``, ``memory-per-param``) section of
docs/benchmarks/memory.md.
"""
from __future__ import annotations

import argparse
import time

import torch

from hf_asyncpp.config.recipe import recipe_from_dict
from hf_asyncpp.plan.memory import plan_memory
from hf_asyncpp.plan.vocab import resolve_vocab_parallel
from hf_asyncpp.pipeline.memtrack import MEASURED_TERMS as TERMS, agreement
from hf_asyncpp.testing import run_workers, stage_memory_report

SEQ, MBS, M = 64, 2, 4
DENSE = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048, "max_position_embeddings": 128,
         "tie_word_embeddings": False}
MOE = {"model_type": "qwen3_moe", "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
       "moe_intermediate_size": 96, "vocab_size": 2048, "max_position_embeddings": 128, "tie_word_embeddings": False,
       "output_router_logits": True, "router_aux_loss_coef": 0.01}
# name: (model, schedule, bf16, gradient checkpointing, optimizer, error feedback)
CONFIGS = {
    "dense-fp32-2bw": (DENSE, "2bw", False, False, "adamw", False),
    "dense-bf16-2bw-muon-ef": (DENSE, "2bw", True, False, "muon", True),
    "dense-bf16-ckpt-1f1b": (DENSE, "1f1b", True, True, "adamw", False),
    "dense-fp32-ckpt-2bw": (DENSE, "2bw", False, True, "muon", True),
    "moe-fp32-1f1b": (MOE, "1f1b", False, False, "adamw", False),
    "moe-bf16-2bw-muon-ef": (MOE, "2bw", True, False, "muon", True),
    "moe-bf16-ckpt-2bw": (MOE, "2bw", True, True, "adamw", False),
}


def recipe_dict(name: str) -> dict:
    model, sched, bf16, ckpt, opt, ef = CONFIGS[name]
    return {
        "model": {"config": dict(model)}, "data": {"seq_len": SEQ},
        "pipeline": {"schedule": sched, "num_stages": 2, "num_microbatches": M, "microbatch_size": MBS},
        "optimizer": {"name": opt, "learning_rate": 1e-3, "delay_correction": "error_feedback" if ef else "none"},
        "training": {"max_steps": 8, "bf16": bf16, "gradient_checkpointing": ckpt, "max_grad_norm": 1.0,
                     "report_to": []},
    }


def recipe(name: str):
    return recipe_from_dict(recipe_dict(name))


def measure_per_param(rank: int, world: int, dp: int, after: bool) -> dict:
    """Bytes per parameter of this rank's stage (2 stages x ``dp`` replicas, the dense model, bf16 2BW Muon + EF):
    ``after`` with bf16 weight versions and ZeRO-1, before with autocast's per-microbatch casts, unsharded."""
    from hf_asyncpp.model.build import build_model
    from hf_asyncpp.pipeline.executor import PipelineEngine
    from hf_asyncpp.topology import Topology

    r = recipe("dense-bf16-2bw-muon-ef")
    r.optimizer.shard_across_replicas = after
    torch.manual_seed(0)
    eng = PipelineEngine(r, build_model(r.model), Topology(rank=rank, world_size=world, num_stages=2), log=lambda *a: None)
    eng.bf16_versions = after
    g = torch.Generator().manual_seed(rank % dp)
    batches = [torch.randint(0, r.model.config["vocab_size"], (M, MBS, SEQ), generator=g) for _ in range(3)]
    eng.track_memory = True
    eng.train_steps(batches, 0)
    rep = eng.memory_report()
    n = sum(q.numel() for q in eng.params.values())
    eng.close()
    return {"stage": rank // dp, "dp_rank": rank % dp, "params": n, **{k: v / n for k, v in rep.items()}}


def predicted(name: str) -> list[dict]:
    r = recipe(name)
    _, mem, _ = plan_memory(r, vocab_parallel=resolve_vocab_parallel(r)[0])
    return [{t: getattr(m, t) for t in (*TERMS, "recompute", "reducer")} for m in mem]


def per_param() -> str:
    """The bytes-per-parameter table: before/after at dp = 1 and 4, replica 0 of each stage (steady, at STEP)."""
    rows = ["| dp | stage | before: steady / at STEP | after: steady / at STEP | after: weights, grads, optimizer, EF, "
            "casts | optimizer + EF over the replicas (after) |", "|---|---|---|---|---|---|"]
    for dp in (1, 4):
        got = {}
        for after in (False, True):
            got[after] = run_workers(measure_per_param, 2 * dp, dp, after)
        for s in (0, 1):
            b, a = (next(x for x in got[k] if x["stage"] == s and x["dp_rank"] == 0) for k in (False, True))
            spread = [x["optimizer"] + x["ef"] for x in got[True] if x["stage"] == s]
            rows.append(f"| {dp} | {s} | {b['steady']:.1f} / {b['total']:.1f} | {a['steady']:.1f} / {a['total']:.1f} | "
                        f"{a['weights']:.1f}, {a['grads']:.1f}, {a['optimizer']:.2f}, {a['ef']:.2f}, {a['casts']:.1f} | "
                        f"{', '.join(f'{v:.2f}' for v in spread)} |")
    return "\n".join(rows)


def measured(name: str) -> list[dict]:
    """Each stage's ``memory_report`` of configuration ``name``: 2 gloo processes, 3 tracked steps."""
    return run_workers(stage_memory_report, 2, recipe_dict(name))


def table(results: dict) -> str:
    kb = lambda x: f"{x / 1e3:.0f}"
    head = "| config | stage | " + " | ".join(TERMS) + " | recompute (planned only) | predicted / measured |"
    lines = [head, "|" + "---|" * (len(TERMS) + 4)]
    for name, (pred, got) in results.items():
        for s, (p, g) in enumerate(zip(pred, got)):
            cells = " | ".join(f"{kb(p[t])} / {kb(g[t])}" for t in TERMS)
            lines.append(f"| {name} | {s} | {cells} | {kb(p['recompute'])} | {agreement(p, g):.3f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=None, help="comma-separated configuration names")
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--per-param", action="store_true", help="only the bytes-per-parameter table (section memory-per-param)")
    args = ap.parse_args()
    if args.per_param:
        t0 = time.perf_counter()
        text = per_param()
        print(text)
        if args.write:
            from .report import write_section

            write_section("memory-per-param", "## Bytes per parameter per stage: bf16 weight versions and ZeRO-1\n\n"
                          f"Command: `python -m bench.memory --per-param --write` ({time.strftime('%Y-%m-%d')}; CPU, "
                          f"gloo, 1 thread per process, {time.perf_counter() - t0:.0f} s). The dense model of the table "
                          "above (Llama h128 x 4, 2 stages, 4 microbatches of 2 x 64 tokens), bf16, 2BW, Muon + "
                          "error feedback, 3 steps with `track_memory`; bytes held per parameter of the stage, "
                          "replica 0 (activations and transfer buffers included, so a tiny model's numbers are "
                          "above the 360M-scale ones). Before: autocast's per-microbatch weight casts, every replica "
                          "with the whole optimizer and EF state. After: the versions hold the linear weights in "
                          "bf16 (`training.bf16`), and `optimizer.shard_across_replicas: true`. The grads term "
                          "counts full gradient sets (a replica accumulates every gradient of its microbatches; "
                          "after the reduction it keeps its own only, which this accounting does not subtract).\n\n"
                          + text)
        return
    names = args.only.split(",") if args.only else list(CONFIGS)
    t0 = time.perf_counter()
    results = {n: (predicted(n), measured(n)) for n in names}
    worst = max(abs(agreement(p, g) - 1) for pred, got in results.values() for p, g in zip(pred, got))
    text = "\n".join([
        f"kB per stage and term, predicted (`plan_memory`) / measured (`memory_report`, 3 steps with "
        f"`track_memory`); 2 stages, {M} microbatches of {MBS} x {SEQ} tokens, 4 layers (Llama h128, Qwen3-MoE h128 "
        f"4 experts top-2). Worst predicted/measured over the measured terms: {1 + worst:.3f} or {1 - worst:.3f} "
        f"(target within 10%). {time.perf_counter() - t0:.0f} s.", "", table(results)])
    print(text)
    if args.write:
        from .report import write_section

        write_section("memory", "## The planner's memory, term by term, against the executor\n\n"
                      f"Command: `python -m bench.memory --write` ({time.strftime('%Y-%m-%d')}; CPU, gloo, 1 thread "
                      f"per process)\n\n{text}")


if __name__ == "__main__":
    main()
