"""The compiled program (``training.torch_compile``, on by default on a GPU) through the real ``PipelineEngine``.

On CPU the backend is ``aot_eager``: Dynamo's graphs and AOTAutograd's forward/backward split exactly as on a GPU,
the kernels run eagerly, so the numbers must be the eager run's. What is checked, per stage, with Dynamo's own
counters (``model.build.compile_counts``):

- the same weights are held per version in bf16 with and without compile (the discovery forward runs eagerly: a
  compiled layer shows autograd no casts);
- a stage compiles at most 2 graphs at its first step (its first layer, and one its other layers share) and at most 2
  more at its first evaluation (no grad), dense and mixture-of-experts alike (the router capture adds no guard per
  layer), then none: no graph break, no recompile, no frame left to run eagerly at the recompile limit;
- compiled runs give the eager runs' losses, norms and weights bit for bit (2BW with Muon + EF, an MoE with its
  router aux loss, activation checkpointing, the output layer shared by the stages).
"""
from __future__ import annotations

import copy
import json
import logging

import torch
from torch._dynamo.utils import counters

from dist_utils import run_distributed
from hf_asyncpp.model.build import compile_counts
from hf_asyncpp.run.reporting import RunLog
from support import LLAMA, MIXTRAL, SEQ, build, make_batches, make_recipe

# 3 layers a stage: its first layer, and two that must share one graph (a guard per layer index would split them)
RUNS = {"dense 2bw muon+ef": ({**LLAMA, "num_hidden_layers": 6}, "2bw", 2, 2, 2, "muon", True, False),
        "moe 2bw aux": ({**MIXTRAL, "num_hidden_layers": 6}, "2bw", 2, 2, 2, "adamw", False, False),
        "moe 1f1b aux checkpointed": ({**MIXTRAL, "num_hidden_layers": 6}, "1f1b", 2, 2, 2, "muon", False, True),
        "moe 2bw aux vocab shared": ({**MIXTRAL, "num_hidden_layers": 6}, "2bw", 2, 2, 2, "muon", True, False)}
VOCAB_SHARED = {"moe 2bw aux vocab shared"}
"""Runs with the output layer cut over the stages (``pipeline.vocab_parallel``): the VOCAB passes run eagerly beside
the compiled layers, and the last stage's compiled layers end at the final norm."""


def _variant(recipe, compiled: bool, checkpointing: bool = False):
    recipe = copy.deepcopy(recipe)
    recipe.training.bf16 = True
    recipe.training.torch_compile, recipe.training.torch_compile_backend = compiled, "aot_eager"
    recipe.training.gradient_checkpointing = checkpointing
    return recipe


def worker(rank, world, jobs, tmp):
    """Each job (recipe, 4 batches, eval blocks or None, resume_at): the step results, evaluations, merged weights,
    the names held in bf16 and the compile counts after step 1, after the first evaluation, and after 3 more steps
    and an evaluation (without blocks: the same steps, no evaluation; with ``resume_at``: saved after that step, the
    rest trained by a new engine that loaded the checkpoint)."""
    from pathlib import Path

    from hf_asyncpp.pipeline.executor import PipelineEngine
    from hf_asyncpp.topology import Topology

    out = []
    for j, (recipe, batches, blocks, resume_at) in enumerate(jobs):
        torch._dynamo.reset()  # each job's layers are new modules: nothing compiled for an earlier job is reused
        counters.clear()
        topo = Topology(rank=rank, world_size=world, num_stages=recipe.pipeline.num_stages)
        eng = PipelineEngine(recipe, build(recipe), topo, log=lambda *a: None)
        counts, nll = [compile_counts()], []
        res = eng.train_steps(batches[:1], 0)
        counts.append(compile_counts())
        if blocks is not None:
            nll.append(eng.eval_nll(blocks, 2))
        counts.append(compile_counts())
        if resume_at:
            res += eng.train_steps(batches[1:resume_at], 1)
            folder = Path(tmp) / f"job{j}"
            folder.mkdir(exist_ok=True)
            eng.save(folder)
            eng.close()
            eng = PipelineEngine(recipe, build(recipe), topo, log=lambda *a: None)
            eng.load(folder)
            res += eng.train_steps(batches[resume_at:], resume_at)
        else:
            res += eng.train_steps(batches[1:], 1)
        if blocks is not None:
            nll.append(eng.eval_nll(blocks, 2))
        counts.append(compile_counts())
        cast = sorted(eng.versions.cast or ())
        out.append((res, nll, eng.full_state_dict(), cast, counts))
        eng.close()
    return out


def _identical(a, b, name):
    key = lambda res: [(r.loss, r.grad_norm, r.lr, r.applied) for r in res]
    assert key(a[0]) == key(b[0]), name
    assert a[1] == b[1], name  # the evaluations' summed NLL and token counts
    assert (a[2] is None) == (b[2] is None), name  # the merged weights: on the main process
    assert a[2] is None or a[2].keys() == b[2].keys(), name
    for k in a[2] or ():
        assert torch.equal(a[2][k], b[2][k]), f"{name}: {k}"


