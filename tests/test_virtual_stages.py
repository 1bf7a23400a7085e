"""Virtual-stage schedules as data (several model stages per rank): interleaved 1F1B, ZBV and DualPipeV, each rank's
compute order taken from torch.distributed.pipelining's classes (``schedules/torch_orders.py``) and kept by the
lowering, checked by the simulator (dependencies across stages on the same and on other ranks, receives in send
order, NCCL's rule, memory in flight), and their bubbles."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from hf_asyncpp.schedules.actions import Action, ActionType as T, format_actions, parse_actions
from hf_asyncpp.schedules.records import (DUALPIPEV, INTERLEAVED_1F1B, ONE_F_ONE_B, VIRTUAL_SCHEDULES, ZBV, ZB_H1,
                                          get_schedule, interleaved_1f1b, stage_ranks)
from hf_asyncpp.schedules.simulator import Costs, ScheduleError, simulate

COMPUTE = (T.F, T.B, T.I, T.W)


def torch_orders(name: str, p: int, m: int, stages_per_rank: int = 2) -> list[list[tuple[str, int, int]]]:
    """Each rank's (F/B/I/W, stage, microbatch) in the order torch's schedule class generates. The constructors build
    ``pipeline_order`` for every rank from the stages' ``group_size``, ``group_rank`` and ``num_stages`` alone, so
    stand-ins with those (and no compiled submodule) build them with no process group; an overlapped pair
    (DualPipeV's OVERLAP_F_B) counts as its forward followed by its backward, the order torch's runtime runs them in
    without a custom overlap function."""
    from torch.distributed.pipelining import schedules as S

    cls = {"interleaved1f1b": S.ScheduleInterleaved1F1B, "zbv": S.ScheduleZBVZeroBubble,
           "dualpipev": S.ScheduleDualPipeV}[name]
    stages = [SimpleNamespace(num_stages=p * stages_per_rank, group_size=p, group_rank=0, submod=None,
                              stage_index_to_group_rank=None) for _ in range(stages_per_rank)]
    order = cls(stages, m).pipeline_order
    return [[(b.computation_type.value, b.stage_index, b.microbatch_index)
             for a in order[r] if a is not None for b in (a.sub_actions or (a,))] for r in range(p)]


def ours(sched, p: int, m: int) -> list[list[tuple[str, int, int]]]:
    return [[(a.type.value, a.stage, a.microbatch) for a in lst if a.type in COMPUTE]
            for lst in sched.actions(p, m, 1)]


def accepts(sched, p: int, m: int) -> bool:
    try:
        sched.check(p, m)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("name,p", [(n, p) for n in VIRTUAL_SCHEDULES for p in (1, 2, 3, 4, 8, 16)])
def test_each_ranks_compute_order_is_torchs(name, p):
    """Same actions per rank in the same order as torch's generator, read here from its ``pipeline_order`` on its own,
    after the lowering (transfers, REDUCE, STEP), for every m up to 64 of a spread that torch accepts (interleaved: m
    a multiple of its rounds; DualPipeV: m >= 2p), and torch refuses what the record's own check refuses."""
    sched = get_schedule(name)
    for m in sorted({1, 2, p - 1, p, p + 1, 2 * p - 1, 2 * p, 2 * p + 1, 3 * p, 63, 64} - {0}):
        if m > 64:
            continue
        if not accepts(sched, p, m):
            with pytest.raises(ValueError):
                torch_orders(name, p, m)
            continue
        assert ours(sched, p, m) == torch_orders(name, p, m), (p, m)


@pytest.mark.parametrize("v,p,m", [(3, 2, 4), (3, 4, 8), (4, 4, 8), (4, 3, 6), (3, 8, 16)])
def test_interleaved_with_more_stages_per_rank_is_torchs(v, p, m):
    assert ours(interleaved_1f1b(v), p, m) == torch_orders("interleaved1f1b", p, m, v)


def test_placements():
    assert stage_ranks("loop", 3, 2) == [0, 1, 2, 0, 1, 2] and INTERLEAVED_1F1B.stage_ranks(2) == [0, 1, 0, 1]
    assert stage_ranks("v", 3, 2) == [0, 1, 2, 2, 1, 0] == ZBV.stage_ranks(3) == DUALPIPEV.stage_ranks(3)
    with pytest.raises(ValueError, match="'v' exactly 2"):
        stage_ranks("v", 3, 3)
    with pytest.raises(ValueError, match="at least 2 stages per rank"):
        interleaved_1f1b(1)
    assert not any(s.runs_in_executor for s in VIRTUAL_SCHEDULES.values()) and ONE_F_ONE_B.runs_in_executor


# (schedule, p, m): m in {p, 2p} and 64 at p = 16, where the record accepts it
SIM_GRID = [(s, p, m) for s in [*VIRTUAL_SCHEDULES.values(), interleaved_1f1b(3)] for p in (1, 2, 3, 4, 8, 16)
            for m in sorted({p, 2 * p} | ({64} if p == 16 else set())) if accepts(s, p, m)]


@pytest.mark.parametrize("sched,p,m", SIM_GRID, ids=[f"{s.name}{s.stages_per_rank}-p{p}-m{m}" for s, p, m in SIM_GRID])
def test_lists_simulate_clean_under_gloo_and_nccl(sched, p, m):
    """Every (stage, microbatch) forwarded and backwarded once (B, or I then W) on the rank holding the stage; a
    transfer only between stages on different ranks; per-direction communicators with the executor's prefetch run
    the lists with no deadlock and, at comm = 0, the same timeline as the plain model."""
    n = 2
    acts = sched.actions(p, m, n)
    ranks = sched.stage_ranks(p)
    plain = simulate(acts, Costs(1, 2), sched, m)
    assert simulate(acts, Costs(1, 2), sched, m, nccl=True).timeline == plain.timeline
    everything = sorted((k, i) for k in range(n) for i in range(m))
    for r, lst in enumerate(acts):
        assert {a.stage for a in lst if a.stage is not None} == {g for g, q in enumerate(ranks) if q == r}
        for g in {a.stage for a in lst if a.stage is not None}:
            done = lambda kinds: sorted((a.step, a.microbatch) for a in lst if a.stage == g and a.type in kinds)
            assert done((T.F,)) == everything and done((T.B, T.W)) == everything
            assert done((T.I,)) == done((T.W,))
        for a in lst:
            if a.type in (T.SEND_ACT, T.RECV_GRAD):
                assert a.peer == ranks[a.stage + 1] != r
            if a.type in (T.RECV_ACT, T.SEND_GRAD):
                assert a.peer == ranks[a.stage - 1] != r
        assert [a.step for a in lst if a.type == T.STEP] == list(range(n))


def test_receives_follow_the_senders_order_in_v_placement():
    """In V placement rank r sends rank r+1 its first stage's activations and its second stage's input gradients on
    one pair: the receiver takes them in send order (no tags; NCCL completes them in that order), receiving an
    earlier one ahead of its place where it needs a later one first. Receiving them where each is needed instead
    puts them out of order, which the simulator refuses."""
    p, m = 2, 4
    acts = ZBV.actions(p, m, 1)
    sent = [a for a in acts[0] if a.type.is_send]
    received = [a for a in acts[1] if a.type.is_recv]
    key = lambda a, rank: (a.step, a.microbatch, a.sending_stage(rank))
    assert [key(a, 0) for a in sent] == [key(a, 1) for a in received]
    needed = list(acts[1])  # each receive moved to just before the computation that needs it
    for a in received:
        needed.remove(a)
        use = next(j for j, b in enumerate(needed) if b.type == (T.F if a.type == T.RECV_ACT else T.I)
                   and (b.step, b.microbatch, b.stage) == (a.step, a.microbatch, a.stage))
        needed.insert(use, a)
    assert needed != acts[1]
    with pytest.raises(ScheduleError, match=r"RECV_GRAD0\.0<0/s2, but the next message from rank 0 is SEND_ACT0\.2/s0 "
                                            r"\(receives out of send order\)"):
        simulate([acts[0], needed])


def test_broken_virtual_lists_are_caught():
    p, m = 2, 4
    zbv = ZBV.actions(p, m, 1)  # rank 1 holds stages 1 and 2: the V turns there without a transfer

    def swapped(lst, first, second):
        out = list(lst)
        i, j = out.index(first), out.index(second)
        out[i], out[j] = out[j], out[i]
        return out

    # the V's turn: stage 2's forward before stage 1's on the same rank
    bad = swapped(zbv[1], Action(T.F, 0, 0, 0, stage=1), Action(T.F, 0, 0, 0, stage=2))
    with pytest.raises(ScheduleError, match=r"(?s)rank 1: F0\.0@v0/s2 before its input: stage 1, on this rank, has "
                                            r"not forwarded it yet.*rank 1 @"):
        simulate([zbv[0], bad])
    # and back: stage 1's input gradient before stage 2's
    bad = swapped(zbv[1], Action(T.I, 0, 0, 0, stage=1), Action(T.I, 0, 0, 0, stage=2))
    with pytest.raises(ScheduleError, match=r"I0\.0@v0/s1 before its output gradient: stage 2, on this rank, has not "
                                            r"computed its input gradient for it yet"):
        simulate([zbv[0], bad])
    # a forward whose input never came from the other rank
    loop = INTERLEAVED_1F1B.actions(p, m, 1)
    no_recv = [a for a in loop[0] if a != Action(T.RECV_ACT, 0, 1, peer=1, stage=2)]
    with pytest.raises(ScheduleError, match=r"F0\.1@v0/s2 before its input: no RECV_ACT0\.1 from rank 1 before it"):
        simulate([no_recv, loop[1]])
    # a transfer to a rank that does not hold the neighbouring stage, one stage on two ranks, unnamed stages
    three = INTERLEAVED_1F1B.actions(3, 3, 1)
    wrong = [Action(T.SEND_ACT, a.step, a.microbatch, peer=2, stage=a.stage) if a.type == T.SEND_ACT else a
             for a in three[0]]
    with pytest.raises(ScheduleError, match=r"SEND_ACT0\.0>2/s0 names rank 2, but stage 1 is on rank 1"):
        simulate([wrong, *three[1:]])
    with pytest.raises(ScheduleError, match="stage 1 has actions on ranks 0 and 1: a stage lives on one rank"):
        simulate([loop[0] + [Action(T.F, 0, 0, 0, stage=1)], loop[1]])
    with pytest.raises(ScheduleError, match="some actions name their stage and some do not"):
        simulate([loop[0], [Action(T.F, 0, 0, 0)] + loop[1]])
    # receives out of send order between two ranks, under NCCL too
    out_of_order = swapped(loop[1], Action(T.RECV_ACT, 0, 0, peer=0, stage=1), Action(T.RECV_ACT, 0, 1, peer=0, stage=1))
    for nccl in (False, True):
        with pytest.raises(ScheduleError, match=r"RECV_ACT0\.1<0/s1, but the next message from rank 0 is "
                                                r"SEND_ACT0\.0/s0 \(receives out of send order"):
            simulate([loop[0], out_of_order], nccl=nccl)


def test_actions_naming_their_stage_round_trip():
    lists = DUALPIPEV.actions(2, 4, 2)
    text = format_actions(lists)
    assert text.startswith("rank 0: F0.0@v0/s0 SEND_ACT0.0>1/s0 ") and "\nrank 1: RECV_ACT0.0<0/s1 " in text
    assert parse_actions(text) == lists
    assert Action.from_str("RECV_GRAD3.1<2/s5") == Action(T.RECV_GRAD, 3, 1, peer=2, stage=5)
    with pytest.raises(ValueError, match="malformed action STEP"):
        Action(T.STEP, 0, stage=1)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 6), (4, 10), (8, 16), (16, 32)])
def test_interleaving_divides_the_fill_and_drain_by_v(p, m):
    """Balanced stages, F = 1 and B = 2 per rank's share of the model: a flushed 1F1B step takes m(F+B) + (p-1)(F+B).
    Interleaved over v stages per rank of 1/v the work each, a microbatch's fill and drain cross p x v stages of
    1/v the time: m(F+B) + (p-1)(F+B)/v (Narayanan et al. 2021), all of its bubble fill/drain. Each rank then holds
    more activations: its (v-1) rounds and 2(p-1-r) warm-up forwards, plus one, of stages 1/v the size."""
    n = 2
    one = simulate(ONE_F_ONE_B.actions(p, m, n), Costs(1, 2), ONE_F_ONE_B)
    assert one.makespan == pytest.approx(n * 3 * (m + p - 1))
    for v in (2, 3, 4):
        sched = interleaved_1f1b(v)
        res = simulate(sched.actions(p, m, n), Costs(1 / v, 2 / v), sched)
        assert res.makespan == pytest.approx(n * (3 * m + 3 * (p - 1) / v))
        assert res.imbalance == pytest.approx(0.0, abs=1e-12) and res.fill_drain == pytest.approx(res.bubble)
        per_round = m // max(1, m // p)
        assert res.peak_inflight == [min((v - 1) * per_round + 2 * (p - 1 - r) + 1, v * m) for r in range(p)]


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 16), (16, 32)])
def test_zbv_has_only_the_last_ranks_warm_up_when_f_i_w_are_equal(p, m):
    """F = I = W = c per stage: a rank's step is 6mc of work (two stages), and no flushed schedule can end a step
    before (p-1)c + 6mc, since the last rank's first forward needs p-1 stages' forwards first. ZBV reaches that bound
    (the zero-bubble paper's "near zero"), half of ZB-H1's (p-1)(F+I-W) on stages of twice the work, at 1F1B's
    activation memory: 2p microbatches of half a rank's layers on every rank."""
    n, c = 2, 0.5
    zbv = simulate(ZBV.actions(p, m, n), Costs(c, 2 * c), ZBV)
    assert zbv.makespan == pytest.approx(n * (6 * m * c + (p - 1) * c))
    zb_h1 = simulate(ZB_H1.actions(p, m, n), Costs(2 * c, 4 * c), ZB_H1)
    assert zb_h1.makespan - zbv.makespan == pytest.approx(n * (p - 1) * c)
    assert zbv.peak_inflight == [2 * p] * p
    assert zbv.imbalance == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 16)])
