"""Tokenizer: from a path or Hub id, or a byte-level BPE trained on the corpus and saved with the run."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from .config import ModelConfig

log = logging.getLogger("hf_asyncpp.tokenizer")
EOS, PAD = "<|endoftext|>", "<|pad|>"


def _iter_texts(files: list[str], text_column: str):
    """Raw documents of local text/jsonl files for tokenizer training (invalid bytes replaced)."""
    for f in files:
        if f.endswith((".jsonl", ".json")):
            with open(f, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    line = line.strip()
                    if line:
                        try:
                            text = json.loads(line).get(text_column)
                        except (json.JSONDecodeError, AttributeError):
                            continue
                        if isinstance(text, str) and text.strip():
                            yield text
        elif f.endswith(".parquet"):
            import pyarrow.parquet as pq

            for text in pq.read_table(f, columns=[text_column]).column(text_column).to_pylist():
                if isinstance(text, str) and text.strip():
                    yield text
        else:
            with open(f, encoding="utf-8", errors="replace") as fh:
                yield from (line for line in fh if line.strip())


def train_tokenizer(files: list[str], vocab_size: int, text_column: str = "text"):
    """Byte-level BPE (GPT-2 style) with ``<|endoftext|>`` as bos/eos and ``<|pad|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_iter_texts(files, text_column), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=PAD)


def load_or_train_tokenizer(model_cfg: ModelConfig, train_files: list[str] | None, text_column: str, out_dir):
    """The recipe's tokenizer, or one trained on the training files and saved to ``out_dir`` (reused if there)."""
    from transformers import AutoTokenizer

    out = Path(out_dir)
    if model_cfg.tokenizer_name_or_path:
        tok = AutoTokenizer.from_pretrained(model_cfg.tokenizer_name_or_path)
    elif model_cfg.name_or_path:
        tok = AutoTokenizer.from_pretrained(model_cfg.name_or_path)
    elif (out / "tokenizer.json").exists():
        tok = AutoTokenizer.from_pretrained(str(out))
    else:
        if not train_files:
            raise ValueError("model.tokenizer_name_or_path: no tokenizer given and no local training files to train one on "
                             "(streamed Hub datasets need a tokenizer); set model.tokenizer_name_or_path")
        log.info("training a %d-token byte-level BPE on %d files", model_cfg.vocab_size, len(train_files))
        tok = train_tokenizer(train_files, model_cfg.vocab_size, text_column)
        tmp = out.with_name(out.name + ".tmp")
        tok.save_pretrained(str(tmp))
        if out.exists():
            import shutil

            shutil.rmtree(out)
        tmp.rename(out)
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer {model_cfg.tokenizer_name_or_path or model_cfg.name_or_path}: it has no eos token, "
                         "which packing needs to join documents")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok
