"""Which process this is, and a rank never outlives the launcher that started it.

Which process: :func:`launched` (a rank a launcher started), :func:`is_main_rank` and :func:`first_on_node` (from the
launcher's environment, before any process group exists), :func:`is_main_process` (rank 0 of the process group, or a
process outside one), and ``CHECKED`` (the ranks a process started after checking the recipe). Whether this process
must start the others itself is the launcher's question (``launch.spawn.started_by_launcher``: SLURM's variables).

torchrun (and ``accelerate launch``, which runs it) starts each worker in its own session, so when the launcher
itself is killed (``kill -9``, an OOM killer, a scheduler) nothing signals the workers: they were measured to go
on training unsupervised for minutes and to write more checkpoints into the run's folder, where a relaunch would
then meet them. :func:`watch_parent` starts a daemon thread that notices the parent is gone (the process is
re-parented) within ``interval_s`` and ends this rank at once; :func:`check_parent` is the same test, called
between writing a checkpoint's manifest and moving the checkpoint into place, so that no checkpoint whose
manifest was written after the launcher died is ever committed.

Only ranks started by a launcher are watched (``LOCAL_RANK`` in the environment): a single process started from
a shell may outlive it on purpose (``nohup``).

The other way round, a scheduler that wants the run to end (SLURM's preemption or time limit, ``scancel``, a
Ctrl-C) sends a signal: :func:`stop_on` makes the ``training.stop_signals`` only note that a stop was asked for
(:func:`stop_requested`), so that every rank finishes its step, agrees on one last step with the others, saves a
checkpoint there and exits (``run/trainer.py``; the executor reads the note at step boundaries). A second SIGINT
stops at once (``KeyboardInterrupt``), as an impatient Ctrl-C expects.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

from .errors import EXIT_ORPHANED

_PARENT_AT_IMPORT = os.getppid()  # imported early by the trainer: narrows the window before watch_parent runs
_watched: list[int] = []
_stop_signal: list[int] = []  # the first stop signal received, if any


def launched() -> bool:
    """Whether this process is a rank started by torchrun / accelerate launch."""
    return "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def restart_count() -> int:
    """How many times torchrun has restarted this rank's worker group (``--max-restarts``; 0 at the first start)."""
    raw = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(raw) if raw.isdigit() else 0


def watch_parent(interval_s: float = 0.5) -> bool:
    """Watch the launcher from a daemon thread (launched ranks only); True when watching."""
    if _watched or not launched():
        return bool(_watched)
    _watched.append(_PARENT_AT_IMPORT)
    check_parent()
    threading.Thread(target=_watch, args=(interval_s,), name="hf_asyncpp-parent-watch", daemon=True).start()
    return True


def parent_alive() -> bool:
    if not _watched:
        return True
    return os.getppid() == _watched[0]


def check_parent() -> None:
    """End this rank now if the launcher that started it is gone."""
    if not parent_alive():
        _orphaned()


def _watch(interval_s: float) -> None:
    while True:
        time.sleep(interval_s)
        check_parent()


def _orphaned() -> None:
    rank = os.environ.get("RANK", "?")
    try:
        sys.stderr.write(f"error: rank {rank}: the launcher that started it (pid {_watched[0]}) is gone; stopping so "
                         f"that no unsupervised copy of the run keeps training and writing checkpoints (exit "
                         f"{EXIT_ORPHANED}); committed checkpoints are left as they are\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # the launcher's end of stderr may be gone with it
        pass
    os._exit(EXIT_ORPHANED)


# ---------------------------------------------------------------------------- stop signals


def stop_on(names: list[str]) -> dict:
    """Make the named signals (``SIGTERM``, ``SIGUSR1``, ...) ask for a stop instead of killing the process; returns
    their previous handlers, for :func:`restore_signals` when the run is over (a process that trains twice, a test
    suite, must not keep ignoring SIGTERM). Only the main thread may install handlers: elsewhere nothing is done."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for name in names:
        sig = signal.Signals[name]
        previous[sig] = signal.signal(sig, _note_stop)
    return previous


def restore_signals(previous: dict) -> None:
    """Put back the handlers :func:`stop_on` replaced."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, handler in previous.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _note_stop(signum: int, frame) -> None:
    if not _stop_signal:
        _stop_signal.append(signum)
    elif signum == signal.SIGINT:  # a second Ctrl-C: now
        raise KeyboardInterrupt
    if signum == signal.SIGINT:  # the next one takes Python's default: KeyboardInterrupt where the process is
        signal.signal(signal.SIGINT, signal.default_int_handler)


def stop_requested() -> bool:
    """Whether a stop signal reached this process."""
    return bool(_stop_signal)


def stop_signal_name() -> str | None:
    """The stop signal this process received (``SIGTERM``), None if none did."""
    return signal.Signals(_stop_signal[0]).name if _stop_signal else None


def request_stop(signum: int = signal.SIGTERM) -> None:
    """Note a stop as the signal ``signum`` would (tests, and an embedding program that wants the run to end)."""
    if not _stop_signal:
        _stop_signal.append(int(signum))


def clear_stop() -> None:
    """Forget a noted stop (a second run in the same process)."""
    _stop_signal.clear()


CHECKED = "HF_ASYNCPP_CHECKED"
"""Set for the ranks a process started after it checked the recipe (``launch.spawn``): what it said is said."""


def is_main_rank() -> bool:
    """Rank 0, or a process no launcher started (before the process group exists; SLURM's before adopt_slurm)."""
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def first_on_node() -> bool:
    """This node's first process (also a process no launcher started); SLURM's variable before adopt_slurm ran."""
    return os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) == "0"


def is_main_process() -> bool:
    """Rank 0 of this run's process group, or a process in none (a process that never imported
    ``torch.distributed`` has none: this module stays importable before torch)."""
    dist = sys.modules.get("torch.distributed")
    return dist is None or not dist.is_initialized() or dist.get_rank() == 0