def test_dualpipev_holds_pp_plus_one_chunks(p, m):
    """DualPipeV's activation memory per device is PP + 1 chunks (DeepSeek's DualPipe README; PP = 2p stages here):
    2p + 1 microbatches of half a rank's layers on every rank, one more than ZBV."""
    res = simulate(DUALPIPEV.actions(p, m, 2), Costs(0.5, 1.0), DUALPIPEV)
    assert res.peak_inflight == [2 * p + 1] * p


def test_constraints_name_the_knob():
    with pytest.raises(ValueError, match=r"num_microbatches must be a multiple of max\(1, m // p\) = 2 \(got 9\): "
                                         r"use 8 or 10"):
        INTERLEAVED_1F1B.actions(4, 9, 1)
    with pytest.raises(ValueError, match=r"dualpipev needs num_microbatches >= 2 x num_stages, one per model stage "
                                         r"\(7 < 8\)"):
        DUALPIPEV.actions(4, 7, 1)
    with pytest.raises(ValueError, match=r"'zb' is not one of gpipe, 1f1b, zbh1, 2bw, pipedream \(planner only: "
                                         r"interleaved1f1b, zbv, dualpipev\)"):
        get_schedule("zb")


# ---------------------------------------------------------------------------- the planner


def _recipe(layers: int, tied: bool = True, **pipeline):
    from hf_asyncpp.config.recipe import recipe_from_dict

    return recipe_from_dict({"model": {"config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                                  "num_hidden_layers": layers, "num_attention_heads": 4,
                                                  "num_key_value_heads": 2, "max_position_embeddings": 64,
                                                  "tie_word_embeddings": tied},
                                       "vocab_size": 256},
                             "data": {"seq_len": 32},
                             "pipeline": {"schedule": "1f1b", "num_stages": 2, "num_microbatches": 4,
                                          "microbatch_size": 2, **pipeline},
                             "optimizer": {"name": "adamw"}})


