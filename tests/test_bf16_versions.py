"""bf16 weight versions (``training.bf16`` in the pipeline): each version holds the weights autocast casts as one bf16
copy made at its STEP, the fp32 master is the optimizer's Parameter, and no microbatch in flight holds a cast of its
own. Autocast's per-microbatch casts (``bf16_versions = False``) are the reference: the numbers must be the same bit
for bit (the same bf16 values, the same fp32 accumulation of the gradients), on a dense model with Muon + EF under
2BW (two versions held), an MoE under 1F1B (its experts looped over, transformers' ``eager`` implementation: the
versions hold the expert stacks in bf16 and slicing a bf16 stack gives autocast's cast of the fp32 slice), with
activation checkpointing (the recomputation reads the version's copy), and across a save and resume (the older version
is saved in bf16). Against the single-process reference (autocast, ``LocalEngine``) the runs agree within bf16
tolerance; so does an MoE under 2BW with transformers' default grouped GEMM, which the bf16 expert stacks turn from
fp32 into bf16 GEMMs (``test_moe_expert_stacks_held_in_bf16_grouped_gemm``)."""
from __future__ import annotations

import copy

import pytest
import torch

from dist_utils import run_distributed
from hf_asyncpp.model.build import expert_stacks
from hf_asyncpp.pipeline.versions import Versions, autocast_casts, find_casts
from support import LLAMA, MIXTRAL, build, make_recipe, reference, scenario

MIXTRAL_EAGER = {**MIXTRAL, "experts_implementation": "eager"}  # a GEMM per expert on a slice of its stack
RUNS = [(LLAMA, "2bw", 2, 2, 2, "muon", True), (MIXTRAL_EAGER, "1f1b", 2, 2, 2, "adamw", False),
        (LLAMA, "2bw", 2, 3, 2, "adamw", True)]
STACKS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _bf16(recipe, ckpt=False):
    recipe = copy.deepcopy(recipe)
    recipe.training.bf16 = True
    recipe.training.gradient_checkpointing = ckpt
    return recipe


def worker(rank, world, jobs, tmp):
    """Each job (recipe, batches, bf16_versions, resume_at): the step results, merged weights, and per stage the
    dtypes of the older version held, the measured casts/weights bytes."""
    from pathlib import Path

    from hf_asyncpp.pipeline.executor import PipelineEngine
    from hf_asyncpp.topology import Topology

    out = []
    for j, (recipe, batches, versions16, resume_at) in enumerate(jobs):
        topo = Topology(rank=rank, world_size=world, num_stages=recipe.pipeline.num_stages)
        eng = PipelineEngine(recipe, build(recipe), topo, log=lambda *a: None)
        eng.bf16_versions, eng.track_memory = versions16, True
        cut = resume_at or len(batches)
        res = eng.train_steps(batches[:cut], 0)
        if resume_at:
            folder = Path(tmp) / f"job{j}"
            folder.mkdir(exist_ok=True)
            eng.save(folder)
            eng.close()
            eng = PipelineEngine(recipe, build(recipe), topo, log=lambda *a: None)
            eng.bf16_versions = versions16
            eng.load(folder)
            res += eng.train_steps(batches[cut:], cut)
        older = {str(b.dtype) for v, buf in eng.versions.buffers.items() if v != eng.versions.latest for b in buf.values()}
        mem = eng.memory_report() if not resume_at else None
        # per weight, the dtypes every held version keeps it in
        held = {n: sorted({str(buf[n].dtype) for buf in eng.versions.buffers.values()}) for n in eng.params}
        info = {"older_dtypes": older, "cast": sorted(eng.versions.cast or ()), "mem": mem, "held": held,
                "versions": len(eng.versions.buffers), "params": sum(p.numel() for p in eng.params.values())}
        infos = [None] * world
        torch.distributed.all_gather_object(infos, info)
        out.append((res, eng.full_state_dict(), infos))
        eng.close()
    return out


def _identical(a, b, name):
    key = lambda res: [(r.loss, r.grad_norm, r.lr, r.applied) for r in res]
    assert key(a[0]) == key(b[0]), name
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), f"{name}: {k}"


