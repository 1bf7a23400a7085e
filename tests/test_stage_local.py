"""A resuming rank reads only what its stage needs: its own files on an unchanged split, and on another split only
the tensors (by name) and optimizer files holding its parameters. Counted at the read edge (``checkpoint.bytes_read``),
not mocked: the bytes are the ones the loaders really read."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers.utils import SAFE_WEIGHTS_NAME

from dist_utils import run_distributed

from hf_asyncpp.config.sections import ModelConfig
from hf_asyncpp.model.build import build_model, load_stage_pretrained, meta_model
from hf_asyncpp.model.seeded_init import init_stage
from hf_asyncpp.optim.ef import install_error_feedback
from hf_asyncpp.partition import partition_model
from hf_asyncpp.pipeline import stage_state
from hf_asyncpp.pipeline.versions import Versions
from hf_asyncpp.storage import checkpoint_io as ckpt
from support import LLAMA, make_batches, make_config, make_model, make_recipe
from hf_asyncpp.storage.names import stage_file, stage_optimizer_file, stage_versions_file


def parts(stage):
    """AdamW with Error Feedback, a constant schedule and a Versions holding one older version (as 2BW does)."""
    opt = install_error_feedback(torch.optim.AdamW(stage.parameters(), lr=1e-2), 0.5)
    versions = Versions(dict(stage.named_parameters()), 1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), versions


def trained_stages(p: int):
    """``p`` stages of the tiny llama after two optimizer steps, each with an older weight version held."""
    stages = partition_model(make_model("llama", num_hidden_layers=4), p, seq_len=16)
    out = []
    for stage in stages:
        opt, sched, versions = parts(stage)
        for _ in range(2):
            for prm in stage.parameters():
                prm.grad = torch.randn_like(prm)
            opt.step()
            sched.step()
        versions.buffers[0] = {n: t.detach() - 1 for n, t in stage.named_parameters()}  # an older version, latest 1
        versions.latest = 1
        out.append((stage, opt, sched, versions))
    return out


def fresh(stage):
    """The same stage, weights scrambled, with new optimizer parts: what a resume has before loading."""
    new = copy.deepcopy(stage)
    with torch.no_grad():
        for prm in new.parameters():
            prm.normal_()
    return (new, *parts(new))


def test_unchanged_split_reads_only_the_ranks_own_files_and_another_split_resumes_exactly(tmp_path):
    saved = trained_stages(2)
    for i, (stage, opt, sched, versions) in enumerate(saved):
        stage_state.save_stage(tmp_path, i, stage, opt, sched, versions, {"nonfinite_skipped": 0})
    own = {i: [tmp_path / stage_file(i), tmp_path / stage_versions_file(i), tmp_path / stage_optimizer_file(i)]
           for i in range(2)}
    for i, (stage, opt, _, versions) in enumerate(saved):
        new, opt2, sched2, versions2 = fresh(stage)
        ckpt.bytes_read(reset=True)
        stage_state.load_stage(tmp_path, new, opt2, sched2, versions2, stage_index=i)
        assert ckpt.bytes_read() == sum(f.stat().st_size for f in own[i])  # its own three files, whole, nothing else
        assert all(torch.equal(a, b) for a, b in zip(stage.state_dict().values(), new.state_dict().values()))
        assert opt2.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
        assert versions2.latest == 1 and versions2.buffers[0].keys() == versions.buffers[0].keys()

    # 2 -> 4 stages: each new stage reads by name only its tensors, and only the optimizer files that hold them
    whole = {n: t for stage, *_ in saved for n, t in stage.state_dict().items()}
    state = {}
    older = {}
    prev = {}
    for stage, opt, _, versions in saved:
        names = stage_state.param_names(stage, opt)
        state.update({names[i]: s for i, s in opt.state_dict()["state"].items()})
        older.update(versions.buffers[0])
        prev.update({n: opt.error_feedback["prev"][p] for n, p in stage.named_parameters()})
    total = sum(f.stat().st_size for fs in own.values() for f in fs)
    reads = []
    for j, (target, *_) in enumerate(trained_stages(4)):
        new, opt2, sched2, versions2 = fresh(target)
        ckpt.bytes_read(reset=True)
        stage_state.load_stage(tmp_path, new, opt2, sched2, versions2, stage_index=j)
        reads.append(ckpt.bytes_read())
        for n, t in new.state_dict().items():
            assert torch.equal(t, whole[n]), n
        names = stage_state.param_names(new, opt2)
        for i, s in opt2.state_dict()["state"].items():
            assert all(torch.equal(s[k], state[names[i]][k]) for k in ("exp_avg", "exp_avg_sq")), names[i]
        for n, p in new.named_parameters():
            assert torch.equal(versions2.buffers[0][n], older[n]) and torch.equal(opt2.error_feedback["prev"][p], prev[n])
    headers = sum(8 + int.from_bytes(f.read_bytes()[:8], "little") for fs in own.values() for f in fs
                  if f.suffix == ".safetensors")
    for (target, *_), read in zip(trained_stages(4), reads):
        holders = [i for i, (stage, *_) in enumerate(saved) if any(n in dict(stage.named_parameters())
                                                                  for n, _ in target.named_parameters())]
        tensors = sum(t.numel() * t.element_size() for t in target.state_dict().values())
        optimizer_files = sum(own[i][2].stat().st_size for i in holders)
        assert read <= 2 * tensors + optimizer_files + headers < total  # its tensors and older version, by name


def test_a_stage_of_a_pretrained_model_reads_only_its_own_tensors(tmp_path):
    """``model.name_or_path``: a meta build, partitioned, each stage materialised from the local safetensors by name,
    equals the stages of the full ``from_pretrained`` model, and reads its tensors (and the header) only. Tied: the
    last stage's head comes from the embedding the checkpoint saved once."""
    make_model("llama", num_hidden_layers=4, tie_word_embeddings=True).save_pretrained(tmp_path)
    recipe = ModelConfig(name_or_path=str(tmp_path))
    full = partition_model(build_model(recipe), 2, seq_len=16)
    stages = partition_model(meta_model(recipe), 2, seq_len=16)
    header = 8 + int.from_bytes((tmp_path / SAFE_WEIGHTS_NAME).read_bytes()[:8], "little")
    for stage, ref in zip(stages, full):
        ckpt.bytes_read(reset=True)
        load_stage_pretrained(stage, str(tmp_path))
        sources = {stage.tied_pairs[0][0] if n in dict(stage.tied_pairs).values() else n: t for n, t in ref.state_dict().items()}
        assert ckpt.bytes_read() == header + sum(t.numel() * t.element_size() for t in sources.values())
        assert stage.state_dict().keys() == ref.state_dict().keys()
        assert all(torch.equal(stage.state_dict()[n], t) for n, t in ref.state_dict().items())
        ids = torch.randint(0, 128, (2, 16))
        torch.testing.assert_close(stage(ids) if stage is stages[0] else stage(full[0](ids)),
                                   ref(ids) if ref is full[0] else ref(full[0](ids)), rtol=0, atol=0)


