"""The pipeline executor against the single-process reference.

Every schedule runs on real gloo processes and must reproduce, step for step,
the single-process trainer with the matching delay semantics: GPipe/1F1B ==
synchronous training, 2BW == ``simulate_delay: 1``, PipeDream ==
``simulate_delay: pipedream``; data parallel x pipeline == the same global batch.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

from dist_utils import run_distributed
from hf_asyncpp.config import recipe_from_dict

LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64,
         "tie_word_embeddings": True}
MIXTRAL = {"model_type": "mixtral", "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64,
           "num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": True,
           "router_aux_loss_coef": 0.02, "tie_word_embeddings": False}
LLAMA_UNTIED = {**LLAMA, "tie_word_embeddings": False}
# the router aux loss is a per-batch statistic, so data parallelism (the mean of per-replica aux losses)
# equals the global batch only without it: the data-parallel MoE case turns it off
MIXTRAL_NO_AUX = {**MIXTRAL, "output_router_logits": False}
STEPS, SEQ = 4, 16


def make_recipe(arch, schedule, stages, m, mbs, opt="adamw", ef=False, delay="0", extra=0, clip=0.5, lam=1.0):
    return recipe_from_dict({
        "model": {"config": dict(arch)},
        "data": {"seq_len": SEQ},
        "pipeline": {"schedule": schedule, "num_stages": stages, "num_microbatches": m, "microbatch_size": mbs,
                     "extra_warmup": extra},
        "optimizer": {"name": opt, "learning_rate": 0.01, "delay_correction": "error_feedback" if ef else "none",
                      "simulate_delay": delay, "ns_dtype": "float32", "adam_epsilon": 1e-6, "ef_lambda": lam},
        # float32 Newton-Schulz and a non-tiny Adam epsilon: bf16 rounding and g/sqrt(v) of near-zero gradients
        # would amplify summation-order noise (data-parallel mean vs global batch) past the 1e-5 tolerance
        "training": {"max_steps": 8, "warmup_ratio": 0.25, "max_grad_norm": clip, "report_to": []},
    })


def make_batches(n, m, mbs, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (m, mbs, SEQ), generator=g) for _ in range(n)]


def build(recipe):
    from hf_asyncpp.modeling import build_model

    torch.manual_seed(0)
    return build_model(recipe.model)


def reference(recipe, batches):
    """Single-process run with the delay semantics the pipeline must reproduce."""
    from hf_asyncpp.engine import LocalEngine
    from hf_asyncpp.topology import Topology

    eng = LocalEngine(recipe, build(recipe), Topology(), log=lambda *a: None)
    results = eng.train_steps(batches, 0)
    return results, {k: v.cpu().clone() for k, v in eng.full_state_dict().items()}


def pipeline_worker(rank, world, scenarios):
    from hf_asyncpp.topology import Topology
    from hf_asyncpp.pipeline.executor import PipelineEngine

    out = []
    for recipe, replica_batches in scenarios:
        topo = Topology(rank=rank, world_size=world, num_stages=recipe.pipeline.num_stages)
        eng = PipelineEngine(recipe, build(recipe), topo, log=lambda *a: None)
        batches = replica_batches[topo.dp_rank]
        half = len(batches) // 2  # two chunks: the pipeline drains in between, numerics must not notice
        res = eng.train_steps(batches[:half], 0) + eng.train_steps(batches[half:], half)
        sd = eng.full_state_dict()
        out.append((res, sd, eng.versions.peak))
        eng.close()
    return out


def _scenario(arch, schedule, stages, m, mbs, opt, ef, dp=1, seed=0, extra=0, clip=0.5, lam=1.0):
    rec = make_recipe(arch, schedule, stages, m, mbs, opt, ef, extra=extra, clip=clip, lam=lam)
    replica = [make_batches(STEPS, m, mbs, seed + 100 * d) for d in range(dp)]
    delay = {"2bw": "1", "pipedream": "pipedream"}.get(schedule, "0")
    ref_rec = make_recipe(arch, "none", stages if schedule == "pipedream" else 1, m, mbs * dp, opt, ef, delay, clip=clip, lam=lam)
    ref_batches = [torch.cat([replica[d][k] for d in range(dp)], dim=1) for k in range(STEPS)]
    return rec, replica, ref_rec, ref_batches


def _check_export(sd, recipe, tmp_dir):
    """The merged pipeline weights export to an HF folder whose from_pretrained logits equal the stages' chain."""
    from hf_asyncpp.export import export_hf_model

    out = export_hf_model(sd, build(recipe).config, tmp_dir)
    _assert_reload_equals_stages(out, recipe, sd)


