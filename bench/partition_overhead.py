"""Single-process overhead of the chained pipeline stages against the plain model (forward + backward,
same input), in two measures:

- **work**, exact and load-independent: the matmul FLOPs (``torch.utils.flop_counter``) and the operator calls
  and elements they write (a dispatch-mode counter), of the chained stages against the plain model;
- **time**: every repeat runs the plain model and each chaining back to back (in a rotating order), and the overhead is the median over
  repeats of each run's time over the plain run's of the same repeat (paired, so the drift of a shared VM, often
  +-5% over a minute here, cancels), with the interquartile range of those ratios; in wall time and in the process's
  CPU time (one thread: the CPU time leaves out what the VM's other tenants take).

    python -m bench.partition_overhead [--repeats 30] [--write]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode


CONFIGS = {
    "llama h256 x 8 (tied)": ("llama", dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=8,
                                          num_key_value_heads=4, vocab_size=4096, max_position_embeddings=256, tie_word_embeddings=True)),
    "mixtral h128 x 4, 8 experts (aux loss)": ("mixtral", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                                              num_attention_heads=4, num_key_value_heads=2, vocab_size=4096,
                                                              max_position_embeddings=256, num_local_experts=8,
                                                              num_experts_per_tok=2, output_router_logits=True)),
    "mamba h128 x 4 (SSM, tied)": ("mamba", dict(hidden_size=128, num_hidden_layers=4, vocab_size=4096, state_size=16)),
}


class OpCounter(TorchDispatchMode):
    """Operator calls and the elements their outputs hold: the non-matmul work (norms, activations, copies)."""

    def __init__(self):
        super().__init__()
        self.calls, self.elements = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls += 1
        self.elements += sum(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def work(fn) -> tuple[int, int, int]:
    """(matmul FLOPs, operator calls, output elements) of one call of ``fn``."""
    with FlopCounterMode(display=False) as flops, OpCounter() as ops:
        fn()
    return flops.get_total_flops(), ops.calls, ops.elements


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def build(mt: str, kw: dict, batch: int, seq: int):
    """The plain model and its 1-, 2- and 4-stage chainings, each a forward + backward callable on the same input."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_asyncpp.partition import partition_model, run_stages

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(mt, **kw))
    ids = torch.randint(0, kw["vocab_size"], (batch, seq))

    def plain():  # no KV cache, as in the stages (a training forward has none): the same work on both sides
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    fns, chains = {"plain": plain}, {p: partition_model(model, p, seq_len=seq) for p in (1, 2, 4)}
    for p, stages in chains.items():
        fns[f"{p} stage{'s' if p > 1 else ''}"] = lambda stages=stages: run_stages(stages, ids, ids).backward()

    def clear():  # every run starts from no gradients (no accumulation on either side)
        for m in (model, *(s for stages in chains.values() for s in stages)):
            m.zero_grad(set_to_none=True)

    return fns, clear, chains[2], ids


def timed(fns: dict, clear, repeats: int) -> tuple[dict, dict]:
    """Wall and CPU seconds of each callable over ``repeats`` interleaved rounds (each in every position in turn)."""
    wall, cpu = {k: [] for k in fns}, {k: [] for k in fns}
    for fn in fns.values():
        clear()
        fn()  # warm-up
    names = list(fns)
    for r in range(repeats):
        for k in names[r % len(names):] + names[:r % len(names)]:
            clear()
            t0, u0 = time.perf_counter(), time.process_time()
            fns[k]()
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - u0)
    clear()
    return wall, cpu


