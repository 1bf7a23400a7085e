"""Zero-shot multiple-choice scoring against direct computations; a model trained on the answers beats chance."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_asyncpp.eval.downstream import (choice_logliks, evaluate_models, model_names, plot_results, predictions,
                                        results_table, score_task)
from hf_asyncpp.eval.tasks import Item, load_items, load_task

from support import TASK_FILES as FILES, record_errors
from hf_asyncpp.storage.names import checkpoint_name

ROOT = Path(__file__).resolve().parent.parent


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
    assert err.startswith("error: task hellaswag: 'Rowan/hellaswag' (default, validation) cannot be loaded from the "
                          "Hub (") and err.count("\n") == 1, err
    assert "--task-file hellaswag=FILE" in err and not (tmp_path / "scores").exists()


def test_trainer_runs_the_recipe_tasks_on_its_export(tmp_path):
    import json

    from hf_asyncpp.config.recipe import recipe_from_dict
    from hf_asyncpp.run.trainer import train
    from support import tiny

    out = tmp_path / "run"
    train(recipe_from_dict(tiny(out, training__export=True, training__max_steps=2, training__eval_steps=1,
                                training__save_steps=1, eval__tasks=["arc_easy", "perplexity"],
                                eval__task_files={"arc_easy": FILES["arc_easy"]}, eval__during_training=True)))
    final = json.loads((out / "final_eval.json").read_text())
    assert set(final["downstream"]) == {"arc_easy", "perplexity"} and final["downstream"]["arc_easy"]["n"] == 12
    # eval.during_training: the tasks on the newest weights at the evaluation point (step 1), in metrics.jsonl
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    during = [r for r in rows if "eval/arc_easy/acc_norm" in r]
    assert [r["step"] for r in during] == [1]
    # ... equal to scoring step 1's checkpointed weights directly
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_asyncpp.storage import checkpoint_io as ckpt

    model = AutoModelForCausalLM.from_pretrained(out / "export").eval()
    missing, unexpected = model.load_state_dict(ckpt.load_tensors(out / checkpoint_name(1) / "model.safetensors"),
                                                strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    step1 = score_task(model, AutoTokenizer.from_pretrained(out / "export"), load_items("arc_easy", FILES["arc_easy"]))
    assert (during[0]["eval/arc_easy/acc"], during[0]["eval/arc_easy/acc_norm"]) == (step1["acc"], step1["acc_norm"])


def test_acc_norm_divides_by_the_choice_without_the_delimiter():
    # a flip between the two normalizations: -8 over " abcd" (4 characters + the delimiter) against -38 over 20 characters
    items = [Item("Q:", [" abcd", " " + "x" * 20], 0)]
    assert predictions([[-8.0, -38.0]], items) == {"acc": [0], "acc_norm": [1]}  # lm-eval: -2.00 < -1.90
    assert predictions([[-8.0, -38.0]], [Item("Q:", ["abcd", "x" * 20], 0)])["acc_norm"] == [1]  # no delimiter: as is


def test_mmlu_prompt_subjects_and_limit_per_subject():
    items, subjects = load_task("mmlu", FILES["mmlu"], limit=2)
    assert subjects == ["miscellaneous", "miscellaneous", "nutrition", "nutrition"]  # lm-eval: --limit per subject
    assert items[2].context.startswith("The following are multiple choice questions (with answers) about nutrition.\n\n")
    assert items[2].context.endswith("\nA. green\nB. orange\nC. yellow\nD. purple\nAnswer:")
    assert items[2].choices == [" A", " B", " C", " D"]
    assert len(load_items("mmlu_nutrition", FILES["mmlu"])) == 6
    with pytest.raises(ValueError, match="no mmlu_anatomy records"):
        load_items("mmlu_anatomy", FILES["mmlu"])


def _devices_seen(model, fn):
    seen = set()
    handle = model.register_forward_pre_hook(lambda m, args, kwargs: seen.add(kwargs["input_ids"].device), with_kwargs=True)
    try:
        return fn(), seen
    finally:
        handle.remove()


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
    items = load_items("arc_easy", FILES["arc_easy"], limit=4)
    ll, seen = _devices_seen(model, lambda: choice_logliks(model, tok, items, batch_size=3))
    assert {d.type for d in seen} == {device}
    assert ll == [pytest.approx(row, abs=1e-3) for row in choice_logliks(cpu, tok, items)]
    blocks = torch.randint(0, len(tok), (3, 16), generator=torch.Generator().manual_seed(0))
    ppl, seen = _devices_seen(model, lambda: evaluate_perplexity(model, blocks))
    assert {d.type for d in seen} == {device}
    assert ppl["eval_ppl"] == pytest.approx(evaluate_perplexity(cpu, blocks)["eval_ppl"], rel=1e-3)
    res = evaluate_models([folders["trained"]], ["arc_easy"], task_files=FILES, limit=4, device=device)
    assert res[folders["trained"]]["arc_easy"]["n"] == 4


def test_re_evaluating_replaces_card_results(tmp_path):
    from huggingface_hub import ModelCard

    from hf_asyncpp.run.model_card import add_eval_results

    first = {"arc_easy": {"acc": 0.5, "acc_norm": 0.25, "n": 200, "limit": 200, "num_fewshot": 0, "scorer": "hf_asyncpp 0.1.0"},
             "perplexity": {"eval_ppl": 12.0, "num_tokens": 100}}
    add_eval_results(tmp_path, first)
    arc = [e for e in ModelCard.load(tmp_path / "README.md").data.eval_results if e.metric_type == "acc_norm"][0]
    assert arc.dataset_args == {"num_few_shot": 0, "limit": 200, "n": 200} and "limit 200 per task" in arc.metric_name
    add_eval_results(tmp_path, {"arc_easy": {"acc": 0.75, "acc_norm": 0.5, "n": 2376, "limit": None, "num_fewshot": 0,
                                             "scorer": "lm-eval 0.4.13"}, "piqa": {"acc": 0.6, "acc_norm": 0.7, "n": 1838}})
    card = ModelCard.load(tmp_path / "README.md")
    got = {(e.dataset_name, e.metric_type): e for e in card.data.eval_results}
    assert len(card.data.eval_results) == len(got) == 5  # arc_easy x2, piqa x2, perplexity: no duplicates
    arc = got[("arc_easy", "acc_norm")]
    assert arc.metric_value == 0.5 and arc.dataset_args == {"num_few_shot": 0, "n": 2376}  # no limit
    assert arc.metric_config == "lm-eval 0.4.13" and "n=2376" in arc.metric_name and arc.dataset_split == "test"
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
    side_by_side = json.loads((both / "eval_results.json").read_text())[str(b)]["perplexity"]["eval_ppl"]
    assert side_by_side == json.loads((alone / "eval_results.json").read_text())["eval_ppl"]
    card = ModelCard.load(both / "async--export" / "README.md")
    assert "Downstream evaluation" not in card.text and card.data.eval_results[0].metric_type == "perplexity"


def staged_scoring_worker(rank, world, folder, num_stages, task_files, limit):
    """A pipeline of ``num_stages`` stages (the rest data parallel) built from an exported folder scores the tasks
    through its stages: with its newest weights, and with the tensors each stage reads from the folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_asyncpp.config.recipe import recipe_from_dict
    from hf_asyncpp.eval.downstream import score_tasks
    from hf_asyncpp.pipeline.executor import PipelineEngine
    from hf_asyncpp.topology import Topology

    recipe = recipe_from_dict({"model": {"name_or_path": folder}, "data": {"seq_len": 32},
                               "pipeline": {"schedule": "2bw", "num_stages": num_stages, "num_microbatches": 2,
                                            "microbatch_size": 1},
                               "training": {"max_steps": 1, "report_to": []}})
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    eng = PipelineEngine(recipe, model, Topology(rank=rank, world_size=world, num_stages=num_stages), log=lambda *a: None)
    tok = AutoTokenizer.from_pretrained(folder)
    items = {t: load_task(t, f, limit) for t, f in task_files.items()}
    newest = score_tasks(eng.scorer(), tok, items, batch_size=3, limit=limit)  # batches of 3: requests split unevenly
    exported = score_tasks(eng.scorer(Path(folder)), tok, items, batch_size=3, limit=limit)
    lls = choice_logliks(eng.scorer(), tok, items["arc_easy"][0], batch_size=3)
    eng.close()
    return newest, exported, lls