def _assert_reload_equals_stages(folder, recipe, sd):
    """from_pretrained(folder) gives the logits of the trained weights ``sd`` chained through the recipe's stages."""
    from transformers import AutoModelForCausalLM

    from hf_asyncpp.partition import partition_model

    model = build(recipe)
    model.load_state_dict({k: v for k, v in sd.items() if k in model.state_dict()}, strict=False)
    reloaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    stages = partition_model(model.eval(), recipe.pipeline.num_stages)
    ids = torch.randint(0, 128, (2, SEQ))
    with torch.no_grad():
        a = stages[0](ids)
        for st in stages[1:-1]:
            a = st(a)
        torch.testing.assert_close(reloaded(ids).logits, stages[-1](a), rtol=1e-5, atol=1e-5)


def _check(scenarios, results, tol=1e-5, export_dir=None):
    for n, ((rec, _, ref_rec, ref_batches), (res, sd, peak)) in enumerate(zip(scenarios, results)):
        if export_dir is not None and rec.pipeline.schedule in ("2bw", "gpipe"):
            _check_export(sd, rec, export_dir / f"export-{n}")
        ref_res, ref_sd = reference(ref_rec, ref_batches)
        name = f"{rec.model.config['model_type']}/tied={rec.model.config.get('tie_word_embeddings')}/{rec.pipeline.schedule}/{rec.optimizer.name}/ef={rec.optimizer.delay_correction}/lam={rec.optimizer.ef_lambda}"
        # after N steps both have applied N updates; step k logs the loss, grad norm and lr of the same batch
        # and the same update in both (a stage-local norm, pipedream without clipping, is not logged)
        assert len(res) == len(ref_res) == STEPS, name
        torch.testing.assert_close(torch.tensor([r.loss for r in res]), torch.tensor([r.loss for r in ref_res]),
                                   rtol=tol, atol=1e-6, msg=name)
        assert [r.lr for r in res] == pytest.approx([r.lr for r in ref_res], rel=1e-12), name
        norms = [(a.grad_norm, b.grad_norm) for a, b in zip(res, ref_res) if a.grad_norm is not None]
        assert len(norms) == (STEPS if rec.training.max_grad_norm or rec.pipeline.schedule != "pipedream" else 0), name
        assert [a for a, _ in norms] == pytest.approx([b for _, b in norms], rel=1e-4), name
        assert [r.applied for r in res] == [r.applied for r in ref_res] == [True] * STEPS, name
        assert set(sd) >= {k for k in ref_sd if k != "lm_head.weight"}, name
        for k, v in ref_sd.items():
            if k in sd:
                # atol 1e-5 (an update is ~1e-2 here): Adam/Muon turn summation-order noise of near-zero
                # gradients into 1e-6..1e-5 weight noise; a wrong version, lr or delay is 1000x that. On a GPU
                # (CUDA kernels reduce in other orders) one embedding element of 4096 was seen 1.7e-5 off
                torch.testing.assert_close(sd[k], v, rtol=tol, atol=1e-5 if not torch.cuda.is_available() else 5e-5, msg=lambda m, k=k, name=name: f"{name}: {k}: {m}")
        assert peak <= {"2bw": 2, "pipedream": rec.pipeline.num_stages}.get(rec.pipeline.schedule, 1), name


