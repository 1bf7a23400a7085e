"""Schedules are data: the action lists, checked by the process-free simulator."""
from __future__ import annotations

import math

import pytest

from hf_asyncpp.schedules.actions import Action, ActionType as T, format_actions, parse_actions
from hf_asyncpp.schedules.records import SCHEDULES, TWO_BW, VIRTUAL_SCHEDULES, get_schedule, schedule_actions, version_lag
from hf_asyncpp.schedules.simulator import Costs, ScheduleError, simulate
from hf_asyncpp.schedules.timeline import plot_steady_step, plot_timeline, steady_step, step_shares, step_timeline


def semantic_version(schedule, step, stage, p):
    """The update semantics, written out independently of the code under test."""
    return {"gpipe": step, "1f1b": step, "zbh1": step, "2bw": max(0, step - 1),
            "pipedream": max(0, step - (p - 1 - stage))}[schedule]


def backward_kinds(lst):
    """A schedule's backward: B, or I and W where it splits it (zero bubble)."""
    return (T.I, T.W) if any(a.type == T.W for a in lst) else (T.B,)


def valid(schedule, p, m):
    return not (schedule == "2bw" and m < p) and not (schedule == "pipedream" and m != 1)


GRID = [(s, p, m, n) for s in SCHEDULES for p in (1, 2, 3, 4) for m in (1, 2, 3, 5, 8) for n in (1, 2, 5) if valid(s, p, m)]


@pytest.mark.parametrize("schedule,p,m,n", GRID)
def test_every_microbatch_forwarded_and_backwarded_once_per_step_on_every_stage(schedule, p, m, n):
    acts = schedule_actions(schedule, p, m, n)
    assert len(acts) == p
    res = simulate(acts, Costs(), schedule, m)  # raises on deadlock, FIFO violation, missing/duplicate work
    everything = sorted((k, i) for k in range(n) for i in range(m))
    for s, lst in enumerate(acts):
        assert backward_kinds(lst) == ((T.I, T.W) if schedule == "zbh1" else (T.B,))
        for kind in (T.F, *backward_kinds(lst)):
            assert sorted((a.step, a.microbatch) for a in lst if a.type == kind) == everything
        assert [a.step for a in lst if a.type == T.REDUCE] == list(range(n))
        assert [a.step for a in lst if a.type == T.STEP] == list(range(n))
        for a in lst:
            if a.type in (T.F, T.B, T.I, T.W):
                assert a.version == semantic_version(schedule, a.step, s, p), (s, str(a))
        # transfers: peers are the neighbours, one per forward/backward that needs it
        assert all(a.peer == s + 1 for a in lst if a.type in (T.SEND_ACT, T.RECV_GRAD))
        assert all(a.peer == s - 1 for a in lst if a.type in (T.RECV_ACT, T.SEND_GRAD))
        count = lambda kind: sum(a.type == kind for a in lst)
        assert count(T.SEND_ACT) == count(T.RECV_GRAD) == (n * m if s < p - 1 else 0)
        assert count(T.RECV_ACT) == count(T.SEND_GRAD) == (n * m if s > 0 else 0)
    assert res.num_steps == n and res.num_microbatches == m


def test_transfers_sit_next_to_their_compute_and_reduce_after_the_last_backward():
    for schedule in SCHEDULES:
        p, m, n = 3, (1 if schedule == "pipedream" else 4), 4
        for s, lst in enumerate(schedule_actions(schedule, p, m, n)):
            for j, a in enumerate(lst):
                key = (a.step, a.microbatch)
                first_backward = backward_kinds(lst)[0]  # B, or the I that sends the input gradient
                if a.type == T.RECV_ACT or a.type == T.RECV_GRAD:
                    nxt = lst[j + 1]
                    assert nxt.type == (T.F if a.type == T.RECV_ACT else first_backward) and (nxt.step, nxt.microbatch) == key
                if a.type == T.SEND_ACT or a.type == T.SEND_GRAD:
                    prv = lst[j - 1]
                    assert prv.type == (T.F if a.type == T.SEND_ACT else first_backward) and (prv.step, prv.microbatch) == key
                if a.type == T.REDUCE:
                    last_b = max(i for i, b in enumerate(lst) if b.type in (T.B, T.W) and b.step == a.step)
                    # right after the backward (and its SEND_GRAD; a W sends nothing)
                    assert j == last_b + 1 + (s > 0 and lst[last_b].type == T.B)


@pytest.mark.parametrize("p,m,n", [(2, 2, 4), (3, 5, 5), (4, 4, 6), (4, 8, 3)])
def test_2bw_steps_as_late_as_the_semantics_allow(p, m, n):
    for s, lst in enumerate(schedule_actions("2bw", p, m, n)):
        for j, a in enumerate(lst):
            if a.type != T.STEP:
                continue
            later = [b for b in lst[j + 1:] if b.type == T.F]
            if a.step + 2 < n:  # just before the stage's first forward of step k+2 (its RECV_ACT first on s > 0)
                first = next(i for i, b in enumerate(lst) if b.type == T.F and b.step == a.step + 2)
                assert j == first - 1 - (s > 0) or lst[j + 1].type == T.STEP
                assert later and later[0].step == a.step + 2 and later[0].version == a.step + 1
            else:  # the window's last two steps: at the end
                assert not later and all(b.type == T.STEP for b in lst[j:])


@pytest.mark.parametrize("schedule,p,m,extra", [(s, p, m, e) for s in ("1f1b", "2bw") for p in (2, 3, 4)
                                                for m in (4, 5, 8) for e in (1, 2) if s == "1f1b" or m >= p + e])
def test_extra_warmup_runs_ahead_without_changing_what_is_computed(schedule, p, m, extra):
    n = 4
    base, eager = schedule_actions(schedule, p, m, n), schedule_actions(schedule, p, m, n, extra_warmup=extra)
    res = simulate(eager, Costs(), schedule, m)  # no deadlock, FIFO order, every microbatch once
    ref = simulate(base, Costs(), schedule, m)
    for s in range(p):
        work = lambda lst: sorted((str(a) for a in lst if a.type in (T.F, T.B, T.REDUCE, T.STEP)))
        assert work(eager[s]) == work(base[s])  # the same forwards/backwards with the same versions
        first_b = next(j for j, a in enumerate(eager[s]) if a.type == T.B)
        forwards_before = sum(a.type == T.F for a in eager[s][:first_b])
        assert forwards_before == min(p - s + (extra if s < p - 1 else 0), m if schedule == "1f1b" else n * m)
        assert res.peak_inflight[s] == min(ref.peak_inflight[s] + (extra if s < p - 1 else 0), m if schedule == "1f1b" else n * m)
    if schedule == "2bw":
        assert simulate(schedule_actions("2bw", p, m, 12, extra_warmup=extra), Costs(1, 1, 0, 0, 0), "2bw").steady_bubble == pytest.approx(0.0, abs=1e-12)


