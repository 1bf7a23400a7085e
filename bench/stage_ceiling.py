"""2BW against its two stages computing with neither waiting (no pipeline at all), and against the no-bubble limit,
the three measured in the same two processes, window after window, so that the machine's slow and fast phases fall
on all three alike (between consecutive runs they moved an arm by up to 27%; a window of a few seconds still
moves by up to 20% here, hence a dozen rounds and medians).

    python -m bench.stage_ceiling [--rounds 12] [--write]

The h256 shapes (``bench.throughput.H256``: Llama h256 x 8 layers, vocabulary 4,096, untied, AdamW's fused kernel,
4 microbatches of 4 x 128 tokens, split 5/3, 2 processes x 1 thread, gloo, random ids). Each round runs, in an
order rotated every round:

- ``2bw``: our executor (``PipelineEngine``), a window of ``--steps`` steps; its rate is read between the second
  step's result and the last but two, so the window's fill and drain do not count (as ``read_rate`` does for a
  command-line run).
- ``stages alone``: each process computes its own stage's steps (m forwards and backwards on local inputs, then
  AdamW) at the same time as the other, with no transfer and no schedule; the rate of the slower one: the split's
  balance and two busy cores, measured, the pipeline left out. A schedule can beat it only by a little: under 2BW
  the lighter stage waits part of each step, which leaves the busier one a less loaded machine.
- ``single``: process 0 computes the whole model, one thread, while process 1 waits (as ``in-process single`` of
  ``bench.cli_throughput``); twice its rate is the no-bubble limit.

Prints each round's three ratios and their medians; ``--write`` replaces its section (``stage-ceiling``) of
docs/benchmarks/speed.md. ``bench.cli_throughput`` has the arm ``stages alone`` too, but runs each arm in processes
of its own, one after another; here the three share two processes and alternate window by window, which is what
makes their ratios comparable on a machine whose speed wanders.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch.distributed as dist

from . import throughput as tp

SPLIT = tp.H256_SPLIT
M = 4
TOKENS = M * tp.MBS * tp.SEQ  # per step


def _worker(rank, world, rounds, steps):
    from hf_asyncpp.engine import LocalEngine
    from hf_asyncpp.pipeline.executor import PipelineEngine
    from hf_asyncpp.topology import Topology

    tp.LAYERS_PER_STAGE = SPLIT
    r = tp.recipe("2bw", world, M)
    eng = PipelineEngine(r, tp.build(r), Topology(rank=rank, world_size=world, num_stages=world), log=lambda *a: None)
    alone_step = tp.stage_alone_step(rank, world, M, SPLIT)
    single = None
    if rank == 0:
        single = LocalEngine(tp.recipe("none", 1, M), tp.build(r), Topology(), log=lambda *a: None)

    step = {"2bw": 0, "single": 0}

    def run_2bw():
        marks = []
        for _ in eng.run(tp.batches(steps, M), step["2bw"], steps):
            marks.append(time.perf_counter())
        step["2bw"] += steps
        return (len(marks) - 4) * TOKENS / (marks[-3] - marks[1])

    def run_alone():
        t0 = time.perf_counter()
        for _ in range(steps):
            alone_step()
        return steps * TOKENS / (time.perf_counter() - t0)

    def run_single():
        if single is None:
            return None
        bs = tp.batches(steps // 2, M)
        t0 = time.perf_counter()
        single.train_steps(bs, step["single"])
        step["single"] += len(bs)
        return len(bs) * TOKENS / (time.perf_counter() - t0)

    arms = {"2bw": run_2bw, "stages alone": run_alone, "single": run_single}
    for fn in arms.values():  # warm-up: both 2BW versions filled, every kernel seen once
        dist.barrier()
        fn()
    out = {k: [] for k in arms}
    keys = list(arms)
    for rnd in range(rounds):
        for k in keys[rnd % 3:] + keys[:rnd % 3]:
            dist.barrier()
            out[k].append(arms[k]())
    dist.barrier()
    eng.close()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=10, help="steps per window (the single arm runs half as many)")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    tp.use_model(tp.H256)  # the workers' model and AdamW's fused kernel, read back by the spawned processes
    tp.use_fused()
    res = tp.spawn(_worker, 2, args.rounds, args.steps)
    two = res[0]["2bw"]  # every stage yields each step's result at the same point: rank 0's clock
    alone = [min(a, b) for a, b in zip(res[0]["stages alone"], res[1]["stages alone"])]
    limit = [2 * s for s in res[0]["single"]]
    rows = list(zip(two, alone, limit))
    lines = ["| round | 2bw tokens/s | stages alone | no-bubble limit | 2bw / limit | stages alone / limit | 2bw / stages alone |",
             "|---|---|---|---|---|---|---|"]
    for i, (a, b, c) in enumerate(rows, 1):
        lines.append(f"| {i} | {a:,.0f} | {b:,.0f} | {c:,.0f} | {a / c:.3f} | {b / c:.3f} | {a / b:.3f} |")
    med = statistics.median
    r_lim, r_alone, r_eff = ([x[0] / x[2] for x in rows], [x[1] / x[2] for x in rows], [x[0] / x[1] for x in rows])
    lines += ["", f"- 2bw / no-bubble limit: median {med(r_lim):.3f} ({min(r_lim):.3f}-{max(r_lim):.3f}; target >= 0.9)",
              f"- stages alone / no-bubble limit: median {med(r_alone):.3f} ({min(r_alone):.3f}-{max(r_alone):.3f}): the "
              "two stages computing with neither waiting, no pipeline: the split's balance and two busy cores",
              f"- 2bw / stages alone: median {med(r_eff):.3f} ({min(r_eff):.3f}-{max(r_eff):.3f}): what the pipeline "
              "(schedule, transfers, versions, reduction) costs"]
    text = "\n".join(lines)
    print(text)
    if args.write:
        from .report import write_section

        write_section("stage-ceiling", "## 2BW against its stages computing alone, interleaved\n\n"
                      f"Command: `python -m bench.stage_ceiling --rounds {args.rounds} --steps {args.steps} --write` "
                      f"({time.strftime('%Y-%m-%d')}; Llama h256 x 8 layers, vocab 4096 untied, AdamW (fused), {M} "
                      f"microbatches of {tp.MBS} x {tp.SEQ} tokens, split {SPLIT[0]}/{SPLIT[1]}, 2 processes x 1 thread, "
                      "gloo, random ids; the three arms in the same two processes, one window each per round, the "
                      "order rotated every round)\n\n" + text)


if __name__ == "__main__":
    main()
