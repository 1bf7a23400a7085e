"""Single-process overhead of the chained pipeline stages against the plain model (forward + backward,
same input), measured interleaved so machine noise hits both alike.

    python bench/partition_overhead.py [--repeats 30] [--write]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path[0] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

CONFIGS = {
    "llama h256 x 8 (tied)": ("llama", dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=8,
                                          num_key_value_heads=4, vocab_size=4096, max_position_embeddings=256, tie_word_embeddings=True)),
    "mixtral h128 x 4, 8 experts (aux loss)": ("mixtral", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                                              num_attention_heads=4, num_key_value_heads=2, vocab_size=4096,
                                                              max_position_embeddings=256, num_local_experts=8,
                                                              num_experts_per_tok=2, output_router_logits=True)),
    "mamba h128 x 4 (SSM, tied)": ("mamba", dict(hidden_size=128, num_hidden_layers=4, vocab_size=4096, state_size=16)),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_asyncpp.partition import partition_model, run_stages

    torch.set_num_threads(1)
    rows, sent = [], []
    for name, (mt, kw) in CONFIGS.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(mt, **kw))
        ids = torch.randint(0, 4096, (4, 128))

        def plain():  # no KV cache, as in the stages (a training forward has none): the same work on both sides
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

        chained, all_stages = {}, []
        for p in (1, 2, 4):
            stages = partition_model(model, p, seq_len=128)
            all_stages += stages

            def run(stages=stages):
                run_stages(stages, ids, ids).backward()

            chained[p] = run
            if p == 2:  # what one stage boundary carries (the runtime sends each tensor)
                with torch.no_grad():
                    out = stages[0](ids)
                parts = out if isinstance(out, tuple) else (out,)
                sent.append(f"- {name}: " + " + ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in parts)
                            + f" = {sum(t.numel() * t.element_size() for t in parts):,} bytes per microbatch")
        fns = {"plain": plain, **{f"{p} stage{'s' if p > 1 else ''}": f for p, f in chained.items()}}
        times = {k: [] for k in fns}
        for fn in fns.values():
            fn()  # warm-up
        for _ in range(args.repeats):
            for k, fn in fns.items():  # interleaved
                for m in (model, *all_stages):  # every run starts from no gradients (no accumulation on either side)
                    m.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        base = statistics.median(times["plain"])
        for k in fns:
            med = statistics.median(times[k])
            rows.append(f"| {name} | {k} | {med * 1e3:.1f} | {(med / base - 1) * 100:+.1f}% |")
    table = "\n".join(["| model | run | median fwd+bwd (ms) | overhead vs plain |", "|---|---|---|---|", *rows])
    print(table)
    print("\n".join(sent))
    if args.write:
        from bench.report import write_section

        write_section("partition", f"## Partition overhead (single process, 1 thread)\n\nCommand: `python bench/partition_overhead.py "
                      f"--repeats {args.repeats} --write` ({time.strftime('%Y-%m-%d')}; batch 4 x 128 tokens; medians of "
                      f"interleaved runs). Target: at most 3%.\n\n{table}\n\nWhat crosses a stage boundary (MoE: hidden states + router "
                      f"statistics pooled over every router so far, 2E + 1 numbers, whatever the depth):\n\n" + "\n".join(sent))


if __name__ == "__main__":
    main()