def test_extra_warmup_limits():
    with pytest.raises(ValueError, match=r"2bw with extra_warmup 1 needs num_microbatches >= num_stages \+ extra_warmup \(4 < 5\)"):
        schedule_actions("2bw", 4, 4, 2, extra_warmup=1)
    with pytest.raises(ValueError, match="extra_warmup applies to 1f1b and 2bw, not 'gpipe'"):
        schedule_actions("gpipe", 2, 4, 2, extra_warmup=1)
    with pytest.raises(ValueError, match="extra_warmup must be an integer >= 0"):
        schedule_actions("1f1b", 2, 4, 2, extra_warmup=-1)


def test_2bw_needs_enough_microbatches_and_pipedream_one():
    with pytest.raises(ValueError, match=r"2bw needs num_microbatches >= num_stages \(3 < 4\)"):
        schedule_actions("2bw", 4, 3, 2)
    schedule_actions("2bw", 4, 4, 2)  # the boundary is allowed
    with pytest.raises(ValueError, match=r"pipedream takes one optimizer step per microbatch: num_microbatches must be 1 \(got 2\)"):
        schedule_actions("pipedream", 2, 2, 3)
    with pytest.raises(ValueError, match="'zb' is not one of gpipe, 1f1b, zbh1, 2bw, pipedream"):
        schedule_actions("zb", 2, 2, 1)
    with pytest.raises(ValueError, match="num_stages must be an integer >= 1, got 0"):
        schedule_actions("1f1b", 0, 2, 1)


@pytest.mark.parametrize("p,m", [(1, 3), (2, 2), (2, 5), (3, 3), (4, 4), (4, 8)])
def test_bubble_fractions_with_unit_costs(p, m):
    unit = Costs(forward=1, backward=1, step=0, reduce=0, comm=0)
    for schedule in ("gpipe", "1f1b"):
        one = simulate(schedule_actions(schedule, p, m, 1), unit, schedule)
        assert one.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
        three = simulate(schedule_actions(schedule, p, m, 3), unit, schedule)
        assert three.makespan == pytest.approx(3 * 2 * (m + p - 1))  # flushed: every step pays the bubble
        assert three.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    for n in (3, 12):
        res = simulate(schedule_actions("2bw", p, m, n), unit, "2bw")
        assert res.steady_bubble == pytest.approx(0.0, abs=1e-12)
        assert res.bubble == pytest.approx((p - 1) / (n * m + p - 1), abs=1e-12)
        assert res.throughput == pytest.approx(n * m / (2 * (n * m + p - 1)))


def test_2bw_hides_the_reduction_that_sync_schedules_pay_every_step():
    p, m, n, f, b = 4, 6, 6, 1.0, 2.0
    slack = (m - p + 1) * (f + b)  # F/B pairs stage 0 runs between REDUCE(k) and STEP(k)
    run = lambda sched, r: simulate(schedule_actions(sched, p, m, n), Costs(f, b, 0, r), sched)
    base, hidden, over = run("2bw", 0), run("2bw", slack), run("2bw", slack + 1)
    assert hidden.steady_bubble == pytest.approx(0.0, abs=1e-12) and over.steady_bubble > 0.01
    assert hidden.makespan == pytest.approx(base.makespan + slack)  # only the window's last STEP waits
    assert run("1f1b", slack).makespan == pytest.approx(run("1f1b", 0).makespan + n * slack)


def test_pipedream_with_a_global_reduction_serializes_the_pipeline():
    p, n = 4, 16
    acts = schedule_actions("pipedream", p, 1, n)
    local = simulate(acts, Costs(1, 1), "pipedream", reduce_scope="stage")
    glob = simulate(acts, Costs(1, 1), "pipedream")
    assert local.steady_bubble == pytest.approx(0.0, abs=1e-12)
    assert glob.steady_bubble > 0.5  # stage p-1's STEP(k) waits for stage 0's backward of the same microbatch


def _versions(lists):
    return {(s, a.step, a.microbatch): a.version for s, lst in enumerate(lists) for a in lst if a.type in (T.F, T.B)}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_versions_do_not_depend_on_the_chunking(schedule):
    p, n = 4, 9
    m = 1 if schedule == "pipedream" else 4
    whole = schedule_actions(schedule, p, m, n)
    for sizes in ([1] * n, [2, 3, 4], [5, 1, 3], [4, 5]):
        got, k0 = {}, 0
        for size in sizes:
            part = schedule_actions(schedule, p, m, size, first_step=k0)
            simulate(part, Costs(), schedule, m)  # each window starts empty and ends drained
            for s, lst in enumerate(part):
                used = {a.version for a in lst if a.type == T.F}
                # versions a window needs from before it: at most version_lag behind the newest (k0)
                assert min(used) >= k0 - version_lag(schedule, s, p), (sizes, k0, s)
            got.update(_versions(part))
            k0 += size
        assert got == _versions(whole), sizes
    assert all(v == semantic_version(schedule, k, s, p) for (s, k, i), v in _versions(whole).items())


def test_peak_versions_and_inflight_activations():
    p, m = 4, 8
    gp = simulate(schedule_actions("gpipe", p, m, 3), Costs(), "gpipe")
    assert gp.peak_inflight == [m] * p and gp.peak_versions == [1] * p
    one = simulate(schedule_actions("1f1b", p, m, 3), Costs(), "1f1b")
    assert one.peak_inflight == [p - s for s in range(p)] and one.peak_versions == [1] * p
    two = simulate(schedule_actions("2bw", p, m, 5), Costs(), "2bw")
    assert two.peak_inflight == [p - s for s in range(p)]
    # current + shadow; the last stage finishes a step's microbatches before the late STEP: one suffices there
    assert two.peak_versions == [2] * (p - 1) + [1]
    later = simulate(schedule_actions("2bw", p, m, 3, first_step=5), Costs(), "2bw")  # a window holds k0-1 too
    assert later.peak_versions == [2] * p
    pd = simulate(schedule_actions("pipedream", p, 1, 12), Costs(), "pipedream")
    assert pd.peak_versions == [p - s for s in range(p)] and pd.peak_inflight == [p - s for s in range(p)]


