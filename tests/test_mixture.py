"""Weighted mixtures of data sources: the recipe's checks, each source's blocks in its own order, the token shares
against the weights, the stopping strategies, and exact resume of every source's position."""
from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest
import torch
import zstandard

from hf_asyncpp.config.recipe import recipe_from_dict
from hf_asyncpp.config.sections import DataConfig, ModelConfig
from hf_asyncpp.data.mixture import MixtureStream, resolve_sources, source_counts, source_eval_blocks, source_seed
from hf_asyncpp.data.sources import is_held_out, train_hold_out
from hf_asyncpp.data.stream import BlockStream
from hf_asyncpp.data.tokenizer import load_or_train_tokenizer
from hf_asyncpp.errors import DataError, RecipeError

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "sotu_slice.jsonl"  # 41 documents of the default corpus
MODEL = {"config": {"model_type": "llama"}}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_or_train_tokenizer(ModelConfig(**MODEL, vocab_size=400), [str(FIXTURE)], "text",
                                   tmp_path_factory.mktemp("tok") / "tokenizer")


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Three sources of other kinds and lengths: the default corpus's addresses (JSON lines, zstd), short notes
    (text, a paragraph each) and a dataset folder read through ``load_dataset`` (its own column)."""
    root = tmp_path_factory.mktemp("mix")
    sotu = [json.loads(line)["text"] for line in FIXTURE.read_text().splitlines() if line.strip()][:12]
    (root / "sotu.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps({"text": d}) + "\n" for d in sotu).encode()))
    notes = [f"Note {i}: the river rose over the lower fields and the harvest came in late." for i in range(120)]
    (root / "notes.txt").write_text("\n\n".join(notes) + "\n")
    folder = root / "hub_like"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"body": f"Record {i} of the ledger. " * (3 + i % 7)}) + "\n"
                                                for i in range(60)))
    return root


def mixture_cfg(root: Path, weights=(5, 3, 2), **kw) -> DataConfig:
    r = recipe_from_dict({"model": MODEL, "data": {"seq_len": 16, "shuffle_buffer": 8, **kw, "sources": [
        {"name": "sotu", "train_files": [str(root / "sotu.jsonl.zst")], "weight": weights[0]},
        {"name": "notes", "train_files": [str(root / "notes.txt")], "weight": weights[1]},
        {"name": "ledger", "dataset": str(root / "hub_like"), "text_column": "body", "weight": weights[2]}]}})
    return r.data


# ---------------------------------------------------------------------------- the recipe


@pytest.mark.parametrize("sources,error", [
    ([{"name": "a", "train_files": ["x"], "colum": "t"}], r"data.sources\[0\].colum: unknown field; allowed fields of "
                                                          r"data.sources\[0\]: dataset, dataset_config, eval_files"),
    ([{"name": "a", "train_files": ["x"], "weight": 0}], r"data.sources\[0\].weight: 0.0 is out of range; allowed: > 0.0"),
    ([{"name": "a", "train_files": ["x"]}, {"name": "b", "dataset": "d", "weight": -2}],
     r"data.sources\[1\].weight: -2.0 is out of range"),
    ([{"name": "a", "train_files": ["x"]}, {"name": "a", "dataset": "d"}],
     r"data.sources\[1\].name: 'a' is also the name of data.sources\[0\]; give each source its own name"),
    ([{"train_files": ["x"]}], r"data.sources\[0\].name: missing"),
    ([{"name": "web/en", "train_files": ["x"]}], r"data.sources\[0\].name: 'web/en'; use letters, digits"),
    ([{"name": "a"}], r"data.sources\[0\]: give exactly one of dataset or train_files$"),
    ([{"name": "a", "dataset": "d", "train_files": ["x"]}], r"data.sources\[0\]: give exactly one .*; both are set"),
    ([], r"data.sources: an empty list"),
])
def test_each_bad_source_field_is_one_error_naming_it(sources, error):
    with pytest.raises(RecipeError, match=error):
        recipe_from_dict({"model": MODEL, "data": {"sources": sources}})


def test_a_mixture_names_its_data_only_in_its_sources():
    with pytest.raises(RecipeError, match=r"data.sources: a mixture names its data in each source; remove data.dataset"):
        recipe_from_dict({"model": MODEL, "data": {"dataset": "d", "sources": [{"name": "a", "dataset": "d"}]}})
    with pytest.raises(RecipeError, match="data.stopping_strategy: 'oversample' is not allowed; choose one of "
                                          "'all_exhausted', 'first_exhausted', 'all_exhausted_without_replacement'"):
        recipe_from_dict({"model": MODEL, "data": {"stopping_strategy": "oversample"}})
    d = recipe_from_dict({"model": MODEL, "data": {"text_column": "content", "seq_len": 64, "sources": [
        {"name": "a", "train_files": ["x"], "weight": 3}, {"name": "b", "dataset": "d", "text_column": "t"}]}}).data
    configs = d.source_configs()
    assert {n: w for n, (_, w) in configs.items()} == {"a": 0.75, "b": 0.25}
    a, b = configs["a"][0], configs["b"][0]
    assert (a.train_files, a.dataset, a.text_column, a.seq_len, a.sources) == (["x"], None, "content", 64, None)
    assert (b.train_files, b.dataset, b.text_column) == (None, "d", "t")
    assert DataConfig().source_configs() == {"": (DataConfig(), 1.0)}  # one source: the data section itself


def test_on_the_command_line_one_source_and_a_mixture_replace_each_other():
    """As data.dataset and data.train_files do: trying a mixture recipe on one local corpus, or a one-source recipe as
    a mixture, is one flag."""
    from hf_asyncpp.config.recipe import load_recipe

    one = load_recipe(ROOT / "recipes" / "moe-10b.yaml", ["--data.train_files=[corpus/*.jsonl.zst]"]).data
    assert (one.sources, one.train_files) == (None, ["corpus/*.jsonl.zst"])
    mix = load_recipe(ROOT / "recipes" / "smollm2-360m.yaml",
                      ["--data.sources=[{name: web, dataset: HuggingFaceFW/fineweb-edu}, {name: mine, train_files: [a.jsonl]}]"]).data
    assert (mix.dataset, [s.name for s in mix.sources]) == (None, ["web", "mine"])
    with pytest.raises(RecipeError, match="data.sources: a mixture names its data in each source; remove data.train_files"):
        load_recipe(ROOT / "recipes" / "moe-10b.yaml", ["--data.train_files=[a.jsonl]", "--data.sources=[{name: a, dataset: d}]"])


# ---------------------------------------------------------------------------- the draws


def attribute(mixed: list[torch.Tensor], alone: dict[str, BlockStream]) -> list[str]:
    """Which source each block of the mixture is: the next block of exactly one source's own stream (read alone,
    with the source's seed). Fails if a block is none of them, so no block is lost, repeated or out of order."""
    heads = {n: next(s) for n, s in alone.items()}
    out = []
    for i, block in enumerate(mixed):
        match = [n for n, h in heads.items() if torch.equal(h, block)]
        assert len(match) == 1, f"block {i} is the next block of {match or 'no source'}"
        out.append(match[0])
        heads[match[0]] = next(alone[match[0]])
    return out


