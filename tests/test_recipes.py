"""Every shipped recipe loads, builds on the meta device with the size its name promises, and partitions."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from hf_asyncpp.config.recipe import load_recipe
from hf_asyncpp.partition import partition_plan
from hf_asyncpp.plan.memory import meta_model, plan_memory
from support import GEMMA3N, ZAMBA

RECIPES = sorted(Path(__file__).resolve().parent.parent.glob("recipes/*.yaml"))


def promised(name: str) -> float | None:
    m = re.search(r"(\d+(?:\.\d+)?)([mb])", name)
    return float(m.group(1)) * (1e6 if m.group(2) == "m" else 1e9) if m else None


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_builds_on_meta_and_partitions(path):
    r = load_recipe(path)
    model = meta_model(r)
    assert all(p.is_meta for p in model.parameters())  # nothing allocated
    n = sum(p.numel() for p in model.parameters())
    want = promised(path.stem)
    if want:
        assert abs(n - want) / want < 0.10, f"{path.stem}: {n / 1e6:.1f}M parameters"
    plan = partition_plan(model, r.pipeline.num_stages, r.pipeline.split, seq_len=r.data.seq_len)
    assert len(plan.stages) == r.pipeline.num_stages
    assert sum(len(s.layers) for s in plan.stages) == model.config.num_hidden_layers


def test_planner_memory_matches_the_executor_for_cpu_tiny():
    """The planner's per-stage estimate against the tensors the 2BW executor really holds (within 15%)."""
    from dist_utils import run_distributed

    r = load_recipe(RECIPES[0].parent / "cpu-tiny.yaml", ["--model.config.vocab_size=4096"])
    _, mem, _ = plan_memory(r)
    measured = run_distributed(_measure_stage_bytes, 2, r)
    for est, got in zip(mem, measured):
        assert abs(est.total - got["total"]) / got["total"] < 0.15, (est, got)


def _measure_stage_bytes(rank, world, recipe):
    from hf_asyncpp.topology import Topology
    from hf_asyncpp.model.build import build_model
    from hf_asyncpp.pipeline.executor import PipelineEngine

    torch.manual_seed(0)
    eng = PipelineEngine(recipe, build_model(recipe.model), Topology(rank=rank, world_size=world, num_stages=2), log=lambda *a: None)
    p = recipe.pipeline
    batches = [torch.randint(0, 4096, (p.num_microbatches, p.microbatch_size, recipe.data.seq_len)) for _ in range(3)]
    eng.track_memory = True
    eng.train_steps(batches, 0)
    out = eng.memory_report()
    eng.close()
    return out


def test_planner_counts_shared_copies_and_received_side_inputs():
    """A block shared by layers on two stages is held (and counted) on both; a stage after the first keeps what it
    receives besides the hidden state (Gemma-3n's per-layer embeddings) for its backward."""
    from hf_asyncpp.config.recipe import recipe_from_dict
    from hf_asyncpp.plan.memory import received_values_per_token

    zamba = {k: v for k, v in ZAMBA.items() if k != "max_position_embeddings"}  # tied: the block too (untied, transformers unties it)
    r = recipe_from_dict({"model": {"config": zamba}, "data": {"seq_len": 16},
                          "pipeline": {"schedule": "1f1b", "num_stages": 2, "num_microbatches": 2}})
    plan, mem, _ = plan_memory(r)
    model = meta_model(r)
    block = sum(p.numel() for p in model.model.layers[1].shared_transf.parameters())
    own = [sum(p.numel() for n, p in model.named_parameters() if plan.stage_of(n) == s) for s in range(2)]
    assert model.model.layers[1].shared_transf.self_attn.q_proj.weight is model.model.layers[3].shared_transf.self_attn.q_proj.weight
    embed = model.model.embed_tokens.weight.numel()
    # the last stage also holds its copies of the block and of the embedding (its head)
    assert [m.params for m in mem] == [own[0], own[1] + block + embed]
    assert "+10 shared copies" in plan.format()

    plan = partition_plan(meta_model(recipe_from_dict({"model": {"config": GEMMA3N}})), 2)
    start = plan.stages[1].layers.start
    assert received_values_per_token(plan.anatomy, plan.stages[0].layers, 0) == 0
    assert received_values_per_token(plan.anatomy, plan.stages[1].layers, 1) == 8 * (4 - start)  # one 8-wide input per layer
