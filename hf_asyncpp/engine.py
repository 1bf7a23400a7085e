"""Engines: the interface the trainer drives, and the single-process engine (the one-stage case).

An engine owns the model (or this rank's pipeline stage), its optimizer, lr scheduler and delay state, and runs
whole optimizer steps. The trainer only hands it a stream of batches and reads back ``StepResult``s, so the
pipeline (``pipeline.executor.PipelineEngine``) plugs into the same loop through the same ``Engine`` protocol.
Data parallelism here is a plain gradient all-reduce over every process.
"""
from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Protocol

import torch
import torch.distributed as dist

from . import supervision
from .config.recipe import Recipe
from .errors import NonFiniteError, RecipeError
from .model.build import autocast, compile_layers, enable_activation_checkpointing, ties
from .model.export import shard_file, write_shard
from .model.fused_loss import HeadCapture, use_fused_loss
from .model.nll import nll_per_block
from .optim import DelaySimulator, apply_delay_correction, build_optimizer
from .optim.delay import lambda_groups, stage_parameter_lists
from .optim.ef import learned_lambda
from .optim.lr import build_scheduler, continue_schedule
from .partition import anatomy
from .partition.moe_aux import expert_token_counts
from .partition.plan import get_module
from .partition.trace import model_kwargs
from .storage import checkpoint_io as ckpt
from .storage.names import MODEL_FILE, OPTIMIZER_FILE
from .storage.staging import StagedFile, Stager
from .topology import Topology, local_device


@dataclass
class StepResult:
    step: int
    loss: float
    grad_norm: float | None
    lr: float
    applied: bool
    skipped_nonfinite: bool = False
    ef_lambda: float | None = None  # ``ef_lambda: learned``: its value after the step (the mean over stages)
    # a MoE model whose config sets ``output_router_logits`` (single-process engine): the router's load-balancing aux
    # loss (the model's ``aux_loss``, before ``router_aux_loss_coef``; mean over microbatches) and the tokens each
    # router call (layer) sent to each expert over the step (this replica's), so a run shows whether its routers stay
    # balanced
    router_aux_loss: float | None = None
    expert_tokens: list[list[int]] | None = None


def finite_step(step: int, grad_norm: float, on_nonfinite: str, loss: float | None = None) -> bool:
    """The one non-finite rule, for ``LocalEngine`` and every pipeline stage's STEP: whether step ``step``'s update
    is applied. Not when its gradient norm (or its loss, where this process has it) is not finite: skipped under
    ``training.on_nonfinite: skip``, NonFiniteError under ``stop``. One function because a schedule is tested
    against its single-process reference step for step: both must skip (or stop at) the same steps.

    ``step`` is the engines' 0-based index; the message names the step as ``metrics.jsonl`` and the progress bar
    number it (``step + 1``), so that the user finds it there.
    """
    if math.isfinite(grad_norm) and (loss is None or math.isfinite(loss)):
        return True
    if on_nonfinite == "stop":
        what = f"gradient norm {grad_norm}" if loss is None else f"loss {loss} or grad norm {grad_norm}"
        raise NonFiniteError(
            f"step {step + 1}: non-finite {what}; stopping (training.on_nonfinite: stop). Checkpoints already written "
            "are left as they are; if this is the first step after a resume, suspect the checkpoint, else lower "
            "optimizer.learning_rate or set training.on_nonfinite: skip")
    return False