def test_broken_lists_are_caught():
    acts = schedule_actions("1f1b", 2, 2, 1)
    idx = lambda lst, kind, n=0: [i for i, a in enumerate(lst) if a.type == kind][n]
    swapped = list(acts[1])  # stage 1 receives microbatch 1 before 0
    i, j = idx(swapped, T.RECV_ACT), idx(swapped, T.RECV_ACT, 1)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(ScheduleError, match=r"RECV_ACT0\.1<0, but the next message from stage 0 is SEND_ACT0\.0"):
        simulate([acts[0], swapped])
    early = list(acts[0])  # stage 0 waits for a gradient before sending the activation stage 1 needs
    early.insert(0, early.pop(idx(early, T.RECV_GRAD)))
    with pytest.raises(ScheduleError, match=r"(?s)deadlock.*stage 0 @   0: \[RECV_GRAD0\.0<1\]  <-- ERROR HERE.*"
                                            r"stage 1 @   0: \[RECV_ACT0\.0<0\]  <-- ERROR HERE"):
        simulate([early, acts[1]])
    no_b = [a for a in acts[1] if not (a.type in (T.B, T.SEND_GRAD) and a.microbatch == 1)]
    with pytest.raises(ScheduleError):
        simulate([acts[0], no_b])
    stale = [Action(T.B, a.step, a.microbatch, 7) if a.type == T.B and a.microbatch == 1 else a for a in acts[0]]
    with pytest.raises(ScheduleError, match="its forward used version 0"):
        simulate([stale, acts[1]])
    future = [Action(T.F, 0, a.microbatch, 1) if a.type == T.F else a for a in acts[1]]
    with pytest.raises(ScheduleError, match="uses version 1, only 0 exists"):
        simulate([acts[0], future])
    with pytest.raises(ScheduleError, match="never received"):
        simulate([acts[0] + [Action(T.SEND_ACT, 0, 0, peer=1)], acts[1]])


def test_collectives_and_updates_out_of_order_are_caught():
    acts = schedule_actions("2bw", 2, 2, 3)
    assert [str(a) for a in acts[1][-3:]] == ["REDUCE2", "STEP1", "STEP2"]
    late = [list(lst) for lst in acts]  # the last two updates swapped
    late[1][-2:] = late[1][-1:-3:-1]
    with pytest.raises(ScheduleError, match="STEP2 but the stage holds version 1: STEP1 must come next"):
        simulate(late)
    swapped = [list(lst) for lst in acts]  # stage 1 posts step 1's reduction before step 0's
    s1 = swapped[1]
    s1.remove(Action(T.REDUCE, 0))
    s1.insert(s1.index(Action(T.REDUCE, 1)) + 1, Action(T.REDUCE, 0))
    with pytest.raises(ScheduleError, match=r"reduction #0 is step \d here but step \d on stage \d \(collectives out of order\)"):
        simulate(swapped)
    early = [list(lst) for lst in acts]  # an update before its step's reduction was posted
    early[0].remove(Action(T.STEP, 0))
    early[0].insert(0, Action(T.STEP, 0))
    with pytest.raises(ScheduleError, match="STEP0 before REDUCE0"):
        simulate(early)


def test_sends_waited_in_place_deadlock_1f1b_but_not_gpipe():
    """Why the executor must not wait() an isend before its next receive (gloo completes it only on receipt)."""
    with pytest.raises(ScheduleError, match="blocking send waits for stage 1 to receive it"):
        simulate(schedule_actions("1f1b", 2, 2, 1), blocking_sends=True)
    for schedule in ("2bw", "pipedream"):
        with pytest.raises(ScheduleError, match="deadlock"):
            simulate(schedule_actions(schedule, 3, 1 if schedule == "pipedream" else 3, 2), blocking_sends=True)
    simulate(schedule_actions("gpipe", 3, 4, 2), blocking_sends=True)


def test_costs_as_dataclass_dict_callable_or_measured():
    acts = schedule_actions("2bw", 3, 4, 3)
    ref = simulate(acts, Costs(forward=[1, 2, 1], backward=2, step=0.5, comm=0.25))
    by_dict = simulate(acts, {"F": [1, 2, 1], "backward": 2, "STEP": 0.5, "comm": 0.25})

    def fn(a, s):
        return {T.F: [1, 2, 1][s], T.B: 2.0, T.STEP: 0.5, T.RECV_ACT: 0.25, T.RECV_GRAD: 0.25}.get(a.type, 0.0)

    by_fn = simulate(acts, fn)
    assert ref.makespan == by_dict.makespan == by_fn.makespan and ref.timeline == by_fn.timeline
    assert ref.makespan > simulate(acts, Costs(forward=[1, 2, 1], backward=2, step=0.5)).makespan  # latency counts
    measured = Costs.from_measured({"F": 8.0, "B": 12.0, "STEP": 1.0, "SEND_ACT": 0.1},
                                   {"F": 8, "B": 6, "STEP": 2, "SEND_ACT": 8})
    assert (measured.forward, measured.backward, measured.step) == (1.0, 2.0, 0.5)
    per_stage = Costs.from_measured([{"F": 2.0}, {"F": 6.0}], [{"F": 2}, {"F": 3}])
    assert per_stage.forward == [1.0, 2.0]
    with pytest.raises(ValueError, match="unknown cost 'fwd'"):
        simulate(acts, {"fwd": 1})


def test_action_strings_round_trip():
    for schedule in SCHEDULES:
        lists = schedule_actions(schedule, 3, 1 if schedule == "pipedream" else 3, 2)
        for lst in lists:
            for a in lst:
                assert Action.from_str(str(a)) == a
        assert parse_actions(format_actions(lists)) == lists
    assert [str(a) for a in schedule_actions("1f1b", 2, 1, 1)[1]] == [
        "RECV_ACT0.0<0", "F0.0@v0", "B0.0@v0", "SEND_GRAD0.0>0", "REDUCE0", "STEP0"]
    assert Action.from_str("F3.1@v2") == Action(T.F, 3, 1, 2)
    for bad in ("F3.1", "SEND_ACT3.1<2", "STEP3.1", "X1", "REDUCE3@v1", "RECV_GRAD2.0"):
        with pytest.raises(ValueError):
            Action.from_str(bad)


