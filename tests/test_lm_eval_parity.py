"""The pipeline's scorer against lm-evaluation-harness's own ``HFLM``, on the same model and the same documents.

lm-eval builds the five fixture tasks (hellaswag, piqa, arc_easy, arc_challenge, mmlu with its two subjects) from its
own YAMLs, the local files read through task YAMLs that include them (``eval/lm_eval.py``'s ``write_local_tasks``),
and scores them twice: with ``PipelineLM`` (``TemplateLM`` over ``StageScorer``: the requests through 2 stages x 2
replicas, each rank holding only its stage's weights, with the newest weights and with the export read back stage by
stage) and with ``HFLM`` on the exported folder. Every request's log-likelihood agrees to float rounding, every
``is_greedy`` flag and every acc / acc_norm is equal (docs/evaluation.md quotes the figures).
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from support import TASK_FILES
from hf_asyncpp.eval.lm_eval import PipelineLM, hf_lm, load_tasks, score

TASKS = list(TASK_FILES)
MODELS = ("half", "trained")  # half-trained: where acc_norm's picks are close (docs/evaluation.md)


def _answers(raw: dict) -> dict[tuple[str, int], list]:
    """{(lm-eval task, doc_id): [(logprob, is_greedy) per choice]} of a run logged with its samples."""
    return {(t, d["doc_id"]): [tuple(r[0]) for r in d["resps"]] for t, docs in raw["samples"].items() for d in docs}


def pipeline_worker(rank, world, folders, num_stages, task_files):
    """lm-eval through a pipeline of ``num_stages`` stages (the rest data parallel) built from each exported folder:
    with its newest weights, and with the tensors each stage reads from the folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_asyncpp.config.recipe import recipe_from_dict
    from hf_asyncpp.pipeline.executor import PipelineEngine
    from hf_asyncpp.topology import Topology

    taskset = load_tasks(list(task_files), task_files)  # once, scored four times
    out = {}
    for name, folder in folders.items():
        recipe = recipe_from_dict({"model": {"name_or_path": folder}, "data": {"seq_len": 32},
                                   "pipeline": {"schedule": "2bw", "num_stages": num_stages, "num_microbatches": 2,
                                                "microbatch_size": 1},
                                   "training": {"max_steps": 1, "report_to": []}})
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        eng = PipelineEngine(recipe, model, Topology(rank=rank, world_size=world, num_stages=num_stages),
                             log=lambda *a: None)
        tok = AutoTokenizer.from_pretrained(folder)
        runs = {}
        for weights, scorer in (("newest", eng.scorer()), ("export", eng.scorer(Path(folder)))):
            # 220 requests in batches of 16: 14 batches, the last one short, split unevenly over the two replicas
            res, raw = score(PipelineLM(scorer, tok, batch_size=16, quiet=rank != 0), taskset, log_samples=True)
            runs[weights] = (res, _answers(raw))
        eng.close()
        out[name] = runs
    return out


@pytest.fixture(scope="module")
def hflm_runs(folders):
    taskset = load_tasks(TASKS, TASK_FILES)
    out = {}
    for name in MODELS:
        res, raw = score(hf_lm(folders[name], device="cpu", batch_size=16), taskset, log_samples=True)
        out[name] = (res, _answers(raw))
    return out


def test_pipeline_lm_equals_hflm_request_by_request(folders, hflm_runs):
    from dist_utils import run_distributed

    results = run_distributed(pipeline_worker, 4, {m: folders[m] for m in MODELS}, 2, TASK_FILES)
    worst = 0.0
    for rank_result in results:  # every rank, the first stage's included, gets every answer
        for name in MODELS:
            theirs, their_answers = hflm_runs[name]
            for weights in ("newest", "export"):
                ours, our_answers = rank_result[name][weights]
                assert our_answers.keys() == their_answers.keys()
                for key, answers in their_answers.items():
                    got = our_answers[key]
                    assert [g for _, g in got] == [g for _, g in answers], (name, weights, key)  # is_greedy
                    for (a, _), (b, _) in zip(got, answers):
                        worst = max(worst, abs(a - b))
                for task in TASKS:
                    for field in ("acc", "acc_norm", "n", "num_fewshot", "subjects", "chance"):
                        assert ours[task].get(field) == theirs[task].get(field), (name, weights, task, field)
    assert worst < 1e-4, worst
    n_docs = len({key for key in hflm_runs["half"][1]})
    print(f"\nPipelineLM vs HFLM: {len(TASKS)} tasks, {n_docs} documents, {len(MODELS)} models, "
          f"worst |log-likelihood difference| {worst:.2e}; acc and acc_norm equal")
    for name in MODELS:
        for task in TASKS:
            r = hflm_runs[name][0][task]
            print(f"| {name} | {task} | {r['n']} | {r['acc']:.4f} | {r.get('acc_norm', float('nan')):.4f} |")


def test_pipeline_lm_scores_log_likelihoods_only(folders):
    from transformers import AutoConfig, AutoTokenizer

    lm = PipelineLM(SimpleNamespace(config=AutoConfig.from_pretrained(folders["half"])),
                    AutoTokenizer.from_pretrained(folders["half"]))
    assert lm.max_length == hf_lm(folders["half"], device="cpu").max_length == 128
    with pytest.raises(NotImplementedError, match="for perplexity use the held-out evaluation"):
        lm.loglikelihood_rolling([])
    with pytest.raises(NotImplementedError, match="score generative tasks on the exported folder with lm-eval's HFLM"):
        lm.generate_until([])
