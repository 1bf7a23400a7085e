"""The planner's per-term memory against what the executor's stages really hold, for two configurations: bf16 with
Muon + error feedback on 2BW (bf16 weight versions, no cast per in-flight microbatch, the EF clone at STEP), and a
MoE with activation checkpointing (the layer inputs the checkpoint keeps). ``python -m bench.memory`` runs seven
such configurations for docs/benchmarks/memory.md; both use ``testing.stage_memory_report`` and
``memtrack.agreement``. The workers are spawned with no time limit."""
import re

import pytest

from hf_asyncpp.cli.plan import main
from hf_asyncpp.config.recipe import recipe_from_dict
from hf_asyncpp.pipeline.memtrack import MEASURED_TERMS, agreement
from hf_asyncpp.plan.memory import plan_memory
from hf_asyncpp.plan.vocab import resolve_vocab_parallel
from hf_asyncpp.testing import run_workers, stage_memory_report
from support import record_errors

LAYERS = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 2048, "max_position_embeddings": 128, "tie_word_embeddings": False}
MOE = {"model_type": "qwen3_moe", **LAYERS, "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
       "moe_intermediate_size": 96, "output_router_logits": True, "router_aux_loss_coef": 0.01}
CONFIGS = {
    "dense-bf16-2bw-muon-ef": ({"model_type": "llama", **LAYERS}, "2bw", True, False, "muon"),
    "moe-bf16-ckpt-2bw": (MOE, "2bw", True, True, "adamw"),
    # one weight version: the expert stacks' bf16 copy beside the master shows (2BW's two copies cost what two fp32
    # versions did); no checkpointing: every expert activation counts, the grouped GEMMs' in bf16
    "moe-bf16-1f1b": (MOE, "1f1b", True, False, "adamw"),
}


def schedule_rows(text: str) -> dict[str, dict]:
    """The plan's per-schedule lines: s/step, bubble, its fill/drain and imbalance (%), speed against 1F1B and, for
    2BW, its speed to the same loss and a step's worth (None where the line has none)."""
    rows = {}
    for m in re.finditer(r"^ +(\w+): ([\d.e+-]+) s/step, bubble ([\d.]+)% = fill/drain ([\d.]+)% \+ imbalance ([\d.]+)%; "
                         r"([\d.]+)x the speed of 1f1b(?:; ([\d.]+)x to the same loss: a step is worth ([\d.]+))?", text, re.M):
        values = [float(v) if v is not None else None for v in m.groups()[1:]]
        rows[m.group(1)] = dict(zip(("step", "bubble", "fill_drain", "imbalance", "speed", "at_loss", "worth"), values))
    return rows


def recipe(name: str) -> dict:
    model, schedule, bf16, checkpointing, optimizer = CONFIGS[name]
    return {"model": {"config": model}, "data": {"seq_len": 64},
            "pipeline": {"schedule": schedule, "num_stages": 2, "num_microbatches": 4, "microbatch_size": 2},
            "optimizer": {"name": optimizer, "learning_rate": 1e-3,
                          "delay_correction": "error_feedback" if optimizer == "muon" else "none"},
            "training": {"max_steps": 8, "bf16": bf16, "gradient_checkpointing": checkpointing, "max_grad_norm": 1.0,
                         "report_to": []}}


