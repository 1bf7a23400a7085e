"""Recipe loading: every bad input names the dotted field and what is allowed."""
import logging
import re

import pytest
import torch
import yaml

from hf_asyncpp.config import recipe as config
from hf_asyncpp.config.recipe import apply_overrides, load_recipe, recipe_from_dict, save_recipe
from hf_asyncpp.errors import RecipeError

BASE = {"model": {"config": {"model_type": "llama", "hidden_size": 32}}}


def _with(section, **kw):
    d = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}
    d.setdefault(section, {}).update(kw)
    return d


BAD = [
    (_with("pipeline", schedule="zero-bubble"), r"pipeline\.schedule: 'zero-bubble' is not allowed; choose one of '2bw', '1f1b', 'zbh1', 'gpipe', 'pipedream', 'none'"),
    (_with("pipeline", schedule="zbv", num_stages=2), r"pipeline\.schedule: 'zbv' holds 2 stages per process, and the "
                                                   r"executor runs one stage per process: interleaved and V-shaped "
                                                   r"schedules are planner-only for now"),
    (_with("training", max_stepz=10), r"training\.max_stepz: unknown field; did you mean 'max_steps'\? allowed fields of "
                                      r"training: .*max_steps"),
    (_with("training", per_device_train_batch_size=8),
     r"training\.per_device_train_batch_size: transformers.TrainingArguments' name; here it is pipeline\.microbatch_size"),
    (_with("training", gradient_accumulation_steps=8), r"here it is pipeline\.num_microbatches"),
    (_with("training", max_steps=0), r"training\.max_steps: 0 is out of range; allowed: >= 1"),
    (_with("training", max_steps="ten"), r"training\.max_steps: expected an integer, got 'ten'"),
    (_with("optimizer", learning_rate=-1.0), r"optimizer\.learning_rate: -1\.0 is out of range; allowed: > 0\.0"),
    (_with("optimizer", name="lion"), r"optimizer\.name: 'lion' is not allowed; choose one of 'muon', 'adamw', 'nadam', 'sgd'"),
    (_with("optimizer", delay_correction="ef"), r"optimizer\.delay_correction: 'ef' is not allowed; choose one of 'none', 'error_feedback'"),
    (_with("optimizer", simulate_delay=2), r"optimizer\.simulate_delay: 2 is not allowed; choose one of '0', '1', 'pipedream'"),
    (_with("optimizer", adam_beta2=1.5), r"optimizer\.adam_beta2: 1\.5 is out of range; allowed: >= 0\.0 and <= 1\.0"),
    (_with("pipeline", schedule="2bw", num_stages=4, num_microbatches=2), r"pipeline\.num_microbatches: 2bw needs num_microbatches >= num_stages \(2 < 4\)"),
    (_with("pipeline", num_stages=2), r"pipeline\.num_stages: 2 needs a pipeline schedule"),
    (_with("pipeline", schedule="1f1b", num_stages=2, layers_per_stage=[1, 1, 1]), r"pipeline\.layers_per_stage: 3 entries for 2 stages"),
    (_with("pipeline", layers_per_stage="fast"), r"pipeline\.layers_per_stage: expected one of 'auto' or a list of an integer or null, got 'fast'"),
    (_with("pipeline", schedule="1f1b", num_stages=2, layers_per_stage="auto"), None),  # valid: measured at start
    (_with("data", seq_len=1), r"data\.seq_len: 1 is out of range; allowed: >= 2"),
    (_with("pipeline", num_stages=2.5), r"pipeline\.num_stages: expected an integer, got 2\.5"),
    (_with("data", train_files={"a": 1}), r"data\.train_files: expected a list of a string or null"),
    (_with("training", bf16="yes"), r"training\.bf16: expected true or false, got the string 'yes' \(quoted in the YAML: remove the quotes\)"),
    (_with("training", max_steps="5"), r"training\.max_steps: expected an integer, got the string '5' \(quoted in the YAML: remove the quotes\)$"),
    (_with("hub", push_to_hub=True), r"hub\.hub_model_id: required when hub\.push_to_hub is true"),
    ({"model": {}}, r"model: give exactly one of model\.config \(random init\) or model\.name_or_path"),
    ({"model": {"config": {"hidden_size": 8}}}, r"model\.config\.model_type: missing"),
    ({**BASE, "trainer": {}}, r"trainer: unknown field; allowed fields: data, eval, hub, model, optimizer, pipeline, training"),
    (_with("training", report_to=[1]), r"training\.report_to\[0\]: expected a string, got 1"),
    (_with("optimizer", ef_lambda="sometimes"), r"optimizer\.ef_lambda: expected a number or one of 'auto', 'learned', got 'sometimes'"),
    (_with("optimizer", ef_lambda=-0.5), r"optimizer\.ef_lambda: -0\.5 is out of range; allowed: >= 0\.0"),
    (_with("optimizer", ef_lambda="auto"), None),  # valid
    (_with("optimizer", name="muon", fused=True), r"optimizer\.fused: true is torch's fused AdamW kernel; it needs optimizer\.name: adamw, not 'muon'"),
    (_with("optimizer", name="adamw", fused=True), None),  # valid
    (_with("optimizer", ef_lambda_schedule="cosine"), r"optimizer\.ef_lambda_schedule: 'cosine' is not allowed; choose one of 'lr', 'constant'"),
    (_with("optimizer", simulate_delay="1"), None),  # valid: control case
]


