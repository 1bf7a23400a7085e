"""``pipeline.layers_per_stage: auto``: the split from measured costs (optimizer step included), cached per recipe
and device."""
from __future__ import annotations

import json

import pytest
import torch

from hf_asyncpp.config.recipe import recipe_from_dict
from hf_asyncpp.model.build import compile_counts
from hf_asyncpp.plan.costs import MeasuredCosts, measure_costs, trainer_compile
from hf_asyncpp.plan.autosplit import auto_split, cache_key
from support import tiny_llama

MODEL = {"config": tiny_llama(8), "vocab_size": 256}


def _recipe(**opt):
    return recipe_from_dict({"model": MODEL, "data": {"seq_len": 16},
                             "pipeline": {"schedule": "2bw", "num_stages": 2, "num_microbatches": 4, "microbatch_size": 2,
                                          "layers_per_stage": "auto"},
                             "optimizer": {"name": "muon", **opt}})


# 8 equal layers whose forward + backward is 1 s per microbatch, but the last four step 8 s per update (say, matrices
# Muon orthogonalizes where the first four are cheap): per microbatch at m = 4 they cost 1 + 8/4 = 3 s.
SKEWED = MeasuredCosts(layers=[1.0] * 8, first=0.0, last=0.0, layer_steps=[0.0] * 4 + [8.0] * 4)


def test_step_cost_moves_the_split():
    assert MeasuredCosts([1.0] * 8, 0.0, 0.0).balance(2, 4) == [4, 4]  # forward + backward alone: even
    assert SKEWED.balance(2, 4) == [5, 3]  # 4 x 1 + 3 = 7 against 3 x 3 = 9; [4, 4] would be 4 against 12
    assert SKEWED.stage_seconds([5, 3], 4) == [7.0, 9.0]
    assert SKEWED.balance(2, 1000) == [4, 4]  # a step spread over many microbatches no longer matters


def test_auto_split_balances_a_skewed_profile_and_hits_the_cache(tmp_path):
    calls = []

    def fake_measure(model, seq_len, microbatch_size, device, optimizer, fused_loss, compile_backend):
        calls.append((seq_len, microbatch_size, compile_backend))
        stage = torch.nn.ModuleDict({"embed": torch.nn.Embedding(8, 4)})
        stage["embed"](torch.arange(8)).sum().backward()
        optimizer(stage).step()  # the run's optimizer (Muon's AdamW side here) is what gets timed
        return SKEWED

    r = _recipe()
    build = lambda: torch.nn.Module()
    assert auto_split(r, build, torch.device("cpu"), fake_measure, tmp_path) == [5, 3]
    assert calls == [(16, 2, None)]  # training on the CPU runs eager layers: so are they timed
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["costs"]["layer_steps"] == SKEWED.layer_steps
    assert auto_split(r, build, torch.device("cpu"), fake_measure, tmp_path) == [5, 3]  # second start: cached
    assert len(calls) == 1
    r.pipeline.num_microbatches = 1000  # same measurement, another balance
    assert auto_split(r, build, torch.device("cpu"), fake_measure, tmp_path) == [4, 4] and len(calls) == 1
    auto_split(_recipe(learning_rate=0.1), build, torch.device("cpu"), fake_measure, tmp_path)  # same timing: cached
    assert len(calls) == 1
    auto_split(_recipe(ns_steps=3), build, torch.device("cpu"), fake_measure, tmp_path)  # another optimizer: measured
    assert len(calls) == 2 and len(list(tmp_path.glob("*.json"))) == 2
    files[0].write_text("{not json")  # a damaged cache file is measured again, not trusted
    auto_split(r, build, torch.device("cpu"), fake_measure, tmp_path)
    assert len(calls) == 3


def test_measure_costs_times_the_optimizer_step():
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_asyncpp.optim import build_optimizer

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(**tiny_llama(3, vocab_size=256))
    r = _recipe()
    stepped = []  # per stage the run's optimizer was built for: (what it holds, how often it stepped)

    def the_runs_optimizer(st):
        opt = build_optimizer(st, r.optimizer, log=lambda *_: None)
        held = {n.split(".")[2] if n.startswith("model.layers.") else n for n, _ in st.named_parameters()}
        stepped.append([held, 0])
        step = opt.step

        def counted(*a, **k):
            stepped[-1][1] += 1
            return step(*a, **k)

        opt.step = counted
        return opt

    c = measure_costs(AutoModelForCausalLM.from_config(cfg), 16, 2, repeats=1, optimizer=the_runs_optimizer)
    # every one-layer stage's own optimizer (the ends with the embedding and the head) stepped: a warm-up + 1 timed
    assert [h for h, _ in stepped] == [{"0", "model.embed_tokens.weight"}, {"1"}, {"2", "model.norm.weight", "lm_head.weight"}]
    assert [n for _, n in stepped] == [2, 2, 2]
    assert len(c.layer_steps) == 3 and all(t > 0 for t in c.layer_steps)
    back = MeasuredCosts.from_dict(json.loads(json.dumps(c.to_dict())))
    assert back == c
    with pytest.raises(TypeError):
        MeasuredCosts.from_dict({"layers": [1.0]})  # first / last are required