def tiny(kw: dict) -> dict:
    """The same architecture with almost no arithmetic: what is left is the fixed (Python) cost of each run."""
    small = dict(kw, hidden_size=16, vocab_size=64, max_position_embeddings=64)
    for k, v in (("intermediate_size", 16), ("num_attention_heads", 2), ("num_key_value_heads", 1), ("state_size", 4)):
        if k in kw:
            small[k] = v
    return small


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--tiny-repeats", type=int, default=300)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--models", default=None, help="comma-separated model types to run (default: all; --write needs all)")
    args = ap.parse_args()
    only = set(args.models.split(",")) if args.models else None
    if only and args.write:
        raise SystemExit("--write replaces the whole table: run every model (no --models)")

    torch.set_num_threads(1)
    rows, fixed_rows, sent, verdict = [], [], [], []
    for name, (mt, kw) in CONFIGS.items():
        if only and mt not in only:
            continue
        fns, clear, two, ids = build(mt, kw, 4, 128)
        with torch.no_grad():  # what one stage boundary carries (the runtime sends each tensor)
            out = two[0](ids)
        parts = out if isinstance(out, tuple) else (out,)
        sent.append(f"- {name}: " + " + ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in parts)
                    + f" = {sum(t.numel() * t.element_size() for t in parts):,} bytes per microbatch")
        counts = {}
        for k, fn in fns.items():
            clear()
            counts[k] = work(fn)
        times, cpu = timed(fns, clear, args.repeats)
        # the fixed cost per run, measured where it is all there is (a 16-wide model on 8 tokens): low-noise, and
        # what it adds to this model is that cost over this model's time
        t_fns, t_clear, _, _ = build(mt, tiny(kw), 1, 8)
        t_times, _ = timed(t_fns, t_clear, args.tiny_repeats)
        f0, c0, e0 = counts["plain"]
        base, t_base = statistics.median(times["plain"]), statistics.median(t_times["plain"])
        for k in fns:
            lo, mid, hi = _quartiles([t / b - 1 for t, b in zip(times[k], times["plain"])])
            clo, cmid, chi = _quartiles([t / b - 1 for t, b in zip(cpu[k], cpu["plain"])])
            f, c, e = counts[k]
            rows.append(f"| {name} | {k} | {(f / f0 - 1) * 100:+.2f}% | {c - c0:+d} ({(c / c0 - 1) * 100:+.1f}%) | "
                        f"{(e / e0 - 1) * 100:+.2f}% | {statistics.median(times[k]) * 1e3:.1f} | {mid * 100:+.1f}% "
                        f"[{lo * 100:+.1f}, {hi * 100:+.1f}] | {cmid * 100:+.1f}% [{clo * 100:+.1f}, {chi * 100:+.1f}] |")
            extra = statistics.median(t_times[k]) - t_base
            if k != "plain":
                verdict.append((f"{name.split(' (')[0]}, {k}", mid, lo, hi, extra / base))
            fixed_rows.append(f"| {name} | {k} | {t_base * 1e3:.2f} | {extra * 1e3:+.2f} | {extra / base * 100:+.1f}% |")
    table = "\n".join(["| model | run | matmul FLOPs | operator calls | elements written | median fwd+bwd (ms) | "
                       "wall time vs plain: median [quartiles] of paired ratios | CPU time vs plain (same) |",
                       "|---|---|---|---|---|---|---|---|", *rows])
    fixed = "\n".join(["| model | run | tiny plain fwd+bwd (ms) | fixed cost added (ms) | over the full model's plain time |",
                       "|---|---|---|---|---|", *fixed_rows])
    worst = max(verdict, key=lambda v: v[4])
    over = [v for v in verdict if v[1] > 0.03]
    summary = (f"Against the 3% target: the fixed cost is at most {worst[4] * 100:.1f}% ({worst[0]}); the paired wall-time "
               f"medians are within 3% in {len(verdict) - len(over)} of {len(verdict)} chainings" +
               ("" if not over else " (over: " + "; ".join(f"{v[0]} {v[1] * 100:+.1f}% [{v[2] * 100:+.1f}, {v[3] * 100:+.1f}]"
                                                      for v in over) + ", quartiles spanning the target)") + ".")
    print(table)
    print(fixed)
    print(summary)
    print("\n".join(sent))
    if args.write:
        from .report import write_section

        write_section("partition", f"""## Partition overhead (single process, 1 thread)

Command: `python -m bench.partition_overhead --repeats {args.repeats} --write` ({time.strftime('%Y-%m-%d')}; batch 4 x 128
tokens). Target: the chained stages' forward + backward within 3% of the plain model's.

**Work** (exact counts of one forward + backward, the chained stages against the plain model): the matmul FLOPs,
the operator calls, and the elements those operators write. **Time**: the median over {args.repeats} interleaved
repeats of each run's time over the plain model's in the same repeat, with the quartiles of that ratio, in wall and
in the process's CPU time (equal here: nothing else ran).

{table}

Every stage runs the model's own forward, so the work is the same matmuls; what a stage adds is a fixed cost per
call, mostly Python: the model's preamble before the layers (its causal mask with the packed-sequence probe, the
rotary table, a zero tensor standing in for the embedding), the stand-in layer calls, and for MoE the router
statistics. On this VM two identical runs differ by 5-10% from one to the next, so the ratios above carry that
noise. The fixed cost is measured where it is all there is: the same architectures 16 wide on 8 tokens (median of
{args.tiny_repeats} interleaved repeats), and its share of the full model is that cost over the full model's plain time:

{fixed}

{summary}

What crosses a stage boundary (MoE: hidden states + router statistics pooled over every router so far, 2E + 1
numbers, whatever the depth):

""" + "\n".join(sent))


if __name__ == "__main__":
    main()