TWO = [
    (LLAMA, "gpipe", 2, 2, 2, "adamw", False),
    (LLAMA, "1f1b", 2, 3, 2, "adamw", False),
    (LLAMA, "2bw", 2, 2, 2, "muon", False),
    (LLAMA, "2bw", 2, 3, 2, "muon", True),
    (LLAMA, "2bw", 2, 2, 2, "adamw", True),
    (LLAMA_UNTIED, "pipedream", 2, 1, 2, "adamw", False),
    (MIXTRAL, "1f1b", 2, 2, 2, "muon", False),
    (MIXTRAL, "2bw", 2, 2, 2, "adamw", True),
    (MIXTRAL, "2bw", 2, 2, 2, "muon", False),
    (MIXTRAL, "pipedream", 2, 1, 2, "muon", False),
    (LLAMA, "2bw", 2, 3, 2, "muon", True, 1),  # pipeline.extra_warmup: other timing, same numerics
    (MIXTRAL, "1f1b", 2, 3, 2, "adamw", False, 1),
    (LLAMA_UNTIED, "pipedream", 2, 1, 2, "muon", False, 0, 0.0),  # no clipping: stage-local norms, no stall
    (LLAMA, "pipedream", 2, 1, 2, "adamw", False),  # tied: the embedding 1 version stale, the head's copy current
    (LLAMA, "2bw", 2, 2, 2, "adamw", True, 0, 0.5, "auto"),  # optimizer.ef_lambda: auto, per tensor on each stage
]


def test_two_stage_schedules_match_single_process_reference(tmp_path):
    scenarios = [_scenario(*s[:7], seed=i, extra=s[7] if len(s) > 7 else 0, clip=s[8] if len(s) > 8 else 0.5,
                           lam=s[9] if len(s) > 9 else 1.0) for i, s in enumerate(TWO)]
    results = run_distributed(pipeline_worker, 2, [(s[0], s[1]) for s in scenarios])
    _check(scenarios, results[0], export_dir=tmp_path)


FOUR = [
    (LLAMA, "1f1b", 4, 4, 1, "adamw", False, 1),
    (LLAMA, "2bw", 4, 4, 1, "muon", True, 1),
    (MIXTRAL, "gpipe", 4, 2, 2, "adamw", False, 1),
    (LLAMA_UNTIED, "pipedream", 4, 1, 2, "muon", False, 1),
    (LLAMA, "pipedream", 4, 1, 2, "muon", True, 1),  # tied: the embedding 3 versions stale, the head's copy current
    (LLAMA, "2bw", 2, 2, 2, "muon", True, 2),   # data parallel 2 x pipeline 2
    (MIXTRAL_NO_AUX, "1f1b", 2, 2, 1, "adamw", False, 2),
    (LLAMA_UNTIED, "gpipe", 2, 2, 1, "sgd", False, 2, 0.0),  # no clipping, SGD: a wrong replica mean moves every weight
]


def test_four_processes_deeper_pipelines_and_data_parallel(tmp_path):
    scenarios = [_scenario(*s[:7], dp=s[7], seed=50 + i, clip=s[8] if len(s) > 8 else 0.5) for i, s in enumerate(FOUR)]
    results = run_distributed(pipeline_worker, 4, [(s[0], s[1]) for s in scenarios])
    _check(scenarios, results[0], export_dir=tmp_path)


def local_worker(rank, world, scenarios):
    """``schedule: none`` on ``world`` data-parallel processes: ``LocalEngine``'s own all-reduce of the gradients."""
    from hf_asyncpp.engine import LocalEngine
    from hf_asyncpp.topology import Topology

    out = []
    for recipe, replica_batches in scenarios:
        topo = Topology(rank=rank, world_size=world, num_stages=1)
        eng = LocalEngine(recipe, build(recipe), topo, log=lambda *a: None)
        out.append((eng.train_steps(replica_batches[topo.dp_rank], 0), eng.full_state_dict(), 1))
    return out