class Engine(Protocol):
    """What the trainer drives; ``LocalEngine`` and ``pipeline.executor.PipelineEngine`` implement it."""

    config: object
    """The model's transformers config (saved with checkpoints and exports)."""

    scheduler: torch.optim.lr_scheduler.LambdaLR
    """This process's lr schedule; its ``last_epoch`` counts the updates applied (the same on every stage)."""

    def run(self, batches: Iterable[torch.Tensor] | None, first_step: int, num_steps: int) -> Iterator[StepResult]:
        """Steps [first_step, first_step + num_steps), one batch pulled per step (None: a middle pipeline stage, which
        uses no ids); each step's result yielded in order as soon as it is known. Exhausting the iterator leaves the
        engine drained (ready to save or evaluate)."""

    stopped: bool
    """The last ``run`` ended before its last step, at a stop (a signal, ``supervision``) every rank agreed to."""

    def agree_stop(self) -> bool:
        """At a drain point: whether a stop signal reached any rank (collective)."""

    def train_steps(self, batches: list[torch.Tensor], first_step: int) -> list[StepResult]: ...

    def eval_nll(self, blocks: torch.Tensor, batch_size: int) -> tuple[float, int]: ...

    def reload_nll(self, folder: Path, blocks: torch.Tensor, batch_size: int) -> tuple[float, int] | None:
        """The held-out NLL of an exported folder read back with a bounded footprint (collective), or None: the
        caller then reloads the whole folder with ``from_pretrained``."""

    def scorer(self, folder: Path | None = None):
        """The downstream tasks' scorer through the pipeline's stages, with the newest weights or those of an
        exported ``folder`` (collective; ``pipeline.forward_only.StageScorer``), or None: the caller scores a whole
        model on one process."""

    def full_state_dict(self) -> dict[str, torch.Tensor] | None: ...

    def export_shards(self, folder: Path) -> list[tuple[str, dict[str, int]]] | None:
        """Write this process's weights as shard(s) of an HF folder (collective); the main process gets every shard's
        (file name, {on-disk tensor name: bytes}), no tensors."""

    def checkpoint_files(self, stager: Stager) -> list[StagedFile]:
        """This process's files of a checkpoint, their tensors copied once by ``stager`` (the writing is the
        checkpointer's, in the background); the engine must be drained."""

    def save(self, tmp: Path) -> None:
        """Write this process's files of a checkpoint now, on this thread (a one-off, outside a run's saves)."""

    def load(self, path: Path) -> None: ...

    def profile(self) -> list[dict] | None:
        """Per-stage action timings (collective), None where there is no pipeline."""

    def close(self) -> None: ...