def test_virtual_stages_are_costed_by_their_own_layers():
    """From FLOPs: each of the p x v stages costs its own layers (``partition_plan`` into p x v stages), the same model
    work as the p-stage plan in all. Measured: the per-layer seconds split into p x v stages balanced by them, each
    pass of each stage the sum of its layers', and the optimizer step per rank the sum of its stages'."""
    from hf_asyncpp.partition import partition_plan
    from hf_asyncpp.plan.costs import MeasuredCosts, PassSeconds
    from hf_asyncpp.plan.memory import meta_model
    from hf_asyncpp.plan.search import flops_costs, virtual_costs

    recipe, p = _recipe(8), 2
    model = meta_model(recipe)
    coarse = flops_costs(partition_plan(model, p, seq_len=32), recipe, 1e9)
    for sched in (INTERLEAVED_1F1B, ZBV, interleaved_1f1b(4)):
        fine = virtual_costs(sched, recipe, p, model, 1e9)
        stages = p * sched.stages_per_rank
        assert fine.forward == flops_costs(partition_plan(model, stages, seq_len=32), recipe, 1e9).forward
        assert len(fine.forward) == stages and sum(fine.forward) == pytest.approx(sum(coarse.forward))
    layers = [1.0, 2.0, 1.0, 3.0, 1.0, 1.0, 2.0, 1.0]
    passes = {name: PassSeconds([x * f for x in layers], 0.5 * f, 2.0 * f)
              for name, f in (("forward", 1.0), ("backward", 2.0), ("backward_input", 1.0), ("backward_weight", 1.0))}
    measured = MeasuredCosts([3 * x for x in layers], 1.5, 6.0, layer_steps=[0.1] * 8, first_step=0.2, last_step=0.3,
                             passes=passes)
    split = measured.balance(4, 4)
    costs = virtual_costs(ZBV, recipe, p, measured=measured)  # ranks hold stages (0, 3) and (1, 2)
    assert costs.forward == measured.stage_costs(split).forward and sum(costs.forward) == pytest.approx(sum(layers) + 2.5)
    steps = measured.stage_costs(split).step
    assert costs.step == pytest.approx([steps[0] + steps[3], steps[1] + steps[2]])
    assert sum(costs.step) == pytest.approx(0.1 * 8 + 0.2 + 0.3)
    with pytest.raises(ValueError, match="needs measured per-layer costs, or a model and flops_per_s"):
        virtual_costs(ZBV, recipe, p)


