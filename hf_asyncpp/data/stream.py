"""Streaming pretraining data: files or Hub datasets -> documents -> tokens -> packed blocks.

Every source goes through ``datasets.load_dataset(..., streaming=True)``, so a
local slice and a multi-TB Hub corpus take the same path:

* the sources (local files, a Hub dataset, the default corpus): ``sources``.

Packing: each kept document is tokenized without special tokens, followed by
one EOS, and the token stream is cut into ``seq_len`` blocks (no padding).
Every token of every kept document lands in exactly one block of the epoch,
except the tail shorter than a block at the end of each epoch (per rank), which
is dropped and counted in ``stats["dropped_tail_tokens"]``. Documents are
shuffled through a seeded buffer of ``shuffle_buffer`` documents; each epoch
reshuffles with seed ``seed + epoch``; the stream repeats forever unless
``repeat=False``. Each data-parallel rank reads its own shard of the stream
(``split_dataset_by_node``: whole files when their number is a multiple of the
world size, else every ``world_size``-th document of every file).

Resume: ``state_dict()`` holds the position of the next block as (epoch, index
of the document in the epoch's shuffled stream, token offset in it). A resumed
stream re-reads the epoch's documents up to that index *without tokenizing
them* (the cost of reading the raw stream, ~0.1 s per epoch of the default
corpus) and yields exactly the blocks an uninterrupted stream would have; a
streamed ``data.dataset`` does not re-read: its state also holds datasets' own
``IterableDataset.state_dict()`` and the shuffle buffer (:mod:`hf_asyncpp.data.shuffle`). A
state with only ``{"epoch", "blocks"}`` (e.g. after changing the data-parallel
size) is also accepted: the epoch is then re-tokenized and that many blocks skipped.

Bad data never crashes a run: unreadable, binary, non-JSON and wrong-column
files among good ones (``skipped_files``, each named in the log; see
:mod:`hf_asyncpp.data.files`), empty files, empty or blank documents and
non-string values (``skipped_empty``) and documents with fewer than
``min_document_tokens`` tokens (``skipped_short``; the default 0 skips none:
short documents are packed together, as transformers' ``run_clm`` does, where a
minimum of one block dropped 84% of a corpus of paragraphs at ``seq_len`` 128;
null: ``seq_len``) are skipped, counted in ``BlockStream.stats`` and logged
(logger ``hf_asyncpp.data``; the short ones also as a count at the end of each
epoch). A corpus with no usable document at all, or fewer tokens than one block,
is a ``DataError`` (a ``ValueError``) naming its files, each skipped file's
reason and the column.

Text files and JSON lines are decoded with ``data.encoding`` (UTF-8 by
default). Bytes not valid in it are read as U+FFFD replacement characters
and their document is trained on, not skipped: a Latin-1 or cp1252 file read as
UTF-8 would otherwise lose every document with an accented letter (all of a
French corpus), and skipping them used to leave "no text to train a tokenizer
on". Such files are named when screened, with their first invalid byte; the
documents and replacement characters are counted
(``invalid_utf8_documents``, ``invalid_utf8_replaced``; a U+FFFD that the text
itself holds, e.g. in a Hub dataset, is counted too), the first document is
named in a warning with the fix (``data.encoding: latin-1`` or ``cp1252``), and
each epoch's share is said at its end.
"""
from __future__ import annotations

import codecs
import itertools
import logging
from typing import Iterator

import torch

from ..config.sections import DataConfig
from ..errors import DataError
from .files import builder as _builder, screen_files
from .shuffle import ShuffledDocuments
from .sources import _rows, _skip_reason, is_held_out, load_stream, log_skipped_files, nothing_usable

__all__ = ["BlockStream", "eval_blocks", "next_batch"]

log = logging.getLogger("hf_asyncpp.data")
_TOKENIZE_BATCH = 64  # documents per tokenizer call
_EPOCH_COUNTS = ("documents", "tokens", "skipped_short", "invalid_utf8_documents", "invalid_utf8_replaced")



# ---------------------------------------------------------------------------- packing


