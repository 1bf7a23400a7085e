"""Zero-shot tasks by lm-evaluation-harness on exported models, in training and from the command line: side by side,
the card, the errors, the devices; a model trained on the answers beats chance. The pipeline's scorer against
lm-eval's HFLM is tests/test_lm_eval_parity.py."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_asyncpp.eval.downstream import evaluate_models, model_names, plot_results, results_table
from hf_asyncpp.eval.lm_eval import hf_lm, load_tasks, score

from support import TASK_FILES as FILES, record_errors
from hf_asyncpp.storage.names import checkpoint_name

ROOT = Path(__file__).resolve().parent.parent


def test_lm_eval_scores_of_a_model_trained_on_the_answers_beat_chance(folders):
    """lm-eval on the fixtures (all five tasks, local copies read through task YAMLs that include lm-eval's own),
    each task's accuracy its per-document mean, well above the uniform guess."""
    res, raw = score(hf_lm(folders["trained"], device="cpu"), load_tasks(list(FILES), FILES), log_samples=True)
    for task, r in res.items():
        docs = [d for name, ds in raw["samples"].items() if name.endswith(task) or task in name for d in ds]
        assert r["n"] == len(docs) and r["acc"] == pytest.approx(sum(d["acc"] for d in docs) / len(docs))
        assert r["num_fewshot"] == 0 and r["scorer"] == "lm-eval 0.4.13" and r["dataset"]["path"] == "json"
        # MMLU answers with a letter after the listed options: harder to memorize for a 2-layer model
        assert r.get("acc_norm", r["acc"]) > r["chance"] + (0.1 if task == "mmlu" else 0.25), (task, r)
    assert res["mmlu"]["chance"] == 0.25 and "acc_norm" not in res["mmlu"]
    assert set(res["mmlu"]["subjects"]) == {"miscellaneous", "nutrition"}


def test_two_models_side_by_side_with_chart_and_cards(folders, tmp_path):
    from huggingface_hub import ModelCard

    dirs = [folders["trained"], folders["untrained"]]
    res = evaluate_models(dirs, ["arc_easy", "piqa"], task_files=FILES, limit=8)
    table = results_table(res)
    assert "| arc_easy | acc |" in table and "trained" in table and "untrained" in table
    png = plot_results(res, tmp_path / "chart.png")
    assert Path(png).stat().st_size > 1000
    r = subprocess.run([sys.executable, "scripts/eval_models.py", *dirs, "--tasks", "arc_easy,mmlu", "--task-file",
                        f"arc_easy={FILES['arc_easy']}", "--task-file", f"mmlu={FILES['mmlu']}", "--out", str(tmp_path / "r"),
                        "--device", "cpu"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                                                                                   "HF_EVALUATE_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "r" / "eval_results.png").exists()
    card = ModelCard.load(tmp_path / "r" / model_names(dirs)[0] / "README.md")  # the card goes to --out, not dirs[0]
    # lm-eval reports MMLU acc only (its acc_norm divides single letters by 1, i.e. is acc)
    assert any(e.dataset_name.startswith("mmlu") and e.metric_type == "acc" for e in card.data.eval_results)
    assert not any(e.dataset_name.startswith("mmlu") and e.metric_type == "acc_norm" for e in card.data.eval_results)


def test_bad_inputs(tmp_path, folders, monkeypatch, capsys):
    from hf_asyncpp.cli.evaluate import main
    from hf_asyncpp.errors import RecipeError
    from hf_asyncpp.run.preflight import check_eval_tasks
    from hf_asyncpp.config.sections import EvalConfig

    with pytest.raises(ValueError, match=r"unknown task 'no_such_task': lm-eval 0.4.13 has no task or group"):
        load_tasks(["no_such_task"], FILES)
    empty = tmp_path / "model"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"no tokenizer_config.json; the tokenizer is missing"):
        evaluate_models([str(empty)], ["arc_easy"], task_files=FILES)
    # without lm-eval installed (the `eval` extra): one line naming the install, before a run or a scoring starts
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    with pytest.raises(RecipeError, match=r"^eval.tasks: the zero-shot tasks arc_easy are scored by "
                                          r"lm-evaluation-harness, which is not installed: pip install hf_asyncpp\[eval\]$"):
        check_eval_tasks(EvalConfig(tasks=["arc_easy", "perplexity"]))
    check_eval_tasks(EvalConfig(tasks=["perplexity"]))  # perplexity needs nothing more
    assert main([str(folders["trained"]), "--tasks", "arc_easy", "--out", str(tmp_path / "scores")]) == 1
    err = capsys.readouterr().err
    record_errors("hf-asyncpp evaluate", 1, err)
    assert err.endswith("not installed: pip install hf_asyncpp[eval]\n") and err.count("\n") == 1, err


def test_a_hub_task_out_of_reach_is_one_line_naming_the_ways_out(tmp_path, folders, monkeypatch, capsys):
    """`evaluate --tasks hellaswag` offline was 41 lines of the datasets library's traceback."""
    from hf_asyncpp.cli.evaluate import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # an empty cache: nothing downloaded before
    import datasets.config
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    assert main([str(folders["trained"]), "--tasks", "hellaswag", "--out", str(tmp_path / "scores")]) == 1
    err = capsys.readouterr().err
    record_errors("hf-asyncpp evaluate", 1, err)
    assert err.startswith("error: task hellaswag: lm-eval cannot load its data from the Hub (") and err.count("\n") == 1, err
    assert "--task-file hellaswag=FILE" in err and not (tmp_path / "scores").exists()


def test_a_hub_task_with_the_hub_unreachable_is_one_request_then_one_line(tmp_path, folders, monkeypatch, capsys):
    """Without HF_HUB_OFFLINE, each file of the task took five retries with backoff (11 lines, 30 s) before its
    line, which named neither the variable nor the cache. One request (an endpoint nothing listens on) finds the
    Hub out of reach; the cache is then read at once, and the line says so."""
    import datasets.config
    from huggingface_hub import constants

    from hf_asyncpp import offline
    from hf_asyncpp.cli.evaluate import main

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    offline.hub_unreachable.cache_clear()
    assert main([str(folders["trained"]), "--tasks", "hellaswag", "--out", str(tmp_path / "scores")]) == 1
    offline.hub_unreachable.cache_clear()
    err = capsys.readouterr().err
    record_errors("hf-asyncpp evaluate", 1, err)
    assert err == ("error: task hellaswag: its data is not in the cache and the Hub (http://127.0.0.1:9) cannot be "
                   "reached (ConnectError: [Errno 111] Connection refused); download it where the Hub is reachable (it "
                   "is then read from the cache), or give a local copy with --task-file hellaswag=FILE\n"), err
    assert not (tmp_path / "scores").exists()


def test_trainer_runs_the_recipe_tasks_on_its_export(tmp_path):
    """One process: the tasks at an evaluation point (step 1) and on the export at the end, by lm-eval; the step-1
    score equals lm-eval's HFLM on step 1's checkpointed weights."""
    from hf_asyncpp.config.recipe import recipe_from_dict
    from hf_asyncpp.run.trainer import train
    from support import tiny

    out = tmp_path / "run"
    train(recipe_from_dict(tiny(out, training__export=True, training__max_steps=2, training__eval_steps=1,
                                training__save_steps=1, eval__tasks=["arc_easy", "perplexity"],
                                eval__task_files={"arc_easy": FILES["arc_easy"]}, eval__during_training=True)))
    final = json.loads((out / "final_eval.json").read_text())
    assert set(final["downstream"]) == {"arc_easy", "perplexity"} and final["downstream"]["arc_easy"]["n"] == 12
    assert final["downstream"]["arc_easy"]["scorer"] == "lm-eval 0.4.13"
    # eval.during_training: the tasks on the newest weights at the evaluation point (step 1), in metrics.jsonl
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    during = [r for r in rows if "eval/arc_easy/acc_norm" in r]
    assert [r["step"] for r in during] == [1]
    # ... equal to lm-eval's HFLM on step 1's checkpointed weights
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_asyncpp.storage import checkpoint_io as ckpt

    model = AutoModelForCausalLM.from_pretrained(out / "export").eval()
    missing, unexpected = model.load_state_dict(ckpt.load_tensors(out / checkpoint_name(1) / "model.safetensors"),
                                                strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    step1 = score(hf_lm(model, AutoTokenizer.from_pretrained(out / "export"), device="cpu"),
                  load_tasks(["arc_easy"], FILES))[0]["arc_easy"]
    assert (during[0]["eval/arc_easy/acc"], during[0]["eval/arc_easy/acc_norm"]) == (step1["acc"], step1["acc_norm"])


def test_limit_and_one_subject_as_lm_eval_applies_them(folders):
    """``limit`` is per task, and each MMLU subject is a task (``mmlu`` with limit 2 scores 2 documents of every
    subject in the file); ``mmlu_<subject>`` reads that subject's rows of a file of several."""
    res = evaluate_models([folders["half"]], ["mmlu", "mmlu_nutrition", "piqa"], limit=2, device="cpu",
                          task_files={**FILES, "mmlu_nutrition": FILES["mmlu"]})[folders["half"]]
    assert res["mmlu"]["n"] == 4 and {s: r["n"] for s, r in res["mmlu"]["subjects"].items()} == {"miscellaneous": 2,
                                                                                              "nutrition": 2}
    assert res["mmlu_nutrition"]["n"] == 2 and res["piqa"]["n"] == 2 and res["piqa"]["limit"] == 2
    nutrition = res["mmlu"]["subjects"]["nutrition"]["acc"]
    assert res["mmlu_nutrition"]["acc"] == nutrition  # the same two documents, scored alone


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                        reason="needs a GPU"))])
def test_evaluation_runs_on_the_model_device(folders, device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_asyncpp.eval.perplexity import evaluate_perplexity, resolve_device

    assert resolve_device(None) == (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                                    else torch.device("cpu"))
    assert resolve_device("cpu") == torch.device("cpu")
    tok = AutoTokenizer.from_pretrained(folders["trained"])
    cpu = AutoModelForCausalLM.from_pretrained(folders["trained"])
    model = AutoModelForCausalLM.from_pretrained(folders["trained"]).to(device)
    blocks = torch.randint(0, len(tok), (3, 16), generator=torch.Generator().manual_seed(0))
    seen = set()
    handle = model.register_forward_pre_hook(lambda m, args, kwargs: seen.add(kwargs["input_ids"].device), with_kwargs=True)
    ppl = evaluate_perplexity(model, blocks)
    handle.remove()
    assert {d.type for d in seen} == {device}
    assert ppl["eval_perplexity"] == pytest.approx(evaluate_perplexity(cpu, blocks)["eval_perplexity"], rel=1e-3)
    lm = hf_lm(folders["trained"], device=device)
    assert lm.device.type == device
    res = evaluate_models([folders["trained"]], ["arc_easy"], task_files=FILES, limit=4, device=device)
    assert res[folders["trained"]]["arc_easy"]["n"] == 4


def test_re_evaluating_replaces_card_results(tmp_path):
    from huggingface_hub import ModelCard

    from hf_asyncpp.run.model_card import add_eval_results

    arc_data = {"path": "allenai/ai2_arc", "config": "ARC-Easy", "split": "test"}  # as lm-eval's task config names it
    first = {"arc_easy": {"acc": 0.5, "acc_norm": 0.25, "n": 200, "limit": 200, "num_fewshot": 0, "scorer": "lm-eval 0.4.12",
                          "dataset": arc_data}, "perplexity": {"eval_perplexity": 12.0, "num_tokens": 100}}
    add_eval_results(tmp_path, first)
    arc = [e for e in ModelCard.load(tmp_path / "README.md").data.eval_results if e.metric_type == "acc_norm"][0]
    assert arc.dataset_args == {"num_few_shot": 0, "limit": 200, "n": 200} and "limit 200 per task" in arc.metric_name
    add_eval_results(tmp_path, {"arc_easy": {"acc": 0.75, "acc_norm": 0.5, "n": 2376, "limit": None, "num_fewshot": 0,
                                             "scorer": "lm-eval 0.4.13", "dataset": arc_data},
                                "piqa": {"acc": 0.6, "acc_norm": 0.7, "n": 1838}})
    card = ModelCard.load(tmp_path / "README.md")
    got = {(e.dataset_name, e.metric_type): e for e in card.data.eval_results}
    assert len(card.data.eval_results) == len(got) == 5  # arc_easy x2, piqa x2, perplexity: no duplicates
    arc = got[("arc_easy", "acc_norm")]
    assert arc.metric_value == 0.5 and arc.dataset_args == {"num_few_shot": 0, "n": 2376}  # no limit
    assert arc.metric_config == "lm-eval 0.4.13" and "n=2376" in arc.metric_name and arc.dataset_split == "test"
    assert (arc.dataset_type, arc.dataset_config) == ("allenai/ai2_arc", "ARC-Easy")
    assert got[("held-out", "perplexity")].metric_value == 12.0
    assert card.text.count("## Downstream evaluation") == 1
    assert "| arc_easy | acc_norm | 0.5000 | 2376 | none | 0 | lm-eval 0.4.13 |" in card.text


def test_models_with_other_tokenizers_side_by_side_each_read_the_text_in_their_own_ids(folders, tmp_path, capsys):
    """``evaluate A B --data``: B's perplexity side by side equals B's alone (the data used to be tokenized once,
    with A's tokenizer); two folders named ``export`` get distinct columns; ``--out`` into a missing folder works;
    a perplexity-only evaluation writes no empty downstream table into the card."""
    import shutil

    from huggingface_hub import ModelCard
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_asyncpp.cli.evaluate import main
    from hf_asyncpp.model.export import export_hf_model
    from hf_asyncpp.data.tokenizer import train_tokenizer

    a = tmp_path / "runs" / "sync" / "export"
    shutil.copytree(folders["trained"], a)
    other = tmp_path / "other.txt"
    other.write_text("a different vocabulary: zebra quartz jumps over lazy dogs\n" * 50)
    tok = train_tokenizer([str(other)], 270)
    cfg = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=128,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    b = export_hf_model(AutoModelForCausalLM.from_config(cfg).state_dict(), cfg, tmp_path / "runs" / "async" / "export",
                        tokenizer=tok)
    data = FILES["arc_easy"]
    both = tmp_path / "new" / "folder" / "both"
    assert main([str(a), str(b), "--data", data, "--text-column", "question", "--out", str(both)]) == 0
    table = capsys.readouterr().out
    assert "| task | metric | sync/export | async/export |" in table
    alone = tmp_path / "alone"
    assert main([str(b), "--data", data, "--text-column", "question", "--out", str(alone), "--no-card"]) == 0
    side_by_side = json.loads((both / "eval_results.json").read_text())[str(b)]["perplexity"]["eval_perplexity"]
    assert side_by_side == json.loads((alone / "eval_results.json").read_text())["eval_perplexity"]
    card = ModelCard.load(both / "async--export" / "README.md")
    assert "Downstream evaluation" not in card.text and card.data.eval_results[0].metric_type == "perplexity"
