"""Streaming, packing, sharding, bad data and resume of the data pipeline."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from hf_asyncpp.config import DataConfig, ModelConfig
from hf_asyncpp.data import BlockStream, eval_blocks, next_batch, prepare_default_corpus
from hf_asyncpp.tokenizer import load_or_train_tokenizer

FIXTURE = Path(__file__).parent / "fixtures" / "sotu_slice.jsonl"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_or_train_tokenizer(ModelConfig(config={"model_type": "llama"}, vocab_size=400), [str(FIXTURE)], "text",
                                   tmp_path_factory.mktemp("tok") / "tokenizer")


def write_docs(path: Path, docs: list[str]) -> str:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(path)


def docs_of(files) -> list[str]:
    return [json.loads(line)["text"] for f in files for line in Path(f).read_text().splitlines() if line.strip()]


def test_tokenizer_round_trips_and_is_reused(tok, tmp_path):
    text = "Fellow citizens of the Senate — and of the House: ünïcödé 2026!"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|pad|>"
    out = tmp_path / "tok"
    a = load_or_train_tokenizer(ModelConfig(config={"model_type": "llama"}, vocab_size=300), [str(FIXTURE)], "text", out)
    b = load_or_train_tokenizer(ModelConfig(config={"model_type": "llama"}, vocab_size=999), None, "text", out)  # reused
    assert len(a) == len(b) == 300


def test_packing_keeps_every_token_and_joins_with_eos(tok, tmp_path):
    docs = [f"Document {i}: " + " ".join(["liberty"] * (5 + 7 * i)) for i in range(12)]
    f = write_docs(tmp_path / "d.jsonl", docs)
    cfg = DataConfig(seq_len=16, shuffle_buffer=0, min_document_tokens=0)
    blocks = list(BlockStream(cfg, tok, [f], repeat=False, shuffle=False))
    flat = torch.cat(blocks).tolist()
    expected = []
    for d in docs:
        expected += tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert len(flat) == (len(expected) // 16) * 16  # only the tail shorter than a block is dropped
    assert flat == expected[: len(flat)]
    assert all(b.shape == (16,) for b in blocks)
    pieces = tok.decode(flat).split(tok.eos_token)
    assert pieces[:-1] == docs[: len(pieces) - 1]


@pytest.mark.parametrize("n_files", [4, 3])
def test_data_parallel_ranks_partition_the_stream(tok, tmp_path, n_files):
    docs = docs_of([FIXTURE])
    files = [write_docs(tmp_path / f"s{i}.jsonl", docs[i::n_files]) for i in range(n_files)]
    cfg = DataConfig(seq_len=32, shuffle_buffer=0, min_document_tokens=0)

    def doc_multiset(rank, world):
        # one block stream per rank; compare the documents each rank packs (the tails differ per rank)
        s = BlockStream(cfg, tok, files, rank=rank, world_size=world, shuffle=False, repeat=False)
        return Counter(t for t in s._documents(0))

    single = doc_multiset(0, 1)
    r0, r1 = doc_multiset(0, 2), doc_multiset(1, 2)
    assert not (set(r0) & set(r1))  # disjoint
    assert r0 + r1 == single  # nothing lost or duplicated
    tokens = lambda r, w: sum(b.numel() for b in BlockStream(cfg, tok, files, rank=r, world_size=w, shuffle=False, repeat=False))
    total = sum(len(tok(d, add_special_tokens=False)["input_ids"]) + 1 for d in single)
    assert total - 2 * 32 < tokens(0, 2) + tokens(1, 2) <= total


def test_bad_data_is_skipped_and_counted(tok, tmp_path):
    good = ["The Union is strong. " * 20, "We the people. " * 25]
    f1 = write_docs(tmp_path / "a.jsonl", [good[0], "", "   ", "too short"])
    (tmp_path / "empty.jsonl").write_text("")
    txt = tmp_path / "b.txt"
    txt.write_bytes(good[1].encode() + b"\n\n" + b"broken \xff\xfe bytes " * 20 + b"\n\n\n\n")
    cfg = DataConfig(seq_len=16, shuffle_buffer=0)
    s = BlockStream(cfg, tok, [f1, str(tmp_path / "empty.jsonl")], repeat=False, shuffle=False)
    n = len(list(s))
    assert n > 0 and s.stats["skipped_empty"] == 2 and s.stats["skipped_short"] == 1 and s.stats["documents"] == 1
    t = BlockStream(cfg, tok, [str(txt)], repeat=False, shuffle=False)
    assert len(list(t)) > 0 and t.stats["skipped_invalid_utf8"] == 1 and t.stats["documents"] == 1


def test_empty_corpus_is_a_clear_error(tok, tmp_path):
    f = write_docs(tmp_path / "blank.jsonl", ["", "  ", "x"])
    with pytest.raises(ValueError, match=r"no usable document in .*blank\.jsonl"):
        next(BlockStream(DataConfig(seq_len=16), tok, [f]))


def test_resume_yields_the_same_blocks_across_epochs(tok, tmp_path):
    f = write_docs(tmp_path / "d.jsonl", docs_of([FIXTURE])[:8])
    cfg = DataConfig(seq_len=64, shuffle_buffer=4)
    straight = BlockStream(cfg, tok, [f], seed=3)
    blocks = [next(straight) for _ in range(200)]  # several epochs of this small file
    assert straight.epoch >= 1
    for cut in (5, 77, 150):
        a = BlockStream(cfg, tok, [f], seed=3)
        for _ in range(cut):
            next(a)
        b = BlockStream(cfg, tok, [f], seed=3)
        b.load_state_dict(json.loads(json.dumps(a.state_dict())))
        assert all(torch.equal(next(b), blocks[cut + i]) for i in range(30))
    # a new epoch reshuffles
    e0 = BlockStream(cfg, tok, [f], seed=3)
    orders = [list(e0._documents(epoch)) for epoch in range(3)]
    assert sorted(orders[0]) == sorted(orders[1]) == sorted(orders[2]) and len({tuple(o) for o in orders}) > 1


def test_batches_and_eval_blocks(tok):
    cfg = DataConfig(seq_len=32, shuffle_buffer=10)
    s = BlockStream(cfg, tok, [str(FIXTURE)])
    assert next_batch(s, 3, 2).shape == (3, 2, 32)
    ev = eval_blocks(cfg, tok, [str(FIXTURE)], 5)
    assert ev.shape == (5, 32) and torch.equal(ev, eval_blocks(cfg, tok, [str(FIXTURE)], 5))
    # without eval files, documents are held out of training by hash
    held = eval_blocks(cfg, tok, None, 2, train_files=[str(FIXTURE)])
    train = BlockStream(cfg, tok, [str(FIXTURE)], hold_out="exclude", shuffle=False, repeat=False)
    train_docs = set(train._documents(0))
    only = BlockStream(cfg, tok, [str(FIXTURE)], hold_out="only", shuffle=False, repeat=False)
    assert held.shape[0] >= 1 and not (set(only._documents(0)) & train_docs)


def test_default_corpus_is_idempotent_and_held_out(tmp_path):
    train, evals = prepare_default_corpus(tmp_path / "sotu")
    stamp = [Path(f).stat().st_mtime_ns for f in train + evals]
    assert prepare_default_corpus(tmp_path / "sotu") == (train, evals)
    assert [Path(f).stat().st_mtime_ns for f in train + evals] == stamp
    assert len(train) == 4
    assert not set(docs_of(train)) & set(docs_of(evals))
