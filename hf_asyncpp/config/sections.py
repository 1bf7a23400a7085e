"""The recipe's sections, one dataclass each: model, data, pipeline, training, hub and eval (the optimizer's is
``optimizer.py``); ``config.Recipe`` holds them and ``recipe.py`` loads, converts and cross-checks them.

Every field carries its type, default, allowed range (:func:`bounds`) and a docstring: ``train --help`` and
docs/recipes.md are generated from them (``reference``). Two pairs of fields are alternatives (:data:`ALTERNATIVES`:
a model from a config or a checkpoint, data from a dataset or files), which the command line resolves in
``config.apply_overrides``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, Optional, Union

__all__ = ["ModelConfig", "DataConfig", "SourceConfig", "StoppingStrategy", "PipelineConfig", "TrainingConfig",
           "HubConfig", "EvalConfig", "SchedulerName", "ALTERNATIVES", "bounds"]


def bounds(lo=None, hi=None, lo_open=False):
    """A numeric field's allowed range, as field metadata (checked by ``config._check_range``, listed in docs/recipes.md)."""
    return {"lo": lo, "hi": hi, "lo_open": lo_open}


ALTERNATIVES = (("model", "config", "name_or_path"), ("data", "dataset", "train_files"))
"""(section, field, field): a recipe gives at most one of the two. One given on the command line replaces the other
one of the recipe file, so that ``--model.name_or_path=my-model`` over a random-init recipe trains my-model."""


@dataclass(kw_only=True)
class ModelConfig:
    config: Optional[dict] = None
    """Kwargs for ``AutoConfig.for_model`` (must contain ``model_type``): random init, each key checked against the
    model type's config class before anything runs. Give this or ``name_or_path``; ``--model.name_or_path=...`` on
    the command line replaces a recipe's ``config``."""
    name_or_path: Optional[str] = None
    """A local folder (written by ``save_pretrained``) or a Hub id for ``from_pretrained``: its weights and, unless
    ``tokenizer_name_or_path`` is set, its tokenizer (docs/bring-your-own.md)."""
    tokenizer_name_or_path: Optional[str] = None
    """A tokenizer folder or Hub id. Unset: the tokenizer of ``name_or_path``; with ``config`` (random init), a
    byte-level BPE of ``vocab_size`` trained on the training files and saved with the run (a streamed
    ``data.dataset`` needs a tokenizer given here)."""
    vocab_size: int = field(default=4096, metadata=bounds(lo=256))
    """Vocabulary size of the byte-level BPE trained when no tokenizer is given."""
    attn_implementation: Optional[str] = None
    """``sdpa``, ``eager``, ... (None: the model's default)."""


StoppingStrategy = Literal["all_exhausted", "first_exhausted", "all_exhausted_without_replacement"]
"""When a mixture's epoch ends, under ``datasets.interleave_datasets``' names (``data/mixture.py``)."""


@dataclass(kw_only=True)
class SourceConfig:
    """One source of a weighted mixture (``data.sources``): a Hub dataset, builder or folder, or local files, with its
    own column, config, splits and weight. The other data fields (``seq_len``, ``encoding``, ``shuffle_buffer``,
    ``min_document_tokens``, ``eval_blocks``) are the mixture's."""

    name: Optional[str] = None
    """The source's name in ``metrics.jsonl`` (``eval_loss/<name>``, ``data/<name>/tokens``): letters, digits, ``_``,
    ``-``, ``.``; required, one per source."""
    weight: float = field(default=1.0, metadata=bounds(lo=0.0, lo_open=True))
    """The source's share of the training tokens, relative to the others' weights (normalised to sum to 1)."""
    dataset: Optional[str] = None
    """Hub id, builder name or dataset folder, streamed; give this or ``train_files``."""
    dataset_config: Optional[str] = None
    """Builder config name for ``dataset``."""
    train_split: str = "train"
    """Split of ``dataset`` to train on."""
    eval_split: Optional[str] = None
    """Split of ``dataset`` for the source's ``eval_loss/<name>`` (None: 1 in 50 of its documents held out by hash)."""
    train_files: Optional[list[str]] = None
    """Local files or globs, of one kind (as ``data.train_files``), optionally compressed."""
    eval_files: Optional[list[str]] = None
    """Local held-out files or globs of this source."""
    text_column: Optional[str] = None
    """Column holding the text (None: ``data.text_column``)."""


