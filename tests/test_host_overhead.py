"""The host dispatches per action what the issue "GPU-bound stages" allows: counts, not timings (a TorchDispatchMode
over the executor's own actions, ``hf_asyncpp.testing.HostOps``; ``python -m bench.host_overhead`` writes the table).
The counts depend on the code and the model's topology, not on its width, so a CPU run holds what a GPU's host
dispatches for smollm2-360m's stage (290 tensors)."""
from pathlib import Path

import pytest

from hf_asyncpp.testing import host_ops_per_step, micro_stage_recipe, plain_ops_per_microbatch, run_workers

SMOLLM2 = Path(__file__).resolve().parent.parent / "recipes" / "smollm2-360m.yaml"


@pytest.fixture(scope="module")
def counts():
    """smollm2-360m's 32 layers, and 16: the same shape classes with half the tensors."""
    return {layers: run_workers(host_ops_per_step, 1, micro_stage_recipe(SMOLLM2, layers))[0] for layers in (32, 16)}


def test_the_optimizer_step_is_a_handful_of_kernels_whatever_the_depth(counts):
    deep, shallow = counts[32], counts[16]
    assert deep["tensors"] == {"muon": 224, "adamw": 66}
    step = deep["actions"]["STEP"]
    assert step["launching"] <= 150, step  # was 7,559 (a per-tensor loop: 38.6 ops per Muon matrix)
    # the count follows the shape classes, not the tensors: 144 fewer tensors, at most a few ops fewer
    assert step["launching"] - shallow["actions"]["STEP"]["launching"] <= 4, (step, shallow["actions"]["STEP"])


def test_forward_and_backward_dispatch_no_more_than_the_plain_model(counts):
    """Per microbatch, F and B dispatch no more ops, and launch no more kernels, than transformers' own model of the
    same layout trained at the same precision (fp32 weights under bf16 autocast: the stage's numerics, bit for bit),
    measured here side by side. The stage's bf16 copies are made once per version, not cast per microbatch, and from
    a step's second microbatch on its bf16 weight gradients are added into the fp32 ones in place (no cast, no fp32
    temporary). Was F 2,793.5 and B 5,063 against the plain model's 2,819 and 5,062."""
    plain = run_workers(plain_ops_per_microbatch, 1, micro_stage_recipe(SMOLLM2), False)[0]
    actions = counts[32]["actions"]
    for kind in ("F", "B"):
        assert actions[kind]["ops"] <= plain[kind]["ops"], (kind, actions[kind], plain[kind])
        assert actions[kind]["launching"] <= plain[kind]["launching"], (kind, actions[kind], plain[kind])
    assert actions["B"]["ops"] <= 0.97 * 5063, actions["B"]  # the in-place accumulation's share


def test_the_weights_are_swapped_once_per_step_not_per_microbatch(counts):
    """The stage's modules are pointed at a version's weights when the version changes (once per step here: 2BW,
    one stage), not by a ``functional_call`` per microbatch (4 per step, 1.7 ms of host each for 290 tensors)."""
    assert counts[32]["weight_swaps_per_step"] == 1, counts[32]


def test_a_step_reads_nothing_back_from_the_device(counts):
    """No scalar read in a whole step (under ``on_nonfinite: stop``, the default): the mask probe of every forward
    (transformers' packed-sequence check) is gone with the mask-free causal attention, the 66 step-counter reads of
    the AdamW side with the fused kernel (its counters on the device), the grad norm's read at STEP with the clip
    coefficient computed on the device, and the report's reads with its host buffers read whole. (Was 73.)"""
    assert counts[32]["reads_per_step"] == {}


def clip_coefficients(rank: int, world: int, recipe: dict) -> list[tuple[str, str]]:
    """(coefficient dtype, gradients' dtypes) of each ``_foreach_mul_`` the STEP makes with a tensor coefficient."""
    import torch

    from hf_asyncpp.testing import _stage_engine

    eng, batches = _stage_engine(rank, world, recipe)
    seen, real = [], torch._foreach_mul_
    step = eng._handlers["STEP"]

    def spy(tensors, other):
        if isinstance(other, torch.Tensor):
            seen.append((str(other.dtype), ",".join(sorted({str(t.dtype) for t in tensors}))))
        return real(tensors, other)

    def spied_step(a, w):
        torch._foreach_mul_ = spy
        try:
            return step(a, w)
        finally:
            torch._foreach_mul_ = real
    eng._handlers["STEP"] = spied_step
    eng.train_steps(batches(2), 0)
    eng.close()
    return seen


def test_the_clip_coefficient_has_the_gradients_dtype():
    """The norm is summed in float64; the clip's coefficient is cast to the gradients' dtype before the foreach
    multiply, whose CUDA kernel takes one launch only when the scalar tensor has the tensors' dtype (else one
    multiply per tensor)."""
    seen = run_workers(clip_coefficients, 1, micro_stage_recipe(SMOLLM2, 2))[0]
    assert seen and set(seen) == {("torch.float32", "torch.float32")}, seen


def profiled_actions(rank: int, world: int, recipe: dict) -> dict:
    """The ``PP:`` ranges of a ``torch.profiler`` trace over two steps, in start order, beside the actions the
    executor ran then; and the profiler ops a step then dispatches with no profiler on outside its actions'
    handlers (inside, torch's optimizers enter ``record_function`` on their own)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_asyncpp.testing import _stage_engine

    ran, inside = [], [False]

    class ProfilerOpsOutside(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name.startswith("profiler::") and not inside[0]:
                self.names.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    def labelled(a, w, handler):
        ran.append(str(a))
        inside[0] = True
        try:
            return handler(a, w)
        finally:
            inside[0] = False

    eng, batches = _stage_engine(rank, world, recipe)
    eng.train_steps(batches(1), 0)
    for kind, handler in list(eng._handlers.items()):
        eng._handlers[kind] = lambda a, w, handler=handler: labelled(a, w, handler)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        eng.train_steps(batches(2), 1)
    events = sorted((e for e in prof.events() if e.name.startswith("PP:")), key=lambda e: e.time_range.start)
    profiled = list(ran)
    with ProfilerOpsOutside() as off:
        eng.train_steps(batches(1), 3)
    eng.close()
    return {"labels": [e.name for e in events], "ran": profiled, "profiler_ops_off": off.names, "ran_off": len(ran)}


def test_a_profiler_trace_names_each_action_and_no_profiler_costs_no_op():
    """Under ``torch.profiler`` every action the executor runs is one ``record_function`` range named as
    ``torch.distributed.pipelining`` names its own (``PP:F1.0@v0``, ``PP:STEP1``); with no profiler on, the executor
    dispatches no profiler op around its actions (entering ``record_function`` would dispatch two per action)."""
    out = run_workers(profiled_actions, 1, micro_stage_recipe(SMOLLM2, 2))[0]
    assert out["labels"] == [f"PP:{a}" for a in out["ran"]], (out["labels"][:12], out["ran"][:12])
    assert {"PP:F1.0@v0", "PP:B1.0@v0", "PP:REDUCE1", "PP:STEP1", "PP:STEP2"} <= set(out["labels"]), out["labels"]
    assert out["ran_off"] > len(out["ran"]) and out["profiler_ops_off"] == [], out["profiler_ops_off"]