def alone(sources, tok, seed: int = 7, **kw) -> dict[str, BlockStream]:
    return {s.name: BlockStream(s.cfg, tok, s.train_files, seed=source_seed(seed, s.name),
                                hold_out=train_hold_out(s.cfg, s.eval_files), **kw) for s in sources}


def test_token_shares_match_the_weights_over_a_long_stream(tok, corpora):
    """4,000 blocks (64,000 tokens, several epochs of every source): each source's blocks are its own stream's, in
    order, and its share of the tokens is within 4 standard deviations of its weight. A block's source is drawn
    independently with probability w, so its count is Binomial(N, w): the bound is 4 * sqrt(w (1 - w) / N) of the
    share (0.032 at w = 0.5), which a correct stream misses with probability below 1e-4 per source."""
    N = 4000
    sources = resolve_sources(mixture_cfg(corpora))
    mix = MixtureStream(sources, tok, seed=7)
    blocks = [next(mix) for _ in range(N)]
    names = attribute(blocks, alone(sources, tok))
    assert all(mix.streams[n].epoch >= 2 for n in mix.names)  # every source repeated, reshuffled
    counts = {n: names.count(n) for n in mix.names}
    for s in sources:
        share, bound = counts[s.name] / N, 4 * math.sqrt(s.weight * (1 - s.weight) / N)
        assert abs(share - s.weight) <= bound, (s.name, share, s.weight, bound)
    seen = source_counts(mix.state_dict(), 16)
    assert {n: c["tokens"] for n, c in seen.items()} == {n: 16 * c for n, c in counts.items()}
    assert all(seen[n]["documents"] == mix.streams[n].stats["documents"] > 0 for n in mix.names)
    # the draws follow the seed: the same seed, the same blocks; another seed, other draws
    again = MixtureStream(sources, tok, seed=7)
    assert all(torch.equal(next(again), b) for b in blocks[:300])
    other = MixtureStream(sources, tok, seed=8)
    assert [next(other).tolist() for _ in range(50)] != [b.tolist() for b in blocks[:50]]


