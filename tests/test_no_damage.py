"""Commands never damage what they read, checked by hashing every file before and after.

Resuming a finished run (the resume command of docs/checkpoints.md) says so and changes nothing; with a raised
``max_steps`` it trains on; a finished run whose export a kill interrupted still writes it, without replacing the
measured pipeline profile or recording its final evaluation twice. ``hf-asyncpp evaluate`` writes only into its
``--out`` folder, never into the folder it scores and never through a symbolic link (a Hugging Face cache snapshot
is a folder of links into the cache's blobs)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from hf_asyncpp.cli.evaluate import main as evaluate_main
from hf_asyncpp.cli.train import main as train_main
from hf_asyncpp.run.reporting import read_metrics
from support import FIXTURE, tiny

ONE_STAGE = dict(pipeline__schedule="2bw", pipeline__num_stages=1, training__max_steps=4, training__save_steps=2)
"""A pipelined run in one process (it writes a pipeline profile), 4 steps."""


def tree(root: Path) -> dict[str, str]:
    """Every entry under ``root``: a file's sha256, a link's target, a folder as such (a new empty folder counts)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def recipe_file(tmp_path: Path, out: Path, **overrides) -> str:
    path = tmp_path / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(tiny(out, **overrides)))
    return str(path)


def train_steps(out: Path) -> list[int]:
    return [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


@pytest.mark.parametrize("export", [True, False])
def test_resuming_a_finished_run_changes_nothing_unless_max_steps_grew(tmp_path, capsys, export):
    out = tmp_path / "done"
    recipe = recipe_file(tmp_path, out, **ONE_STAGE, training__export=export)
    assert train_main([recipe]) == 0
    before = tree(out)
    assert "pipeline_profile.json" in before and ("export/model.safetensors" in before) == export
    capsys.readouterr()
    assert train_main([recipe, "--training.resume_from_checkpoint=latest"]) == 0
    said = capsys.readouterr().out.strip().splitlines()
    assert len(said) == 1 and "is complete" in said[0] and "checkpoint-0000004" in said[0] and \
        "--training.max_steps" in said[0], said
    assert tree(out) == before  # the profile, the timeline, metrics.jsonl, the recipe, the export: all as they were
    assert train_main([recipe, "--training.resume_from_checkpoint=latest", "--training.max_steps=6"]) == 0
    assert train_steps(out) == [1, 2, 3, 4, 5, 6] and (out / "checkpoint-0000006").is_dir()


def test_a_finished_run_killed_in_its_export_writes_it_on_resume_and_keeps_its_profile(tmp_path, capsys):
    """A kill mid-export leaves ``.export.partial/`` and no ``export/``. Resuming
    from the checkpoint at max_steps writes the export; the profile the run measured stays (the resume trained
    nothing, so measured nothing), and its final evaluation is recorded once."""
    out = tmp_path / "killed"
    recipe = recipe_file(tmp_path, out, **ONE_STAGE, training__export=True)
    assert train_main([recipe]) == 0
    shutil.rmtree(out / "export")
    (out / "final_eval.json").unlink()
    (out / ".export.partial").mkdir()
    (out / ".export.partial" / "model-00001-of-00001.safetensors").write_bytes(b"half")
    kept = {n: (out / n).read_bytes() for n in ("pipeline_profile.json", "pipeline_timeline.png", "metrics.jsonl")}
    capsys.readouterr()
    assert train_main([recipe, "--training.resume_from_checkpoint=latest"]) == 0
    assert "exported" in capsys.readouterr().out
    assert (out / "export" / "model.safetensors").is_file() and (out / "final_eval.json").is_file()
    assert not (out / ".export.partial").exists()
    for name, data in kept.items():
        assert (out / name).read_bytes() == data, f"{name} was rewritten by a resume that trained no step"


# ---------------------------------------------------------------------------- evaluate: only into --out


@pytest.fixture
def cached_snapshot(tmp_path) -> Path:
    """A model as the Hugging Face cache holds it: ``snapshots/<rev>/`` is a folder of symbolic links into ``blobs/``
    (README.md among them), the layout that ``evaluate`` wrote through into the shared blob."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_asyncpp.data.tokenizer import train_tokenizer
    from hf_asyncpp.model.export import export_hf_model

    tok = train_tokenizer([str(FIXTURE)], 300)
    cfg = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=64,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    folder = export_hf_model(AutoModelForCausalLM.from_config(cfg).state_dict(), cfg, tmp_path / "made", tokenizer=tok)
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# someone's model\n")
    repo = tmp_path / "hub" / "models--someone--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in folder.iterdir():
        blob = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, repo / "blobs" / blob)
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / blob)
    return snapshot


def test_evaluate_writes_only_into_a_new_folder_beside_what_it_scores(cached_snapshot, tmp_path, monkeypatch, capsys):
    from huggingface_hub import ModelCard

    hub = tmp_path / "hub"
    before = tree(hub)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    args = [str(cached_snapshot), "--data", str(FIXTURE), "--seq-len", "16", "--max-blocks", "2", "--device", "cpu"]
    assert evaluate_main(args) == 0
    assert tree(hub) == before  # not the README.md blob, not a new file in the snapshot
    [out] = [p for p in work.iterdir()]  # the default --out: a new folder in the current one
    assert out.name.startswith("eval-") and f"results: {out}" in capsys.readouterr().out
    assert json.loads((out / "eval_results.json").read_text())["blocks"] == 2
    card = ModelCard.load(out / "0123abc" / "README.md")  # the model's card, with the results added
    assert card.data.license == "mit" and card.data.eval_results[0].metric_type == "perplexity"
    assert not (out / "0123abc" / "README.md").is_symlink()

    assert evaluate_main(args) == 0  # a second evaluation: another new folder, the first one kept
    assert len(list(work.iterdir())) == 2 and tree(hub) == before


@pytest.mark.parametrize("inside", ["snapshot", "snapshot/results", "json"])
def test_evaluate_refuses_an_out_inside_what_it_scores(cached_snapshot, tmp_path, capsys, inside):
    hub = tmp_path / "hub"
    before = tree(hub)
    out = {"snapshot": cached_snapshot, "snapshot/results": cached_snapshot / "results",
           "json": tmp_path / "r.json"}[inside]
    code = evaluate_main([str(cached_snapshot), "--data", str(FIXTURE), "--max-blocks", "2", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "--out" in err, err
    assert tree(hub) == before and not (tmp_path / "r.json").exists()
