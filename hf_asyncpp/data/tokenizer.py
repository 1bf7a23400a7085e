"""Tokenizer: from a path or Hub id, or a byte-level BPE trained on the corpus and saved with the run.

The trained tokenizer is GPT-2 style: byte-level pre-tokenizer and decoder (every string
round-trips exactly, no unknown token), BPE merges learned on the training documents as the
data stream reads them, ``<|endoftext|>`` (id 0) as bos/eos and ``<|pad|>`` (id 1). It is
wrapped as a transformers fast tokenizer (``TokenizersBackend`` in transformers 5) and saved
with ``save_pretrained``, so ``AutoTokenizer.from_pretrained(out_dir)`` loads it.
"""
from __future__ import annotations

import itertools
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Union

from ..config.sections import ModelConfig
from ..errors import DataError, RecipeError
from ..storage.write import writing
from .sources import iter_documents

__all__ = ["load_or_train_tokenizer", "checkpoint_tokenizer", "adopt_tokenizer", "train_tokenizer", "EOS", "PAD"]

log = logging.getLogger("hf_asyncpp.tokenizer")
EOS, PAD = "<|endoftext|>", "<|pad|>"


def _capped(texts, max_chars: int | None, seen: list[int]):
    n = 0
    for t in texts:
        yield t
        n += len(t)
        seen[0] += 1
        if max_chars is not None and n >= max_chars:
            log.info("tokenizer training stopped at %d characters (max_train_chars)", n)
            return


Corpus = Union[list[str], list[tuple[list[str], str]]]
"""Local files of one source (read with one ``text_column``), or a mixture's: ``(files, text_column)`` per source."""


def _groups(files: Corpus, text_column: str) -> list[tuple[list[str], str]]:
    return list(files) if files and isinstance(files[0], tuple) else [(list(files or []), text_column)]


