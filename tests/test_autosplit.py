"""``pipeline.layers_per_stage: auto``: the split from measured costs (optimizer step included), cached per recipe
and device."""
from __future__ import annotations

import json

import pytest
import torch

from hf_asyncpp.config.recipe import recipe_from_dict
from hf_asyncpp.plan.costs import MeasuredCosts, measure_costs
from hf_asyncpp.plan.autosplit import auto_split
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

    def fake_measure(model, seq_len, microbatch_size, device, optimizer, fused_loss):
        calls.append((seq_len, microbatch_size))
        stage = torch.nn.ModuleDict({"embed": torch.nn.Embedding(8, 4)})
        stage["embed"](torch.arange(8)).sum().backward()
        optimizer(stage).step()  # the run's optimizer (Muon's AdamW side here) is what gets timed
        return SKEWED

    r = _recipe()
    build = lambda: torch.nn.Module()
    assert auto_split(r, build, torch.device("cpu"), fake_measure, tmp_path) == [5, 3]
    assert calls == [(16, 2)]
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
