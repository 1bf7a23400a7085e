"""Pipeline throughput on this machine: our gpipe / 1f1b / 2bw against torch.distributed.pipelining
and against one process with no pipeline. Every row: the same model, microbatch size and microbatches
per step; 2 processes with 1 thread each (the no-bubble limit is 2x the one-process, one-thread rate).

    python -m bench.throughput [--steps 6] [--microbatches 4] [--repeats 3] [--extra-warmup 1] [--write]
    python -m bench.throughput --model h256 --layers-per-stage 5,3 [--extra-warmup 0] [--write]

``--model h128`` (the default; the first targets): Llama h128, tied, 8 layers (``--layers``). ``--model h256``
(the stricter targets: 2bw / torch Schedule1F1B >= 1.2 at m = 4 and >= 1.4 at m = p = 2, 2bw / limit >= 0.9): Llama
h256 x 8 layers, vocabulary 4,096, untied, the shapes of ``bench.cli_throughput``, ``bench.stage_ceiling`` and
``bench.reduction``; with ``--layers-per-stage 5,3`` it has every arm of the retired
``bench/vs_torch_pipelining.py``.

Prints a table with ratios; ``--write`` replaces the ``throughput-<layers>`` (or ``throughput-h256-<layers>``)
section of docs/benchmarks/speed.md and writes the timelines that the simulator predicts from the measured
per-action times to docs/schedules/measured-*.png (next to its predicted tokens/s, a check of the simulator
against reality).

This module is also the harness of the other CPU speed benchmarks: the workers (``_ours``, ``_torch_pipelining``,
``_stages_alone``), ``single_process``, ``spawn``, and the model every arm uses (``use_model``, ``use_fused``).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hf_asyncpp.plan.profile import stage_shares
from hf_asyncpp.testing import run_workers

ROOT = Path(__file__).resolve().parent.parent

H128 = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096, "max_position_embeddings": 256,
        "tie_word_embeddings": True}
"""The default model of this benchmark."""
H256 = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096, "max_position_embeddings": 256,
        "tie_word_embeddings": False}
"""The larger model (bench.cli_throughput, bench.stage_ceiling, bench.reduction), split ``H256_SPLIT``."""
H256_SPLIT = [5, 3]
MODELS = {"h128": H128, "h256": H256}
SEQ, MBS = 128, 4

_MODEL_ENV, _FUSED_ENV = "HF_ASYNCPP_BENCH_MODEL", "HF_ASYNCPP_BENCH_FUSED"
# The model and AdamW's kernel of every arm. A benchmark picks them with use_model / use_fused before it spawns
# workers; a spawned worker imports this module afresh and reads them back from the environment it inherited.
MODEL = dict(H128)
MODEL.update(json.loads(os.environ.get(_MODEL_ENV, "{}")))
FUSED = os.environ.get(_FUSED_ENV) == "1"
"""AdamW's kernel on every arm (ours and torch's alike): torch's per-tensor loop, or its fused kernel."""


def use_model(model: dict) -> None:
    """Every arm's model from now on, in this process and in the workers it spawns after this call."""
    MODEL.clear()
    MODEL.update(model)
    os.environ[_MODEL_ENV] = json.dumps(MODEL)


def use_fused(on: bool = True) -> None:
    """AdamW's fused kernel (``optimizer.fused``, ``torch.optim.AdamW(fused=True)``) on every arm from now on, in
    this process and in the workers it spawns after this call."""
    global FUSED
    FUSED = on
    os.environ[_FUSED_ENV] = "1" if on else "0"


LAYERS_PER_STAGE = None  # set by --layers-per-stage; None: the partitioner's cost model


def recipe(schedule: str, stages: int, m: int, extra_warmup: int = 0):
    from hf_asyncpp.config.recipe import recipe_from_dict

    return recipe_from_dict({
        "model": {"config": dict(MODEL)}, "data": {"seq_len": SEQ},
        "pipeline": {"schedule": schedule, "num_stages": stages, "num_microbatches": m, "microbatch_size": MBS,
                     "layers_per_stage": LAYERS_PER_STAGE if stages > 1 else None,
                     "extra_warmup": extra_warmup},
        "optimizer": {"name": "adamw", "learning_rate": 1e-3, "fused": FUSED},
        "training": {"max_steps": 1000, "warmup_steps": 0, "report_to": []},
    })