def test_data_parallel_without_a_pipeline_equals_one_process_on_the_whole_batch():
    """Two replicas of the single-process engine, each on its half of the batch, equal one process on the whole
    batch: the mean of the replicas' gradients (not their sum), in the loss, the grad norm and the weights. SGD
    without clipping makes a wrong mean visible in every weight, not only in the norm (clipping and the scale
    invariance of Adam and Muon absorb a factor 2)."""
    scenarios = [_scenario(LLAMA, "none", 1, 2, 2, "adamw", False, dp=2, seed=70),
                 _scenario(MIXTRAL_NO_AUX, "none", 1, 2, 1, "sgd", False, dp=2, seed=71, clip=0.0)]
    _check(scenarios, run_distributed(local_worker, 2, [(s[0], s[1]) for s in scenarios])[0])


NAN_STEP = 2


def _skip_nonfinite(recipe):
    from hf_asyncpp.config import recipe_to_dict

    d = recipe_to_dict(recipe)
    d["training"]["on_nonfinite"] = "skip"
    return recipe_from_dict(d)


def nan_worker(rank, world, recipe, batches):
    """2BW with step NAN_STEP's loss made NaN on the last stage (so its gradient is NaN on every stage)."""
    from hf_asyncpp.pipeline.executor import PipelineEngine
    from hf_asyncpp.pipeline.schedules import ActionType
    from hf_asyncpp.topology import Topology

    eng = PipelineEngine(recipe, build(recipe), Topology(rank=rank, world_size=world, num_stages=2), log=lambda *a: None)
    do_forward, forward, now = eng._handlers[ActionType.F], eng._forward, {}
    eng._handlers[ActionType.F] = lambda a, w: (now.__setitem__("step", a.step), do_forward(a, w))[1]
    eng._forward = lambda mb, ids: forward(mb, ids) * (float("nan") if eng.last and now["step"] == NAN_STEP else 1.0)
    res = eng.train_steps(batches, 0)
    sd = eng.full_state_dict()
    eng.close()
    return res, sd


