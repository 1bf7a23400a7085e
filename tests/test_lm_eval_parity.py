"""Our scorer against lm-evaluation-harness itself, on the same model and the same documents.

lm-eval reads the fixtures through task YAMLs that include its own official task definitions and only point the
dataset at the local file (``eval/lm_eval.py``'s ``write_local_tasks``). For hellaswag, piqa, arc_easy, arc_challenge and
mmlu (overall and per subject): the rendered (context, continuation) pairs are lm-eval's, the per-document log-
likelihoods agree, and acc / acc_norm are equal exactly, with and without a limit.
"""
from __future__ import annotations

import pytest

from support import TASK_FILES
from hf_asyncpp.eval.downstream import choice_logliks, evaluate_models, predictions
from hf_asyncpp.eval.lm_eval import LOCAL_PREFIX, evaluate_with_lm_eval
from hf_asyncpp.eval.tasks import load_task

TASKS = ["hellaswag", "piqa", "arc_easy", "arc_challenge", "mmlu"]
MODELS = ["half"]  # half-trained: where acc_norm with and without the delimiter pick differently (docs/evaluation.md)


@pytest.fixture(scope="module")
def lm_eval_runs(folders):
    return {name: evaluate_with_lm_eval(folders[name], TASKS, task_files=TASK_FILES, device="cpu", batch_size=16,
                                        log_samples=True) for name in MODELS}


def _lm_eval_docs(raw: dict, task: str, subjects: list) -> list[dict]:
    """lm-eval's logged samples of a task in our item order (MMLU: one lm-eval task per subject, file order)."""
    if task != "mmlu":
        return sorted(raw["samples"][LOCAL_PREFIX + task], key=lambda d: d["doc_id"])
    by_subject = {s: sorted(raw["samples"][f"{LOCAL_PREFIX}mmlu_{s}"], key=lambda d: d["doc_id"]) for s in set(subjects)}
    seen = {s: 0 for s in by_subject}
    docs = []
    for s in subjects:
        docs.append(by_subject[s][seen[s]])
        seen[s] += 1
    return docs


@pytest.mark.parametrize("name", MODELS)
def test_prompts_logliks_and_scores_equal_lm_eval(folders, lm_eval_runs, name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folders[name])
    tok = AutoTokenizer.from_pretrained(folders[name])
    ours_all = evaluate_models([folders[name]], TASKS, task_files=TASK_FILES, device="cpu")[folders[name]]
    theirs_all, raw = lm_eval_runs[name]
    for task in TASKS:
        items, subjects = load_task(task, TASK_FILES[task])
        docs = _lm_eval_docs(raw, task, subjects)
        assert len(docs) == len(items), task
        ll = choice_logliks(model, tok, items)
        preds = predictions(ll, items)
        for k, (item, doc) in enumerate(zip(items, docs)):
            # the exact strings lm-eval scored: (context, target delimiter + choice) per choice
            assert [tuple(a) for a in doc["arguments"]] == [(item.context, c) for c in item.choices], (task, k)
            theirs_ll = [float(r[0][0]) for r in doc["resps"]]
            assert ll[k] == pytest.approx(theirs_ll, abs=2e-4), (task, k)
            assert float(preds["acc"][k] == item.label) == doc["acc"], (task, k)
            if "acc_norm" in doc:
                assert float(preds["acc_norm"][k] == item.label) == doc["acc_norm"], (task, k)
        ours, theirs = ours_all[task], theirs_all[task]
        assert {m for m in ("acc", "acc_norm") if m in ours} == {m for m in ("acc", "acc_norm") if m in theirs}, task
        for m in ("acc", "acc_norm"):
            if m in ours:
                assert ours[m] == theirs[m], (task, m, ours[m], theirs[m])
        assert ours["n"] == theirs["n"] and ours["num_fewshot"] == theirs["num_fewshot"] == 0
        if task == "mmlu":
            assert set(ours["subjects"]) == set(theirs["subjects"]) == {"miscellaneous", "nutrition"}
            for s in ours["subjects"]:
                assert ours["subjects"][s] == theirs["subjects"][s], s
    assert theirs_all["mmlu"]["scorer"].startswith("lm-eval ") and ours_all["mmlu"]["scorer"].startswith("hf_asyncpp ")


def test_limit_and_one_subject_as_lm_eval_applies_them(folders):
    kw = dict(task_files={**TASK_FILES, "mmlu_nutrition": TASK_FILES["mmlu"]}, limit=2, device="cpu")
    tasks = ["mmlu", "mmlu_nutrition", "piqa"]
    ours = evaluate_models([folders["half"]], tasks, **kw)[folders["half"]]
    theirs = evaluate_models([folders["half"]], tasks, backend="lm_eval", **kw)[folders["half"]]
    assert ours["mmlu"]["n"] == theirs["mmlu"]["n"] == 4  # 2 per subject, not the first 2 rows of the file
    assert {s: r["n"] for s, r in ours["mmlu"]["subjects"].items()} == {"miscellaneous": 2, "nutrition": 2}
    assert ours["mmlu_nutrition"]["n"] == theirs["mmlu_nutrition"]["n"] == 2 and ours["piqa"]["n"] == 2
    for t in tasks:
        for m in ("acc", "acc_norm"):
            assert ours[t].get(m) == theirs[t].get(m), (t, m)
        assert theirs[t]["limit"] == ours[t]["limit"] == 2
