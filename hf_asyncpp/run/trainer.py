"""The training loop: one loop for the single-process and the pipelined run.

Read it top to bottom: set up (accelerate, threads, output dir, recipe), data and tokenizer, model, engine,
resume; then the stream of steps, cut only where the numbers need a drained pipeline (an evaluation, a
checkpoint, the end); then the run profile, export and a final perplexity. The engine (``LocalEngine`` or the
pipeline's ``PipelineEngine``) does the steps, ``Checkpointer`` the checkpoints, ``Evaluator`` the evaluations and
the end of the run (export, its evaluation, the final push), ``RunLog`` the reporting;
this file only wires them together.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from .. import supervision  # first: it notes the launcher's pid before the slow imports below

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration

from ..config.recipe import Recipe, save_recipe
from ..data.mixture import MixtureStream, resolve_sources, source_counts, source_eval_blocks
from ..data.prefetch import Prefetcher
from ..data.sources import resolve_data_files, train_hold_out
from ..data.stream import BlockStream, eval_blocks
from ..data.tokenizer import adopt_tokenizer, checkpoint_tokenizer, load_or_train_tokenizer
from ..engine import Engine, LocalEngine, StepResult
from ..errors import NonFiniteError, StageLocalError
from ..launch.spawn import check_topology, processes_needed
from ..model.build import build_model, compile_counts, meta_model
from ..plan.autosplit import auto_split
from ..plan.vocab import resolve_vocab_parallel
from ..pipeline.executor import PipelineEngine
from ..plan.profile import write_report
from ..schedules.records import pipelined
from ..storage.names import (FINAL_EVAL, LOGS_DIR, LOSS_CURVE, METRICS, PROFILE, RECIPE_FILE, TIMELINE, TOKENIZER_DIR,
                             checkpoint_name)
from ..storage.write import check_output_dir, lock_output_dir, unlock_output_dir, writing
from ..topology import Topology, local_device, one_process_group
from .checkpointer import Checkpointer, RunState, check_model, save_due
from .evaluator import Evaluator, evaluation_due
from .folder import check_fresh_run, choose_resume, finished_run, list_checkpoints
from .hub import Pusher
from .reporting import RunLog, check_trackers, model_flops_per_token
from .seeds import rank_seed, set_seed

log = logging.getLogger("hf_asyncpp")

# ---------------------------------------------------------------------------- setup


def make_accelerator(recipe: Recipe):
    """Accelerator on CPU or GPU; on CPU it must be told ``cpu=True`` or it reports one process."""
    report_to = check_trackers(recipe.training.report_to)
    return Accelerator(
        cpu=not torch.cuda.is_available(),
        log_with=report_to or None,
        project_config=ProjectConfiguration(project_dir=recipe.training.output_dir, logging_dir=str(Path(recipe.training.output_dir) / LOGS_DIR)),
        # the default group carries checkpoint, export and evaluation gathers: pipeline.init_timeout_s
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=recipe.pipeline.init_timeout_s))],
    )


# ---------------------------------------------------------------------------- run


def make_engine(recipe: Recipe, tokenizer, topo: Topology) -> Engine:
    """The engine with its model: a pipeline stage builds only its own part (a meta model, partitioned, then its
    stage's weights drawn or read: ``modeling.materialise_stage``), so no rank holds the whole model; where that
    is not possible (a tokenizer that outgrows a pretrained embedding, weights without safetensors, an initializer
    that leaves a tensor unset), the whole model, as a single process builds it. Seeded by the caller."""
    if not pipelined(recipe.pipeline.schedule):
        return LocalEngine(recipe, build_model(recipe.model, tokenizer), topo, log=log.info)
    try:
        return PipelineEngine(recipe, meta_model(recipe.model, tokenizer), topo, log=log.info)
    except StageLocalError as e:
        log.warning("rank %d builds the whole model, then keeps its stage: %s", topo.rank, e)
        return PipelineEngine(recipe, build_model(recipe.model, tokenizer), topo, log=log.info)


def measured_split(recipe: Recipe, tokenizer, main: bool) -> list[int]:
    """``pipeline.layers_per_stage: auto``: the main process measures (or finds its cache) and every rank gets its
    split, so all build the same stages whatever the timing noise on each."""
    box = [auto_split(recipe, lambda: build_model(recipe.model, tokenizer), local_device(),
                      vocab_parallel=resolve_vocab_parallel(recipe)[0]) if main else None]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def drain_points(start: int, recipe: Recipe) -> list[int]:
    """Steps after which the pipeline drains: an evaluation and a checkpoint need every update of the steps so far
    applied (and nothing in flight), and the run ends. Logging is not one of them: results stream out as they
    come, so a 2BW run never flushes between these points, whatever ``logging_steps`` is."""
    t = recipe.training
    stop = min(t.max_steps, t.stop_after_steps or t.max_steps)
    return [s for s in range(start + 1, stop + 1) if s == stop or evaluation_due(t, s) or save_due(t, s)]


def run_files(out: Path, export_dir: str | None = None) -> dict[str, str]:
    """What the run folder holds for its user, by kind, only what exists: ``export`` (the folder this run exported,
    when it did), ``metrics`` (metrics.jsonl), ``final_eval``, ``loss_curve``, ``profile`` and ``timeline`` (a
    pipelined run's), ``logs`` (the trackers' folder), ``checkpoint`` (the newest complete one). The end summary
    (``cli/train.py: end_summary``) lists them."""
    found = {"export": Path(export_dir) if export_dir else None, "metrics": out / METRICS, "final_eval": out / FINAL_EVAL,
             "loss_curve": out / LOSS_CURVE, "profile": out / PROFILE, "timeline": out / TIMELINE, "logs": out / LOGS_DIR}
    checkpoints = list_checkpoints(out)
    if checkpoints:
        found["checkpoint"] = checkpoints[-1][1]
    return {k: str(p) for k, p in found.items() if p is not None and p.exists()}


def held_out_parts(per_source: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, slice]]:
    """A mixture's held-out blocks in one tensor (the export's perplexity, the model card) and each source's rows."""
    parts, at = {}, 0
    for name, blocks in per_source.items():
        parts[name] = slice(at, at + len(blocks))
        at += len(blocks)
    return torch.cat(list(per_source.values())), parts


