"""Balance stages by measured time, for when a FLOPs count misjudges real kernels (like torchgpipe's
``balance_by_time``). Small hidden sizes are overhead-bound, big vocabularies memory-bound: timing the
stages on the device that will run them settles the split. The result is a ``layers_per_stage`` list to put in
the recipe, so every rank uses the same split without agreeing on measurements at run time.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from .plan import PartitionError, anatomy, balanced_sizes, get_module
from .stage import partition_model


@dataclass
class MeasuredCosts:
    """Seconds of forward + backward per microbatch: each decoder layer, plus what the first and last stage add."""

    layers: list[float]
    first: float  # embedding (and anything before the layers)
    last: float  # final norm, head and loss

    def balance(self, num_stages: int) -> list[int]:
        return balanced_sizes(self.layers, self.first, self.last, num_stages)

    def stage_seconds(self, layers_per_stage: list[int]) -> list[float]:
        out, start = [], 0
        for s, n in enumerate(layers_per_stage):
            t = sum(self.layers[start:start + n]) + (self.first if s == 0 else 0.0)
            out.append(t + (self.last if s == len(layers_per_stage) - 1 else 0.0))
            start += n
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_costs(model: nn.Module, seq_len: int, microbatch_size: int, device: str | torch.device = "cpu",
                  repeats: int = 3) -> MeasuredCosts:
    """Time forward + backward of every one-layer stage (the fastest of ``repeats`` after a warm-up).

    The model is cut into one stage per layer; the first stage's extra time over the median layer is the
    embedding's, the last stage's extra is the head's (so layer 0 and the last layer count as median layers).
    Moves the model's modules to ``device``.
    """
    device = torch.device(device)
    L = len(get_module(model, anatomy(model).layers))
    if L < 3:
        raise PartitionError(f"measuring stage costs needs at least 3 decoder layers (the model has {L}): the first and "
                             "last layers are timed together with the embedding and the head")
    stages = [st.to(device) for st in partition_model(model, L, [1] * L, seq_len=seq_len)]
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (microbatch_size, seq_len), device=device)
    x, seconds = ids, []
    for s, st in enumerate(stages):
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
        for p in st.parameters():
            p.grad = None
        x = tuple(o.detach() for o in outs) if isinstance(out, tuple) else out.detach()
    mid = statistics.median(seconds[1:-1])
    layers = [mid] + seconds[1:-1] + [mid]
    return MeasuredCosts(layers, max(0.0, seconds[0] - mid), max(0.0, seconds[-1] - mid))
