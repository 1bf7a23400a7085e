"""2BW through the command a user types (``hf-asyncpp train``, real data: the default corpus, its tokenizer, the
prefetching data path, metrics, the progress line) against torch.distributed.pipelining's Schedule1F1B and the
no-bubble limit, on the h256 shapes (``bench.throughput.H256``): Llama h256 x 8 layers, vocabulary 4,096, untied,
AdamW, 4 microbatches of 4 x 128 tokens per step, split 5/3, 2 processes x 1 thread (gloo).

    python -m bench.cli_throughput [--steps 40] [--rounds 3] [--fused] [--only "cli 2bw,in-process 2bw"] [--write]

``--fused``: every arm, ours and torch's, steps AdamW with torch's fused kernel (``optimizer.fused: true``,
``torch.optim.AdamW(fused=True)``) instead of torch's per-tensor loop; written to its own section.

Arms, each once per round with the order rotated every round, best round reported:

- ``cli 2bw`` / ``cli 1f1b``: ``hf-asyncpp train`` on 2 stages; tokens/s in the steady state, between the step
  records a third into the run and the last but one (``read_rate``: the pipeline filled, the data worker running,
  as the in-process arms time their steps after a warm-up); the run's own ``pipeline_profile.json`` gives the
  per-action seconds (whole run).
- ``cli 2bw recv-block``: the same with each rank sleeping in its waits instead of polling
  (``pipeline.recv_wait: block``): what polling is worth.
- ``cli single``: the same command with ``--pipeline.schedule=none`` on one process and one thread.
- ``torch 1f1b``: torch's ``PipelineStage`` + ``Schedule1F1B`` on our partitioner's stages (random ids in the
  process: torch has no data path of its own), AdamW after each schedule step (``bench.throughput``'s worker).
  With ``--fused``, also ``torch 1f1b per-tensor AdamW``: torch as its users write it by default.
- ``in-process single``: the engine with no pipeline on random ids (``bench.throughput``).
- ``in-process 2bw``: the same executor as ``cli 2bw`` on random ids, without the command's launcher, data path and
  outputs (``bench.throughput``): what the command line costs on top of the schedule.
- ``2 x cli single side by side``: two one-process runs at once: what this machine gives two processes that never
  wait for each other.
- ``stages alone``: each of the two processes computes its own stage's steps (m forwards and
  backwards, AdamW) on local inputs, with no transfer and no schedule, both at once for the same wall time
  (``bench.throughput``'s ``_stages_alone``; ``bench.stage_ceiling`` measures the same interleaved window by window); the slower stage's rate: the split's balance and two busy cores,
  measured rather than simulated, the pipeline left out. Each pipeline against it is what its schedule and
  transport cost (2BW can beat it a little: its lighter stage waits part of each step, which leaves the busier one
  a less loaded machine).

The no-bubble limit is twice the faster of the two single-process rates. Then the attribution:
per-action costs (ms per forward, backward, step, receive wait) of 2BW against our 1F1B and against one process,
all from the same machine in the same run.

Last, the schedules' own ceilings (``ceilings``): the simulator fed each 2BW arm's measured per-stage forward,
backward and step costs, with nothing else (no transfer, no wait, no contention), runs 2BW and 1F1B on them. At
equal per-action costs that is the most 2BW can be against any 1F1B, and against the limit, at this split; the same
at every other whole-layer split, from per-layer costs read off the same run. A measured ratio is then read
against what the schedule allows, and a target above the ceiling says so.

``--write`` replaces the ``cli-throughput`` (or ``cli-throughput-fused``) section of docs/benchmarks/speed.md.
``--only`` (comma-separated arm names) runs those arms and prints their medians, without the tables.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hf_asyncpp.schedules.records import schedule_actions
from hf_asyncpp.schedules.simulator import Costs, simulate

from . import throughput as tp

ROOT = tp.ROOT
MODEL, SPLIT = tp.H256, tp.H256_SPLIT
M = 4


def cli_args(schedule: str, steps: int, out: Path) -> list[str]:
    """``hf-asyncpp train`` on the default recipe's data and tokenizer with the benchmark's model and shapes."""
    model = {k: v for k, v in MODEL.items() if k != "vocab_size"}
    pipe = (["--pipeline.schedule=none", "--pipeline.num_stages=1", "--training.torch_threads=1"] if schedule == "single"
            else [f"--pipeline.schedule={schedule}", "--pipeline.num_stages=2", f"--pipeline.layers_per_stage={SPLIT}"])
    return [sys.executable, "-m", "hf_asyncpp", "train", str(ROOT / "recipes/cpu-tiny.yaml"),
            "--model.config=" + json.dumps(model), f"--model.vocab_size={MODEL['vocab_size']}",
            f"--data.seq_len={tp.SEQ}", f"--pipeline.num_microbatches={M}", f"--pipeline.microbatch_size={tp.MBS}",
            "--optimizer.name=adamw", "--optimizer.learning_rate=1e-3", "--optimizer.delay_correction=none",
            f"--training.max_steps={steps}", f"--training.logging_steps={max(1, steps // 10)}",
            "--training.eval_steps=0", "--training.save_steps=0", "--training.export=false", "--data.eval_blocks=8",
            "--training.report_to=none", f"--training.output_dir={out}", f"--optimizer.fused={str(tp.FUSED).lower()}",
            *pipe]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_EVALUATE_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def run_cli(schedule: str, steps: int, out: Path, extra: list[str] = ()) -> tuple[float, list | None]:
    """(median tokens/s past the first third, the run's pipeline_profile.json)."""
    r = subprocess.run(cli_args(schedule, steps, out) + list(extra), cwd=ROOT, env=ENV, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"cli {schedule} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return read_rate(out)


def read_rate(out: Path) -> tuple[float, dict | None]:
    """(tokens/s in the steady state, the run's pipeline_profile.json): tokens over training seconds between the
    step record a third into the run and the last but one, so that neither the start (process groups, the first
    forward, the pipeline filling) nor the end (the last records arrive together at the final drain) counts;
    metrics.jsonl's own ``tokens_per_s`` is cumulative from step 1, start included."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train_s" in r and "num_input_tokens_seen" in r][:-1]
    a, b = rows[len(rows) // 3], rows[-1]
    prof = out / "pipeline_profile.json"
    return ((b["num_input_tokens_seen"] - a["num_input_tokens_seen"]) / (b["train_s"] - a["train_s"]),
            json.loads(prof.read_text()) if prof.exists() else None)


def side_by_side(steps: int, tmp: Path) -> float:
    """Two one-process, one-thread runs at once: the sum of their rates is what this machine gives two processes
    that never wait for each other (the no-bubble limit assumes twice one process's rate)."""
    outs = [tmp / f"pair{i}" for i in range(2)]
    procs = [subprocess.Popen(cli_args("single", steps, o), cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for o in outs]
    for pr in procs:
        if pr.wait() != 0:
            raise RuntimeError(f"side-by-side run failed:\n{pr.stderr.read()[-3000:]}")
    return sum(read_rate(o)[0] for o in outs)


def in_process_2bw(steps: int) -> tuple[float, dict]:
    """(tokens/s, its per-stage action seconds and counts in pipeline_profile.json's layout)."""
    res = tp.spawn(tp._ours, 2, "2bw", steps, M, SPLIT)
    return res[0]["tokens_per_s"], {"stages": [{"stage": s, "seconds": r["seconds"], "counts": r["counts"]}
                                              for s, r in enumerate(res)]}


def arms(steps: int, inproc_steps: int, tmp: Path) -> dict[str, callable]:
    def cli(schedule, *extra):
        def run(rnd):
            return run_cli(schedule, steps, tmp / f"{schedule}{len(extra)}-{rnd}", extra)
        return run

    out = {
        "cli 2bw": cli("2bw"),
        "cli 2bw recv-block": cli("2bw", "--pipeline.recv_wait=block"),
        "cli 1f1b": cli("1f1b"),
        "cli single": cli("single"),
        "torch 1f1b": lambda rnd: (tp.spawn(tp._torch_pipelining, 2, "1f1b", inproc_steps, M, SPLIT)[0]["tokens_per_s"], None),
        "in-process single": lambda rnd: (tp.single_process(inproc_steps, M), None),
        "in-process 2bw": lambda rnd: in_process_2bw(inproc_steps),
        "2 x cli single side by side": lambda rnd: (side_by_side(steps, tmp / f"side-{rnd}"), None),
        # a 2BW step of the timed ones takes about 0.6 s here: the window is about as long as in-process 2bw's
        "stages alone": lambda rnd: tp.stages_alone(0.6 * inproc_steps, M, SPLIT),
    }
    if tp.FUSED:  # torch as a torch.pipelining user writes it by default, beside the fused comparison
        out["torch 1f1b per-tensor AdamW"] = lambda rnd: (
            tp.spawn(tp._torch_pipelining, 2, "1f1b", inproc_steps, M, SPLIT, False)[0]["tokens_per_s"], None)
    return out


def per_action(profile: dict) -> dict[int, dict[str, float]]:
    """Stage -> ms per action kind (receive waits per step), from a pipeline_profile.json."""
    out = {}
    for st in profile["stages"]:
        sec, cnt = st["seconds"], st["counts"]
        steps = cnt.get("STEP", 1)
        out[st["stage"]] = {
            "F": 1e3 * sec.get("F", 0) / max(cnt.get("F", 1), 1), "B": 1e3 * sec.get("B", 0) / max(cnt.get("B", 1), 1),
            "STEP": 1e3 * sec.get("STEP", 0) / steps,
            "wait": 1e3 * (sec.get("RECV_ACT", 0) + sec.get("RECV_GRAD", 0)) / steps,
            "send": 1e3 * (sec.get("SEND_ACT", 0) + sec.get("SEND_GRAD", 0)) / steps,
            "other": 1e3 * sum(v for k, v in sec.items() if k in ("REDUCE",)) / steps,
            "busy": sum(sec.get(k, 0) for k in ("F", "B", "STEP", "REDUCE")) / max(sum(sec.values()), 1e-9),
        }
    return out


def _step_ms(schedule: str, forward, backward, step) -> float:
    """The simulator's steady-state step of ``schedule`` on 2 stages at these per-stage costs (ms): the makespan of
    20 steps less that of 10, over 10, so the pipeline's fill and drain do not count."""
    costs = Costs(forward=forward, backward=backward, step=step)
    span = lambda n: simulate(schedule_actions(schedule, 2, M, n), costs, schedule).makespan  # noqa: E731
    return (span(20) - span(10)) / 10


def ceilings(actions: dict[int, dict[str, float]]) -> dict[str, tuple[float, float]]:
    """Split -> (2bw / 1f1b, 2bw / limit) as the schedules allow at these per-action costs (``per_action`` of a 2BW
    run): both schedules on the same costs, the limit one process computing every stage's forward, backward and
    step back to back at those costs. The run's own split is exact; the other whole-layer splits move layers at
    stage 0's mean cost per layer (its embedding, about 1% of it, counted as layer time), the last stage's head
    and loss being what its layers leave of its cost."""
    F = [actions[s]["F"] for s in (0, 1)]
    B = [actions[s]["B"] for s in (0, 1)]
    S = [actions[s]["STEP"] for s in (0, 1)]
    k0, layers = SPLIT[0], sum(SPLIT)
    per = [x[0] / k0 for x in (F, B, S)]  # one layer's F, B, STEP
    head = [x[1] - SPLIT[1] * q for x, q in zip((F, B, S), per)]
    out = {}
    for k in range(max(1, k0 - 2), min(layers, k0 + 2)):
        f, b, st = ([k * q, (layers - k) * q + h] for q, h in zip(per, head))
        if k == k0:
            f, b, st = F, B, S
        one = M * (sum(f) + sum(b)) + sum(st)  # ms per step, one process at the stages' costs
        two = _step_ms("2bw", f, b, st)
        out[f"{k}/{layers - k}"] = (_step_ms("1f1b", f, b, st) / two, one / (2 * two))
    return out


def per_round(seen: dict) -> dict[str, list[float]]:
    """Per round: cli 2bw / torch 1f1b, cli 2bw / twice the faster single process of that round, and cli 2bw / the
    two single processes run side by side in that round (what this machine gave two processes that never wait), and
    cli 2bw / in-process 2bw (what the command line costs on top of the executor), and each pipeline against the
    stages computing alone side by side (the split's balance and two busy cores, no pipeline)."""
    two, tt, alone = seen["cli 2bw"], seen["torch 1f1b"], seen["stages alone"]
    singles = [max(a, b) for a, b in zip(seen["cli single"], seen["in-process single"])]
    return {"2bw / torch": [a / b for a, b in zip(two, tt)],
            "2bw / limit": [a / (2 * s) for a, s in zip(two, singles)],
            "2bw / side by side": [a / b for a, b in zip(two, seen["2 x cli single side by side"])],
            "side by side / limit": [b / (2 * s) for b, s in zip(seen["2 x cli single side by side"], singles)],
            "cli 2bw / in-process 2bw": [a / b for a, b in zip(two, seen["in-process 2bw"])],
            "in-process 2bw / torch": [a / b for a, b in zip(seen["in-process 2bw"], tt)],
            "cli 2bw / cli 2bw recv-block": [a / b for a, b in zip(two, seen["cli 2bw recv-block"])],
            "stages alone / limit": [a / (2 * s) for a, s in zip(alone, singles)],
            "cli 2bw / stages alone": [a / b for a, b in zip(two, alone)],
            "in-process 2bw / stages alone": [a / b for a, b in zip(seen["in-process 2bw"], alone)],
            "torch 1f1b / stages alone": [a / b for a, b in zip(tt, alone)]}


def tables(best: dict, seen: dict, args) -> str:
    limit_single = max(best["cli single"][0], best["in-process single"][0])
    limit = 2 * limit_single
    pair = best["2 x cli single side by side"][0]
    lines = [f"| run | tokens/s (best of {args.rounds}) | range over rounds | / no-bubble limit |", "|---|---|---|---|"]
    for key, (tps, _) in best.items():
        lines.append(f"| {key} | {tps:,.0f} | {min(seen[key]):,.0f}-{max(seen[key]):,.0f} | {tps / limit:.2f} |")
    t2, t1, tt = best["cli 2bw"][0], best["cli 1f1b"][0], best["torch 1f1b"][0]
    alone, alone_ms = best["stages alone"]
    bubble = 1 / M  # (p-1)/m of 1F1B's step at p = 2: removing it gives (m+p-1)/m
    lines += ["", f"- no-bubble limit = 2 x the faster single process ({limit_single:,.0f} tokens/s) = {limit:,.0f} tokens/s",
              f"- cli 2bw / torch Schedule1F1B = {t2 / tt:.2f} (target >= 1.2; removing 1F1B's bubble alone gives "
              f"{1 + bubble:.2f} with equal stages)",
              f"- cli 2bw / no-bubble limit = {t2 / limit:.2f} (target >= 0.9)",
              "- the same two ratios round by round (each arm's rate against the others' in its own round: a slow phase "
              "of the machine hits the arms of one round alike), median and range: "
              + "; ".join(f"{name} {statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})" for name, r in per_round(seen).items()),
              *([f"- cli 2bw / torch Schedule1F1B with torch's default per-tensor AdamW = "
                 f"{t2 / best['torch 1f1b per-tensor AdamW'][0]:.2f}"] if "torch 1f1b per-tensor AdamW" in best else []),
              f"- two single processes side by side reach {pair / limit:.2f} of the limit (this machine with both cores "
              f"busy); cli 2bw / that = {t2 / pair:.2f}",
              f"- cli 2bw with recv_wait block (each rank sleeps in its waits) / no-bubble limit = "
              f"{best['cli 2bw recv-block'][0] / limit:.2f}; cli 2bw (polling) / that = "
              f"{t2 / best['cli 2bw recv-block'][0]:.2f}",
              f"- cli 2bw / cli 1f1b = {t2 / t1:.2f}; cli 1f1b / torch Schedule1F1B = {t1 / tt:.2f}",
              f"- the stages computing alone side by side (each its own forwards, backwards and AdamW on local inputs, "
              f"no transfer, no schedule; the slower stage's rate) reach {alone / limit:.2f} of the limit: the split's "
              f"balance and two busy cores, the pipeline left out (stage 0 / stage 1 ms per step in that round: "
              f"{' / '.join(f'{x:.0f}' for x in alone_ms)}); cli 2bw / that = {t2 / alone:.2f}; in-process 2bw / "
              f"that = {best['in-process 2bw'][0] / alone:.2f}; torch Schedule1F1B / that = {tt / alone:.2f}"]
    p2, p1 = best["cli 2bw"][1], best["cli 1f1b"][1]
    if p2 and p1:
        a2, a1 = per_action(p2), per_action(p1)
        lines += ["", "Per-action cost (ms; F and B per microbatch, the rest per step; the best round's own "
                  "pipeline_profile.json, whole run; `2bw, in process`: the in-process arm's best round, timed steps):", "",
                  "| stage | schedule | F | B | STEP | waiting on receives | sends | busy |", "|---|---|---|---|---|---|---|---|"]
        inproc = best.get("in-process 2bw", (0, None))[1]
        a0 = per_action(inproc) if inproc else {}  # the executor alone, its timed steps: the command line's cost by action
        for s in sorted(a2):
            rows = [("2bw", a2[s]), ("1f1b", a1[s])] + ([("2bw, in process", a0[s])] if s in a0 else [])
            for name, a in rows:
                lines.append(f"| {s} | {name} | {a['F']:.1f} | {a['B']:.1f} | {a['STEP']:.1f} | {a['wait']:.1f} | "
                             f"{a['send']:.1f} | {a['busy']:.0%} |")
        fb = lambda a: sum(M * (x["F"] + x["B"]) for x in a.values())  # noqa: E731
        one = M * tp.MBS * tp.SEQ / limit_single * 1e3  # ms per step of one process: forward, backward, step
        step2 = max(M * (x["F"] + x["B"]) + x["STEP"] for x in a2.values())
        lines += ["", f"- forward + backward per step, both stages: 2bw {fb(a2):.0f} ms, 1f1b {fb(a1):.0f} ms "
                  f"(2bw / 1f1b = {fb(a2) / fb(a1):.3f}: a microbatch's cost with no stage idle against with the bubble)",
                  f"- one process computes a step (forward, backward, optimizer step) in {one:.0f} ms; the two 2bw stages "
                  f"together {fb(a2) + sum(x['STEP'] for x in a2.values()):.0f} ms "
                  f"({(fb(a2) + sum(x['STEP'] for x in a2.values())) / one:.2f}x: the pipeline's own cost per step)",
                  f"- the busiest 2bw stage computes {step2:.0f} ms per step; both stages {fb(a2) + sum(x['STEP'] for x in a2.values()):.0f} ms: "
                  f"balance bound {(fb(a2) + sum(x['STEP'] for x in a2.values())) / (2 * step2):.2f} of the limit at these costs"]
    lines += ["", "The schedules' own ceilings (`ceilings`: the simulator on each 2BW arm's measured per-stage F, B and STEP, "
              "nothing else; other splits estimated from its per-layer costs), against the targets:", "",
              "| costs of | split | 2bw / 1f1b ceiling (target 1.2) | 2bw / limit ceiling (target 0.9) |", "|---|---|---|---|"]
    for arm in ("cli 2bw", "in-process 2bw"):
        if best.get(arm, (0, None))[1]:
            for split, (vs_1f1b, vs_limit) in ceilings(per_action(best[arm][1])).items():
                own = " (the run's)" if split == f"{SPLIT[0]}/{SPLIT[1]}" else ""
                lines.append(f"| {arm} | {split}{own} | {vs_1f1b:.3f} | {vs_limit:.3f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40, help="steps per command-line run (the rate is read past its first third)")
    ap.add_argument("--inproc-steps", type=int, default=8, help="timed steps per in-process arm")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default=None, help="comma-separated arm names (default: all)")
    ap.add_argument("--fused", action="store_true", help="AdamW's fused kernel on every arm (its own section)")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    tp.use_model(MODEL)  # every in-process arm and every worker they spawn
    if args.fused:
        tp.use_fused()
    best: dict[str, tuple[float, object]] = {}
    seen: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as d:
        todo = arms(args.steps, args.inproc_steps, Path(d))
        if args.only:
            names = [name.strip() for name in args.only.split(",")]
            if unknown := [name for name in names if name not in todo]:
                raise SystemExit(f"--only: no arm {unknown[0]!r}; the arms: {', '.join(map(repr, todo))}")
            todo = {name: todo[name] for name in names}
        keys = list(todo)
        for rnd in range(args.rounds):
            order = keys[rnd % len(keys):] + keys[: rnd % len(keys)]
            print(f"round {rnd + 1}/{args.rounds}: {', '.join(order)}", flush=True)
            for key in order:
                tps, prof = todo[key](rnd)
                print(f"  {key}: {tps:,.0f} tokens/s", flush=True)
                seen.setdefault(key, []).append(tps)
                if key not in best or tps > best[key][0]:
                    best[key] = (tps, prof)
    if args.only:  # the arms' medians over the rounds (an A/B without the tables)
        for key, rates in seen.items():
            print(f"{key}: median {statistics.median(rates):,.0f} tokens/s over {len(rates)} rounds "
                  f"({min(rates):,.0f}-{max(rates):,.0f})")
        return
    text = tables(best, seen, args)
    print(text)
    if args.write:
        from .report import write_section

        kernel = ", AdamW's fused kernel on every arm" if args.fused else ""
        write_section("cli-throughput-fused" if args.fused else "cli-throughput",
                      f"## 2BW through `hf-asyncpp train` against torch's Schedule1F1B{kernel}\n\n"
                      f"Command: `python -m bench.cli_throughput --steps {args.steps} --rounds {args.rounds}"
                      f"{' --fused' if args.fused else ''}"
                      f"{f' --inproc-steps {args.inproc_steps}' if args.inproc_steps != 8 else ''} --write` "
                      f"({time.strftime('%Y-%m-%d')}; Llama h256 x 8 layers, vocab 4096 untied, AdamW"
                      f"{' (fused)' if args.fused else ''}, {M} microbatches "
                      f"of {tp.MBS} x {tp.SEQ} tokens, split {SPLIT[0]}/{SPLIT[1]}, 2 processes x 1 thread, gloo; the "
                      "command-line arms read the default corpus with its 4,096-token tokenizer)\n\n" + text)


if __name__ == "__main__":
    main()