def batches(n: int, m: int):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, MODEL["vocab_size"], (m, MBS, SEQ), generator=g) for _ in range(n)]


def build(r):
    from hf_asyncpp.model.build import build_model

    torch.manual_seed(0)
    return build_model(r.model)


def single_process(steps: int, m: int) -> float:
    from hf_asyncpp.engine import LocalEngine
    from hf_asyncpp.topology import Topology

    torch.set_num_threads(1)
    r = recipe("none", 1, m)
    eng = LocalEngine(r, build(r), Topology(), log=lambda *a: None)
    eng.train_steps(batches(1, m), 0)  # warm-up
    bs = batches(steps, m)
    t0 = time.perf_counter()
    eng.train_steps(bs, 1)
    return steps * m * MBS * SEQ / (time.perf_counter() - t0)


def _ours(rank, world, schedule, steps, m, split=None, extra_warmup=0):
    global LAYERS_PER_STAGE
    LAYERS_PER_STAGE = split
    from hf_asyncpp.topology import Topology
    from hf_asyncpp.pipeline.executor import PipelineEngine

    r = recipe(schedule, world, m, extra_warmup)
    eng = PipelineEngine(r, build(r), Topology(rank=rank, world_size=world, num_stages=world), log=lambda *a: None)
    eng.train_steps(batches(2, m), 0)  # warm-up (fills both 2BW versions)
    bs = batches(steps, m)
    eng.action_seconds.clear()
    eng.action_counts.clear()
    dist.barrier()
    t0 = time.perf_counter()
    eng.train_steps(bs, 2)
    dist.barrier()
    dt = time.perf_counter() - t0
    seconds = {k.value: v for k, v in eng.action_seconds.items()}  # the timed steps only
    counts = {k.value: v for k, v in eng.action_counts.items()}
    eng.track_memory = True  # after timing: count the bytes really held, for the planner comparison
    eng.train_steps(batches(3, m), 2 + steps)
    memory = eng.memory_report()
    eng.close()
    return {"tokens_per_s": steps * m * MBS * SEQ / dt, "peak_versions": eng.versions.peak, "memory": memory,
            "peak_inflight": eng.peak_inflight, "rss_mb": _rss_mb(), "seconds": seconds, "counts": counts, "wall": dt}


def _torch_pipelining(rank, world, schedule, steps, m, split=None, fused=None):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from hf_asyncpp.partition import partition_model

    r = recipe("1f1b", world, m)
    stage_mod = partition_model(build(r), world, split)[rank]
    fused = FUSED if fused is None else fused
    opt = torch.optim.AdamW(stage_mod.parameters(), lr=1e-3, fused=True if fused else None)
    stage = PipelineStage(stage_mod, rank, world, torch.device("cpu"))

    def loss_fn(logits, target):
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1))

    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = cls(stage, n_microbatches=m, loss_fn=loss_fn)

    def one(batch):
        flat = batch.reshape(m * MBS, SEQ)
        if rank == 0:
            sched.step(flat)
        elif rank == world - 1:
            sched.step(target=flat)
        else:
            sched.step()
        opt.step()
        opt.zero_grad()

    one(batches(1, m)[0])
    bs = batches(steps, m)
    dist.barrier()
    t0 = time.perf_counter()
    for b in bs:
        one(b)
    dist.barrier()
    return {"tokens_per_s": steps * m * MBS * SEQ / (time.perf_counter() - t0)}


