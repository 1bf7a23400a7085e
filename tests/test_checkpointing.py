"""Activation checkpointing (``training.gradient_checkpointing``): the same numbers, less saved per microbatch.

With it on, every decoder layer recomputes its forward inside the backward (transformers' own
``GradientCheckpointingLayer``, non-reentrant ``torch.utils.checkpoint``). The recomputation reads the stage's
parameters as they are at backward time, which under 2BW is a newer weight version than the microbatch's forward
used unless the executor puts the microbatch's version back for its backward: the 2BW runs here fail without it.
The results must be bitwise those of the run without checkpointing (CPU kernels are deterministic), on a dense
model, an MoE with its router aux loss, a hybrid whose shared block is held on both stages, and the single process.
"""
from __future__ import annotations

import copy

import torch
import transformers.modeling_utils
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from dist_utils import run_distributed
from hf_asyncpp.model.build import build_model, enable_activation_checkpointing
from hf_asyncpp.partition import partition_model
from hf_asyncpp.plan.memory import plan_memory
from support import LLAMA, MIXTRAL, ZAMBA, check_against_reference, make_batches, make_recipe, pipeline_worker, reference, scenario

RUNS = [(LLAMA, "2bw", 2, 2, 2, "muon", True), (LLAMA, "1f1b", 2, 3, 2, "adamw", False),
        (MIXTRAL, "2bw", 2, 2, 2, "adamw", True), (MIXTRAL, "1f1b", 2, 2, 2, "muon", False),
        (ZAMBA, "2bw", 2, 2, 2, "adamw", False), (ZAMBA, "1f1b", 2, 2, 2, "adamw", False)]


def _checkpointed(recipe):
    recipe = copy.deepcopy(recipe)
    recipe.training.gradient_checkpointing = True
    return recipe


def _assert_identical(a, b, name):
    """Two runs' (step results, merged state dict) agree bit for bit."""
    (res_a, sd_a), (res_b, sd_b) = a, b
    assert [(r.loss, r.grad_norm, r.lr, r.applied) for r in res_a] == [(r.loss, r.grad_norm, r.lr, r.applied) for r in res_b], name
    assert sd_a.keys() == sd_b.keys(), name
    for k in sd_a:
        assert torch.equal(sd_a[k], sd_b[k]), f"{name}: {k}"


def test_pipeline_with_checkpointing_is_bitwise_the_pipeline_without():
    scenarios = [scenario(*s, seed=300 + i) for i, s in enumerate(RUNS)]
    jobs = [(rec, batches) for rec, batches, _, _ in scenarios] + [(_checkpointed(rec), batches) for rec, batches, _, _ in scenarios]
    results = run_distributed(pipeline_worker, 2, jobs)[0]
    plain, ckpt = results[:len(RUNS)], results[len(RUNS):]
    for s, a, b in zip(RUNS, plain, ckpt):
        _assert_identical(a[:2], b[:2], f"{s[0]['model_type']}/{s[1]}")
    # and against the single-process reference (itself checkpointed: the LocalEngine path, with the 2BW delay)
    check_against_reference([(rec, None, _checkpointed(ref), ref_b) for rec, _, ref, ref_b in scenarios[:4]], ckpt[:4])


def test_single_process_with_checkpointing_is_bitwise_without(monkeypatch):
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return checkpoint(*args, **kwargs)
    monkeypatch.setattr(transformers.modeling_utils, "checkpoint", counting)  # what the model's layers call
    for arch in (LLAMA, MIXTRAL, ZAMBA):
        rec = make_recipe(arch, "none", 1, 2, 2)
        batches = make_batches(3, 2, 2, seed=7)
        plain = reference(rec, batches)
        assert not calls
        _assert_identical(plain, reference(_checkpointed(rec), batches), arch["model_type"])
        # steps x microbatches x layers: every layer checkpointed (Zamba's hybrid layers nest a checkpointed one)
        assert len(calls) == 3 * 2 * 4 * (2 if arch is ZAMBA else 1), arch["model_type"]
        calls.clear()


# ---------------------------------------------------------------------------- what a microbatch keeps


def saved_bytes(checkpointing: bool, layers: int = 4, hidden: int = 64, seq: int = 32, batch: int = 2) -> int:
    """Bytes a middle stage (``layers`` llama layers, no embedding, no head) keeps for one microbatch's backward:
    the distinct storages autograd saves (weights excluded), plus, with checkpointing, the tensors each
    checkpointed layer keeps for its recomputation (its inputs), which autograd's hooks do not see."""
    cfg = {"model_type": "llama", "hidden_size": hidden, "intermediate_size": 4 * hidden, "num_attention_heads": 4,
           "num_key_value_heads": 4, "num_hidden_layers": 3 * layers, "vocab_size": 128, "max_position_embeddings": seq}
    torch.manual_seed(0)
    model = build_model(make_recipe(cfg, "1f1b", 3, 1, batch).model)
    if checkpointing:
        enable_activation_checkpointing(model)
    stage = partition_model(model, 3, check=False)[1].train()
    weights = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    seen: set = set()
    total = 0

    def count(t):
        nonlocal total
        if isinstance(t, (tuple, list)):
            for u in t:
                count(u)
        elif isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in weights | seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
        return t

    for m in stage.modules():
        if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing:
            ckpt = m._gradient_checkpointing_func

            def recording(fn, *args, ckpt=ckpt):
                for t in (*args, *fn.keywords.values()):
                    count(t)
                return ckpt(fn, *args)
            m._gradient_checkpointing_func = recording
    x = torch.randn(batch, seq, hidden, requires_grad=True)
    count(x)  # the received input: kept either way
    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        out = stage(x)
    out.sum().backward()  # the recomputation works
    return total


