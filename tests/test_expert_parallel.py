"""Expert parallelism inside a stage (``pipeline.expert_parallel``, ``pipeline/experts.py``): a run whose experts are
sharded over a stage's replicas, the tokens moved by transformers' ``AllToAllEP``, equals the same run with every
expert on every replica (losses, grad norms, the weights after the steps) within fp32 rounding. Every distributed
test here runs under the NCCL-order transport (``conftest.py`` sets it for the suite)."""
from __future__ import annotations

import copy

import pytest
import torch

from dist_utils import run_distributed
from support import MIXTRAL, assert_reload_equals_stages, build, make_recipe, scenario

QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 64, "num_hidden_layers": 4, "vocab_size": 128,
             "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "output_router_logits": True, "router_aux_loss_coef": 0.02, "tie_word_embeddings": False}


def _route_to_first_two(model) -> None:
    """Every router's choices folded onto experts 0 and 1 (its indices mod 2), in both runs: with 2 expert-parallel
    ranks, rank 1's experts get no token from any replica."""
    for m in model.modules():
        if type(m).__name__.endswith("TopKRouter"):
            m.register_forward_hook(lambda _, __, out: (*out[:-1], out[-1] % 2))


def ep_worker(rank, world, runs, route_two=False, export_dir=None):
    """Each recipe trained on its replica batches in two windows: (loss, grad norm, lr) per step, then a held-out
    NLL, and the gathered weights (main process); with ``export_dir`` the expert-parallel runs also export there (``export_engine``)."""
    import os
    from pathlib import Path

    from hf_asyncpp.model.export import export_engine
    from hf_asyncpp.pipeline.executor import PipelineEngine
    from hf_asyncpp.topology import Topology

    assert os.environ.get("HF_ASYNCPP_P2P") == "nccl-order"
    received = []  # rows each expert-parallel dispatch brought this rank's experts
    if route_two:
        from transformers.distributed.expert_parallel import AllToAllEP

        dispatch = AllToAllEP._dispatch_tokens

        def spy(self, *args):
            rows = dispatch(self, *args)
            received.append(rows[0].shape[0])
            return rows
        AllToAllEP._dispatch_tokens = spy
    out = []
    for n, (recipe, replica_batches) in enumerate(runs):
        topo = Topology(rank=rank, world_size=world, num_stages=recipe.pipeline.num_stages)
        model = build(recipe)
        if route_two:
            _route_to_first_two(model)
        eng = PipelineEngine(recipe, model, topo, log=lambda *a: None)
        batches = replica_batches[topo.dp_rank]
        res = eng.train_steps(batches[:2], 0) + eng.train_steps(batches[2:], 2)
        sd = eng.full_state_dict()
        # held-out NLL: 5 blocks in batches of 2, so replica 0 runs 2 forwards and replica 1 one (a 2nd, filling)
        nll = eng.eval_nll(torch.randint(0, 128, (5, 16), generator=torch.Generator().manual_seed(5)), 2)
        if export_dir is not None and recipe.pipeline.expert_parallel > 1:
            export_engine(eng, Path(export_dir) / f"export-{n}")
        local = {k: tuple(p.shape) for k, p in eng.params.items()}
        out.append(([(r.loss, r.grad_norm, r.lr) for r in res] + [nll], sd, local))
        eng.close()
    return (out, received) if route_two else out


def _with_ep(recipe, ep: int, **fields):
    rec = copy.deepcopy(recipe)
    rec.pipeline.expert_parallel = ep
    for section_field, value in fields.items():
        section, name = section_field.split("__")
        setattr(getattr(rec, section), name, value)
    return rec