def test_stopping_strategies_end_the_epoch_as_interleave_datasets_names_them(tok, corpora):
    cfg = mixture_cfg(corpora, weights=(1, 1, 1))
    sources = resolve_sources(cfg)
    per_epoch = {s.name: len(list(BlockStream(s.cfg, tok, s.train_files, seed=source_seed(7, s.name), repeat=False,
                                              hold_out="exclude"))) for s in sources}
    for strategy in ("first_exhausted", "all_exhausted", "all_exhausted_without_replacement"):
        mix = MixtureStream(sources, tok, seed=7, strategy=strategy, repeat=False)
        names = attribute(list(mix), alone(sources, tok))
        counts = {n: names.count(n) for n in per_epoch}
        if strategy == "first_exhausted":  # one source gave its whole epoch, none more than its epoch
            assert any(counts[n] == per_epoch[n] for n in counts) and all(counts[n] <= per_epoch[n] for n in counts)
        elif strategy == "all_exhausted":  # every source at least its epoch; the last to run out exactly that
            assert all(counts[n] >= per_epoch[n] for n in counts) and any(counts[n] == per_epoch[n] for n in counts)
        else:  # every block of every source, once
            assert counts == per_epoch, (counts, per_epoch)
        # repeating: mixture epochs follow one another; each source's blocks stay its own stream's, in order
        rep = MixtureStream(sources, tok, seed=7, strategy=strategy)
        more = [next(rep) for _ in range(len(names) + 100)]
        assert rep.epoch >= 1 and attribute(more, alone(sources, tok))[:len(names)] == names

# ---------------------------------------------------------------------------- resume


def without_datasets_state(sd: dict) -> dict:
    return {**sd, "sources": {n: {**st, "stream": {**st["stream"], "source": None}} if "stream" in st else st
                              for n, st in sd["sources"].items()}}


@pytest.mark.parametrize("strategy", ["all_exhausted", "first_exhausted", "all_exhausted_without_replacement"])
def test_resume_yields_the_same_blocks_and_counts_bitwise(tok, corpora, strategy):
    """A stream loaded with a saved position (through JSON, as a checkpoint holds it) yields bitwise the blocks the
    uninterrupted stream yields, across source epochs and mixture epochs, for local files (re-read to the position)
    and a streamed dataset (its shuffle buffer saved); every source's counters continue."""
    sources = resolve_sources(mixture_cfg(corpora, weights=(1, 3, 3)))
    new = lambda: MixtureStream(sources, tok, seed=7, strategy=strategy)  # noqa: E731
    straight = new()
    blocks, states = [], []
    for _ in range(1500):
        states.append(json.loads(json.dumps(straight.state_dict())))  # the state before each block
        blocks.append(next(straight))
    assert max(s.epoch for s in straight.streams.values()) >= 1
    restarts = [i for i in range(1, 1500) if states[i]["epoch"] != states[i - 1]["epoch"]
                or any(states[i]["sources"][n]["epoch"] != states[i - 1]["sources"][n]["epoch"] for n in straight.names)]
    assert len(restarts) >= 2
    for at in (0, 1, 37, *restarts[:3], *(r - 1 for r in restarts[:2]), 1400):
        b = new()
        b.load_state_dict(states[at])
        got = [next(b) for _ in range(40)]
        assert all(torch.equal(x, y) for x, y in zip(got, blocks[at:at + 40])), (strategy, at)
        again = json.loads(json.dumps(b.state_dict()))
        assert without_datasets_state(again) == without_datasets_state(states[at + 40])  # positions, counters continue
        c = new()  # datasets' own part of a resumed stream's state is written otherwise, to the same effect
        c.load_state_dict(again)
        assert all(torch.equal(next(c), y) for y in blocks[at + 40:at + 60]), (strategy, at)
    with pytest.raises(DataError, match=r"saved with seed=7, this mixture has seed=8"):
        MixtureStream(sources, tok, seed=8, strategy=strategy).load_state_dict(states[5])
    with pytest.raises(DataError, match=r"the recipe's data.sources are \['ledger', 'sotu'\]"):
        MixtureStream([s for s in sources if s.name != "notes"], tok, seed=7, strategy=strategy).load_state_dict(states[5])
    # another data-parallel size: {"epoch", "blocks"} replays the draws, each source skips its share
    c = new()
    c.load_state_dict({"epoch": states[100]["epoch"], "blocks": states[100]["blocks"]})
    assert {n: s.blocks for n, s in c.streams.items()} == {n: st["blocks"] for n, st in states[100]["sources"].items()}