def test_checkpointing_keeps_only_the_layer_inputs():
    plain, ckpt = saved_bytes(False), saved_bytes(True)
    assert ckpt * 2 <= plain, (plain, ckpt)


def test_planner_charges_layer_inputs_plus_one_recompute():
    """A checkpointed stage is charged a small fraction of its activations per in-flight microbatch (the layer
    inputs it keeps), plus once the full activations of the one layer the backward recomputes: exactly what one
    layer of one microbatch costs without checkpointing. (The planner's terms against the executor's measured ones
    are tests/test_memory_plan.py's.)"""
    cfg = {**LLAMA, "num_hidden_layers": 8, "tie_word_embeddings": False}
    rec = make_recipe(cfg, "1f1b", 2, 4, 2)
    _, plain, _ = plan_memory(rec)
    _, ckpt, _ = plan_memory(_checkpointed(rec))
    first, first_ckpt = plain[0], ckpt[0]  # no head: every activation byte is a layer's
    lo, hi = map(int, first.layers.split("-"))
    layers = hi - lo + 1
    assert first.inflight == first_ckpt.inflight and first.weights == first_ckpt.weights
    assert first_ckpt.recompute == first.activations / (first.inflight * layers)
    assert first_ckpt.activations * 4 <= first.activations and plain[0].recompute == 0


def _compiled(recipe, checkpointing=False):
    recipe = copy.deepcopy(recipe)
    recipe.training.torch_compile, recipe.training.torch_compile_backend = True, "aot_eager"
    recipe.training.gradient_checkpointing = checkpointing
    return recipe


def test_compiled_layers_train_as_the_eager_ones():
    """``training.torch_compile``: each decoder layer compiled (aot_eager on CPU: dynamo's graphs and AOT autograd,
    the kernels eager), under 2BW's weight versions with and without activation checkpointing, and in one process:
    the eager runs' losses, norms and weights within rounding."""
    runs = [(LLAMA, "2bw", 2, 2, 2, "muon", True), (MIXTRAL, "1f1b", 2, 2, 2, "adamw", False)]
    scenarios = [scenario(*s, seed=500 + i) for i, s in enumerate(runs)]
    jobs = [(_compiled(rec, ckpt), batches) for rec, batches, _, _ in scenarios for ckpt in (False, True)]
    results = run_distributed(pipeline_worker, 2, jobs)[0]
    eager = [(rec, None, ref, ref_b) for rec, _, ref, ref_b in scenarios for _ in (False, True)]
    check_against_reference(eager, results)
    rec, _, ref, ref_b = scenarios[0]
    torch._dynamo.reset()
    counters.clear()
    res, sd = reference(_compiled(ref), ref_b)  # the one-process engine compiles the model's layers
    assert counters["stats"]["unique_graphs"] >= 1 and counters["aot_autograd"]["total"] >= 1  # it did compile
    ref_res, ref_sd = reference(ref, ref_b)
    torch.testing.assert_close(torch.tensor([r.loss for r in res]), torch.tensor([r.loss for r in ref_res]), rtol=1e-5, atol=1e-6)
    for k in ref_sd:
        torch.testing.assert_close(sd[k], ref_sd[k], rtol=1e-5, atol=1e-5)


def test_single_process_compiles_two_graphs_for_all_its_layers():
    """The one-process engine runs the model without a KV cache (as the stages do): its compiled decoder layers share
    one graph after the first layer's (2 at the first step, whatever the depth), and nothing compiles after it. With a
    cache each layer guards on its own cache entry and compiles a graph of its own (4 here)."""
    from hf_asyncpp.engine import LocalEngine
    from hf_asyncpp.topology import Topology

    rec = _compiled(make_recipe(LLAMA, "none", 1, 2, 2))
    assert rec.model.config["num_hidden_layers"] == 4
    batches = make_batches(3, 2, 2, seed=11)
    torch._dynamo.reset()
    counters.clear()
    eng = LocalEngine(rec, build_model(rec.model), Topology(), log=lambda *a: None)
    eng.train_steps(batches[:1], 0)
    first = (counters["stats"]["unique_graphs"], counters["frames"]["ok"])
    eng.train_steps(batches[1:], 1)
    after = (counters["stats"]["unique_graphs"], counters["frames"]["ok"])
    assert 1 <= first[0] <= 2 and first[1] <= 2, first
    assert after == first, (first, after)
