"""docs/bring-your-own.md, run: each ``hf-asyncpp train`` command of the page (and the recipe file it shows) trains
for 2 steps in this process, on a tiny model folder, tokenizers and data files written here, and uses the model,
tokenizer and data the page says it does. The commands are read from the page, so the two cannot drift apart.

The Hub cannot be reached from a test, so its two commands meet local copies at the network's edge only: the Hub
model and tokenizer are a Hugging Face cache folder that transformers itself reads (``HF_HUB_OFFLINE``), the Hub
dataset's repository files a local folder handed to ``datasets.load_dataset`` in place of the repository id.
Everything between the recipe and those library calls is the real code path.
"""
from __future__ import annotations

import gzip
import inspect
import json
import re
import shlex
from pathlib import Path

import datasets
import huggingface_hub.constants
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
import zstandard
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from hf_asyncpp.cli import main
from hf_asyncpp.config.recipe import load_recipe
from hf_asyncpp.data.corpus import prepare_default_corpus
from hf_asyncpp.data.tokenizer import train_tokenizer
from hf_asyncpp.storage.names import TOKENIZER_DIR, checkpoint_name

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "bring-your-own.md"
FIXTURE = ROOT / "tests" / "fixtures" / "sotu_slice.jsonl"
HUB_MODEL, HUB_DATASET = "HuggingFaceTB/SmolLM2-135M", "HuggingFaceFW/fineweb-edu"
SNAPSHOT = "0" * 40
FAST = ["--pipeline.schedule=none", "--pipeline.num_stages=1", "--training.max_steps=2", "--pipeline.num_microbatches=2",
        "--pipeline.microbatch_size=2", "--data.eval_blocks=2", "--training.report_to=[]", "--training.export=false"]
"""One process, 2 small steps: what the test changes in each command of the page."""


def page_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", PAGE.read_text(), flags=re.M | re.S)


def page_commands() -> list[list[str]]:
    return [shlex.split(line) for block in page_blocks("bash") for line in block.splitlines()
            if line.startswith("hf-asyncpp ")]


def page_recipes() -> dict[str, str]:
    """The page's recipe files, by the name on their first line (``# my-recipe.yaml``)."""
    return {block.splitlines()[0].lstrip("# ").strip(): block for block in page_blocks("yaml")}


COMMANDS = page_commands()


def option(command: list[str], name: str) -> str | None:
    return next((a.split("=", 1)[1] for a in command if a.startswith(f"--{name}=")), None)


def tiny_model(folder: Path, tok, model_type: str) -> None:
    """A 2-layer model saved with save_pretrained, its tokenizer beside it: a user's model folder."""
    config = AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                                  vocab_size=len(tok), tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                                  bos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)


def jsonl(docs: list[str], column: str = "content") -> bytes:
    return "".join(json.dumps({"id": i, column: d}) + "\n" for i, d in enumerate(docs)).encode()


def write_jsonl(path: Path, docs: list[str], column: str = "content") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(jsonl(docs, column))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The folder the page's commands run in: its model, tokenizer and data, the default corpus, the recipes."""
    ws = tmp_path_factory.mktemp("byo")
    sotu = [json.loads(line)["text"] for line in FIXTURE.read_text().splitlines() if line.strip()]
    mine = [f"Note {i} on the zorbling harvest: the rains came late, and the river rose over the lower fields. " * 3
            for i in range(200)]  # a word only these files have
    docs = sotu + mine
    tok = train_tokenizer([str(FIXTURE)], 300)
    tiny_model(ws / "my-model", tok, "llama")
    train_tokenizer([str(FIXTURE)], 280).save_pretrained(ws / "my-tokenizer")
    write_jsonl(ws / "mydata" / "train-00.jsonl", docs[0::2]), write_jsonl(ws / "mydata" / "train-01.jsonl", docs[1::2])
    write_jsonl(ws / "mydata" / "valid.jsonl", sotu[:4])
    pq.write_table(pa.table({"id": list(range(len(docs))), "content": docs}), ws / "mydata" / "part-00.parquet")
    (ws / "corpus").mkdir()  # the same documents compressed, as pretraining corpora ship
    (ws / "corpus" / "part-00.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl(docs[0::2])))
    (ws / "corpus" / "part-01.jsonl.gz").write_bytes(gzip.compress(jsonl(docs[1::2])))
    (ws / "notes").mkdir()
    for i in range(2):
        (ws / "notes" / f"notes-{i}.txt").write_text("\n\n".join(d.replace("\n\n", "\n") for d in docs[i::2]) + "\n")
    prepare_default_corpus(ws / "data" / "sotu")
    (ws / "recipes").symlink_to(ROOT / "recipes")
    repo = ws / "hub-cache" / f"models--{HUB_MODEL.replace('/', '--')}"  # the layout huggingface_hub downloads into
    tiny_model(repo / "snapshots" / SNAPSHOT, tok, "qwen3")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SNAPSHOT)
    dataset = ws / "hub-datasets" / HUB_DATASET  # the dataset repository's files: a config of its README
    write_jsonl(dataset / "sample" / "10BT" / "000_00000.jsonl", docs, column="text")
    (dataset / "README.md").write_text("---\nconfigs:\n- config_name: sample-10BT\n  data_files:\n  - split: train\n"
                                       "    path: sample/10BT/*.jsonl\n---\n")
    for name, text in page_recipes().items():
        (ws / name).write_text(text)
    return ws