def test_planned_memory_with_sharded_experts_within_10_percent_of_measured():
    """Expert parallelism over 2 replicas of 2 stages (4 ranks): each GPU holds half of every MoE layer's experts
    (weights, gradients, optimizer state), what the planner plans per GPU (``plan_memory`` with ``dp``), and what each
    rank's executor holds, within 10% as the configurations above (2 layers and 2 tracked steps: 4 ranks share the
    machine's cores); the plan of the same run unsharded holds more on every GPU."""
    d = recipe("moe-bf16-1f1b")
    d["model"]["config"] = {**MOE, "num_hidden_layers": 2}  # 4 ranks on the machine's cores: the smallest split
    d["pipeline"]["expert_parallel"] = 2
    r = recipe_from_dict(d)
    vocab = resolve_vocab_parallel(r, replicas=2)[0]  # as the executor runs it
    _, planned, _ = plan_memory(r, dp=2, vocab_parallel=vocab)
    got = run_workers(stage_memory_report, 4, d, 2)
    for rank, g in enumerate(got):  # rank = stage x 2 + replica
        p = {t: getattr(planned[rank // 2], t) for t in MEASURED_TERMS}
        assert abs(agreement(p, g) - 1) < 0.10, (rank, p, g)
    d["pipeline"]["expert_parallel"] = 1
    whole = plan_memory(recipe_from_dict(d), dp=2, vocab_parallel=vocab)[1]
    assert all(x.params_per_gpu < y.params_per_gpu for x, y in zip(planned, whole))
    assert all(x.weights < y.weights and x.optimizer < y.optimizer for x, y in zip(planned, whole))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_planned_memory_within_10_percent_of_measured(name):
    r = recipe_from_dict(recipe(name))
    _, planned, _ = plan_memory(r, vocab_parallel=resolve_vocab_parallel(r)[0])  # as the executor runs it
    pred = [{t: getattr(m, t) for t in MEASURED_TERMS} for m in planned]
    got = run_workers(stage_memory_report, 2, recipe(name))
    for p, g in zip(pred, got):
        assert abs(agreement(p, g) - 1) < 0.10, (name, p, g)
        assert got[0]["ef_copy"] == pred[0]["ef_copy"] and all(g[t] >= 0 for t in MEASURED_TERMS)
    if name == "moe-bf16-1f1b":
        for p, g in zip(pred, got):
            assert abs(g["weights"] / p["weights"] - 1) < 0.005, (p["weights"], g["weights"])
            assert abs(g["activations"] / p["activations"] - 1) < 0.05, (p["activations"], g["activations"])
    if name.startswith("dense-bf16"):
        # the versions hold the linear weights in bf16 beside the fp32 masters: 2 versions cost what 2 fp32 ones did,
        # and no microbatch holds a cast of its own
        assert all(g["casts"] == 0 for g in got)
        assert all(g["weights"] == p["weights"] for p, g in zip(pred, got))


def test_plan_takes_recipe_overrides_after_the_recipe(capsys):
    """`hf-asyncpp plan RECIPE --training.gradient_checkpointing=true` plans that recipe (argparse alone took the
    override for an unknown option); a stray option is still an error."""
    assert main(["recipes/cpu-tiny.yaml", "--top", "0"]) in (0, None)
    plain = capsys.readouterr().out
    assert main(["recipes/cpu-tiny.yaml", "--top", "0", "--training.gradient_checkpointing=true"]) in (0, None)
    checkpointed = capsys.readouterr().out
    assert plain != checkpointed and "fits" in checkpointed
    # the form `train` takes too, the value as the next argument, before or after the tool's own options
    assert main(["recipes/cpu-tiny.yaml", "--training.gradient_checkpointing", "true", "--top", "0"]) in (0, None)
    assert capsys.readouterr().out == checkpointed
    with pytest.raises(SystemExit):
        main(["recipes/cpu-tiny.yaml", "--bogus"])
    capsys.readouterr()
    assert main(["recipes/cpu-tiny.yaml", "--training.max_stepz", "5"]) == 2  # one line naming the field meant
    err = capsys.readouterr().err.strip()
    record_errors("hf-asyncpp plan", 2, err)
    assert err.startswith("error: --training.max_stepz: unknown field; did you mean 'max_steps'?") and "\n" not in err


def test_compare_takes_recipe_overrides_in_both_forms(tmp_path):
    """What each arm is started with: the overrides as given, in train's forms, after the arm's own settings."""
    from hf_asyncpp.cli.compare import arm_overrides
    from hf_asyncpp.config.recipe import split_overrides

    own, extra = split_overrides(["recipes/cpu-tiny.yaml", "--steps", "4", "--data.seq_len", "64",
                                  "--training.seed=3", "--reuse"])
    assert own == ["recipes/cpu-tiny.yaml", "--steps", "4", "--reuse"]
    assert extra == ["--data.seq_len", "64", "--training.seed=3"]
    assert arm_overrides("2bw", tmp_path, 4, 2, 2, extra)[-3:] == extra


def test_plan_compares_zero_bubble_and_puts_2bw_at_the_same_loss(capsys, tmp_path):
    """The plan lists ZB-H1 beside 2BW, 1F1B and GPipe, the virtual-stage schedules (2 stages per rank: cpu-tiny's 4
    layers on 2 ranks), each with its fullest stage's or rank's memory, and 2BW's speed at the same loss: its steps
    are worth less than synchronous ones by the paper-regime study's measured fraction for the recipe's optimizer and
    correction. On 4 ranks the virtual-stage schedules would need 8 layers: the plan says so."""
    from hf_asyncpp.plan.search import DELAYED_STEP_WORTH, PLANNED_SCHEDULES

    assert main(["recipes/cpu-tiny.yaml", "--top", "0", "--optimizer.name", "adamw",
                 "--optimizer.delay_correction", "none"]) in (0, None)
    out = capsys.readouterr().out
    rows = schedule_rows(out)
    assert set(rows) == set(PLANNED_SCHEDULES), out
    for name in ("interleaved1f1b", "zbv", "dualpipev"):
        assert re.search(rf"^ +{name}: .*; fullest rank [\d.]+ GB; 2 stages per rank \((loop|v) placement\)", out, re.M)
    assert re.search(r"^ +zbh1: .*; fullest stage [\d.]+ GB$", out, re.M)
    assert rows["zbh1"]["bubble"] < rows["1f1b"]["bubble"]  # the W's fill part of 1F1B's bubble
    speed, at_loss, worth = (rows["2bw"][k] for k in ("speed", "at_loss", "worth"))
    assert worth == DELAYED_STEP_WORTH[("adamw", "none")] and at_loss == pytest.approx(speed * worth, abs=0.011)
    assert "docs/benchmarks/quality.md" in out and rows["1f1b"]["at_loss"] is None
    for r in rows.values():  # the bubble's two parts, each rounded to 0.1%
        assert r["fill_drain"] + r["imbalance"] == pytest.approx(r["bubble"], abs=0.11)
    assert main(["recipes/cpu-tiny.yaml", "--top", "0", "--num-stages", "4", "--png", str(tmp_path / "t.png")]) in (0, None)
    out = capsys.readouterr().out
    assert set(schedule_rows(out)) == {"2bw", "1f1b", "zbh1", "gpipe"}, out
    assert re.search(r"^ +zbv: does not fit: needs 8 stages of at least one layer; the model has 4 layers$", out, re.M)


def test_plan_measure_simulates_the_schedules_on_measured_f_i_w(capsys, tmp_path):
    """``plan --measure`` times F, B, I and W per layer here and simulates the schedules again on the measured
    split with them (the virtual-stage ones on a finer split by the same per-layer times): the first stage has no I,
    the others do, and the simulated steps are at least what the slowest stage's measured work takes (not the FLOPs
    estimate, which is far smaller for this tiny model)."""
    from hf_asyncpp.plan.search import PLANNED_SCHEDULES

    import torch

    threads = torch.get_num_threads()  # --measure times one pipeline rank's thread
    try:
        assert main(["recipes/cpu-tiny.yaml", "--top", "0", "--measure", "--device", "cpu", "--png",
                     str(tmp_path / "t.png"), "--data.seq_len", "32", "--pipeline.microbatch_size", "2"]) in (0, None)
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    flops, measured = out.split("simulated with the measured ms per stage")
    assert set(schedule_rows(flops)) == set(schedule_rows(measured)) == set(PLANNED_SCHEDULES), out
    split = [int(n) for n in re.search(r"the schedules on the measured split \[([\d, ]+)\]", flops).group(1).split(",")]
    per_stage = {k: [float(x) / 1e3 for x in v.split()] for k, v in re.findall(r"(\w+) \[([\d. ]+)\]", measured)}
    assert set(per_stage) == {"F", "B", "I", "W", "step"} and all(len(v) == len(split) == 2 for v in per_stage.values())
    assert per_stage["I"][0] == 0 and per_stage["W"][0] == per_stage["B"][0]
    assert all(x > 0 for x in per_stage["F"] + per_stage["B"] + per_stage["W"] + per_stage["I"][1:])
    rows = schedule_rows(measured)
    m = 4  # the recipe's microbatches per step
    slowest = max(m * (per_stage["F"][s] + per_stage["B"][s]) + per_stage["step"][s] for s in range(2))
    for name in ("1f1b", "gpipe"):
        assert rows[name]["step"] >= 0.99 * slowest, (name, rows[name], slowest)
    slowest_split = max(m * (per_stage["F"][s] + per_stage["I"][s] + per_stage["W"][s]) + per_stage["step"][s]
                        for s in range(2))
    assert rows["zbh1"]["step"] >= 0.99 * slowest_split
    for r in rows.values():
        assert r["fill_drain"] + r["imbalance"] == pytest.approx(r["bubble"], abs=0.11)


def test_plan_measure_times_the_layers_compiled_where_training_compiles_them(capsys, tmp_path):
    """With ``training.torch_compile`` on, ``plan --measure`` times the layers compiled with the recipe's backend, as
    training runs them: F, B and the step per stage, not I and W, and the split-backward schedules (refused with
    compile) listed as refused rather than simulated on halves of B."""
    import torch

    from hf_asyncpp.schedules.records import get_schedule

    threads = torch.get_num_threads()
    try:
        assert main(["recipes/cpu-tiny.yaml", "--top", "0", "--measure", "--device", "cpu", "--png",
                     str(tmp_path / "t.png"), "--data.seq_len", "32", "--pipeline.microbatch_size", "2",
                     "--training.torch_compile", "true", "--training.torch_compile_backend", "aot_eager"]) in (0, None)
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "measured on cpu, layers compiled (aot_eager)" in out
    flops, measured = out.split("simulated with the measured ms per stage")
    per_stage = {k: [float(x) / 1e3 for x in v.split()] for k, v in re.findall(r"(\w+) \[([\d. ]+)\]", measured)}
    assert set(per_stage) == {"F", "B", "step"} and all(x > 0 for x in per_stage["F"] + per_stage["B"])
    split_backward = {n for n in schedule_rows(flops) if get_schedule(n).split_backward}
    assert split_backward and not split_backward & set(schedule_rows(measured))
    for name in split_backward:
        assert re.search(rf"^ +{name}: does not fit: refused with training\.torch_compile on", measured, re.M), out
    assert {"2bw", "1f1b", "gpipe"} <= set(schedule_rows(measured))
