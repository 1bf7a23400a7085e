"""Local data files: which exist, which kind they are, and which of them can be read at all.

A corpus is often a folder of files of uneven quality. One unreadable, binary, non-JSON or wrong-column file
among good ones must not stop a run, and must not pass silently either: :func:`screen_files` looks at the start
of each file (the first 64 KiB, and the first JSON line) and sets aside the files that cannot be used, each with
its reason; the data stream and the tokenizer read only the rest, and log and count what was skipped. A file
that goes bad only after its start is still met by the reader, whose error names the file list.

A file whose start is mostly text but not valid in ``data.encoding`` (a Latin-1 or cp1252 file read as UTF-8) is
read, not skipped: its invalid bytes become U+FFFD and the stream counts them. Skipping it would drop whole documents
for one accented letter; reading it silently would hide why the model sees replacement characters. So the file is
named once per process, with its first invalid byte and the fix (``data.encoding``).

Compressed files (``.gz``, ``.bz2``, ``.xz``, ``.zst``) are opened here exactly as ``datasets`` opens them to read
them: ``fsspec.open(path, compression="infer")``, so the probe sees the decompressed bytes the reader will. ``.zst``
needs the ``zstandard`` package (a dependency); where a codec is missing, the screening says which package
to install, in one line, instead of the file being judged binary (:func:`check_compression`).

A user's data mistake is a :class:`DataError` (one ``error:`` line from the trainer, no traceback).
"""
from __future__ import annotations

import codecs
import glob
import io
import json
import logging
import os
from pathlib import Path

import fsspec
from fsspec.utils import infer_compression

from ..errors import DataError, DataFileNotFound

BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
COMPRESSION = (".gz", ".bz2", ".xz", ".zst")
CODEC_PACKAGES = {".zst": "zstandard"}
"""The compressions whose codec is a package of its own (the others are in Python's standard library)."""
PROBE_BYTES = 1 << 16
_FIRST_LINE_LIMIT = 1 << 26  # a first JSON line longer than this is not judged here
_NOT_TEXT_SHARE = 0.25  # more undecodable characters than this in the probe: the file is not text in its encoding
log = logging.getLogger("hf_asyncpp.data")


def expand_files(patterns: list[str], field: str) -> list[str]:
    """Paths and globs (``**`` allowed) -> sorted, de-duplicated files; a pattern that matches nothing is an error.
    A glob keeps broken links, so that :func:`screen_files` reports them instead of dropping them unseen."""
    files: list[str] = []
    for p in patterns:
        if os.path.isdir(p):
            raise DataFileNotFound(f"{field}: {p!r} is a directory; name its files, e.g. {os.path.join(p, '*.jsonl')!r}")
        hits = sorted(glob.glob(p, recursive=True)) if any(c in p for c in "*?[") else ([p] if os.path.exists(p) else [])
        hits = [h for h in hits if os.path.isfile(h) or (os.path.islink(h) and not os.path.exists(h))]
        if not hits:
            raise DataFileNotFound(f"{field}: {p!r} matches no file")
        files.extend(h for h in hits if h not in files)
    return files


def builder(files: list[str]) -> str:
    """The datasets builder of the files (``text``, ``json`` or ``parquet``); they must all be of one kind. A parquet
    file compresses inside (its columns' codec), and ``datasets`` cannot read one compressed again as a whole."""
    for f in files:
        check_compression(f)
    kinds = {kind_of(f) for f in files}
    if None in kinds or len(kinds) != 1:
        raise DataError(f"data files must all be of one kind: text ({', '.join(k for k, v in BUILDERS.items() if v == 'text')}), "
                        f"jsonl (.jsonl, .json) or parquet (.parquet), optionally compressed ({', '.join(COMPRESSION)}); "
                        f"got {files[:5]}")
    return kinds.pop()


def kind_of(path: str) -> str | None:
    name = path.lower()
    for c in COMPRESSION:
        name = name.removesuffix(c)
    return BUILDERS.get(Path(name).suffix)


def check_compression(path: str) -> None:
    """A compressed file that ``datasets`` cannot read, whatever its bytes: a parquet file (compressed inside, read only
    as it is), or one whose codec fsspec cannot load; one line naming the fix (the package to install)."""
    suffix = next((c for c in COMPRESSION if path.lower().endswith(c)), None)
    if suffix is not None and kind_of(path) == "parquet":
        raise DataError(f"{path}: a compressed parquet file cannot be read (datasets reads parquet only as it is); "
                        "decompress it, or write the table with its own codec: pyarrow.parquet.write_table(..., "
                        "compression='zstd')")
    if suffix is not None and infer_compression(path) is None:
        package = CODEC_PACKAGES.get(suffix, suffix.lstrip("."))
        raise DataError(f"{path}: reading {suffix} files needs the {package} package, which is not installed: "
                        f"pip install {package}")


def open_data_file(path: str):
    """The file's decompressed bytes, opened as ``datasets`` opens it (fsspec, compression inferred from the name),
    buffered: zstandard's reader has no ``readline``."""
    check_compression(path)
    f = fsspec.open(path, mode="rb", compression="infer").open()
    return f if infer_compression(path) is None else io.BufferedReader(f)


def _first_invalid(chunk: bytes, encoding: str, whole: bool) -> int | None:
    """The offset of the first byte of ``chunk`` not valid in ``encoding`` (None: every byte is). A character that
    the end of the probe cuts in two is not invalid unless the probe is the ``whole`` file."""
    try:
        codecs.getincrementaldecoder(encoding)("strict").decode(chunk, final=whole)
    except UnicodeDecodeError as e:
        return e.start
    return None


