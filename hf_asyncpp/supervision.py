"""A rank never outlives the launcher that started it.

torchrun (and ``accelerate launch``, which runs it) starts each worker in its own session, so when the launcher
itself is killed (``kill -9``, an OOM killer, a scheduler) nothing signals the workers: they were measured to go
on training unsupervised for minutes and to write more checkpoints into the run's folder, where a relaunch would
then meet them. :func:`watch_parent` starts a daemon thread that notices the parent is gone (the process is
re-parented) within ``interval_s`` and ends this rank at once; :func:`check_parent` is the same test, called
between writing a checkpoint's manifest and moving the checkpoint into place, so that no checkpoint whose
manifest was written after the launcher died is ever committed.

Only ranks started by a launcher are watched (``LOCAL_RANK`` in the environment): a single process started from
a shell may outlive it on purpose (``nohup``).
"""
from __future__ import annotations

import os
import sys
import threading
import time
from .errors import EXIT_ORPHANED

_PARENT_AT_IMPORT = os.getppid()  # imported early by the trainer: narrows the window before watch_parent runs
_watched: list[int] = []


def launched() -> bool:
    """Whether this process is a rank started by torchrun / accelerate launch."""
    return "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


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
