"""Honest outputs: a model card says what was measured on what (a local task file is not the
public dataset), what the model was trained on (its usage prompt comes from the run's data, or is neutral) and
whether a license was chosen; exported files are readable as ``save_pretrained`` leaves them (the umask, not
0600); a pipelined checkpoint opens with ``from_pretrained``, as a Trainer checkpoint does; a run ends with one
summary that says its result once and where its outputs are."""
from __future__ import annotations

import json
import logging
import stat
from pathlib import Path

import pytest
import torch
import yaml

from hf_asyncpp.cli.train import main as train_main
from hf_asyncpp.run.model_card import add_eval_results, render_model_card
from hf_asyncpp.storage import checkpoint_io as ckpt
from hf_asyncpp.storage.names import INDEX_FILE, MANIFEST, checkpoint_name
from hf_asyncpp.storage.write import umask
from support import TASK_FILES, make_model, tiny, tiny_llama

ARC = {"acc": 0.5, "acc_norm": 0.25, "n": 12, "limit": None, "num_fewshot": 0, "scorer": "lm-eval 0.4.13",
       "dataset": {"path": "allenai/ai2_arc", "config": "ARC-Easy", "split": "test"}}  # as lm-eval's task config says


def test_a_local_task_file_is_labelled_as_local_never_as_the_public_dataset(tmp_path):
    from huggingface_hub import ModelCard

    local = {**ARC, "dataset": {"path": "json", "config": None, "split": "test"}}  # lm-eval read the file
    add_eval_results(tmp_path, {"arc_easy": local}, task_files={"arc_easy": TASK_FILES["arc_easy"]})
    card = ModelCard.load(tmp_path / "README.md")
    for e in card.data.eval_results:
        assert e.dataset_type == "arc_easy.jsonl" and "allenai" not in e.dataset_type
        assert e.dataset_split is None and e.dataset_config is None
        assert "local file arc_easy.jsonl, 12 items" in e.dataset_name and "local file" in e.metric_name
    assert "allenai/ai2_arc" not in (tmp_path / "README.md").read_text()
    add_eval_results(tmp_path / "hub", {"arc_easy": ARC})  # the Hub's data keeps its id, config and split
    [hub] = ModelCard.load(tmp_path / "hub" / "README.md").data.eval_results[:1]
    assert (hub.dataset_type, hub.dataset_split) == ("allenai/ai2_arc", "test")