def test_a_rank_holds_its_stages_parameters_once_and_their_activations_as_they_fly():
    """Per rank: the parameters of all its stages (in V placement rank 0 holds the embedding and the head, one tensor
    when tied: counted once), and the activations of its in-flight (stage, microbatch) pairs each at its own stage's
    size, walked in the rank's order."""
    from hf_asyncpp.partition import partition_plan
    from hf_asyncpp.plan.memory import meta_model, peak_in_flight, plan_memory
    from hf_asyncpp.plan.search import schedule_memory

    for tied in (True, False):
        recipe = _recipe(8, tied)
        model = meta_model(recipe)
        total = sum(q.numel() for q in model.parameters())  # each tensor once
        plan = partition_plan(model, 4, seq_len=32)
        zbv = schedule_memory(recipe, "zbv", 2, model)
        assert [m.layers for m in zbv] == [f"0-{plan.stages[0].layers.stop - 1},{plan.stages[3].layers.start}-7",
                                           f"{plan.stages[1].layers.start}-{plan.stages[1].layers.stop - 1},"
                                           f"{plan.stages[2].layers.start}-{plan.stages[2].layers.stop - 1}"]
        assert sum(m.params for m in zbv) == total  # the tied head is on the embedding's rank: no copy
        loop = schedule_memory(recipe, "interleaved1f1b", 2, model)
        assert sum(m.params for m in loop) == total + (model.lm_head.weight.numel() if tied else 0)  # a copy on rank 1
    _, one, sim = plan_memory(recipe, 2, model)
    assert [m.activations for m in one] == [
        peak_in_flight([iv.action for iv in sim.timeline[s]], s, {s: m.activations / m.inflight}) for s, m in enumerate(one)]
    walk = [Action(T.F, 0, 0, 0, stage=0), Action(T.F, 0, 0, 0, stage=3), Action(T.I, 0, 0, 0, stage=3),
            Action(T.F, 0, 1, 0, stage=0), Action(T.W, 0, 0, 0, stage=3), Action(T.B, 0, 0, 0, stage=0)]
    assert peak_in_flight(walk, 0, {0: 1.0, 3: 10.0}) == 12.0  # two of stage 0 and one of stage 3 (held to its W)