def test_the_compile_setting_is_measured_and_keys_the_cache(tmp_path):
    """``auto`` times the program training runs: the layers compiled with the trainer's backend where training compiles
    them (``torch_compile`` as applied), so a compiled and an eager measurement are two cache entries."""
    seen = []

    def fake_measure(model, seq_len, microbatch_size, device, optimizer, fused_loss, compile_backend):
        seen.append(compile_backend)
        return SKEWED

    eager, aot, inductor = _recipe(), _recipe(), _recipe()
    eager.training.torch_compile = False
    aot.training.torch_compile, aot.training.torch_compile_backend = True, "aot_eager"
    inductor.training.torch_compile = True  # backend unset: inductor, as compile_layers takes it
    assert [trainer_compile(r.training) for r in (eager, aot, inductor)] == [None, "aot_eager", "inductor"]
    cpu = torch.device("cpu")
    keys = [cache_key(r, cpu) for r in (eager, aot, inductor)]
    assert len({json.dumps(k, sort_keys=True) for k in keys}) == 3
    for r in (eager, aot, inductor, aot):
        auto_split(r, lambda: torch.nn.Module(), cpu, fake_measure, tmp_path)
    assert seen == [None, "aot_eager", "inductor"] and len(list(tmp_path.glob("*.json"))) == 3  # the 4th: cached


def test_compiled_measurement_times_compiled_layers_after_their_warm_up():
    """With ``compile_backend`` every timed forward of a layer runs its compiled graph (counted by the backend), and
    every graph is compiled at a stage's first, untimed, forward: no compile time is timed, no recompile follows."""
    from torch._dynamo.backends.registry import lookup_backend
    from transformers import AutoConfig, AutoModelForCausalLM

    torch._dynamo.reset()
    aot_eager, repeats, L = lookup_backend("aot_eager"), 2, 3
    calls, compiled_at = [0], []  # forwards run by the compiled graphs; the forward count when each graph compiled

    def counting_aot_eager(gm, example_inputs):
        compiled_at.append(calls[0])
        fn = aot_eager(gm, example_inputs)

        def run(*args):
            calls[0] += 1
            return fn(*args)
        return run

    cfg = AutoConfig.for_model(**tiny_llama(L, vocab_size=256))
    torch.manual_seed(0)
    before = compile_counts()
    c = measure_costs(AutoModelForCausalLM.from_config(cfg), 16, 2, repeats=repeats, split_backward=True,
                      compile_backend=counting_aot_eager)  # as ``plan --measure`` measures
    after = compile_counts()
    assert calls[0] == L * (repeats + 1)  # every forward of every one-layer stage, warm-up and timed, compiled
    assert compiled_at and all(n % (repeats + 1) == 0 for n in compiled_at)  # only at a stage's warm-up forward
    assert after["frames"] - before["frames"] == len(compiled_at) > 0
    assert after["graph_breaks"] == before["graph_breaks"] and after["eager_fallbacks"] == before["eager_fallbacks"]
    assert len(c.layers) == L and all(t > 0 for t in c.layers) and c.first >= 0 and c.last >= 0
    # F and B timed; not I and W (the split-backward schedules are refused with compile): the simulator's halves
    assert set(c.passes) == {"forward", "backward"} and all(t > 0 for p in c.passes.values() for t in p.layers)
    costs = c.stage_costs([2, 1])
    assert costs.backward_input is None and costs.backward_weight is None and all(t > 0 for t in costs.forward)
    torch.manual_seed(0)
    mid = compile_counts()
    eager = measure_costs(AutoModelForCausalLM.from_config(cfg), 16, 2, repeats=1)  # a fresh model: eager layers
    assert compile_counts()["frames"] == mid["frames"] and len(eager.layers) == L


def test_auto_measured_with_compile_leaves_the_run_its_own_graphs(tmp_path):
    """After ``auto`` measured compiled layers, the run's stage compiles as in a fresh process: 2 graphs (its first
    layer, and one its other layer shares), 1 recompile; the throw-away layers' graphs are not left to be checked
    at every call or to count the run's first compile as a recompile."""
    from hf_asyncpp.model.build import build_model, compile_layers
    from hf_asyncpp.partition.stage import partition_model

    r = _recipe()
    r.model.config["num_hidden_layers"] = 4
    r.training.torch_compile, r.training.torch_compile_backend = True, "aot_eager"
    assert sum(auto_split(r, lambda: build_model(r.model), torch.device("cpu"), folder=tmp_path)) == 4
    before = compile_counts()
    stage = partition_model(build_model(r.model), 2, [2, 2], seq_len=16)[0]
    compile_layers(stage.decoder_layers(), "aot_eager")
    out = stage(torch.randint(0, 256, (2, 16)))
    torch.autograd.backward(out, torch.randn_like(out))
    after = compile_counts()
    assert {k: after[k] - before[k] for k in ("frames", "recompiles")} == {"frames": 2, "recompiles": 1}