@dataclass(kw_only=True)
class DataConfig:
    dataset: Optional[str] = None
    """Hub id, datasets builder name or dataset folder, streamed (``load_dataset(dataset, dataset_config,
    split=train_split, streaming=True)``); give this or ``train_files``."""
    dataset_config: Optional[str] = None
    """Builder config name for ``dataset``."""
    train_split: str = "train"
    """Split of ``dataset`` to train on."""
    eval_split: Optional[str] = None
    """Split of ``dataset`` for evaluation (None: 1 in 50 documents of the training stream, chosen by hash, are held out)."""
    train_files: Optional[list[str]] = None
    """Local files or globs, replacing the default corpus: ``.txt``/``.md`` (a document per paragraph) or ``.jsonl``/``.json``,
    optionally compressed (``.gz``, ``.bz2``, ``.xz``, ``.zst``), or ``.parquet`` (compressed inside)."""
    eval_files: Optional[list[str]] = None
    """Local held-out files or globs."""
    text_column: str = "text"
    """Column holding the document text (jsonl, parquet, Hub datasets)."""
    encoding: str = "utf-8"
    """Text encoding of the local text and jsonl files (a Python codec that keeps ASCII as ASCII: ``latin-1``,
    ``cp1252``, ...). A byte not valid in it is read as U+FFFD and its document still trained on; the files and
    documents with such bytes are named in the log and counted (``invalid_utf8_documents``, ``invalid_utf8_replaced``)."""
    seq_len: int = field(default=128, metadata=bounds(lo=2))
    """Tokens per packed training block; at most the model's positions (``max_position_embeddings``)."""
    shuffle_buffer: int = field(default=1000, metadata=bounds(lo=0))
    """Documents in the streaming shuffle buffer (0: no shuffle)."""
    prefetch_batches: int = field(default=2, metadata=bounds(lo=0))
    """Training batches tokenized and packed ahead by a background thread, so a step never waits for text (0: packed
    inline, on the training thread)."""
    eval_blocks: int = field(default=32, metadata=bounds(lo=1))
    """Packed blocks of the held-out stream used for each evaluation."""
    min_document_tokens: Optional[int] = field(default=0, metadata=bounds(lo=0))
    """Documents with fewer tokens are skipped, in training and held-out data alike, and their number is reported
    each epoch. 0: none is; short documents are packed together (as transformers' ``run_clm``); null: ``seq_len``."""
    data_dir: str = "data/sotu"
    """Where the default corpus (State of the Union addresses) is prepared."""
    sources: Optional[list[SourceConfig]] = None
    """A weighted mixture instead of one source: a list of ``{name, weight, dataset, dataset_config, train_split,
    eval_split, train_files, eval_files, text_column}`` (each source ``dataset`` or ``train_files``; replaces
    ``data.dataset``/``train_files``/``eval_files``). Each training block is one source's documents, the source drawn
    by weight with a generator seeded by ``training.seed``, so each source's share of the tokens is its weight;
    every source's position resumes exactly; ``metrics.jsonl`` gets ``data/<name>/documents`` and ``tokens`` and an
    ``eval_loss/<name>`` per source (its own ``eval_blocks`` held-out blocks)."""
    stopping_strategy: StoppingStrategy = "all_exhausted"
    """A mixture's epoch, named as ``datasets.interleave_datasets``: ``all_exhausted`` (a source that runs out starts
    its next epoch, reshuffled, until every source has run out once: the weights hold throughout); ``first_exhausted``
    (the epoch ends when the first source runs out); ``all_exhausted_without_replacement`` (a source that runs out
    leaves the draws until every source has: the others' weights grow). A source that runs out goes on with its next
    epoch, the others where they are: no document is dropped at an epoch's end."""

    def source_configs(self) -> dict[str, tuple["DataConfig", float]]:
        """name -> (the data section one source streams with, its normalised weight); a single source is ``{"": (self,
        1.0)}``."""
        if not self.sources:
            return {"": (self, 1.0)}
        total = sum(s.weight for s in self.sources)
        return {s.name: (replace(
            self, dataset=s.dataset, dataset_config=s.dataset_config, train_split=s.train_split, eval_split=s.eval_split,
            train_files=s.train_files, eval_files=s.eval_files, text_column=s.text_column or self.text_column,
            sources=None), s.weight / total) for s in self.sources}


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
    num_stages: int = field(default=1, metadata=bounds(lo=1))
    """Pipeline stages: the model's decoder layers split into this many consecutive parts, one process each
    (times the data-parallel replicas: ``hf-asyncpp train`` starts them; under a launcher the world size must be a
    multiple). 1 with ``schedule: none`` trains the whole model in each process."""
    num_microbatches: int = field(default=4, metadata=bounds(lo=1))
    """Microbatches per optimizer step (gradients accumulated over them)."""
    microbatch_size: int = field(default=4, metadata=bounds(lo=1))
    """Sequences per microbatch."""
    layers_per_stage: Union[Literal["auto"], list[int], None] = None
    """Decoder layers per stage: a list; ``auto``: measured at start on the machine that trains (forward, backward
    and optimizer step of each layer, the embedding and the head; cached, printed); None: balanced by the FLOPs
    cost model."""
    vocab_parallel: Union[bool, Literal["auto"]] = "auto"
    """The vocabulary layers shared by every stage (Vocabulary Parallelism, Yeung et al., MLSys 2025): each stage
    holds a 1/num_stages shard of the output layer's vocabulary and computes its part of every microbatch's logits
    and loss (a VOCAB pass per microbatch in the schedule), so the decoder layers split evenly instead of around a
    head that weighs one or two layers. ``auto``: on where the planner's simulation says it pays; ``true``/``false``
    force it."""
    expert_parallel: int = field(default=1, metadata=bounds(lo=1))
    """Expert parallelism inside a stage (transformers' ``ep_size``): each MoE layer's experts sharded over this many
    of the stage's data-parallel replicas (it divides their number and the experts'), the routed tokens sent to their
    experts and back with all-to-all collectives. 1: every replica holds every expert. ``hf-asyncpp plan RECIPE
    --gpus N`` weighs it: the expert state per GPU divided by it against the all-to-alls' time on the compute stream."""
    extra_warmup: int = field(default=0, metadata=bounds(lo=0))
    """1f1b/2bw: forwards each non-last stage runs ahead of plain 1F1B (one microbatch of activations each);
    the next stage then finds its input waiting, which absorbs jitter between nearly balanced stages."""
    p2p_timeout_s: float = field(default=90.0, metadata=bounds(lo=0.0, lo_open=True))
    """A neighbouring stage silent for this long (no activation or gradient arrives) once the stream's first step is
    done is declared hung, and the job ends with the rank named. A peer that dies is found at once whatever this is
    (gloo: its connection closes; NCCL: the launcher ends the other ranks), so this only bounds a hang: with the
    launcher's 30 s for the other ranks to exit, a hung job ends within 2 minutes (torchtitan waits 100 s); the run's
    first step has ``init_timeout_s``, checkpoints and evaluations ``checkpoint_timeout_s``."""
    recv_wait: Literal["auto", "poll", "block"] = "auto"
    """How a rank waits for a neighbour's activations or gradients: ``poll`` spins on the transfer (yielding its
    core to its own threads at every turn), as MPI waits by default, so the core never idles between actions;
    ``block`` sleeps in the wait; ``auto`` polls on CPU when the node's ranks fit its cores, else blocks
    (``pipeline/p2p.py: polls``). On a VM an idle virtual CPU halts, and a rank that slept ran its next forwards and
    backwards up to 25% slower (docs/benchmarks.md, "Waiting by polling": +4% in process, within the noise through
    the command line). NCCL's receives are waited for by the stream, whatever this says."""
    collective_timeout_s: float = field(default=90.0, metadata=bounds(lo=0.0, lo_open=True))
    """How long an all-reduce of a training step (data-parallel gradients, the grad norm, the loss reports; NCCL's
    watchdog) may wait for a slow replica once the stream's first step is done, before the job is declared hung."""
    init_timeout_s: float = field(default=900.0, metadata=bounds(lo=0.0, lo_open=True))
    """The longer budget of what may be slow without hanging, until the run's first step is done: setting up the
    process groups, compiling, the data's first read, and the evaluation and checkpoint before that step. A rank
    that does not answer within it is named (``PeerFailure``)."""
    checkpoint_timeout_s: float = field(default=300.0, metadata=bounds(lo=0.0, lo_open=True))
    """Once the run's first step is done, how long the waits around a checkpoint or an evaluation may last (a rank
    still writing its shards, the gathers of a save or an export, an evaluation's transfers, the first step after
    them) before the job is declared hung and the silent rank named: a filesystem that stalls mid-save ends the job
    in about 5 minutes instead of idling it for ``init_timeout_s``. Raise it where writing one stage's checkpoint
    can take longer than this."""

    @property
    def split(self) -> Optional[list[int]]:
        """The explicit split, or None where the FLOPs model decides (``None``, or ``auto`` not yet measured)."""
        return self.layers_per_stage if isinstance(self.layers_per_stage, list) else None


