"""Which schedule wins for a recipe at its scale: the planner's decision table.

For each recipe and stage count, every schedule the executor runs (2BW, 1F1B, ZB-H1, GPipe) on the recipe's own
partition, and the virtual-stage schedules the planner simulates (interleaved 1F1B, ZBV, DualPipeV: 2 stages per GPU
on the model split into twice the stages, balanced by FLOPs; not in the executor yet): steady-state seconds per step
simulated from the partition's FLOPs at ``--tflops`` (each backward charged its forward's replay where the recipe
checkpoints its layers; the difference of a 4-step and a 2-step window, so a window's
fill and drain, paid once per drain point, do not count; I and W half a backward each), the bubble, the fullest
GPU's planned memory (a stage, or a rank's two stages) and whether it fits ``--gpu-memory``, the speed against 1F1B,
and the speed at the same loss: a 2BW step is worth ``plan.search.DELAYED_STEP_WORTH`` of a synchronous one for the
recipe's optimizer and correction (measured in the paper-regime study). Every schedule twice where the model allows
it: with the vocabulary layers on the last stage, and shared by every stage (``pipeline.vocab_parallel``: each stage
a shard of the output layer and loss, a VOCAB pass per microbatch, the layers split evenly), with the speed-up the
sharing gives. Nothing is allocated (meta device).

    python -m bench.schedules            # print the table
    python -m bench.schedules --write    # and replace its section of docs/benchmarks/speed.md
"""
from __future__ import annotations

import argparse
import copy

from hf_asyncpp.cli.plan import parse_bytes
from hf_asyncpp.config.recipe import load_recipe
from hf_asyncpp.plan.memory import _runnable_m, meta_model, plan_memory
from hf_asyncpp.plan.search import (DELAYED_STEP_WORTH, PLANNED_SCHEDULES, STEP_WORTH_SOURCE, flops_costs, run_costs,
                                    steady_step_time, step_worth, why_not_planned)
from hf_asyncpp.plan.vocab import why_not_vocab_parallel
from hf_asyncpp.schedules.records import get_schedule

CASES = [("smollm2-360m", 4, 1), ("moe-10b", 8, 2), ("moe-10b", 16, 1)]
"""(recipe, stages, data-parallel replicas): the recipes' own layouts and moe-10b on all 16 GPUs as stages."""
NAMES = PLANNED_SCHEDULES


def decide(recipe_name: str, p: int, dp: int, tflops: float, gpu_memory: str) -> list[dict]:
    """Each schedule's row, once with the vocabulary layers on the last stage and, where the model allows, once shared
    by every stage (the recipe's layers_per_stage dropped: each way on its own FLOPs-balanced split)."""
    base = load_recipe(f"recipes/{recipe_name}.yaml")
    base.pipeline.layers_per_stage = None
    model = meta_model(base)
    modes = (False, True) if why_not_vocab_parallel(base, model, p) is None else (False,)
    rows = [row for vocab in modes for row in _rows(base, model, p, dp, tflops, gpu_memory, vocab)]
    one = {vocab: next(r["step_s"] for r in rows if r["schedule"] == "1f1b" and r["vocab"] == vocab) for vocab in modes}
    without = {r["schedule"]: r["step_s"] for r in rows if not r["vocab"]}
    for r in rows:
        r["speed"] = one[False] / r["step_s"]
        r["at_loss"] = r["speed"] * r["worth"] if r["worth"] is not None else None
        r["gain"] = without[r["schedule"]] / r["step_s"] if r["vocab"] and r["schedule"] in without else None
    return rows