@pytest.fixture
def hub(workspace, monkeypatch):
    """Hub ids resolve to the workspace's copies; returns the calls that named the Hub dataset, as
    ``(function, {parameter: argument})``."""
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(workspace / "hub-cache"))
    calls = []

    def from_the_workspace(real):
        def load(path, *args, **kwargs):
            if path == HUB_DATASET:
                calls.append((real.__name__, inspect.signature(real).bind(path, *args, **kwargs).arguments))
                path = str(workspace / "hub-datasets" / HUB_DATASET)
            return real(path, *args, **kwargs)
        return load

    for name in ("load_dataset", "load_dataset_builder"):  # training streams; a check before it resolves the builder
        monkeypatch.setattr(datasets, name, from_the_workspace(getattr(datasets, name)))
    return calls


def test_the_page_shows_each_way_to_bring_your_own():
    """A model folder and a Hub id, a tokenizer, jsonl, parquet and text files, a Hub dataset, a recipe file; and
    the README and the recipe reference link the page."""
    shown = " ".join(" ".join(c) for c in COMMANDS)
    for what in ("--model.name_or_path=./", f"--model.name_or_path={HUB_MODEL}", "--model.tokenizer_name_or_path=",
                 ".jsonl]", ".parquet]", ".txt]", ".jsonl.zst,", ".jsonl.gz]", "--data.eval_files=", "--data.text_column=",
                 f"--data.dataset={HUB_DATASET}", "--data.dataset_config="):
        assert what in shown, what
    assert [c[2] for c in COMMANDS if not c[2].startswith("recipes/")] == list(page_recipes())
    assert all(c[:2] == ["hf-asyncpp", "train"] for c in COMMANDS)
    outputs = [option(c, "training.output_dir") for c in COMMANDS if c[2].startswith("recipes/")]
    assert None not in outputs and len(set(outputs)) == len(outputs)  # the page runs top to bottom in one folder
    mixture = yaml.safe_load(page_recipes()["my-mixture.yaml"])["data"]  # a Hub dataset and compressed files, weighted
    assert {"dataset", "train_files", "weight"} <= {k for src in mixture["sources"] for k in src}
    assert any(f.endswith(".zst") for src in mixture["sources"] for f in src.get("train_files", []))
    assert "(docs/bring-your-own.md)" in (ROOT / "README.md").read_text()
    assert "(bring-your-own.md)" in (ROOT / "docs" / "recipes.md").read_text()


@pytest.mark.parametrize("command", COMMANDS, ids=[c[2] if len(c) == 3 else option(c, "training.output_dir") for c in COMMANDS])
def test_a_command_of_the_page_trains_what_it_says(command, workspace, hub):
    assert main(command[1:] + FAST) == 0
    r = load_recipe(command[2], command[3:] + FAST)
    saved = Path(r.training.output_dir) / checkpoint_name(2)  # its HF files: the config and the tokenizer
    got = AutoTokenizer.from_pretrained(str(saved / TOKENIZER_DIR))
    source = r.model.tokenizer_name_or_path or r.model.name_or_path  # the page's rule, else a BPE trained here
    assert got.get_vocab() == AutoTokenizer.from_pretrained(source or str(saved.parent / "tokenizer")).get_vocab()
    if source is None:
        assert r.data.train_files and got.tokenize(" zorbling") == ["Ġzorbling"]  # learned from the command's files
    config = json.loads((saved / "config.json").read_text())
    if r.model.name_or_path:  # the folder's or the Hub's model, not the recipe's random-init Llama
        assert r.model.config is None and config["model_type"] == AutoConfig.from_pretrained(r.model.name_or_path).model_type
        assert config["hidden_size"] == 32
    else:
        assert config["hidden_size"] == r.model.config["hidden_size"] and config["vocab_size"] == len(got)
    hub_sources = [r.data.dataset] if r.data.dataset else [s.dataset for s in r.data.sources or [] if s.dataset]
    if hub_sources:
        streamed = [args for function, args in hub if function == "load_dataset"]
        assert streamed and all((a["path"], a["name"], a["split"], a["streaming"]) == (HUB_DATASET, "sample-10BT", "train", True)
                                for a in streamed)
        assert all((a["path"], a["name"]) == (HUB_DATASET, "sample-10BT") for _, a in hub)
    else:
        assert not hub
    if r.data.sources:  # each source trained on, counted, and evaluated on its own held-out blocks
        rows = [json.loads(x) for x in (Path(r.training.output_dir) / "metrics.jsonl").read_text().splitlines()]
        counts = next(x for x in rows if "data/mine/tokens" in x)
        assert sum(counts[f"data/{s.name}/tokens"] for s in r.data.sources) == \
            [x for x in rows if "loss" in x][-1]["num_input_tokens_seen"]
        evals = [x for x in rows if "eval_loss" in x]
        assert evals and all(f"eval_loss/{s.name}" in x for x in evals for s in r.data.sources)
