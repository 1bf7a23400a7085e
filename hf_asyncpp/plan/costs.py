"""Balance stages by measured time, for when a FLOPs count misjudges real kernels (like torchgpipe's
``balance_by_time``). Small hidden sizes are overhead-bound, big vocabularies memory-bound, and an optimizer step
(Muon's Newton-Schulz, an error-feedback copy) is not proportional to FLOPs at all: timing the stages on the device
that will run them settles the split. ``pipeline.layers_per_stage: auto`` does this at start
(``plan.autosplit``); ``hf-asyncpp plan --measure`` prints the result to write into the recipe.

With ``split_backward`` the measurement also times each pass on its own: the forward F, the whole backward B, and the
zero-bubble schedules' split backward, I (input gradient) and W (weight gradient), with torch's own
``stage_backward_input`` and ``partition.split_backward.weight_gradients``, as the executor runs them.
``MeasuredCosts.stage_costs`` turns them into the simulator's per-stage ``Costs``, so the planner compares the
schedules on what this device makes F, I and W cost rather than on the zero-bubble paper's I = W = B / 2, which need
not hold (the two halves walk the graph twice, and I + W need not equal B).

The measured program is the trainer's: with ``compile_backend`` (``trainer_compile``: ``training.torch_compile`` as
training applies it, and its backend) the decoder layers are compiled exactly as the executor compiles its stage's
(``model.build.compile_layers``) while the embedding, the head and the loss stay eager as they do in training, and
the last stage computes the loss the run computes (``fused_loss``). Each stage's untimed warm-up forward + backward
compiles its graphs, so compile time is never timed. Timing eager layers for a run that compiles them would weigh
the layers against an eager head and loss at the wrong ratio, and plan the split for another program.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input

from ..model.build import compile_layers
from ..partition.split_backward import weight_gradients
from ..schedules.simulator import Costs
from ..partition.plan import PartitionError, anatomy, balanced_sizes, get_module
from ..partition.stage import partition_model

PASSES = ("forward", "backward", "backward_input", "backward_weight")
"""The passes ``measure_costs(split_backward=True)`` times, named as the simulator's ``Costs`` fields."""


@dataclass
class PassSeconds:
    """Seconds of one pass per microbatch, split as ``MeasuredCosts`` splits forward + backward: each decoder layer,
    and what the first and the last stage add."""

    layers: list[float]
    first: float
    last: float


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
    passes: dict[str, PassSeconds] = field(default_factory=dict)
    """Per pass in ``PASSES`` (``split_backward``; empty otherwise; with compiled layers only F and B, the
    split-backward schedules being refused with compile). The first stage computes no input gradient, so
    the executor runs its whole backward at its W: its I and W are not timed (``first`` 0, layer 0 the median) and
    ``stage_costs`` gives it I = 0 and W = its B."""

    def per_microbatch(self, num_microbatches: int = 1) -> tuple[list[float], float, float]:
        """(per layer, first extra, last extra) seconds per microbatch, the optimizer step spread over m microbatches."""
        m = max(1, num_microbatches)
        steps = self.layer_steps or [0.0] * len(self.layers)
        return ([f + st / m for f, st in zip(self.layers, steps)], self.first + self.first_step / m,
                self.last + self.last_step / m)

    def balance(self, num_stages: int, num_microbatches: int = 1, vocab_parallel: bool = False) -> list[int]:
        """The split minimizing the slowest stage. ``vocab_parallel``: the vocabulary layers shared by every stage:
        the measured head and loss (``last``) spread over all stages (1 / num_stages each), so the layers split as
        if it were not there."""
        layers, first, last = self.per_microbatch(num_microbatches)
        if vocab_parallel:
            return balanced_sizes(layers, first, 0.0, num_stages, last / num_stages)
        return balanced_sizes(layers, first, last, num_stages)

    def stage_seconds(self, layers_per_stage: list[int], num_microbatches: int = 1,
                      vocab_parallel: bool = False) -> list[float]:
        """Per stage, seconds per microbatch (forward + backward + its share of the optimizer step; with
        ``vocab_parallel`` its 1 / stages of the head and loss instead of the last stage all of it)."""
        layers, first, last = self.per_microbatch(num_microbatches)
        if vocab_parallel:
            return [t + last / len(layers_per_stage) for t in _per_stage(layers, first, 0.0, layers_per_stage)]
        return _per_stage(layers, first, last, layers_per_stage)

    def stage_costs(self, layers_per_stage: list[int], vocab_parallel: bool = False, shards: int | None = None) -> Costs:
        """The simulator's per-stage costs of this split: F, B, I and W per microbatch and one optimizer step per
        step, all measured (needs ``measure_costs(split_backward=True)``). The first stage's I is 0 and its W its
        whole backward B: it has no input gradient to send, so the executor's I there does nothing and its W runs one
        plain backward. Measured with compiled layers, I and W are None (half of B each, the simulator's default).
        ``vocab_parallel``: the head and loss's measured forward + backward leave the last stage and become every
        stage's VOCAB pass, 1 / ``shards`` (default: the stages) of it (the softmax statistics' and the broadcast's
        collectives not measured: ``Costs.vocab_comm``)."""
        if not self.passes:
            raise ValueError("no per-pass seconds: measure with measure_costs(..., split_backward=True)")
        if sum(layers_per_stage) != len(self.layers) or min(layers_per_stage) < 1:
            raise ValueError(f"layers_per_stage {layers_per_stage} does not split {len(self.layers)} layers")
        per = {name: _per_stage(t.layers, t.first, 0.0 if vocab_parallel else t.last, layers_per_stage)
               for name, t in self.passes.items()}
        if "backward_input" in per:  # not measured with compiled layers: the simulator's halves of B
            per["backward_input"][0], per["backward_weight"][0] = 0.0, per["backward"][0]
        steps = _per_stage(self.layer_steps or [0.0] * len(self.layers), self.first_step, self.last_step,
                           layers_per_stage)
        vocab = (self.passes["forward"].last + self.passes["backward"].last) / (shards or len(layers_per_stage)) \
            if vocab_parallel else 0.0
        return Costs(**per, step=steps, vocab=vocab)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MeasuredCosts":
        kept = {k: d[k] for k in ("layers", "first", "last", "layer_steps", "first_step", "last_step") if k in d}
        return cls(**kept, passes={name: PassSeconds(**t) for name, t in d.get("passes", {}).items()})


