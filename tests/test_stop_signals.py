"""A scheduler's signal mid-run (SLURM's preemption and time limit, ``scancel``, Ctrl-C) under each launcher: every rank
finishes its step, one checkpoint is saved at the step they agreed on, one line names it, and the resumed run equals
one that was never stopped, bitwise. The stop-point rules themselves are proven in tests/test_stop_points.py."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file
from torch.distributed.elastic.multiprocessing.api import SignalException

from hf_asyncpp.errors import EXIT_STOPPED
from hf_asyncpp.launch.spawn import RESTART_FIX, _sigint_relay, torchrun_signals
from dist_utils import free_port
from support import ROOT, losses, write_recipe

MAX_STEPS = 200  # steps of ~12 ms: the launcher, torchrun and the ranks pass a signal on within 2 s on a loaded machine
SIGNAL_AT = 3  # metrics.jsonl's step when the signal is sent: the stop comes at most STOP_LAG + 1 steps later
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_EVALUATE_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false"}
HF_ASYNCPP = [sys.executable, "-m", "hf_asyncpp"]


def _recipe(tmp_path: Path, name: str) -> tuple[Path, Path]:
    out = tmp_path / name
    return write_recipe(tmp_path / f"{name}.yaml", out, max_steps=MAX_STEPS, save_steps=MAX_STEPS, logging_steps=1), out


def _train(recipe: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([*HF_ASYNCPP, "train", str(recipe), *overrides], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def never_stopped(tmp_path_factory):
    recipe, out = _recipe(tmp_path_factory.mktemp("stop"), "straight")
    r = _train(recipe)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return out


def _last_step(out: Path) -> int:
    try:
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.endswith("}")]
    except OSError:
        return 0
    return max((r.get("step", 0) for r in rows), default=0)


def _ranks(launcher: int) -> list[psutil.Process]:
    out = []
    for p in psutil.Process(launcher).children(recursive=True):
        try:
            if "RANK" in p.environ():
                out.append(p)
        except psutil.Error:
            pass
    return out


def _interrupt(cmd: list[str], out: Path, sig: signal.Signals, to_ranks: bool = False, meanwhile=None,
               to_all: bool = False, preexec=None, env: dict | None = None, at: int = SIGNAL_AT) -> tuple[int, str]:
    """Start ``cmd`` (in its own session, after ``preexec()`` in the child), send ``sig`` to the launcher (or to the
    ranks alone, or with ``to_all`` to the launcher's process group and every rank, as SLURM signals a step) once
    metrics.jsonl reaches step ``at`` (after running ``meanwhile(proc)`` while it trains), and return its exit code
    and output."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=preexec)
    try:
        deadline = time.time() + 300
        while _last_step(out) < at and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        if meanwhile is not None:
            meanwhile(proc)
        assert proc.poll() is None, "the run ended before the signal: " + proc.stdout.read()[-3000:]
        if to_all:
            ranks = _ranks(proc.pid)
            os.killpg(proc.pid, sig)
        for p in (_ranks(proc.pid) if to_ranks else ranks if to_all else [psutil.Process(proc.pid)]):
            p.send_signal(sig)
        text, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, text


def _stopped_step(text: str, sig: str, out: Path, longest: int = MAX_STEPS, first: int = SIGNAL_AT,
                  complete: set[str] | None = None) -> int:
    """The step a run that printed ``text`` says ``sig`` stopped it at, checked: at or after the step it was sent at
    (``first``), saved there as a complete checkpoint (in ``complete``, the names of those seen just after the run,
    where later runs in the folder may have removed it since)."""
    m = re.search(rf"stopped by {sig} at step (\d+): saved (\S+); resume with", text)
    assert m, text[-3000:]
    step = int(m.group(1))
    assert first <= step < longest and Path(m.group(2)) == out / f"checkpoint-{step:07d}", text[-3000:]
    name = f"checkpoint-{step:07d}"
    assert name in complete if complete is not None else (out / name / "manifest.json").exists(), (name, complete)
    assert "Traceback" not in text.split("stopped by")[0], text[-3000:]  # the ranks stopped cleanly
    return step


def _resumes_exactly(recipe: Path, out: Path, never_stopped: Path) -> None:
    r = _train(recipe, "--training.resume_from_checkpoint=latest")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert losses(out) == losses(never_stopped)  # bitwise, every step
    for s in ("00", "01"):
        a = load_file(str(never_stopped / f"checkpoint-{MAX_STEPS:07d}" / f"stage-{s}.safetensors"))
        b = load_file(str(out / f"checkpoint-{MAX_STEPS:07d}" / f"stage-{s}.safetensors"))
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


@pytest.fixture(scope="module")
def relay(tmp_path_factory):
    """One run stopped by each launcher in turn, each resuming where the one before stopped: SIGTERM (what SLURM's
    preemption and ``scancel`` send) to ``hf-asyncpp train``, SIGTERM to torchrun, Ctrl-C to ``accelerate launch``
    with the shipped 2-process config. Three launches where a stop and a resume per launcher took six; the tests
    below check each leg and the end. {launcher: (exit code, output, the signal's name, step it was sent at, the
    complete checkpoints just after)}, the recipe and the folder."""
    recipe, out = _recipe(tmp_path_factory.mktemp("relay"), "relay")
    resume = "--training.resume_from_checkpoint=latest"
    legs = {}
    at = SIGNAL_AT
    for launcher, sig in (("hf-asyncpp", signal.SIGTERM), ("torchrun", signal.SIGTERM), ("accelerate", signal.SIGINT)):
        cmd = {"hf-asyncpp": [*HF_ASYNCPP, "train", str(recipe)],
               "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
                            str(free_port()), "-m", "hf_asyncpp.cli.train", str(recipe), resume],
               "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                              str(ROOT / "recipes/accelerate/cpu-2proc.yaml"), "--main_process_port", str(free_port()),
                              "-m", "hf_asyncpp.cli.train", str(recipe), resume]}[launcher]
        rc, text = _interrupt(cmd, out, sig, at=at)
        complete = {p.parent.name for p in out.glob("checkpoint-*/manifest.json")}
        legs[launcher] = (rc, text, sig.name, at, complete)
        m = re.search(rf"stopped by {sig.name} at step (\d+)", text)
        at = (int(m.group(1)) if m else _last_step(out)) + SIGNAL_AT
    return legs, recipe, out


