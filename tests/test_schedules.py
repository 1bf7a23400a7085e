"""Schedules are data: checked by the process-free simulator."""
from __future__ import annotations

import dataclasses

import pytest

from hf_asyncpp.schedules import SCHEDULES, Action, Op, schedule_actions, version_of
from hf_asyncpp.simulator import Costs, ScheduleError, simulate

GRID = [(p, m, n) for p in (1, 2, 3, 4) for m in (1, 2, 4, 5) for n in (1, 3)]


def _ok(schedule, p, m):
    return not (schedule == "2bw" and m < p) and not (schedule == "pipedream" and m != 1)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_microbatch_once_and_versions_follow_the_semantics(schedule):
    for p, m, n in GRID:
        if not _ok(schedule, p, m):
            continue
        acts = schedule_actions(schedule, p, m, n)
        simulate(acts, Costs(), schedule)  # raises on deadlock, FIFO violation, missing/duplicate work
        for s, lst in enumerate(acts):
            fs = [a for a in lst if a.type == Op.F]
            bs = [a for a in lst if a.type == Op.B]
            assert sorted((a.step, a.microbatch) for a in fs) == [(k, i) for k in range(n) for i in range(m)]
            assert sorted((a.step, a.microbatch) for a in bs) == sorted((a.step, a.microbatch) for a in fs)
            assert [a.step for a in lst if a.type == Op.STEP] == list(range(n))
            for a in fs:
                assert a.version == version_of(schedule, a.step, s, p)
            # the executor can only use a version that exists: count the STEPs before each forward
            done = 0
            for a in lst:
                if a.type == Op.STEP:
                    done += 1
                elif a.type == Op.F:
                    assert a.version <= done, (schedule, p, m, s, str(a))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_chunking_does_not_change_versions(schedule):
    p, m, n = 3, (1 if schedule == "pipedream" else 3), 6
    whole = [[(a.step, a.microbatch, a.version) for a in lst if a.type == Op.F] for lst in schedule_actions(schedule, p, m, n)]
    parts = [schedule_actions(schedule, p, m, 2, first_step=k) for k in (0, 2, 4)]
    chunked = [[(a.step, a.microbatch, a.version) for part in parts for a in part[s] if a.type == Op.F] for s in range(p)]
    assert [sorted(x) for x in whole] == [sorted(x) for x in chunked]


def test_2bw_needs_enough_microbatches():
    with pytest.raises(ValueError, match=r"2bw needs num_microbatches >= num_stages \(2 < 4\)"):
        schedule_actions("2bw", 4, 2, 3)
    with pytest.raises(ValueError, match="pipedream takes one optimizer step per microbatch"):
        schedule_actions("pipedream", 2, 2, 3)


@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (3, 5), (4, 4), (4, 8)])
def test_bubble_fractions_with_unit_costs(p, m):
    for sched in ("gpipe", "1f1b"):
        res = simulate(schedule_actions(sched, p, m, 3), Costs(1, 1), sched)
        assert res.bubble == pytest.approx((p - 1) / (m + p - 1))
    n = 12
    res = simulate(schedule_actions("2bw", p, m, n), Costs(1, 1), "2bw")
    assert res.steady_bubble == pytest.approx(0.0, abs=1e-12)
    assert res.bubble == pytest.approx((p - 1) / (n * m + p - 1))


def test_peak_memory_per_stage():
    p, m = 4, 8
    assert simulate(schedule_actions("gpipe", p, m, 2), Costs(), "gpipe").peak_inflight == [m] * p
    one = simulate(schedule_actions("1f1b", p, m, 2), Costs(), "1f1b")
    assert one.peak_inflight == [p - s for s in range(p)] and one.peak_versions == [1] * p
    two = simulate(schedule_actions("2bw", p, m, 4), Costs(), "2bw")
    assert two.peak_inflight == [p - s for s in range(p)] and two.peak_versions == [2] * p
    pd = simulate(schedule_actions("pipedream", p, 1, 10), Costs(), "pipedream")
    assert pd.peak_versions[0] == p and pd.peak_versions[-1] == 1


def test_broken_lists_are_caught():
    acts = schedule_actions("1f1b", 2, 2, 1)
    recvs = [i for i, a in enumerate(acts[1]) if a.type == Op.RECV_ACT]
    swapped = list(acts[1])
    swapped[recvs[0]], swapped[recvs[1]] = swapped[recvs[1]], swapped[recvs[0]]
    with pytest.raises(ScheduleError, match="out of send order"):
        simulate([acts[0], swapped])
    # stage 0 waits for a gradient before sending the activation stage 1 needs: deadlock
    first_send = next(i for i, a in enumerate(acts[0]) if a.type == Op.SEND_ACT)
    first_recv_grad = next(i for i, a in enumerate(acts[0]) if a.type == Op.RECV_GRAD)
    bad = list(acts[0])
    bad.insert(0, bad.pop(first_recv_grad))
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate([bad, acts[1]])
    dropped = [a for a in acts[1] if not (a.type == Op.B and a.microbatch == 1)]
    with pytest.raises(ScheduleError):
        simulate([acts[0], dropped])
    assert first_send >= 0


def test_action_string_round_trip():
    for lst in schedule_actions("2bw", 2, 2, 2):
        for a in lst:
            assert Action.from_str(str(a)) == a