def test_each_source_holds_out_its_own_documents(tok, corpora):
    """eval_loss/<source> reads each source's held-out blocks: its eval files, else its hashed hold-out, which its
    training stream never yields."""
    evals = corpora / "ledger-eval.jsonl"
    evals.write_text("".join(json.dumps({"body": f"Held ledger line {i}. " * 6}) + "\n" for i in range(20)))
    (corpora / "sotu-all.jsonl.gz").write_bytes(gzip.compress(FIXTURE.read_bytes()))
    cfg = recipe_from_dict({"model": MODEL, "data": {"seq_len": 16, "sources": [
        {"name": "sotu", "train_files": [str(corpora / "sotu-all.jsonl.gz")]},
        {"name": "ledger", "dataset": str(corpora / "hub_like"), "text_column": "body", "eval_files": [str(evals)]}]}}).data
    sources = resolve_sources(cfg)
    held = source_eval_blocks(sources, tok, 4)
    assert set(held) == {"sotu", "ledger"} and all(t.shape == (4, 16) for t in held.values())
    ledger = BlockStream(sources[1].cfg, tok, [str(evals)], shuffle=False, repeat=False)
    assert torch.equal(held["ledger"], torch.stack([next(ledger) for _ in range(4)]))
    sotu_held = [json.loads(line)["text"] for line in FIXTURE.read_text().splitlines() if is_held_out(json.loads(line)["text"])]
    ids = [t for d in sotu_held for t in tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    assert held["sotu"].flatten().tolist() == ids[:64]


def test_the_moe_10b_mixture_reads_as_its_weights_on_local_copies(tok, tmp_path):
    """recipes/moe-10b.yaml's four Hub sources, each replaced by a local dataset folder of its own documents (DCLM's
    as .jsonl.zst, as it ships): 3,000 blocks give each source its weight within the bound of the statistical test
    above, and each source's held-out blocks are its own."""
    from dataclasses import replace

    from hf_asyncpp.config.recipe import load_recipe

    data = load_recipe(ROOT / "recipes" / "moe-10b.yaml", ["--data.seq_len=16", "--data.shuffle_buffer=8",
                                                           "--data.eval_blocks=2"]).data
    assert [s.name for s in data.sources] == ["fineweb-edu", "dclm", "cosmopedia", "finemath"]
    local = []
    for s in data.sources:
        folder = tmp_path / s.name
        folder.mkdir()
        lines = "".join(json.dumps({"text": " ".join(f"{s.name}:{i}.{j}" for j in range(2 + i % 9))}) + "\n"
                        for i in range(300)).encode()  # every block names its source
        if s.name == "dclm":
            (folder / "shard_00000.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
        else:
            (folder / "train.jsonl").write_bytes(lines)
        local.append(replace(s, dataset=str(folder), dataset_config=None))
    sources = resolve_sources(replace(data, sources=local))
    N = 3000
    mix = MixtureStream(sources, tok, seed=42, strategy=data.stopping_strategy)
    names = attribute([next(mix) for _ in range(N)], alone(sources, tok, seed=42))
    for s in sources:
        share = names.count(s.name) / N
        assert abs(share - s.weight) <= 4 * math.sqrt(s.weight * (1 - s.weight) / N), (s.name, share, s.weight)
    held = source_eval_blocks(sources, tok, 2)
    for s in sources:  # the first blocks of the source's documents held out by hash, packed in file order
        docs = [" ".join(f"{s.name}:{i}.{j}" for j in range(2 + i % 9)) for i in range(300)]
        ids = [t for d in docs if is_held_out(d) for t in tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
        assert held[s.name].flatten().tolist() == ids[:32], s.name
