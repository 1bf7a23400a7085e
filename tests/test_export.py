"""Export round trip: from_pretrained of the exported folder gives the trained model's logits, with a card."""
from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_asyncpp.model.export import StateDictMismatchError, export_from_model, export_hf_model, load_checkpoint_state
from hf_asyncpp.run.model_card import card_writer, render_model_card
from support import DIMS

ROOT = Path(__file__).resolve().parent.parent
SENTENCES = [
    "Peace and liberty for all the people of the Union.",
    "The state of the Union is strong, and our economy grows.",
    "We must invest in schools, roads, and the health of our citizens.",
    "Congress shall pass the budget before the end of the year.",
    "Tonight I ask you to join me in building a stronger nation.",
] * 4
SMALL = dict(**DIMS, num_hidden_layers=2)
CONFIGS = {
    "llama": dict(model_type="llama", tie_word_embeddings=True, **SMALL),
    "llama_untied": dict(model_type="llama", tie_word_embeddings=False, **SMALL),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, **SMALL),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=8, **SMALL),
    "gemma3_text": dict(model_type="gemma3_text", head_dim=8, sliding_window=8, **SMALL),  # non-persistent embed_scale
    "gpt2": dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0),
}
FULL_CARD = {"schedule": "2bw", "num_stages": 2, "num_microbatches": 4, "microbatch_size": 2, "optimizer": "muon",
             "learning_rate": 0.02, "delay_correction": "error_feedback", "steps": 10, "tokens": 1234, "seq_len": 64,
             "datasets": ["user/sotu"], "data_description": "State of the Union addresses", "eval_loss": 3.5,
             "perplexity": 33.1, "eval_tokens": 640, "model_id": "user/tiny-2bw"}