class BlockStream:
    """Iterator of ``seq_len`` token blocks (LongTensor of shape ``(seq_len,)``) from this
    data-parallel rank's shard of the stream. See the module docstring for the rules.

    Args:
        cfg: the recipe's data section (``seq_len``, ``shuffle_buffer``, ``text_column``,
            ``min_document_tokens``, and ``dataset``/``train_split``/``eval_split`` when ``files`` is None).
        tokenizer: a transformers tokenizer with an EOS token.
        files: local files (already expanded), or None to stream ``cfg.dataset``.
        rank, world_size: this process's data-parallel rank and the data-parallel size.
        seed: shuffle seed; epoch ``e`` shuffles with ``seed + e``.
        shuffle: shuffle documents through a buffer of ``cfg.shuffle_buffer`` (0 disables).
        repeat: start a new epoch when the data runs out (else ``StopIteration``).
        split: ``"train"`` or ``"eval"`` (``cfg.eval_split`` of ``cfg.dataset``).
        hold_out: ``"exclude"`` drops the hashed hold-out (:func:`is_held_out`), ``"only"`` keeps
            only it, None keeps every document.

    Attributes:
        stats: cumulative counts over the epochs read so far (documents, tokens, skipped_empty,
            skipped_short, dropped_tail_tokens, empty_files, skipped_files, invalid_utf8_documents: kept
            documents with U+FFFD, invalid_utf8_replaced: their U+FFFD characters); restored by
            :meth:`load_state_dict` (a state saved before the invalid_utf8 counts keeps its
            skipped_invalid_utf8, the documents it skipped, and counts the new ones from 0).
        epoch, blocks: the current epoch and the blocks yielded in it.
    """

    def __init__(self, cfg: DataConfig, tokenizer, files: list[str] | None, *, rank: int = 0, world_size: int = 1,
                 seed: int = 0, shuffle: bool = True, repeat: bool = True, split: str = "train",
                 hold_out: str | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a data-parallel world of {world_size}")
        if hold_out not in (None, "exclude", "only"):
            raise ValueError(f"hold_out: {hold_out!r}; choose None, 'exclude' or 'only'")
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token, which packing needs to join documents")
        self.cfg, self.tok = cfg, tokenizer
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.shuffle, self.repeat, self.split, self.hold_out = shuffle and cfg.shuffle_buffer > 0, repeat, split, hold_out
        self.min_tokens = cfg.seq_len if cfg.min_document_tokens is None else cfg.min_document_tokens
        self.eos = tokenizer.eos_token_id
        self.files = list(files) if files else None
        self._readable, empty, self.skipped_files = screen_files(self.files or [], self._column(), cfg.encoding)
        self.source = self.files if self.files else f"dataset {cfg.dataset!r} split {self._split_name()!r}"
        self.stats = {"documents": 0, "tokens": 0, "skipped_empty": 0, "skipped_short": 0, "dropped_tail_tokens": 0,
                      "empty_files": len(empty), "skipped_files": len(self.skipped_files),
                      "invalid_utf8_documents": 0, "invalid_utf8_replaced": 0}
        if empty:
            log.warning("skipping %d empty data file(s): %s", len(empty), empty[:5])
        log_skipped_files(self.skipped_files)
        self.epoch, self.blocks = 0, 0
        self._pos: tuple[int, int] | None = (0, 0)  # (document index, token offset) of the next block; None: unknown
        self._skip_blocks = 0
        self._it = None
        self._base = None
        self._logged: set[str] = set()
        self._docs: ShuffledDocuments | None = None  # a streamed dataset's epoch, resumable without re-reading
        self._resume_docs: dict | None = None  # its saved position, for the epoch being resumed
        self._epoch_counts = dict.fromkeys(_EPOCH_COUNTS, 0)  # of the epoch being read

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """JSON-serialisable position: load it into a new stream to continue exactly here."""
        sd = {"epoch": self.epoch, "blocks": self.blocks, "seq_len": self.cfg.seq_len, "rank": self.rank,
              "world_size": self.world_size, "seed": self.seed, "stats": dict(self.stats)}
        if self._pos is not None:
            sd["document"], sd["offset"] = self._pos
            if self._docs is not None and self._docs.epoch == self.epoch:  # where a streamed dataset continues (datasets' state + the shuffle buffer)
                sd["stream"] = self._docs.state_at(self._pos[0])
            elif self._resume_docs is not None:  # loaded, not read since
                sd["stream"] = self._resume_docs
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Continue from ``sd``. Keys other than ``epoch`` and ``blocks`` are optional (see the module docstring)."""
        for key, mine in (("seq_len", self.cfg.seq_len), ("world_size", self.world_size), ("rank", self.rank),
                          ("seed", self.seed)):
            if key in sd and sd[key] != mine:
                raise DataError(f"data state was saved with {key}={sd[key]}, this stream has {key}={mine}; the saved "
                                 f"position does not apply (resume with the same data.seq_len, data-parallel layout "
                                 f"and training.seed, or pass only {{'epoch', 'blocks'}} to re-derive the position)")
        self.epoch, self.blocks = int(sd["epoch"]), int(sd["blocks"])
        self._pos = (int(sd["document"]), int(sd["offset"])) if "document" in sd else None
        self._skip_blocks = 0 if self._pos is not None else self.blocks
        self.stats.update(sd.get("stats", {}))
        self._it, self._docs = None, None
        self._resume_docs = sd.get("stream") if self.files is None and self._pos is not None else None

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> "BlockStream":
        return self

    def __next__(self) -> torch.Tensor:
        while True:
            if self._it is None:
                doc, offset = self._pos if self._pos is not None else (0, 0)
                self._it = self._epoch_blocks(self.epoch, doc, offset, self._skip_blocks)
            try:
                block, self._pos = next(self._it)
            except StopIteration:
                if self.blocks == 0:
                    raise DataError(self._empty_message()) from None
                self._end_of_epoch()
                if not self.repeat:
                    raise
                self.next_epoch()
                continue
            self.blocks += 1
            return block

    def next_epoch(self) -> None:
        """Start the next epoch (reshuffled) at its first block: what ``repeat`` does when an epoch ends; a mixture
        calls it for a source that ran out (:mod:`hf_asyncpp.data.mixture`)."""
        self.epoch, self.blocks, self._pos, self._skip_blocks, self._it = self.epoch + 1, 0, (0, 0), 0, None

    def _split_name(self) -> str:
        return (self.cfg.eval_split or "") if self.split == "eval" else self.cfg.train_split

    def _column(self) -> str:
        return "text" if self.files and _builder(self.files) == "text" else self.cfg.text_column

    def _dataset(self):
        """This rank's shard of the unshuffled stream (built once, reshuffled per epoch)."""
        if self._base is None:
            from datasets.distributed import split_dataset_by_node

            if self.files is not None and not self._readable:
                raise DataError(self._empty_message())
            try:
                ds = load_stream(self.cfg, self._readable or None, split=self.split)
            except (ValueError, OSError) as e:  # e.g. malformed JSON lines (pyarrow.ArrowInvalid is a ValueError)
                if not self.files or isinstance(e, DataError):
                    raise
                raise DataError(f"reading {self._readable}: {type(e).__name__}: {e}") from e
            col = self._column()
            if ds.features and col not in ds.features:
                raise DataError(f"data.text_column: {col!r} is not a column of {self.source} "
                                 f"(columns: {sorted(ds.features)})")
            if self.world_size > 1:
                if ds.n_shards % self.world_size:
                    log.info("%d data shards for %d data-parallel ranks: every rank reads every shard and keeps every "
                             "%d-th document (use a multiple of %d files for faster reading)", ds.n_shards,
                             self.world_size, self.world_size, self.world_size)
                ds = split_dataset_by_node(ds, rank=self.rank, world_size=self.world_size)
            self._base = ds
        return self._base

    def _documents(self, epoch: int, start: int = 0) -> Iterator[object]:
        """The raw documents (text, or whatever the column holds) of ``epoch`` from the ``start``-th, in stream order,
        after the hold-out. A streamed dataset resumes at a saved position without reading what it passed."""
        if self.files is None:
            saved, self._resume_docs = self._resume_docs, None
            if saved is not None and (saved["epoch"], saved["document"]) != (epoch, start):
                saved = None
            keep = None if not self.hold_out else (
                lambda t: not isinstance(t, str) or is_held_out(t) == (self.hold_out == "only"))
            self._docs = ShuffledDocuments(self._dataset(), self._column(), seed=self.seed, epoch=epoch,
                                           buffer_size=self.cfg.shuffle_buffer if self.shuffle else 0, keep=keep,
                                           state=saved, where=self.source)
            docs = iter(self._docs)
            return docs if saved is not None or not start else itertools.islice(docs, start, None)
        docs = self._file_documents(epoch)
        return itertools.islice(docs, start, None) if start else docs

    def _file_documents(self, epoch: int) -> Iterator[object]:
        ds = self._dataset()
        if self.shuffle:
            ds = ds.shuffle(seed=self.seed + epoch, buffer_size=self.cfg.shuffle_buffer)
        col = self._column()
        for ex in _rows(ds, self._readable or self.source):
            text = ex.get(col) if isinstance(ex, dict) else None
            if self.hold_out and isinstance(text, str) and is_held_out(text) != (self.hold_out == "only"):
                continue
            yield text

    def _epoch_blocks(self, epoch: int, doc: int, offset: int, skip_blocks: int):
        """Yield ``(block, (document, offset) of the next block)`` for one epoch.

        Starts at token ``offset`` of document ``doc`` (documents before it are read, not
        tokenized). ``skip_blocks`` > 0 (a state without a document position) re-tokenizes
        from the epoch start and drops that many blocks. Stats are counted only for what an
        uninterrupted stream would count after the resume point (the rest was saved with the state).
        """
        T, eos = self.cfg.seq_len, self.eos
        counting = skip_blocks == 0
        self._epoch_counts = dict.fromkeys(_EPOCH_COUNTS, 0)
        buf: list[int] = []
        start = made = 0
        docs = self._documents(epoch, doc)
        index = doc
        while chunk := list(itertools.islice(docs, _TOKENIZE_BATCH)):
            usable = [t for t in chunk if _skip_reason(t) is None]
            encoded = iter(self.tok(usable, add_special_tokens=False, verbose=False)["input_ids"] if usable else ())
            for text in chunk:
                i, index = index, index + 1
                reason = _skip_reason(text)
                toks = None if reason else list(next(encoded))
                if toks is not None and len(toks) < self.min_tokens:
                    reason = "skipped_short"
                if i == doc and offset:  # the document the saved position points into (counted before the save)
                    if reason or offset > len(toks):
                        raise DataError(f"data state points at token {offset} of document {doc} of epoch {epoch}, "
                                         f"which this data and tokenizer do not have; was the corpus or tokenizer changed?")
                    toks.append(eos)
                    buf.extend(toks[offset:])
                else:
                    if reason:
                        if reason == "skipped_short":
                            self._epoch_counts["skipped_short"] += 1
                        if counting:
                            self._skipped(reason, epoch, i, text)
                        continue
                    toks.append(eos)
                    buf.extend(toks)
                    if counting:
                        self.stats["documents"] += 1
                        self.stats["tokens"] += len(toks)
                    self._epoch_counts["documents"] += 1
                    self._epoch_counts["tokens"] += len(toks)
                    if "\ufffd" in text:  # bytes not valid in data.encoding, read as U+FFFD: kept, counted, said
                        self._replaced(text, epoch, i, counting)
                # Cut blocks. What is left of the buffer after a cut lies inside this document
                # (the buffer held < T tokens before it), so (i, offset) locates the next block.
                while len(buf) - start >= T:
                    block = buf[start:start + T]
                    start += T
                    made += 1
                    if made == skip_blocks:
                        counting = True
                    if made > skip_blocks:
                        left = len(buf) - start
                        yield torch.tensor(block, dtype=torch.long), ((i, len(toks) - left) if left else (i + 1, 0))
                del buf[:start]
                start = 0
        if counting:
            self.stats["dropped_tail_tokens"] += len(buf)

    def _skipped(self, reason: str, epoch: int, index: int, text) -> None:
        self.stats[reason] += 1
        if reason not in self._logged:
            self._logged.add(reason)
            what = {"skipped_empty": "empty or non-text documents",
                    "skipped_short": f"documents shorter than data.min_document_tokens={self.min_tokens} tokens"}[reason]
            log.info("skipping %s (first: document %d of epoch %d on rank %d: %r); counted in BlockStream.stats[%r]",
                     what, index, epoch, self.rank, str(text)[:60], reason)

    def _replaced(self, text: str, epoch: int, index: int, counting: bool) -> None:
        """Count a kept document holding U+FFFD; the first one is named in a warning with the fix."""
        n = text.count("\ufffd")
        self._epoch_counts["invalid_utf8_documents"] += 1
        self._epoch_counts["invalid_utf8_replaced"] += n
        if not counting:
            return
        self.stats["invalid_utf8_documents"] += 1
        self.stats["invalid_utf8_replaced"] += n
        if "invalid_utf8" not in self._logged:
            self._logged.add("invalid_utf8")
            at = text.index("\ufffd")
            what = (f"documents with bytes not valid in data.encoding={self.cfg.encoding!r} are read with U+FFFD "
                    "replacement characters and" if self.files else "documents holding U+FFFD replacement characters are")
            log.warning("%s trained on (first: document %d of epoch %d on rank %d: %r); counted in BlockStream.stats"
                        "['invalid_utf8_documents'] and ['invalid_utf8_replaced']%s", what, index, epoch, self.rank,
                        text[max(0, at - 30):at + 30], self._fix())

    def _undecodable(self) -> str:
        return f" (bytes not valid in data.encoding={self.cfg.encoding!r})" if self.files else ""

    def _fix(self) -> str:
        if not self.files:  # a dataset's text holds them: the recipe cannot decode it otherwise
            return ""
        if codecs.lookup(self.cfg.encoding).name == "utf-8":
            return "; if the files are Latin-1 or cp1252 text, not UTF-8, set data.encoding: latin-1 (or cp1252)"
        return f"; check that the files are {self.cfg.encoding} text"

    def _end_of_epoch(self) -> None:
        c = self._epoch_counts
        log.info("epoch %d done on rank %d/%d: %d blocks of %d tokens; totals %s", self.epoch, self.rank,
                 self.world_size, self.blocks, self.cfg.seq_len, self.stats)
        if c["invalid_utf8_documents"]:  # the warning came with the first one; this is what each epoch holds
            log.info("%d of %d documents of epoch %d held %d U+FFFD replacement characters%s and were trained on%s",
                     c["invalid_utf8_documents"], c["documents"], self.epoch, c["invalid_utf8_replaced"],
                     self._undecodable(), self._fix())
        if c["skipped_short"]:  # a minimum the recipe set: what it cost is said every epoch
            log.warning("%d of %d documents of epoch %d were shorter than data.min_document_tokens=%d and skipped; "
                        "data.min_document_tokens: 0 (the default) packs short documents together instead",
                        c["skipped_short"], c["skipped_short"] + c["documents"], self.epoch, self.min_tokens)

    def _empty_message(self) -> str:
        if self.files is not None and not self._readable and self.skipped_files:
            return nothing_usable(self.skipped_files, self._column())
        c = self._epoch_counts
        where = f"{self.source} (rank {self.rank} of {self.world_size}"
        where += {None: ")", "exclude": ", without the hashed hold-out)", "only": ", hashed hold-out: 1 in 50 documents)"}[self.hold_out]
        if c["documents"]:
            return (f"only {c['tokens']} tokens in {c['documents']} usable documents in {where}: fewer than one block of "
                    f"data.seq_len={self.cfg.seq_len}; add data or lower data.seq_len")
        return (f"no usable document in {where}; stats: {self.stats}. Check the files, "
                f"data.text_column={self._column()!r} and data.min_document_tokens "
                f"(now {self.min_tokens}; 0 keeps every non-empty document)")


def eval_blocks(cfg: DataConfig, tokenizer, eval_files: list[str] | None, n_blocks: int,
                train_files: list[str] | None = None) -> torch.Tensor:
    """The first ``n_blocks`` blocks of the held-out stream, in order (no shuffle): the same every evaluation.

    The held-out stream is ``eval_files``, else ``cfg.eval_split`` of ``cfg.dataset``, else the
    documents of the training stream (``train_files`` or ``cfg.dataset``) held out by hash.

    Returns:
        LongTensor ``(n, seq_len)`` with ``n <= n_blocks`` (a warning is logged when fewer exist).
    """
    if eval_files:
        stream = BlockStream(cfg, tokenizer, eval_files, shuffle=False, repeat=False)
    elif cfg.dataset and cfg.eval_split:
        stream = BlockStream(cfg, tokenizer, None, shuffle=False, repeat=False, split="eval")
    else:
        stream = BlockStream(cfg, tokenizer, train_files, shuffle=False, repeat=False, hold_out="only")
    out = list(itertools.islice(stream, n_blocks))
    if len(out) < n_blocks:
        log.warning("the held-out stream has only %d of the %d eval blocks asked for (data.eval_blocks)", len(out), n_blocks)
    return torch.stack(out)


def next_batch(stream: BlockStream, num_microbatches: int, microbatch_size: int) -> torch.Tensor:
    """Token ids for one optimizer step: LongTensor ``(num_microbatches, microbatch_size, seq_len)``."""
    blocks = [next(stream) for _ in range(num_microbatches * microbatch_size)]
    return torch.stack(blocks).view(num_microbatches, microbatch_size, -1)