# ---------------------------------------------------------------------------- random init, one stage at a time


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mixtral_tied", "qwen2_moe", "deepseek_v3", "gemma3_text"])
def test_a_stage_built_alone_has_the_whole_models_random_init(arch):
    """``init_stage`` on a stage of the meta model draws, bit for bit, what ``build_model`` draws for the whole model
    (per-module seeds): for every stage of three splits, tied heads and shared blocks included, and the parameters
    the whole model's stage shares between modules are shared here too (one stage holding the embedding and the tied
    head trained them apart: ``to_empty`` gave each module its own tensor)."""
    cfg = make_config(arch)
    rec = make_recipe({k: v for k, v in cfg.to_dict().items() if not k.startswith("_")
                       and k not in ("transformers_version", "architectures", "dtype", "torch_dtype")}, "2bw", 2, 2, 2)
    for p in (1, 2, 3):
        torch.manual_seed(11)
        whole = partition_model(build_model(rec.model), p, seq_len=16)
        meta = meta_model(rec.model)
        for i, stage in enumerate(partition_model(meta, p, seq_len=16)):
            assert not init_stage(stage, meta, 11, torch.device("cpu"))
            want, got = whole[i].state_dict(), stage.state_dict()
            assert want.keys() == got.keys()
            for n in want:
                assert torch.equal(want[n], got[n]), (arch, p, i, n)
            assert _sharing(stage) == _sharing(whole[i]), (arch, p, i)


def _sharing(module) -> set[tuple[str, ...]]:
    """The names under which one parameter appears, for each parameter appearing under several."""
    names: dict[int, list[str]] = {}
    for n, t in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(t), []).append(n)
    return {tuple(v) for v in names.values() if len(v) > 1}