def stage_alone_step(rank, world, m, split=None):
    """One step of this rank's stage computing alone (``_stages_alone``): m forwards and backwards on local inputs,
    then AdamW. Stage 0 reads ids and its backward takes a random output gradient; a later stage reads random
    hidden states and computes their gradient (as it would to send it back)."""
    from hf_asyncpp.partition import partition_model

    r = recipe("1f1b", world, m)
    stage = partition_model(build(r), world, split)[rank]
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-3, fused=True if FUSED else None)
    g = torch.Generator().manual_seed(rank)
    ids = [torch.randint(0, MODEL["vocab_size"], (MBS, SEQ), generator=g) for _ in range(m)]
    hidden = [torch.randn(MBS, SEQ, MODEL["hidden_size"], generator=g) for _ in range(m)]
    last = rank == world - 1

    def one_step():
        for i in range(m):
            x = ids[i] if rank == 0 else hidden[i].detach().requires_grad_()
            out = stage(x, labels=ids[i]) if last else stage(x)
            if last:
                out.backward()
            else:
                out.backward(hidden[i])  # a stand-in for the next stage's gradient, of the same shape
        opt.step()
        opt.zero_grad()

    return one_step


def _stages_alone(rank, world, seconds, m, split=None):
    """Each rank computes its own stage's steps (``stage_alone_step``), with no transfer and no schedule, for
    ``seconds`` of wall time after a common start, so that every rank computes throughout and the machine is as
    loaded as under a pipeline that never waits. The slowest rank's step rate: the split's balance and two busy
    cores, measured rather than simulated, with no pipeline."""
    one_step = stage_alone_step(rank, world, m, split)
    one_step()  # warm-up
    dist.barrier()
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < seconds:
        one_step()
        n += 1
    dt = time.perf_counter() - t0
    dist.barrier()
    return {"tokens_per_s": n * m * MBS * SEQ / dt, "steps": n, "wall": dt}


def stages_alone(seconds: float, m: int, split=None, world: int = 2) -> tuple[float, list[float]]:
    """(tokens/s of the slowest stage computing alone beside the others (``_stages_alone``), each stage's ms per
    step)."""
    res = spawn(_stages_alone, world, seconds, m, split)
    return min(r["tokens_per_s"] for r in res), [1e3 * r["wall"] / r["steps"] for r in res]


def _rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def spawn(fn, world, *args) -> list[dict]:
    """``fn(rank, world, *args)`` on ``world`` gloo processes, one thread each; every rank's result."""
    return run_workers(fn, world, *args)


TARGETS = {"h128": {"limit": 0.85, "torch_m": None, "torch_mp": 1.15},
           "h256": {"limit": 0.9, "torch_m": 1.2, "torch_mp": 1.4}}