@dataclass(kw_only=True)
class TrainingConfig:
    output_dir: str = "runs/default"
    """The run folder: checkpoints, ``metrics.jsonl``, the resolved recipe, the loss curve and ``export/``. One run
    per folder (a lock); a second run into it resumes (``resume_from_checkpoint``) or must say
    ``overwrite_output_dir``."""
    max_steps: int = field(default=100, metadata=bounds(lo=1))
    """Optimizer steps of the run (each ``num_microbatches`` x ``microbatch_size`` sequences per data-parallel
    replica); the lr schedule spans them."""
    warmup_steps: Union[int, float] = field(default=0, metadata=bounds(lo=0))
    """Linear warm-up from 0 to the peak lr, as transformers 5: an integer is a number of steps, a number in [0, 1)
    a fraction of ``max_steps``."""
    warmup_ratio: Optional[float] = field(default=None, metadata=bounds(lo=0.0, hi=1.0))
    """Deprecated (as in transformers 5): use ``warmup_steps`` with a number below 1."""
    lr_scheduler_type: SchedulerName = "linear"
    """A ``transformers.get_scheduler`` name, with its meaning: ``cosine`` decays to 0, ``cosine_with_min_lr`` to
    ``lr_scheduler_kwargs.min_lr_rate`` of the peak, ``constant`` has no warm-up (``constant_with_warmup`` has)."""
    lr_scheduler_kwargs: dict = field(default_factory=dict)
    """Extra arguments of the schedule (transformers' ``scheduler_specific_kwargs``), e.g. ``{min_lr_rate: 0.1}``
    for ``cosine_with_min_lr``, ``{num_decay_steps: 100}`` for ``warmup_stable_decay``."""
    max_grad_norm: float = field(default=1.0, metadata=bounds(lo=0.0))
    """Global gradient-norm clip across all stages (0 disables)."""
    seed: int = 42
    """Seed of the model's initialisation (the same whole and split), the data order and every rank's own stream."""
    bf16: bool = False
    """bf16 autocast for forward and backward; the optimizer's weights and state stay fp32. In a pipeline each weight
    version holds the matrices autocast casts, and the MoE expert stacks, as one bf16 copy made at its step (no
    per-microbatch casts; the experts' grouped GEMMs run in bf16)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer in the backward (the model's own ``GradientCheckpointingLayer``, non-reentrant):
    an in-flight microbatch keeps only its layers' inputs, for about one more forward of compute."""
    torch_compile: Optional[bool] = None
    """``torch.compile`` each decoder layer (the Trainer's name): unset, on a GPU and off on CPU. Composes with the
    weight versions (a layer's weights are its compiled graph's inputs), activation checkpointing and every schedule
    but ``zbh1`` (refused: a compiled layer's backward computes every gradient, so its I and W would each run it
    whole); the losses are the eager ones within rounding."""
    torch_compile_backend: Optional[str] = None
    """The ``torch.compile`` backend (the Trainer's name); unset: ``inductor``."""
    fused_loss: Union[bool, Literal["auto"]] = "auto"
    """The last stage's loss (and the single-process engine's) as a chunked fused linear cross-entropy: the head's
    GEMM, log-softmax, loss and gradients a chunk of tokens at a time in the forward, never the whole fp32 logits
    (at its peak the hidden states' fp32 gradient and one chunk's logits, instead of about 12 bytes per logit:
    3.9 KB per token instead of 590 KB at hidden 960, vocab 49,152; ``model/fused_loss.py``). ``auto``: on where
    the model's head is a plain linear layer under transformers' ``ForCausalLMLoss`` (not Gemma-2/3's soft-capping,
    Cohere's or Granite's logit scaling); ``true`` requires it; ``false`` keeps transformers' head and loss."""
    logging_steps: int = field(default=10, metadata=bounds(lo=1))
    """Log every N steps: the mean over the interval, as the HF Trainer logs (``metrics.jsonl`` keeps every step;
    logging never drains the pipeline)."""
    eval_steps: int = field(default=0, metadata=bounds(lo=0))
    """Evaluate every N steps (0: only at the end)."""
    save_steps: int = field(default=0, metadata=bounds(lo=0))
    """Checkpoint every N steps (0: only at the end)."""
    save_total_limit: Optional[int] = field(default=2, metadata=bounds(lo=1))
    """Complete checkpoints kept in ``output_dir`` (the newest, the one just written always among them); null:
    all."""
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
    peak_tflops: Optional[float] = field(default=None, metadata=bounds(lo=0.0, lo_open=True))
    """Peak dense TFLOP/s of one device, for ``train/mfu`` (known GPUs are looked up; CPUs have no MFU)."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A step whose gradient norm (or loss) is not finite: ``stop`` ends the run with a ``NonFiniteError`` naming the
    step, its checkpoints as they were (a pipeline finds out when the step's report lands, so STEP never waits for
    the device); ``skip`` leaves the weights as they were and counts it (``skipped_nonfinite`` in metrics.jsonl):
    deciding before the step, it reads the norm back once per step."""
    max_consecutive_skips: int = field(default=10, metadata=bounds(lo=1))
    """``on_nonfinite: skip`` gives up (``NonFiniteError``, exit code 3) after this many skipped steps in a row: the
    model has stopped training, and going on would save and export it as if it had."""
    max_skipped_fraction: float = field(default=0.05, metadata=bounds(lo=0.0, hi=1.0))
    """``on_nonfinite: skip`` also gives up once more than this fraction of ``max_steps`` was skipped in all, so a run
    that exits 0 trained at least the rest."""
    torch_threads: Optional[int] = field(default=None, metadata=bounds(lo=1))
    """Intra-op threads per process (None: 1 per rank when several ranks share the CPU)."""
    stop_after_steps: Optional[int] = field(default=None, metadata=bounds(lo=1))
    """Checkpoint and exit at this step without changing the schedule (like Megatron's --exit-interval);
    continue later with ``resume_from_checkpoint: latest``."""
    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGINT", "SIGUSR1"])
    """Signals that stop the run safely: every rank finishes its step, one checkpoint is saved at a step they agree on
    (within 4 steps of the signal), and the run exits with code 10 and one line naming the checkpoint. SLURM's
    preemption, ``scancel`` and a time limit send SIGTERM; ``--signal=USR1@120`` asks for SIGUSR1 two minutes before
    the limit; a second SIGINT (Ctrl-C) stops at once, unsaved. [] keeps the signals' default (the process dies)."""
    max_restarts: int = field(default=0, metadata=bounds(lo=0))
    """``hf-asyncpp train`` starting the stage processes itself: restart them this many times after a failure (as
    ``torchrun --max-restarts``); a restarted run resumes from the newest verified checkpoint."""
    export: bool = True
    """Export an HF folder (``output_dir/export``) and evaluate it at the end."""

    def compiles(self) -> bool:
        """``torch_compile`` as training applies it: as set, or on where a GPU trains."""
        import torch  # the recipe stays cheap to read: torch only for the one question that needs it

        return torch.cuda.is_available() if self.torch_compile is None else self.torch_compile


