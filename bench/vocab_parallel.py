"""The vocabulary layers shared by every stage, measured: one head-heavy model trained both ways, side by side.

    python -m bench.vocab_parallel [--stages 2] [--rounds 5] [--steps 3]

A Llama of 4 small layers (hidden 256) and a 32,000-token untied output layer, whose head and loss weigh about as
much as ten of its layers, on ``--stages`` gloo processes under 2BW (AdamW, fp32): one ``PipelineEngine`` with the
head and loss on the last stage (``pipeline.vocab_parallel: false``) and one with them shared (``true``), built in
the same processes and stepped in alternation, ``--steps`` steps per turn and ``--rounds`` turns each, so both see
the same machine at the same moments (two shared cores move a CPU figure by up to 2x between runs). Printed: each
way's median seconds per step on the first stage and the ratio; the figure that counts is the ratio, and the planner
predicts it from the partition's FLOPs (``plan.vocab.vocab_parallel_step_times``), printed beside it.
"""
from __future__ import annotations

import argparse
import statistics
import time

from hf_asyncpp.config.recipe import recipe_from_dict
from hf_asyncpp.plan.vocab import vocab_parallel_step_times
from hf_asyncpp.testing import _stage_engine, run_workers

MODEL = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32000, "max_position_embeddings": 256,
         "tie_word_embeddings": False}


def recipe(stages: int, shared: bool) -> dict:
    return {"model": {"config": MODEL}, "data": {"seq_len": 128},
            "pipeline": {"schedule": "2bw", "num_stages": stages, "num_microbatches": 2 * stages, "microbatch_size": 2,
                         "vocab_parallel": shared},
            "optimizer": {"name": "adamw", "learning_rate": 1e-3},
            "training": {"max_steps": 1000, "max_grad_norm": 1.0, "report_to": []}}


def _worker(rank: int, world: int, rounds: int, steps: int) -> dict[bool, list[float]]:
    """Both engines in this process, stepped in turns; seconds per step of each turn (after one warm-up turn)."""
    engines = {shared: _stage_engine(rank, world, recipe(world, shared)) for shared in (False, True)}
    done = {False: 0, True: 0}
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for turn in range(rounds + 1):
        for shared, (eng, batches) in engines.items():
            t0 = time.perf_counter()
            eng.train_steps(batches(steps), done[shared])
            if turn:  # the first turn builds caches and warms the allocator
                seconds[shared].append((time.perf_counter() - t0) / steps)
            done[shared] += steps
    for eng, _ in engines.values():
        eng.close()
    return seconds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    first = run_workers(_worker, args.stages, args.rounds, args.steps)[0]
    last, shared = (statistics.median(first[v]) for v in (False, True))
    planned = vocab_parallel_step_times(recipe_from_dict(recipe(args.stages, True)))
    print(f"head-heavy Llama (4 layers, hidden 256, vocabulary 32,000), 2BW on {args.stages} stages, "
          f"{args.rounds} x {args.steps} steps each way, alternating:")
    print(f"  head on the last stage: {last * 1e3:.1f} ms/step; shared by every stage: {shared * 1e3:.1f} ms/step; "
          f"{last / shared:.2f}x (the planner on the partition's FLOPs: {planned[0] / planned[1]:.2f}x)")


if __name__ == "__main__":
    main()