"""Per model: 2bw / no-bubble limit, 2bw / torch Schedule1F1B at m (where m != p) and at m = p."""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="h128", help="h128 (the default) or h256 (the larger model)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds; each row reports its best")
    ap.add_argument("--layers-per-stage", default=None, help="e.g. 6,2 (default: the partitioner's cost model)")
    ap.add_argument("--extra-warmup", type=int, default=1, help="also measure 2bw with this pipeline.extra_warmup (0: skip)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers of the model (default: 8)")
    args = ap.parse_args()
    base = MODELS[args.model]
    use_model(dict(base, num_hidden_layers=args.layers or base["num_hidden_layers"]))
    split = [int(x) for x in args.layers_per_stage.split(",")] if args.layers_per_stage else None
    p, m, n = 2, args.microbatches, args.steps
    # Every row is measured once per round and rounds are interleaved, so slow phases of this shared machine hit
    # all rows alike; a row reports its best round (as timeit does), ratios are between best rounds.
    best: dict[tuple, dict] = {}
    spread: dict[tuple, list[float]] = {}

    def keep(key, tps, res=None):
        spread.setdefault(key, []).append(tps)
        if key not in best or tps > best[key]["tps"]:
            best[key] = {"tps": tps, "res": res}

    extra = args.extra_warmup if m >= p + args.extra_warmup else 0
    for rnd in range(args.repeats):
        print(f"round {rnd + 1}/{args.repeats}", flush=True)
        keep(("single", m), single_process(n, m))
        for sched in ("gpipe", "1f1b", "2bw"):
            res = spawn(_ours, p, sched, n, m, split)
            keep(("ours", sched, m), res[0]["tokens_per_s"], res)
        if extra:
            res = spawn(_ours, p, "2bw", n, m, split, extra)
            keep(("ours", "2bw+", m), res[0]["tokens_per_s"], res)
        for sched in ("gpipe", "1f1b"):
            for mm in sorted({m, p}):
                keep(("torch", sched, mm), spawn(_torch_pipelining, p, sched, n, mm, split)[0]["tokens_per_s"])
        if m != p:
            keep(("ours", "2bw", p), spawn(_ours, p, "2bw", n, p, split)[0]["tokens_per_s"])
    names = {"single": "1 process, 1 thread, no pipeline", "ours": "hf_asyncpp {}", "torch": "torch.distributed.pipelining {}"}
    rows = []
    for key, v in best.items():
        if key[0] == "torch":
            name = names["torch"].format("ScheduleGPipe" if key[1] == "gpipe" else "Schedule1F1B")
        elif key[0] == "ours":
            label = f"2bw, extra_warmup {extra}" if key[1] == "2bw+" else key[1]
            name = names["ours"].format(label + (" (m = p)" if key[1] == "2bw" and key[2] != m else ""))
        else:
            name = names["single"]
        rows.append((name, key[-1], v["tps"], min(spread[key]), max(spread[key])))
    single = best[("single", m)]["tps"]
    ours = {sched: best[("ours", sched, m)]["res"] for sched in ("gpipe", "1f1b", "2bw", "2bw+") if ("ours", sched, m) in best}
    torch_rows = {(k[1], k[2]): v["tps"] for k, v in best.items() if k[0] == "torch"}
    ours_mp = best[("ours", "2bw", p)]["tps"]

    from hf_asyncpp.plan.memory import plan_memory
    from hf_asyncpp.plan.vocab import resolve_vocab_parallel

    r = recipe("2bw", p, m)
    _, plan, _ = plan_memory(r, vocab_parallel=resolve_vocab_parallel(r)[0])
    limit = 2 * single
    t1 = best[("ours", "1f1b", m)]["tps"]
    goal = TARGETS[args.model]
    targets = []
    for key, label in ((("ours", "2bw", m), "2bw"), (("ours", "2bw+", m), f"2bw with extra_warmup {extra}")):
        if key in best:
            t2 = best[key]["tps"]
            targets += [f"- {label} / limit = {t2 / limit:.2f} (target >= {goal['limit']}); / our 1f1b = {t2 / t1:.2f} "
                        f"(target >= 0.95 x (m+p-1)/m = {0.95 * (m + p - 1) / m:.2f})"]
    if goal["torch_m"] and m != p:
        targets.append(f"- 2bw / torch Schedule1F1B at m = {m}: {best[('ours', '2bw', m)]['tps'] / torch_rows[('1f1b', m)]:.2f} "
                       f"(target >= {goal['torch_m']})")
    lines = [
        f"| run | microbatches | tokens/s (best of {args.repeats}) | range over rounds | / no-bubble limit |",
        "|---|---|---|---|---|",
        *[f"| {name} | {mm} | {tps:,.0f} | {lo:,.0f}-{hi:,.0f} | {tps / limit:.2f} |" for name, mm, tps, lo, hi in rows],
        "",
        f"- no-bubble limit = 2 x one-process tokens/s = {limit:,.0f} tokens/s",
        *targets,
        f"- 2bw / torch Schedule1F1B at m = p = {p}: {ours_mp / torch_rows[('1f1b', p)]:.2f} (target >= {goal['torch_mp']})",
        f"- our 1f1b / torch Schedule1F1B at m = {m}: {t1 / torch_rows[('1f1b', m)]:.2f} (the executors at the same bubble)",
        "",
        "Per-stage memory of 2bw: measured (the executor's weight versions, gradients, optimizer state, EF buffer and "
        "saved activations at their peak) against the planner's formula (`hf_asyncpp/plan/memory.py`):",
        "",
        "| stage | weight versions | in-flight microbatches | measured MB | planned MB | planned / measured | process RSS MB |",
        "|---|---|---|---|---|---|---|",
        *[f"| {s} | {r['peak_versions']} | {r['peak_inflight']} | {r['memory']['total'] / 1e6:.1f} | {plan[s].total / 1e6:.1f} | "
          f"{plan[s].total / r['memory']['total']:.2f} | {r['rss_mb']:.0f} |" for s, r in enumerate(ours["2bw"])],
        "",
    ]
    for sched, res in ours.items():
        sched = f"2bw extra_warmup {extra}" if sched == "2bw+" else sched
        for s, r in enumerate(res):
            sec = r["seconds"]
            busy, wait = (share * sum(sec.values()) for share in stage_shares(sec))
            lines.append(f"- {sched} stage {s}: compute {busy:.2f}s (F {sec.get('F', 0):.2f}, B {sec.get('B', 0):.2f}, "
                         f"step {sec.get('STEP', 0):.2f}), waiting on receives {wait:.2f}s, of {r['wall']:.2f}s wall")
    lines += ["", *_simulated(ours, n, m, p, extra, args.write, args.model)]
    table = "\n".join(lines)
    print(table)
    if args.write:
        _write(table, n, m, args)