@pytest.mark.parametrize("data,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_recipes_name_the_field(data, message):
    if message is None:
        recipe_from_dict(data)
        return
    with pytest.raises(RecipeError, match=message):
        recipe_from_dict(data)


def test_simulate_delay_outside_single_process_is_rejected():
    with pytest.raises(RecipeError, match=r"optimizer\.simulate_delay: '1' is a single-process research mode"):
        recipe_from_dict({**_with("optimizer", simulate_delay=1), "pipeline": {"schedule": "2bw", "num_stages": 2}})


def test_zbh1_is_refused_with_compiled_layers_as_training_would_compile_them(monkeypatch):
    """A compiled layer's backward computes every gradient, so ZB-H1's I and W would each run it whole: refused in
    one line naming both fields and what to use instead, for the setting training applies (unset: compiled where a
    GPU trains); an unset setting on a CPU (not compiled) and the other schedules compiled are accepted."""
    zb = {"schedule": "zbh1", "num_stages": 2, "num_microbatches": 2}
    msg = (r"pipeline\.schedule: 'zbh1' with training\.torch_compile on \(unset: on where a GPU trains\) runs each "
           r"compiled layer's whole backward twice, in I and in W .*; use pipeline\.schedule: 1f1b or 2bw, or set "
           r"training\.torch_compile: false")
    with pytest.raises(RecipeError, match=msg) as e:
        recipe_from_dict({**BASE, "pipeline": zb, "training": {"torch_compile": True}})
    assert "\n" not in str(e.value)
    recipe_from_dict({**BASE, "pipeline": zb, "training": {"torch_compile": False}})
    recipe_from_dict({**BASE, "pipeline": {**zb, "schedule": "1f1b"}, "training": {"torch_compile": True}})
    recipe_from_dict({**BASE, "pipeline": {**zb, "schedule": "2bw"}, "training": {"torch_compile": True}})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # unset on a CPU: not compiled
    recipe_from_dict({**BASE, "pipeline": zb})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # unset where a GPU trains: compiled
    with pytest.raises(RecipeError, match=msg):
        recipe_from_dict({**BASE, "pipeline": zb})
    recipe_from_dict({**BASE, "pipeline": zb, "training": {"torch_compile": False}})


def test_overrides_and_roundtrip(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(BASE))
    r = load_recipe(path, ["--training.max_steps=50", "--optimizer.learning_rate=1e-3", "--optimizer.simulate_delay=1",
                           "--training.report_to=none", "--data.train_files=[a.txt, b.txt]"])
    assert r.training.max_steps == 50 and r.optimizer.learning_rate == 1e-3
    assert r.optimizer.simulate_delay == "1" and r.training.report_to == ["none"]
    assert r.data.train_files == ["a.txt", "b.txt"]
    save_recipe(r, tmp_path / "resolved.yaml")
    assert load_recipe(tmp_path / "resolved.yaml") == r
    with pytest.raises(RecipeError, match=r"expected --section\.field=value"):
        apply_overrides({}, ["training.max_steps=5"])
    with pytest.raises(RecipeError, match=r"training\.max_steps: expected an integer, got 'x'"):
        load_recipe(path, ["--training.max_steps=x"])
    with pytest.raises(RecipeError, match="not found"):
        load_recipe(tmp_path / "nope.yaml")


def test_a_command_line_field_replaces_its_alternative_from_the_recipe_file(tmp_path, caplog, monkeypatch):
    """``--model.name_or_path`` over a random-init recipe trains that model (the command line wins, said in a log
    line); a recipe that gives both, in its file or on the command line, is an error that names the fix."""
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({**BASE, "data": {"dataset": "org/corpus"}}))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(config, "_SAID", set())  # said once per process: this test's process may have said it
    with caplog.at_level(logging.WARNING, logger="hf_asyncpp"):
        r = load_recipe(path, ["--model.name_or_path=byo/gpt2", "--data.train_files=[a.jsonl]"])
    assert (r.model.name_or_path, r.model.config, r.data.train_files, r.data.dataset) == ("byo/gpt2", None, ["a.jsonl"], None)
    assert "--model.name_or_path replaces the recipe's model.config" in caplog.text
    assert "--data.train_files replaces the recipe's data.dataset" in caplog.text
    caplog.clear()
    load_recipe(path, ["--model.name_or_path=byo/gpt2"])  # `hf-asyncpp train` loads a recipe twice: said once
    assert "replaces" not in caplog.text
    pretrained = tmp_path / "p.yaml"
    pretrained.write_text(yaml.safe_dump({"model": {"name_or_path": "byo/gpt2"}}))
    monkeypatch.setenv("RANK", "1")  # one process says it, not every rank
    caplog.clear()
    r = load_recipe(pretrained, ["--model.config={model_type: llama}"])
    assert (r.model.name_or_path, r.model.config) == (None, {"model_type": "llama"}) and "replaces" not in caplog.text
    assert load_recipe(path, ["--model.config=null", "--model.name_or_path=byo/gpt2"]).model.config is None
    both = r"model: give exactly one of model\.config \(random init\) or model\.name_or_path; both are set: remove one " \
           r"\(--model\.config=null removes the recipe's\)"
    with pytest.raises(RecipeError, match=both):
        load_recipe(path, ["--model.name_or_path=byo/gpt2", "--model.config={model_type: llama}"])
    with pytest.raises(RecipeError, match=both):
        recipe_from_dict({"model": {**BASE["model"], "name_or_path": "byo/gpt2"}})
    with pytest.raises(RecipeError, match=r"data\.dataset, not both: remove one \(--data\.dataset=null removes the recipe's\)"):
        recipe_from_dict({**BASE, "data": {"dataset": "org/corpus", "train_files": ["a.jsonl"]}})