def _rows(base, model, p: int, dp: int, tflops: float, gpu_memory: str, vocab: bool) -> list[dict]:
    cap = 0.9 * parse_bytes(gpu_memory)
    rows = []
    for name in NAMES:
        sched = get_schedule(name)
        if not sched.runs_in_executor and why_not_planned(sched, model.config.num_hidden_layers, p,
                                                          base.pipeline.num_microbatches):
            continue  # the virtual-stage schedules at the recipe's own m only, where the layers allow
        rec = copy.deepcopy(base)
        rec.pipeline.schedule = name
        plan, mem, _ = plan_memory(rec, p, model=model, dp=dp, vocab_parallel=vocab)
        m = _runnable_m(sched, p, max(rec.pipeline.num_microbatches, 1))
        costs = flops_costs(plan, rec, tflops * 1e12)
        costs.vocab *= sched.stages_per_rank  # a rank's shard: 1 / ranks of the head (the plan's are per model stage)
        # as the recipe runs the layers: with activation checkpointing every backward replays its forward
        costs = run_costs(costs, rec).per_rank(sched.stage_ranks(p))
        step, bubble = steady_step_time(sched, p, m, costs, sched.reduce_scope(rec.training.max_grad_norm),
                                        vocab_parallel=vocab)
        # the global clip: every stage's STEP waits for the norm of all stages; against each stage on its own norm
        local, _ = steady_step_time(sched, p, m, costs, "stage", vocab_parallel=vocab)
        peak = max(s.total for s in mem)
        rows.append({"schedule": name, "vocab": vocab, "m": m, "step_s": step, "bubble": bubble, "peak": peak,
                     "fits": peak <= cap, "clip_delay": step - local, "worth": step_worth(sched, rec.optimizer)})
    return rows


def table(cases, tflops: float, gpu_memory: str) -> str:
    lines = [f"| recipe | ranks x replicas | schedule | vocabulary layers | m | s/step | bubble | fullest GPU | "
             f"fits {gpu_memory} | speed vs 1F1B | to the same loss vs 1F1B | global clip's delay | shared vs last |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for recipe_name, p, dp in cases:
        for r in decide(recipe_name, p, dp, tflops, gpu_memory):
            at_loss = f"{r['at_loss']:.2f}x" if r["at_loss"] is not None else "not measured"
            per_rank = get_schedule(r["schedule"]).stages_per_rank
            name = r["schedule"] + (f" ({per_rank} stages per rank)" if per_rank > 1 else "")
            gain = f"{r['gain']:.2f}x" if r["gain"] is not None else "-"
            lines.append(f"| {recipe_name} | {p} x {dp} | {name} | {'shared' if r['vocab'] else 'last stage'} | "
                         f"{r['m']} | {r['step_s']:.3f} | {r['bubble']:.1%} | {r['peak'] / 1e9:.1f} GB | "
                         f"{'yes' if r['fits'] else 'no'} | {r['speed']:.2f}x | {at_loss} | "
                         f"{r['clip_delay'] * 1e3:.1f} ms | {gain} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tflops", type=float, default=300.0, help="bf16 TFLOP/s per GPU the costs assume")
    ap.add_argument("--gpu-memory", default="80GB")
    ap.add_argument("--write", action="store_true", help="replace the schedules section of docs/benchmarks/speed.md")
    args = ap.parse_args(argv)
    worth = ", ".join(f"{o} + {c}: {w:.2f}" for (o, c), w in sorted(DELAYED_STEP_WORTH.items()))
    text = (f"### Which schedule wins at the recipes' scale (`python -m bench.schedules --write`)\n\n"
            f"Simulated at {args.tflops:g} TFLOP/s per GPU from each partition's FLOPs; memory from the planner "
            f"(within 1% of the executor, section 4). A 2BW step is worth a fraction of a synchronous one ({worth}; "
            f"{STEP_WORTH_SOURCE}), which the last column applies; the synchronous schedules compute the same "
            f"gradients, so their steps are worth 1. The last column is what the global gradient-norm clip costs a "
            f"step: the step time with every STEP waiting for all stages' norms, less the time with each stage "
            f"clipping on its own norm. Each schedule runs twice where the model allows it: the vocabulary layers on the "
            f"last stage, and shared by every stage (`pipeline.vocab_parallel`; each on its own FLOPs-balanced split, "
            f"the VOCAB passes costed by their FLOPs, no link modelled); the last column is the speed the sharing gives "
            f"that schedule; speed vs 1F1B is against 1F1B with the layers on the last stage. smollm2-360m ties its "
            f"head to the embedding: not shared.\n\n{table(CASES, args.tflops, args.gpu_memory)}\n")
    print(text)
    if args.write:
        from .report import write_section

        print(f"wrote {write_section('schedules', text)}")


if __name__ == "__main__":
    main()