def source_report(stream, topo: Topology, seq_len: int) -> dict[str, int]:
    """``data/<source>/documents`` and ``data/<source>/tokens`` of a mixture so far, summed over the replicas (each
    first stage's consumed position; collective: every rank calls it at the same drain point)."""
    mine = source_counts(stream.state_dict(), seq_len) if stream is not None and topo.first else None
    per_rank = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, mine)
    total: dict[str, int] = {}
    for counts in filter(None, per_rank):
        for name, c in counts.items():
            for what, n in c.items():
                total[f"data/{name}/{what}"] = total.get(f"data/{name}/{what}", 0) + n
    return total


@dataclass
class SkipLimit:
    """``training.on_nonfinite: skip`` gives up: a run whose updates are all skipped has stopped training, and must
    not save, export and exit 0 as if it had. Fed every step's result in order, the same on every rank (the skip
    decision is taken on the global norm), so every rank stops at the same step."""

    max_consecutive: int
    max_total: int  # ``max_skipped_fraction`` of ``max_steps``
    consecutive: int = 0
    total: int = 0

    def see(self, r: StepResult) -> None:
        if not r.skipped_nonfinite:
            self.consecutive = 0
            return
        self.consecutive += 1
        self.total += 1
        if self.consecutive >= self.max_consecutive or self.total > self.max_total:
            why = (f"{self.consecutive} steps in a row (training.max_consecutive_skips: {self.max_consecutive})"
                   if self.consecutive >= self.max_consecutive else
                   f"{self.total} steps since the run started, more than training.max_skipped_fraction of max_steps "
                   f"({self.max_total})")
            raise NonFiniteError(
                f"step {r.step + 1}: non-finite gradients skipped in {why}; the model has stopped training, so the run "
                "stops here (training.on_nonfinite: skip). Resume from a checkpoint before the trouble with a lower "
                "optimizer.learning_rate (or more warm-up)")


def gathered_compile_counts(since: dict[str, int]) -> list[dict] | None:
    """Every rank's ``compile_counts`` since ``since`` (its counts when the run began: the process may have compiled
    before) on the main process (None elsewhere): a collective, made at drain points only, where every rank is
    between the same two actions and nothing is in flight."""
    counts = {k: n - since.get(k, 0) for k, n in compile_counts().items()}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [counts]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(counts, out, dst=0)
    return out


def train(recipe: Recipe, recipe_path: str = "RECIPE") -> dict:
    """Run the recipe; returns a summary: the final eval loss/perplexity, the export's, and under ``files`` where the
    run's outputs are (:func:`run_files`; on the main process)."""
    supervision.clear_stop()
    previous = supervision.stop_on(recipe.training.stop_signals)  # a scheduler's signal now asks for a saved stop
    try:
        return _train(recipe, recipe_path)
    finally:  # however the run ended: the output folder's lock (a process that dies releases it too), the signals
        unlock_output_dir(Path(recipe.training.output_dir))
        supervision.restore_signals(previous)