def test_version_is_a_command(capsys):
    from hf_asyncpp import __version__
    from hf_asyncpp.cli import main

    assert main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"hf-asyncpp {__version__}"


def test_an_override_takes_the_next_argument_as_its_value(tmp_path):
    """``--field value`` as ``--field=value`` (HfArgumentParser's and torchtitan's convention); a bare ``--flag``
    is true for a true/false field and an error naming the field otherwise, never a silent default."""
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(BASE))
    r = load_recipe(path, ["--training.max_steps", "50", "--optimizer.learning_rate", "1e-3", "--training.bf16",
                           "--data.train_files", "[a.txt, b.txt]", "--training.gradient_checkpointing", "false",
                           "--training.resume_from_checkpoint"])
    assert (r.training.max_steps, r.optimizer.learning_rate, r.training.bf16, r.data.train_files) == (50, 1e-3, True,
                                                                                                     ["a.txt", "b.txt"])
    assert r.training.gradient_checkpointing is False and r.training.resume_from_checkpoint == "latest"
    assert load_recipe(path, ["--model.config.hidden_size", "64"]).model.config["hidden_size"] == 64
    for argv in (["--training.max_steps"], ["--training.max_steps", "--training.bf16"]):
        with pytest.raises(RecipeError, match=r"^--training\.max_steps: no value given \(an integer\); write "
                                              r"--training\.max_steps=VALUE or --training\.max_steps VALUE$"):
            load_recipe(path, argv)
    with pytest.raises(RecipeError, match=r"^override '60': expected --section\.field=value or --section\.field value"):
        load_recipe(path, ["--training.max_steps", "50", "60"])
    with pytest.raises(RecipeError, match=r"^override --training\.max_steps\.x: training\.max_steps is a field"):
        load_recipe(path, ["--training.max_steps.x=1"])