def _simulated(ours: dict, n: int, m: int, p: int, extra: int, draw: bool, model: str = "h128") -> list[str]:
    """The simulator fed with each run's measured mean F/B times per stage (STEP from 2bw, whose steps never wait
    for a reduction): its predicted tokens/s next to the measured one, and the timelines as PNGs."""
    from hf_asyncpp.schedules.records import schedule_actions
    from hf_asyncpp.schedules.simulator import Costs, simulate
    from hf_asyncpp.schedules.timeline import plot_timeline

    step_cost = Costs.from_measured([r["seconds"] for r in ours["2bw"]], [r["counts"] for r in ours["2bw"]]).step
    out = ["Simulated from the measured per-stage forward/backward means (the simulator's prediction of the same run):",
           "", "| schedule | measured tokens/s | simulated tokens/s | simulated bubble | timeline |", "|---|---|---|---|---|"]
    for key, res in ours.items():
        sched, ew = ("2bw", extra) if key == "2bw+" else (key, 0)
        c = Costs.from_measured([r["seconds"] for r in res], [r["counts"] for r in res])
        costs = Costs(forward=c.forward, backward=c.backward, step=step_cost)
        sim = simulate(schedule_actions(sched, p, m, n, first_step=2, extra_warmup=ew), costs, sched)
        tps = n * m * MBS * SEQ / sim.makespan
        name = (f"measured-{'' if model == 'h128' else model + '-'}{MODEL['num_hidden_layers']}layers-{sched}"
                f"{'-extra' + str(ew) if ew else ''}")
        if draw:
            short = simulate(schedule_actions(sched, p, m, 3, first_step=2, extra_warmup=ew), costs, sched)
            plot_timeline(short, str(ROOT / "docs" / "schedules" / f"{name}.png"),
                          f"{sched}{f' extra_warmup {ew}' if ew else ''}: p={p}, m={m}, measured costs (3 steps)")
        out.append(f"| {sched}{f' extra_warmup {ew}' if ew else ''} | {res[0]['tokens_per_s']:,.0f} | {tps:,.0f} | "
                   f"{sim.bubble:.2f} | ![{name}](../schedules/{name}.png) |")
    return out


def _write(table: str, n: int, m: int, args) -> None:
    from .report import write_section

    layers = MODEL["num_hidden_layers"]
    h256 = args.model == "h256"
    key = f"throughput-{'h256-' if h256 else ''}{layers}"
    shape = (f"Llama h256 x {layers} layers, vocab 4096 untied" if h256 else f"Llama h128 x {layers} layers, vocab 4096")
    split = f" --layers-per-stage {args.layers_per_stage}" if args.layers_per_stage else ""
    write_section(key, f"## Pipeline throughput (2 processes x 1 thread, CPU, {'h256, ' if h256 else ''}{layers} layers)\n\n"
                  f"Command: `python -m bench.throughput{' --model h256' if h256 else ''} --steps {n} --microbatches {m} "
                  f"--layers {layers}{split} --repeats {args.repeats}"
                  f"{' --extra-warmup ' + str(args.extra_warmup) if args.extra_warmup != 1 else ''} --write` "
                  f"({shape}, seq {SEQ}, microbatch {MBS}, AdamW{' (fused)' if FUSED else ''}; "
                  f"{time.strftime('%Y-%m-%d')})\n\n{table}")


if __name__ == "__main__":
    main()