def test_plot_timeline_writes_a_png(tmp_path):
    res = simulate(schedule_actions("2bw", 2, 2, 3), Costs(1, 2, 0.5))
    assert not math.isnan(res.steady_bubble)
    for what in (res, res.timeline):
        out = plot_timeline(what, str(tmp_path / "t.png"), "2bw")
        with open(out, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_one_steady_step_is_the_schedules_period_and_its_picture_stays_readable(tmp_path):
    """The window ``plan`` draws is one step of the steady state, whose length is known by hand: 2BW keeps every
    stage busy, m (F + B) + STEP; a flushed 1F1B adds its fill and drain, (m + p - 1)(F + B) + STEP. At a planned
    recipe's 64 microbatches x 8 stages the picture keeps a fixed, readable size (the whole run's would be a blur
    of 8 x 128 x 8 bars), with each row's idle share written beside it."""
    from PIL import Image

    m, p = 8, 4
    for name, period in (("2bw", m * 3 + 0.5), ("1f1b", (m + p - 1) * 3 + 0.5)):
        res = simulate(schedule_actions(name, p, m, 8), Costs(1, 2, 0.5), name, m)
        t0, t1 = steady_step(res)
        assert t1 - t0 == period and 0 < t0 < res.makespan - period
    assert steady_step(simulate(schedule_actions("2bw", p, m, 1), Costs(1, 2, 0.5), "2bw", m)) is None
    work = {T.F: 1.0, T.B: 2.0, T.STEP: 0.5}  # transfers and reductions free
    heavy = lambda a, stage: work.get(a.type, 0.0) * (1.25 if stage == 6 and a.type != T.STEP else 1.0)
    res = simulate(schedule_actions("2bw", 8, 64, 8), heavy, "2bw", 64)
    window = steady_step(res)
    shares = step_shares(step_timeline(res, window), window[1] - window[0])
    busy = [sum(x) for x in zip(*shares.values())]
    # stage 6, 1.25x the work, sets the pace: the others idle a fifth of each step but for their (equal) STEP
    assert math.isclose(busy[6], 1.0) and all(math.isclose(1 - b, 0.2 * (1 - 0.5 / (window[1] - window[0])))
                                              for s, b in enumerate(busy) if s != 6), busy
    out = plot_steady_step(res, str(tmp_path / "moe.png"), "2bw on 8 stages, 64 microbatches per step")
    width, height = Image.open(out).size
    assert width <= 16 * 110 and height <= 6 * 110  # 16 x 6 inches at most, at 110 dpi


# ---------------------------------------------------------------------------- NCCL's ordering rule


def _accepts(schedule, p, m):
    try:
        get_schedule(schedule).check(p, m)
    except ValueError:
        return False
    return True


# (schedule, p, m, steps): every m in {p, 2p, 64} a schedule accepts, 3 steps; pipedream takes m = 1 only, so it runs
# 3 steps and 3p steps (one microbatch each: the latter reaches its steady state)
NCCL_GRID = [(s, p, m, 3) for s in SCHEDULES for p in (2, 3, 4, 8, 16) for m in sorted({p, 2 * p, 64}) if _accepts(s, p, m)] + [
    ("pipedream", p, 1, n) for p in (2, 3, 4, 8, 16) for n in sorted({3, 3 * p})]
ONE_COMMUNICATOR = lambda src, dst: "world"  # the old executor: every transfer on the world group


@pytest.mark.parametrize("schedule,p,m,n", NCCL_GRID)
def test_every_schedule_obeys_nccl_ordering_on_per_direction_channels(schedule, p, m, n):
    """Per-direction communicators with the executor's prefetch: no deadlock, and at comm = 0 the same timeline."""
    acts = schedule_actions(schedule, p, m, n)
    plain = simulate(acts, Costs(), schedule, m)
    res = simulate(acts, Costs(), schedule, m, nccl=True)
    assert res.makespan == plain.makespan and res.timeline == plain.timeline
    # with latency: posting every receive at its RECV action is the plain model; prefetching hides some latency
    slow = Costs(forward=1, backward=2, comm=0.25)
    ref = simulate(acts, slow, schedule, m)
    assert simulate(acts, slow, schedule, m, nccl=True, prefetch=False).makespan == pytest.approx(ref.makespan)
    assert simulate(acts, slow, schedule, m, nccl=True).makespan <= ref.makespan + 1e-9


@pytest.mark.parametrize("schedule,p", [(s, p) for s in SCHEDULES for p in (2, 4, 8)])
def test_one_communicator_for_both_directions_deadlocks_every_schedule_the_bug_per_direction_channels_fix(schedule, p):
    """The executor before ``channels``: activations and gradients on the world group. The prefetched receive of
    each stage stands in front of its next send on the one NCCL stream per pair, and its neighbour's stands in front
    of the send it waits for: two receives at the heads, a hang gloo never shows."""
    m = 1 if schedule == "pipedream" else p
    acts = schedule_actions(schedule, p, m, 3)
    with pytest.raises(ScheduleError, match=r"(?s)^deadlock.*'world'.*two receives wait for each other"):
        simulate(acts, nccl=True, channel=ONE_COMMUNICATOR)
    simulate(acts, nccl=True)  # the same lists on per-direction channels
    # without the prefetch only GPipe survives one communicator: in 1F1B a stage's send to its neighbour and the
    # neighbour's send back meet at the heads, and an unbuffered send completes only with its receive
    if schedule == "gpipe":
        simulate(acts, nccl=True, channel=ONE_COMMUNICATOR, prefetch=False)
    else:
        with pytest.raises(ScheduleError, match=r"(?s)^deadlock.*two sends wait for each other"):
            simulate(acts, nccl=True, channel=ONE_COMMUNICATOR, prefetch=False)


def test_a_prefetched_receive_ahead_of_a_send_deadlocks_one_communicator_and_not_two():
    """Stage 1's prefetch posts RECV_ACT0.1 ahead of its SEND_GRAD0.0, and stage 0 posts RECV_GRAD0.0 ahead of its
    SEND_ACT0.1: on one communicator each head is a receive waiting for the send queued behind the other's."""
    acts = parse_actions("""
        stage 0: F0.0@v0 SEND_ACT0.0>1 RECV_GRAD0.0<1 B0.0@v0 F0.1@v0 SEND_ACT0.1>1 RECV_GRAD0.1<1 B0.1@v0 REDUCE0 STEP0
        stage 1: RECV_ACT0.0<0 F0.0@v0 B0.0@v0 SEND_GRAD0.0>0 RECV_ACT0.1<0 F0.1@v0 B0.1@v0 SEND_GRAD0.1>0 REDUCE0 STEP0
    """)
    ref = simulate(acts, Costs(), None, 2)
    with pytest.raises(ScheduleError) as err:
        simulate(acts, nccl=True, channel=ONE_COMMUNICATOR)
    assert str(err.value) == """\
deadlock: no stage can go on
stage 0 @   2: F0.0@v0 SEND_ACT0.0>1 [RECV_GRAD0.0<1]  <-- ERROR HERE: waits for SEND_GRAD0.0 from stage 1: \
RECV_GRAD0.0<1 (posted here) heads 'world' to stage 1; stage 1's head there is RECV_ACT0.1<0 (two receives wait for \
each other)
stage 1 @   4: RECV_ACT0.0<0 F0.0@v0 B0.0@v0 SEND_GRAD0.0>0 [RECV_ACT0.1<0]  <-- ERROR HERE: waits for SEND_ACT0.1 \
from stage 0: RECV_ACT0.1<0 (prefetched at @0 after RECV_ACT0.0<0) heads 'world' to stage 0; stage 0's head there is \
RECV_GRAD0.0<1 (two receives wait for each other); behind it: SEND_GRAD0.0>0"""
    for kw in ({}, {"channel": ONE_COMMUNICATOR, "prefetch": False}):  # per-direction channels, or no prefetch
        assert simulate(acts, Costs(), None, 2, nccl=True, **kw).timeline == ref.timeline


def test_nccl_mode_catches_what_the_plain_one_does():
    acts = schedule_actions("1f1b", 2, 2, 1)
    swapped = list(acts[1])  # stage 1 receives microbatch 1 before 0: the heads do not match
    i, j = [k for k, a in enumerate(swapped) if a.type == T.RECV_ACT]
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(ScheduleError, match=r"RECV_ACT0\.1<0, but the next message from stage 0 is SEND_ACT0\.0 "
                                            r"\(receives out of send order; on \('act', 0\)\)"):
        simulate([acts[0], swapped], nccl=True)
    with pytest.raises(ScheduleError, match=r"never received, first SEND_ACT0\.0>1 \(on \('act', 0\)\)"):
        simulate([acts[0] + [Action(T.SEND_ACT, 0, 0, peer=1)], acts[1]], nccl=True)
    far = [[Action(T.SEND_ACT, 0, 0, peer=2)], [], [Action(T.RECV_ACT, 0, 0, peer=0)]]
    with pytest.raises(ScheduleError, match="no communicator for 0 -> 2: stages 0 and 2 are not adjacent"):
        simulate(far, nccl=True)
    # a send waited in place completes once its receive is posted: the prefetch posts it before the RECV action
    three = schedule_actions("1f1b", 3, 3, 2)
    simulate(three, nccl=True, blocking_sends=True)
    with pytest.raises(ScheduleError, match=r"(?s)^deadlock.*blocking send waits for its receive"):
        simulate(three, nccl=True, blocking_sends=True, prefetch=False)


# ---------------------------------------------------------------------------- planner search


def _search_recipe(layers: int, **pipeline):
    from hf_asyncpp.config.recipe import recipe_from_dict

    return recipe_from_dict({"model": {"config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                                  "num_hidden_layers": layers, "num_attention_heads": 4,
                                                  "num_key_value_heads": 2, "max_position_embeddings": 64},
                                       "vocab_size": 256},
                             "data": {"seq_len": 32},
                             "pipeline": {"schedule": "2bw", "num_stages": 4, "num_microbatches": 8,
                                          "microbatch_size": 2, **pipeline},
                             "optimizer": {"name": "adamw"}})


