"""The paper-regime study's MoE arm (bench/paper_regime.py): its parameter counts against a hand count from
the config, the step count of 20 tokens per active parameter, the router's balance read from a run's records, the
report rendered from partial results, and the single-process engine's router records (what the balance is read
from) against the model's own aux loss and routing."""
import math
import statistics

import pytest
import torch

from bench import paper_regime as pr
from support import ARCHS, BASE, make_batches, make_recipe, reference


def hand_count(cfg: dict, vocab: int) -> tuple[int, int, int]:
    """(total, active, embedding) of a tied Llama or Qwen3-MoE config, counted by hand from its dimensions."""
    h, layers, heads, kv = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head = cfg.get("head_dim", h // heads)
    attention = h * heads * head * 2 + h * kv * head * 2  # q and o, k and v
    norms = 2 * h
    if cfg["model_type"] == "qwen3_moe":
        experts, top_k, ffn = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
        expert = 3 * h * ffn  # gate, up, down
        shared = attention + 2 * head + norms + experts * h  # + QK norms, router
        total_layer, active_layer = shared + experts * expert, shared + top_k * expert
    else:
        total_layer = active_layer = attention + norms + 3 * h * cfg["intermediate_size"]
    embedding = vocab * h  # tied: the head is the embedding
    return (layers * total_layer + embedding + h, layers * active_layer + embedding + h, embedding)


@pytest.mark.parametrize("cfg", [pr.MODEL, pr.MOE_MODEL], ids=["dense", "moe"])
def test_parameter_counts_match_a_hand_count(cfg):
    c = pr.count_params(cfg)
    assert (c.total, c.active, c.embedding) == hand_count(cfg, pr.VOCAB)
    if cfg is pr.MOE_MODEL:
        E, k = cfg["num_experts"], cfg["num_experts_per_tok"]
        assert c.experts == cfg["num_hidden_layers"] * E * 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"]
        assert c.total - c.active == c.experts * (E - k) // E
    else:
        assert c.experts == 0 and c.total == c.active


def test_moe_active_parameters_are_the_dense_models_and_set_T():
    dense, moe = pr.count_params(pr.MODEL), pr.count_params(pr.MOE_MODEL)
    assert abs(moe.active / dense.active - 1) < 0.02  # router and QK norms only
    T = pr.full_steps(pr.MOE_MODEL)
    assert T == round(pr.TOKENS_PER_PARAM * moe.active / (pr.BATCH * pr.SEQ))
    assert T * pr.BATCH * pr.SEQ / moe.active == pytest.approx(pr.TOKENS_PER_PARAM, abs=0.01)
    assert pr.full_steps() == pr.full_steps(pr.MODEL) == round(pr.TOKENS_PER_PARAM * dense.total / (pr.BATCH * pr.SEQ))


def records(steps: int, counts) -> list[dict]:
    """Step records as metrics.jsonl holds them: ``counts(step)`` the step's tokens per layer and expert."""
    return [{"step": s, "loss": 1.0, "router_aux_loss": 2.0 + s / 1000, "expert_tokens": counts(s)} for s in range(1, steps + 1)]


def test_router_balance_reads_the_load_per_window_and_at_the_end():
    # layer 0 uniform; layer 1 drifts: expert 0 takes more and more of the tokens
    rows = records(200, lambda s: [[8, 8, 8, 8], [8 + s // 10, 8, 8, 8 - s // 40]])
    r = pr.router_balance(rows, points=10)
    assert len(r["windows"]) == 10 and [w[0] for w in r["windows"]] == list(range(20, 201, 20))
    tail = rows[180:]
    c1 = [sum(row["expert_tokens"][1][e] for row in tail) for e in range(4)]
    load1 = [4 * x / sum(c1) for x in c1]
    assert r["final_load"][0] == [1.0] * 4
    assert r["final_load"][1] == [round(x, 4) for x in load1]
    assert r["final"]["cv"] == pytest.approx(statistics.pstdev(load1) / 2, abs=1e-5)  # mean over layers, one is 0
    assert r["final"]["max"] == pytest.approx(max(load1), abs=1e-4) and r["final"]["min"] == pytest.approx(min(load1), abs=1e-4)
    assert r["final"]["aux"] == pytest.approx(statistics.mean(x["router_aux_loss"] for x in tail), abs=1e-5)
    cvs = [w[2] for w in r["windows"]]
    assert cvs == sorted(cvs) and cvs[0] < cvs[-1]  # the drift shows


def summary(b, opt, v, seed, final, drift):
    """A finished arm's summary as ``Bench.run`` keeps it, with a router whose load drifts by ``drift``."""
    rows = records(b.T, lambda s: [[8 + round(drift * s / b.T), 8, 8, 8]] * 2)
    tag = b.arm(opt, v, b.T)[0]
    return (tag, b.T, seed), {"tag": tag, "steps": b.T, "seed": seed, "final": final, "lr": b.lrs[opt],
                              "curve": [(0, 7.0), (b.T, final)], "router": pr.router_balance(rows)}


def test_effective_steps_are_read_per_seed_from_its_own_ladder(tmp_path):
    """R4: a delayed seed's loss is placed on that seed's sync ladder (log-linear in steps), then the seeds averaged.
    Seed 0's sync run at T is the worst here, so the delayed mean lies below seed 0's ladder: read against it, as
    before, the arm fell off the ladder."""
    moe = pr.Bench(tmp_path, 1, True, pr.MOE)
    moe.lrs = {"adamw": 0.016, "muon": 0.01}
    T, L = moe.T, moe.lengths()
    ladder = {0: {"T/8": 3.40, "T/4": 3.20, "T/2": 3.05, "T": 2.95}, 1: {"T/4": 3.15, "T/2": 3.00, "T": 2.92}}
    results = {}
    for sd, points in ladder.items():
        for k, loss in points.items():
            tag = moe.arm("muon", "sync", L[k])[0]
            results[(tag, L[k], sd)] = {"tag": tag, "steps": L[k], "seed": sd, "final": loss}
    results.update([summary(moe, "muon", "delay", 0, 3.00, 2), summary(moe, "muon", "delay", 1, 2.90, 2)])
    _, ratios = pr.arm_table(moe, results)
    # seed 0 halfway (in loss) between T/2 and T: 2^(-1/2) of T; seed 1 below its sync run at T: 1
    assert pr.effective_fraction(3.00, list(zip([L["T/2"], T], [3.05, 2.95])), T) == pytest.approx(
        math.exp(math.log(L["T/2"]) + 0.5 * (math.log(T) - math.log(L["T/2"]))) / T)
    want = (pr.effective_fraction(3.00, [(L[k], x) for k, x in ladder[0].items()], T) + 1.0) / 2
    assert ratios[("muon", "delay")]["eff"] == pytest.approx(want) and 0.7 < want < 0.9
    assert pr.effective_fraction(3.5, [(L[k], x) for k, x in ladder[0].items()], T) is None  # above the ladder


def test_moe_report_renders_partial_results(tmp_path):
    moe = pr.Bench(tmp_path, 1, True, pr.MOE)
    moe.lrs = {"adamw": 0.016, "muon": 0.01}
    dense = pr.Bench(tmp_path, 1, True)
    dense.lrs = {"adamw": 0.016, "muon": 0.01}
    results = dict([summary(moe, "muon", "sync", 0, 3.00, 2), summary(moe, "muon", "sync", 1, 3.02, 2),
                    summary(moe, "muon", "delay", 0, 3.03, 8), summary(moe, "muon", "delay", 1, 3.07, 8),
                    summary(moe, "muon", "delay+EF", 0, 3.01, 4)])
    text, png = pr.moe_report(moe, results, dense, {})
    lines = text.splitlines()
    row = lambda table, opt, v: next(x for x in lines if x.startswith(f"| {opt} | {v} |") and table(x))  # noqa: E731
    loss_row = lambda x: "not run" in x or "±" in x or x.count("|") == 9  # noqa: E731
    assert row(loss_row, "adamw", "sync") == "| adamw | sync | 0 | not run |  |  |  |  |"
    delay = row(lambda x: True, "muon", "delay")
    assert "| 2 | 3.0500 ± 0.0283 | +0.0400 ± 0.0141 |" in delay  # gaps paired by seed: 0.03 and 0.05
    assert f"{0.04 / 3.01:+.2%}" in delay
    ef = row(lambda x: True, "muon", "delay+EF")
    assert "| 1 | 3.0100 | +0.0100 |" in ef and f"{1 - 0.01 / 0.03:.0%}" in ef  # EF's share on seed 0, both arms have it
    router = [x for x in lines if x.startswith("| muon | delay | 2 |")][1]
    cv_gap = results[(moe.arm("muon", "delay", moe.T)[0], moe.T, 0)]["router"]["final"]["cv"] - \
        results[(moe.arm("muon", "sync", moe.T)[0], moe.T, 0)]["router"]["final"]["cv"]
    assert cv_gap > 0 and f"{cv_gap:+.4f}" in router  # the drifting router, paired with the sync seed
    r1 = next(x for x in lines if x.startswith("| R1 "))
    assert r1 == "| R1 Muon's gap / AdamW's gap | 0.043 | not run | - | not run |"
    r3 = next(x for x in lines if x.startswith("| R3 muon"))
    assert r3.endswith(f"| {(1.911 - 1.906) / 1.906:.2%} | {0.04 / 3.01:+.2%} |")
    assert f"{pr.count_params(pr.MOE_MODEL).active:,}" in text and png.exists()
    # nothing tuned: every arm says so, nothing else breaks
    moe.lrs = {}
    text, png = pr.moe_report(moe, {}, dense, {})
    assert png is None  # no figure of nothing
    untuned = [x for x in text.splitlines() if x.startswith("| ") and "| not tuned yet |" in x]
    assert len(untuned) == 2 * 2 * len(pr.VARIANTS) and "not tuned yet (`--phases moe-tune`)" in text


def test_moe_jobs_wait_for_the_tuned_lrs_and_reuse_the_tuning_run(tmp_path):
    moe = pr.Bench(tmp_path, 1, True, pr.MOE)
    moe.lrs = {}
    assert pr.moe_jobs(moe, list(pr.MOE_PHASES)) == []
    moe.lrs = {"adamw": 0.016, "muon": 0.01}
    jobs = pr.moe_jobs(moe, list(pr.MOE_PHASES))
    keys = [(t, st, sd) for t, _, st, sd in jobs]
    assert len(keys) == len(set(keys)) == 2 * 3 * 3 + 2 * 3  # the main arms x 3 seeds, the sync ladder
    assert ("muon-lr0.01-sync", moe.T, 0) in keys  # the tuning grid's run at the tuned lr: kept, not run again
    assert all(any("--optimizer.simulate_delay" in a for a in args) == ("delay" in t) for t, args, _, _ in jobs)
    assert jobs[0][3] == 0 and jobs[-1][3] == 2  # seed 0 of every arm first


def test_single_process_engine_records_the_routers_balance():
    """Each step's ``router_aux_loss`` is the model's own aux loss at the weights the step ran (step 0: the initial
    ones) and ``expert_tokens`` the top-k choices of each layer's router, every routed token counted k times."""
    from hf_asyncpp.partition.moe_aux import expert_token_counts
    from support import build

    arch = {"model_type": "qwen3_moe", **BASE, **ARCHS["qwen3_moe"]}
    recipe = make_recipe(arch, "none", 1, 2, 2)
    batches = make_batches(3, 2, 2, seed=0)
    results, _ = reference(recipe, batches)
    model = build(recipe)  # the same initial weights
    k, layers = arch["num_experts_per_tok"], arch["num_hidden_layers"]
    with torch.no_grad():
        outs = [model(input_ids=ids, labels=ids) for ids in batches[0]]
    assert results[0].router_aux_loss == pytest.approx(statistics.mean(float(o.aux_loss) for o in outs), rel=1e-5)
    want = sum(expert_token_counts(o.router_logits, k) for o in outs).tolist()
    assert results[0].expert_tokens == want
    for r, batch in zip(results, batches):
        assert len(r.expert_tokens) == layers and all(len(x) == arch["num_experts"] for x in r.expert_tokens)
        assert all(sum(x) == batch.numel() * k for x in r.expert_tokens)
        assert math.isfinite(r.router_aux_loss)
    dense, _ = reference(make_recipe({"model_type": "llama", **BASE}, "none", 1, 2, 2), batches)
    assert all(r.router_aux_loss is None and r.expert_tokens is None for r in dense)