def _assert_same_run(plain, sharded, what):
    (a, sd_a, _), (b, sd_b, _) = plain, sharded
    (a, nll_a), (b, nll_b) = (a[:-1], a[-1]), (b[:-1], b[-1])
    assert nll_b[1] == nll_a[1] and nll_b[0] == pytest.approx(nll_a[0], rel=1e-5), what
    assert len(a) == len(b) == 4, what
    torch.testing.assert_close(torch.tensor([x[0] for x in b]), torch.tensor([x[0] for x in a]), rtol=1e-5, atol=1e-6,
                               msg=what)
    assert [x[1] for x in b] == pytest.approx([x[1] for x in a], rel=1e-5), what
    assert [x[2] for x in b] == [x[2] for x in a], what
    assert sd_a.keys() == sd_b.keys(), what
    for k in sd_a:  # atol as check_against_reference's: Adam/Muon turn the summation-order noise of near-zero
        # gradients into 1e-6..1e-5 weight noise (an update is ~1e-2 here; a wrong expert slice or scale is 1000x that)
        torch.testing.assert_close(sd_b[k], sd_a[k], rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{what}: {k}: {m}")


def _pairs(specs):
    """Each spec (arch, schedule, stages, m, mbs, optimizer, EF, replicas, expert_parallel, {field: value}) as the
    plain recipe and its expert-parallel twin on the same replica batches."""
    runs = []
    for i, (arch, sched, stages, m, mbs, opt, ef, dp, ep, fields) in enumerate(specs):
        rec, replica, _, _ = scenario(arch, sched, stages, m, mbs, opt, ef, dp=dp, seed=31 + i)
        plain = _with_ep(rec, 1, **fields)
        runs += [(plain, replica), (_with_ep(plain, ep), replica)]
    return runs


def test_two_stages_two_replicas_equal_the_run_without_expert_parallelism(tmp_path):
    """2 stages x 2 replicas, experts over both: Mixtral under 2BW with Muon and EF; Qwen3-MoE under GPipe with
    AdamW, activation checkpointing and ZeRO-1 (the replicated part sharded, each rank stepping its own experts), and
    under ZB-H1 (the backward split in two: the all-to-alls' backward runs in the input half) with dense layers 0
    and 1 (stage 0 has no expert: its groups, norm and forward-only rounds follow the others').
    Each rank holds half of every expert tensor; the export gathers them into a folder from_pretrained reads."""
    specs = [(MIXTRAL, "2bw", 2, 2, 2, "muon", True, 2, 2, {}),
             (QWEN3_MOE, "gpipe", 2, 2, 2, "adamw", False, 2, 2,
              {"training__gradient_checkpointing": True, "optimizer__shard_across_replicas": True}),
             ({**QWEN3_MOE, "mlp_only_layers": [0, 1]}, "zbh1", 2, 2, 1, "muon", False, 2, 2, {})]
    runs = _pairs(specs)
    results = run_distributed(ep_worker, 4, runs, False, str(tmp_path))
    main = results[0]
    for k, spec in enumerate(specs):
        _assert_same_run(main[2 * k], main[2 * k + 1], f"{spec[0]['model_type']}/{spec[1]}")
        rec = runs[2 * k + 1][0]
        assert_reload_equals_stages(tmp_path / f"export-{2 * k + 1}", rec, main[2 * k + 1][1])
    for r, res in enumerate(results):  # each rank holds its own half of the experts, every dense tensor whole
        for k in range(len(specs)):
            plain, sharded = res[2 * k][2], res[2 * k + 1][2]
            for n, shape in plain.items():
                halved = ".experts." in n
                assert sharded[n] == ((shape[0] // 2, *shape[1:]) if halved else shape), (r, n)


def test_one_stage_four_replicas_equal_the_run_without_expert_parallelism():
    """1 stage x 4 replicas: experts over 2 (two blocks: expert gradients summed over the replicas holding the same
    shard) under 2BW with Muon, and over all 4 under 1F1B with AdamW."""
    specs = [(QWEN3_MOE, "2bw", 1, 2, 1, "muon", True, 4, 2, {}),
             (MIXTRAL, "1f1b", 1, 2, 1, "adamw", False, 4, 4, {})]
    main = run_distributed(ep_worker, 4, _pairs(specs))[0]
    for k, spec in enumerate(specs):
        _assert_same_run(main[2 * k], main[2 * k + 1], f"{spec[0]['model_type']}/{spec[1]}/ep={spec[8]}")


def test_experts_that_get_no_token_get_a_zero_gradient():
    """Every router folded onto experts 0 and 1: the rank holding experts 2 and 3 receives no token from either
    replica (transformers' empty-batch path) and still runs the backward's exchange; the run equals the plain one
    (experts 2 and 3 with a zero gradient: only weight decay moves them, as in the plain run)."""
    specs = [(MIXTRAL, "gpipe", 1, 2, 2, "adamw", False, 2, 2, {})]
    (main, first), (_, second) = run_distributed(ep_worker, 2, _pairs(specs), True)
    assert first and all(first) and second and not any(second), (first, second)  # rank 1's experts: never a row
    _assert_same_run(main[0], main[1], "mixtral routed to experts 0 and 1")


@pytest.mark.parametrize("arch,ep,replicas,fragment", [
    ({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
      "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 128}, 2, 2, r"\(llama\) has none"),
    (MIXTRAL, 3, 4, "does not divide the 4 data-parallel replica"),
    (MIXTRAL, 8, 8, "does not divide the model's 4 experts"),
])
def test_bad_expert_parallel_is_named(arch, ep, replicas, fragment):
    from hf_asyncpp.errors import RecipeError
    from hf_asyncpp.partition import partition_model
    from hf_asyncpp.pipeline.experts import expert_names

    model = build(make_recipe(arch, "gpipe", 1, 1, 1))
    stage = partition_model(model, 1)[0]
    with pytest.raises(RecipeError, match=fragment) as e:
        expert_names(model, stage, ep, replicas)
    assert "pipeline.expert_parallel" in str(e.value)
    assert expert_names(model, stage, 1, replicas) == []


def test_the_one_process_engine_refuses_sharded_experts():
    """``pipeline.schedule: none`` trains in ``LocalEngine``, which holds every expert: a recipe asking for sharded
    experts there is named, not silently run replicated."""
    from hf_asyncpp.engine import LocalEngine
    from hf_asyncpp.errors import RecipeError
    from hf_asyncpp.topology import Topology

    rec = _with_ep(make_recipe(MIXTRAL, "none", 1, 1, 1), 2)
    with pytest.raises(RecipeError, match="pipeline.expert_parallel: 2 runs in the pipeline executor"):
        LocalEngine(rec, build(rec), Topology(), log=lambda *a: None)


def save_resume_worker(rank, world, recipe, batches, tmp):
    """4 steps straight with the experts over both replicas; 2 steps, a save, a fresh engine that loads it, 2 steps;
    and the same checkpoint resumed with every expert on every replica (expert_parallel 1)."""
    from pathlib import Path

    from hf_asyncpp.pipeline.executor import PipelineEngine
    from hf_asyncpp.storage import checkpoint_io as ckpt
    from hf_asyncpp.topology import Topology

    topo = Topology(rank=rank, world_size=world, num_stages=recipe.pipeline.num_stages)
    mine = batches[topo.dp_rank]
    runs = {}
    for how in ("straight", "resumed", "onto plain"):
        eng = PipelineEngine(recipe, build(recipe), topo, log=lambda *a: None)
        if how == "onto plain":
            eng.close()
            eng = PipelineEngine(_with_ep(recipe, 1), build(recipe), topo, log=lambda *a: None)
            eng.load(Path(tmp))
            res = []
        else:
            res = eng.train_steps(mine[:2], 0)
        if how == "resumed":
            eng.save(Path(tmp))
            eng.close()
            eng = PipelineEngine(recipe, build(recipe), topo, log=lambda *a: None)
            eng.load(Path(tmp))
        res += eng.train_steps(mine[2:], 2)
        runs[how] = ([(r.loss, r.grad_norm) for r in res], eng.full_state_dict())
        eng.close()
    saved = {n: tuple(t.shape) for n, t in ckpt.load_tensors(Path(tmp) / "stage-00.safetensors").items()} \
        if rank == 0 else None
    return runs, saved


@pytest.mark.parametrize("zero", [False, True])
def test_checkpoint_resumes_bit_for_bit_and_onto_another_expert_parallel_size(tmp_path, zero):
    """1 stage x 2 replicas, experts over both, 2BW with Muon and EF (two weight versions, momentum, EF buffers per
    expert), and with ZeRO-1 (replica 1's own optimizer file, without its experts): a save after 2 steps holds every
    expert whole; resumed with the same expert_parallel the run continues with the same losses and weights bit for
    bit, resumed with expert_parallel 1 within fp32 rounding."""
    rec, replica, _, _ = scenario(MIXTRAL, "2bw", 1, 2, 2, "muon", True, dp=2, seed=3)
    rec = _with_ep(rec, 2, optimizer__shard_across_replicas=zero)
    runs, saved = run_distributed(save_resume_worker, 2, rec, replica, str(tmp_path))[0]
    assert saved["model.layers.0.mlp.experts.gate_up_proj"][0] == 4  # every expert, in replica 0's file
    (straight, a), (resumed, b), (plain, c) = runs["straight"], runs["resumed"], runs["onto plain"]
    # as tests/test_runtime.py's resume: the restored grad norm's float64 sum may round its last bit differently
    torch.testing.assert_close(torch.tensor(resumed, dtype=torch.float64), torch.tensor(straight, dtype=torch.float64),
                               rtol=1e-9, atol=0)
    assert [x[0] for x in resumed] == [x[0] for x in straight]
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    assert [x[0] for x in plain] == pytest.approx([x[0] for x in straight[2:]], rel=1e-6)
    for k in a:
        torch.testing.assert_close(c[k], a[k], rtol=1e-5, atol=1e-5)


def host_ops_worker(rank, world, recipe):
    """What ``hf_asyncpp.testing.host_ops_per_step`` measures (``HostOps`` over 2 steps after 2), and the host reads
    ``Tensor.tolist`` makes in those steps (no dispatched op: ``HostOps`` does not see them)."""
    from hf_asyncpp.testing import HostOps, _stage_engine

    eng, batches = _stage_engine(rank, world, recipe)
    eng.train_steps(batches(2), 0)
    mode, real, calls = HostOps(), torch.Tensor.tolist, []
    mode.watch(eng)

    def counted(t):
        calls.append(mode.label)
        return real(t)
    torch.Tensor.tolist = counted
    try:
        with mode:
            eng.train_steps(batches(2), 2)
    finally:
        torch.Tensor.tolist = real
    eng.close()
    return {"actions": mode.per_call(), "reads_per_step": mode.reads, "tolist": {k: calls.count(k) / 2 for k in set(calls)}}


def test_the_all_to_all_costs_a_few_host_ops_and_one_read_per_moe_layer():
    """The all-to-alls run inside F and B and are counted there (``hf_asyncpp.testing.HostOps``): per microbatch,
    a bounded number of extra ops per MoE layer (dispatch and combine: the counts, the sort, two exchanges), and
    transformers' ``AllToAllEP`` reads the split sizes to the host once per layer and forward (nothing more in the
    backward); the reduction and the step add nothing per expert."""
    def recipe(ep):
        return {"model": {"config": QWEN3_MOE}, "data": {"seq_len": 16},
                "pipeline": {"schedule": "2bw", "num_stages": 1, "num_microbatches": 2, "microbatch_size": 2,
                             "expert_parallel": ep},
                "optimizer": {"name": "muon", "learning_rate": 0.01}, "training": {"max_steps": 8, "report_to": []}}
    plain, sharded = (run_distributed(host_ops_worker, 2, recipe(ep))[0] for ep in (1, 2))
    layers, m = QWEN3_MOE["num_hidden_layers"], 2
    f, b = (sharded["actions"][k]["ops"] - plain["actions"][k]["ops"] for k in ("F", "B"))
    assert 0 < f <= 40 * layers and 0 <= b <= 12 * layers, (f, b)  # measured: 37 and 9 per layer
    # the reduction's phases land in REDUCE, STEP or between actions as their collectives complete: their sum per
    # step is no larger (the experts leave the data-parallel buckets; their mean is one _foreach_div_)
    def reducing(r):
        return sum(r["actions"][k]["ops"] * r["actions"][k]["calls"] for k in ("REDUCE", "STEP", "between")
                   if k in r["actions"]) / 2
    assert reducing(sharded) <= reducing(plain), (sharded["actions"], plain["actions"])
    reads = {k: n - plain["tolist"].get(k, 0) for k, n in sharded["tolist"].items()}
    assert {k: n for k, n in reads.items() if n} == {"F": layers * m}, sharded["tolist"]  # per step
    assert sharded["reads_per_step"] == plain["reads_per_step"] == {}