def test_search_never_returns_a_plan_over_memory():
    from hf_asyncpp.plan.search import search_plans

    r = _search_recipe(4, num_stages=2)
    everything = search_plans(r, 4, cap=1e12, flops_per_s=1e9, link_bytes_per_s=1e12)
    assert everything and all(c.feasible for c in everything if c.runnable)
    cap = sorted(c.memory for c in everything)[len(everything) // 2] / 0.9  # half the plans fit
    cands = search_plans(r, 4, cap=cap, flops_per_s=1e9, link_bytes_per_s=1e12)
    feasible = [c for c in cands if c.feasible]
    assert 0 < len(feasible) < len(cands)
    assert all(c.memory <= 0.9 * cap for c in feasible)
    assert cands[: len(feasible)] == feasible  # feasible first, each by simulated speed
    speeds = [round(c.tokens_per_s, 3) for c in feasible]
    assert speeds == sorted(speeds, reverse=True)
    for c in cands:  # every plan trains the recipe's global batch: 8 microbatches x 2 sequences x 4 / 2 replicas
        assert c.num_microbatches * c.microbatch_size * c.dp == 32 and c.num_stages * c.dp == 4
        assert not c.runnable or c.num_microbatches >= c.num_stages  # 2bw's m >= p


def test_search_prefers_an_even_stage_count_when_the_simulator_says_it_is_faster():
    """12 layers on 8 GPUs: 8 stages cannot split 12 layers evenly (four stages hold 2 layers, 1.33x the mean), so 4
    stages of 3 layers x 2 replicas (or 2 x 6 x 4) are faster; the search finds that by simulation."""
    from hf_asyncpp.plan.memory import meta_model
    from hf_asyncpp.plan.search import evaluate_plan, search_plans

    r = _search_recipe(12, num_stages=4, num_microbatches=8)
    cands = search_plans(r, 8, cap=1e12, flops_per_s=1e9, link_bytes_per_s=1e15)
    best = cands[0]
    assert 12 % best.num_stages == 0 and len(set(best.layers_per_stage)) <= 2
    model = meta_model(r)
    eight = [c for c in cands if c.num_stages == 8 and c.feasible]
    assert eight and max(c.tokens_per_s for c in eight) < best.tokens_per_s
    assert max(eight, key=lambda c: c.tokens_per_s).layers_per_stage.count(2) >= 2
    same = evaluate_plan(r, model, best.num_stages, best.dp, best.num_microbatches, best.microbatch_size,
                    best.layers_per_stage, 1e12, 1e9, 1e15)
    assert same.tokens_per_s == pytest.approx(best.tokens_per_s)


@pytest.mark.parametrize("p", [2, 4])
def test_2bw_reduction_has_m_minus_p_plus_1_pairs_of_slack(p):
    """At m = p a step's reduction (data-parallel all-reduce, tied sum, global norm) hides behind exactly one
    forward/backward pair of stage 0, the last stage to finish the step's backwards: STEP{k} cannot move later (step
    k+2's first forward needs the version it writes) and REDUCE{k} cannot move earlier (it sums the step's last
    backward). Longer reductions stall every stage by the excess, one more microbatch per step buys one more pair."""
    from hf_asyncpp.plan.search import steady_step_time

    f, b = 1.0, 2.0
    for m in (p, p + 1):
        slack = (m - p + 1) * (f + b)
        base, _ = steady_step_time(TWO_BW, p, m, Costs(forward=f, backward=b), "global")
        assert base == pytest.approx(m * (f + b))
        for r in (0.5 * slack, slack, slack + 1.0, slack + 4.0):
            step, _ = steady_step_time(TWO_BW, p, m, Costs(forward=f, backward=b, reduce=r), "global")
            assert step == pytest.approx(base + max(0.0, r - slack)), (m, r)


def test_search_reports_the_reduction_stall_of_a_slow_link():
    """A data-parallel all-reduce slower than 2BW's slack shows as a stall (and slows the plan); at a fast link none."""
    from hf_asyncpp.plan.memory import meta_model
    from hf_asyncpp.plan.search import evaluate_plan, reduction_stall

    r = _search_recipe(4, num_stages=2, num_microbatches=2)
    model = meta_model(r)
    fast = evaluate_plan(r, model, 2, 2, 2, 2, None, 1e12, 1e9, 1e15)
    slow = evaluate_plan(r, model, 2, 2, 2, 2, None, 1e12, 1e9, 1e5)
    assert reduction_stall(r, fast) == 0.0
    stall = reduction_stall(r, slow)  # m = p: one forward/backward pair of stage 0 (and its transfers) hides a little
    assert 0.5 * max(slow.costs.reduce) < stall < max(slow.costs.reduce)


def test_a_reduction_on_the_compute_stream_hands_2bw_s_gain_back():
    """F = 1, B = 2, reductions free: 2BW at p = 4, m = 8 takes 24 per step against 1F1B's 33 when its reduction is
    off the compute stream (only STEP waits for it), and 30 when the compute stream waits for it at REDUCE (what a
    synchronous NCCL collective does): its STEP cannot start before stage 0 posted the same reduction. At p = 8: 24
    and 38 against 45. A reduction of 2 per step costs 2BW nothing off the stream."""
    from hf_asyncpp.plan.search import steady_step_time
    from hf_asyncpp.schedules.records import ONE_F_ONE_B, TWO_BW

    free, costly = Costs(forward=1, backward=2), Costs(forward=1, backward=2, reduce=2.0)
    step = lambda sched, p, c, on=False: steady_step_time(sched, p, 8, c, "global", reduce_on_compute_stream=on)[0]
    assert (step(TWO_BW, 4, free), step(TWO_BW, 4, free, True), step(ONE_F_ONE_B, 4, free)) == (24, 30, 33)
    assert (step(TWO_BW, 8, free), step(TWO_BW, 8, free, True), step(ONE_F_ONE_B, 8, free)) == (24, 38, 45)
    assert step(TWO_BW, 4, costly) == 24 and step(ONE_F_ONE_B, 4, costly) == 35


def torch_zero_bubble_order(rank: int, p: int, m: int) -> list[tuple[str, int]]:
    """torch.distributed.pipelining's ZB1P order for one stage per rank (``ScheduleInterleavedZeroBubble``'s
    ``_calculate_single_rank_operations`` with n_local_stages=1), computed by torch's own functions."""
    from torch.distributed.pipelining.schedules import _get_1f1b_rank_ops, _get_warmup_ops

    rounds = max(1, m // p)
    warmup = _get_warmup_ops(rank, 1, m // rounds, p, m, multiply_factor=1)
    ops = _get_1f1b_rank_ops(1, p, warmup, m - warmup, warmup, rank, lambda step: rank, lambda step: rank,
                             num_1f1b_microbatches=rank, enable_zero_bubble=True)
    return [(a.computation_type.value, a.microbatch_index) for a in ops if a is not None]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8, 16])
def test_zb_h1_is_torchs_zero_bubble_order_and_simulates_clean(p):
    """Per stage, the order of F, I and W is torch's for every m up to 64 (m a multiple of the rounds torch
    needs); every list runs in the simulator under NCCL's rule, each step's REDUCE after its last W."""
    for m in sorted({1, 2, p - 1, p, p + 1, 2 * p, 3 * p, 64} - {0}):
        if m > 64 or m % max(1, m // p):
            continue
        acts = schedule_actions("zbh1", p, m, 2)
        simulate(acts, Costs(1, 2), "zbh1", m, nccl=True)
        for s, lst in enumerate(acts):
            ours = [(a.type.value, a.microbatch) for a in lst if a.type in (T.F, T.I, T.W) and a.step == 0]
            assert ours == torch_zero_bubble_order(s, p, m), (p, m, s)


def representative_actions(name: str, p: int, m: int):
    """A schedule's lists at (p, m), at the microbatch count and steps it runs with (PipeDream: 1 per step)."""
    sched = SCHEDULES[name]
    m, steps = sched.representative(p, m)
    return sched.actions(p, m, steps), sched


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_balanced_stages_have_no_imbalance_and_all_their_bubble_is_fill_drain(name):
    acts, sched = representative_actions(name, 4, 8)
    res = simulate(acts, Costs(forward=1, backward=2, step=0.5), sched)
    assert res.bubble > 0.01  # a window's fill and drain
    assert res.imbalance == pytest.approx(0.0, abs=1e-12)
    assert res.fill_drain == pytest.approx(res.bubble, abs=1e-12)


@pytest.mark.parametrize("p,m", [(2, 3), (4, 6), (3, 8)])
def test_gpipe_imbalance_is_the_closed_form(p, m):
    """GPipe with unequal stages is a flow shop of m identical jobs, forwards then backwards: the step takes
    sum F + (m - 1) max F + sum B + (m - 1) max B, a stage works m (F + B), so its imbalance is
    m sum(max c - c) / (p x makespan) with c = F + B, and fill/drain is the busiest stage's idle 1 - m max c / makespan."""
    fwd = [1.0 + (3 * s) % (p + 1) for s in range(p)]  # unequal; the slowest stage in the middle at p = 3
    bwd = [2 * f + 0.5 * s for s, f in enumerate(fwd)]
    res = simulate(schedule_actions("gpipe", p, m, 1), Costs(forward=fwd, backward=bwd), "gpipe")
    makespan = sum(fwd) + (m - 1) * max(fwd) + sum(bwd) + (m - 1) * max(bwd)
    work = [f + b for f, b in zip(fwd, bwd)]
    assert res.makespan == pytest.approx(makespan)
    assert res.imbalance == pytest.approx(m * sum(max(work) - c for c in work) / (p * makespan), abs=1e-12)
    assert res.fill_drain == pytest.approx(1 - m * max(work) / makespan, abs=1e-12)
    assert res.imbalance > 0.05


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_bubble_parts_sum_to_the_idle_share_of_the_timeline(name):
    """Unequal F, B, I, W and STEP per stage, transfers and a reduction that take time: fill/drain + imbalance is the
    idle share of stage-time counted from the timeline's intervals, both parts non-negative."""
    p = 4
    acts, sched = representative_actions(name, p, 8)
    costs = Costs(forward=[1.0, 1.5, 0.8, 1.2], backward=[2.1, 2.9, 1.7, 2.6], step=[0.3, 0.1, 0.2, 0.4],
                  backward_input=[1.0, 1.6, 0.7, 1.1], backward_weight=[1.2, 1.1, 1.0, 1.4], comm=0.05, reduce=0.2)
    res = simulate(acts, costs, sched)
    busy = [sum(iv.end - iv.start for iv in tl) for tl in res.timeline]
    assert res.bubble == pytest.approx(1 - sum(busy) / (p * res.makespan), abs=1e-12)
    assert res.fill_drain + res.imbalance == pytest.approx(res.bubble, abs=1e-12)
    assert res.imbalance > 0 and res.fill_drain > 0
    assert res.imbalance == pytest.approx(sum(max(busy) - b for b in busy) / (p * res.makespan), abs=1e-12)


def test_2bw_steady_state_bubble_is_all_imbalance():
    """In steady state 2BW keeps its slowest stage always busy (no flush): what idles is the other stages waiting for
    it, all imbalance; a flushed 1F1B also pays fill/drain every step."""
    from hf_asyncpp.plan.search import steady_state

    fwd = [1.0, 3.0, 2.0, 1.0]
    costs = Costs(forward=fwd, backward=[2 * f for f in fwd])
    step, two_bw = steady_state(TWO_BW, 4, 8, costs, "global")
    work = [3 * f for f in fwd]
    assert step == pytest.approx(8 * max(work))
    assert two_bw.fill_drain == pytest.approx(0.0, abs=1e-12)
    assert two_bw.imbalance == pytest.approx(sum(max(work) - c for c in work) / (4 * max(work)), abs=1e-12)
    _, one = steady_state(get_schedule("1f1b"), 4, 8, costs, "global")
    assert one.fill_drain > 0.05 and one.total == pytest.approx(one.fill_drain + one.imbalance)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (8, 16), (16, 64)])