def test_bf16_versions_are_autocast_bit_for_bit(tmp_path):
    scen = [scenario(*s, seed=400 + i) for i, s in enumerate(RUNS)]
    # and one stage on 2 data-parallel replicas, m = 3: a step's first microbatch gives its leaves their gradients,
    # the second adds into them in place, the last accumulates through autograd, whose hooks start the reduction
    dp = scenario(LLAMA, "2bw", 1, 3, 2, "muon", True, seed=410)
    recipes = [_bf16(rec) for rec, *_ in scen] + [_bf16(scen[0][0], ckpt=True), _bf16(dp[0])]
    batches = [b[0] for _, b, _, _ in scen] + [scen[0][1][0], dp[1][0]]
    jobs = [(r, b, True, 0) for r, b in zip(recipes, batches)] + [(r, b, False, 0) for r, b in zip(recipes, batches)]
    jobs += [(recipes[0], batches[0], True, 3), (recipes[0], batches[0], False, 3)]
    res = run_distributed(worker, 2, jobs, str(tmp_path))[0]
    n = len(recipes)
    for i in range(n):
        _identical(res[i], res[n + i], f"job {i}")
    _identical(res[2 * n], res[2 * n + 1], "save/resume")
    # resumed against straight: as tests/test_runtime.py's resume test (a restored norm's sum may round its last bit)
    straight, resumed = res[0], res[2 * n]
    as_tensor = lambda r: torch.tensor([(x.loss, x.grad_norm, x.lr) for x in r[0]], dtype=torch.float64)
    torch.testing.assert_close(as_tensor(resumed), as_tensor(straight), rtol=1e-9, atol=0)
    for k in straight[1]:
        torch.testing.assert_close(resumed[1][k], straight[1][k], rtol=1e-6, atol=1e-7)

    dense_2bw, moe = res[0], res[1]
    for stage in dense_2bw[2]:
        # the linear weights are held in bf16; the older version of 2BW is bf16 for them, fp32 for the rest
        assert stage["cast"] and all(n.endswith(("proj.weight", "lm_head.weight")) for n in stage["cast"]), stage["cast"]
        assert stage["older_dtypes"] == {"torch.bfloat16", "torch.float32"}
        assert stage["mem"]["casts"] == 0  # no microbatch keeps a cast of its own
    for stage in res[n][2]:  # autocast's path: each in-flight microbatch keeps a cast, versions are fp32
        assert stage["mem"]["casts"] > 0 and stage["older_dtypes"] == {"torch.float32"} and not stage["cast"]
    # weights held: the fp32 masters + 2 versions with the linear weights in bf16 (4 + 2 x 2 bytes) against 2 fp32
    # versions (2 x 4): the same; what goes is every in-flight microbatch's cast
    for new, old in zip(dense_2bw[2], res[n][2]):
        assert new["mem"]["weights"] == old["mem"]["weights"]
        assert new["mem"]["steady"] == old["mem"]["steady"] - old["mem"]["casts"]
    # the MoE's expert stacks (2 layers a stage, 2 stacks a layer) are held in bf16 like the linear weights; the
    # forward's slices of them are the casts autocast made of the fp32 slices: bit for bit (above)
    for stage in moe[2]:
        stacks = {n for n in stage["cast"] if n.endswith(STACKS)}
        assert len(stacks) == 4 and all(stage["held"][n] == ["torch.bfloat16"] for n in stacks), stage["cast"]
        assert stage["mem"]["casts"] == 0

    # and against the single-process reference (autocast over the whole model in one process, the 2BW delay
    # simulated): within bf16 rounding (an update is about 1e-2 here; a wrong version is off by that)
    for (_, _, ref_rec, ref_batches), got in zip(scen[:2], res[:2]):
        ref_res, ref_sd = reference(_bf16(ref_rec), ref_batches)
        torch.testing.assert_close(torch.tensor([r.loss for r in got[0]]), torch.tensor([r.loss for r in ref_res]),
                                   rtol=1e-3, atol=0)
        for k, v in ref_sd.items():
            if k in got[1]:  # bf16 rounding moves a few elements (Muon's orthogonalisation spreads it); a wrong
                diff = (got[1][k] - v).abs()  # version moves nearly every element by about the lr (1e-2)
                assert float(diff.max()) < 5e-3 and float((diff > 1e-3).float().mean()) < 0.01, (k, float(diff.max()))