@dataclass(kw_only=True)
class HubConfig:
    push_to_hub: bool = False
    """Push the exported model (and, by ``hub_strategy``, checkpoints) to the Hugging Face Hub."""
    hub_model_id: Optional[str] = None
    """The Hub repository (``user/name``) pushes go to; required with ``push_to_hub``, created if missing."""
    hub_strategy: Literal["end", "every_save", "checkpoint", "all_checkpoints"] = "end"
    """As the HF Trainer's: ``end`` pushes the exported model at the end; ``every_save`` also pushes the model (a
    loadable HF folder) at every checkpoint; ``checkpoint`` also pushes the latest checkpoint to ``last-checkpoint/``
    (resumable); ``all_checkpoints`` pushes every checkpoint to its own folder. Pushes run in the background."""
    private: bool = True
    """Create the Hub repository private (an existing one keeps its visibility)."""
    license: Optional[str] = None
    """Card metadata, e.g. ``apache-2.0``."""
    language: Optional[list[str]] = None
    """Card metadata, e.g. ``[en]``."""


@dataclass(kw_only=True)
class EvalConfig:
    tasks: list[str] = field(default_factory=list)
    """Tasks run on the export at the end: any lm-evaluation-harness task or group name (hellaswag, piqa, arc_easy,
    arc_challenge, mmlu, mmlu_<subject>, ...; scored by lm-eval, the ``eval`` extra: ``pip install
    hf_asyncpp[eval]``), and perplexity."""
    task_files: Optional[dict] = None
    """Local task data by task name (the Hub record format); tasks without a file stream from the Hub."""
    limit: Optional[int] = field(default=None, metadata=bounds(lo=1))
    """Documents per task, the first ones, as lm-eval's ``--limit`` (per subject for MMLU; None: all)."""
    during_training: bool = False
    """Also score ``tasks`` (not perplexity) every ``training.eval_steps`` on the newest weights, logged as
    ``eval/<task>/acc_norm``: lm-eval's tasks, the log-likelihoods through the pipeline's stages."""