def _per_stage(layers: list[float], first: float, last: float, layers_per_stage: list[int]) -> list[float]:
    """Per stage, the sum of its layers' seconds, plus ``first`` on the first stage and ``last`` on the last."""
    out, start = [], 0
    for s, n in enumerate(layers_per_stage):
        t = sum(layers[start:start + n]) + (first if s == 0 else 0.0)
        out.append(t + (last if s == len(layers_per_stage) - 1 else 0.0))
        start += n
    return out


def trainer_compile(training) -> Optional[str]:
    """The ``torch.compile`` backend training compiles the decoder layers with (``training.torch_compile`` as
    applied, ``TrainingConfig.compiles``; the backend unset is ``inductor``, as ``compile_layers`` takes it), or None
    where training runs them eagerly: what ``measure_costs(compile_backend=...)`` must time."""
    return (training.torch_compile_backend or "inductor") if training.compiles() else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_costs(model: nn.Module, seq_len: int, microbatch_size: int, device: str | torch.device = "cpu",
                  repeats: int = 3, optimizer: Optional[Callable[[nn.Module], torch.optim.Optimizer]] = None,
                  split_backward: bool = False, fused_loss: bool = False,
                  compile_backend: Optional[str] = None) -> MeasuredCosts:
    """Time forward + backward of every one-layer stage (the fastest of ``repeats`` after a warm-up), and with
    ``optimizer`` (a stage -> optimizer factory, the run's own) one optimizer step of each stage the same way.
    With ``split_backward`` also each pass on its own (``MeasuredCosts.passes``): F and B of the same runs, and a
    second forward whose backward is split into I and W by torch's ``stage_backward_input`` and
    ``split_backward.weight_gradients`` (``executor._backward_input`` / ``_backward_weight``), which about doubles
    the time the measurement takes. ``fused_loss``: the last stage's loss as the run computes it (``training.fused_loss``).
``compile_backend``: the decoder layers compiled with this backend as training compiles them (``trainer_compile``;
None: eager); the first of the repeats, untimed, compiles them, and the timed ones reuse those graphs. With it,
``split_backward`` times F and B but not I and W (see ``MeasuredCosts.passes``).

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
    stages = partition_model(model, L, [1] * L, seq_len=seq_len, fused_loss=fused_loss)
    if compile_backend is not None:  # as the executor compiles a stage's layers; the head and the loss stay eager
        compile_layers([layer for st in stages for layer in st.decoder_layers()], compile_backend)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (microbatch_size, seq_len), device=device)
    x, seconds, step_seconds = ids, [], []
    # per pass, per one-layer stage; with compiled layers not I and W: torch's split backward cannot run a compiled
    # layer's backward twice (its buffers are donated), and the split-backward schedules are refused with compile
    timed = PASSES if compile_backend is None else PASSES[:2]
    raw = {name: [] for name in (timed if split_backward else ())}
    for s, st in enumerate(stages):
        st = st.to(device)  # one layer on the device at a time: a model larger than the device can be measured
        run = (lambda inp: st(inp, labels=ids)) if s == L - 1 else st
        best = float("inf")
        best_pass = dict.fromkeys(raw, float("inf"))
        for r in range(repeats + 1):
            inp, _ = _stage_input(x, s)
            t0 = _clock(device)
            out = run(inp)
            t1 = _clock(device) if raw else t0  # no extra synchronization inside the plain timing
            torch.autograd.backward(*_roots(out))
            t2 = _clock(device)
            if r > 0:
                best = min(best, t2 - t0)
            if raw:  # the first stage has no I: it runs its whole backward at W (stage_costs), not timed here
                split = _time_split_backward(run, x, s, list(st.parameters()), device) \
                    if s > 0 and "backward_input" in raw else (t1 - t0, 0.0, 0.0)
                if r > 0:
                    for name, t in zip(PASSES, (min(t1 - t0, split[0]), t2 - t1, split[1], split[2])):
                        if name in best_pass:
                            best_pass[name] = min(best_pass[name], t)
        seconds.append(best)
        for name, t in best_pass.items():
            raw[name].append(t)
        if optimizer is not None:  # the gradients just computed (accumulated over the repeats) are real-shaped
            step_seconds.append(_time_step(optimizer(st), device, repeats))
        for p in st.parameters():
            p.grad = None
        x = tuple(o.detach() for o in out) if isinstance(out, tuple) else out.detach()
        if device.type != "cpu":
            st.to("cpu")
    first, layers, last = _split_ends(seconds)
    passes = {}
    for name, secs in raw.items():
        pass_first, pass_layers, pass_last = _split_ends(secs)
        passes[name] = PassSeconds(pass_layers, pass_first, pass_last)
    if not step_seconds:
        return MeasuredCosts(layers, first, last, passes=passes)
    first_step, layer_steps, last_step = _split_ends(step_seconds)
    return MeasuredCosts(layers, first, last, layer_steps, first_step, last_step, passes=passes)


def _clock(device: torch.device) -> float:
    _sync(device)
    return time.perf_counter()


def _stage_input(x, s: int):
    """(what stage s is called with, its floating tensors as autograd leaves): the previous stage's output detached,
    the floats requiring grad as a received activation does; the first stage's token ids as they are."""
    if s == 0:
        return x, []
    parts = x if isinstance(x, tuple) else (x,)
    parts = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in parts)
    return (parts if isinstance(x, tuple) else parts[0]), [t for t in parts if t.is_floating_point()]


def _roots(out) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(outputs a backward starts from, their gradients): the loss with 1, an activation with random gradients as
    the next stage would send."""
    outs = out if isinstance(out, tuple) else (out,)
    floats = [o for o in outs if o.is_floating_point() and o.requires_grad]
    return floats, [torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o) for o in floats]


def _time_split_backward(run, x, s: int, params: list[nn.Parameter], device: torch.device) -> tuple[float, float, float]:
    """Seconds of (F, I, W) of one microbatch on a one-layer stage after the first, the backward split as the
    executor splits it: I, the input gradient, keeps the graph's weight branches; W computes the weight gradients
    from them."""
    inp, inputs = _stage_input(x, s)
    t0 = _clock(device)
    out = run(inp)
    t1 = _clock(device)
    _, groups = stage_backward_input(*_roots(out), inputs, iter(params))
    t2 = _clock(device)
    weight_gradients(params, groups)
    t3 = _clock(device)
    return t1 - t0, t2 - t1, t3 - t2


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
