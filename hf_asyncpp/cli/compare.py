"""Is 2BW worth it for this model? Train a recipe twice on the same processes, seed and data -- synchronous 1F1B +
Muon, then PipeDream-2BW + Muon + the EF correction -- and compare the time each needs to reach a loss.

    hf-asyncpp compare recipes/cpu-tiny.yaml --steps 300 [--async-steps 360]
    python scripts/compare_schedules.py recipes/cpu-tiny.yaml --steps 300 --out runs/compare-cpu-tiny

Prints the time 2BW needs to reach the synchronous run's final eval loss over the synchronous run's time (below 1:
2BW gets there sooner; the clock is ``metrics.jsonl``'s ``train_s``, training only, evaluations and checkpoints
excluded; the crossing is interpolated linearly between evaluations) and writes ``time_to_loss.png`` (eval loss
against training time, both arms) and ``compare.json`` into ``--out``. The arms run one after the other, never at
the same time; extra ``--section.field=value`` arguments go to both. A recipe of one stage is run on
``--num-stages`` (default 2). The arguments and the recipe are read before torch is imported (the metrics reader
imports it), so a mistake in them answers at once.

``--async-steps``: the 2BW arm's own step budget (default ``--steps``). Trained for the same steps, 2BW ends at a
slightly higher loss (its gradients are one step old) and so never reaches the synchronous run's final loss, however
much faster its steps are; the question a user asks is whether 2BW, given more steps (its learning-rate schedule
over its own budget), gets there in less time. Budgets up to the step-rate gain are worth trying.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from . import at_least
from ..config.recipe import load_recipe, split_overrides
from ..errors import RecipeError
from ..figures import pyplot
from ..storage.names import METRICS
from ..storage.write import json_text, write_file

ARMS = {
    "sync": ("synchronous 1F1B + Muon", ["--pipeline.schedule=1f1b", "--optimizer.name=muon",
                                          "--optimizer.delay_correction=none"]),
    "2bw": ("PipeDream-2BW + Muon + EF", ["--pipeline.schedule=2bw", "--optimizer.name=muon",
                                          "--optimizer.delay_correction=error_feedback"]),
}


def arm_overrides(name: str, out: Path, steps: int, eval_steps: int, num_stages: int, extra: list[str]) -> list[str]:
    return [*ARMS[name][1], f"--pipeline.num_stages={num_stages}", f"--training.max_steps={steps}",
            f"--training.eval_steps={eval_steps}", "--training.save_steps=0", "--training.export=false",
            "--training.report_to=none", f"--training.output_dir={out}",
            "--training.overwrite_output_dir=true", *extra]  # a new comparison replaces the arm's last run


def run_arm(recipe: str, name: str, out: Path, steps: int, eval_steps: int, num_stages: int, extra: list[str],
            reuse: bool = False) -> Path:
    """Train one arm with ``hf-asyncpp train`` (it starts the stage processes); its log goes to ``out``.log."""
    from ..run.reporting import read_metrics  # see main()

    if reuse and any(r.get("step") == steps and "train_s" in r for r in read_metrics(out / METRICS)):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "hf_asyncpp", "train", recipe,
           *arm_overrides(name, out, steps, eval_steps, num_stages, extra)]
    root = str(Path(__file__).resolve().parents[2])  # this hf_asyncpp, also when run from a checkout
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    with open(f"{out}.log", "w") as log:
        r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if r.returncode != 0:
        tail = Path(f"{out}.log").read_text()[-3000:]
        raise RuntimeError(f"the {name} arm failed (exit {r.returncode}); {out}.log ends:\n{tail}")
    return out


def curve(run: Path) -> tuple[list[tuple[float, float]], float, int]:
    """([(training seconds, eval loss) at each evaluation], training seconds of the whole run, its steps)."""
    from ..run.reporting import read_metrics  # see main()

    rows = read_metrics(run / METRICS)
    train_s = {r["step"]: r["train_s"] for r in rows if "train_s" in r}
    train_s[0] = 0.0
    evals = [(train_s[r["step"]], r["eval_loss"]) for r in rows if "eval_loss" in r and r["step"] in train_s]
    return evals, max(train_s.values()), max(train_s)


def crossing(evals: list[tuple[float, float]], target: float) -> float | None:
    """First training time the eval loss reaches ``target``, linear between evaluations; None if it never does."""
    for (t0, l0), (t1, l1) in zip([evals[0]] + evals, evals):
        if l1 <= target:
            return t1 if l0 <= target or l0 == l1 else t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None


def compare(sync: Path, async_: Path) -> dict:
    """The time-to-loss summary of two finished arms."""
    s_evals, s_time, s_steps = curve(sync)
    a_evals, a_time, a_steps = curve(async_)
    if not s_evals or not a_evals:
        raise ValueError(f"no evaluations in {sync / METRICS} or {async_ / METRICS}: set --eval-steps")
    target = s_evals[-1][1]
    reach = crossing(a_evals, target)
    return {"target_eval_loss": target, "sync_train_s": s_time, "2bw_train_s": a_time,
            "2bw_final_eval_loss": a_evals[-1][1], "2bw_reach_s": reach,
            "ratio": None if reach is None else reach / s_time,
            "step_speedup": (s_time / s_steps) / (a_time / a_steps), "sync_steps": s_steps, "2bw_steps": a_steps,
            "curves": {"sync": s_evals, "2bw": a_evals}}


def plot(res: dict, png: Path, title: str) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, pts in res["curves"].items():
        ax.plot([t for t, _ in pts], [loss for _, loss in pts], marker="o", ms=3, label=ARMS[name][0])
    ax.axhline(res["target_eval_loss"], color="gray", ls=":", lw=1, label="synchronous run's final eval loss")
    if res["2bw_reach_s"] is not None:
        ax.axvline(res["2bw_reach_s"], color="C1", ls="--", lw=1)
        ax.annotate(f"{res['ratio']:.2f}x the sync time", (res["2bw_reach_s"], res["target_eval_loss"]),
                    textcoords="offset points", xytext=(6, 12), fontsize=8)
    ax.set_xlabel("training time (s, evaluations excluded)")
    ax.set_ylabel("eval loss")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def summary(res: dict) -> str:
    reach = (f"2BW reaches it after {res['2bw_reach_s']:.1f} s: {res['ratio']:.2f}x the synchronous run's time" if
             res["ratio"] is not None else
             f"2BW does not reach it (its final eval loss {res['2bw_final_eval_loss']:.4f}): run more steps")
    return (f"synchronous run: {res['sync_train_s']:.1f} s of training, final eval loss {res['target_eval_loss']:.4f}\n"
            f"2BW run: {res['2bw_train_s']:.1f} s for {res['2bw_steps']} steps ({res['step_speedup']:.2f}x the step rate), "
            f"final eval loss {res['2bw_final_eval_loss']:.4f}\n{reach}")


def budget_dir(out: Path, name: str, steps: int, async_steps: int) -> Path:
    """An arm's folder; a 2BW arm with its own step budget is named for it (several budgets can share ``--out``)."""
    return out / name if name == "sync" or async_steps == steps else out / f"{name}-{async_steps}steps"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hf-asyncpp compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe")
    ap.add_argument("--steps", type=at_least(1), required=True, help="optimizer steps of the synchronous arm (and of 2BW's by default)")
    ap.add_argument("--async-steps", type=at_least(1), default=None, help="optimizer steps of the 2BW arm (default --steps)")
    ap.add_argument("--eval-steps", type=at_least(1), default=None, help="evaluate every this many steps (default: steps / 10)")
    ap.add_argument("--num-stages", type=at_least(1), default=None, help="pipeline stages (default: the recipe's, at least 2)")
    ap.add_argument("--out", default=None, metavar="DIR", help="folder of both runs, the PNG and compare.json (default runs/compare-<recipe>)")
    ap.add_argument("--reuse", action="store_true", help="keep an arm whose run in --out already has --steps steps")
    own, extra = split_overrides(list(sys.argv[1:] if argv is None else argv))
    args = ap.parse_args(own)
    try:
        recipe = load_recipe(args.recipe, extra)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    p = args.num_stages or max(2, recipe.pipeline.num_stages)
    eval_steps = args.eval_steps or max(1, args.steps // 10)
    out = Path(args.out or f"runs/compare-{Path(args.recipe).stem}")
    async_steps = args.async_steps or args.steps
    runs = {}
    for name in ARMS:
        steps = args.steps if name == "sync" else async_steps
        run = budget_dir(out, name, args.steps, async_steps)
        print(f"training the {ARMS[name][0]} arm ({steps} steps on {p} stages) -> {run}", flush=True)
        runs[name] = run_arm(args.recipe, name, run, steps, eval_steps, p, extra, args.reuse)
    res = compare(runs["sync"], runs["2bw"])
    budget = f"{args.steps} steps" if async_steps == args.steps else f"sync {args.steps} / 2BW {async_steps} steps"
    plot(res, out / "time_to_loss.png", f"{Path(args.recipe).stem}: {budget} on {p} stages, same seed and data")
    text = json_text(res, indent=1)
    write_file(out / "compare.json", lambda f: f.write(text.encode("utf-8")))
    print(summary(res) + f"\nplot: {out / 'time_to_loss.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