FOREIGN = [  # what users bring from the HF Trainer, run_clm, trl and torch, and the field that means the same here
    ("dataset_name", "data.dataset"), ("block_size", "data.seq_len"), ("eval_strategy", "training.eval_steps"),
    ("hub_private_repo", "hub.private"), ("learning_rate", "optimizer.learning_rate"),
    ("per_device_train_batch_size", "pipeline.microbatch_size"), ("num_train_epochs", "training.max_steps"),
    ("output_dir", "training.output_dir"), ("max_steps", "training.max_steps"), ("save_steps", "training.save_steps"),
    ("logging_steps", "training.logging_steps"), ("lr_scheduler_type", "training.lr_scheduler_type"),
    ("warmup_steps", "training.warmup_steps"), ("weight_decay", "optimizer.weight_decay"), ("seed", "training.seed"),
    ("bf16", "training.bf16"), ("push_to_hub", "hub.push_to_hub"), ("hub_model_id", "hub.hub_model_id"),
    ("gradient_checkpointing", "training.gradient_checkpointing"),
    ("resume_from_checkpoint", "training.resume_from_checkpoint"), ("optimizer.lr", "optimizer.learning_rate"),
    ("training.learning_rate", "optimizer.learning_rate"), ("data.dataset_name", "data.dataset"),
    ("max_seq_length", "data.seq_len"), ("dataset_text_field", "data.text_column"),
    ("model_name_or_path", "model.name_or_path"), ("gradient_accumulation_steps", "pipeline.num_microbatches"),
]


@pytest.mark.parametrize("name,here", FOREIGN, ids=[n for n, _ in FOREIGN])
def test_names_from_the_trainer_run_clm_and_trl_are_answered_with_the_field_here(tmp_path, name, here):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(BASE))
    for argv in ([f"--{name}", "1"], [f"--{name}=1"]):
        with pytest.raises(RecipeError, match=rf"^--{re.escape(name)}: .*; here it is --{re.escape(here)}\b"):
            load_recipe(path, argv)
    section, _, field = name.rpartition(".")
    in_file = {**BASE, section: {field: 1}} if section else {**BASE, field: 1}
    with pytest.raises(RecipeError, match=rf"^{re.escape(name)}: .*; here it is {re.escape(here)}\b"):
        recipe_from_dict(in_file)  # the same answer for a recipe file's key


def test_every_name_from_elsewhere_points_at_a_field(tmp_path):
    """Each field ``FOREIGN_NAMES`` answers with exists (or is a key inside ``model.config``), and no such name is a
    field here itself (it would never be looked up)."""
    from hf_asyncpp.config.names import FOREIGN_NAMES
    from hf_asyncpp.config.reference import recipe_fields

    fields = {f.dotted for f in recipe_fields()}
    names = {f.name for f in recipe_fields()}
    for name, (_, here, _) in FOREIGN_NAMES.items():
        assert name not in names, name
        assert here is None or here in fields or here.startswith("model.config."), (name, here)


def test_every_recipe_field_says_what_it_means():
    """``train --help`` and docs/recipes.md print each field's docstring: a field without one prints a blank meaning."""
    from hf_asyncpp.config.reference import recipe_fields

    blank = [f"{f.section}.{f.name}" for f in recipe_fields() if not f.doc.strip()]
    assert not blank, f"give these fields a docstring in hf_asyncpp/config/: {blank}"