def test_seeded_init_is_the_models_own_initializer():
    """The per-module seeds change which numbers are drawn, not how: the same distributions as transformers' init
    (norms at 1, linear and embedding weights at the config's initializer_range), and the global random state is
    left alone (dropout streams do not depend on the model's size)."""
    rec = make_recipe({**LLAMA, "initializer_range": 0.05, "hidden_size": 64, "intermediate_size": 256}, "2bw", 2, 2, 2)
    torch.manual_seed(3)
    before = torch.random.get_rng_state()
    model = build_model(rec.model)
    assert torch.equal(torch.random.get_rng_state(), before)
    w = model.model.layers[0].mlp.up_proj.weight.detach()
    assert abs(float(w.std()) - 0.05) < 0.005 and abs(float(w.mean())) < 0.005
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    torch.manual_seed(4)
    assert not torch.equal(build_model(rec.model).model.layers[0].mlp.up_proj.weight, w)  # another seed, other values


def engine_worker(rank, world, recipe, batches, meta):
    from hf_asyncpp.pipeline.executor import PipelineEngine
    from hf_asyncpp.topology import Topology

    torch.manual_seed(0)
    model = meta_model(recipe.model) if meta else build_model(recipe.model)
    eng = PipelineEngine(recipe, model, Topology(rank=rank, world_size=world, num_stages=2), log=lambda *a: None)
    res = eng.train_steps(batches, 0)
    sd = eng.full_state_dict()
    eng.close()
    return [(r.loss, r.grad_norm) for r in res], sd


def test_pipeline_from_a_meta_model_trains_as_from_the_whole_model():
    """The trainer's start: each rank builds its stage alone from the meta model; the run is bitwise the one whose
    ranks each built the whole model and kept their stage."""
    rec = make_recipe(LLAMA, "2bw", 2, 2, 2, "muon", True)
    batches = make_batches(3, 2, 2, seed=21)
    alone = run_distributed(engine_worker, 2, rec, batches, True)[0]
    whole = run_distributed(engine_worker, 2, rec, batches, False)[0]
    assert alone[0] == whole[0]
    for k in whole[1]:
        assert torch.equal(alone[1][k], whole[1][k]), k


def reload_worker(rank, world, recipe, batches, blocks, out_dir):
    """Train, export, and read the export back through the pipeline: as exported, then with one of the last stage's
    tensors changed on disk by the main process. Returns (eval_nll, reload as exported, reload after the change)."""
    from pathlib import Path

    import torch.distributed as dist
    from safetensors.torch import load_file, save_file

    from hf_asyncpp.model.export import export_engine
    from hf_asyncpp.pipeline.executor import PipelineEngine
    from hf_asyncpp.topology import Topology
    from support import build

    eng = PipelineEngine(recipe, build(recipe), Topology(rank=rank, world_size=world, num_stages=world), log=lambda *a: None)
    eng.train_steps(batches, 0)
    export_engine(eng, out_dir)
    direct = eng.eval_nll(blocks, 2)
    as_exported = eng.reload_nll(Path(out_dir), blocks, 2)
    changed = None
    if as_exported is not None:
        if rank == 0:  # the final norm lives on the last stage, in the last shard: scale it on disk
            shard = sorted(Path(out_dir).glob("model-*.safetensors"))[-1]
            tensors = load_file(shard)
            tensors["model.norm.weight"] = tensors["model.norm.weight"] * 2
            save_file(tensors, shard, metadata={"format": "pt"})
        changed = eng.reload_nll(Path(out_dir), blocks, 2)
    dist.barrier()
    eng.close()
    return direct, as_exported, changed


def test_the_export_is_read_back_through_the_pipeline_each_stage_its_own_tensors(tmp_path):
    """The end-of-run check that the export is the trained model runs through the pipeline (``reload_nll``): each
    stage reads its own tensors from the folder (tied head included), never the whole model. It equals the engine's
    own evaluation bit for bit and sees a tensor changed on disk; a model whose experts transformers converts on load
    cannot be read stage by stage, and every rank says so (None: the caller reloads the whole folder)."""
    from support import MIXTRAL

    blocks = torch.randint(0, 128, (6, 16), generator=torch.Generator().manual_seed(3))
    recipe = make_recipe(LLAMA, "2bw", 2, 2, 1)
    results = run_distributed(reload_worker, 2, recipe, make_batches(2, 2, 1, 5), blocks, str(tmp_path / "llama"))
    (direct, as_exported, changed), _ = results
    assert as_exported == direct and changed is not None and changed != direct
    assert all(r == results[0] for r in results)  # every rank returns the all-reduced sums
    moe = make_recipe(MIXTRAL, "2bw", 2, 2, 1)
    results = run_distributed(reload_worker, 2, moe, make_batches(2, 2, 1, 5), blocks, str(tmp_path / "moe"))
    assert [r[1] for r in results] == [None, None]  # transformers 5 saves Mixtral's fused experts one by one
