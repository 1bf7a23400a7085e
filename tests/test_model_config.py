"""``model.config`` checked against the model's own config class before anything runs (hf_asyncpp/run/preflight.py):
transformers keeps a key its class does not know as a plain attribute, so a typo used to train the default and ship
in the export's config.json; a model type it does not know used to surface as an 11,737-character line after a
tokenizer was trained; a ``data.seq_len`` beyond the model's positions trained without a word."""
from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoConfig

from hf_asyncpp.config.recipe import load_recipe, recipe_from_dict
from hf_asyncpp.config.sections import DataConfig, ModelConfig
from hf_asyncpp.errors import RecipeError
from hf_asyncpp.run.preflight import check_model_config, check_recipe
from support import ARCHS, BASE, LLAMA, MIXTRAL, MODEL_TYPE, ROOT, ZAMBA, tiny, tiny_llama


def checked(tmp_path: Path, **overrides) -> None:
    """Every check before training (no Hub) on the tiny trainer recipe with ``section__field`` overrides."""
    check_recipe(recipe_from_dict(tiny(tmp_path / "run", **overrides)), hub=False)


def test_a_typo_in_model_config_is_an_error_with_the_key_meant(tmp_path):
    with pytest.raises(RecipeError, match=r"^model\.config\.hidden_sise: not a key of LlamaConfig .*did you mean "
                                          r"'hidden_size'\?$"):
        checked(tmp_path, model__config=tiny_llama(2, hidden_sise=96))
    with pytest.raises(RecipeError, match=r"^model\.config\.frobnicate: not a key of LlamaConfig .*its keys: .*hidden_size"):
        checked(tmp_path, model__config=tiny_llama(2, frobnicate=1))


def test_an_unknown_model_type_is_one_short_line_with_the_closest_types(tmp_path):
    with pytest.raises(RecipeError) as e:
        checked(tmp_path, model__config=tiny_llama(2, model_type="lama"))
    line = str(e.value)
    assert line.startswith("model.config.model_type: 'lama' is not a model type transformers") and "'llama'" in line
    assert "\n" not in line and len(line) < 300


def test_a_value_the_config_class_refuses_names_the_class(tmp_path):
    with pytest.raises(RecipeError, match=r"^model\.config: LlamaConfig refuses it: .*hidden size \(30\) is not a "
                                          r"multiple of the number of attention heads \(4\)"):
        checked(tmp_path, model__config=tiny_llama(2, hidden_size=30))


def test_a_block_longer_than_the_positions_names_both_values(tmp_path):
    with pytest.raises(RecipeError, match=r"^data\.seq_len: 128 tokens per block, but the model has 64 positions "
                                          r"\(model\.config\.max_position_embeddings\); lower data\.seq_len or raise "
                                          r"model\.config\.max_position_embeddings$"):
        checked(tmp_path, data__seq_len=128)
    without = {k: v for k, v in tiny_llama(2).items() if k != "max_position_embeddings"}  # the class default: 2048
    with pytest.raises(RecipeError, match=r"has 2048 positions \(model\.config\.max_position_embeddings, LlamaConfig "
                                          r"default\)"):
        checked(tmp_path, model__config=without, data__seq_len=4096)
    gpt2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 16}  # an aliased name
    with pytest.raises(RecipeError, match=r"has 16 positions \(model\.config\.n_positions\)"):
        check_model_config(ModelConfig(config=gpt2), DataConfig(seq_len=32))
    checked(tmp_path / "fits", data__seq_len=64)  # exactly the positions


def test_a_pretrained_model_folder_with_fewer_positions_is_an_error(tmp_path):
    folder = tmp_path / "my-model"
    AutoConfig.for_model(**tiny_llama(2)).save_pretrained(folder)  # 64 positions; the config is read before the tokenizer
    with pytest.raises(RecipeError, match=rf"^data\.seq_len: 128 tokens per block, but the model has 64 positions "
                                          rf"\(max_position_embeddings of model\.name_or_path '{folder}'\); lower "
                                          r"data\.seq_len$"):
        checked(tmp_path, model__config=None, model__name_or_path=str(folder), data__seq_len=128)


def test_the_keys_recipes_and_tests_use_pass(tmp_path):
    """Keys no ``__init__`` parameter names but transformers reads pass: ``rope_theta`` (consumed into
    ``rope_parameters``), Qwen3-MoE's ``head_dim`` (its attention's ``getattr``), Gemma 3's legacy
    ``sliding_window_pattern``. Of the tests' family table only GPT-2's ``intermediate_size`` is refused: GPT-2 reads
    ``n_inner``, so that key never changed its model."""
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        r = load_recipe(path)
        check_model_config(r.model, r.data)
    for config in (LLAMA, MIXTRAL, ZAMBA, tiny_llama(2, rope_theta=10000.0, attn_implementation="eager")):
        check_model_config(ModelConfig(config=config), DataConfig(seq_len=32))
    refused = {}
    for arch, extra in ARCHS.items():
        try:
            check_model_config(ModelConfig(config={"model_type": MODEL_TYPE.get(arch, arch), **BASE, **extra}),
                               DataConfig(seq_len=32))
        except RecipeError as e:
            refused[arch] = str(e).split(":")[0]
    assert refused == {"gpt2": "model.config.intermediate_size"}


@pytest.mark.parametrize("override,message", [
    ("--pipeline.num_stages=8 --pipeline.num_microbatches=8",
     r"pipeline.num_stages: 8 stages for 4 decoder layers; use at most 4 stages"),
    ("--pipeline.layers_per_stage=[1,2]", r"pipeline.layers_per_stage: \[1, 2\] must have 2 positive integers "
                                          r"summing to the 4 decoder layers \(it has 2 entries summing to 3\)"),
])
def test_stages_that_do_not_fit_the_layers_are_refused_before_any_process_starts(tmp_path, override, message):
    """Checked on the config by the partitioner's own plan in the launcher's checks: it was found after starting a
    process per stage, each printing its traceback (247 lines for 8 stages on 2 cores)."""
    recipe = load_recipe(ROOT / "recipes/cpu-tiny.yaml", [*override.split(), f"--training.output_dir={tmp_path / 'run'}"])
    with pytest.raises(RecipeError, match=message):
        check_recipe(recipe, hub=False)