@pytest.fixture(scope="module")
def tok():
    """A tiny byte-level BPE trained here, wrapped as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|pad|>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|pad|>")


def tiny(arch: str, vocab_size: int = 320, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(CONFIGS[arch])
    cfg = AutoConfig.for_model(kw.pop("model_type"), vocab_size=vocab_size, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # off the init distribution, so a silently re-initialized tensor shows in the logits
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_round_trip_from_stage_pieces(arch, tmp_path, tok):
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from hf_asyncpp.partition import merge_state_dicts, partition_model

    model = tiny(arch)
    pieces = [s.state_dict() for s in partition_model(model, 2)]  # what pipeline stages hold, original HF names
    assert all(len(p) < len(model.state_dict()) for p in pieces)
    out = export_hf_model(merge_state_dicts(pieces), model.config, tmp_path / "out", tokenizer=tok, card=card_writer(FULL_CARD),
                          max_shard_size="40KB")
    for f in ("config.json", "generation_config.json", "README.md", "tokenizer.json", "model.safetensors.index.json"):
        assert (out / f).exists(), f
    assert len(list(out.glob("model-*.safetensors"))) > 1
    assert not list(tmp_path.glob(".out*")), "temp dir left behind"

    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(logits(reloaded, ids), logits(model, ids), rtol=1e-6, atol=1e-6)
    gen = GenerationConfig.from_pretrained(out)
    assert (gen.eos_token_id, gen.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    assert json.loads((out / "config.json").read_text())["model_type"] == model.config.model_type
    card = ModelCard.load(out / "README.md")
    assert {r.metric_type: r.metric_value for r in card.data.eval_results} == {"loss": 3.5, "perplexity": 33.1}
    loaded_tok = AutoTokenizer.from_pretrained(out)
    assert loaded_tok.eos_token == "<|endoftext|>" and loaded_tok(SENTENCES[0]).input_ids == tok(SENTENCES[0]).input_ids


def test_card_records_the_training(tmp_path, tok):
    from huggingface_hub import ModelCard

    model = tiny("mixtral")
    curve = tmp_path / "plots" / "loss.png"
    curve.parent.mkdir()
    curve.write_bytes(b"\x89PNG\r\n\x1a\n stand-in image bytes")
    out = export_from_model(model, tmp_path / "out", tokenizer=tok, card=card_writer({**FULL_CARD, "loss_curve": str(curve)}))
    card = ModelCard.load(out / "README.md")
    assert {"hf_asyncpp", "pipeline-parallel", "pretraining", "2bw", "muon"} <= set(card.data.tags)
    assert card.data.datasets == ["user/sotu"] and set(card.data.metrics) == {"loss", "perplexity"}
    assert card.data.model_name == "user/tiny-2bw" and card.data.eval_results[0].dataset_type == "user/sotu"
    n = sum(p.numel() for p in model.parameters())
    for text in ("`mixtral`", f"{n:,}", "4 experts (2 per token)", "| Pipeline stages | 2 |", "| Microbatches per step | 4 of 2 sequences |",
                 "`error_feedback`", "| Peak learning rate | 0.02 |", "| Optimizer steps | 10 |", "| Tokens seen | 1,234 |",
                 "| Sequence length | 64 |", "State of the Union addresses", "| Loss (mean NLL per token) | 3.5000 |",
                 "| Perplexity | 33.10 |", "![loss curve](loss.png)", 'AutoModelForCausalLM.from_pretrained("user/tiny-2bw")'):
        assert text in card.text, text
    assert (out / "loss.png").read_bytes() == curve.read_bytes()


def test_card_leaves_out_missing_fields(tmp_path, caplog):
    from huggingface_hub import ModelCard

    model = tiny("llama_untied")
    text = render_model_card({}, model, load_path="some/dir").text
    assert "Not evaluated." in text and "Not recorded." in text and "None" not in text and "\"./dir\"" in text  # the folder by its relative name, no local path
    with caplog.at_level(logging.WARNING, logger="hf_asyncpp.export"):
        out = export_from_model(model, tmp_path / "out", card=card_writer({"perplexity": 12.5, "steps": None, "stpes": 3}))
    assert "stpes" in caplog.text
    card = ModelCard.load(out / "README.md")
    assert [(r.metric_type, r.metric_value) for r in card.data.eval_results] == [("perplexity", 12.5)]
    assert "| Perplexity | 12.50 |" in card.text and "Loss (mean NLL" not in card.text and "Optimizer steps" not in card.text


def test_missing_and_unexpected_keys_are_named(tmp_path):
    model = tiny("llama_untied")
    sd = dict(model.state_dict())
    sd.pop("model.layers.1.mlp.down_proj.weight")
    with pytest.raises(StateDictMismatchError, match=r"missing \['model.layers.1.mlp.down_proj.weight'\], unexpected \[\]"):
        export_hf_model(sd, model.config, tmp_path / "x")
    sd = {**model.state_dict(), "model.layers.7.extra": torch.zeros(2)}
    with pytest.raises(StateDictMismatchError, match=r"missing \[\], unexpected \['model.layers.7.extra'\]"):
        export_hf_model(sd, model.config, tmp_path / "x")
    tied = tiny("llama")  # a tied head may be absent, but must equal the embedding when given
    sd = {**tied.state_dict(), "lm_head.weight": tied.lm_head.weight.detach() + 1}
    with pytest.raises(ValueError, match="lm_head.weight is tied to model.embed_tokens.weight"):
        export_hf_model(sd, tied.config, tmp_path / "x")
    assert list(tmp_path.iterdir()) == []


def test_existing_export_is_replaced_only_on_success(tmp_path, tok):
    from transformers import AutoModelForCausalLM

    first, second = tiny("llama", seed=0), tiny("llama", seed=1)
    out = export_from_model(first, tmp_path / "out", tokenizer=tok)
    broken = dict(second.state_dict())
    broken.pop("model.norm.weight")
    with pytest.raises(StateDictMismatchError):
        export_hf_model(broken, second.config, out)
    ids = torch.randint(0, 320, (1, 12))
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(out), ids), logits(first, ids), rtol=1e-6, atol=1e-6)
    export_from_model(second, out, tokenizer=tok)
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(out), ids), logits(second, ids), rtol=1e-6, atol=1e-6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(ValueError, match="refusing to replace"):
        export_from_model(second, tmp_path / "notes")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="the tokenizer has .* tokens but the model's vocab_size is 64"):
        export_from_model(tiny("llama", vocab_size=64), tmp_path / "small", tokenizer=tok)


def test_load_checkpoint_state_merges_stage_files(tmp_path):
    from safetensors.torch import save_file

    model = tiny("llama_untied")
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    keys = sorted(sd)
    save_file({k: sd[k] for k in keys[: len(keys) // 2]}, str(tmp_path / "stage-00.safetensors"))
    save_file({k: sd[k] for k in keys[len(keys) // 2 :]} | {"model.embed_tokens.weight": sd["model.embed_tokens.weight"]},
              str(tmp_path / "stage-01.safetensors"))
    save_file({"model.norm.weight": torch.zeros(32)}, str(tmp_path / "stage-01-versions.safetensors"))  # 2BW's old version
    model.config.to_json_file(str(tmp_path / "config.json"))
    state, config, tok = load_checkpoint_state(tmp_path, unverified=True)  # hand-made: no manifest
    assert tok is None and config.model_type == "llama" and set(state) == set(sd)
    assert all(torch.equal(state[k], sd[k]) for k in sd)
    save_file({"model.embed_tokens.weight": sd["model.embed_tokens.weight"] + 1}, str(tmp_path / "stage-02.safetensors"))
    with pytest.raises(ValueError, match="model.embed_tokens.weight differs between stage-01.safetensors and stage-02"):
        load_checkpoint_state(tmp_path, unverified=True)


def test_scripts_export_and_evaluate(tmp_path, tok):
    from huggingface_hub import ModelCard
    from safetensors.torch import save_file

    from hf_asyncpp.config.recipe import recipe_from_dict, save_recipe
    from hf_asyncpp.config.sections import DataConfig
    from hf_asyncpp.data.stream import eval_blocks
    from hf_asyncpp.eval.perplexity import evaluate_model_dir
    from hf_asyncpp.partition import partition_model

    model = tiny("llama_untied", vocab_size=len(tok))
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoint-0000010"
    ckpt.mkdir(parents=True)
    for s, stage in enumerate(partition_model(model, 2)):
        save_file({k: v.contiguous() for k, v in stage.state_dict().items()}, str(ckpt / f"stage-{s:02d}.safetensors"))
    model.config.to_json_file(str(ckpt / "config.json"))
    tok.save_pretrained(str(ckpt / "tokenizer"))
    save_recipe(recipe_from_dict({"model": {"config": {"model_type": "llama"}},
                                  "pipeline": {"schedule": "1f1b", "num_stages": 2, "num_microbatches": 4},
                                  "optimizer": {"name": "muon", "learning_rate": 0.02}, "data": {"seq_len": 16}}),
                ckpt / "recipe.yaml")
    (ckpt / "run_state.json").write_text(json.dumps({"step": 10, "tokens": 2560}))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in (
        {"step": 0, "eval_loss": 5.8, "eval_perplexity": 330.3}, {"step": 5, "loss": 5.0}, {"step": 10, "eval_loss": 4.5, "eval_perplexity": 90.0},
        {"step": 20, "eval_loss": 4.0, "eval_perplexity": 54.6})))  # written after this checkpoint: not its result

    env = {"HF_EVALUATE_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    run = lambda *a: subprocess.run([sys.executable, *a], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    r = run("scripts/export.py", str(ckpt), str(tmp_path / "hf"), "--unverified")  # hand-made: no manifest
    assert r.returncode == 0, r.stderr
    card = ModelCard.load(tmp_path / "hf" / "README.md")
    assert {"1f1b", "muon"} <= set(card.data.tags) and "| Optimizer steps | 10 |" in card.text
    assert {r.metric_type: r.metric_value for r in card.data.eval_results} == {"loss": 4.5, "perplexity": 90.0}

    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"text": s * 3}) + "\n" for s in SENTENCES[:5]))
    r = run("scripts/eval_models.py", str(tmp_path / "hf"), "--data", str(data), "--seq-len", "16", "--max-blocks", "4",
            "--out", str(tmp_path / "ppl"), "--no-card")
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "ppl" / "eval_results.json").read_text())
    assert res["blocks"] == 4 and res["num_tokens"] == 4 * 15 and math.isclose(res["eval_perplexity"], math.exp(res["eval_loss"]))
    cfg = DataConfig(seq_len=16, shuffle_buffer=0, min_document_tokens=0)  # the blocks the script scores, in process
    direct = evaluate_model_dir(tmp_path / "hf", eval_blocks(cfg, tok, [str(data)], 4))
    assert math.isclose(res["eval_loss"], direct["eval_loss"], rel_tol=1e-9)

    r = run("scripts/export.py", str(tmp_path / "nowhere"), str(tmp_path / "hf2"))
    assert r.returncode != 0 and "nowhere: no such folder; no complete checkpoint in" in r.stderr and not (tmp_path / "hf2").exists()


def test_buffers_unknown_to_init_weights_are_rebuilt_or_named():
    """A non-persistent buffer the model's _init_weights does not set is rebuilt from the config, else an error."""
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

    class ScalerConfig(PretrainedConfig):
        model_type = "hf_asyncpp_test_scaler"

        def __init__(self, vocab_size=16, scale=3.0, fixed=False, **kw):
            self.vocab_size, self.scale, self.fixed = vocab_size, scale, fixed
            super().__init__(**kw)

    class Scaler(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.register_buffer("scale", torch.tensor(config.scale), persistent=False)

    class Fixed(torch.nn.Module):  # not built from a config: cannot be rebuilt
        def __init__(self, n):
            super().__init__()
            self.register_buffer("offset", torch.arange(n, dtype=torch.long), persistent=False)

    class ScalerModel(PreTrainedModel):
        config_class = ScalerConfig

        def __init__(self, config):
            super().__init__(config)
            self.embed = torch.nn.Embedding(config.vocab_size, 8)
            self.scaler = Scaler(config)
            self.fixed = Fixed(4) if config.fixed else None
            self.post_init()

    AutoConfig.register(ScalerConfig.model_type, ScalerConfig, exist_ok=True)
    AutoModelForCausalLM.register(ScalerConfig, ScalerModel, exist_ok=True)
    from hf_asyncpp.model.export import assemble_model

    cfg = ScalerConfig(scale=2.5)
    sd = {"embed.weight": torch.randn(16, 8)}
    model = assemble_model(sd, cfg)
    assert model.scaler.scale.item() == 2.5
    assert torch.equal(model.embed.weight, sd["embed.weight"])
    with pytest.raises(RuntimeError, match=r"non-persistent buffer fixed.offset \(Fixed\)"):
        assemble_model(sd, ScalerConfig(fixed=True))


def test_the_card_of_a_run_continued_from_weights(tmp_path):
    """A local ``model.name_or_path`` is named in the text by its folder name and is not ``base_model`` (Hub
    metadata: the Hub would link a local path as a model id); a Hub id is both. The model is named by the run's
    folder, never by an absolute path."""
    from hf_asyncpp.config.recipe import recipe_from_dict
    from hf_asyncpp.run.model_card import card_from_recipe

    local = tmp_path / "my-base"
    local.mkdir()
    model = tiny("llama_untied")
    for source, base in ((str(local), None), ("someone/base-model", "someone/base-model")):
        card = card_from_recipe(recipe_from_dict({"model": {"name_or_path": source}}), 10, 1000, [])
        rendered = render_model_card(card, model, load_path=str(tmp_path / "runs" / "mine" / "export"))
        assert rendered.data.base_model == base and rendered.data.model_name == "mine"
        assert f"continued from `{'my-base' if base is None else base}`" in rendered.text
        assert "from scratch" not in rendered.text and str(tmp_path) not in rendered.text
        assert 'from_pretrained("./export")' in rendered.text
    scratch = render_model_card(card_from_recipe(recipe_from_dict({"model": {"config": {"model_type": "llama"}}}), 10, 1000, []), model, load_path=str(local))
    assert "pretrained from scratch" in scratch.text and scratch.data.base_model is None
