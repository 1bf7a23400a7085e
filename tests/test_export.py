"""Export round trip: from_pretrained of the exported folder gives the trained model's logits."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_asyncpp.config import ModelConfig
from hf_asyncpp.export import export_hf_model, load_checkpoint_state
from hf_asyncpp.tokenizer import load_or_train_tokenizer
from test_partition import make_model

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "sotu_slice.jsonl"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_or_train_tokenizer(ModelConfig(config={"model_type": "llama"}, vocab_size=300), [str(FIXTURE)], "text",
                                   tmp_path_factory.mktemp("tok") / "tokenizer")


@pytest.mark.parametrize("arch", ["llama", "llama_untied", "qwen3_moe", "mixtral", "gpt2"])
def test_round_trip(arch, tmp_path, tok):
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_asyncpp.partition import merge_state_dicts, partition_model

    model = make_model(arch).eval()
    with torch.no_grad():  # perturb so a silently re-initialized tensor would show
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    stages = partition_model(model, 2)
    sd = merge_state_dicts([s.state_dict() for s in stages])
    card = {"schedule": "2bw", "num_stages": 2, "optimizer": "muon", "delay_correction": "error_feedback", "steps": 10,
            "tokens": 1234, "eval_loss": 3.5, "perplexity": 33.1, "data_description": "test corpus"}
    out = export_hf_model(sd, model.config, tmp_path / "out", tokenizer=tok, card=card, max_shard_size="200KB")
    for f in ("config.json", "generation_config.json", "README.md", "tokenizer.json"):
        assert (out / f).exists(), f
    if sum(p.numel() for p in model.parameters()) * 4 > 200_000:
        assert (out / "model.safetensors.index.json").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=1e-6, atol=1e-6)
    loaded = ModelCard.load(out / "README.md")
    assert "2bw" in loaded.data.tags and loaded.data.eval_results[0].metric_value == pytest.approx(33.1)
    assert AutoTokenizer.from_pretrained(out).eos_token == "<|endoftext|>"
    json.loads((out / "generation_config.json").read_text())


def test_missing_keys_are_named(tmp_path):
    model = make_model("llama_untied")
    sd = dict(model.state_dict())
    sd.pop("model.layers.1.mlp.down_proj.weight")
    with pytest.raises(KeyError, match=r"missing \['model.layers.1.mlp.down_proj.weight'\]"):
        export_hf_model(sd, model.config, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_scripts_export_and_evaluate(tmp_path, tok):
    from safetensors.torch import save_file

    from hf_asyncpp.partition import partition_model

    from transformers import AutoModelForCausalLM

    from test_partition import make_config

    cfg = make_config("llama_untied")
    cfg.vocab_size = len(tok)  # the tokenizer's vocabulary, as the trainer reconciles it
    model = AutoModelForCausalLM.from_config(cfg)
    ckpt = tmp_path / "checkpoint-0000010"
    ckpt.mkdir()
    for s, stage in enumerate(partition_model(model, 2)):
        save_file({k: v.contiguous() for k, v in stage.state_dict().items()}, str(ckpt / f"stage-{s:02d}.safetensors"))
    model.config.to_json_file(str(ckpt / "config.json"))
    tok.save_pretrained(str(ckpt / "tokenizer"))
    state, config, t = load_checkpoint_state(ckpt)
    assert set(state) == set(model.state_dict()) and t is not None
    env = {"HF_EVALUATE_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    run = lambda *a: subprocess.run([sys.executable, *a], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    r = run("scripts/export.py", str(ckpt), str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"text": "Peace and liberty for all the people of the Union. " * 8}) + "\n" for _ in range(4)))
    r = run("scripts/evaluate.py", str(tmp_path / "hf"), "--data", str(data), "--seq-len", "16", "--max-blocks", "4",
            "--out", str(tmp_path / "ppl.json"))
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "ppl.json").read_text())
    assert res["eval_ppl"] > 1 and res["blocks"] == 4
