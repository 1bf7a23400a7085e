"""ZB-H1 in the executor: 1F1B with each backward split into I (the input gradient, sent at once) and W (the weight
gradient, later), through torch.distributed.pipelining's own ``stage_backward_input``/``stage_backward_weight`` on
transformers' modules. It computes exactly 1F1B's gradients, so on the same processes, seed and batches its losses,
grad norms and weights are bitwise 1F1B's: tied embeddings, an MoE, activation checkpointing, bf16, 2 and 4 stages,
data parallelism, ZeRO-1; under the NCCL-order transport every launched test inherits (tests/conftest.py)."""
from __future__ import annotations

import copy

import torch

from dist_utils import run_distributed
from support import LLAMA, LLAMA_UNTIED, MIXTRAL, build, make_batches, make_recipe


def twins_worker(rank, world, cases):
    """Each case trained as 1F1B, then as ZB-H1, from the same initial weights and batches: (results, weights) each."""
    from hf_asyncpp.pipeline.executor import PipelineEngine
    from hf_asyncpp.schedules.actions import ActionType as T
    from hf_asyncpp.topology import Topology

    out = []
    for recipe, replica_batches in cases:
        pair = []
        for schedule in ("1f1b", "zbh1"):
            rec = copy.deepcopy(recipe)
            rec.pipeline.schedule = schedule
            topo = Topology(rank=rank, world_size=world, num_stages=rec.pipeline.num_stages)
            eng = PipelineEngine(rec, build(rec), topo, log=lambda *a: None)
            batches = replica_batches[topo.dp_rank]
            res = eng.train_steps(batches[:2], 0) + eng.train_steps(batches[2:], 2)  # drained in between
            sd = eng.full_state_dict()  # collective: every rank takes part
            pair.append((res, {k: v.clone() for k, v in sd.items()} if rank == 0 else None,
                         (eng.action_counts[T.B], eng.action_counts[T.I], eng.action_counts[T.W])))
            eng.close()
        out.append(pair)
    return out


def case(arch, stages, m, mbs, opt, dp=1, seed=0, zero1=False, **training):
    rec = make_recipe(arch, "1f1b", stages, m, mbs, opt)
    rec.optimizer.shard_across_replicas = zero1
    for k, v in training.items():
        setattr(rec.training, k, v)
    return rec, [make_batches(4, m, mbs, seed + 100 * d) for d in range(dp)]


def assert_bitwise_twins(results, cases):
    for (rec, _), ((one, one_sd, one_ran), (zb, zb_sd, zb_ran)) in zip(cases, results):
        name = (f"{rec.model.config['model_type']}/tied={rec.model.config.get('tie_word_embeddings')}/"
                f"{rec.pipeline.num_stages} stages/{rec.optimizer.name}/ckpt={rec.training.gradient_checkpointing}/"
                f"bf16={rec.training.bf16}")
        micro = 4 * rec.pipeline.num_microbatches  # rank 0's backwards: B in 1F1B; I (a no-op on stage 0) and W
        assert one_ran == (micro, 0, 0) and zb_ran == (0, micro, micro), (name, one_ran, zb_ran)
        assert [r.loss for r in zb] == [r.loss for r in one], name
        assert [r.grad_norm for r in zb] == [r.grad_norm for r in one], name
        assert zb_sd.keys() == one_sd.keys(), name
        differ = [k for k in one_sd if not torch.equal(zb_sd[k], one_sd[k])]
        assert not differ, (name, differ[:5])


def test_zb_h1_equals_1f1b_bitwise_on_two_stages():
    cases = [
        case(LLAMA, 2, 4, 2, "adamw"),  # tied embeddings across the two stages
        case(LLAMA_UNTIED, 2, 3, 2, "muon", seed=1),
        case(MIXTRAL, 2, 2, 2, "muon", seed=2),
        case(LLAMA, 2, 4, 1, "muon", seed=3, gradient_checkpointing=True),
        case(LLAMA, 2, 2, 2, "adamw", seed=4, bf16=True),
    ]
    assert_bitwise_twins(run_distributed(twins_worker, 2, cases)[0], cases)


def test_zb_h1_equals_1f1b_bitwise_on_four_stages_and_with_data_parallelism():
    cases = [
        case(LLAMA, 4, 4, 1, "muon"),  # three middle-and-last stages with I and W, the first with its W only
        case(LLAMA, 2, 2, 2, "adamw", dp=2, seed=5),  # 2 stages x 2 replicas: the reduction after the last W
        case(LLAMA_UNTIED, 2, 3, 1, "muon", dp=2, seed=6, zero1=True),  # and ZeRO-1
    ]
    assert_bitwise_twins(run_distributed(twins_worker, 4, cases)[0], cases)


def replays_worker(rank, world, recipe, batches):
    """Decoder-layer forwards run per action kind on this rank, the checkpointed replays included: each layer's
    checkpointed function counts its calls (transformers checkpoints the layer's ``forward``, inside its module
    hooks, so a hook would not see a replay). {kind: forwards}, and the stage's layers."""
    from hf_asyncpp.pipeline.executor import PipelineEngine
    from hf_asyncpp.schedules.actions import ActionType as T
    from hf_asyncpp.topology import Topology

    eng = PipelineEngine(recipe, build(recipe), Topology(rank=rank, world_size=world, num_stages=world),
                         log=lambda *a: None)
    kind, counts = [None], {}

    def counted(fn):
        def run(*args, **kwargs):
            counts[kind[0]] = counts.get(kind[0], 0) + 1
            return fn(*args, **kwargs)
        return run
    for layer in eng.stage.decoder_layers():
        layer._gradient_checkpointing_func = lambda fn, *a, ckpt=layer._gradient_checkpointing_func, **k: \
            ckpt(counted(fn), *a, **k)
    for t in (T.F, T.B, T.I, T.W):
        def tagged(a, w, run=eng._handlers[t], t=t):
            kind[0] = t
            try:
                return run(a, w)
            finally:
                kind[0] = None
        eng._handlers[t] = tagged
    eng.train_steps(batches, 0)
    layers = len(eng.stage.decoder_layers())
    eng.close()
    return {k.value: v for k, v in counts.items()}, layers


def test_zb_h1_w_replays_each_checkpointed_layer_once():
    """With activation checkpointing, a W replays each of its stage's layers once per microbatch, as a 1F1B B does:
    its weight gradients come from one backward (one graph task), not one per parameter group (9 per Llama layer),
    which replayed the layer's forward once per group. The I replays them too (a graph task of its own)."""
    rec, batches = case(LLAMA, 2, 2, 1, "adamw", gradient_checkpointing=True)
    runs = {}
    for schedule in ("1f1b", "zbh1"):
        r = copy.deepcopy(rec)
        r.pipeline.schedule = schedule
        runs[schedule] = run_distributed(replays_worker, 2, r, batches[0][:1])
    micro = rec.pipeline.num_microbatches
    for rank in (0, 1):
        (one, layers), (zb, _) = runs["1f1b"][rank], runs["zbh1"][rank]
        assert layers == 2
        assert one == {"F": micro * layers, "B": micro * layers}, (rank, one)
        if rank == 0:  # the first stage: no I (nothing to send back), its whole backward in the W
            assert zb == {"F": micro * layers, "W": micro * layers}, (rank, zb)
        else:
            assert zb == {"F": micro * layers, "I": micro * layers, "W": micro * layers}, (rank, zb)
