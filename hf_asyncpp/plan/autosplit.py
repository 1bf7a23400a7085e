"""``pipeline.layers_per_stage: auto``: the split from a short profile measured at start on the machine that trains.

The FLOPs model (``partition.plan``) is right about big matmuls and wrong about what they leave out: the optimizer
step (Muon's Newton-Schulz is several matmuls per matrix per step; error feedback copies every weight), per-kernel
overhead at small hidden sizes, the memory-bound softmax of a large vocabulary. On the CPU pipeline of bench.throughput's h256 model the
first stage spent more time in STEP than in forward + backward. So ``auto`` times, on this device and at the recipe's
microbatch shape, the forward + backward of every layer, the embedding, the head and the loss, and one optimizer step
of each (``plan.costs.measure_costs``), then picks the contiguous split that minimizes the slowest stage's
``m x (forward + backward) + step``.

The measured program is the trainer's: the decoder layers compiled as training compiles them (or eager where it
runs them eagerly), the head and the loss as the last stage computes them (fused or not).

The measurement is cached by a hash of what it depends on (model config, microbatch shape, optimizer settings,
precision, compile setting and backend, loss path, device, threads, torch version), so a restart or a resume finds
the same split without measuring again (and a resumed run cannot silently get another partition from timing noise). The main process measures; the split
is broadcast so every rank builds the same stages. ``hf-asyncpp plan`` keeps the FLOPs model: it plans without the
hardware.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from pathlib import Path
from typing import Callable, Optional

import torch

from ..config.recipe import Recipe, recipe_to_dict
from ..model.build import autocast
from ..model.fused_loss import use_fused_loss
from ..optim import apply_delay_correction, build_optimizer
from .costs import MeasuredCosts, measure_costs, trainer_compile
from ..storage.write import replace_file, write_file

log = logging.getLogger("hf_asyncpp")

CACHE_ENV = "HF_ASYNCPP_CACHE"
_TIMED_OPTIMIZER_FIELDS = ("name", "ns_steps", "ns_dtype", "nesterov", "adjust_lr", "delay_correction")


def cache_dir() -> Path:
    """``$HF_ASYNCPP_CACHE`` or ``~/.cache/hf_asyncpp``: measured stage costs outlive a run's output folder."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hf_asyncpp") / "stage_costs"


def device_name(device: torch.device) -> str:
    """What the timings depend on about the machine: the accelerator's name, or the CPU and the thread count."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{platform.machine()}:{platform.processor() or '?'}:{os.cpu_count()}cores:{torch.get_num_threads()}threads"


def cache_key(recipe: Recipe, device: torch.device) -> dict:
    """Everything a stage's measured seconds depend on (not the stage count or m: the split is recomputed from the
    per-layer costs, so changing those reuses the measurement)."""
    d = recipe_to_dict(recipe)
    opt = {k: d["optimizer"][k] for k in _TIMED_OPTIMIZER_FIELDS}  # not the learning rates: they change no timing
    return {"model": d["model"], "seq_len": recipe.data.seq_len, "microbatch_size": recipe.pipeline.microbatch_size,
            "optimizer": opt, "bf16": recipe.training.bf16, "device": device_name(device), "torch": torch.__version__,
            "fused_loss": recipe.training.fused_loss, "torch_compile": trainer_compile(recipe.training)}


def _digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def measured_costs(recipe: Recipe, build: Callable[[], torch.nn.Module], device: torch.device,
                   measure: Callable[..., MeasuredCosts] = measure_costs, folder: Optional[Path] = None
                   ) -> tuple[MeasuredCosts, Path, bool]:
    """(costs, cache file, whether it was a cache hit). ``build`` makes a throw-away model (random weights)."""
    key = cache_key(recipe, device)
    path = (folder or cache_dir()) / f"{_digest(key)}.json"
    if path.exists():
        try:
            return MeasuredCosts.from_dict(json.loads(path.read_text())["costs"]), path, True
        except (ValueError, KeyError, TypeError) as e:  # a damaged cache file: measure again and overwrite it
            log.warning("pipeline.layers_per_stage auto: ignoring unreadable cache %s (%s)", path, e)
    opt = recipe.optimizer
    factory = lambda stage: apply_delay_correction(build_optimizer(stage, opt, log=lambda *_: None), opt)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), autocast(recipe.training.bf16):
        torch.manual_seed(0)
        model = build()
        costs = measure(model, recipe.data.seq_len, recipe.pipeline.microbatch_size, device, optimizer=factory,
                        fused_loss=use_fused_loss(recipe.training.fused_loss, model),
                        compile_backend=trainer_compile(recipe.training))
    if trainer_compile(recipe.training) is not None:
        # drop the throw-away layers' graphs: the run's layers compile their own (other guards), and would otherwise
        # check the stale entries at every call and count their first compile as a recompile
        torch.compiler.reset()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps({"key": key, "costs": costs.to_dict()}, indent=1, default=str).encode("utf-8")
    replace_file(path, lambda tmp: write_file(tmp, lambda f: f.write(data)))
    return costs, path, False


def auto_split(recipe: Recipe, build: Callable[[], torch.nn.Module], device: torch.device,
               measure: Callable[..., MeasuredCosts] = measure_costs, folder: Optional[Path] = None,
               vocab_parallel: bool = False) -> list[int]:
    """The measured split for ``recipe`` on ``device``, logged with each stage's time per microbatch.
    ``vocab_parallel`` (resolved: ``plan.vocab.resolve_vocab_parallel``): the vocabulary layers shared by every
    stage, the measured head and loss spread over all stages (``MeasuredCosts.balance``)."""
    p, m = recipe.pipeline.num_stages, recipe.pipeline.num_microbatches
    costs, path, hit = measured_costs(recipe, build, device, measure, folder)
    split = costs.balance(p, m, vocab_parallel)
    secs = costs.stage_seconds(split, m, vocab_parallel)
    log.info("pipeline.layers_per_stage auto: %s (%s %s): per microbatch, forward + backward + 1/%d of the optimizer "
             "step, stage seconds %s ms, slowest / mean %.3f", split, "cached in" if hit else "measured, saved to", path,
             m, " ".join(f"{x * 1e3:.1f}" for x in secs), max(secs) / (sum(secs) / len(secs)))
    return split
