"""The data path at scale: a streamed dataset resumes without re-reading, batches are packed ahead in a worker with
the consumed position checkpointed, a worker's error reaches the training thread, and a pipeline's middle stages
never open the training stream."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_asyncpp.config.sections import DataConfig, ModelConfig
from hf_asyncpp.data.prefetch import Prefetcher
from hf_asyncpp.data.shuffle import ShuffledDocuments
from hf_asyncpp.data.stream import BlockStream, next_batch
from hf_asyncpp.data.tokenizer import load_or_train_tokenizer
from hf_asyncpp.errors import DataError
from hf_asyncpp.run.checkpointer import saved_positions
from support import FIXTURE, launch, losses, write_recipe
from hf_asyncpp.storage.names import checkpoint_name


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_or_train_tokenizer(ModelConfig(config={"model_type": "llama"}, vocab_size=400), [str(FIXTURE)], "text",
                                   tmp_path_factory.mktemp("tok") / "tokenizer")


@pytest.fixture
def hub_like(tmp_path) -> Path:
    """A local dataset folder standing in for a Hub dataset (load_dataset(folder, split="train", streaming=True)):
    4 files of 150 short documents, so a position lies hundreds of documents deep."""
    root = tmp_path / "hub_like"
    root.mkdir()
    for f in range(4):
        (root / f"part-{f}.jsonl").write_text("".join(
            json.dumps({"text": f"Address {f}-{i}: the state of the union is strong. " * (1 + i % 3)}) + "\n"
            for i in range(150)))
    return root


@pytest.fixture
def count_reads(monkeypatch):
    """Documents read from the streamed source, counted at the one place a row's text is taken."""
    counter = {"n": 0}
    read = ShuffledDocuments._read

    def counted(self):
        text = read(self)
        counter["n"] += 1
        return text

    monkeypatch.setattr(ShuffledDocuments, "_read", counted)
    return counter


@pytest.mark.parametrize("rank,world,hold_out", [(0, 1, None), (1, 2, "exclude")])
def test_streamed_dataset_resumes_where_it_stopped_without_rereading(tok, hub_like, count_reads, rank, world, hold_out):
    cfg = DataConfig(dataset=str(hub_like), seq_len=16, shuffle_buffer=32, min_document_tokens=0)
    make = lambda: BlockStream(cfg, tok, None, rank=rank, world_size=world, seed=7, hold_out=hold_out)
    straight = make()
    before = [next(straight) for _ in range(300)]
    state = json.loads(json.dumps(straight.state_dict()))  # as run_state.json keeps it
    passed = count_reads["n"]
    after = [next(straight) for _ in range(40)]
    assert state["stream"]["document"] == state["document"] > 60  # deep into the epoch
    count_reads["n"] = 0
    resumed = make()
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(after, (next(resumed) for _ in range(40))))
    # it read what the next 40 blocks need (plus the buffer's and the tokenizer batch's read-ahead), not the epoch so far
    assert count_reads["n"] < passed / 2, (count_reads["n"], passed)
    assert resumed.state_dict()["stats"] == straight.state_dict()["stats"]
    assert before[0].shape == (16,)


def test_streamed_dataset_resumes_across_epochs(tok, hub_like):
    """A position saved at an epoch's start needs no stream state; the next epoch reshuffles as an uninterrupted one."""
    cfg = DataConfig(dataset=str(hub_like), seq_len=64, shuffle_buffer=8, min_document_tokens=0)
    straight = BlockStream(cfg, tok, None, seed=1)
    blocks = []
    while straight.epoch == 0:
        blocks.append(next(straight))
    state = json.loads(json.dumps(straight.state_dict()))  # inside epoch 1, after its first block
    later = [next(straight) for _ in range(20)]
    resumed = BlockStream(cfg, tok, None, seed=1)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(later, (next(resumed) for _ in range(20))))
    assert resumed.epoch == straight.epoch


def test_prefetcher_checkpoints_the_consumed_position(tok):
    cfg = DataConfig(seq_len=16, shuffle_buffer=8, min_document_tokens=0)
    inline = BlockStream(cfg, tok, [str(FIXTURE)], seed=3)
    expected = [next_batch(inline, 2, 2) for _ in range(6)]
    feed = Prefetcher(BlockStream(cfg, tok, [str(FIXTURE)], seed=3), 2, 2, depth=3)
    try:
        got = [next(feed) for _ in range(3)]
        assert feed._queue.qsize() or feed._thread.is_alive()  # the worker read ahead
        state = feed.state_dict()
    finally:
        feed.close()
    assert all(torch.equal(a, b) for a, b in zip(got, expected[:3]))
    resumed = Prefetcher(BlockStream(cfg, tok, [str(FIXTURE)], seed=3), 2, 2, depth=3)
    resumed.load_state_dict(state)
    try:
        assert all(torch.equal(next(resumed), b) for b in expected[3:])  # where the consumed batches ended
    finally:
        resumed.close()
    assert len(resumed.waits) == 3 and resumed.stall_s >= 0


def test_prefetcher_raises_the_workers_data_error(tok, tmp_path):
    empty = tmp_path / "blank.jsonl"
    empty.write_text(json.dumps({"text": "   "}) + "\n")
    feed = Prefetcher(BlockStream(DataConfig(seq_len=16), tok, [str(empty)]), 2, 2, depth=2)
    for _ in range(2):  # the same error again at the next step, not a hang
        with pytest.raises(DataError, match="no usable document"):
            next(feed)
    feed.close()


def test_middle_stages_never_open_the_training_stream(tmp_path):
    """4 stages on 4 processes: the checkpoint's data positions are the first and last stages' (equal); the middle
    stages have none, since they built no stream; a resume from the step-2 checkpoint into a new folder (the middle
    stages restore nothing) continues exactly as the run that went on."""
    stages = ("--pipeline.num_stages=4", "--pipeline.num_microbatches=4", "--pipeline.microbatch_size=1")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    rc, log = launch(write_recipe(tmp_path / "a.yaml", straight, max_steps=4, save_steps=2), *stages, procs=4)
    assert rc == 0, log[-3000:]
    for step in (2, 4):
        data = saved_positions(straight / checkpoint_name(step))  # each reading rank's own file
        assert data[1] is None and data[2] is None
        assert data[0] == data[3] and data[0]["blocks"] > 0
    rc, log = launch(write_recipe(tmp_path / "b.yaml", resumed, max_steps=4, save_steps=2), *stages,
                     f"--training.resume_from_checkpoint={straight / checkpoint_name(2)}", procs=4)
    assert rc == 0, log[-3000:]
    assert len(losses(straight)) == 4 and losses(resumed) == losses(straight)[2:]