def _not_text(chunk: bytes, encoding: str, whole: bool, first_invalid: int | None) -> bool:
    """Binary: a NUL byte (no text in an ASCII-compatible encoding has one; config: ``_check_encoding``), or more than
    a quarter of the probe undecodable."""
    if b"\x00" in chunk:
        return True
    if first_invalid is None:
        return False
    text = codecs.getincrementaldecoder(encoding)("replace").decode(chunk, final=whole)
    return text.count("\ufffd") > _NOT_TEXT_SHARE * max(1, len(text))


def _name(encoding: str) -> str:
    return "UTF-8" if codecs.lookup(encoding).name == "utf-8" else encoding


def _json_problem(path: str, f, text_column: str, encoding: str) -> str | None:
    for number in range(1, 1000):
        line = f.readline(_FIRST_LINE_LIMIT)
        if not line:
            return None  # only blank lines: an empty file, counted by the reader
        if not line.strip():
            continue
        if not line.endswith(b"\n") and len(line) >= _FIRST_LINE_LIMIT:
            return None
        if line.lstrip().startswith(b"["):  # a .json array: not judged line by line
            return None
        try:
            obj = json.loads(line.decode(encoding, errors="replace"))
        except ValueError as e:
            return f"{path}: not JSON lines (line {number}: {e})"
        if not isinstance(obj, dict):
            return f"{path}: not JSON lines of objects (line {number} is a {type(obj).__name__})"
        if text_column not in obj:
            return f"data.text_column: {text_column!r} is not a column of {path} (columns: {sorted(obj)})"
        return None
    return None


def _parquet_problem(path: str, text_column: str) -> str | None:
    import pyarrow.parquet as pq  # only for parquet corpora

    try:
        names = pq.read_schema(path).names
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid and OSError for a file that is not parquet
        return f"{path}: not a parquet file ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    if text_column not in names:
        return f"data.text_column: {text_column!r} is not a column of {path} (columns: {sorted(names)})"
    return None


def _examine(path: str, text_column: str, encoding: str) -> tuple[str | None, str | None]:
    """(problem, note): why ``path`` cannot be used (None: it looks usable), and, for a usable file whose probe is not
    valid in ``encoding``, the warning that names it."""
    kind = kind_of(path)
    check_compression(path)
    try:
        if kind == "parquet":
            with open(path, "rb"):
                pass
            return _parquet_problem(path, text_column), None
        with open_data_file(path) as f:
            chunk = f.read(PROBE_BYTES)
            if not chunk:
                return None, None
            whole = len(chunk) < PROBE_BYTES
            bad = _first_invalid(chunk, encoding, whole)
            name = _name(encoding)
            if _not_text(chunk, encoding, whole, bad):
                return f"{path}: not {name} text (binary data in its first {len(chunk)} bytes)", None
            note = None if bad is None else (
                f"{path}: not valid {name} (first invalid byte {chunk[bad]:#04x} at offset {bad}); its invalid bytes are "
                "read as U+FFFD" + ("; if the file is Latin-1 or cp1252 text set data.encoding: latin-1 or cp1252"
                                    if name == "UTF-8" else ""))
        if kind == "json":
            with open_data_file(path) as f:  # opened again: a zstd stream cannot seek back
                return _json_problem(path, f, text_column, encoding), note
        return None, note
    except OSError as e:
        return f"{path}: cannot be read ({e.strerror or e})", None
    except EOFError as e:  # a truncated compressed file
        return f"{path}: cannot be read ({e})", None


def problem_of(path: str, text_column: str, encoding: str = "utf-8") -> str | None:
    """Why ``path`` cannot be used as a data file (None: it looks usable). An empty file is not a problem here, nor
    is one whose first 64 KiB are mostly text in ``encoding`` with a few invalid bytes (:func:`screen_files` names it)."""
    return _examine(path, text_column, encoding)[0]


_SCREENED: dict[tuple, str | None] = {}
"""(path, size, mtime, ctime, mode, column, encoding) -> :func:`problem_of`'s answer: a process screens each file once,
however many streams (the tokenizer's corpus, the held-out blocks, the training stream) read it, and so warns once
about a file not valid in its encoding; a changed file is screened again."""


def _problem(f: str, text_column: str, encoding: str) -> str | None:
    try:
        st = os.stat(f)
        key = (f, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode, text_column, encoding)
    except OSError:
        return problem_of(f, text_column, encoding)  # gone or a broken link: said by problem_of, never remembered
    if key not in _SCREENED:
        _SCREENED[key], note = _examine(f, text_column, encoding)
        if note is not None and _SCREENED[key] is None:
            log.warning("%s", note)
    return _SCREENED[key]


def screen_files(files: list[str], text_column: str, encoding: str = "utf-8") -> tuple[list[str], list[str], dict[str, str]]:
    """(usable, empty, skipped): the files to read, the empty ones, and the unusable ones with their reasons. A usable
    file not valid in ``encoding`` is named in a warning the first time this process screens it."""
    usable, empty, skipped = [], [], {}
    for f in files:
        reason = _problem(f, text_column, encoding)
        if reason is not None:
            skipped[f] = reason
        elif os.path.getsize(f) == 0:
            empty.append(f)
        else:
            usable.append(f)
    return usable, empty, skipped
