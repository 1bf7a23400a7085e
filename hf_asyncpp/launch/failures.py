"""One ``error:`` line per run, whichever process meets the error.

A user's mistake (exit codes in ``EXIT_CODES``, listed in docs/troubleshooting.md) ends a run with one line starting
``error:`` and no traceback (``--debug`` or ``HF_ASYNCPP_DEBUG=1`` adds it). With several processes that line must
not come once per rank, nor be buried under the errors it causes elsewhere:

* an error every rank meets in the same way (the recipe, the checks before training) is printed by each node's
  first process only (``LOCAL_RANK`` 0). Under torchrun the others wait for it before they exit
  (:func:`_wait_for_first_process`): torchrun ends every worker as soon as one fails, and a rank that left first
  would have the first process killed before it printed;
* a rank whose peer died (its connection closed) leaves quietly with exit code 3: the peer printed the cause;
* the processes that ``hf-asyncpp train`` starts itself (``launch.spawn``) print nothing: each leaves its line in
  the folder named by ``ERROR_DIR`` and the starting process prints the one that came first (:func:`first_error`),
  in place of torchrun's own failure report.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch.distributed as dist

from ..errors import EXIT_CODES, EXIT_PEER, EXIT_STOPPED, RecipeError, WriteError
from .. import supervision
from ..storage.write import write_file

DEBUG_FLAG = "--debug"
DEBUG_ENV = "HF_ASYNCPP_DEBUG"  # set to 1 (or pass --debug) for the traceback behind an `error:` line
ERROR_DIR = "HF_ASYNCPP_ERROR_DIR"  # set by launch.spawn for the ranks it starts: where each leaves its error line
# how long a rank that leaves a shared error to its node's first process waits under torchrun for that process to
# exit (torchrun then ends this one): the first process may still be importing or running checks the others skip
FIRST_PROCESS_GRACE_S = 120.0
# what gloo (and the store) say when the process at the other end has exited
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
              "failed to recv, got 0 bytes")


def debug_requested(argv: list[str]) -> bool:
    return DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def without_debug(argv: list[str]) -> list[str]:
    return [a for a in argv if a != DEBUG_FLAG]


def peer_gone(e: BaseException) -> bool:
    """Whether ``e`` only says that another rank's process ended (its own error is that rank's to report)."""
    if isinstance(e, (dist.DistNetworkError, dist.DistStoreError)):
        return True
    return isinstance(e, RuntimeError) and any(s in str(e) for s in _PEER_GONE)


def exit_code(e: BaseException) -> int | None:
    """The exit code of an error a user can meet (None: a bug, shown with its traceback)."""
    if peer_gone(e):
        return EXIT_PEER
    return next((code for kind, code in EXIT_CODES if isinstance(e, kind)), None)


def error_line(e: BaseException) -> str:
    kind = "" if isinstance(e, RecipeError) else f"{type(e).__name__}: "
    return f"error: {kind}{e}"


def report(e: BaseException, debug: bool, *, same_everywhere: bool = False) -> int | None:
    """Tell the user about ``e`` (called in an ``except`` block); its exit code, or None for a bug (re-raise it).

    ``same_everywhere``: every rank meets this error identically (the recipe, the checks before training; an error
    marked by ``errors.met_by_every_rank``)."""
    same_everywhere = same_everywhere or getattr(e, "same_everywhere", False)
    code = exit_code(e)
    if code is None:
        return None
    if debug:
        traceback.print_exc()
    gone = peer_gone(e)
    if os.environ.get(ERROR_DIR) and _leave(Path(os.environ[ERROR_DIR]), error_line(e), code, gone):
        return code
    if not gone and (supervision.first_on_node() or not same_everywhere):
        print(error_line(e), file=sys.stderr, flush=True)
        _tell_torchrun(error_line(e))
    elif not gone and "TORCHELASTIC_RUN_ID" in os.environ:
        _wait_for_first_process(error_line(e))
    return code


def _wait_for_first_process(line: str) -> None:
    """Under torchrun (also ``accelerate launch``), a rank that leaves a shared error to its node's first process
    stays until that process has printed it and exited: torchrun then ends this rank with SIGTERM. Leaving at once
    would race: torchrun would stop the first process on this rank's exit, often before its line was out (the
    first process runs checks the others skip, rank 0 the Hub's). If it never comes (that process did not meet the
    error after all), the line is printed here once the grace has passed, so a run never ends without it."""
    time.sleep(FIRST_PROCESS_GRACE_S)
    print(line, file=sys.stderr, flush=True)


def _tell_torchrun(line: str) -> None:
    """Under torchrun (also ``accelerate launch``), whose failure report names the first failed rank's error file
    (``TORCHELASTIC_ERROR_FILE``, in the format of torch's ErrorHandler): the line, in place of "To enable traceback
    see ..." there."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        _write_json(Path(path), record)
    except (OSError, WriteError):
        pass


def leave_for_launcher(line: str, code: int) -> bool:
    """Under ``hf-asyncpp train``'s own launcher (``ERROR_DIR`` set): leave the run's last line (a stop's, an
    interrupt's) for the launcher to print once, True; elsewhere False (print it here)."""
    folder = os.environ.get(ERROR_DIR)
    return bool(folder) and _leave(Path(folder), line, code, False)


def _leave(folder: Path, line: str, code: int, gone: bool) -> bool:
    """Leave the error for the starting process to print; False when it cannot be written (then print it here)."""
    record = {"line": line, "code": code, "peer_gone": gone, "time": time.time()}
    try:
        _write_json(folder / f"rank-{os.environ.get('RANK', '0')}.json", record)
    except (OSError, WriteError):
        return False
    return True


def _write_json(path: Path, record: dict) -> None:
    """A failure record, through the run's one write path (not fsynced: it is read once the rank has exited)."""
    text = json.dumps(record)
    write_file(path, lambda f: f.write(text.encode("utf-8")), fsync=False)


FINISHED = "finished.json"


def leave_finished() -> None:
    """Under ``hf-asyncpp train``'s own launcher: the main rank's note that the run finished (trained, saved,
    exported), so that a stop signal the launcher gets in the run's last moments, after which torchrun reports the
    workers as stopped, is not taken for a failure (``finished``). Best effort: without it the launcher says less."""
    folder = os.environ.get(ERROR_DIR)
    if folder:
        try:
            _write_json(Path(folder) / FINISHED, {"time": time.time()})
        except (OSError, WriteError):
            pass


def finished(folder: Path) -> bool:
    """Whether the run's main rank left :func:`leave_finished`'s note."""
    return (folder / FINISHED).is_file()


def stop_record(folder: Path) -> tuple[str, int] | None:
    """The line and exit code a stopped run's main rank left (``leave_for_launcher``) when the workers all exited 0
    (a stop under ``--max-restarts``), else None."""
    for path in folder.glob("rank-*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not record["peer_gone"]:
            return record["line"], EXIT_STOPPED
    return None


def first_error(failures: dict, folder: Path) -> tuple[str, int]:
    """The line and exit code of a failed run of spawned ranks (torchrun's ``ChildFailedError.failures``): the first
    error a rank left that is not a peer's death, else the first rank that ended without leaving one (a bug, whose
    traceback it printed, or a signal), else the first peer's death (one rank waited for another in vain)."""
    records = {}
    for path in folder.glob("rank-*.json"):
        try:
            records[int(path.stem.split("-")[1])] = json.loads(path.read_text())
        except (OSError, ValueError):  # cut short by a kill: that rank counts as one that left nothing
            continue
    if not records and not failures:
        return "error: the run's processes failed", 1
    own = sorted((r["time"], rank) for rank, r in records.items() if not r["peer_gone"])
    if own:
        record = records[own[0][1]]
        return record["line"], record["code"]
    # torchrun ends the survivors of a failure with SIGTERM: the first rank that failed otherwise is the cause
    silent = sorted((f.exitcode == -signal.SIGTERM, f.timestamp, rank) for rank, f in failures.items() if rank not in records)
    if silent:
        rank = silent[0][2]
        f = failures[rank]
        if f.exitcode < 0:
            return f"error: rank {rank} was killed by {f.signal_name()} (the out-of-memory killer? see dmesg)", 1
        return f"error: rank {rank} ended with exit code {f.exitcode}; its traceback is above", f.exitcode
    record = min(records.values(), key=lambda r: r["time"])
    return record["line"], record["code"]
