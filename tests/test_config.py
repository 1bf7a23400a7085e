"""Recipe loading: every bad input names the dotted field and what is allowed."""
import logging

import pytest
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
    (_with("pipeline", schedule="zero-bubble"), r"pipeline\.schedule: 'zero-bubble' is not allowed; choose one of '2bw', '1f1b', 'gpipe', 'pipedream', 'none'"),
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
    (_with("training", bf16="yes"), r"training\.bf16: expected true or false, got 'yes'"),
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