def test_sigterm_to_hf_asyncpp_train_saves_and_exits_10(relay):
    """To the launcher ``hf-asyncpp train`` started: one line, no traceback, exit code EXIT_STOPPED."""
    (rc, text, sig, at, complete), _, out = relay[0]["hf-asyncpp"], *relay[1:]
    assert rc == EXIT_STOPPED, text[-3000:]
    _stopped_step(text, sig, out, first=at, complete=complete)
    assert text.count("stopped by SIGTERM") == 1 and "Traceback" not in text, text[-3000:]


def test_sigterm_to_torchrun_saves(relay):
    """torchrun passes SIGTERM on to the ranks and gives them its shutdown timeout (30 s) to save; torchrun itself
    then ends with its own report of the signal."""
    (rc, text, sig, at, complete), _, out = relay[0]["torchrun"], *relay[1:]
    assert rc != 0
    _stopped_step(text, sig, out, first=at, complete=complete)


def test_ctrl_c_to_accelerate_launch_saves(relay):
    """SIGINT (Ctrl-C) to ``accelerate launch`` with the shipped 2-process config."""
    (rc, text, sig, at, complete), _, out = relay[0]["accelerate"], *relay[1:]
    assert rc != 0
    _stopped_step(text, sig, out, first=at, complete=complete)


def test_a_run_stopped_under_each_launcher_resumes_exactly(relay, never_stopped):
    """The run the three stops left, resumed to its end: every step's loss and the final weights equal a run never
    stopped, bitwise (each leg's steps are in its metrics, so a leg that resumed wrong shows)."""
    legs, recipe, out = relay
    assert all(f"stopped by {sig} at step" in text for _, text, sig, _, _ in legs.values())
    _resumes_exactly(recipe, out, never_stopped)


def test_sigusr1_to_the_ranks_alone_stops_them_at_one_step(tmp_path):
    """SLURM's ``--signal=USR1@120`` reaches the ranks (an srun step's tasks): they agree on a step among themselves
    and save there (what a checkpoint resumes to is the same whichever way the stop came: the other tests).
    Meanwhile a resume launched into the folder while the run trains (a requeue while the old job lingers) is
    refused in one line naming the run that holds it."""
    recipe, out = _recipe(tmp_path, "usr1")

    def second_run(proc):
        r = _train(recipe, "--training.resume_from_checkpoint=latest")
        assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
        assert re.search(rf"error: training.output_dir: {out} is in use by another run \(pid \d+ on ", r.stderr), r.stderr
        assert "Traceback" not in r.stderr

    rc, text = _interrupt([*HF_ASYNCPP, "train", str(recipe), "--training.max_steps=100000",
                           "--training.save_steps=100000"], out, signal.SIGUSR1, to_ranks=True, meanwhile=second_run)
    assert rc == EXIT_STOPPED, text[-3000:]
    step = _stopped_step(text, "SIGUSR1", out, longest=100000)
    assert json.loads((out / f"checkpoint-{step:07d}" / "run_state.json").read_text())["step"] == step


def test_sigusr1_to_hf_asyncpp_train_saves_and_exits_10(tmp_path):
    """SIGUSR1, a default stop signal, to the launcher alone (``kill -USR1 PID``): torchrun's agent must catch it
    (its own defaults leave it out) and send it on, so the ranks save at an agreed step and the run exits 10."""
    recipe, out = _recipe(tmp_path, "usr1_launcher")
    rc, text = _interrupt([*HF_ASYNCPP, "train", str(recipe), "--training.max_steps=100000"], out, signal.SIGUSR1)
    assert rc == EXIT_STOPPED, text[-3000:]
    _stopped_step(text, "SIGUSR1", out, longest=100000)
    assert text.count("stopped by SIGUSR1") == 1 and "Traceback" not in text and "is gone" not in text, text[-3000:]


def test_under_nohup_sighup_is_ignored_and_sigusr1_to_every_process_saves(tmp_path):
    """A launcher started ignoring SIGHUP (``nohup hf-asyncpp train``) keeps ignoring it: the run trains on after
    a SIGHUP. Then SIGUSR1 to the launcher's process group and to every rank at once (SLURM's ``--signal=USR1@120``
    signals every process of the step): one saved stop, exit 10."""
    recipe, out = _recipe(tmp_path, "nohup")
    hup_at = []

    def hang_up(proc):
        hup_at.append(_last_step(out))
        os.killpg(proc.pid, signal.SIGHUP)  # the terminal closes
        deadline = time.time() + 120
        while _last_step(out) < hup_at[0] + 5 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)

    rc, text = _interrupt([*HF_ASYNCPP, "train", str(recipe), "--training.max_steps=100000"], out, signal.SIGUSR1,
                          to_all=True, meanwhile=hang_up, preexec=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    assert rc == EXIT_STOPPED, text[-3000:]
    assert _stopped_step(text, "SIGUSR1", out, longest=100000) >= hup_at[0] + 5
    assert text.count("stopped by SIGUSR1") == 1 and "Traceback" not in text, text[-3000:]


def test_torchrun_is_told_every_stop_signal_and_leaves_an_ignored_sighup_alone():
    """What the launcher passes as torchrun's ``--signals-to-handle``: the recipe's stop signals with torchrun's own,
    SIGINT left to the launcher's relay, SIGHUP left out where it is ignored (nohup) and kept where it is not."""
    ignored = {signal.SIGHUP: signal.SIG_IGN}
    assert torchrun_signals(["SIGTERM", "SIGINT", "SIGUSR1"], handler=lambda s: signal.SIG_DFL) == [
        "SIGTERM", "SIGINT", "SIGUSR1", "SIGHUP", "SIGQUIT"]
    assert torchrun_signals(["SIGUSR2"], sigint=False, handler=lambda s: ignored.get(s, signal.SIG_DFL)) == [
        "SIGUSR2", "SIGTERM", "SIGQUIT"]
    assert torchrun_signals(["SIGHUP"], handler=lambda s: ignored.get(s, signal.SIG_DFL)) == ["SIGTERM", "SIGINT", "SIGQUIT"]


def test_the_launchers_second_sigint_reaches_the_workers_at_once():
    """The launcher's SIGINT handler while torchrun runs: the first SIGINT raises torch's SignalException (the agent
    sends it on and waits for the saved stop); the second goes at once to each worker's process group (a worker is
    in its own session, as torchrun starts it) instead of waiting for the agent's shutdown timeout."""
    worker = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
                              # SIGINT's default action, as torchrun's workers have it, whatever this test process's is
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    before = signal.getsignal(signal.SIGINT)
    try:
        assert worker.stdout.readline() == "up\n"
        signal.signal(signal.SIGINT, _sigint_relay())
        with pytest.raises(SignalException) as first:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        assert first.value.sigval == signal.SIGINT and worker.poll() is None
        os.kill(os.getpid(), signal.SIGINT)  # the second: no exception here, the worker gets it
        assert worker.wait(timeout=30) == -signal.SIGINT
    finally:
        signal.signal(signal.SIGINT, before)
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_sigusr1_to_torchrun_with_the_documented_setting_saves(tmp_path):
    """The documented form for a torchrun of your own: ``PET_SIGNALS_TO_HANDLE`` (torchrun's
    ``--signals-to-handle``) with SIGUSR1 makes torchrun send it on to the ranks, which save."""
    recipe, out = _recipe(tmp_path, "torchrun_usr1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(free_port()),
           "-m", "hf_asyncpp.cli.train", str(recipe), "--training.max_steps=100000"]
    rc, text = _interrupt(cmd, out, signal.SIGUSR1, env={**ENV, "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGUSR1"})
    assert rc != 0
    _stopped_step(text, "SIGUSR1", out, longest=100000)


def test_sigterm_to_accelerate_launch_alone_stops_the_run_saved(tmp_path):
    """``kill PID`` (or ``docker stop``) of ``accelerate launch`` without a config: its one-process launcher ends at
    once and passes nothing on; the process it started turns that end into a stop, so the run saves and ends
    instead of training on unsupervised, and says why."""
    recipe, out = _recipe(tmp_path, "accelerate_alone")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "scripts/pretrain.py", str(recipe),
           "--training.max_steps=100000"]
    rc, text = _interrupt(cmd, out, signal.SIGTERM)
    assert rc == -signal.SIGTERM, text[-3000:]  # accelerate itself dies of it, before the run has saved
    _stopped_step(text, "SIGTERM", out, longest=100000)  # communicate() returned: every writer of the output ended
    assert "the accelerate launch that started this run" in text, text[-3000:]


def _kill_rank_after_first_checkpoint(cmd: list[str], out: Path) -> tuple[int, str]:
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**ENV, **RESTART_FIX}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not list(out.glob("checkpoint-*/manifest.json")) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        while _last_step(out) < 6 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        ranks = {int(p.environ()["RANK"]): p for p in _ranks(proc.pid)}
        ranks[1].kill()  # as an out-of-memory killer would
        text, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, text


@pytest.mark.parametrize("launcher", ["hf-asyncpp", "torchrun"])
def test_a_restart_after_a_killed_rank_resumes_exactly(tmp_path, never_stopped, launcher):
    """torchrun --max-restarts=1 (with torch 2.13's store fix, RESTART_FIX, which hf-asyncpp train's launcher sets
    itself: --training.max_restarts=1): rank 1 killed after checkpoint 4; the restarted ranks resume it on their own
    and the run ends equal to one never interrupted."""
    recipe, out = _recipe(tmp_path, launcher)
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=localhost:{free_port()}", "-m", "hf_asyncpp.cli.train", str(recipe), "--training.save_steps=4"]
    else:
        cmd = [*HF_ASYNCPP, "train", str(recipe), "--training.save_steps=4", "--training.max_restarts=1"]
    rc, text = _kill_rank_after_first_checkpoint(cmd, out)
    assert rc == 0, text[-4000:]
    assert "resuming from the newest verified checkpoint" in text, text[-4000:]
    assert losses(out)[-MAX_STEPS:] == losses(never_stopped)
    a = load_file(str(never_stopped / f"checkpoint-{MAX_STEPS:07d}" / "stage-01.safetensors"))
    b = load_file(str(out / f"checkpoint-{MAX_STEPS:07d}" / "stage-01.safetensors"))
    assert all((a[k] == b[k]).all() for k in a)


def test_a_signal_stops_the_single_process_engine_at_the_next_step(tmp_path):
    """``schedule: none`` (LocalEngine) in this process: SIGUSR1 after step 2 stops it at the step that signal's
    vote is read in, saved there; the resume equals an uninterrupted run bitwise."""
    from hf_asyncpp.config.recipe import recipe_from_dict
    from hf_asyncpp.run.trainer import train
    from support import tiny

    common = dict(training__max_steps=8, training__save_steps=0, training__logging_steps=1)
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    train(recipe_from_dict(tiny(straight, **common)))
    before = signal.getsignal(signal.SIGUSR1)
    signaller = threading.Thread(target=_signal_self_at_step, args=(stopped, 2), daemon=True)
    signaller.start()
    try:
        summary = train(recipe_from_dict(tiny(stopped, **common)))
    finally:
        signal.signal(signal.SIGUSR1, before)
    assert summary["stopped_by"] == "SIGUSR1" and 2 <= summary["step"] < 8, summary
    assert summary["checkpoint"] == str(stopped / f"checkpoint-{summary['step']:07d}")
    train(recipe_from_dict(tiny(stopped, training__resume_from_checkpoint="latest", **common)))
    assert losses(stopped) == losses(straight)


def _signal_self_at_step(out: Path, step: int) -> None:
    deadline = time.time() + 120
    while _last_step(out) < step and time.time() < deadline:
        time.sleep(0.005)
    os.kill(os.getpid(), signal.SIGUSR1)