def test_casts_found_from_the_graph_exclude_a_weight_also_used_uncast():
    """A weight used both cast (a linear) and uncast (an embedding lookup, a tied head on one stage) stays fp32."""
    emb = torch.nn.Embedding(10, 4)
    lin = torch.nn.Linear(4, 4)
    leaves = {"emb": emb.weight.detach().requires_grad_(), "lin": lin.weight.detach().requires_grad_(),
              "bias": lin.bias.detach().requires_grad_()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = torch.nn.functional.embedding(torch.tensor([1, 2]), leaves["emb"])
        out = torch.nn.functional.linear(h, leaves["lin"], leaves["bias"])
        tied = torch.nn.functional.linear(out, leaves["emb"])
    assert autocast_casts([out], leaves) == {"lin", "bias"}
    assert autocast_casts([tied], leaves) == {"lin", "bias"}  # emb is read directly by the lookup


def test_versions_hold_bf16_copies_made_once_per_step():
    params = {"w": torch.nn.Parameter(torch.randn(3, 3)), "n": torch.nn.Parameter(torch.ones(3))}
    v = Versions(params, lag=1)
    v.use_bf16({"w"})
    first = v.compute_for(0)
    assert first["w"].dtype == torch.bfloat16 and first["n"] is v.leaves_for(0)["n"]
    hold = v.hold(0)
    v.prepare_update()
    with torch.no_grad():
        params["w"].add_(1.0)
    v.finish_update()
    assert torch.equal(v.compute_for(1)["w"], params["w"].detach().to(torch.bfloat16))
    assert torch.equal(v.compute_for(0)["w"], (params["w"].detach() - 1).to(torch.bfloat16))  # the old one kept
    (v.compute_for(0)["w"].float().sum() + v.compute_for(1)["w"].float().sum()).backward()
    assert v.leaves_for(0)["w"].grad.dtype == torch.float32 and v.leaves_for(0)["w"].grad.shape == (3, 3)
    hold.release()
    assert v.nbytes() == 9 * 4 + 2 * 9 * 2 + 2 * 3 * 4  # the master, two bf16 copies, two fp32 norms


class _Gemms(torch.utils._python_dispatch.TorchDispatchMode):
    """Per GEMM (mm, bmm, grouped mm) of a forward the dtypes of its operands and whether one of them is a view of
    ``stacks`` (storages); the casts (``_to_copy``) made, and those that read ``stacks``."""

    GEMMS = ("mm", "addmm", "bmm", "_grouped_mm")

    def __init__(self, stacks: set):
        super().__init__()
        self.stacks, self.gemms, self.casts, self.stack_casts = stacks, [], 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        reads = any(torch.is_tensor(a) and a.untyped_storage().data_ptr() in self.stacks for a in args)
        if name in self.GEMMS:
            self.gemms.append((name, reads, {str(a.dtype) for a in args if torch.is_tensor(a) and a.is_floating_point()}))
        elif name == "_to_copy":
            self.casts += 1
            self.stack_casts += reads
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_expert_gemms_read_the_versions_bf16_stacks(impl):
    """Stage 0 of a 2-stage Mixtral (2 MoE layers, 4 experts) under ``training.bf16``: the weights a version holds in
    bf16 (``find_casts``) include the expert stacks, and the forward's expert GEMMs read those bf16 copies: the eager
    loop slices the bf16 stack (no per-microbatch cast of an fp32 slice any more, and bit for bit autocast's numbers:
    the forward and the fp32 gradients), transformers' grouped GEMM gets bf16 stacks (it ran in fp32 on the fp32
    masters: it is no autocast op). A stack gathered per token (``batched_mm``) stays fp32: the gather's backward
    sums an expert's per-token gradients in the stack's dtype."""
    from torch.func import functional_call

    from hf_asyncpp.model.build import autocast
    from hf_asyncpp.partition import partition_model

    stage = partition_model(build(make_recipe({**MIXTRAL, "experts_implementation": impl}, "1f1b", 2, 2, 2)), 2)[0]
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    want = {f"model.layers.{i}.{s}" for i in (0, 1) for s in STACKS}
    assert expert_stacks(stage) == want
    runs = {}
    for held in ("autocast's casts", "with the expert stacks"):
        v = Versions(dict(stage.named_parameters()), lag=1)
        casts = find_casts(stage, v.leaves_for(0), ids, None)
        assert want <= casts  # the stacks, beside the linear weights autocast casts whole
        if held == "autocast's casts":  # what the versions held before: the stacks fp32, cast per slice per microbatch
            casts -= want
        v.use_bf16(casts)
        masters = {stage.get_parameter(n).untyped_storage().data_ptr() for n in want}
        copies = {v.buffers[0][n].untyped_storage().data_ptr() for n in want}
        mode = _Gemms(masters | copies)
        with mode, autocast(True):
            out = functional_call(stage, v.compute_for(0), (ids,), None, strict=False)
        out = [t for t in (out if isinstance(out, tuple) else (out,)) if t.requires_grad]  # the hidden state, aux
        sum(t.float().pow(2).mean() for t in out).backward()
        grads = {n: t.grad for n, t in v.leaves_for(0).items()}
        runs[held] = (mode, [t.detach() for t in out], grads, {n: v.buffers[0][n].dtype for n in want})

    old, new = runs["autocast's casts"], runs["with the expert stacks"]
    assert set(new[3].values()) == {torch.bfloat16} and set(old[3].values()) == {torch.float32}
    expert_gemms = [g for g in new[0].gemms if g[1]]
    # grouped: 2 a layer; eager: 2 per expert a layer's tokens reach, each of which read a cast of its fp32 slice
    assert len(expert_gemms) == (4 if impl == "grouped_mm" else old[0].stack_casts) > 0
    assert all(dtypes == {"torch.bfloat16"} for _, _, dtypes in expert_gemms), expert_gemms
    assert all(g[0] == ("_grouped_mm" if impl == "grouped_mm" else "mm") for g in expert_gemms)
    assert new[0].stack_casts == 0  # no microbatch casts a stack or a slice of one
    for n in want:
        assert new[2][n].dtype == torch.float32 and new[2][n].shape == stage.get_parameter(n).shape
    if impl == "eager":  # before: a cast per expert slice per microbatch; the numbers are the same bit for bit
        assert new[0].casts == old[0].casts - old[0].stack_casts
        assert all(torch.equal(a, b) for a, b in zip(new[1], old[1], strict=True))
        for n, g in old[2].items():
            assert torch.equal(new[2][n], g), n
    else:  # before: the grouped GEMMs ran in fp32 on the masters; now in bf16 (within bf16 rounding of it)
        before = [g for g in old[0].gemms if g[1]]
        assert len(before) == 4 and all(dtypes == {"torch.float32"} for _, _, dtypes in before), before
        for a, b in zip(new[1], old[1], strict=True):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    stage.config._experts_implementation = "batched_mm"
    v = Versions(dict(stage.named_parameters()), lag=1)
    assert not find_casts(stage, v.leaves_for(0), ids, None) & want


def test_moe_expert_stacks_held_in_bf16_grouped_gemm():
    """Mixtral under 2BW with transformers' default experts implementation (one grouped GEMM per projection), bf16:
    both versions a stage holds keep its expert stacks in bf16 (the grouped GEMMs run in bf16; on the fp32 stacks
    autocast leaves they ran in fp32) and no microbatch holds a cast. The numbers are those of the single-process
    autocast reference whose expert GEMMs are bf16 (its experts looped over: autocast casts each expert's fp32 slice,
    what the bf16 stack's slice is), but for the two kernels' summation order. (Against the reference whose grouped
    GEMMs run in fp32, what the versions did before, the losses agree within rtol 1e-3, measured once; AdamW turns the
    bf16 rounding of near-zero expert gradients into steps of about the lr on a few percent of elements.)"""
    rec, batches, ref_rec, ref_batches = scenario(MIXTRAL, "2bw", 2, 2, 2, "adamw", False, seed=420)
    (res, sd, infos), = run_distributed(worker, 2, [(_bf16(rec), batches[0], True, 0)], None)[0]
    for stage in infos:
        stacks = sorted(n for n in stage["held"] if n.endswith(STACKS))
        assert len(stacks) == 4 and set(stacks) <= set(stage["cast"]), stage["cast"]
        assert stage["versions"] == 2 and all(stage["held"][n] == ["torch.bfloat16"] for n in stacks)
        assert stage["mem"]["casts"] == 0
    losses = torch.tensor([r.loss for r in res])
    ref_bf16 = _bf16(ref_rec)
    ref_bf16.model.config = {**ref_bf16.model.config, "experts_implementation": "eager"}
    ref_res, ref_sd = reference(ref_bf16, ref_batches)
    torch.testing.assert_close(losses, torch.tensor([r.loss for r in ref_res]), rtol=1e-5, atol=0)
    for k, v in ref_sd.items():
        if k in sd:  # measured: at most 2e-5 (summation order); fp32 expert GEMMs or a wrong version: about 1e-2
            assert float((sd[k] - v).abs().max()) < 2e-4, (k, float((sd[k] - v).abs().max()))