def train_tokenizer(files: Corpus, vocab_size: int, text_column: str = "text", *, encoding: str = "utf-8",
                    max_train_chars: int | None = 1_000_000_000):
    """Train a byte-level BPE of ``vocab_size`` tokens (specials included) on local files.

    Args:
        files: text/jsonl/parquet files (see :mod:`hf_asyncpp.data.stream` for how documents are read), or a
            mixture's local sources as ``(files, text_column)`` pairs, read one source after the other.
        vocab_size: final vocabulary size; smaller when the corpus has too few distinct pairs.
        text_column: document column of jsonl/parquet files.
        encoding: text encoding of text/jsonl files (``data.encoding``); invalid bytes are read as U+FFFD,
            their documents kept, as the training stream keeps them.
        max_train_chars: stop after the documents holding this many characters (file order); None: all.

    Returns:
        a transformers fast tokenizer with eos/bos ``<|endoftext|>`` and pad ``<|pad|>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast


    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    seen = [0]
    groups = _groups(files, text_column)
    documents = itertools.chain.from_iterable(iter_documents(f, column, encoding) for f, column in groups)
    tok.train_from_iterator(_capped(documents, max_train_chars, seen), trainer=trainer)
    if not seen[0]:
        raise DataError(f"no text to train a tokenizer on in {[f for g, _ in groups for f in g][:5]} "
                        f"(data.text_column={', '.join(repr(c) for _, c in groups)})")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=PAD)


def _save_atomic(tok, out: Path, copy_from: Path | None = None) -> None:
    """save_pretrained (or copy ``copy_from``'s files) into a temporary folder, then move the files in,
    ``tokenizer.json`` (the completeness marker that :func:`load_or_train_tokenizer` checks) last."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with writing(out):
        if copy_from is not None:
            shutil.copytree(copy_from, tmp)
        else:
            tok.save_pretrained(str(tmp))
        out.mkdir(parents=True, exist_ok=True)
        names = sorted(os.listdir(tmp), key=lambda n: n == "tokenizer.json")
        for name in names:
            os.replace(tmp / name, out / name)
        tmp.rmdir()


def checkpoint_tokenizer(path: Path, model_cfg: ModelConfig):
    """The tokenizer a checkpoint was trained with (its ``tokenizer/``), whatever the training files now are.

    Raises:
        RecipeError: the recipe names another tokenizer (``model.tokenizer_name_or_path`` or ``name_or_path``).
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    asked = model_cfg.tokenizer_name_or_path or model_cfg.name_or_path
    if asked:
        other = AutoTokenizer.from_pretrained(asked)
        if other.get_vocab() != tok.get_vocab():
            field = "model.tokenizer_name_or_path" if model_cfg.tokenizer_name_or_path else "model.name_or_path"
            raise RecipeError(f"{field}: the tokenizer of {asked!r} ({len(other)} tokens) is not the one {path.parent.name} "
                              f"was trained with ({len(tok)} tokens, in {path}); leave it unset to resume with the "
                              "checkpoint's, or start a new run")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def adopt_tokenizer(path: Path, out_dir) -> None:
    """Make a checkpoint's tokenizer files the run's ``out_dir`` tokenizer (the export and later runs use it)."""
    out = Path(out_dir)
    mine = out / "tokenizer.json"
    if mine.exists() and mine.read_bytes() == (Path(path) / "tokenizer.json").read_bytes():
        return
    if mine.exists():
        log.warning("replacing the tokenizer in %s with the one %s was trained with", out, Path(path).parent.name)
    _save_atomic(None, out, copy_from=Path(path))


def load_or_train_tokenizer(model_cfg: ModelConfig, train_files: Corpus | None, text_column: str, out_dir, *,
                            encoding: str = "utf-8"):
    """The recipe's tokenizer, or one trained on ``train_files`` and saved to ``out_dir``.

    Order: ``model_cfg.tokenizer_name_or_path`` (path or Hub id), else the tokenizer of
    ``model_cfg.name_or_path``, else a tokenizer already saved in ``out_dir`` (idempotent: a
    second call, or a resumed run, reuses it whatever ``vocab_size`` says), else a new byte-level
    BPE of ``model_cfg.vocab_size`` trained on ``train_files`` (decoded with ``encoding``, ``data.encoding``; a
    mixture's local sources, :data:`Corpus`)
    and saved to ``out_dir``.
    A tokenizer without a pad token gets its eos token as pad.

    Raises:
        ValueError: no eos token (packing needs it), or nothing to train on.
    """
    from transformers import AutoTokenizer

    out = Path(out_dir)
    source = model_cfg.tokenizer_name_or_path or model_cfg.name_or_path
    if source:
        tok = AutoTokenizer.from_pretrained(source)
    elif (out / "tokenizer.json").exists():
        tok = AutoTokenizer.from_pretrained(str(out))
        source = str(out)
        if len(tok) != model_cfg.vocab_size:
            log.warning("reusing the %d-token tokenizer in %s (model.vocab_size asks for %d; delete the folder to "
                        "train a new one)", len(tok), out, model_cfg.vocab_size)
    else:
        if not train_files:
            raise RecipeError("model.tokenizer_name_or_path: no tokenizer given and no local training files to train "
                             "one on (streamed Hub datasets need a tokenizer); set model.tokenizer_name_or_path")
        t0 = time.perf_counter()
        tok = train_tokenizer(train_files, model_cfg.vocab_size, text_column, encoding=encoding)
        _save_atomic(tok, out)
        n_files = sum(len(f) for f, _ in _groups(train_files, text_column))
        log.info("trained a %d-token byte-level BPE on %d files in %.1fs; saved to %s", len(tok), n_files,
                 time.perf_counter() - t0, out)
        source = str(out)
    if tok.eos_token_id is None:
        raise RecipeError(f"model.tokenizer_name_or_path: tokenizer {source}: it has no eos token, which packing needs to join documents; "
                         "choose another model.tokenizer_name_or_path")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok
