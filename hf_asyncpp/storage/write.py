"""Where the run's files meet the disk: one write path, and errors that say what happened.

Checkpoint files, ``metrics.jsonl`` and the run's JSON reports are written through :func:`write_file`, the only
place their bytes leave the process (tests fake a full disk here, at the edge, and nowhere else). Files that
libraries write themselves (``save_pretrained`` of the export and the tokenizer) are written inside
:func:`writing`. Either way a failure becomes a :class:`WriteError` naming the file, the cause (no space left,
permission, read-only file system, I/O error) and the free space, instead of torch's ``basic_ios::clear`` or
safetensors' ``os error 28`` with no path.

:func:`write_file` also hashes what it writes, so a checkpoint's manifest records each file's size and sha256
without reading the file back, and counts the bytes each thread writes (:func:`bytes_written_by`): what an
asynchronous checkpoint promises (the training thread writes nothing; a background writer everything) is a count
the tests read.
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
import socket
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import RecipeError, WriteError
from .names import RUN_LOCK, run_owned

log = logging.getLogger("hf_asyncpp")

_CAUSES = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
    errno.EIO: "I/O error",
    errno.EFBIG: "file too large",
}
_TEXT_CAUSES = {"os error 28": errno.ENOSPC, "no space left": errno.ENOSPC, "permission denied": errno.EACCES,
                "read-only file system": errno.EROFS, "input/output error": errno.EIO}
NEARLY_FULL = 1 << 20  # below this many free bytes an unexplained write failure is reported as a full disk
_by_thread: dict[int, int] = {}  # thread ident -> bytes it serialized, hashed and wrote through this module


def _count(n: int) -> None:
    ident = threading.get_ident()
    _by_thread[ident] = _by_thread.get(ident, 0) + n


def bytes_written_by(thread: threading.Thread | None = None) -> int:
    """Bytes ``thread`` (default: the calling one) has written through :func:`write_file` (serialized, hashed and
    written there) and inside :func:`writing` (a library's files, counted by their size once written), ever."""
    return _by_thread.get((thread or threading.current_thread()).ident, 0)


@dataclass
class Written:
    """What :func:`write_file` wrote: the manifest's record of a file."""

    size: int
    sha256: str


class _HashingFile:
    """A binary file that hashes and counts what goes through it, and keeps the OS error of a failed write
    (torch's C++ writer turns it into a RuntimeError that no longer says "no space left")."""

    def __init__(self, f):
        self.f, self.sha, self.size, self.error = f, hashlib.sha256(), 0, None

    def write(self, data) -> int:
        try:
            n = self.f.write(data)
        except OSError as e:
            self.error = e
            raise
        self.sha.update(data)
        size = len(memoryview(data).cast("B"))
        self.size += size
        _count(size)
        return n

    def flush(self) -> None:
        try:
            self.f.flush()
        except OSError as e:
            self.error = e
            raise


def open_for_write(path: Path, append: bool = False):
    """The file-write edge: the binary file every :func:`write_file` writes into."""
    return open(path, "ab" if append else "wb")


def write_file(path: str | os.PathLike, fill: Callable, *, append: bool = False, fsync: bool = True) -> Written:
    """Create ``path`` (or append to it) with ``fill(f)`` writing its bytes, flushed (and fsynced: a checkpoint
    must be on disk before its manifest; a metrics line need not).

    Raises:
        WriteError: naming the file, the cause and the free space.
    """
    path = Path(path)
    hf = None
    try:
        with open_for_write(path, append) as raw:
            hf = _HashingFile(raw)
            fill(hf)
            hf.flush()
            if fsync:
                os.fsync(raw.fileno())
    except Exception as e:  # noqa: BLE001 - torch's C++ writer re-raises our OSError as a RuntimeError
        cause = hf.error if hf is not None and hf.error is not None else e
        if not isinstance(cause, OSError):
            raise  # not the disk: a bug in what was being written keeps its traceback
        raise write_error(path, cause) from e
    return Written(hf.size, hf.sha.hexdigest())


@contextmanager
def writing(path: str | os.PathLike):
    """Run a library's write of ``path`` (a file or a folder); its failure becomes a :class:`WriteError`. What it
    wrote counts, by its size, as this thread's (:func:`bytes_written_by`)."""
    try:
        yield
        _count(_size_of(Path(path)))
    except WriteError:
        raise
    except (OSError, RuntimeError) as e:  # SafetensorError is not an OSError; see _cause
        raise write_error(Path(path), e) from e
    except Exception as e:  # noqa: BLE001
        if type(e).__name__ == "SafetensorError":
            raise write_error(Path(path), e) from e
        raise


def _size_of(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def replace_file(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Write ``path`` whole or not at all, and never through a symbolic link: ``write(tmp)`` makes the file at a
    temporary name beside it (a library's writer: ``savefig``, ``ModelCard.save``), which then replaces ``path``. A
    link at ``path`` is replaced by the file, its target left as it was (a model card in the Hugging Face cache is a
    link into a blob other snapshots share); a reader sees the old file or the new one, never half of one.

    Raises:
        WriteError: naming the file, the cause and the free space.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")  # the suffix kept: writers go by it
    try:
        with writing(path):
            try:
                write(tmp)
            except WriteError as e:  # from write_file, naming the temporary file: the user knows the file it replaces
                raise WriteError(str(e).replace(str(tmp), str(path))) from e
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def umask() -> int:
    """This process's umask, read without changing it where Linux says it (``/proc/self/status``)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(folder: str | os.PathLike) -> None:
    """Give every file under ``folder`` the mode ``open()`` gives a new file (0644 under the usual umask 022), as
    ``save_pretrained`` would: safetensors' writer makes its files 0600, which a group sharing the models (a lab's
    model folder, a serving user) cannot read."""
    mode = 0o666 & ~umask()
    for p in Path(folder).rglob("*"):
        if p.is_file() and not p.is_symlink():
            os.chmod(p, mode)


def disk_free(path: str | os.PathLike) -> int | None:
    """Free bytes on the file system holding ``path`` (or its nearest existing parent); None if unknown."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def human(n: int | None) -> str:
    if n is None:
        return "unknown"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def _cause(exc: BaseException) -> str | None:
    """The OS cause of a write failure, from its errno or (for errors that lost it) its text."""
    seen = set()
    e = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _CAUSES:
            return _CAUSES[e.errno]
        text = str(e).lower()
        for needle, code in _TEXT_CAUSES.items():
            if needle in text:
                return _CAUSES[code]
        e = e.__cause__ or e.__context__
    return None


def write_error(path: Path, exc: BaseException) -> WriteError:
    free = disk_free(path)
    cause = _cause(exc)
    if cause is None and free is not None and free < NEARLY_FULL:
        cause = "no space left on device"
    if cause is None:
        cause = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else 'write failed'}"
    return WriteError(f"cannot write {path}: {cause} ({human(free)} free on its file system)")


def json_text(obj, indent: int | None = None) -> str:
    """``obj`` as JSON that every reader accepts, for every JSON file the run writes: a non-finite float (the bubble
    of a run that trained no step, a skipped step's loss) is written as null. Python would write ``NaN``, which is
    not JSON: jq, JavaScript and strict parsers refuse the whole file. ``allow_nan=False``: anything that still
    carries one fails here, at the writer, not in someone's reader."""
    return json.dumps(_finite(obj), indent=indent, allow_nan=False)


def _finite(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


_held: dict[Path, int] = {}  # folder -> its lock's file descriptor, open until the run ends (or the process does)


def lock_output_dir(out: Path) -> None:
    """One run per output folder: an exclusive ``flock`` on ``out/.run.lock``, taken by the main process before it
    looks at the folder and held until the process ends (any end: the kernel releases it, so a crashed or killed run
    leaves no lock behind). Two runs started into one folder at the same moment, or a resume launched while the run
    still trains, would otherwise both pass the fresh-run check and replace each other's checkpoints; the second
    is refused naming the first (pid, host, start). A lock file whose holder is gone (a dead process, a dead
    host whose NFS locks were recovered) is free and is taken over with a line naming who left it."""
    if out.resolve() in _held:  # this process holds it already (a run before this one in the same process)
        return
    path, fd = out / RUN_LOCK, _take_lock(out)
    before = _read_holder(fd)
    if before.get("pid") and (before.get("pid"), before.get("host")) != (os.getpid(), socket.gethostname()):
        log.warning("%s: the lock left by %s is free (that run ended without releasing it: killed, or its host "
                    "died): taken over", path, _describe(before))
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join(sys.argv)}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    _held[out.resolve()] = fd


def remove_if_unused(out: Path) -> bool:
    """Remove the output folder a failed start created if it holds nothing but the run's lock (or nothing at all):
    a mistyped field or an unreachable model would otherwise leave an empty folder per try (27 after a morning of
    them), each one a folder the next try then looks at. Kept when it holds anything else, or when another process
    holds its lock (a run that started into the same new folder meanwhile). Whether it was removed."""
    try:
        if {p.name for p in out.iterdir()} - {RUN_LOCK}:
            return False
        if (out / RUN_LOCK).exists() and out.resolve() not in _held:
            os.close(_take_lock(out))  # refused (RecipeError) while another run holds it
        shutil.rmtree(out)
    except (OSError, RecipeError):
        return False
    fd = _held.pop(out.resolve(), None)
    if fd is not None:
        os.close(fd)
    return True


def check_output_dir_free(out: Path) -> None:
    """Refuse, naming the holder, a folder another run holds now (the launcher's check before it starts any rank, so
    a second run's first line is this and not what it would meet in the folder); takes nothing. The main rank takes
    the lock itself (:func:`lock_output_dir`)."""
    if not (out / RUN_LOCK).exists() or out.resolve() in _held:
        return
    fd = _take_lock(out)
    os.close(fd)  # closing the descriptor releases the lock


def _take_lock(out: Path) -> int:
    """``out/.run.lock`` opened (never through a link) and locked; its descriptor. RecipeError, naming the holder,
    when another process holds it."""
    path = out / RUN_LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        why = "is a symbolic link: remove it" if e.errno == errno.ELOOP else f"cannot be opened ({e.strerror})"
        raise RecipeError(f"training.output_dir: {path} {why}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _describe(_read_holder(fd))
        os.close(fd)
        if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise RecipeError(f"training.output_dir: {path} cannot be locked ({e.strerror}); a file system without "
                              "locks cannot keep two runs apart: choose an output_dir on a local or NFSv4 disk") from None
        raise RecipeError(f"training.output_dir: {out} is in use by another run ({holder}); wait for it to end, stop "
                          "it, or choose another output_dir") from None
    return fd


def unlock_output_dir(out: Path) -> None:
    """Release the folder at the end of a run, whatever the end (a process that dies releases it anyway, leaving its
    record for the next run to name); the record is cleared, so the next run takes a free lock without a word."""
    fd = _held.pop(out.resolve(), None)
    if fd is not None:
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        os.close(fd)


def _read_holder(fd: int) -> dict:
    try:
        record = json.loads(os.pread(fd, 1 << 16, 0) or b"{}")
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _describe(holder: dict) -> str:
    if not holder:
        return "its process did not say which"
    return (f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}: "
            f"{holder.get('command', '')}").strip()


def check_output_dir(path: str) -> Path:
    """The run's output folder, created; refused, naming the field, where this process cannot write, or where an
    entry the run writes or removes is a symbolic link (:func:`check_no_links`)."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise WriteError(f"training.output_dir: {path!r} cannot be written ({e.strerror}); choose a writable directory") from None
    check_no_links(out)
    return out


def check_no_links(out: Path) -> None:
    """Refuse an output folder where an entry the run writes, replaces or removes (``tokenizer/``, ``recipe.yaml``,
    a checkpoint, ...) is a symbolic link: writing the tokenizer or the recipe would change the link's target outside
    the folder, and ``overwrite_output_dir`` cannot remove it. Refused rather than the link replaced: the link was
    put there by someone, on purpose or not, and its target may be theirs. The folder itself may be a link."""
    links = sorted(p for p in out.iterdir() if run_owned(p.name) and p.is_symlink())
    if links:
        named = ", ".join(f"{p} -> {os.readlink(p)}" for p in links)
        raise RecipeError(f"training.output_dir: {named} {'is a symbolic link' if len(links) == 1 else 'are symbolic links'}; "
                          "the run writes and removes its own files there and never through a link, which would change "
                          f"what it points to: remove the link ({'rm ' + ' '.join(str(p) for p in links)}: its target "
                          "stays) or choose another training.output_dir")
