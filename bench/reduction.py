"""What the gradient reduction costs a pipeline, measured on CPU and fed to the simulator at p = 4 and 8.

    python -m bench.reduction [--repeats 5] [--write]

Measured here, on the h256 model (``bench.throughput.H256``: Llama h256 x 8 layers, vocabulary 4,096, untied,
microbatches of 4 x 128 tokens), one thread per process:

- the whole model's forward and backward per microbatch and AdamW's step (one process), cut into p equal stages;
- the reduction of one stage's gradients at p = 4 and 8 by the real ``Reducer`` (asynchronous collectives, the
  data-parallel mean in buckets, the norm) between 2 data-parallel replicas (2 processes, gloo), submit to result;
  and the global norm's all-reduce over a pipeline of 2 (a scalar).

Then the simulator's steady-state step time of 2BW and 1F1B at m = 8 and 16 with (a) no reduction, (b) the
measured reduction off the compute stream (``REDUCE`` posts it, only ``STEP`` waits: the reducer's design), (c) the
same reduction on the compute stream (``reduce_on_compute_stream``: a stage computes nothing until its reduction is
done, which is what synchronous NCCL collectives on a reduction thread would do to the compute stream). Target:
2BW / 1F1B with (b) within 5% of (a) at p = 4, m = 8. ``--write`` replaces the ``reduction``
section of docs/benchmarks/parts.md.
"""
from __future__ import annotations

import argparse
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from hf_asyncpp.plan.search import steady_step_time
from hf_asyncpp.pipeline.reducer import Reducer
from hf_asyncpp.schedules.records import ONE_F_ONE_B, TWO_BW
from hf_asyncpp.schedules.simulator import Costs
from hf_asyncpp.testing import run_workers
from hf_asyncpp.topology import Topology, make_groups

from .throughput import H256 as MODEL, MBS, SEQ

PS, MS = (4, 8), (8, 16)


def build():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = dict(MODEL)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg)).float()


def compute_costs(repeats: int) -> dict[str, float]:
    """Median seconds of the whole model's forward, backward (one microbatch) and AdamW step, one thread."""
    torch.set_num_threads(1)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, MODEL["vocab_size"], (MBS, SEQ), generator=torch.Generator().manual_seed(0))
    f, b, s = [], [], []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if i:  # the first is a warm-up
            f.append(t1 - t0), b.append(t2 - t1), s.append(t3 - t2)
    params = sum(p.numel() for p in model.parameters())
    return {"F": statistics.median(f), "B": statistics.median(b), "STEP": statistics.median(s), "params": params}


def _worker(rank: int, world: int, params: int, repeats: int) -> dict:
    """Median seconds of the reducer, submit to result, per (kind, p): run on 2 gloo processes."""
    res = {}
    # (stages, replicas): 1 x 2 is one stage's data-parallel reduction; 2 x 1 is the global norm over a pipeline
    for name, stages in (("dp", 1), ("norm", 2)):
        topo = Topology(rank=rank, world_size=world, num_stages=stages)
        groups = make_groups(topo, [], timedelta(seconds=120))
        for p in PS if name == "dp" else (0,):
            n = params // p if p else 1
            shapes = _shapes(n)
            times = []
            for i in range(repeats + 1):
                grads = {f"w{j}": torch.randn(sh) for j, sh in enumerate(shapes)}
                red = Reducer(groups, topo, {}, 120.0)
                dist.barrier()
                t0 = time.perf_counter()
                red.submit(0, grads)
                red.result(0)
                if i:
                    times.append(time.perf_counter() - t0)
            res[(name, p)] = statistics.median(times)
        groups.destroy()
    return res


def _shapes(n: int) -> list[tuple[int, ...]]:
    """Layer-like tensors (256 x 768 matrices, 256 vectors) holding about ``n`` values."""
    out, left = [], n
    while left > 256 * 768:
        out.append((256, 768))
        left -= 256 * 768
    return out + [(max(1, left),)]


def reduction_costs(params: int, repeats: int) -> dict:
    return run_workers(_worker, 2, params, repeats)[0]  # rank 0's clock


def simulate_table(cost: dict, red: dict) -> tuple[str, dict]:
    lines = ["| p | m | reduction ms | 2bw s/step: none / off stream / on compute stream | 1f1b s/step: none / off / on "
             "| 2bw / 1f1b: none / off stream / on compute stream |", "|---|---|---|---|---|---|"]
    ratios = {}
    for p in PS:
        r = red[("dp", p)] + red[("norm", 0)]
        for m in MS:
            base = Costs(forward=cost["F"] / p, backward=cost["B"] / p, step=cost["STEP"] / p)
            with_red = Costs(forward=base.forward, backward=base.backward, step=base.step, reduce=r)
            t = {}
            for sched in (TWO_BW, ONE_F_ONE_B):
                t[(sched.name, "none")] = steady_step_time(sched, p, m, base, "global")[0]
                t[(sched.name, "off")] = steady_step_time(sched, p, m, with_red, "global")[0]
                t[(sched.name, "on")] = steady_step_time(sched, p, m, with_red, "global", reduce_on_compute_stream=True)[0]
            rat = {v: t[("1f1b", v)] / t[("2bw", v)] for v in ("none", "off", "on")}
            ratios[(p, m)] = rat
            lines.append(f"| {p} | {m} | {r * 1e3:.1f} | {t[('2bw', 'none')]:.3f} / {t[('2bw', 'off')]:.3f} / "
                         f"{t[('2bw', 'on')]:.3f} | {t[('1f1b', 'none')]:.3f} / {t[('1f1b', 'off')]:.3f} / "
                         f"{t[('1f1b', 'on')]:.3f} | {rat['none']:.2f} / {rat['off']:.2f} / {rat['on']:.2f} |")
    return "\n".join(lines), ratios


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    cost = compute_costs(args.repeats)
    red = reduction_costs(cost["params"], args.repeats)
    table, ratios = simulate_table(cost, red)
    r48 = ratios[(4, 8)]
    text = "\n".join([
        f"Measured (median of {args.repeats}): whole model {cost['params'] / 1e6:.1f}M parameters, forward "
        f"{cost['F'] * 1e3:.1f} ms and backward {cost['B'] * 1e3:.1f} ms per microbatch of {MBS} x {SEQ} tokens, AdamW "
        f"step {cost['STEP'] * 1e3:.1f} ms; the reducer on one stage's gradients between 2 replicas: "
        + ", ".join(f"p = {p} ({cost['params'] // p / 1e6:.2f}M values) {red[('dp', p)] * 1e3:.1f} ms" for p in PS)
        + f"; the global norm over a pipeline of 2: {red[('norm', 0)] * 1e3:.2f} ms.", "",
        table, "",
        f"- p = 4, m = 8: 2BW / 1F1B {r48['none']:.2f} without a reduction, {r48['off']:.2f} with it off the compute "
        f"stream ({r48['off'] / r48['none'] - 1:+.1%}; target within 5%), {r48['on']:.2f} with it on the compute "
        "stream (the former reduction thread under NCCL).",
    ])
    print(text)
    if args.write:
        from .report import write_section

        write_section("reduction", "## The gradient reduction off the compute stream\n\n"
                      f"Command: `python -m bench.reduction --repeats {args.repeats} --write` "
                      f"({time.strftime('%Y-%m-%d')}; CPU, gloo, 1 thread per process)\n\n{text}")


if __name__ == "__main__":
    main()
