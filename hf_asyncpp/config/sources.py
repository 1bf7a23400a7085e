"""The recipe's model and data sections: what a run trains and what it reads (``config.Recipe`` holds them).

Apart from ``recipe.py`` because a user brings these most often (their own model folder, tokenizer, files or
Hub dataset: docs/bring-your-own.md), and because two pairs of their fields are alternatives
(:data:`ALTERNATIVES`), which the command line resolves in ``config.apply_overrides``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

__all__ = ["ModelConfig", "DataConfig", "ALTERNATIVES", "bounds"]


def bounds(lo=None, hi=None, lo_open=False):
    """A numeric field's allowed range, as field metadata (checked by ``config._check_range``, listed in docs/recipes.md)."""
    return {"lo": lo, "hi": hi, "lo_open": lo_open}


ALTERNATIVES = (("model", "config", "name_or_path"), ("data", "dataset", "train_files"))
"""(section, field, field): a recipe gives at most one of the two. One given on the command line replaces the other
one of the recipe file, so that ``--model.name_or_path=my-model`` over a random-init recipe trains my-model."""


@dataclass(kw_only=True)
class ModelConfig:
    config: Optional[dict] = None
    """Kwargs for ``AutoConfig.for_model`` (must contain ``model_type``): random init, each key checked against the
    model type's config class before anything runs. Give this or ``name_or_path``; ``--model.name_or_path=...`` on
    the command line replaces a recipe's ``config``."""
    name_or_path: Optional[str] = None
    """A local folder (written by ``save_pretrained``) or a Hub id for ``from_pretrained``: its weights and, unless
    ``tokenizer_name_or_path`` is set, its tokenizer (docs/bring-your-own.md)."""
    tokenizer_name_or_path: Optional[str] = None
    """A tokenizer folder or Hub id. Unset: the tokenizer of ``name_or_path``; with ``config`` (random init), a
    byte-level BPE of ``vocab_size`` trained on the training files and saved with the run (a streamed
    ``data.dataset`` needs a tokenizer given here)."""
    vocab_size: int = field(default=4096, metadata=bounds(lo=256))
    """Vocabulary size of the byte-level BPE trained when no tokenizer is given."""
    attn_implementation: Optional[str] = None
    """``sdpa``, ``eager``, ... (None: the model's default)."""


@dataclass(kw_only=True)
class DataConfig:
    dataset: Optional[str] = None
    """Hub id, datasets builder name or dataset folder, streamed (``load_dataset(dataset, dataset_config,
    split=train_split, streaming=True)``); give this or ``train_files``."""
    dataset_config: Optional[str] = None
    """Builder config name for ``dataset``."""
    train_split: str = "train"
    """Split of ``dataset`` to train on."""
    eval_split: Optional[str] = None
    """Split of ``dataset`` for evaluation (None: 1 in 50 documents of the training stream, chosen by hash, are held out)."""
    train_files: Optional[list[str]] = None
    """Local files or globs, replacing the default corpus: ``.txt``/``.md`` (a document per paragraph), ``.jsonl``/``.json``
    or ``.parquet``, optionally compressed (``.gz``, ``.bz2``, ``.xz``, ``.zst``)."""
    eval_files: Optional[list[str]] = None
    """Local held-out files or globs."""
    text_column: str = "text"
    """Column holding the document text (jsonl, parquet, Hub datasets)."""
    encoding: str = "utf-8"
    """Text encoding of the local text and jsonl files (a Python codec that keeps ASCII as ASCII: ``latin-1``,
    ``cp1252``, ...). A byte not valid in it is read as U+FFFD and its document still trained on; the files and
    documents with such bytes are named in the log and counted (``invalid_utf8_documents``, ``invalid_utf8_replaced``)."""
    seq_len: int = field(default=128, metadata=bounds(lo=2))
    """Tokens per packed training block; at most the model's positions (``max_position_embeddings``)."""
    shuffle_buffer: int = field(default=1000, metadata=bounds(lo=0))
    """Documents in the streaming shuffle buffer (0: no shuffle)."""
    prefetch_batches: int = field(default=2, metadata=bounds(lo=0))
    """Training batches tokenized and packed ahead by a background thread, so a step never waits for text (0: packed
    inline, on the training thread)."""
    eval_blocks: int = field(default=32, metadata=bounds(lo=1))
    """Packed blocks of the held-out stream used for each evaluation."""
    min_document_tokens: Optional[int] = field(default=0, metadata=bounds(lo=0))
    """Documents with fewer tokens are skipped, in training and held-out data alike, and their number is reported
    each epoch. 0: none is; short documents are packed together (as transformers' ``run_clm``); null: ``seq_len``."""
    data_dir: str = "data/sotu"
    """Where the default corpus (State of the Union addresses) is prepared."""