class LocalEngine:
    """Whole model in this process; ``optimizer.simulate_delay`` reproduces the pipeline's delays exactly."""

    def __init__(self, recipe: Recipe, model: torch.nn.Module, topo: Topology, log=print):
        self.recipe, self.topo, self.device = recipe, topo, local_device()
        if recipe.pipeline.expert_parallel > 1:  # the experts' shards and all-to-alls live in the pipeline executor
            raise RecipeError(f"pipeline.expert_parallel: {recipe.pipeline.expert_parallel} runs in the pipeline "
                              "executor; with pipeline.schedule: none set it to 1, or name a schedule (gpipe, 1f1b, "
                              "2bw; one stage is allowed)")
        if recipe.training.gradient_checkpointing:
            enable_activation_checkpointing(model)
        self.model = model.to(self.device)
        if recipe.training.compiles():
            compile_layers(get_module(model, anatomy(model).layers), recipe.training.torch_compile_backend)
        self.config = model.config
        # no KV cache in training or evaluation: transformers would build one per forward, and every compiled layer
        # would guard on its own cache entry (one graph per layer), as the stages' forward does not
        self.forward_kwargs = model_kwargs(model)
        # the loss through the model's own forward, its head and cross-entropy fused (training.fused_loss)
        fused = use_fused_loss(recipe.training.fused_loss, model)
        if recipe.pipeline.vocab_parallel is True:  # one process holds the whole head: nothing to share it with
            raise RecipeError("pipeline.vocab_parallel: true, but pipeline.schedule 'none' trains the whole model in "
                              "one process, which holds the whole output layer; set pipeline.vocab_parallel: false")
        self.capture = HeadCapture(model.get_output_embeddings()) if fused else None
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = apply_delay_correction(build_optimizer(model, recipe.optimizer, log=log), recipe.optimizer,
                                                groups=lambda_groups(model, recipe))
        self.scheduler = build_scheduler(self.optimizer, recipe.training)
        self.delay = DelaySimulator(recipe.optimizer.simulate_delay, *stage_parameter_lists(model, recipe),
                                    start_step=recipe.optimizer.delay_start_step)
        self.nonfinite_skipped = 0
        self.stopped = False  # the last ``run`` ended early, at a stop every replica agreed to
        self._stop_vote = False  # the last step's: a stop signal reached this process (or a replica) by then

    # ------------------------------------------------------------------ training
    def _allreduce_grads(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """The replicas' mean gradients and loss; the stop votes travel in the same all-reduce."""
        vote = supervision.stop_requested()
        if self.topo.dp_size == 1:
            self._stop_vote = vote
            return loss_sum
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads] + [loss_sum.reshape(1).to(grads[0]),
                                                          torch.full((1,), float(vote)).to(grads[0])])
        dist.all_reduce(flat)
        flat /= self.topo.dp_size
        offset = 0
        for p, g in zip(self.params, grads):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(g).clone()
            offset += n
        self._stop_vote = bool(flat[-1] > 0)
        return flat[-2]

    def _one_step(self, step: int, batch: torch.Tensor) -> StepResult:
        """batch: (num_microbatches, microbatch_size, seq_len) token ids of this dp rank."""
        cfg = self.recipe
        m = batch.shape[0]
        self.model.train()
        self.delay.before_forward()
        loss_sum = torch.zeros((), device=self.device)
        batch = batch.to(self.device)
        aux, n_aux, tokens = None, 0, None  # the router's balance (a MoE model with router logits), on the device
        top_k = getattr(self.config, "num_experts_per_tok", None)
        for i in range(m):
            ids = batch[i]
            with autocast(cfg.training.bf16), self._loss_path():
                out = self.model(input_ids=ids, labels=ids, **self.forward_kwargs)
            (out.loss / m).backward()
            loss_sum += out.loss.detach().float()
            if getattr(out, "router_logits", None) and getattr(out, "aux_loss", None) is not None and top_k:
                aux = out.aux_loss.detach().float() + (0 if aux is None else aux)
                n_aux += 1
                counts = expert_token_counts(out.router_logits, top_k)
                tokens = counts if tokens is None else tokens + counts
        self.delay.after_backward()  # the current weights back; a tied head's gradient summed into its parameter
        loss_mean = self._allreduce_grads(loss_sum) / m
        lr = self.optimizer.param_groups[0]["lr"]
        max_norm = cfg.training.max_grad_norm or math.inf
        # under every simulate_delay the gradient applied is the one just computed (at stale weights), so the
        # non-finite decision is taken on the gradient being applied, as the executor's STEP takes it
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        skipped = not finite_step(step, grad_norm, cfg.training.on_nonfinite, float(loss_mean))
        if skipped:
            self.nonfinite_skipped += 1
        else:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.delay.after_step()
        return StepResult(step, float(loss_mean), grad_norm, lr, not skipped, skipped, learned_lambda(self.optimizer),
                          float(aux) / n_aux if n_aux else None, tokens.tolist() if tokens is not None else None)

    @contextlib.contextmanager
    def _loss_path(self):
        """The model's forward with labels computes its loss through the fused head and loss where it is on."""
        if self.capture is None:
            yield
            return
        with self.capture.installed(self.model):
            yield
            self.capture.check_used()

    def run(self, batches: Iterable[torch.Tensor], first_step: int, num_steps: int) -> Iterator[StepResult]:
        batches = iter(batches)
        self.stopped = False
        for k in range(first_step, first_step + num_steps):
            yield self._one_step(k, next(batches))
            if self._stop_vote and k + 1 < first_step + num_steps:  # every replica read the same vote
                self.stopped = True
                return

    def agree_stop(self) -> bool:
        """At a drain point: whether a stop signal reached any replica (collective where there are several)."""
        vote = torch.full((1,), float(supervision.stop_requested()), device=self.device)
        if self.topo.dp_size > 1:
            dist.all_reduce(vote)
        return bool(vote.item() > 0)

    def train_steps(self, batches: list[torch.Tensor], first_step: int) -> list[StepResult]:
        return list(self.run(batches, first_step, len(batches)))

    def profile(self) -> None:
        """No pipeline, nothing to profile."""
        return None

    def close(self) -> None:
        """Nothing to release (the pipeline engine releases its process groups here)."""

    # ------------------------------------------------------------------ eval
    @torch.no_grad()
    def eval_nll(self, blocks: torch.Tensor, batch_size: int) -> tuple[float, int]:
        """Summed next-token NLL and token count over ``blocks`` (split over dp ranks, then all-reduced)."""
        was_training = self.model.training
        self.model.eval()
        mine = blocks[self.topo.dp_rank :: self.topo.dp_size]
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for i in range(0, len(mine), batch_size):
            ids = mine[i : i + batch_size].to(self.device)
            with autocast(self.recipe.training.bf16):
                logits = self.model(input_ids=ids, **self.forward_kwargs).logits
            total[0] += nll_per_block(logits, ids).sum()
            total[1] += ids[:, 1:].numel()
        if self.topo.dp_size > 1:
            dist.all_reduce(total)
        self.model.train(was_training)
        return float(total[0]), int(total[1])

    def reload_nll(self, folder: Path, blocks: torch.Tensor, batch_size: int) -> None:
        """None: this process holds the whole model already, so the caller's ``from_pretrained`` reload of the whole
        folder (the stronger check: transformers' own loading) costs no more than training did."""
        return None

    def scorer(self, folder: Path | None = None) -> None:
        """None: this process holds the whole model, which the caller scores directly."""
        return None

    # ------------------------------------------------------------------ state
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The current weights by original HF name (on the main process)."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def export_shards(self, folder: Path) -> list[tuple[str, dict[str, int]]] | None:
        if not self.topo.is_main:
            return None
        name = shard_file(0, 1)
        return [(name, write_shard(self.model.state_dict(), self.config, folder / name))]

    def checkpoint_files(self, stager: Stager) -> list[StagedFile]:
        """This engine's part of a checkpoint, staged (only dp rank 0 writes the shared state)."""
        if self.topo.dp_rank != 0:
            return []
        staged = stager.stage({"weights": _dedup_tied(self.model), "optimizer": self.optimizer.state_dict(),
                               "delay": self.delay.state_dict()})
        state = {"optimizer": staged["optimizer"], "scheduler": copy.deepcopy(self.scheduler.state_dict()),
                 "delay": staged["delay"], "nonfinite_skipped": self.nonfinite_skipped}
        return [StagedFile(MODEL_FILE, "tensors", staged["weights"]), StagedFile(OPTIMIZER_FILE, "state", state)]

    def save(self, tmp: Path) -> None:
        """Write this engine's part of a checkpoint into ``tmp`` now, on this thread (a one-off)."""
        stager = Stager()
        ckpt.write_staged(tmp, self.checkpoint_files(stager))
        stager.close()

    def load(self, path: Path) -> None:
        weights = ckpt.load_tensors(path / MODEL_FILE)
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        tied = set(_tied_names(self.model))
        missing = [k for k in missing if k not in tied]
        if missing or unexpected:
            raise RuntimeError(f"checkpoint {path}: missing {missing[:5]} unexpected {unexpected[:5]}")
        state = ckpt.load_state(path / OPTIMIZER_FILE)
        recipe_groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state["optimizer"])  # the moments; the hyperparameters stay the recipe's:
        for group, mine in zip(self.optimizer.param_groups, recipe_groups, strict=True):
            group.update(mine)
        continue_schedule(self.optimizer, self.scheduler, state["scheduler"])
        self.delay.load_state_dict(state["delay"])
        self.nonfinite_skipped = state["nonfinite_skipped"]


def _tied_names(model) -> list[str]:
    return list(ties(model))


def _dedup_tied(model) -> dict[str, torch.Tensor]:
    """State dict without the tied copies (safetensors refuses shared storage)."""
    sd = model.state_dict()
    for k in _tied_names(model):
        sd.pop(k, None)
    return sd
