"""Every error a user can meet, and the exit code each ends a run with (docs/troubleshooting.md).

One page for them all: a message names the field or file and the fix; ``launch.failures`` turns
one of these into one ``error:`` line and its exit code, anything else keeps its traceback.
"""
from __future__ import annotations


class DataError(ValueError):
    """The training or evaluation data cannot be used; the message names the files (and the column)."""


class DataFileNotFound(DataError, FileNotFoundError):
    """A data file or glob of the recipe matches nothing."""


class WriteError(RuntimeError):
    """A file of the run could not be written; the message names it, the cause and the free space."""


class RecipeError(ValueError):
    """An invalid recipe. The message names the dotted field and what is allowed."""


class LaunchError(RecipeError):
    """The launcher's environment cannot be used. A RecipeError so that it ends the run the same way as a wrong process
    count does (one ``error:`` line, exit code 2): both are fixed in the launch command, not in the code."""


class PeerFailure(RuntimeError):
    """A pipeline peer died, stalled past the timeout, or closed its connection."""


class StageLocalError(RecipeError):
    """This model cannot be built one stage at a time here (the caller builds the whole model instead)."""


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient under ``training.on_nonfinite: stop``."""


class HubError(RuntimeError):
    """The Hub refuses the run's token or repository, or a push failed for good; the message names the field."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed; the message names the file and what is wrong with it."""


class MissingCheckpoint(CheckpointError, FileNotFoundError):
    """``training.resume_from_checkpoint`` names no complete checkpoint."""


def met_by_every_rank(e: BaseException) -> BaseException:
    """``e`` marked as an error every rank meets identically (a collective verdict, such as the checkpoint a resume
    may use): under a launcher each node's first process prints it, once, instead of every rank
    (``launch.failures.report``)."""
    e.same_everywhere = True
    return e


EXIT_PEER = 3  # a rank whose pipeline peer died leaves with this code, quietly: the peer printed the cause
EXIT_CODES = (  # what main() returns for the errors a user can meet (docs/troubleshooting.md lists them)
    (RecipeError, 2), (NonFiniteError, 3), (PeerFailure, EXIT_PEER), (WriteError, 4), (CheckpointError, 5),
    (DataError, 6), (HubError, 8),
)
EXIT_ORPHANED = 7  # a rank whose launcher died (supervision.py)
EXIT_STOPPED = 10  # stopped by one of training.stop_signals after saving a checkpoint: resumable, not finished
EXIT_INTERRUPTED = 130  # a second SIGINT: stopped at once, nothing saved (the shell's code for Ctrl-C)