def test_zb_h1_cool_down_filled_by_the_weight_gradients(p, m):
    """With F = I = W (B = 2F), 1F1B's flushed step is m(F+B) + (p-1)(F+B); ZB-H1's bubble is (p-1)(F+I-W), a third
    of it (the paper's ZB-H1), at 1F1B's peak of p microbatches in flight at stage 0."""
    f, n = 1.0, 3
    one = simulate(schedule_actions("1f1b", p, m, n), Costs(f, 2 * f), "1f1b")
    zb = simulate(schedule_actions("zbh1", p, m, n), Costs(f, 2 * f), "zbh1")
    assert one.makespan == pytest.approx(n * (3 * m * f + (p - 1) * 3 * f))
    assert zb.makespan == pytest.approx(n * (3 * m * f + (p - 1) * f))
    assert max(zb.peak_inflight) == max(one.peak_inflight) == min(p, m)
    # measured costs: an I and W that are not half of B each move the balance
    uneven = simulate(schedule_actions("zbh1", p, m, n), Costs(f, 2 * f, backward_input=1.2, backward_weight=0.8), "zbh1")
    assert uneven.makespan == pytest.approx(n * (3 * m * f + (p - 1) * (f + 1.2 - 0.8)))


def test_a_split_backward_broken_is_caught():
    lists = parse_actions("stage 0: F0.0@v0 W0.0@v0 REDUCE0 STEP0")
    with pytest.raises(ScheduleError, match=r"W of \(0, 0\) before its I"):
        simulate(lists)
    lists = parse_actions("stage 0: F0.0@v0 I0.0@v0 REDUCE0 STEP0")
    with pytest.raises(ScheduleError, match=r"I without its W"):
        simulate(lists)
    lists = parse_actions("stage 0: F0.0@v0 I0.0@v0 B0.0@v0 REDUCE0 STEP0")
    with pytest.raises(ScheduleError, match=r"B of \(0, 0\) after its I"):
        simulate(lists)


