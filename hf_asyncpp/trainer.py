"""The training loop: one loop for the single-process and the pipelined run.

Read it top to bottom: set up (accelerate, threads, output dir, recipe), data and tokenizer, model, engine,
resume; then the stream of steps, cut only where the numbers need a drained pipeline (an evaluation, a
checkpoint, the end); then the run profile, export and a final perplexity. The engine (``LocalEngine`` or the
pipeline's ``PipelineEngine``) does the steps, ``Checkpointer`` the checkpoints, ``RunLog`` the reporting;
this file only wires them together.
"""
from __future__ import annotations

import itertools
import logging
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

from . import checkpoint as ckpt
from .checkpointer import Checkpointer, RunState, set_seed
from .config import Recipe, RecipeError, load_recipe, save_recipe
from .data import BlockStream, eval_blocks, next_batch, resolve_data_files, train_hold_out
from .downstream import evaluate_tasks_during_training
from .engine import Engine, LocalEngine, NonFiniteError
from .evaluation import perplexity_from_sums
from .export import export_run
from .modeling import build_model
from .pipeline.executor import PipelineEngine
from .pipeline.p2p import PeerFailure
from .pipeline.profile import write_report
from .reporting import RunLog
from .tokenizer import load_or_train_tokenizer
from .topology import Topology

log = logging.getLogger("hf_asyncpp")

CPU_LAUNCH = (
    "accelerate launch --config_file recipes/accelerate/cpu-{n}proc.yaml scripts/pretrain.py {recipe}"
)


# ---------------------------------------------------------------------------- setup


def make_accelerator(recipe: Recipe):
    """Accelerator on CPU or GPU; on CPU it must be told ``cpu=True`` or it reports one process."""
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


# ---------------------------------------------------------------------------- run


def build_engine(recipe: Recipe, model: torch.nn.Module, topo: Topology) -> Engine:
    if recipe.pipeline.schedule == "none":
        return LocalEngine(recipe, model, topo, log=log.info)
    return PipelineEngine(recipe, model, topo, log=log.info)


def drain_points(start: int, recipe: Recipe) -> list[int]:
    """Steps after which the pipeline drains: an evaluation and a checkpoint need every update of the steps so far
    applied (and nothing in flight), and the run ends. Logging is not one of them: results stream out as they
    come, so a 2BW run never flushes between these points, whatever ``logging_steps`` is."""
    t = recipe.training
    stop = min(t.max_steps, t.stop_after_steps or t.max_steps)
    ends = {stop}
    for every in (t.eval_steps, t.save_steps):
        if every:
            ends.update(range(every, t.max_steps, every))
    return sorted(e for e in ends if start < e <= stop)


def train(recipe: Recipe, recipe_path: str = "RECIPE") -> dict:
    """Run the recipe; returns a summary (final eval loss/perplexity, export path)."""
    t, rp = recipe.training, recipe.pipeline
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
    topo = Topology(rank=rank, world_size=world, num_stages=pipeline_stages(recipe))

    # data and tokenizer: the main process prepares, the others reuse its files
    with accelerator.main_process_first():
        train_files, eval_files = resolve_data_files(recipe.data)
        tokenizer = load_or_train_tokenizer(recipe.model, train_files, recipe.data.text_column, out / "tokenizer")
        held_out = eval_blocks(recipe.data, tokenizer, eval_files, recipe.data.eval_blocks, train_files)

    set_seed(t.seed)
    engine = build_engine(recipe, build_model(recipe.model, tokenizer), topo)
    stream = BlockStream(recipe.data, tokenizer, train_files, rank=topo.dp_rank, world_size=topo.dp_size, seed=t.seed,
                         hold_out=train_hold_out(recipe.data, eval_files))
    checkpointer = Checkpointer(out, recipe, topo, accelerator, tokenizer)
    state = RunState()
    resume = ckpt.resolve_resume(out, t.resume_from_checkpoint)
    if resume is not None:
        state = checkpointer.resume(resume, engine, stream)
        log.info("resumed from %s at step %d", resume, state.step)
    tokens_per_step = recipe.tokens_per_step * topo.dp_size
    runlog = RunLog(out, recipe, accelerator, state.step, tokens_per_step)

    def evaluate(step: int) -> dict:
        nll, n = engine.eval_nll(held_out, rp.microbatch_size)  # forward-only, through the stages
        return runlog.eval(step, nll, n, perplexity_from_sums([nll], [n]))  # the shipped `evaluate` metric

    if state.step == 0 and resume is None:
        first_eval = evaluate(0)
        log.info("untrained: eval_loss %.4f perplexity %.2f", first_eval["eval_loss"], first_eval["eval_ppl"])

    batches = (next_batch(stream, rp.num_microbatches, rp.microbatch_size) for _ in itertools.count())
    runlog.restart_clock()
    for end in drain_points(state.step, recipe):
        for r in engine.run(batches, state.step, end - state.step):  # one stream; results arrive as they are known
            state.step, state.tokens = r.step + 1, state.tokens + tokens_per_step
            runlog.step(r, state.tokens)
        if t.eval_steps and state.step % t.eval_steps == 0 and state.step < t.max_steps:
            evaluate(state.step)
            evaluate_tasks_during_training(engine, tokenizer, recipe, accelerator, out, state.step)  # eval.during_training
        if (t.save_steps and state.step % t.save_steps == 0) or state.step in (t.max_steps, t.stop_after_steps):
            checkpointer.save(state, engine, stream)
        runlog.restart_clock()
    runlog.close()
    if state.step < t.max_steps:  # stop_after_steps: checkpointed, nothing more to do
        engine.close()
        accelerator.end_training()
        return {"step": state.step, "tokens": state.tokens, "stopped_early": True, "is_main": accelerator.is_main_process}
    last_eval = evaluate(state.step)
    summary = {"step": state.step, "tokens": state.tokens, "is_main": accelerator.is_main_process,
               **{k: last_eval[k] for k in ("eval_loss", "eval_ppl")}}
    prof = engine.profile()  # collective under the pipeline; None in one process
    if prof is not None:
        summary["pipeline_profile"] = write_report(out, prof, rp, t.max_grad_norm)
    if t.export:
        weights = engine.full_state_dict()  # collective under the pipeline: merged on the main process only
        if accelerator.is_main_process:
            summary.update(export_run(out, weights, engine.config, tokenizer, recipe, state.step, state.tokens,
                                      held_out, runlog.plot_loss()))
    accelerator.wait_for_everyone()
    engine.close()
    accelerator.end_training()
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: accelerate launch scripts/pretrain.py RECIPE.yaml [--section.field=value ...]")
        return 0 if argv else 2
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
