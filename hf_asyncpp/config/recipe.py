"""Typed recipe: YAML -> nested dataclasses, strictly validated.

Field names follow ``transformers.TrainingArguments`` where one exists, so HF
users can read a recipe without a manual. Every error names the dotted field and
what is allowed, because a typo in a 10-hour run's recipe should cost seconds.
"""
from __future__ import annotations

import codecs
import dataclasses
import difflib
import json
import logging
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

import yaml

from ..errors import RecipeError
from ..schedules.records import (NO_PIPELINE, SCHEDULES, get_schedule, get_simulated_delay, one_step_delay,
                                 pipelined)
from ..storage.write import write_file
from .names import FOREIGN_NAMES
from .optimizer import EF_LEARNED, OptimizerConfig
from .sources import ALTERNATIVES, DataConfig, ModelConfig, bounds as _range

log = logging.getLogger("hf_asyncpp")

__all__ = [
    "RecipeError",
    "ModelConfig",
    "DataConfig",
    "PipelineConfig",
    "OptimizerConfig",
    "TrainingConfig",
    "HubConfig",
    "EvalConfig",
    "Recipe",
    "load_recipe",
    "recipe_from_dict",
    "recipe_to_dict",
    "apply_overrides",
    "save_recipe",
]


SchedulerName = Literal["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                        "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay"]
"""transformers' ``SchedulerType`` values that need no metric (a test keeps this list equal to transformers')."""


@dataclass(kw_only=True)
class PipelineConfig:
    schedule: Literal["2bw", "1f1b", "zbh1", "gpipe", "pipedream", "none", "interleaved1f1b", "zbv", "dualpipev"] = "none"
    """Pipeline schedule; ``none`` runs the whole model in each process. ``zbh1``: 1F1B with each backward split
    into the input gradient and the weight gradient, the latter filling the cool-down (synchronous, 1F1B's
    numbers). ``interleaved1f1b``, ``zbv`` and ``dualpipev`` hold several stages per process: ``hf-asyncpp plan``
    compares them; training refuses them (the executor runs one stage per process)."""
    num_stages: int = field(default=1, metadata=_range(lo=1))
    num_microbatches: int = field(default=4, metadata=_range(lo=1))
    """Microbatches per optimizer step (gradients accumulated over them)."""
    microbatch_size: int = field(default=4, metadata=_range(lo=1))
    """Sequences per microbatch."""
    layers_per_stage: Union[Literal["auto"], list[int], None] = None
    """Decoder layers per stage: a list; ``auto``: measured at start on the machine that trains (forward, backward
    and optimizer step of each layer, the embedding and the head; cached, printed); None: balanced by the FLOPs
    cost model."""
    extra_warmup: int = field(default=0, metadata=_range(lo=0))
    """1f1b/2bw: forwards each non-last stage runs ahead of plain 1F1B (one microbatch of activations each);
    the next stage then finds its input waiting, which absorbs jitter between nearly balanced stages."""
    p2p_timeout_s: float = field(default=90.0, metadata=_range(lo=0.0, lo_open=True))
    """A neighbouring stage silent for this long (no activation or gradient arrives) once the stream's first step is
    done is declared hung, and the job ends with the rank named. A peer that dies is found at once whatever this is
    (gloo: its connection closes; NCCL: the launcher ends the other ranks), so this only bounds a hang: with the
    launcher's 30 s for the other ranks to exit, a hung job ends within 2 minutes (torchtitan waits 100 s); the first
    step and the checkpoints have ``init_timeout_s``."""
    recv_wait: Literal["auto", "poll", "block"] = "auto"
    """How a rank waits for a neighbour's activations or gradients: ``poll`` spins on the transfer (yielding its
    core to its own threads at every turn), as MPI waits by default, so the core never idles between actions;
    ``block`` sleeps in the wait; ``auto`` polls on CPU when the node's ranks fit its cores, else blocks
    (``pipeline/p2p.py: polls``). On a VM an idle virtual CPU halts, and a rank that slept ran its next forwards and
    backwards up to 25% slower (docs/benchmarks.md, "Waiting by polling": +4% in process, within the noise through
    the command line). NCCL's receives are waited for by the stream, whatever this says."""
    collective_timeout_s: float = field(default=90.0, metadata=_range(lo=0.0, lo_open=True))
    """How long an all-reduce of a training step (data-parallel gradients, the grad norm, the loss reports; NCCL's
    watchdog) may wait for a slow replica once the stream's first step is done, before the job is declared hung."""
    init_timeout_s: float = field(default=900.0, metadata=_range(lo=0.0, lo_open=True))
    """The longer budget of what may be slow without hanging: setting up the process groups, the first step of each
    stream of steps (after the start, a resume, an evaluation or a checkpoint: compiling, the data's first read, a
    neighbour still writing its checkpoint), and the gathers of checkpoints, exports and evaluations. A rank that
    does not answer within it is named (``PeerFailure``)."""

    @property
    def split(self) -> Optional[list[int]]:
        """The explicit split, or None where the FLOPs model decides (``None``, or ``auto`` not yet measured)."""
        return self.layers_per_stage if isinstance(self.layers_per_stage, list) else None


@dataclass(kw_only=True)
class TrainingConfig:
    output_dir: str = "runs/default"
    max_steps: int = field(default=100, metadata=_range(lo=1))
    warmup_steps: Union[int, float] = field(default=0, metadata=_range(lo=0))
    """Linear warm-up from 0 to the peak lr, as transformers 5: an integer is a number of steps, a number in [0, 1)
    a fraction of ``max_steps``."""
    warmup_ratio: Optional[float] = field(default=None, metadata=_range(lo=0.0, hi=1.0))
    """Deprecated (as in transformers 5): use ``warmup_steps`` with a number below 1."""
    lr_scheduler_type: SchedulerName = "linear"
    """A ``transformers.get_scheduler`` name, with its meaning: ``cosine`` decays to 0, ``cosine_with_min_lr`` to
    ``lr_scheduler_kwargs.min_lr_rate`` of the peak, ``constant`` has no warm-up (``constant_with_warmup`` has)."""
    lr_scheduler_kwargs: dict = field(default_factory=dict)
    """Extra arguments of the schedule (transformers' ``scheduler_specific_kwargs``), e.g. ``{min_lr_rate: 0.1}``
    for ``cosine_with_min_lr``, ``{num_decay_steps: 100}`` for ``warmup_stable_decay``."""
    max_grad_norm: float = field(default=1.0, metadata=_range(lo=0.0))
    """Global gradient-norm clip across all stages (0 disables)."""
    seed: int = 42
    bf16: bool = False
    """bf16 autocast for forward and backward; the optimizer's weights and state stay fp32. In a pipeline each weight
    version holds the matrices autocast casts, and the MoE expert stacks, as one bf16 copy made at its step (no
    per-microbatch casts; the experts' grouped GEMMs run in bf16)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer in the backward (the model's own ``GradientCheckpointingLayer``, non-reentrant):
    an in-flight microbatch keeps only its layers' inputs, for about one more forward of compute."""
    torch_compile: Optional[bool] = None
    """``torch.compile`` each decoder layer (the Trainer's name): unset, on a GPU and off on CPU. Composes with the
    weight versions (a layer's weights are its compiled graph's inputs), activation checkpointing and every schedule;
    the losses are the eager ones within rounding."""
    torch_compile_backend: Optional[str] = None
    """The ``torch.compile`` backend (the Trainer's name); unset: ``inductor``."""
    fused_loss: Union[bool, Literal["auto"]] = "auto"
    """The last stage's loss (and the single-process engine's) as a chunked fused linear cross-entropy: the head's
    GEMM, log-softmax, loss and gradients a chunk of tokens at a time in the forward, never the whole fp32 logits
    (at its peak the hidden states' fp32 gradient and one chunk's logits, instead of about 12 bytes per logit:
    3.9 KB per token instead of 590 KB at hidden 960, vocab 49,152; ``model/fused_loss.py``). ``auto``: on where
    the model's head is a plain linear layer under transformers' ``ForCausalLMLoss`` (not Gemma-2/3's soft-capping,
    Cohere's or Granite's logit scaling); ``true`` requires it; ``false`` keeps transformers' head and loss."""
    logging_steps: int = field(default=10, metadata=_range(lo=1))
    eval_steps: int = field(default=0, metadata=_range(lo=0))
    """Evaluate every N steps (0: only at the end)."""
    save_steps: int = field(default=0, metadata=_range(lo=0))
    """Checkpoint every N steps (0: only at the end)."""
    save_total_limit: Optional[int] = field(default=2, metadata=_range(lo=1))
    resume_from_checkpoint: Union[str, bool, None] = None
    """``latest`` or a checkpoint directory; ``true`` (the Trainer's value) means ``latest``."""
    overwrite_output_dir: bool = False
    """A run that resumes nothing stops before writing anything when ``output_dir`` holds another run (its
    checkpoints, metrics, export); true: that run is removed first (the Trainer's name)."""
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])
    """accelerate trackers (tensorboard, wandb, mlflow, trackio, ...); ``all``: every installed one; [] or [none]
    disables. A tracker whose package is not installed is an error naming it."""
    project: Optional[str] = None
    """The trackers' project (tensorboard's folder under ``output_dir/logs``, wandb's project). Unset: the tracker's
    own variable where it is set (WANDB_PROJECT, COMET_PROJECT_NAME), else ``hf_asyncpp``."""
    run_name: Optional[str] = None
    """The trackers' run name (default: the output directory's name); a resumed run continues the same tracker run."""
    peak_tflops: Optional[float] = field(default=None, metadata=_range(lo=0.0, lo_open=True))
    """Peak dense TFLOP/s of one device, for ``train/mfu`` (known GPUs are looked up; CPUs have no MFU)."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A step whose gradient norm (or loss) is not finite: ``stop`` ends the run with a ``NonFiniteError`` naming the
    step, its checkpoints as they were (a pipeline finds out when the step's report lands, so STEP never waits for
    the device); ``skip`` leaves the weights as they were and counts it (``skipped_nonfinite`` in metrics.jsonl):
    deciding before the step, it reads the norm back once per step."""
    max_consecutive_skips: int = field(default=10, metadata=_range(lo=1))
    """``on_nonfinite: skip`` gives up (``NonFiniteError``, exit code 3) after this many skipped steps in a row: the
    model has stopped training, and going on would save and export it as if it had."""
    max_skipped_fraction: float = field(default=0.05, metadata=_range(lo=0.0, hi=1.0))
    """``on_nonfinite: skip`` also gives up once more than this fraction of ``max_steps`` was skipped in all, so a run
    that exits 0 trained at least the rest."""
    torch_threads: Optional[int] = field(default=None, metadata=_range(lo=1))
    """Intra-op threads per process (None: 1 per rank when several ranks share the CPU)."""
    stop_after_steps: Optional[int] = field(default=None, metadata=_range(lo=1))
    """Checkpoint and exit at this step without changing the schedule (like Megatron's --exit-interval);
    continue later with ``resume_from_checkpoint: latest``."""
    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGINT", "SIGUSR1"])
    """Signals that stop the run safely: every rank finishes its step, one checkpoint is saved at a step they agree on
    (within 4 steps of the signal), and the run exits with code 10 and one line naming the checkpoint. SLURM's
    preemption, ``scancel`` and a time limit send SIGTERM; ``--signal=USR1@120`` asks for SIGUSR1 two minutes before
    the limit; a second SIGINT (Ctrl-C) stops at once, unsaved. [] keeps the signals' default (the process dies)."""
    max_restarts: int = field(default=0, metadata=_range(lo=0))
    """``hf-asyncpp train`` starting the stage processes itself: restart them this many times after a failure (as
    ``torchrun --max-restarts``); a restarted run resumes from the newest verified checkpoint."""
    export: bool = True
    """Export an HF folder (``output_dir/export``) and evaluate it at the end."""