@pytest.mark.parametrize("name", [*SCHEDULES, *VIRTUAL_SCHEDULES])
def test_a_record_says_whether_its_backward_is_split(name):
    """``Schedule.split_backward`` (what the recipe check asks) is whether its lists hold I and W actions."""
    sched = get_schedule(name)
    m, steps = sched.representative(4, 8)
    kinds = {a.type for lst in sched.actions(4, m, steps) for a in lst}
    assert sched.split_backward == (T.I in kinds) == (T.W in kinds), (name, kinds)


def test_checkpointed_costs_charge_one_forward_per_backward_pass():
    """With activation checkpointing each backward pass replays its layers' forward, as the executor runs it (the
    replays tests/test_zero_bubble.py counts): one per B; in ZB-H1 one in the I and one in the W of every stage
    after the first, and one in the first stage's W (its whole backward; its I does nothing)."""
    fwd, p, m, steps = [1.0, 2.0, 3.0], 3, 4, 2
    plain = Costs(forward=fwd, backward=[2 * f for f in fwd])
    measured = Costs(forward=fwd, backward=[2 * f for f in fwd], backward_input=[0.0, 1.5, 2.5],
                     backward_weight=[2.0, 3.0, 4.0])  # MeasuredCosts.stage_costs: the first stage's I is 0
    for costs in (plain, measured):
        for name, replays in (("1f1b", [1, 1, 1]), ("zbh1", [1, 2, 2])):
            acts = schedule_actions(name, p, m, steps)
            a, b = simulate(acts, costs, name), simulate(acts, costs.checkpointed(), name)
            for s in range(p):
                assert b.busy[s] - a.busy[s] == pytest.approx(steps * m * replays[s] * fwd[s]), (name, s)
    assert Costs(forward=1.0, backward=2.0).checkpointed() == Costs(forward=1.0, backward=3.0, backward_input=2.0,
                                                                      backward_weight=2.0)


def test_the_planner_charges_checkpointings_replays():
    """``simulate_schedules`` on a recipe with ``training.gradient_checkpointing``: each stage's compute grows by one
    forward per 1F1B backward and by two per ZB-H1 backward after the first stage (``Costs.checkpointed``)."""
    import dataclasses

    from hf_asyncpp.config.recipe import recipe_from_dict
    from hf_asyncpp.plan.memory import meta_model, plan_memory
    from hf_asyncpp.plan.search import PLANNED_STEPS, flops_costs, planned_microbatches, simulate_schedules

    recipe = recipe_from_dict({"model": {"config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                                    "num_hidden_layers": 6, "num_attention_heads": 4,
                                                    "num_key_value_heads": 2, "vocab_size": 256}},
                               "data": {"seq_len": 32},
                               "pipeline": {"schedule": "1f1b", "num_stages": 3, "num_microbatches": 4,
                                            "microbatch_size": 2}})
    ckpt = dataclasses.replace(recipe, training=dataclasses.replace(recipe.training, gradient_checkpointing=True))
    model = meta_model(recipe)
    plan, _, _ = plan_memory(recipe, 3, model)
    plain, checkpointed = simulate_schedules(plan, recipe, 3, 1e12), simulate_schedules(plan, ckpt, 3, 1e12)
    fwd, m = flops_costs(plan, recipe, 1e12).forward, planned_microbatches(recipe, 3)
    for name, replays in (("1f1b", [1, 1, 1]), ("zbh1", [1, 2, 2]), ("2bw", [1, 1, 1])):
        for s in range(3):
            grown = checkpointed[name].busy[s] - plain[name].busy[s]
            assert grown == pytest.approx(PLANNED_STEPS * m * replays[s] * fwd[s]), (name, s)


# ---------------------------------------------------------------------------- the vocabulary layers shared by every stage

VOCAB_GRID = [(s, p, m) for s in ("gpipe", "1f1b", "zbh1", "2bw") for p in (2, 3, 4, 8) for m in (1, 2, 3, 5, 8, 16)
              if valid(s, p, m) and p <= 4 or (p == 8 and m == 16)]


@pytest.mark.parametrize("schedule,p,m", VOCAB_GRID)
def test_vocab_passes_run_in_every_one_stage_schedule_without_deadlock(schedule, p, m):
    """With the vocabulary layers shared by every stage each stage runs one VOCAB per microbatch, in microbatch order,
    on the step's version, before the step's REDUCE; the last stage between F and B of the microbatch. The simulator
    runs the lists under gloo's and NCCL's rules (it raises on a deadlock or any order it refuses), and the text form
    round-trips."""
    for extra in (0, 1) if schedule in ("1f1b", "2bw") and valid(schedule, p, m + 1) and m >= p + 1 else (0,):
        acts = schedule_actions(schedule, p, m, 3, extra_warmup=extra, vocab_parallel=True)
        for nccl in (False, True):
            simulate(acts, Costs(forward=1, backward=2, vocab=0.5, comm=0.1), schedule, m, nccl=nccl)
        assert parse_actions(format_actions(acts)) == acts
        plain = schedule_actions(schedule, p, m, 3, extra_warmup=extra)
        for s, lst in enumerate(acts):
            vocab = [a for a in lst if a.type == T.VOCAB]
            assert [(a.step, a.microbatch) for a in vocab] == [(k, i) for k in range(3) for i in range(m)]
            assert all(a.version == semantic_version(schedule, a.step, s, p) for a in vocab)
            # the same computations, transfers, reductions and updates as without, some forwards earlier
            assert sorted(map(str, (a for a in lst if a.type != T.VOCAB))) == sorted(map(str, plain[s]))
            if s == p - 1:
                for a in vocab:
                    at = lst.index(a)
                    assert lst[at - 1].type == T.F and (lst[at - 1].step, lst[at - 1].microbatch) == (a.step, a.microbatch)