def test_compiled_stages_compile_few_graphs_and_train_as_eager(tmp_path):
    blocks = torch.randint(0, 128, (4, SEQ), generator=torch.Generator().manual_seed(7))
    jobs = []
    for i, (name, (*spec, ckpt)) in enumerate(RUNS.items()):
        rec = make_recipe(*spec, vocab=name in VOCAB_SHARED)
        batches = make_batches(4, spec[3], spec[4], seed=600 + i)
        jobs += [(_variant(rec, False, ckpt), batches, blocks, 0), (_variant(rec, True, ckpt), batches, blocks, 0)]
    # the dense run again without its evaluations: an evaluation reads the newest version's bf16 copies first (under
    # no grad), and the training steps after it must still send their gradients to the weights; and compiled, saved
    # after step 2 and resumed by a new engine
    dense, dense_batches = jobs[0][0], jobs[0][1]
    jobs += [(dense, dense_batches, None, 0), (jobs[1][0], dense_batches, None, 2)]
    per_rank = run_distributed(worker, 2, jobs, str(tmp_path))
    for stage, results in enumerate(per_rank):
        for j, name in enumerate(RUNS):
            eager, compiled = results[2 * j], results[2 * j + 1]
            where = f"{name}, stage {stage}"
            # the same weights held in bf16 per version (the linear weights; the MoE's expert stacks too)
            assert compiled[3] == eager[3] and eager[3], (where, eager[3], compiled[3])
            if name.startswith("moe"):
                assert any(n.endswith("experts.gate_up_proj") for n in eager[3]), where
            assert eager[4][-1]["graphs"] == 0, where  # the eager run compiled nothing
            start, step1, eval1, end = compiled[4]
            assert start["graphs"] == 0, (where, start)  # building the engine compiles nothing
            assert 1 <= step1["graphs"] <= 2, (where, step1)
            assert eval1["graphs"] - step1["graphs"] <= 2, (where, eval1)
            assert end["graphs"] == eval1["graphs"] and end["frames"] == eval1["frames"], (where, end)
            assert end["graph_breaks"] == 0 and end["eager_fallbacks"] == 0, (where, end)
            # aot_eager runs the eager kernels: the compiled run is the eager run, bit for bit
            _identical(compiled, eager, where)
        unevaluated, resumed = results[-2], results[-1]
        _identical((unevaluated[0], results[0][1], *unevaluated[2:]), results[0], f"evaluations, stage {stage}")
        # compiled and resumed against eager and straight: as tests/test_bf16_versions.py's resume (a restored norm's
        # sum may round its last bit)
        as_tensor = lambda r: torch.tensor([(x.loss, x.grad_norm, x.lr) for x in r[0]], dtype=torch.float64)
        torch.testing.assert_close(as_tensor(resumed), as_tensor(unevaluated), rtol=1e-9, atol=0)
        assert resumed[3] == unevaluated[3]
        for k in unevaluated[2] or ():
            torch.testing.assert_close(resumed[2][k], unevaluated[2][k], rtol=1e-6, atol=1e-7)


def test_a_recompile_limit_hit_is_counted_and_said_once(tmp_path, caplog):
    """Dynamo only logs that a function hit its recompile limit and now runs eagerly: ``compile_counts`` counts it
    (a real hit: a guard on a Python string that changes per call), and the run log says it once, with the cause
    and the fix, however many drain points report it."""
    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(lambda x, tag: x + len(tag), backend="eager")
    with torch._dynamo.config.patch(recompile_limit=2):
        for tag in ("a", "bb", "ccc", "dddd"):  # a guard on the string's value: a new graph per call, until the limit
            f(torch.ones(2), tag)
    counts = compile_counts()
    assert counts["graphs"] == 2 and counts["recompiles"] >= 1 and counts["eager_fallbacks"] >= 1, counts
    clean = {**counts, "eager_fallbacks": 0}
    runlog = RunLog.__new__(RunLog)  # what compile_stats uses: the file, the main-process flag, the said-once flag,
    runlog.path, runlog.main, runlog.compile_warned = tmp_path / "metrics.jsonl", True, False
    runlog.writer = None  # and no checkpoint writer to follow: records are written at once
    with caplog.at_level(logging.WARNING, logger="hf_asyncpp"):
        runlog.compile_stats(2, [clean, clean])
        assert "recompile limit" not in caplog.text
        runlog.compile_stats(4, [clean, counts])
        runlog.compile_stats(6, [counts, counts])
    said = [r.getMessage() for r in caplog.records if "recompile limit" in r.getMessage()]
    assert len(said) == 1 and "rank 1 " in said[0] and "TORCH_LOGS=recompiles" in said[0], said
    assert "training.torch_compile: false" in said[0] and "\n" not in said[0]
    rows = [json.loads(x) for x in runlog.path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 6] and rows[1]["compile"]["eager_fallbacks"] == [0, counts["eager_fallbacks"]]