def test_costs_per_rank_sum_the_steps_of_a_ranks_stages():
    costs = Costs(forward=[1, 2, 3, 4], step=[0.1, 0.2, 0.3, 0.4], reduce=0.5).per_rank([0, 1, 1, 0])
    assert costs.forward == [1, 2, 3, 4] and costs.step == pytest.approx([0.5, 0.5]) and costs.reduce == [1.0, 1.0]


def test_plan_simulates_the_virtual_stage_schedules_where_they_fit():
    """``simulate_schedules`` adds interleaved 1F1B, ZBV and DualPipeV where the layers allow p x 2 stages and the
    schedule takes m (DualPipeV: m >= 2p); on balanced layers interleaving halves 1F1B's fill and drain."""
    from hf_asyncpp.plan.memory import meta_model, plan_memory
    from hf_asyncpp.plan.search import PLANNED_SCHEDULES, simulate_schedules, why_not_planned

    recipe = _recipe(16, num_microbatches=8)
    model = meta_model(recipe)
    plan, _, _ = plan_memory(recipe, 4, model)
    sims = simulate_schedules(plan, recipe, 4, 1e12, model=model)
    assert set(sims) == set(PLANNED_SCHEDULES)
    assert all(not math.isnan(r.makespan) and r.makespan > 0 for r in sims.values())
    assert sims["interleaved1f1b"].makespan < sims["1f1b"].makespan and sims["zbv"].makespan < sims["zbh1"].makespan
    assert simulate_schedules(plan, recipe, 4, 1e12).keys() == {"2bw", "1f1b", "zbh1", "gpipe"}  # no model: no split
    few = _recipe(6, num_microbatches=4)
    plan, _, _ = plan_memory(few, 4, meta_model(few))
    assert set(simulate_schedules(plan, few, 4, 1e12, model=meta_model(few))) == {"2bw", "1f1b", "zbh1", "gpipe"}
    assert why_not_planned(ZBV, 6, 4, 4) == "needs 8 stages of at least one layer; the model has 6 layers"
    assert "dualpipev needs num_microbatches >= 2 x num_stages" in why_not_planned(DUALPIPEV, 16, 4, 4)