@pytest.mark.parametrize("schedule", ["1f1b", "2bw", "zbh1", "gpipe"])
def test_vocab_passes_cost_little_more_than_their_own_time_with_enough_microbatches(schedule):
    """A VOCAB is a barrier of every stage; the orders run p-1-s more forwards ahead (``records.vocab_warmup``) so
    that no forward or backward waits within one interval between two barriers for its neighbour's of the same
    interval. With m = 4p the step takes at most 17% more than the plain schedule plus the VOCABs' own time (the
    contract's first placement, without the deeper warm-up, took 3x at 8 stages), and stage s holds at most
    2 (p-1-s) + 1 microbatches in flight (ZB-H1: + the s whose W trails)."""
    p, m, v = 4, 16, 0.3
    plain = simulate(schedule_actions(schedule, p, m, 3), Costs(forward=1, backward=2), schedule)
    shared = simulate(schedule_actions(schedule, p, m, 3, vocab_parallel=True), Costs(forward=1, backward=2, vocab=v),
                      schedule)
    assert shared.makespan <= 1.17 * (plain.makespan + 3 * m * v)
    if schedule != "gpipe":
        trail = (lambda s: s) if schedule == "zbh1" else (lambda s: 0)
        assert all(n <= 2 * (p - 1 - s) + 1 + trail(s) for s, n in enumerate(shared.peak_inflight))


def test_a_vocab_pass_starts_when_every_stage_reached_it_and_ends_together():
    """The collective's timing: every stage's VOCAB j starts at the latest arrival and ends after the slowest stage's
    shard plus the broadcast and the reduce (2 x comm unless ``vocab_comm`` is given)."""
    acts = schedule_actions("1f1b", 3, 4, 1, vocab_parallel=True)
    for costs, latency in ((Costs(forward=1, backward=2, vocab=[0.2, 0.5, 0.3], comm=0.1), 0.2),
                           (Costs(forward=1, backward=2, vocab=0.4, comm=0.1, vocab_comm=0.05), 0.05)):
        res = simulate(acts, costs, "1f1b")
        spans = {}
        for s, tl in enumerate(res.timeline):
            for iv in tl:
                if iv.action.type == T.VOCAB:
                    spans.setdefault(iv.action.microbatch, set()).add((round(iv.start, 9), round(iv.end, 9)))
        slowest = max(costs.vocab) if isinstance(costs.vocab, list) else costs.vocab
        for i, span in spans.items():
            assert len(span) == 1, (i, span)  # every stage: the same start and end
            (start, end), = span
            assert end - start == pytest.approx(slowest + latency)


def _swap(lst, a, b):
    lst = list(lst)
    i, j = lst.index(a), lst.index(b)
    lst[i], lst[j] = lst[j], lst[i]
    return lst


def test_simulator_refuses_vocab_passes_out_of_order_or_missing():
    """The checks of the VOCAB passes, each on a list broken one way."""
    acts = schedule_actions("1f1b", 2, 3, 2, vocab_parallel=True)
    v = lambda s, i, k=0: next(a for a in acts[s] if a.type == T.VOCAB and (a.step, a.microbatch) == (k, i))
    cases = {
        "collectives out of order": [_swap(acts[0], v(0, 0), v(0, 1)), acts[1]],
        "before VOCAB0.0": [acts[0], _swap(acts[1], v(1, 0), next(a for a in acts[1] if a.type == T.B))],
        "deadlock": [[a for a in acts[0] if a != v(0, 2)], acts[1]],
        "mixed versions": [[a if a != v(0, 1, 1) else Action(T.VOCAB, 1, 1, 0) for a in acts[0]], acts[1]],
        "future version": [[a if a != v(0, 1) else Action(T.VOCAB, 0, 1, 1) for a in acts[0]], acts[1]],
        "before the last stage's forward": [acts[0], _swap(acts[1], v(1, 0),
                                                           next(a for a in acts[1] if a.type == T.F))],
    }
    for why, lists in cases.items():
        with pytest.raises(ScheduleError, match=why.replace("(", r"\(")) as e:
            simulate(lists, Costs(), "1f1b")
        if why == "deadlock":
            assert "waits for VOCAB0.2 of stage(s) [0]" in str(e.value)


def test_pipedream_refuses_the_vocabulary_layers_shared_by_every_stage():
    with pytest.raises(ValueError, match="one version of the output layer per step"):
        schedule_actions("pipedream", 2, 1, 2, vocab_parallel=True)


def test_timeline_draws_the_vocab_passes_and_the_head_both_ways(tmp_path, capsys):
    """``hf-asyncpp timeline --head H``: the head on the last stage's F and B; ``--vocab-parallel``: shared, a VOCAB of
    3H/p per microbatch on every stage. On 4 stages 2BW's steady state loses its imbalance (docs/how-it-works.md)."""
    from hf_asyncpp.cli.timeline import main

    bubbles = {}
    for flag in ([], ["--vocab-parallel"]):
        png = tmp_path / f"t{len(flag)}.png"
        assert main(["--schedule", "2bw", "--stages", "4", "--microbatches", "8", "--head", "0.4", "--png", str(png),
                     *flag]) == 0
        out = capsys.readouterr().out
        bubbles[bool(flag)] = float(out.split("steady-state bubble ")[1].split("%")[0])
        assert png.exists()
    assert bubbles[True] < 1.0 < 15.0 < bubbles[False]


@pytest.mark.parametrize("p,m", [(2, 4), (3, 5), (4, 4), (4, 8)])
def test_vocab_passes_across_a_synchronous_start(p, m):
    """2BW synchronous for its first 2 steps (1F1B's lists, then 2BW's), cut into windows anywhere: the VOCAB passes
    follow each part's order and the lists simulate clean under NCCL's rule with the record's versions."""
    from hf_asyncpp.schedules.records import with_sync_start

    sched = with_sync_start(TWO_BW, 2)
    for k0 in range(4):
        acts = sched.actions(p, m, 3, first_step=k0, vocab_parallel=True)
        simulate(acts, Costs(1, 2, vocab=0.3), sched, m, nccl=True)
        assert all(sum(a.type == T.VOCAB for a in lst) == 3 * m for lst in acts)
