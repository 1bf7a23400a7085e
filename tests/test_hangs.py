"""A rank that hangs but stays alive (SIGSTOP: a stuck file system, a deadlocked library) ends the job within the
timeouts, with one line naming it: mid-run (pipeline.p2p_timeout_s, collective_timeout_s) and while a checkpoint is
written (pipeline.checkpoint_timeout_s). Short timeouts here; the defaults (90 s, 90 s, 300 s) follow the same code."""
from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
from dist_utils import free_port, run_distributed
from support import ROOT
from test_stop_signals import ENV, _last_step, _ranks, _recipe

from hf_asyncpp.errors import PeerFailure
from hf_asyncpp.pipeline.step_reports import StepReports
from hf_asyncpp.run.folder import list_checkpoints


def _stall_rank_1(cmd: list[str], until) -> tuple[float, str]:
    """Start ``cmd``, SIGSTOP rank 1 once ``until()`` holds; (seconds from the stall to the first ``error:`` line,
    the output so far). The job is then killed: torchrun would end the stopped rank only after its 30 s grace."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    text, ranks = [], []
    try:
        deadline = time.time() + 300
        rank_1 = None  # found before the condition is polled, so the stall follows it within milliseconds
        while rank_1 is None and proc.poll() is None and time.time() < deadline:
            with contextlib.suppress(psutil.Error):
                rank_1 = next((p for p in _ranks(proc.pid) if p.environ().get("RANK") == "1"), None)
            time.sleep(0.05)
        while not until() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.005)
        assert rank_1 is not None, "rank 1 never started: " + "".join(text)[-3000:]
        rank_1.suspend()
        ranks = _ranks(proc.pid)  # all of them, for the kill below
        t0 = time.time()
        while time.time() < t0 + 120:
            try:
                text.append(lines.get(timeout=1))
            except queue.Empty:
                continue
            if text[-1].startswith("error:"):
                return time.time() - t0, "".join(text)
        raise AssertionError("no error line within 120 s of the stall: " + "".join(text)[-3000:])
    finally:
        for p in ranks:  # in sessions of their own (torchrun's workers), and the stopped one cannot notice anything
            with contextlib.suppress(psutil.Error):
                p.kill()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _torchrun(recipe: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(free_port()),
            "-m", "hf_asyncpp.cli.train", str(recipe), *overrides]


def test_a_rank_hung_mid_run_ends_the_job_naming_it(tmp_path):
    recipe, out = _recipe(tmp_path, "midrun")
    took, text = _stall_rank_1(_torchrun(recipe, "--training.max_steps=100000", "--pipeline.p2p_timeout_s=6",
                                         "--pipeline.collective_timeout_s=6"), lambda: _last_step(out) >= 3)
    # met in a receive (the peer named by the transfer) or in the step's reduction or report (named by the store)
    assert re.search(r"error: PeerFailure: rank 0( \(stage 0\))?: .*rank 1 (failed or timed out after 6s|stopped "
                     r"answering \(nothing within 6s)", text), text[-3000:]
    assert "Traceback" not in text and took < 30, (took, text[-3000:])


def test_a_rank_hung_during_a_checkpoint_is_named(tmp_path):
    recipe, out = _recipe(tmp_path, "ckpt")
    took, text = _stall_rank_1(_torchrun(recipe, "--training.save_steps=4", "--pipeline.checkpoint_timeout_s=8"),
                               lambda: any(out.glob(".tmp-checkpoint-*")))
    assert re.search(r"error: PeerFailure: rank 0: writing checkpoint-0000004: rank 1 stopped answering \(nothing "
                     r"within pipeline.checkpoint_timeout_s=8s", text), text[-3000:]
    # Mostly rank 1 stops before its part is gathered, and nothing is committed. On a loaded machine it can stop
    # after the commit, in the save's last barrier: then the line must say that checkpoint is the latest, and it is.
    committed = (out / "checkpoint-0000004").exists()
    latest = "checkpoint-0000004 stays the latest checkpoint" if committed else "no checkpoint was completed yet"
    assert latest in text and "Traceback" not in text and took < 40, (took, text[-3000:])
    assert [step for step, _ in list_checkpoints(out)] == ([4] if committed else [])  # committed means complete


def test_a_rank_hung_during_an_evaluation_is_named_within_the_checkpoint_budget(tmp_path):
    """An evaluation after the first step waited init_timeout_s (15 minutes by default) and then named "rank -1"."""
    recipe, out = _recipe(tmp_path, "eval")
    took, text = _stall_rank_1(_torchrun(recipe, "--training.max_steps=100000", "--training.eval_steps=4",
                                         "--pipeline.checkpoint_timeout_s=8", "--pipeline.p2p_timeout_s=600",
                                         "--pipeline.collective_timeout_s=600"), lambda: _last_step(out) >= 4)
    [line] = [x for x in text.splitlines() if x.startswith("error:")]
    assert re.search(r"rank 1\b", line) and "rank -1" not in line and "Traceback" not in text, text[-3000:]
    assert took < 45, (took, text[-3000:])  # 8 s, and the search for the silent rank (at most 30 s)


def _report_with_a_stalled_rank(rank: int, world: int) -> str:
    """Ranks 0 and 1 post step 5's report; rank 2 stalls past their 2 s timeout (it is alive, it never joins)."""
    if rank == 2:
        time.sleep(6)
        return ""
    reports = StepReports(dist.group.WORLD, dp_size=1, timeout_s=2)
    reports.post(5, torch.tensor(1.0), None, 1e-3, True)
    try:
        reports.stop_vote(5)
    except PeerFailure as e:
        return str(e)
    return "no error"


def test_a_report_that_times_out_names_the_stalled_rank():
    errors = run_distributed(_report_with_a_stalled_rank, 3)
    for rank in (0, 1):
        assert re.fullmatch(rf"rank {rank}: the loss report of step 5: rank 2 stopped answering \(nothing within 2s: "
                            r"stalled or hung, see its log\)", errors[rank]), errors[rank]