def test_the_usage_prompt_comes_from_the_data_or_is_neutral_and_the_license_is_said():
    model = make_model("llama")
    plain = render_model_card({"steps": 3}, model)
    assert "state of the Union" not in str(plain) and 'tokenizer("The", return_tensors="pt")' in str(plain)
    assert "license" not in plain.data.to_dict() and "License: not set" in plain.text  # no invented license
    own = render_model_card({"prompt": 'Mr. Speaker, "the" year', "license": "apache-2.0"}, model)
    assert 'tokenizer("Mr. Speaker, \\"the\\" year", return_tensors="pt")' in str(own)
    assert own.data.license == "apache-2.0" and "License: `apache-2.0`" in own.text


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_exports_follow_the_umask_and_checkpoints_open_with_from_pretrained(tmp_path, tied):
    """A pipelined run (2BW, one process): its export's files have the mode open() gives (0600 from safetensors'
    writer before), and its checkpoint has a model.safetensors.index.json of the stage file only (not the 2BW
    versions nor the optimizer), listed in its manifest, so from_pretrained loads the checkpoint's weights. Tied, the
    stage file holds the head too (a copy of the embedding's one parameter): the index leaves it out and
    from_pretrained ties it again; 2 stages: test_launch.py."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(tiny(out, pipeline__schedule="2bw", pipeline__num_stages=1, training__max_steps=2,
                                          training__save_steps=2, training__export=True,
                                          model__config=tiny_llama(2, tie_word_embeddings=tied))))
    assert train_main([str(recipe)]) == 0
    want = 0o666 & ~umask()
    for f in (out / "export").iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == want, (f.name, oct(f.stat().st_mode))
    saved = out / checkpoint_name(2)
    index = json.loads((saved / INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == {"stage-00.safetensors"}
    assert "lm_head.weight" in ckpt.TensorFile(saved / "stage-00.safetensors").names
    assert ("lm_head.weight" in index["weight_map"]) is not tied
    assert INDEX_FILE in json.loads((saved / MANIFEST).read_text())["files"] and ckpt.verify(saved) == []
    model = AutoModelForCausalLM.from_pretrained(saved)
    exported = AutoModelForCausalLM.from_pretrained(out / "export")
    for name, value in exported.state_dict().items():  # the checkpoint's model is the exported one
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied


def test_the_index_is_written_only_where_each_tied_copy_equals_its_partner(tmp_path):
    """``weight_index`` on hand-made stage files: a tied head the last stage holds as its own copy, equal to the
    embedding, gets an index without it (from_pretrained re-ties it); one that differs (from_pretrained would untie
    the two and give another model), a copy whose partner no stage file holds, or a name two stage files hold with
    different values gets none. Only the copies are read past the headers."""
    from safetensors.torch import save_file

    tied = {"lm_head.weight": "model.embed_tokens.weight"}
    emb, layer, norm = torch.randn(8, 4), torch.randn(4, 4), torch.randn(4)

    def stages(name, head, **last):
        folder = tmp_path / name
        folder.mkdir()
        save_file({"model.embed_tokens.weight": emb, "model.layers.0.w": layer}, str(folder / "stage-00.safetensors"))
        save_file({"model.norm.weight": norm, "lm_head.weight": head, **last}, str(folder / "stage-01.safetensors"))
        save_file({"lm_head.weight/0": head + 1}, str(folder / "stage-01-versions.safetensors"))  # never indexed
        return folder

    good = stages("good", emb.clone())
    ckpt.bytes_read(reset=True)
    index = ckpt.weight_index(good, tied=tied)
    assert index["weight_map"] == {"model.embed_tokens.weight": "stage-00.safetensors",
                                   "model.layers.0.w": "stage-00.safetensors", "model.norm.weight": "stage-01.safetensors"}
    assert index["metadata"]["total_size"] == sum(f.stat().st_size for f in good.glob("stage-0?.safetensors"))
    headers = sum(8 + int.from_bytes(f.read_bytes()[:8], "little") for f in good.glob("stage-0?.safetensors"))
    assert ckpt.bytes_read() == headers + 2 * emb.numel() * emb.element_size()  # the head and the embedding, no more
    assert ckpt.weight_index(good)["weight_map"]["lm_head.weight"] == "stage-01.safetensors"  # untied: a weight
    assert ckpt.weight_index(stages("differs", emb + 1e-6), tied=tied) is None
    assert ckpt.weight_index(stages("no-partner", emb.clone()), tied={"lm_head.weight": "model.wte.weight"}) is None
    assert ckpt.weight_index(stages("same-copies", emb.clone(), **{"model.layers.0.w": layer.clone()}), tied=tied)
    assert ckpt.weight_index(stages("other-copies", emb.clone(), **{"model.layers.0.w": layer + 1}), tied=tied) is None


def test_a_run_ends_with_one_summary_saying_the_result_once_and_where_its_outputs_are(tmp_path, capsys, caplog):
    """The end of a run (here pipelined, exported, with tensorboard logs and an evaluation on the way) prints its
    final result once, in the end summary (``cli/train.py: end_summary``), not also in the log; the summary's first
    line is the result line docs and scripts quote, then a line per kind of output, each path one that exists."""
    caplog.set_level(logging.INFO, logger="hf_asyncpp")  # the log lines as a console shows them
    out = tmp_path / "run"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(tiny(out, pipeline__schedule="2bw", pipeline__num_stages=1, training__max_steps=4,
                                          training__save_steps=2, training__eval_steps=2, training__export=True,
                                          training__report_to=["tensorboard"])))
    assert train_main([str(recipe)]) == 0
    said = capsys.readouterr()
    console = said.out + said.err + caplog.text
    final = json.loads((out / "final_eval.json").read_text())
    result = (f"exported {out / 'export'}: perplexity {final['export_eval_perplexity']:.2f} "
              f"(untrained {final['untrained_eval_perplexity']:.2f}), eval_loss {final['export_eval_loss']:.4f}")
    assert console.count(f"perplexity {final['export_eval_perplexity']:.2f}") == 1, console
    assert console.count("exported ") == 1 and "step 2: eval_loss" in caplog.text  # each evaluation is said
    first, *where = said.out.strip().splitlines()
    assert first == result
    listed = dict(line.strip().split(": ", 1) for line in where)
    assert [line[:2] for line in where] == ["  "] * len(where) and list(listed) == ["metrics", "curves", "logs", "checkpoints"]
    assert listed["metrics"] == ", ".join(str(out / n) for n in ("metrics.jsonl", "final_eval.json", "pipeline_profile.json"))
    assert listed["curves"] == f"{out / 'loss_curve.png'}, {out / 'pipeline_timeline.png'}"
    assert listed["logs"] == str(out / "logs") and listed["checkpoints"] == f"{out} (newest {checkpoint_name(4)})"
    for path in ", ".join([listed["metrics"], listed["curves"], listed["logs"]]).split(", "):
        assert Path(path).exists(), path
    assert (out / checkpoint_name(4) / MANIFEST).is_file()
