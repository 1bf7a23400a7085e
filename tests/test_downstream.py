"""Zero-shot multiple-choice scoring against direct computations; a model trained on the answers beats chance."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_asyncpp.downstream import (choice_logliks, evaluate_models, load_items, plot_results, results_table, score_task)

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "tests" / "fixtures" / "tasks"
FILES = {t: str(TASKS / f"{t}.jsonl") for t in ("arc_easy", "mmlu", "piqa", "hellaswag")}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Two exported models: one trained on the fixtures' correct answers, one untrained."""
    from hf_asyncpp.config import ModelConfig
    from hf_asyncpp.export import export_hf_model
    from hf_asyncpp.tokenizer import train_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("models")
    texts = []
    for t, f in FILES.items():
        for ctx, choices, label in load_items(t, f):
            texts.append(ctx + choices[label])
    corpus = root / "answers.txt"
    corpus.write_text("\n".join(texts * 3) + "\n")
    tok = train_tokenizer([str(corpus)], 300)
    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=128,
                               eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    untrained = AutoModelForCausalLM.from_config(cfg)
    trained = AutoModelForCausalLM.from_config(cfg)
    trained.load_state_dict(untrained.state_dict())
    opt = torch.optim.AdamW(trained.parameters(), lr=3e-3)
    enc = [tok(x, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for x in texts]
    for step in range(300):
        batch = [enc[(step * 8 + j) % len(enc)] for j in range(8)]
        w = max(map(len, batch))
        ids = torch.tensor([b + [tok.pad_token_id] * (w - len(b)) for b in batch])
        labels = torch.tensor([b + [-100] * (w - len(b)) for b in batch])
        trained(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    out = {}
    for name, m in (("trained", trained), ("untrained", untrained)):
        out[name] = str(export_hf_model(m.state_dict(), cfg, root / name, tokenizer=tok))
    return out


def test_choice_logliks_equal_a_direct_computation(folders):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folders["trained"]).eval()
    tok = AutoTokenizer.from_pretrained(folders["trained"])
    items = load_items("arc_easy", FILES["arc_easy"], limit=3)
    got = choice_logliks(model, tok, items, batch_size=5)  # batches mix items and padding
    for (ctx, choices, _), row in zip(items, got):
        for c, score in zip(choices, row):
            ctx_ids = tok(ctx, add_special_tokens=False)["input_ids"]
            whole = tok(ctx + c, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), -1)
            direct = sum(float(logp[i - 1, whole[i]]) for i in range(len(ctx_ids), len(whole)))
            assert score == pytest.approx(direct, abs=1e-4)


def test_accuracy_equals_the_predictions_and_training_beats_chance(folders):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folders["trained"])
    tok = AutoTokenizer.from_pretrained(folders["trained"])
    for task, f in FILES.items():
        items = load_items(task, f)
        res = score_task(model, tok, items)
        ll = choice_logliks(model, tok, items)
        by_hand = sum(int(max(range(len(s)), key=s.__getitem__) == lab) for s, (_, _, lab) in zip(ll, items)) / len(items)
        assert res["acc"] == pytest.approx(by_hand)
        # MMLU answers with a letter after the listed options: harder to memorize for a 2-layer model
        assert res["acc_norm"] > res["chance"] + (0.1 if task == "mmlu" else 0.25), (task, res)


def test_two_models_side_by_side_with_chart_and_cards(folders, tmp_path):
    from huggingface_hub import ModelCard

    dirs = [folders["trained"], folders["untrained"]]
    res = evaluate_models(dirs, ["arc_easy", "piqa"], task_files=FILES, limit=8)
    table = results_table(res)
    assert "| arc_easy | acc |" in table and "trained" in table and "untrained" in table
    png = plot_results(res, tmp_path / "chart.png")
    assert Path(png).stat().st_size > 1000
    r = subprocess.run([sys.executable, "scripts/eval_models.py", *dirs, "--tasks", "arc_easy,mmlu", "--task-file",
                        f"arc_easy={FILES['arc_easy']}", "--task-file", f"mmlu={FILES['mmlu']}", "--out", str(tmp_path / "r.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                                                                                   "HF_EVALUATE_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "r.png").exists()
    card = ModelCard.load(Path(dirs[0]) / "README.md")
    assert any(e.dataset_name == "mmlu" and e.metric_type == "acc_norm" for e in card.data.eval_results)


def test_bad_inputs(tmp_path, folders):
    with pytest.raises(ValueError, match=r"unknown task 'boolq'; known tasks: arc_challenge, arc_easy, hellaswag, mmlu, piqa, perplexity"):
        load_items("boolq")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "ok?", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "A"}\n{"question": "no choices"}\n')
    with pytest.raises(ValueError, match=r"record 1 is not a arc_easy record .*missing \['choices', 'answerKey'\]"):
        load_items("arc_easy", str(bad))
    empty = tmp_path / "model"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"no tokenizer_config.json; the tokenizer is missing"):
        evaluate_models([str(empty)], ["arc_easy"], task_files=FILES)


def test_trainer_runs_the_recipe_tasks_on_its_export(tmp_path):
    import json

    from hf_asyncpp.config import recipe_from_dict
    from hf_asyncpp.trainer import train
    from test_trainer import tiny

    out = tmp_path / "run"
    train(recipe_from_dict(tiny(out, training__export=True, training__max_steps=2,
                                eval__tasks=["arc_easy", "perplexity"], eval__task_files={"arc_easy": FILES["arc_easy"]})))
    final = json.loads((out / "final_eval.json").read_text())
    assert set(final["downstream"]) == {"arc_easy", "perplexity"} and final["downstream"]["arc_easy"]["n"] == 12