def _train(recipe: Recipe, recipe_path: str) -> dict:
    t, rp = recipe.training, recipe.pipeline
    supervision.watch_parent()  # a rank never outlives its launcher
    accelerator = make_accelerator(recipe)
    one_process_group(pipelined(rp.schedule), timedelta(seconds=rp.init_timeout_s))  # no launcher made one
    world, rank = accelerator.num_processes, accelerator.process_index
    check_topology(recipe, world, recipe_path)
    threads = t.torch_threads or (1 if world > 1 else None)
    if threads:
        torch.set_num_threads(threads)
    logging.basicConfig(level=logging.INFO if accelerator.is_main_process else logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    out = check_output_dir(t.output_dir)
    if accelerator.is_main_process:
        lock_output_dir(out)  # one run per folder, before anything looks at it; held for the process's life
    topo = Topology(rank=rank, world_size=world, num_stages=processes_needed(recipe))
    resume = choose_resume(out, t.resume_from_checkpoint, topo)  # verified against its manifest
    complete = finished_run(out, resume, t) if resume is not None else None
    if complete is not None:  # a finished run resumed: said, and nothing of it is written again
        check_model(resume, recipe, checkpoint_tokenizer(resume / TOKENIZER_DIR, recipe.model))  # still refused if it contradicts
        return {"complete": complete, "is_main": accelerator.is_main_process}
    if resume is None:  # a fresh run: never into another run's folder unless told to replace it
        with accelerator.main_process_first():
            check_fresh_run(out, t.overwrite_output_dir, accelerator.is_main_process, t.resume_from_checkpoint)

    # data and tokenizer (a resumed run's own, from its checkpoint): the main process prepares, the others reuse
    with accelerator.main_process_first():
        sources = resolve_sources(recipe.data) if recipe.data.sources else None
        if sources is None:
            train_files, eval_files = resolve_data_files(recipe.data)
            corpus = train_files
        else:  # a mixture: its local files (the checkpoint's fingerprint) and, per source, what a BPE trains on
            train_files = [f for s in sources for f in s.train_files or []]
            corpus = [(s.train_files, s.cfg.text_column) for s in sources if s.train_files]
        if resume is not None:
            tokenizer = checkpoint_tokenizer(resume / TOKENIZER_DIR, recipe.model)
            check_model(resume, recipe, tokenizer)  # before anything is written
            if accelerator.is_main_process:
                adopt_tokenizer(resume / TOKENIZER_DIR, out / TOKENIZER_DIR)
        else:
            tokenizer = load_or_train_tokenizer(recipe.model, corpus, recipe.data.text_column, out / TOKENIZER_DIR,
                                                encoding=recipe.data.encoding)
        if sources is None:
            held_out, held_parts = eval_blocks(recipe.data, tokenizer, eval_files, recipe.data.eval_blocks, train_files), None
        else:  # each source's held-out blocks, one after the other: an eval_loss/<source> each
            held_out, held_parts = held_out_parts(source_eval_blocks(sources, tokenizer, recipe.data.eval_blocks))

    if rp.layers_per_stage == "auto" and pipelined(rp.schedule):
        rp.layers_per_stage = measured_split(recipe, tokenizer, accelerator.is_main_process)
    set_seed(t.seed)  # the same initial weights on every rank
    compiled = compile_counts() if t.compiles() else None  # what compiles from here is the run's
    engine = make_engine(recipe, tokenizer, topo)
    set_seed(rank_seed(t.seed, topo.stage, topo.dp_rank))  # then each stage and replica its own dropout stream
    stream = None  # a middle stage needs no ids (the executor knows the shapes): it never opens the training stream
    if topo.first or topo.last:  # the last stage reads the same stream as the first (same replica, seed): its labels
        blocks = (BlockStream(recipe.data, tokenizer, train_files, rank=topo.dp_rank, world_size=topo.dp_size,
                              seed=t.seed, hold_out=train_hold_out(recipe.data, eval_files)) if sources is None else
                  MixtureStream(sources, tokenizer, rank=topo.dp_rank, world_size=topo.dp_size, seed=t.seed,
                                strategy=recipe.data.stopping_strategy))
        stream = Prefetcher(blocks, rp.num_microbatches, rp.microbatch_size, recipe.data.prefetch_batches,
                            pin=torch.cuda.is_available())
    pusher = Pusher(recipe.hub) if recipe.hub.push_to_hub and accelerator.is_main_process else None
    checkpointer = Checkpointer(out, recipe, topo, accelerator, tokenizer, train_files, pusher)
    state = RunState()
    if resume is not None:
        state = checkpointer.resume(resume, engine, stream)
        log.info("resumed from %s at step %d", resume, state.step)
    if accelerator.is_main_process:  # only now: a run that failed to start leaves the folder's recipe as it was
        with writing(out / RECIPE_FILE):
            save_recipe(recipe, out / RECIPE_FILE)
    tokens_per_step = recipe.tokens_per_step * topo.dp_size
    runlog = RunLog(out, recipe, accelerator, state, tokens_per_step, model_flops_per_token(engine.config, recipe.data.seq_len),
                    writer=checkpointer.writer)

    evaluator = Evaluator(out, recipe, engine, tokenizer, accelerator, runlog, held_out, pusher, held_parts)
    if state.step == 0 and resume is None:
        first_eval = evaluator.perplexity(0)
        log.info("untrained: eval_loss %.4f perplexity %.2f", first_eval["eval_loss"], first_eval["eval_perplexity"])

    batches = stream  # None on a middle stage
    skips = SkipLimit(t.max_consecutive_skips, math.ceil(t.max_skipped_fraction * t.max_steps))
    saved_at = state.step if resume is not None else None  # the step of the newest checkpoint of this run
    stopping = False
    runlog.restart_clock()
    try:
        for end in drain_points(state.step, recipe):
            for r in engine.run(batches, state.step, end - state.step):  # one stream; results arrive as known
                state.step, state.tokens = r.step + 1, state.tokens + tokens_per_step
                runlog.step(r, state.tokens)
                skips.see(r)  # on_nonfinite: skip gives up, on every rank at the same step
            # a stop signal: every rank agreed on the step in the stream, or agrees here, where all are drained
            stopping = engine.stopped or engine.agree_stop()
            if not stopping and evaluation_due(t, state.step):
                evaluator.at_step(state.step)  # held-out perplexity, and eval.during_training's tasks
            if sources is not None:  # what each source gave so far, all replicas (collective)
                runlog.record(state.step, source_report(stream, topo, recipe.data.seq_len))
            if compiled is not None:  # each rank's graphs so far (its evaluation's too), recompiles, eager fallbacks
                runlog.compile_stats(state.step, gathered_compile_counts(compiled))
            if (save_due(t, state.step) or stopping) and saved_at != state.step:
                checkpointer.save(state, engine, stream)
                saved_at = state.step
            if stopping:
                break
            runlog.restart_clock()
    except BaseException as e:
        runlog.abort()  # the progress bar ends its line: an `error:` line starts on its own
        checkpointer.settle(e)  # the save in flight finished first; its own failure, where it came first
        raise
    finally:
        if stream is not None:
            stream.close()  # the worker stops reading ahead: nothing after this point trains
    checkpointer.finish()  # the last save written and committed before anything else (a stop signal's exit too)
    runlog.close()
    if stopping or state.step < t.max_steps:  # a stop signal or stop_after_steps: checkpointed, nothing more to do
        if pusher is not None:
            pusher.wait()
        checkpointer.close()
        engine.close()
        accelerator.end_training()
        if pusher is not None:  # the checkpoint is safe: now a push that never landed fails the run
            pusher.raise_failures(out)
        summary = {"step": state.step, "tokens": state.tokens, "stopped_early": True, "is_main": accelerator.is_main_process,
                   "checkpoint": str(out / checkpoint_name(saved_at)) if saved_at is not None else None}
        if stopping:
            summary["stopped_by"] = supervision.stop_signal_name() or "a stop signal to another rank"
        if accelerator.is_main_process:
            summary["files"] = run_files(out)
        return summary
    if sources is not None:  # the final report says what each source gave
        evaluator.data_sources = source_report(stream, topo, recipe.data.seq_len)
    last_eval = evaluator.perplexity(state.step)
    summary = {"step": state.step, "tokens": state.tokens, "is_main": accelerator.is_main_process,
               **{k: last_eval[k] for k in ("eval_loss", "eval_perplexity")}}
    prof = engine.profile()  # collective under the pipeline; None in one process
    if prof is not None:
        summary["pipeline_profile"] = write_report(out, prof, rp, t.max_grad_norm)
    if t.export:  # collective: every stage writes its own shard of the HF folder
        curve = runlog.plot_loss() if accelerator.is_main_process else None
        summary.update(evaluator.finish(state.step, state.tokens, curve))
    elif pusher is not None:
        pusher.wait()
    accelerator.wait_for_everyone()
    checkpointer.close()
    engine.close()
    accelerator.end_training()
    if pusher is not None:  # every file is written: now a push that never landed fails the run
        pusher.raise_failures(out)
    if accelerator.is_main_process:
        summary["files"] = run_files(out, summary.get("export_dir"))
    return summary
