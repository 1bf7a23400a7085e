"""Independent anchors for the schedule decision: our 2BW, 1F1B and ZB-H1 beside torch.distributed.pipelining's
own 1F1B, interleaved 1F1B, interleaved zero bubble, ZBV and DualPipeV, on one model and machine.

Llama h256 x 8 layers (bench.throughput's ``--model h256``), AdamW with torch's fused kernel on every arm, m = 4
microbatches of 4 x 128 tokens, 2 gloo processes x 1 thread. Ours and torch's ``Schedule1F1B`` run one stage per
rank (split 5/3, as the other CPU speed benchmarks); torch's multi-stage schedules run 2 stages per rank (the model
cut in 4 by our partitioner, each a ``PipelineStage``), in loop placement (rank r holds stages r and r + 2) for the
interleaved ones and in V placement (rank 0 holds 0 and 3, rank 1 holds 1 and 2) for ZBV and DualPipeV, as those
need. Rounds are interleaved (every arm once per round) and each arm reports its median, so a slow phase of the
shared machine hits all alike; the ratios are to torch's ``Schedule1F1B`` in the same rounds.

    python -m bench.schedule_anchors [--steps 12] [--rounds 3] [--write]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from . import throughput as tp

TORCH_MULTI = {"interleaved-1f1b": ("ScheduleInterleaved1F1B", "loop"),
               "interleaved-zb": ("ScheduleInterleavedZeroBubble", "loop"),
               "zbv": ("ScheduleZBVZeroBubble", "v"), "dualpipev": ("ScheduleDualPipeV", "v")}
"""Our name -> (torch's class, stage placement over the 2 ranks)."""


def _torch_multi(rank, world, name, steps, m):
    """torch's multi-stage ``name`` with 2 stages per rank; tokens/s over ``steps`` steps after one warm-up step."""
    from torch.distributed import pipelining

    from hf_asyncpp.partition import partition_model

    cls_name, placement = TORCH_MULTI[name]
    n = 2 * world
    chunks = partition_model(tp.build(tp.recipe("1f1b", world, m)), n)
    mine = [rank, rank + world] if placement == "loop" else [rank, n - 1 - rank]
    stages = [pipelining.PipelineStage(chunks[i], i, n, torch.device("cpu")) for i in mine]
    params = [q for i in mine for q in chunks[i].parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)

    def loss_fn(logits, target):
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1))

    sched = getattr(pipelining, cls_name)(stages, n_microbatches=m, loss_fn=loss_fn)
    first, last = 0 in mine, n - 1 in mine

    def one(batch):
        flat = batch.reshape(m * tp.MBS, tp.SEQ)
        args = (flat,) if first else ()
        kwargs = {"target": flat} if last else {}
        sched.step(*args, **kwargs)
        opt.step()
        opt.zero_grad()

    one(tp.batches(1, m)[0])
    bs = tp.batches(steps, m)
    dist.barrier()
    t0 = time.perf_counter()
    for b in bs:
        one(b)
    dist.barrier()
    return {"tokens_per_s": steps * m * tp.MBS * tp.SEQ / (time.perf_counter() - t0)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--write", action="store_true", help="replace the schedule-anchors section of docs/benchmarks/speed.md")
    args = ap.parse_args(argv)
    tp.use_model(tp.H256)
    tp.use_fused(True)
    p, m, n, split = 2, args.microbatches, args.steps, tp.H256_SPLIT
    arms = {f"hf_asyncpp {s}": (tp._ours, (s, n, m, split)) for s in ("2bw", "1f1b", "zbh1")}
    arms["torch Schedule1F1B"] = (tp._torch_pipelining, ("1f1b", n, m, split, True))
    arms.update({f"torch {cls} (2 stages per rank)": (_torch_multi, (name, n, m)) for name, (cls, _) in TORCH_MULTI.items()})
    got: dict[str, list[float]] = {a: [] for a in arms}
    failed: dict[str, str] = {}
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", flush=True)
        for arm, (fn, fn_args) in arms.items():
            if arm in failed:
                continue
            try:
                got[arm].append(tp.spawn(fn, p, *fn_args)[0]["tokens_per_s"])
            except Exception as e:  # noqa: BLE001 - a schedule torch refuses here is reported, not fatal
                failed[arm] = str(e).strip().splitlines()[-1][:200]
            print(f"  {arm}: {got[arm][-1] if got[arm] and arm not in failed else failed.get(arm)}", flush=True)
    ref = statistics.median(got["torch Schedule1F1B"])
    lines = ["| arm | tokens/s, median (min-max) | / torch Schedule1F1B |", "|---|---|---|"]
    for arm, vals in got.items():
        if arm in failed:
            lines.append(f"| {arm} | failed: {failed[arm]} | |")
            continue
        med = statistics.median(vals)
        lines.append(f"| {arm} | {med:,.0f} ({min(vals):,.0f}-{max(vals):,.0f}) | {med / ref:.2f} |")
    text = (f"### Schedule anchors on this machine (`python -m bench.schedule_anchors --steps {n} --rounds "
            f"{args.rounds} --write`)\n\nLlama h256 x 8, AdamW (fused) on every arm, m = {m} microbatches of "
            f"{tp.MBS} x {tp.SEQ} tokens, 2 gloo processes x 1 thread; medians of {args.rounds} interleaved rounds "
            f"of {n} steps.\n\n" + "\n".join(lines) + "\n")
    print(text)
    if args.write:
        from .report import write_section

        print(f"wrote {write_section('schedule-anchors', text)}")


if __name__ == "__main__":
    main()
