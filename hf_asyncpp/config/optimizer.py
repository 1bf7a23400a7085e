"""The recipe's optimizer section (``config.Recipe.optimizer``): the optimizer, its hyperparameters, the delay
correction and the single-process delay references.

Apart from ``recipe.py`` because it is the section the research knobs grow in (EF's lambda rules, sync start,
first-moment variants), each documented where it is declared, and read by ``optim/`` alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from .sections import bounds as _range

__all__ = ["OptimizerConfig", "EF_AUTO", "EF_LEARNED"]

EF_AUTO = "auto"
"""``optimizer.ef_lambda: auto``: lambda from the step's own statistics (``optim.ef.auto_lambda``)."""
EF_LEARNED = "learned"
"""``optimizer.ef_lambda: learned``: one lambda per stage, learned from the loss (``optim/ef.py``)."""


@dataclass(kw_only=True)
class OptimizerConfig:
    name: Literal["muon", "adamw", "nadam", "sgd"] = "adamw"
    """The optimizer: ``muon`` (Muon on the hidden matrices, AdamW on embeddings, head, norms, biases and routers),
    ``adamw``, ``nadam`` or ``sgd``; each as torch builds it."""
    learning_rate: float = field(default=3e-4, metadata=_range(lo=0.0, lo_open=True))
    """Peak learning rate (Muon's matrices when ``name: muon``)."""
    weight_decay: float = field(default=0.1, metadata=_range(lo=0.0))
    """Decoupled weight decay (AdamW's; Muon's on its matrices, scaled by the lr as torch.optim.Muon does)."""
    adam_beta1: Optional[float] = field(default=None, metadata=_range(lo=0.0, hi=1.0))
    """The first moment's beta1 (AdamW, NAdam, Muon's AdamW side); unset: 0.99 for nadam (Ajanthan et al.'s
    constant high Nesterov momentum), 0.9 otherwise."""
    adam_beta2: float = field(default=0.95, metadata=_range(lo=0.0, hi=1.0))
    """The second moment's beta2 (AdamW, NAdam, Muon's AdamW side)."""
    adam_epsilon: float = field(default=1e-8, metadata=_range(lo=0.0, lo_open=True))
    """Added to the second moment's square root (AdamW, NAdam, Muon's AdamW side)."""
    momentum: float = field(default=0.95, metadata=_range(lo=0.0, hi=1.0))
    """Muon (and SGD) momentum."""
    nesterov: bool = True
    """Muon (and SGD): Nesterov momentum."""
    ns_steps: int = field(default=5, metadata=_range(lo=1, hi=99))
    """Muon: Newton-Schulz iterations that orthogonalize each update (5, Keller Jordan's and torch's default)."""
    ns_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Newton-Schulz precision. auto: bfloat16 on a GPU (as torch.optim.Muon: fast there), float32 on a CPU, where
    bfloat16 matmuls are emulated (17x slower than float32 on the CPUs we measured). float32 also for bit-level
    comparisons."""
    adjust_lr: Literal["original", "match_rms_adamw"] = "match_rms_adamw"
    """Muon lr scaling: Keller Jordan's ``original`` or Moonshot's ``match_rms_adamw``."""
    muon_split_fused: bool = True
    """Muon: orthogonalize the gate and the up projection of a fused MoE expert ``gate_up_proj`` (transformers 5's
    (E, 2I, H) layout) each on its own, as separate projections (dense Llama, transformers 4 MoE) are. False: one
    (2I x H) matrix per expert. The two updates differ by 39-55% at MoE shapes (docs/how-it-works.md)."""
    fused: bool = False
    """AdamW: torch's fused kernel (``torch.optim.AdamW(fused=True)``, transformers' ``adamw_torch_fused``), one
    kernel over every tensor instead of torch's per-tensor loop on a CPU (4x faster there at the benchmark's 4.7M
    parameters; docs/benchmarks.md, "cli-throughput"). The same update, rounded differently in the last bits. Off by
    default so that runs and the committed benchmark tables keep their numbers; only with ``name: adamw``."""
    adamw_lr: Optional[float] = field(default=None, metadata=_range(lo=0.0, lo_open=True))
    """Muon hybrid: lr of the AdamW group (embeddings, head, norms, biases, routers); None: learning_rate."""
    adamw_weight_decay: Optional[float] = field(default=None, metadata=_range(lo=0.0))
    """Muon hybrid: weight decay of the AdamW group; None: weight_decay."""
    nadam_momentum_decay: float = field(default=1000.0, metadata=_range(lo=0.0))
    """NAdam's ``momentum_decay`` psi: its momentum at step t is ``beta1 (1 - 0.5 * 0.96^(t psi))``. 1000 makes it
    beta1 from the first step (0.96^1000 ~ 2e-18), the constant high momentum of Ajanthan et al.'s Nesterov baseline for
    asynchronous pipelines; torch's default 0.004 ramps it from 0.50 (step 1) to only 0.89 at step 10k."""
    delay_correction: Literal["none", "error_feedback"] = "none"
    """What corrects a one-step-old gradient's update (2BW, ``simulate_delay: 1``): ``none``, or ``error_feedback``,
    the update-level Error-Feedback extrapolation ``x[t+1] = x[t] - u[t] - lambda (u[t] - u[t-1])`` (lambda:
    ``ef_lambda``; 1 gives ``x[t] - 2 u[t] + u[t-1]``), for any optimizer, at the cost of one parameter-sized buffer
    (``optim/ef.py``). It closes most of AdamW's delay gap; Muon loses little without it."""
    ef_lambda: Union[float, Literal[EF_AUTO, EF_LEARNED]] = field(default=1.0, metadata=_range(lo=0.0))
    """Error-feedback extrapolation weight: a number >= 0 (1.0 is the paper's); ``auto``: per parameter tensor and
    step, ``clip(cos(u[t], u[t-1]), 0, 1)``, the extrapolation trusted as far as consecutive updates agree; or
    ``learned``: one lambda per stage, from 1, moved each step by ``ef_lambda_lr`` (times the lr schedule's factor:
    ``ef_lambda_schedule``) times the cosine of the gradient at the extrapolated weights with the extrapolation (a
    hypergradient step; needs a one-step delay, within [0, 3]; logged as ``ef_lambda``; ``optim/ef.py``)."""
    ef_lambda_lr: float = field(default=0.02, metadata=_range(lo=0.0))
    """``ef_lambda: learned``: the step of lambda per unit of cosine."""
    ef_lambda_schedule: Literal["lr", "constant"] = "lr"
    """``ef_lambda: learned``: its step over the run: ``lr`` (``ef_lambda_lr`` times the lr schedule's factor, lr /
    peak lr: large while the delay gap is large, small late) or ``constant`` (``ef_lambda_lr`` at every step, which
    drifts past the best lambda late in a run). ``lr`` is the one within one seed's spread of the best fixed lambda on
    every paper-regime arm (docs/benchmarks.md, the lambda tables)."""
    delay_start_step: int = field(default=0, metadata=_range(lo=0))
    """"Sync start", the paper's baseline mitigation: the first ``delay_start_step`` steps are synchronous, then the
    delay (and the EF correction) starts; in the single-process reference (``simulate_delay: 1``) and in the
    pipeline (``schedule: 2bw``: 1F1B's flushed steps first, 2BW from that drain point on)."""
    shard_across_replicas: bool = False
    """ZeRO-1: with data parallelism, each replica of a stage owns whole tensors (about 1/dp of them, a tied tensor by
    replica 0 on every stage holding it) and keeps the optimizer and error-feedback state of those only; the
    gradients are reduced to their owner (not all-reduced), the owner steps them (Muon's Newton-Schulz runs once per
    matrix, not dp times) and broadcasts the new weights, which the replicas wait for at their first forward with
    them. The same numbers as without. Not with ``ef_lambda: learned`` (its cosine spans the stage)."""
    simulate_delay: Literal["0", "1", "pipedream"] = "0"
    """Single-process research mode, equal step for step to the pipeline schedule: 0 sync, 1 PipeDream-2BW's one-step
    delay (each step's gradient at the previous step's weights, applied at once: N updates after N steps), pipedream
    the variable delay of ``pipeline.num_stages`` stages (a tied output head at lag 0, as the executor's copy)."""