@dataclass(kw_only=True)
class HubConfig:
    push_to_hub: bool = False
    hub_model_id: Optional[str] = None
    hub_strategy: Literal["end", "every_save", "checkpoint", "all_checkpoints"] = "end"
    """As the HF Trainer's: ``end`` pushes the exported model at the end; ``every_save`` also pushes the model (a
    loadable HF folder) at every checkpoint; ``checkpoint`` also pushes the latest checkpoint to ``last-checkpoint/``
    (resumable); ``all_checkpoints`` pushes every checkpoint to its own folder. Pushes run in the background."""
    private: bool = True
    license: Optional[str] = None
    """Card metadata, e.g. ``apache-2.0``."""
    language: Optional[list[str]] = None
    """Card metadata, e.g. ``[en]``."""


@dataclass(kw_only=True)
class EvalConfig:
    tasks: list[str] = field(default_factory=list)
    """Tasks run on the export at the end: hellaswag, piqa, arc_easy, arc_challenge, mmlu, mmlu_<subject>, perplexity
    (with ``backend: lm_eval``: any lm-eval task name)."""
    task_files: Optional[dict] = None
    """Local task data by task name (the Hub record format); tasks without a file stream from the Hub."""
    limit: Optional[int] = field(default=None, metadata=_range(lo=1))
    """Documents per task, the first ones, as lm-eval's ``--limit`` (per subject for MMLU; None: all)."""
    backend: Literal["hf_asyncpp", "lm_eval"] = "hf_asyncpp"
    """Scorer of the tasks on the export: this package's (offline, lm-eval's task definitions) or lm-evaluation-harness
    itself (needs ``pip install hf_asyncpp[eval]``)."""
    during_training: bool = False
    """Also score ``tasks`` (not perplexity) every ``training.eval_steps`` on the newest weights, logged as
    ``eval/<task>/acc_norm``; always with this package's scorer."""


