"""The real entry point under accelerate launch: 2 processes, 2 pipeline stages, 2BW + Muon + EF.

Also: a SIGKILLed pipelined run resumed from its last checkpoint gives exactly the losses and weights
of an uninterrupted run.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from support import TASK_FILES
from hf_asyncpp.launch.spawn import NO_SPAWN
from support import ROOT, launch, losses, write_recipe

# Newton-Schulz in float32 (auto's choice on a CPU, named so a GPU run is exact too): bfloat16 would amplify the
# float noise of a new partition in test_resume_onto_another_topology
EXACT = ("--optimizer.ns_dtype=float32",)
STEPS_24 = dict(max_steps=24, save_steps=4, logging_steps=1)


@pytest.fixture(scope="module")
def two_stage_run(tmp_path_factory):
    """The default 8-step run, exported: checked on its own and the uninterrupted reference of the topology change
    (each launch costs about 20 s of start-up, so the tests share it)."""
    tmp = tmp_path_factory.mktemp("two-stage")
    out = tmp / "run"
    path = write_recipe(tmp / "r.yaml", out, eval_steps=4)
    recipe = yaml.safe_load(path.read_text())  # downstream tasks, scored through the stages at step 4 and at the end
    recipe["eval"] = {"tasks": ["arc_easy", "perplexity"], "task_files": {"arc_easy": TASK_FILES["arc_easy"]},
                      "during_training": True}
    path.write_text(yaml.safe_dump(recipe))
    rc, log = launch(path, "--training.export=true", *EXACT)
    assert rc == 0, log[-3000:]
    return out, log


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_the_runs_export_equals_hf_asyncpp_export_of_its_last_checkpoint(two_stage_run, tmp_path):
    """Written at the end of a 2-stage run (each stage its shard) and by ``hf-asyncpp export`` of the same
    checkpoint (merged, through save_pretrained): the same config (with ``architectures``, which vLLM needs),
    generation config, tokenizer (with the model's ``model_max_length``) and weights; both folders readable by
    others (the user's umask), both cards named without a local path."""
    from huggingface_hub import ModelCard
    from transformers import AutoConfig, AutoTokenizer

    from hf_asyncpp.cli.export import main as export_main

    out, _ = two_stage_run
    mine, theirs = out / "export", tmp_path / "cli-export"
    assert export_main([str(out / "checkpoint-0000008"), str(theirs)]) == 0
    weights = lambda d: {p.name for p in d.iterdir() if p.suffix == ".safetensors" or p.name.endswith(".index.json")}
    others = lambda d: {p.name for p in d.iterdir()} - weights(d) - {"README.md", "loss_curve.png"}
    assert others(mine) == others(theirs) and "config.json" in others(mine)
    for name in sorted(others(mine)):
        a, b = (mine / name).read_text(), (theirs / name).read_text()
        assert json.loads(a) == json.loads(b) if name.endswith(".json") else a == b, name
    assert AutoConfig.from_pretrained(mine).architectures == ["LlamaForCausalLM"]
    assert AutoTokenizer.from_pretrained(mine).model_max_length == AutoConfig.from_pretrained(mine).max_position_embeddings
    a, b = _weights(mine), _weights(theirs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    umask = os.umask(0)
    os.umask(umask)
    for folder, name in ((mine, out.name), (theirs, theirs.name)):
        assert folder.stat().st_mode & 0o777 == 0o777 & ~umask, oct(folder.stat().st_mode)
        card = ModelCard.load(folder / "README.md")
        assert card.data.model_name == name and str(tmp_path) not in card.text and str(out) not in card.text


def test_the_tied_two_stage_checkpoint_opens_with_from_pretrained(two_stage_run, tmp_path):
    """The run's model ties its head to the embedding (write_recipe) and the last stage holds the head as its own
    copy: the checkpoint still has a model.safetensors.index.json (the copies got the same summed gradients and
    updates, so they are equal, see weight_index), without the head, and from_pretrained of the checkpoint gives the
    export's weights and logits, the head tied. A copy of the checkpoint whose head differs gets no index."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_asyncpp.model.export import tied_names
    from hf_asyncpp.storage import checkpoint_io as ckpt

    out, _ = two_stage_run
    saved = out / "checkpoint-0000008"
    stage1 = load_file(str(saved / "stage-01.safetensors"))
    assert "lm_head.weight" in stage1 and "model.embed_tokens.weight" not in stage1  # the last stage's own copy
    index = json.loads((saved / "model.safetensors.index.json").read_text())
    tied = tied_names(AutoConfig.from_pretrained(saved))
    assert tied == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in index["weight_map"] and index == ckpt.weight_index(saved, tied=tied)
    assert set(index["weight_map"].values()) == {"stage-00.safetensors", "stage-01.safetensors"}
    model = AutoModelForCausalLM.from_pretrained(saved).eval()
    exported = AutoModelForCausalLM.from_pretrained(out / "export").eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.state_dict().keys() == exported.state_dict().keys()
    assert all(torch.equal(v, exported.state_dict()[k]) for k, v in model.state_dict().items())
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, exported(ids).logits)

    edited = tmp_path / "edited"
    shutil.copytree(saved, edited)
    save_file({**stage1, "lm_head.weight": stage1["lm_head.weight"] + 1e-3}, str(edited / "stage-01.safetensors"),
              metadata={"format": "pt"})
    assert ckpt.weight_index(edited, tied=tied) is None


def test_data_parallel_replicas_read_their_own_shards(tmp_path):
    """``schedule: none`` on 2 processes: 2 data-parallel replicas, each on its own shard of the stream. The first
    step's loss (before any update) is the mean over both replicas' batches, computed here by hand from the run's
    tokenizer, its initial weights and ``BlockStream(rank=r, world_size=2)``; with every replica on shard 0 it
    would be shard 0's loss alone."""
    from transformers import AutoTokenizer

    from hf_asyncpp.run.seeds import set_seed
    from hf_asyncpp.config.recipe import load_recipe
    from hf_asyncpp.data.sources import resolve_data_files, train_hold_out
    from hf_asyncpp.data.stream import BlockStream, next_batch
    from hf_asyncpp.model.build import build_model

    out = tmp_path / "run"
    path = write_recipe(tmp_path / "r.yaml", out, max_steps=1, logging_steps=1, save_steps=0)
    rc, log = launch(path, "--pipeline.schedule=none", "--pipeline.num_stages=1", "--optimizer.name=adamw",
                     "--optimizer.delay_correction=none")
    assert rc == 0, log[-3000:]
    recipe = load_recipe(path, ["--pipeline.schedule=none", "--pipeline.num_stages=1"])
    tok = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    set_seed(recipe.training.seed)  # the trainer's initial weights: the same seed before the same build
    model = build_model(recipe.model, tok)
    train_files, eval_files = resolve_data_files(recipe.data)
    p = recipe.pipeline
    batches = [next_batch(BlockStream(recipe.data, tok, train_files, rank=r, world_size=2, seed=recipe.training.seed,
                                      hold_out=train_hold_out(recipe.data, eval_files)), p.num_microbatches,
                          p.microbatch_size) for r in (0, 1)]
    assert not torch.equal(batches[0], batches[1])
    with torch.no_grad():
        by_hand = sum(float(model(input_ids=b, labels=b).loss) for batch in batches for b in batch) / (2 * p.num_microbatches)
    assert losses(out)[0] == pytest.approx(by_hand, abs=1e-5)


@pytest.fixture(scope="module")
def straight_24(tmp_path_factory):
    """24 steps uninterrupted, logged every step: the reference of the SIGKILL resume and of logging every 7 steps."""
    tmp = tmp_path_factory.mktemp("straight")
    out = tmp / "straight"
    rc, log = launch(write_recipe(tmp / "a.yaml", out, **STEPS_24))
    assert rc == 0, log[-3000:]
    return out


def test_two_stage_2bw_run_exports_and_evaluates(two_stage_run):
    out, log = two_stage_run
    final = json.loads((out / "final_eval.json").read_text())
    assert final["export_eval_perplexity"] < final["untrained_eval_perplexity"]
    last_eval = [r for r in (json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r][-1]
    # the evaluation through the stages (the newest weights, whatever version 2BW still holds) equals transformers'
    # forward of the reloaded export on the same blocks
    assert last_eval["step"] == 8 and abs(last_eval["eval_loss"] - final["export_eval_loss"]) < 1e-6
    assert (out / "export" / "README.md").exists() and "exported" in log
    # lm-eval's scores through the stages (PipelineLM: each stage its own tensors of the export) equal lm-eval's HFLM
    # on the exported folder; during training (eval.during_training) they ran through the stages at step 4 on the
    # newest weights, and equal HFLM on step 4's checkpointed weights
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_asyncpp.eval.lm_eval import hf_lm, load_tasks, score

    taskset = load_tasks(["arc_easy"], {"arc_easy": TASK_FILES["arc_easy"]})
    whole = score(hf_lm(out / "export", device="cpu"), taskset)[0]["arc_easy"]
    staged = final["downstream"]["arc_easy"]
    assert (staged["acc"], staged["acc_norm"], staged["n"]) == (whole["acc"], whole["acc_norm"], whole["n"])
    assert staged["scorer"] == whole["scorer"] == "lm-eval 0.4.13"
    assert final["downstream"]["perplexity"]["eval_loss"] == final["export_eval_loss"]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    during = [r for r in rows if "eval/arc_easy/acc" in r]
    assert [r["step"] for r in during] == [4]  # the end scores the export instead
    step4 = AutoModelForCausalLM.from_pretrained(out / "export").eval()
    newest = {k: v for f in sorted((out / "checkpoint-0000004").glob("stage-??.safetensors")) for k, v in load_file(str(f)).items()}
    missing, unexpected = step4.load_state_dict(newest, strict=False)  # each stage's newest weights, by HF name
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    at4 = score(hf_lm(step4, AutoTokenizer.from_pretrained(out / "export"), device="cpu"), taskset)[0]["arc_easy"]
    assert (during[0]["eval/arc_easy/acc"], during[0]["eval/arc_easy/acc_norm"]) == (at4["acc"], at4["acc_norm"])
    ckpt = out / "checkpoint-0000008"
    assert {"stage-00.safetensors", "stage-01.safetensors", "stage-00-versions.safetensors"} <= {p.name for p in ckpt.iterdir()}
    prof = json.loads((out / "pipeline_profile.json").read_text())  # where each stage's time went, and its picture
    assert [s["stage"] for s in prof["stages"]] == [0, 1] and (out / "pipeline_timeline.png").stat().st_size > 0
    for s in prof["stages"]:
        assert 0 < s["busy_share"] <= 1 and s["forward_ms"] > 0 and s["backward_ms"] > 0
        assert s["counts"]["F"] == s["counts"]["B"] == 8 * 2  # 8 steps x 2 microbatches (write_recipe), each once
    assert 0 <= prof["simulated_steady_bubble"] < 0.5 and "pipeline: stage 0 busy" in log


def test_one_process_starts_the_pipeline_itself(tmp_path):
    """`python scripts/pretrain.py RECIPE` (from another directory) runs the recipe's 2 stages (`accelerate launch
    scripts/pretrain.py RECIPE` without a config, one process on a CPU machine, is the README's first command:
    test_readme.py); with HF_ASYNCPP_NO_SPAWN=1 the one process stops with commands that work from any directory."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_EVALUATE_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf-home")}  # no user accelerate config
    env.pop(NO_SPAWN, None)
    recipe = write_recipe(tmp_path / "r.yaml", tmp_path / "python", max_steps=4, save_steps=4)
    r = subprocess.run([sys.executable, str(ROOT / "scripts/pretrain.py"), str(recipe), "--training.export=true"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "starting 2 local processes" in r.stdout
    prof = json.loads((tmp_path / "python" / "pipeline_profile.json").read_text())
    assert [s["stage"] for s in prof["stages"]] == [0, 1]
    assert (tmp_path / "python" / "export" / "config.json").exists()

    r = subprocess.run([sys.executable, str(ROOT / "scripts/pretrain.py"), str(recipe)], cwd=tmp_path,
                       env={**env, NO_SPAWN: "1"}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "2 stages need a multiple of 2 processes, but 1 was started" in r.stderr
    config = ROOT / "recipes" / "accelerate" / "cpu-2proc.yaml"
    assert f"accelerate launch --config_file {config} -m hf_asyncpp.cli.train {recipe}" in r.stderr


def test_sigkill_then_resume_is_exact(tmp_path, straight_24):
    straight, killed = straight_24, tmp_path / "killed"
    proc = launch(write_recipe(tmp_path / "b.yaml", killed, **STEPS_24), wait=False)
    deadline = time.time() + 300
    while not list(killed.glob("checkpoint-*/manifest.json")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks, mid-run
    proc.wait()
    done = sorted(killed.glob("checkpoint-*/manifest.json"))
    assert done, "no checkpoint was written before the kill"
    assert not (killed / "checkpoint-0000024").exists(), "the run finished before it could be killed"
    rc, log = launch(tmp_path / "b.yaml", "--training.resume_from_checkpoint=latest")
    assert rc == 0, log[-3000:]
    assert losses(killed) == losses(straight)  # bitwise
    for s in ("00", "01"):
        a = load_file(str(straight / "checkpoint-0000024" / f"stage-{s}.safetensors"))
        b = load_file(str(killed / "checkpoint-0000024" / f"stage-{s}.safetensors"))
        assert all((a[k] == b[k]).all() for k in a)


def test_resume_onto_another_topology(tmp_path, two_stage_run):
    """2 stages for 4 steps, then 4 stages on 4 processes: the same 2BW + Muon + EF semantics continue."""
    (straight, _), moved = two_stage_run, tmp_path / "moved"
    rc, log = launch(write_recipe(tmp_path / "b.yaml", moved, stop_after_steps=4), *EXACT)
    assert rc == 0, log[-3000:]
    rc, log = launch(tmp_path / "b.yaml", *EXACT, "--pipeline.num_stages=4", "--pipeline.num_microbatches=4",
                     "--pipeline.microbatch_size=1", "--training.resume_from_checkpoint=latest",
                     "--training.stop_after_steps=null", procs=4)
    assert rc == 0, log[-3000:]
    assert "resumed a 2-process, 2-stage checkpoint on 4 processes, 4 stages" in log
    a, b = losses(straight), losses(moved)
    assert len(a) == len(b) == 8 and b[:4] == a[:4]
    for x, y in zip(a[4:], b[4:]):
        assert abs(x - y) <= 1e-4 * abs(x), (a, b)


def test_resume_onto_one_stage_with_hf_asyncpp_train(tmp_path, caplog):
    """docs/checkpoints.md's resume onto one stage, with the documented command: ``hf-asyncpp train`` of a 1-stage
    2BW recipe is one process no launcher started, which makes its own process group (it crashed in make_groups)."""
    from hf_asyncpp.cli.train import main

    moved = tmp_path / "moved"
    rc, log = launch(write_recipe(tmp_path / "b.yaml", moved, stop_after_steps=4), *EXACT)
    assert rc == 0, log[-3000:]
    caplog.set_level("INFO", logger="hf_asyncpp")
    assert main([str(tmp_path / "b.yaml"), *EXACT, "--pipeline.num_stages=1", "--training.resume_from_checkpoint=latest",
                 "--training.stop_after_steps=null"]) == 0
    assert "resumed a 2-process, 2-stage checkpoint on 1 processes, 1 stages" in caplog.text
    assert [r["step"] for r in map(json.loads, (moved / "metrics.jsonl").read_text().splitlines()) if "loss" in r] \
        == list(range(1, 9))


def test_logging_steps_change_nothing_computed(tmp_path, straight_24):
    """logging_steps 1 and 7 give bit-identical losses, grad norms, lrs and weights: logging never drains the
    pipeline, so what it reports cannot change what is computed."""
    rows, weights = {}, {}
    every_7 = tmp_path / "every-7"
    rc, log = launch(write_recipe(tmp_path / "7.yaml", every_7, **{**STEPS_24, "logging_steps": 7}))
    assert rc == 0, log[-3000:]
    for every, out in ((1, straight_24), (7, every_7)):
        rows[every] = [(r["step"], r["loss"], r["grad_norm"], r["learning_rate"])
                       for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
        weights[every] = {s: load_file(str(out / "checkpoint-0000024" / f"stage-{s}.safetensors")) for s in ("00", "01")}
    assert [r[0] for r in rows[1]] == list(range(1, 25))  # one record per step, in order
    assert rows[1] == rows[7]  # bitwise
    for s, tensors in weights[1].items():
        assert all(torch.equal(t, weights[7][s][k]) for k, t in tensors.items()), s


def test_the_launcher_gives_cuda_ranks_the_expandable_allocator_unless_the_user_set_one():
    """The ranks the launcher starts on GPUs inherit ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``; on CPU
    nothing is added, and a value the user set reaches the ranks unchanged."""
    from hf_asyncpp.launch.spawn import CUDA_ALLOC, _environment, worker_env
    from support import LLAMA, make_recipe

    recipe, key = make_recipe(LLAMA, "2bw", 2, 2, 2), CUDA_ALLOC[0]
    assert worker_env(recipe, "errors", False, gpus=2, environ={})[key] == "expandable_segments:True"
    assert key not in worker_env(recipe, "errors", False, gpus=0, environ={})
    user = {key: "max_split_size_mb:128"}
    assert key not in worker_env(recipe, "errors", False, gpus=2, environ=user)
    read = [sys.executable, "-c", f"import os; print(os.environ.get({key!r}))"]
    for gpus, outside, seen in ((2, None, "expandable_segments:True"), (2, "max_split_size_mb:128", "max_split_size_mb:128"),
                                (0, None, "None")):
        before = os.environ.pop(key, None)
        try:
            if outside is not None:
                os.environ[key] = outside
            with _environment(worker_env(recipe, "errors", False, gpus=gpus)):  # as spawn() starts torchrun
                child = subprocess.run(read, capture_output=True, text=True, check=True).stdout.strip()
        finally:
            os.environ.pop(key, None)
            if before is not None:
                os.environ[key] = before
        assert child == seen, (gpus, outside, child)


def test_a_mixture_on_two_replicas_counts_every_replica_and_resumes_bitwise(tmp_path):
    """A mixture of a zstd and a gzip source on 2 data-parallel replicas (one stage each): the replicas draw the same
    sources, each from its own shard, so the sources' tokens in metrics.jsonl, summed over the replicas, are
    num_input_tokens_seen; 2 steps, stop, resume, 2 steps is bitwise the straight 4."""
    import gzip

    import zstandard

    from support import FIXTURE

    (tmp_path / "sotu.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(FIXTURE.read_bytes()))
    notes = [f"Note {i}: the river rose over the lower fields and the harvest came in late." for i in range(300)]
    (tmp_path / "notes.txt.gz").write_bytes(gzip.compress(("\n\n".join(notes) + "\n").encode()))
    sources = [{"name": "sotu", "train_files": [str(tmp_path / "sotu.jsonl.zst")], "weight": 3},
               {"name": "notes", "train_files": [str(tmp_path / "notes.txt.gz")], "weight": 1}]
    flags = ("--pipeline.schedule=none", "--pipeline.num_stages=1", "--optimizer.delay_correction=none",
             "--data.train_files=null", "--data.eval_files=null", f"--data.sources={json.dumps(sources)}",
             "--training.max_steps=4", "--training.save_steps=2", "--training.eval_steps=2", *EXACT)
    straight, split = tmp_path / "straight", tmp_path / "split"
    rc, log = launch(write_recipe(tmp_path / "a.yaml", straight), *flags)
    assert rc == 0, log[-3000:]
    rc, log = launch(write_recipe(tmp_path / "b.yaml", split, stop_after_steps=2), *flags)
    assert rc == 0, log[-3000:]
    rc, log = launch(tmp_path / "b.yaml", *flags, "--training.resume_from_checkpoint=latest", "--training.stop_after_steps=null")
    assert rc == 0, log[-3000:]
    assert len(losses(straight)) == 4 and losses(split) == losses(straight)
    rows = [json.loads(x) for x in (straight / "metrics.jsonl").read_text().splitlines()]
    seen = {r["step"]: r["num_input_tokens_seen"] for r in rows if "loss" in r}
    counts = {r["step"]: r for r in rows if "data/sotu/tokens" in r}
    assert sorted(counts) == [2, 4] and all(c["data/sotu/tokens"] + c["data/notes/tokens"] == seen[s]
                                            for s, c in counts.items())
    assert [r for r in map(json.loads, (split / "metrics.jsonl").read_text().splitlines()) if "data/sotu/tokens" in r] \
        == [counts[2], counts[4]]
