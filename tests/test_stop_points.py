"""Where a stop signal ends a run, proven without starting one: the rules the executor relies on hold for every
schedule, a signal only notes the stop (a second SIGINT interrupts), and ``on_nonfinite: skip`` gives up."""
from __future__ import annotations

import os
import signal

import pytest

from hf_asyncpp import supervision
from hf_asyncpp.engine import StepResult
from hf_asyncpp.run.trainer import SkipLimit
from hf_asyncpp.errors import NonFiniteError
from hf_asyncpp.pipeline.executor import STOP_LAG
from hf_asyncpp.schedules.actions import ActionType
from hf_asyncpp.schedules.records import SCHEDULES, with_sync_start
from support import ROOT

def _schedule(name: str, sync: int):
    return with_sync_start(SCHEDULES[name], sync) if sync else SCHEDULES[name]


def _valid(name: str, sync: int, p: int, m: int, extra: int) -> bool:
    try:
        _schedule(name, sync).check(p, m, extra)
    except ValueError:
        return False
    return True


CASES = [(name, sync, p, m, extra) for name in SCHEDULES for sync in (0, 4) if not sync or name == "2bw"
         for p in (1, 2, 3, 4, 6) for m in (p, p + 1, 2 * p) for extra in (0, 1) if _valid(name, sync, p, m, extra)]


@pytest.mark.parametrize("name,sync,p,m,extra", CASES)
def test_a_window_cut_after_step_s_begins_with_what_ran_before_step_s(name, sync, p, m, extra):
    """At its first action of step s a stage may switch to the list of the window that ends after step s: what it
    ran so far is that list's beginning (the executor also checks it at run time). Cutting one step later would not
    do: a late STEP sits elsewhere in a window's cool-down."""
    s = _schedule(name, sync)
    first, n = 3, 8
    for stage in range(p):
        full = list(s.stage_actions(stage, p, m, n, first, extra))
        for last in range(first, first + n - 1):
            cut = next(i for i, a in enumerate(full) if a.step >= last)
            short = list(s.stage_actions(stage, p, m, last + 1 - first, first, extra))
            assert full[:cut] == short[:cut], (stage, last)
            assert {a.step for a in short} == set(range(first, last + 1))


@pytest.mark.parametrize("name,sync,p,m,extra", CASES)
def test_every_stage_has_posted_the_vote_it_reads(name, sync, p, m, extra):
    """The vote of step s - STOP_LAG is read at a stage's first action of step s: that stage ran STEP{s - STOP_LAG}
    before (so its own report is posted), with a step to spare."""
    s = _schedule(name, sync)
    first = 3
    for stage in range(p):
        stepped, seen = set(), first - 1
        for a in s.stage_actions(stage, p, m, 10, first, extra):
            if a.step > seen:
                seen = a.step
                if seen - STOP_LAG >= first:
                    assert set(range(first, seen - STOP_LAG + 2)) <= stepped, (stage, seen)
            if a.type == ActionType.STEP:
                stepped.add(a.step)


def test_a_stop_signal_is_noted_and_a_second_sigint_interrupts():
    old = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGINT)}
    supervision.clear_stop()
    try:
        assert set(supervision.stop_on(["SIGUSR1", "SIGINT"])) == {signal.SIGUSR1, signal.SIGINT}
        os.kill(os.getpid(), signal.SIGUSR1)  # handled between bytecodes: the process goes on
        assert supervision.stop_requested() and supervision.stop_signal_name() == "SIGUSR1"
        with pytest.raises(KeyboardInterrupt):  # a stop is already asked for: a SIGINT is the impatient second one
            os.kill(os.getpid(), signal.SIGINT)
            signal.sigtimedwait([], 0.1) if hasattr(signal, "sigtimedwait") else None
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        supervision.clear_stop()
    assert not supervision.stop_requested()


def test_the_handlers_are_put_back_when_the_run_is_over():
    """A process that trained once (a test suite, a notebook) must not keep ignoring SIGTERM afterwards."""
    before = signal.getsignal(signal.SIGTERM)
    previous = supervision.stop_on(["SIGTERM"])
    assert signal.getsignal(signal.SIGTERM) is not before
    supervision.restore_signals(previous)
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_first_ctrl_c_asks_for_a_saved_stop_the_second_interrupts():
    old = signal.getsignal(signal.SIGINT)
    supervision.clear_stop()
    try:
        supervision.stop_on(["SIGINT"])
        os.kill(os.getpid(), signal.SIGINT)
        assert supervision.stop_signal_name() == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            signal.sigtimedwait([], 0.1) if hasattr(signal, "sigtimedwait") else None
    finally:
        signal.signal(signal.SIGINT, old)
        supervision.clear_stop()


def _result(step: int, skipped: bool) -> StepResult:
    return StepResult(step, float("nan") if skipped else 1.0, None, 1e-3, not skipped, skipped)


def test_skip_mode_gives_up_after_consecutive_skips_naming_the_step():
    limit = SkipLimit(max_consecutive=3, max_total=100)
    for k, skipped in enumerate([True, True, False, True, True]):  # a finite step resets the run of skips
        limit.see(_result(k, skipped))
    with pytest.raises(NonFiniteError, match=r"step 6: non-finite gradients skipped in 3 steps in a row"):
        limit.see(_result(5, True))


def test_skip_mode_gives_up_past_the_skipped_fraction():
    limit = SkipLimit(max_consecutive=10, max_total=2)  # max_skipped_fraction of max_steps
    for k in range(4):
        limit.see(_result(k, k % 2 == 0))  # steps 0 and 2 skipped: within the budget
    with pytest.raises(NonFiniteError, match=r"step 5: .* 3 steps since the run started, more than "
                                             r"training.max_skipped_fraction of max_steps \(2\)"):
        limit.see(_result(4, True))


def test_recipe_refuses_a_signal_that_cannot_be_caught():
    from hf_asyncpp.config.recipe import load_recipe
    from hf_asyncpp.errors import RecipeError

    with pytest.raises(RecipeError, match=r"training.stop_signals: 'SIGKILL' cannot be caught"):
        load_recipe(ROOT / "recipes/cpu-tiny.yaml", ["--training.stop_signals=[SIGTERM,SIGKILL]"])