@dataclass(kw_only=True)
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    hub: HubConfig = field(default_factory=HubConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    @property
    def tokens_per_step(self) -> int:
        p = self.pipeline
        return p.num_microbatches * p.microbatch_size * self.data.seq_len


# ---------------------------------------------------------------- conversion


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = " or ".join(_type_name(a) for a in args)
        return f"{inner} or null" if len(args) < len(typing.get_args(tp)) else inner
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict or tp is dict:
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _convert(value: Any, tp, where: str):
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, where)
            except RecipeError as e:
                errors.append(e)
        raise RecipeError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        # YAML reads `simulate_delay: 1` as an int; the allowed values are strings.
        cand = str(value) if isinstance(value, (int, str)) and not isinstance(value, bool) else value
        if cand not in allowed:
            raise RecipeError(f"{where}: {value!r} is not allowed; choose one of {', '.join(map(repr, allowed))}")
        return cand
    if origin is list:
        (inner,) = typing.get_args(tp)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool) and inner is str:
            value = [value]  # `report_to: tensorboard` is a common shorthand
        if not isinstance(value, (list, tuple)):
            raise RecipeError(f"{where}: expected {_type_name(tp)}, got {value!r}")
        return [_convert(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise RecipeError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise RecipeError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecipeError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `3e-4` as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecipeError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise RecipeError(f"{where}: expected a string, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    raise TypeError(f"unsupported recipe type {tp} at {where}")


def _check_range(value, meta, where):
    if value is None or isinstance(value, str) or not meta or "lo" not in meta:
        return  # a Literal alternative of a numeric field (ef_lambda: auto) has no range
    lo, hi, lo_open = meta["lo"], meta["hi"], meta["lo_open"]
    bad = (lo is not None and (value <= lo if lo_open else value < lo)) or (hi is not None and value > hi)
    if bad:
        lo_s = "" if lo is None else (f"> {lo}" if lo_open else f">= {lo}")
        hi_s = "" if hi is None else f"<= {hi}"
        allowed = " and ".join(s for s in (lo_s, hi_s) if s)
        raise RecipeError(f"{where}: {value!r} is out of range; allowed: {allowed}")


def _build(cls, data, where: str):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{where or 'recipe'}: expected a mapping of fields, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise RecipeError(_unknown_field(where, unknown[0], fields))
    kwargs = {}
    for name, value in data.items():
        dotted = f"{where}.{name}" if where else name
        kwargs[name] = _convert(value, hints[name], dotted)
        _check_range(kwargs[name], fields[name].metadata, dotted)
    return cls(**kwargs)


STOP_SIGNALS_ALLOWED = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")


def _unknown_field(where: str, name: str, fields, *, flag: bool = False) -> str:
    """The error for ``name``, not a field of section ``where`` ("": the top level): the field that means the same
    when it is another tool's name (``FOREIGN_NAMES``) or a field of another section, else the closest field and the
    allowed ones. ``flag``: names written as on the command line (``--data.seq_len``)."""
    dash = "--" if flag else ""
    full = f"{dash}{where + '.' if where else ''}{name}"
    if name in FOREIGN_NAMES:
        whose, here, note = FOREIGN_NAMES[name]
        whose += "'" if whose.endswith("s") else "'s"
        if here is None:
            return f"{full}: {whose} name; {note}"
        return f"{full}: {whose} name; here it is {dash}{here}{f' ({note})' if note else ''}"
    elsewhere = [f"{dash}{s.name}.{name}" for s in dataclasses.fields(Recipe) if s.name != where
                 and name in {f.name for f in dataclasses.fields(typing.get_type_hints(Recipe)[s.name])}]
    if elsewhere:
        return f"{full}: unknown field{' of ' + where if where else ''}; here it is {' or '.join(elsewhere)}"
    near = difflib.get_close_matches(name, list(fields), n=1, cutoff=0.75)
    return (f"{full}: unknown field;{f' did you mean {near[0]!r}?' if near else ''} allowed fields"
            f"{' of ' + where if where else ''}: " + ", ".join(sorted(fields)))


def _cross_checks(r: Recipe) -> None:
    """Constraints between fields, named by the field a user would change."""
    if (r.model.config is None) == (r.model.name_or_path is None):
        both = "; both are set: remove one (--model.config=null removes the recipe's)" if r.model.config is not None else ""
        raise RecipeError(f"model: give exactly one of model.config (random init) or model.name_or_path{both}")
    if r.model.config is not None and "model_type" not in r.model.config:
        raise RecipeError("model.config.model_type: missing; give a transformers model_type such as 'llama'")
    bad = [n for n in r.training.stop_signals if n not in STOP_SIGNALS_ALLOWED]
    if bad:
        raise RecipeError(f"training.stop_signals: {', '.join(map(repr, bad))} cannot be caught for a safe stop; choose from "
                          f"{', '.join(STOP_SIGNALS_ALLOWED)} ([] keeps the signals' default)")
    p = r.pipeline
    delay = get_simulated_delay(r.optimizer.simulate_delay)
    o = r.optimizer
    if not pipelined(p.schedule) and p.num_stages != 1 and not delay.per_stage and o.ef_lambda != EF_LEARNED:
        raise RecipeError(f"pipeline.num_stages: {p.num_stages} needs a pipeline schedule; set pipeline.schedule to one of {', '.join(SCHEDULES)}")
    record = get_schedule(p.schedule) if pipelined(p.schedule) else None
    if record is not None and not record.runs_in_executor:
        raise RecipeError(f"pipeline.schedule: {p.schedule!r} holds {record.stages_per_rank} stages per process, and the "
                          f"executor runs one stage per process: interleaved and V-shaped schedules are planner-only for "
                          f"now (hf-asyncpp plan compares them with these for any recipe); train with one of "
                          f"{', '.join(SCHEDULES)}")
    if p.schedule in SCHEDULES:  # the schedule's own constraints (m >= p for 2bw, ...), named by their knob
        try:
            SCHEDULES[p.schedule].check(p.num_stages, p.num_microbatches, p.extra_warmup)
        except ValueError as e:
            raise RecipeError(_knob(str(e))) from None
    if p.split is not None and len(p.split) != p.num_stages:
        raise RecipeError(f"pipeline.layers_per_stage: {len(p.layers_per_stage)} entries for {p.num_stages} stages; give one per stage")
    one_step = one_step_delay(p.schedule, o.simulate_delay)
    if o.ef_lambda == EF_LEARNED and (o.delay_correction != "error_feedback" or not one_step):
        raise RecipeError("optimizer.ef_lambda: learned needs optimizer.delay_correction: error_feedback under a one-step "
                          f"delay (pipeline.schedule: 2bw, or optimizer.simulate_delay: 1); here the schedule is "
                          f"{p.schedule!r} and simulate_delay {o.simulate_delay!r}")
    if o.fused and o.name != "adamw":
        raise RecipeError(f"optimizer.fused: true is torch's fused AdamW kernel; it needs optimizer.name: adamw, not "
                          f"{o.name!r} (allowed with fused: adamw)")
    if o.shard_across_replicas and o.ef_lambda == EF_LEARNED:
        raise RecipeError("optimizer.shard_across_replicas: true does not support optimizer.ef_lambda: learned (its "
                          "cosine spans every tensor of the stage); use a number or 'auto', or do not shard")
    if o.delay_start_step and not one_step:
        raise RecipeError(f"optimizer.delay_start_step: {o.delay_start_step} starts a one-step delay late; it needs "
                          f"pipeline.schedule: 2bw (or simulate_delay: 1 with schedule none), not {p.schedule!r}")
    if delay.delayed and pipelined(p.schedule):
        raise RecipeError(
            f"optimizer.simulate_delay: {r.optimizer.simulate_delay!r} is a single-process research mode; "
            f"use it with pipeline.schedule {NO_PIPELINE!r} (the {p.schedule!r} schedule produces its delay for real)"
        )
    t = r.training
    if isinstance(t.resume_from_checkpoint, bool):  # the Trainer's boolean: true resumes the newest checkpoint
        t.resume_from_checkpoint = "latest" if t.resume_from_checkpoint else None
    if isinstance(t.warmup_steps, float) and t.warmup_steps >= 1 and not t.warmup_steps.is_integer():
        raise RecipeError(f"training.warmup_steps: {t.warmup_steps} is neither a number of steps (an integer) nor a "
                          "fraction of max_steps (below 1)")
    if isinstance(t.warmup_steps, float) and t.warmup_steps >= 1:
        t.warmup_steps = int(t.warmup_steps)
    if t.warmup_ratio is not None:
        if t.warmup_steps:
            raise RecipeError("training.warmup_ratio: deprecated and given together with training.warmup_steps; "
                              f"keep only warmup_steps: {t.warmup_ratio} (a number below 1 is a fraction of max_steps)")
        _say_once(f"training.warmup_ratio is deprecated (as in transformers 5): write warmup_steps: {t.warmup_ratio} "
                  "(a number below 1 is a fraction of max_steps)")
    if t.lr_scheduler_type == "constant" and (t.warmup_steps or t.warmup_ratio):
        _say_once("training.lr_scheduler_type: constant has no warm-up (transformers' meaning); the warm-up is "
                  "ignored. For a warm-up use lr_scheduler_type: constant_with_warmup")
    if r.hub.push_to_hub and not r.hub.hub_model_id:
        raise RecipeError("hub.hub_model_id: required when hub.push_to_hub is true (e.g. 'user/my-model')")
    if r.data.train_files is not None and r.data.dataset is not None:
        raise RecipeError("data: give data.train_files or data.dataset, not both: remove one (--data.dataset=null "
                          "removes the recipe's)")
    _check_encoding(r.data.encoding)


_ASCII = bytes(range(128))


def _check_encoding(name: str) -> None:
    """``data.encoding`` is a text codec that reads ASCII bytes as ASCII: the file screening and datasets' json
    builder find lines, JSON syntax and NUL bytes by their bytes, before decoding (UTF-16 or EBCDIC would break both)."""
    try:
        codecs.lookup(name)
        keeps_ascii = _ASCII.decode(name) == _ASCII.decode("ascii")
    except (LookupError, ValueError):  # an unknown name; a codec of bytes to bytes (base64) or text to text (rot13)
        raise RecipeError(f"data.encoding: {name!r} is not a text encoding Python knows; give a codec name such as "
                          "utf-8, latin-1 or cp1252") from None
    if not keeps_ascii:
        raise RecipeError(f"data.encoding: {name!r} does not read ASCII bytes as ASCII, which reading lines and JSON "
                          f"needs; convert the files to UTF-8 (e.g. iconv -f {name} -t utf-8) and leave data.encoding unset")


def recipe_from_dict(data: dict) -> Recipe:
    r = _build(Recipe, data, "")
    _cross_checks(r)
    return r


def recipe_to_dict(r: Recipe) -> dict:
    return dataclasses.asdict(r)


def _parse_scalar(text: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply command-line overrides to a raw recipe dict: ``--section.field=value`` or ``--section.field value``
    (values parsed as YAML; a bare ``--section.flag`` is true for a true/false field), as the HF Trainer's
    ``HfArgumentParser`` and torchtitan read them. Each names a field of the recipe or a key inside a mapping field
    (``--model.config.hidden_size``); another name is an error naming the field meant, before anything else is read.
    A field given here replaces its alternative in the file (:func:`_yield_to_command_line`)."""
    data = json.loads(json.dumps(data))  # deep copy of plain data
    given = set()
    for key, value in _pairs(overrides):
        parts = key.split(".")
        node = data
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise RecipeError(f"override --{key}: {part} is not a section")
            node = nxt
        node[parts[-1]] = _parse_scalar(value)
        given.add(key)
    _yield_to_command_line(data, given)
    return data


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the tool's own arguments, the recipe overrides) of a command line that mixes them (``hf-asyncpp plan``,
    ``compare``): an override is a ``--`` option whose name has a dot (``--training.max_steps=5`` or
    ``--training.max_steps 5``, the value then the next argument unless that is an option), as ``train`` reads
    them; the tools' own options have no dot in their names, so argparse never sees an override's value."""
    own, overrides, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and "." in arg.partition("=")[0]:
            overrides.append(arg)
            if "=" not in arg and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                i += 1
                overrides.append(argv[i])
        else:
            own.append(arg)
        i += 1
    return own, overrides


def _pairs(args: list[str]) -> list[tuple[str, str]]:
    """(dotted field, value text) of each override. A ``--field`` without ``=`` takes the next argument as its value
    unless that is another ``--`` option or there is none: then it is ``true`` for a true/false field (as
    ``--bf16`` is for the Trainer) and an error naming the field otherwise, never a silent default."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise RecipeError(f"override {arg!r}: expected --section.field=value or --section.field value, e.g. "
                              "--training.max_steps=50")
        key, eq, value = arg[2:].partition("=")
        tp = _field_type(key)
        if not eq:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                i += 1
                value = args[i]
            elif _takes_bool(tp):
                value = "true"
            else:
                kind = f" ({_type_name(tp)})" if tp is not None else ""
                raise RecipeError(f"--{key}: no value given{kind}; write --{key}=VALUE or --{key} VALUE")
        out.append((key, value))
        i += 1
    return out


def _field_type(key: str):
    """The type of the recipe field a dotted key names; None for a key inside a mapping field (``model.config.*``,
    whose keys the model's config class checks: ``run/preflight.py``). An unknown name is an error naming the field
    meant (:func:`_unknown_field`), written as on the command line."""
    cls, where, parts = Recipe, "", key.split(".")
    for i, part in enumerate(parts):
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            raise RecipeError(_unknown_field(where, part, names, flag=True))
        tp = typing.get_type_hints(cls)[part]
        where = f"{where}.{part}" if where else part
        if i == len(parts) - 1:
            return tp
        if dataclasses.is_dataclass(tp):
            cls = tp
        elif any(a is dict or typing.get_origin(a) is dict for a in (typing.get_args(tp) or (tp,))):
            return None
        else:
            raise RecipeError(f"override --{key}: {where} is a field ({_type_name(tp)}), not a section")
    return None


def _takes_bool(tp) -> bool:
    """Whether a field's type admits true/false (``bool``, ``Optional[bool]``, ``resume_from_checkpoint``'s union)."""
    return tp is bool or bool in typing.get_args(tp)


def _yield_to_command_line(data: dict, given: set[str]) -> None:
    """Of two alternative fields (``ALTERNATIVES``), one given on the command line replaces the recipe file's other:
    ``--model.name_or_path=my-model`` over a random-init recipe means "train my-model", not "give both"."""
    for section, a, b in ALTERNATIVES:
        node = data.get(section)
        for mine, other in ((a, b), (b, a)):
            if (isinstance(node, dict) and f"{section}.{mine}" in given and f"{section}.{other}" not in given
                    and node.get(mine) is not None and node.get(other) is not None):
                del node[other]
                _say_once(f"--{section}.{mine} replaces the recipe's {section}.{other} (a recipe gives one of the two)")


_SAID: set[str] = set()


CHECKED = "HF_ASYNCPP_CHECKED"
"""Set for the ranks a process started after it checked the recipe (``launch.spawn``): what it said is said."""


def _say_once(message: str) -> None:
    """A warning about the recipe said by one process of a run, once: the process that starts the ranks (it loads
    the recipe twice: the command, then the checks), or rank 0 under an outside launcher."""
    if os.environ.get("RANK", "0") == "0" and not os.environ.get(CHECKED) and message not in _SAID:
        _SAID.add(message)
        log.warning(message)


def load_recipe(path: str | os.PathLike, overrides: list[str] | None = None) -> Recipe:
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise RecipeError(f"recipe file {str(path)!r} not found") from None
    except IsADirectoryError:
        raise RecipeError(f"recipe file {str(path)!r} is a folder; give the recipe's YAML file (e.g. "
                          "recipes/cpu-tiny.yaml)") from None
    except UnicodeDecodeError as e:
        raise RecipeError(f"recipe file {str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start}); "
                          "save it as UTF-8") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"recipe file {str(path)!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"recipe file {str(path)!r} holds a YAML {type(data).__name__}, not a mapping of sections "
                          "(model:, data:, training:, ...); see recipes/cpu-tiny.yaml")
    return recipe_from_dict(apply_overrides(data, overrides or []))


def save_recipe(r: Recipe, path: str | os.PathLike) -> None:
    """Write the resolved recipe (every default filled in) next to the run's outputs."""
    text = yaml.safe_dump(recipe_to_dict(r), sort_keys=False)
    write_file(path, lambda f: f.write(text.encode("utf-8")))


def _knob(message: str) -> str:
    """A schedule record's message, led by the recipe field a user would change."""
    if "extra_warmup" in message:
        return message if message.startswith("pipeline.") else f"pipeline.extra_warmup: {message}"
    return f"pipeline.num_microbatches: {message}"
