"""Virtual-stage schedules as data (several model stages per rank): interleaved 1F1B, ZBV and DualPipeV, each rank's
compute order equal to the one torch.distributed.pipelining generates, checked by the simulator (dependencies across
stages on the same and on other ranks, receives in send order, NCCL's rule, memory in flight), and their bubbles."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from hf_asyncpp.schedules.records import (DUALPIPEV, INTERLEAVED_1F1B, ONE_F_ONE_B, VIRTUAL_SCHEDULES, ZB_H1, ZBV, Action,
                                          ActionType as T, format_actions, get_schedule, interleaved_1f1b,
                                          parse_actions, stage_ranks)
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
    """Same actions per rank in the same order as torch's generator, for every m up to 64 of a spread that torch
    accepts (interleaved: m a multiple of its rounds; DualPipeV: m >= 2p), and torch refuses what the record refuses."""
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