def test_timeline_draws_a_row_per_rank(tmp_path, capsys):
    """``hf-asyncpp timeline --schedule zbv``: ranks of 2 stages each, every stage at half the given costs, so a rank
    works as long as a 1F1B stage, m (F + B); 1F1B's flushed step adds (p-1)(F + B), ZBV's only the last rank's
    warm-up, (p-1) F / 2."""
    from hf_asyncpp.cli.timeline import main

    spans = {}
    for name in ("zbv", "1f1b"):
        out = tmp_path / f"{name}.png"
        assert main(["--schedule", name, "--stages", "2", "--microbatches", "4", "--steps", "1", "--step-cost", "0",
                     "--out", str(out)]) == 0
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        spans[name] = float(capsys.readouterr().out.split("makespan ")[1].split(",")[0])
    assert spans == {"1f1b": 4 * 3 + 3, "zbv": 4 * 3 + 0.5}


VOCAB_GRID = [(s, p, m) for s in [*VIRTUAL_SCHEDULES.values(), interleaved_1f1b(3)] for p in (2, 3, 4, 8)
              for m in sorted({p, 2 * p, 4 * p}) if accepts(s, p, m)]


@pytest.mark.parametrize("sched,p,m", VOCAB_GRID, ids=[f"{s.name}{s.stages_per_rank}-p{p}-m{m}" for s, p, m in VOCAB_GRID])
def test_vocab_passes_placed_in_every_virtual_stage_schedule_run_without_deadlock(sched, p, m):
    """With the vocabulary layers shared by every stage, every rank runs one VOCAB per microbatch (naming no stage: the
    shard is the rank's), all in the same order; the rank holding the last model stage right after that stage's
    forward of the microbatch; the lists simulate with no deadlock under gloo's and NCCL's rules, with the same
    computations and transfers as without (``records._vocab_cut``)."""
    n = 2
    acts = sched.actions(p, m, n, vocab_parallel=True)
    plain = sched.actions(p, m, n)
    costs = Costs(forward=1, backward=2, vocab=0.4, comm=0.05)
    for nccl in (False, True):
        simulate(acts, costs, sched, m, nccl=nccl)
    last = p * sched.stages_per_rank - 1
    holder = sched.stage_ranks(p)[last]
    order = None
    for r, lst in enumerate(acts):
        vocab = [(a.step, a.microbatch) for a in lst if a.type == T.VOCAB]
        assert sorted(vocab) == [(k, i) for k in range(n) for i in range(m)] and (order is None or vocab == order)
        order = vocab
        assert all(a.stage is None for a in lst if a.type == T.VOCAB)
        assert [a for a in lst if a.type != T.VOCAB] == plain[r]
        if r == holder:  # the computations before each VOCAB: the last stage's forward of it (DualPipeV: and the
            # backward overlapped with it in one chunk)
            computes = [a for a in lst if a.type in (*COMPUTE, T.VOCAB)]
            for at, a in enumerate(computes):
                if a.type == T.VOCAB:
                    before = computes[at - 1] if computes[at - 1].type != T.F else None
                    f = computes[at - 2] if before is not None else computes[at - 1]
                    assert (f.type, f.stage, f.step, f.microbatch) == (T.F, last, a.step, a.microbatch), (r, a, f)
                    assert before is None or (sched.name == "dualpipev" and before.type == T.B)


@pytest.mark.parametrize("name", ["interleaved1f1b", "zbv", "dualpipev"])
def test_vocab_passes_in_virtual_stage_schedules_cost_little_more_than_their_own_time(name):
    """Placed where the rank stands when the last stage's forward ends (torch's time grid, or the order run with unit
    times), the VOCAB barriers leave the schedule's pacing: at 8 ranks and 32 microbatches a step takes at most 6%
    more than the plain schedule plus the VOCABs' own time, and no more microbatches are in flight."""
    sched, p, m, v = get_schedule(name), 8, 32, 0.3
    plain = simulate(sched.actions(p, m, 2), Costs(forward=1, backward=2), sched)
    shared = simulate(sched.actions(p, m, 2, vocab_parallel=True), Costs(forward=1, backward=2, vocab=v), sched)
    assert shared.makespan <= 1.06 * (plain.makespan + 2 * m * v)
    assert shared.peak_inflight == plain.peak_inflight
