"""Balance stages by measured time, for when a FLOPs count misjudges real kernels (like torchgpipe's
``balance_by_time``). Small hidden sizes are overhead-bound, big vocabularies memory-bound, and an optimizer step
(Muon's Newton-Schulz, an error-feedback copy) is not proportional to FLOPs at all: timing the stages on the device
that will run them settles the split. ``pipeline.layers_per_stage: auto`` does this at start
(``pipeline.autosplit``); ``hf-asyncpp plan --measure`` prints the result to write into the recipe.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from .plan import PartitionError, anatomy, balanced_sizes, get_module
from .stage import partition_model


@dataclass
class MeasuredCosts:
    """Seconds of forward + backward per microbatch: each decoder layer, plus what the first and last stage add;
    and seconds of one optimizer step of the same pieces (empty / 0 when not measured).

    A stage spends ``m x (forward + backward) + step`` per optimizer step of m microbatches, so ``balance`` and
    ``stage_seconds`` weigh the step by 1/m per microbatch: with Muon on a CPU the step of a layer can cost as much
    as several microbatches' forward and backward, and a split that ignores it leaves the first stage (which also
    steps the embedding) the bottleneck.
    """

    layers: list[float]
    first: float  # embedding (and anything before the layers)
    last: float  # final norm, head and loss
    layer_steps: list[float] = field(default_factory=list)
    first_step: float = 0.0
    last_step: float = 0.0

    def per_microbatch(self, num_microbatches: int = 1) -> tuple[list[float], float, float]:
        """(per layer, first extra, last extra) seconds per microbatch, the optimizer step spread over m microbatches."""
        m = max(1, num_microbatches)
        steps = self.layer_steps or [0.0] * len(self.layers)
        return ([f + st / m for f, st in zip(self.layers, steps)], self.first + self.first_step / m,
                self.last + self.last_step / m)

    def balance(self, num_stages: int, num_microbatches: int = 1) -> list[int]:
        layers, first, last = self.per_microbatch(num_microbatches)
        return balanced_sizes(layers, first, last, num_stages)

    def stage_seconds(self, layers_per_stage: list[int], num_microbatches: int = 1) -> list[float]:
        """Per stage, seconds per microbatch (forward + backward + its share of the optimizer step)."""
        layers, first, last = self.per_microbatch(num_microbatches)
        out, start = [], 0
        for s, n in enumerate(layers_per_stage):
            t = sum(layers[start:start + n]) + (first if s == 0 else 0.0)
            out.append(t + (last if s == len(layers_per_stage) - 1 else 0.0))
            start += n
        return out

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MeasuredCosts":
        return cls(**{k: d[k] for k in ("layers", "first", "last", "layer_steps", "first_step", "last_step") if k in d})


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_costs(model: nn.Module, seq_len: int, microbatch_size: int, device: str | torch.device = "cpu",
                  repeats: int = 3, optimizer: Optional[Callable[[nn.Module], torch.optim.Optimizer]] = None) -> MeasuredCosts:
    """Time forward + backward of every one-layer stage (the fastest of ``repeats`` after a warm-up), and with
    ``optimizer`` (a stage -> optimizer factory, the run's own) one optimizer step of each stage the same way.

    The model is cut into one stage per layer; the first stage's extra time over the median layer is the
    embedding's, the last stage's extra is the head's (so layer 0 and the last layer count as median layers).
    Each stage is on ``device`` only while it is timed (then back on the CPU), so one layer, the embedding or the
    head at a time: ``layers_per_stage: auto`` can measure a model larger than one device.
    """
    device = torch.device(device)
    L = len(get_module(model, anatomy(model).layers))
    if L < 3:
        raise PartitionError(f"measuring stage costs needs at least 3 decoder layers (the model has {L}): the first and "
                             "last layers are timed together with the embedding and the head")
    stages = partition_model(model, L, [1] * L, seq_len=seq_len)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (microbatch_size, seq_len), device=device)
    x, seconds, step_seconds = ids, [], []
    for s, st in enumerate(stages):
        st = st.to(device)  # one layer on the device at a time: a model larger than the device can be measured
        best = float("inf")
        for r in range(repeats + 1):
            inp = x
            if s > 0:
                parts = x if isinstance(x, tuple) else (x,)
                parts = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in parts)
                inp = parts if isinstance(x, tuple) else parts[0]
            _sync(device)
            t0 = time.perf_counter()
            out = st(inp, labels=ids) if s == L - 1 else st(inp)
            outs = out if isinstance(out, tuple) else (out,)
            floats = [o for o in outs if o.is_floating_point() and o.requires_grad]
            torch.autograd.backward(floats, [torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o) for o in floats])
            _sync(device)
            if r > 0:
                best = min(best, time.perf_counter() - t0)
        seconds.append(best)
        if optimizer is not None:  # the gradients just computed (accumulated over the repeats) are real-shaped
            step_seconds.append(_time_step(optimizer(st), device, repeats))
        for p in st.parameters():
            p.grad = None
        x = tuple(o.detach() for o in outs) if isinstance(out, tuple) else out.detach()
        if device.type != "cpu":
            st.to("cpu")
    first, layers, last = _split_ends(seconds)
    if not step_seconds:
        return MeasuredCosts(layers, first, last)
    first_step, layer_steps, last_step = _split_ends(step_seconds)
    return MeasuredCosts(layers, first, last, layer_steps, first_step, last_step)


def _split_ends(seconds: list[float]) -> tuple[float, list[float], float]:
    """(first stage's extra over the median layer, per-layer seconds, last stage's extra)."""
    mid = statistics.median(seconds[1:-1])
    return max(0.0, seconds[0] - mid), [mid] + seconds[1:-1] + [mid], max(0.0, seconds[-1] - mid)


def _time_step(opt: torch.optim.Optimizer, device: torch.device, repeats: int) -> float:
    best = float("inf")
    for r in range(repeats + 1):  # the first step creates the optimizer state: not timed
        _sync(device)
        t0 = time.perf_counter()
        opt.step()
        _sync(device)
        if r > 0:
            best = min(best, time.perf_counter() - t0)
    return best
