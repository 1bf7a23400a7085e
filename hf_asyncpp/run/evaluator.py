"""When a run is evaluated, and what its end leaves behind: the ``Evaluator``, beside the ``Checkpointer``.

The trainer cuts its stream of steps at evaluation points; this module says what happens there. :meth:`Evaluator.at_step`
measures held-out perplexity through the engine (forward only, through the stages, so a pipelined run needs no
gather) and, with ``eval.during_training``, scores ``eval.tasks`` on the newest weights; both are recorded by the
run's ``RunLog``, the one writer of ``metrics.jsonl``. :meth:`Evaluator.finish` is the end of a run: the HF folder
(``model/export.py``), its perplexity read back from the folder (the proof that the export is the trained model: through the
pipeline, each stage reading its own tensors, or a ``from_pretrained`` reload in one process), the downstream tasks
(through the pipeline too, on the tensors each stage reads from the export), the card's results, the final Hub push
and ``final_eval.json``.

The zero-shot tasks are lm-evaluation-harness's (``eval/lm_eval.py``), built once per run: under a pipeline its
requests go through the stages (``PipelineLM``), in one process lm-eval's ``HFLM`` scores the model. The evaluation
itself lives in ``eval/``; this module only decides when, on which weights, and where results go.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..eval.downstream import evaluate_models, results_table, zero_shot_tasks
from ..eval.perplexity import evaluate_model_dir, perplexity_from_sums
from ..model.export import assemble_model, export_engine
from ..storage import checkpoint_io as ckpt
from ..storage.names import EXPORT_DIR, FINAL_EVAL, METRICS
from ..supervision import is_main_process
from .hub import Pusher
from .model_card import add_eval_results, card_from_recipe, card_writer, held_out_prompt
from .preflight import check_eval_tasks
from .reporting import RunLog, read_metrics

log = logging.getLogger("hf_asyncpp")


def evaluation_due(training, step: int) -> bool:
    """Whether the run evaluates after ``step`` (``training.eval_steps``; the end has its own evaluation)."""
    return bool(training.eval_steps) and step % training.eval_steps == 0 and step < training.max_steps


class Evaluator:
    """The evaluation points of a run and its end. Every rank calls every method (the engine's evaluation and
    gathers are collective); only the main process records."""

    def __init__(self, out: Path, recipe, engine, tokenizer, accelerator, runlog: RunLog, held_out: torch.Tensor,
                 pusher: Pusher | None = None, held_parts: dict[str, slice] | None = None):
        self.out, self.recipe, self.engine, self.tokenizer = Path(out), recipe, engine, tokenizer
        self.accelerator, self.runlog, self.held_out, self.pusher = accelerator, runlog, held_out, pusher
        self.held_parts = held_parts  # a mixture's sources: their rows of held_out
        self.data_sources: dict[str, int] | None = None  # a mixture's documents and tokens per source, at the end
        check_eval_tasks(recipe.eval)  # lm-eval missing: said now, not after the training
        self._taskset = None

    def taskset(self):
        """lm-eval's tasks of ``eval.tasks``, built on first use and kept for the run (their data read once)."""
        if self._taskset is None:
            from ..eval import lm_eval  # the `eval` extra, checked at the start (check_eval_tasks)

            ev = self.recipe.eval
            self._taskset = lm_eval.load_tasks(zero_shot_tasks(ev.tasks), ev.task_files, ev.limit)
        return self._taskset

    def score_tasks(self, scorer=None, model=None) -> dict:
        """``{task: metrics}`` by lm-eval: through the pipeline's ``scorer`` (collective: every rank calls it, with
        the same tasks) or, in one process, on ``model`` with lm-eval's ``HFLM``."""
        from ..eval import lm_eval

        main = self.accelerator.is_main_process
        if scorer is not None:
            lm = lm_eval.PipelineLM(scorer, self.tokenizer, quiet=not main)
        else:
            lm = lm_eval.hf_lm(model, self.tokenizer, device=self.accelerator.device)
        return lm_eval.score(lm, self.taskset())[0]

    def perplexity(self, step: int) -> dict:
        """Held-out loss and perplexity of the newest weights, through the engine, recorded (``eval_loss``,
        ``eval_perplexity``, ``eval_tokens``; for a mixture also ``eval_loss/<source>``, and ``eval_loss`` over all its
        sources' held-out tokens); the shipped ``evaluate`` metric computes them."""
        mbs = self.recipe.pipeline.microbatch_size
        if not self.held_parts:
            nll, n = self.engine.eval_nll(self.held_out, mbs)  # forward-only, through the stages
            return self.runlog.eval(step, nll, n, perplexity_from_sums([nll], [n]))
        sums = {name: self.engine.eval_nll(self.held_out[rows], mbs) for name, rows in self.held_parts.items()}
        per_source = {f"eval_loss/{name}": perplexity_from_sums([nll], [n])["eval_loss"] for name, (nll, n) in sums.items()}
        nlls, counts = zip(*sums.values())
        return self.runlog.eval(step, sum(nlls), sum(counts), perplexity_from_sums(nlls, counts), per_source)

    def at_step(self, step: int) -> dict:
        """An evaluation point during training: :meth:`perplexity`, then :meth:`tasks`. Returns the perplexity record."""
        rec = self.perplexity(step)
        log.info("step %d: eval_loss %.4f perplexity %.2f", step, rec["eval_loss"], rec["eval_perplexity"])
        self.tasks(step)
        return rec

    def tasks(self, step: int) -> dict | None:
        """``eval.tasks`` on the newest weights, when ``eval.during_training`` is set.

        lm-eval scores them. Under the pipeline its requests go through the stages (``engine.scorer()``: collective,
        each rank its stage's weights, forward only); in one process the weights are gathered
        (``engine.full_state_dict``) into a model on the main process's training device, scored by ``HFLM``.
        Recorded as ``eval/<task>/<metric>``. Returns the results on the main process, None elsewhere or when there
        is nothing to do.
        """
        ev = self.recipe.eval
        if not (ev.during_training and zero_shot_tasks(ev.tasks)):
            return None
        scorer = self.engine.scorer()
        if scorer is not None:  # every rank: the batches go through the stages
            res = self.score_tasks(scorer)
            if not self.accelerator.is_main_process:
                return None
        else:
            weights = self.engine.full_state_dict()  # collective under data parallelism: on the main process only
            if not self.accelerator.is_main_process:
                return None
            model = assemble_model(weights, self.engine.config).to(self.accelerator.device)  # shares the weights
            res = self.score_tasks(model=model)
        self.runlog.record(step, {f"eval/{t}/{m}": r[m] for t, r in res.items() for m in ("acc", "acc_norm") if m in r})
        return res

    def finish(self, step: int, tokens: int, loss_curve: Path | None) -> dict:
        """The end of a training run: ``out/export`` written by every stage (``export_engine``, collective), its
        perplexity read back (``engine.reload_nll``, collective: through the pipeline, each stage its own tensors;
        else a ``from_pretrained`` reload on the main process), the downstream tasks when the recipe asks (through
        the stages where they can read the export, else on the main process), then on the main process the Hub push
        and ``final_eval.json`` (other ranks return {})."""
        out, recipe = self.out, self.recipe
        main = is_main_process()
        metrics = read_metrics(out / METRICS) if main else []
        card = card_writer({**card_from_recipe(recipe, step, tokens, metrics, loss_curve=str(loss_curve) if loss_curve else None),
                            "prompt": held_out_prompt(self.tokenizer, self.held_out)}) if main else None
        export_dir = export_engine(self.engine, out / EXPORT_DIR, tokenizer=self.tokenizer, card=card)
        # read back through the pipeline, each stage its own tensors (collective): the whole model never sits on one
        # device beside a stage; None where a stage cannot be read alone, or in one process
        sums = self.engine.reload_nll(out / EXPORT_DIR, self.held_out, self.recipe.pipeline.microbatch_size)
        ev = recipe.eval
        tasks = zero_shot_tasks(ev.tasks)
        # the downstream tasks of the export through the stages too (collective), each stage scoring with the
        # tensors it reads from the folder; None in one process, or for a folder a stage cannot read alone: then
        # the main process scores the folder whole with lm-eval's HFLM (evaluate_models)
        scorer = self.engine.scorer(out / EXPORT_DIR) if tasks else None
        staged = None
        if scorer is not None:
            staged = self.score_tasks(scorer)
            del scorer
        if not main:
            return {}
        evals = [m for m in metrics if "eval_loss" in m]
        if sums is not None:
            reloaded = perplexity_from_sums([sums[0]], [sums[1]])
        else:  # the whole folder with from_pretrained, on this process's training device (resolve_device)
            reloaded = evaluate_model_dir(export_dir, self.held_out, bf16=self.recipe.training.bf16)
        result = {"export_dir": str(export_dir), "export_eval_loss": reloaded["eval_loss"],
                  "export_eval_perplexity": reloaded["eval_perplexity"], "untrained_eval_perplexity": evals[0]["eval_perplexity"] if evals else None}
        if self.data_sources is not None:  # a mixture: what each source gave, and its held-out loss at the end
            last = evals[-1] if evals else {}
            result["data_sources"] = {**self.data_sources, **{k: v for k, v in last.items() if k.startswith("eval_loss/")}}
        if ev.tasks:
            if staged is not None:
                res = {**staged, **({"perplexity": reloaded} if "perplexity" in ev.tasks else {})}
            else:
                res = evaluate_models([str(export_dir)], ev.tasks, task_files=ev.task_files, limit=ev.limit,
                                      perplexity_blocks=self.held_out,
                                      taskset=self.taskset() if tasks else None)[str(export_dir)]
            add_eval_results(export_dir, res, task_files=ev.task_files)
            result["downstream"] = res
            log.info("downstream evaluation of the export:\n%s", results_table({str(export_dir): res}))
        if self.pusher is not None:  # the final model, after the pushes already queued; wait for all of them
            self.pusher.push(export_dir, commit_message=f"hf_asyncpp export after {step} steps")
            result["hub_commit"] = self.pusher.wait()[-1]
        ckpt.save_json(out / FINAL_EVAL, result)
        return result  # said once, by the end summary (cli/train.py: end_summary), not logged here too