def test_tasks_scored_through_the_pipeline_equal_the_whole_model(folders):
    """Downstream scoring through a pipeline (2 stages x 2 replicas; ``PipelineEngine.scorer``), each stage holding
    only its weights, gives every rank the one-device scorer's results: the same accuracies, log-likelihoods equal
    to float rounding, from the newest weights and from the export read back stage by stage."""
    from dist_utils import run_distributed
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tasks = {t: FILES[t] for t in ("arc_easy", "piqa", "mmlu")}
    whole = evaluate_models([folders["trained"]], list(tasks), task_files=tasks, limit=6, batch_size=3,
                            device="cpu")[folders["trained"]]
    model = AutoModelForCausalLM.from_pretrained(folders["trained"]).eval()
    direct = choice_logliks(model, AutoTokenizer.from_pretrained(folders["trained"]),
                            load_task("arc_easy", FILES["arc_easy"], 6)[0], batch_size=3)
    results = run_distributed(staged_scoring_worker, 4, folders["trained"], 2, tasks, 6)
    for newest, exported, lls in results:  # every rank, the first stage's included
        assert newest == exported == whole
        assert len(lls) == len(direct)
        for got, ref in zip(lls, direct):
            assert got == pytest.approx(ref, abs=1e-5)
    assert whole["arc_easy"]["acc"] > whole["arc_easy"]["chance"]
