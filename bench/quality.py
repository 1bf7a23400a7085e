"""The paper's table at our scale, with error bars: final eval loss of {AdamW, Muon} x {sync, delay 1, delay 1 + EF}
over several seeds, the EF lambda sweep (0.5, 1, 1.5) and ``ef_lambda: auto``, Muon under PipeDream's variable delay
at 4 and 8 stages (tied model, the tied head at lag 0 as in the executor), and NAdam (effective beta1 0.99) sync and
delayed. All arms are single-process exact delay references (``optimizer.simulate_delay``, equal step for step to
the pipeline executor, tests/test_runtime.py) with the same model, data order and hyperparameters per optimizer.

    python -m bench.quality [--steps 300] [--seeds 0,1,2] [--parallel 2] [--out DIR] [--write]
    python -m bench.quality --long [--steps 1000] [--seeds 0] [--parallel 2] [--out DIR] [--write]

Each arm is a real run of scripts/pretrain.py (1 thread); ``--parallel`` arms run at once (losses do not depend on
machine load). The learning rate of each optimizer is its sync arm's (``--adamw-lr``, ``--muon-lr``, ``--nadam-lr``;
``--sweep`` tunes them on the sync arms first) and is used unchanged for that optimizer's other arms. A finished arm
(its directory holds final_eval.json) is reused; an arm killed midway (a session's end) resumes from its last
checkpoint, one per evaluation, exactly. ``--report-only`` runs nothing and reports the finished arms, naming the
missing ones. ``--long``: the six AdamW/Muon sync / delay-1 / delay-1 + EF arms
only, in ``OUT/long<steps>``, reported in the ``quality-long`` section. Writes a loss-curve PNG and (``--write``)
the ``quality`` (or ``quality-long``) section of docs/benchmarks/quality.md, its PNG beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from hf_asyncpp.figures import pyplot

ROOT = Path(__file__).resolve().parent.parent
MODEL = ("--model.config={model_type: llama, hidden_size: 128, intermediate_size: 384, num_hidden_layers: 8, "
         "num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 256, tie_word_embeddings: true}")
# a delayed arm's directory carries the reference's version: runs of the old simulate_delay '1' (one update behind)
# and of the old tied PipeDream (head p-1 stale) must never be reused; sync arms are unaffected and keep their names
DELAYED_TAG = "-ref2"
# arXiv 2606.30634, 360M model, validation loss (docs: /work/shared/reference/paper-notes.md)
PAPER = {"muon": (2.578, 2.590, 2.583), "adamw": (2.612, 2.890, 2.640)}
LONG_ARMS = ("adamw sync", "adamw delay-1", "adamw delay-1 + EF", "muon sync", "muon delay-1", "muon delay-1 + EF")


def arms(adamw_lr: float, muon_lr: float, nadam_lr: float | None = None) -> dict[str, list[str]]:
    a = ["--optimizer.name=adamw", f"--optimizer.learning_rate={adamw_lr}"]
    # Muon's AdamW side (embeddings, norms) shares Muon's lr: with match_rms_adamw scaling one lr serves both
    m = ["--optimizer.name=muon", f"--optimizer.learning_rate={muon_lr}", f"--optimizer.adamw_lr={muon_lr}"]
    # NAdam with the constant momentum 0.99 of Ajanthan et al. (optimizer.nadam_momentum_decay's default)
    n = ["--optimizer.name=nadam", f"--optimizer.learning_rate={nadam_lr or adamw_lr}"]
    d1, ef = ["--optimizer.simulate_delay=1"], ["--optimizer.delay_correction=error_feedback"]

    def pd(p):  # PipeDream: one update per microbatch, so the microbatch is the whole step's batch (same tokens per update)
        return ["--optimizer.simulate_delay=pipedream", f"--pipeline.num_stages={p}", "--pipeline.num_microbatches=1",
                "--pipeline.microbatch_size=32"]

    out = {}
    for opt, base in (("adamw", a), ("muon", m)):
        out |= {f"{opt} sync": base, f"{opt} delay-1": base + d1, f"{opt} delay-1 + EF": base + d1 + ef,
                f"{opt} delay-1 + EF lambda=0.5": base + d1 + ef + ["--optimizer.ef_lambda=0.5"],
                f"{opt} delay-1 + EF lambda=1.5": base + d1 + ef + ["--optimizer.ef_lambda=1.5"],
                f"{opt} delay-1 + EF auto": base + d1 + ef + ["--optimizer.ef_lambda=auto"]}
    out |= {"muon pipedream p=4": m + pd(4), "muon pipedream p=8": m + pd(8), "nadam sync": n, "nadam delay-1": n + d1}
    return out


def arm_dir(name: str, overrides: list[str], seed: int, out_root: Path) -> Path:
    lr = next(o.split("=", 1)[1] for o in overrides if o.startswith("--optimizer.learning_rate="))
    delayed = any(o.startswith("--optimizer.simulate_delay=") for o in overrides)
    # the directory names the arm, its lr and seed: a finished arm is reused by the sweep and by later runs
    return out_root / (f"{name.replace(' ', '_').replace('+', 'plus').replace('=', '')}-lr{float(lr):g}-seed{seed}"
                       + (DELAYED_TAG if delayed else ""))


def run_arm(name: str, overrides: list[str], steps: int, seed: int, out_root: Path, report_only: bool = False) -> dict | None:
    """Run one arm (or reuse it if finished; resume it if killed) and read its eval curve. ``report_only``: None for
    an arm that has not finished, nothing is run."""
    out = arm_dir(name, overrides, seed, out_root)
    final = out / "final_eval.json"
    if report_only and not final.exists():
        return None
    if final.exists():
        done = yaml.safe_load((out / "recipe.yaml").read_text())["training"]["max_steps"]
        if done != steps:
            raise RuntimeError(f"{out} holds a finished run of {done} steps, not {steps}: use another --out")
    else:
        launch(name, seed, out, [MODEL, "--pipeline.schedule=none", "--pipeline.num_stages=1",
                                 "--pipeline.num_microbatches=4", "--pipeline.microbatch_size=8",
                                 f"--training.max_steps={steps}", f"--training.seed={seed}",
                                 f"--training.eval_steps={50 if steps <= 300 else 100}",
                                 f"--training.save_steps={50 if steps <= 300 else 100}", "--data.eval_blocks=128",
                                 "--optimizer.delay_correction=none", *overrides])
    return read_run(name, seed, out)


def launch(name: str, seed: int, out: Path, args: list[str]) -> None:
    """Run scripts/pretrain.py on cpu-tiny with ``args`` (1 thread) into ``out``, resuming a killed run: a checkpoint
    every eval and resume from the latest, so an arm killed with its session goes on where it stopped (a resumed
    run equals an uninterrupted one, test_trainer.py); one killed before its first checkpoint starts over."""
    cmd = [sys.executable, str(ROOT / "scripts/pretrain.py"), str(ROOT / "recipes/cpu-tiny.yaml"),
           f"--training.output_dir={out}", "--training.overwrite_output_dir=true", "--training.save_total_limit=1",
           "--training.resume_from_checkpoint=latest", "--training.torch_threads=1", "--training.report_to=none", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_EVALUATE_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    t0 = time.time()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"arm {name} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    print(f"  {name} (seed {seed}) done in {time.time() - t0:.0f}s", flush=True)


def read_run(name: str, seed: int, out: Path) -> dict:
    """A finished run's eval curve, final eval loss and training-loss curve (from its metrics.jsonl)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_loss" in r]
    return {"name": name, "seed": seed, "final": evals[-1]["eval_loss"], "curve": [(r["step"], r["eval_loss"]) for r in evals],
            "train": [(r["step"], r["loss"]) for r in rows if "loss" in r]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="steps per arm (default 300; 1000 with --long)")
    ap.add_argument("--seeds", default=None, help="comma-separated seeds (default 0,1,2; 0 with --long)")
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--adamw-lr", type=float, default=3e-3)
    ap.add_argument("--muon-lr", type=float, default=1e-2)
    ap.add_argument("--nadam-lr", type=float, default=1e-2)
    ap.add_argument("--sweep", default=None, help="comma-separated lrs tried on the sync arms first, e.g. 1e-3,3e-3,1e-2")
    ap.add_argument("--long", action="store_true", help="the 1000-step table: one seed of the six AdamW/Muon arms")
    ap.add_argument("--arms", default=None, help="comma-separated arm names to run (default: all of the table)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "quality"))
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: report (and --write) the finished arms only, listing the ones missing")
    args = ap.parse_args()
    args.steps = args.steps or (1000 if args.long else 300)
    args.seeds = args.seeds or ("0" if args.long else "0,1,2")
    seeds = [int(s) for s in args.seeds.split(",")]
    out_root = Path(args.out) / (f"long{args.steps}" if args.long else "")
    subprocess.run([sys.executable, str(ROOT / "scripts/prepare_data.py")], check=True, cwd=ROOT)
    lrs = {"adamw": args.adamw_lr, "muon": args.muon_lr, "nadam": args.nadam_lr}
    if args.sweep:
        grid = [float(x) for x in args.sweep.split(",")]
        opts = ("adamw", "muon") if args.long else ("adamw", "muon", "nadam")
        jobs = [(f"{opt} sync", arms(lr, lr, lr)[f"{opt} sync"], args.steps, seeds[0], out_root) for opt in opts for lr in grid]
        with ThreadPoolExecutor(args.parallel) as ex:
            res = list(ex.map(lambda j: run_arm(*j), jobs))
        for opt in opts:
            tried = [(r["final"], lr) for r, (name, *_), lr in zip(res, jobs, grid * len(opts)) if name.startswith(opt)]
            lrs[opt] = min(tried)[1]
            print(f"{opt} sync: " + ", ".join(f"lr {lr:g} -> {f:.4f}" for f, lr in tried), flush=True)
        print(f"tuned on the sync arms: {lrs}")
    table = arms(lrs["adamw"], lrs["muon"], lrs["nadam"])
    names = list(LONG_ARMS) if args.long else list(table)
    if args.arms:
        names = [n.strip() for n in args.arms.split(",")]
        unknown = [n for n in names if n not in table]
        if unknown:
            raise SystemExit(f"--arms: unknown {unknown}; known: {', '.join(table)}")
    jobs = [(name, table[name], args.steps, seed, out_root) for seed in seeds for name in names]
    with ThreadPoolExecutor(args.parallel) as ex:
        results = list(ex.map(lambda j: run_arm(*j, report_only=args.report_only), jobs))
    missing = [f"{name} (seed {seed})" for (name, _, _, seed, _), r in zip(jobs, results) if r is None]
    results = [r for r in results if r is not None]
    text = report(results, lrs, args, out_root)
    if missing:
        text += f"\n\nNot run yet ({len(missing)} of {len(jobs)}): " + "; ".join(missing) + "."
    print(text)
    if args.write:
        write_section(text, "quality-long" if args.long else "quality", args)


# ---------------------------------------------------------------------------- report


def summarize(results: list[dict]) -> dict[str, dict]:
    """Per arm: mean and sample sd of the final eval loss over seeds, and the gap to its optimizer's sync arm paired
    by seed (same seed = same init and data order, so the paired difference is the delay's effect with less noise)."""
    by = {}
    for r in results:
        by.setdefault(r["name"], {})[r["seed"]] = r["final"]
    out = {}
    for n, finals in by.items():
        vals = list(finals.values())
        s = {"mean": statistics.mean(vals), "sd": statistics.stdev(vals) if len(vals) > 1 else 0.0, "n": len(vals),
             "min": min(vals), "max": max(vals)}
        sync = by.get(f"{n.split()[0]} sync")
        if sync:
            s["gaps"] = {k: finals[k] - sync[k] for k in finals if k in sync}  # by seed
            diffs = list(s["gaps"].values())
            s["gap"] = statistics.mean(diffs) if diffs else float("nan")
            s["gap_sd"] = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
        out[n] = s
    return out


def _pm(x: float, sd: float, n: int, digits: int = 4) -> str:
    return f"{x:.{digits}f} ± {sd:.{digits}f}" if n > 1 else f"{x:.{digits}f}"


def _paired(s: dict, a: str, b: str) -> tuple[float, float, int] | None:
    """Mean gap to sync of arms ``a`` and ``b`` over the seeds both have (and how many): arms with different seed
    counts are compared on the same seeds, never a 3-seed mean against one seed."""
    ga, gb = s.get(a, {}).get("gaps"), s.get(b, {}).get("gaps")
    common = sorted(set(ga or ()) & set(gb or ()))
    if not common:
        return None
    return statistics.mean(ga[k] for k in common), statistics.mean(gb[k] for k in common), len(common)


def _n_seeds(n: int) -> str:
    return "one seed" if n == 1 else f"{n} seeds"


def _closed(s: dict, opt: str, arm: str) -> float | None:
    pair = _paired(s, f"{opt} delay-1", arm)
    if pair is None or pair[0] <= 0:
        return None
    base, ef, _ = pair
    return (base - ef) / base


def _met(ok: bool | None) -> str:
    return "n/a (arm missing or no delay gap)" if ok is None else ("**met**" if ok else "**not met**")


def report(results, lrs, args, out_root: Path) -> str:
    s = summarize(results)
    n_seeds = len(args.seeds.split(","))
    lines = [f"Final eval loss (mean ± sample sd over {n_seeds} seed{'s' if n_seeds > 1 else ''}; the gap to sync is "
             "paired by seed, same init and data order).", "",
             "| arm | seeds | final eval loss | min .. max | gap to sync | gap % | share of the delay gap closed by EF |",
             "|---|---|---|---|---|---|---|"]
    for n, v in s.items():
        opt = n.split()[0]
        gap, closed = v.get("gap"), (_closed(s, opt, n) if "EF" in n else None)
        sync = s.get(f"{opt} sync", {}).get("mean")
        gap_s = "" if gap is None else (f"{gap:+.4f} ± {v['gap_sd']:.4f}" if v["n"] > 1 else f"{gap:+.4f}")
        pct = "" if gap is None or not sync else f"{gap / sync:+.2%}"
        lines.append(f"| {n} | {v['n']} | {_pm(v['mean'], v['sd'], v['n'])} | {v['min']:.4f} .. {v['max']:.4f} | {gap_s} | {pct} | "
                     + ("" if closed is None else f"{closed:.0%}") + " |")
    lines += ["", "Next to the paper (arXiv 2606.30634, 360M model, 20 tokens per parameter; ours: 2.6M parameters, "
              f"{args.steps} steps of 4,096 tokens):", "",
              "| optimizer | paper: sync / delayed / + EF | paper: gap, EF closes | ours: sync / delayed / + EF | ours: gap, EF closes |",
              "|---|---|---|---|---|"]
    for opt, (ps, pd, pe) in PAPER.items():
        if f"{opt} delay-1" not in s:
            continue
        ours = [s.get(f"{opt} {a}", {}).get("mean", float("nan")) for a in ("sync", "delay-1", "delay-1 + EF")]
        c = _closed(s, opt, f"{opt} delay-1 + EF")
        lines.append(f"| {opt} | {ps:.3f} / {pd:.3f} / {pe:.3f} | {pd - ps:+.3f}, {(pd - pe) / (pd - ps):.0%} | "
                     f"{ours[0]:.4f} / {ours[1]:.4f} / {ours[2]:.4f} | {s[f'{opt} delay-1']['gap']:+.4f}, "
                     f"{'n/a' if c is None else f'{c:.0%}'} |")
    a_gap, m_gap = (s.get(f"{o} delay-1", {}).get("gap") for o in ("adamw", "muon"))
    lines += ["", "Targets (from the paper's ordering):"]
    if a_gap is not None and m_gap is not None:
        ratio = f"{m_gap / a_gap:.2f} of AdamW's" if a_gap > 0 else "AdamW shows no gap"
        lines.append(f"- Muon's delay gap <= 1/5 of AdamW's: {m_gap:+.4f} vs {a_gap:+.4f} ({ratio}) -> "
                     + _met(m_gap <= a_gap / 5 if a_gap > 0 else None) + " (paper: 0.012 vs 0.278, 0.04)")
    for opt in ("adamw", "muon"):
        c = _closed(s, opt, f"{opt} delay-1 + EF")
        if f"{opt} delay-1 + EF" in s:
            d, e = s.get(f"{opt} delay-1", {}).get("gaps", {}), s[f"{opt} delay-1 + EF"].get("gaps", {})
            each = [(d[k] - e[k]) / d[k] for k in sorted(set(d) & set(e)) if d[k] > 0]
            spread = f" (per seed {min(each):.0%} .. {max(each):.0%})" if len(each) > 1 else ""
            lines.append(f"- EF (lambda 1) closes >= 60% of {opt}'s delay gap: "
                         f"{'n/a' if c is None else f'{c:.0%}'}{spread} -> {_met(None if c is None else c >= 0.6)}")
    pd8 = _paired(s, "muon delay-1", "muon pipedream p=8")
    if pd8:
        d, p8, n = pd8
        p4 = _paired(s, "muon delay-1", "muon pipedream p=4")
        lines.append(f"- constant delay (2BW) beats PipeDream at p = 8 (gap to sync, {_n_seeds(n)}): muon delay-1 "
                     f"{d:+.4f} vs pipedream p=8 {p8:+.4f}" + (f" (p=4: {p4[1]:+.4f})" if p4 else "") + f" -> {_met(d < p8)}")
    for opt in ("adamw", "muon"):
        pair = _paired(s, f"{opt} delay-1 + EF", f"{opt} delay-1 + EF auto")
        if pair:
            one, auto, n = pair
            sd = [s[f"{opt} delay-1 + EF{x}"]["gap_sd"] for x in ("", " auto")]
            lines.append(f"- ef_lambda auto at least as good as lambda = 1 ({opt}; gap to sync, {_n_seeds(n)}): "
                         f"{auto:+.4f} vs {one:+.4f} ({auto - one:+.4f}"
                         + (f"; seed sd of the gaps {max(sd):.4f}" if n > 1 else "") + f") -> {_met(auto <= one)}")
    lines += _gap_over_training(results)
    lines += _sync_steps_worth(results, args.steps)
    sweep = [(opt, lam) for opt in ("adamw", "muon") for lam in ("lambda=0.5", "", "lambda=1.5", "auto")
             if f"{opt} delay-1 + EF{' ' + lam if lam else ''}" in s]
    if any(lam for _, lam in sweep):
        lines += ["", "EF lambda sweep (gap to sync and the share of the delay gap closed, each optimizer on the seeds "
                  "all its sweep arms have):", "",
                  "| optimizer | seeds | lambda 0.5 | lambda 1 | lambda 1.5 | auto |", "|---|---|---|---|---|---|"]
        for opt in ("adamw", "muon"):
            names = [f"{opt} delay-1 + EF{' ' + lam if lam else ''}" for lam in ("lambda=0.5", "", "lambda=1.5", "auto")]
            have = [n for n in names if n in s] + [f"{opt} delay-1"]
            common = sorted(set.intersection(*(set(s.get(n, {}).get("gaps") or ()) for n in have)))
            if not common:
                continue
            base = statistics.mean(s[f"{opt} delay-1"]["gaps"][k] for k in common)
            cells = []
            for n in names:
                if n not in s:
                    cells.append("-")
                    continue
                gap = statistics.mean(s[n]["gaps"][k] for k in common)
                cells.append(f"{gap:+.4f} ({(base - gap) / base:.0%})" if base > 0 else f"{gap:+.4f}")
            lines.append(f"| {opt} | {', '.join(map(str, common))} | " + " | ".join(cells) + " |")
    how = (f"tuned on the sync arms over {args.sweep}" if args.sweep else
           "given: each the best of 1e-3, 3e-3, 1e-2 on its sync arm at 300 steps, seed 0 (AdamW's and Muon's "
           "swept 2026-11-22, NAdam's 2026-11-23)")
    lines += ["", f"Learning rates ({how}; shared by each optimizer's arms): {lrs}; seeds {args.seeds}; {args.steps} "
              "steps of 4,096 tokens; "
              "cosine to 10% with 10% warm-up, weight decay 0.1, clip 1.0."]
    png = "quality_long_curves.png" if args.long else "quality_curves.png"
    _plot(results, out_root / png)
    if args.write:  # the docs' picture changes only with the docs' table
        from .report import DOCS

        (DOCS / png).write_bytes((out_root / png).read_bytes())
    lines.append(f"\n![eval loss curves]({png})")
    return "\n".join(lines)


def _gap_over_training(results: list[dict]) -> list[str]:
    """The delay gap and EF's share of it at every evaluation (paired by seed, mean over the seeds that have all
    three arms): the final number alone cannot say whether a gap is closing or opening as training goes on."""
    curves = {(r["name"], r["seed"]): dict(r["curve"]) for r in results}
    gaps = {}  # (opt, step) -> lists of delay gaps and EF gaps
    for opt in ("adamw", "muon"):
        for (name, seed), sync in curves.items():
            d, e = curves.get((f"{opt} delay-1", seed)), curves.get((f"{opt} delay-1 + EF", seed))
            if name != f"{opt} sync" or d is None or e is None:
                continue
            for step in sorted(set(sync) & set(d) & set(e) - {0}):
                g = gaps.setdefault((opt, step), ([], []))
                g[0].append(d[step] - sync[step])
                g[1].append(e[step] - sync[step])
    steps = sorted({st for (_, st) in gaps})
    if not steps or not all(("adamw", st) in gaps and ("muon", st) in gaps for st in steps):
        return []
    lines = ["", "The gap during training (eval loss of the delayed arm minus sync at each evaluation, mean over seeds; "
             "EF's share of it closed):", "", "| step | AdamW gap | EF closes | Muon gap | EF closes | Muon's gap / AdamW's |",
             "|---|---|---|---|---|---|"]
    for st in steps:
        (ad, ae), (md, me) = ([statistics.mean(x) for x in gaps[(o, st)]] for o in ("adamw", "muon"))
        share = lambda d, e: f"{(d - e) / d:.0%}" if d > 0 else "n/a"  # noqa: E731
        lines.append(f"| {st} | {ad:+.4f} | {share(ad, ae)} | {md:+.4f} | {share(md, me)} | "
                     + (f"{md / ad:.2f}" if ad > 0 else "n/a") + " |")
    return lines


def _sync_steps_worth(results: list[dict], steps: int) -> list[str]:
    """At which step the sync run's eval curve (linearly interpolated between evaluations) first reaches each
    delayed arm's final loss, same seed: the delay's cost in steps, which reads the same at any loss level. A rough
    measure (the sync run is at another point of its lr schedule there), but it says whether a gap is "a few steps
    behind" or a different trajectory."""
    curves = {(r["name"], r["seed"]): r["curve"] for r in results}
    worth = {}
    for (name, seed), curve in curves.items():
        sync = curves.get((f"{name.split()[0]} sync", seed))
        if sync is None or "sync" in name:
            continue
        final = curve[-1][1]
        for (s0, l0), (s1, l1) in zip(sync, sync[1:]):
            if l1 <= final <= l0:
                worth.setdefault(name, []).append(s0 + (l0 - final) / (l0 - l1) * (s1 - s0) if l0 > l1 else s1)
                break
        else:
            worth.setdefault(name, []).append(float("nan") if final < sync[-1][1] else 0.0)
    if not worth:
        return []
    lines = ["", f"What {steps} delayed steps are worth in sync steps (the step at which the same seed's sync run "
             "reaches the arm's final eval loss; mean over seeds; NaN: the arm ends below the sync run):", "",
             "| arm | seeds | sync steps | share of the run |", "|---|---|---|---|"]
    for name, vals in worth.items():
        m = statistics.mean(vals)
        lines.append(f"| {name} | {len(vals)} | {m:.0f} | {m / steps:.0%} |")
    return lines


def _color(name: str) -> str:
    """One hue per optimizer (PipeDream its own), darker for the corrected arms: arms of one optimizer read together."""
    if "pipedream" in name:
        return "tab:olive" if "p=4" in name else "tab:brown"
    base = {"adamw": ("tab:blue", "navy"), "muon": ("tab:red", "darkred"), "nadam": ("tab:green", "darkgreen")}
    light, dark = base.get(name.split()[0], ("tab:gray", "black"))
    return dark if "EF" in name else light


def _linestyle(name: str) -> str:
    if "sync" in name:
        return "-"
    if "auto" in name:
        return "-."
    return ":" if "EF" in name else "--"


def _plot(results, path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:  # the first seed; the lambda sweep arms are in the table only
        if r["seed"] != results[0]["seed"] or "lambda=" in r["name"]:
            continue
        style = dict(color=_color(r["name"]), linestyle=_linestyle(r["name"]))
        axes[0].plot(*zip(*r["curve"]), marker="o", ms=3, label=r["name"], **style)
        steps, losses = zip(*r["train"])
        k = 10
        smooth = [sum(losses[max(0, i - k):i + 1]) / len(losses[max(0, i - k):i + 1]) for i in range(len(losses))]
        axes[1].plot(steps, smooth, label=r["name"], lw=1, **style)
    axes[0].set_title(f"held-out loss (seed {results[0]['seed']})")
    axes[1].set_title("training loss (moving average)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylim(top=min(8, axes[0].get_ylim()[1]))
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_section(table: str, key: str, args) -> None:
    from .report import write_section as write

    title = ("## Delay tolerance at 1000 steps (one seed; short-run regime, 1.95 tokens per parameter)" if key == "quality-long"
             else "## Delay tolerance in the short-run regime (300 steps, 0.59 tokens per parameter): the paper's table "
                  "at our scale\n\nThe short-run regime: almost all transient, where a delay costs most. The paper's "
                  "regime (20 tokens per parameter, 5,131 steps) is `bench.paper_regime`'s section below.")
    shown = " ".join(a for a in sys.argv[1:] if a != "--report-only")  # the command that runs the arms (reused)
    write(key, f"{title}\n\nCommand: `python -m bench.quality {shown}` ({time.strftime('%Y-%m-%d')}; "
               f"Llama h128 x 8 layers, 2.6M parameters, tied embeddings, default corpus, single-process exact delay "
               f"references)\n\n{table}")


if __name__ == "__main__":
    main()