def test_nonfinite_skip_under_delay_matches_reference():
    """A NaN batch under 2BW skips exactly its own update in the executor and in ``simulate_delay: 1`` (the decision
    is taken on the gradient being applied): same applied/skipped steps, losses and weights after 6 steps."""
    from hf_asyncpp.engine import LocalEngine
    from hf_asyncpp.topology import Topology

    batches = make_batches(6, 2, 2, 11)
    res, sd = run_distributed(nan_worker, 2, _skip_nonfinite(make_recipe(LLAMA, "2bw", 2, 2, 2, "muon", True)), batches)[0]
    ref_rec = _skip_nonfinite(make_recipe(LLAMA, "none", 1, 2, 2, "muon", True, "1"))
    eng = LocalEngine(ref_rec, build(ref_rec), Topology(), log=lambda *a: None)
    forward, one_step, now = eng.model.forward, eng._one_step, {}

    def nan_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        if now["step"] == NAN_STEP:
            out.loss = out.loss * float("nan")
        return out

    eng.model.forward = nan_forward
    eng._one_step = lambda k, b: (now.__setitem__("step", k), one_step(k, b))[1]
    ref = eng.train_steps(batches, 0)
    expect = [(k, k != NAN_STEP, k == NAN_STEP) for k in range(6)]  # one update skipped, the other five applied
    assert [(r.step, r.applied, r.skipped_nonfinite) for r in res] == expect
    assert [(r.step, r.applied, r.skipped_nonfinite) for r in ref] == expect
    assert eng.nonfinite_skipped == 1
    torch.testing.assert_close(torch.tensor([r.loss for r in res]), torch.tensor([r.loss for r in ref]), rtol=1e-5,
                               atol=1e-6, equal_nan=True)
    assert [r.lr for r in res] == pytest.approx([r.lr for r in ref], rel=1e-12)
    for k, v in eng.full_state_dict().items():
        if k in sd:
            torch.testing.assert_close(sd[k], v.cpu(), rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def export_worker(rank, world, recipe, batches, out_dir):
    """Train a few steps, then export: every stage writes its own shard; record what the gather carried."""
    import torch.distributed as dist

    from hf_asyncpp.export import export_engine
    from hf_asyncpp.pipeline.executor import PipelineEngine
    from hf_asyncpp.topology import Topology

    eng = PipelineEngine(recipe, build(recipe), Topology(rank=rank, world_size=world, num_stages=world), log=lambda *a: None)
    eng.train_steps(batches, 0)
    carried, gather = [], dist.gather_object

    def spy(obj, *args, **kwargs):  # passes through: only records what each rank hands to the main process
        carried.append(obj)
        return gather(obj, *args, **kwargs)

    dist.gather_object = spy
    try:
        export_engine(eng, out_dir)
    finally:
        dist.gather_object = gather
    sd = eng.full_state_dict()  # for the comparison only, after the export
    eng.close()
    return carried, sd


def test_sharded_export_of_four_stages_reloads_exactly(tmp_path):
    """4 stages of a MoE model export without a gather (each stage its own safetensors shard, the main process only
    names and sizes); from_pretrained of the folder gives the trained stages' logits."""
    recipe = make_recipe(MIXTRAL, "2bw", 4, 4, 1, "adamw")
    out = tmp_path / "export"
    results = run_distributed(export_worker, 4, recipe, make_batches(2, 4, 1, 7), str(out))
    for carried, _ in results:
        payload = [x for obj in carried for x in ([] if obj is None else [obj])]
        assert all(isinstance(name, str) and all(isinstance(v, int) for v in sizes.values()) for name, sizes in payload)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    _assert_reload_equals_stages(out, recipe, results[0][1])


def split_resume_worker(rank, world, old, new, tmp):
    from pathlib import Path

    from hf_asyncpp.pipeline.executor import PipelineEngine
    from hf_asyncpp.topology import Topology

    topo = Topology(rank=rank, world_size=world, num_stages=2)
    eng = PipelineEngine(old, build(old), topo, log=lambda *a: None)
    eng.train_steps(make_batches(3, 2, 2, 5), 0)
    eng.save(Path(tmp))
    saved = {g["name"]: g["lr"] for g in eng.optimizer.param_groups}
    eng.close()
    fresh = PipelineEngine(new, build(new), topo, log=lambda *a: None)
    fresh.load(Path(tmp))
    groups = {g["name"]: (g["lr"], g["split_rows"] if g["use_muon"] else None) for g in fresh.optimizer.param_groups}
    fresh.close()
    return saved, groups


def test_checkpoint_from_before_the_split_resumes_the_split_group_on_schedule(tmp_path):
    """A pipelined MoE checkpoint written with fused experts in the "muon" group (muon_split_fused: false, or before
    the option) resumes with muon_split_fused: true: the new "muon_split" group takes the lr the schedule had
    reached, its split from the recipe."""
    from hf_asyncpp.config import recipe_to_dict

    d = recipe_to_dict(make_recipe(MIXTRAL, "2bw", 2, 2, 2, "muon"))
    d["optimizer"]["muon_split_fused"] = False
    old = recipe_from_dict(d)
    saved, groups = run_distributed(split_resume_worker, 2, old, make_recipe(MIXTRAL, "2bw", 2, 2, 2, "muon"),
                                    str(tmp_path))[0]
    assert "muon_split" not in saved and saved["muon"] != 0.01  # the schedule has moved off the peak
    assert groups["muon_split"] == (saved["muon"], 2) and groups["muon"] == (saved["muon"], 1)
