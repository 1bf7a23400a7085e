"""A resume with a changed recipe runs the new recipe from the checkpoint's position, and says so: a longer
``max_steps`` continues on the schedule for the new length (compared with an uninterrupted run of that length and
with transformers' own scheduler), a changed hyperparameter takes effect, and each change is named once with both
values before step 1."""
from __future__ import annotations

import json
import logging

import torch
from transformers import AutoTokenizer, get_scheduler

from hf_asyncpp.config.recipe import recipe_from_dict
from hf_asyncpp.engine import LocalEngine
from hf_asyncpp.model.build import build_model
from hf_asyncpp.run.resume_report import changed_fields
from hf_asyncpp.run.trainer import train
from hf_asyncpp.topology import Topology
from support import FIXTURE, tiny
from hf_asyncpp.storage.names import RUN_STATE, rng_file


def _lrs(out) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["learning_rate"] for r in rows if "loss" in r}


def _transformers_lr(peak: float, total: int, applied: int) -> float:
    """The reference: transformers' linear schedule for ``total`` steps, stepped ``applied`` times."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    sched = get_scheduler("linear", opt, num_warmup_steps=0, num_training_steps=total)
    for _ in range(applied):
        opt.step()
        sched.step()
    return sched.get_last_lr()[0]


def test_a_longer_run_continues_on_the_new_schedule_and_says_how_the_lr_changes(tmp_path, caplog):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(recipe_from_dict(tiny(straight, training__max_steps=10, training__save_steps=0)))
    train(recipe_from_dict(tiny(resumed, training__max_steps=6, training__save_steps=3, training__stop_after_steps=3)))
    with caplog.at_level(logging.WARNING, logger="hf_asyncpp"):
        train(recipe_from_dict(tiny(resumed, training__max_steps=10, training__save_steps=0,
                                    training__resume_from_checkpoint="latest")))
    after, reference = _lrs(resumed), _lrs(straight)
    assert [after[s] for s in range(4, 11)] == [reference[s] for s in range(4, 11)]  # the 10-step schedule, bitwise
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resume: ")]
    assert said[0] == "resume: training.max_steps: 6 in checkpoint-0000003, 10 now; the run continues with 10"
    then, now = _transformers_lr(0.003, 6, 3), _transformers_lr(0.003, 10, 3)
    assert said[-1] == (f"resume: the learning-rate schedule is this recipe's from update 4 on (linear over 10 steps): "
                        f"the next update's lr is {now:.3e} where the checkpoint's schedule gives {then:.3e} "
                        f"({(now - then) / then:+.0%})")
    assert len(said) == 2  # nothing else changed that alters a number (stop_after_steps, save_steps do not)


def test_changed_hyperparameters_take_effect_on_resume(tmp_path):
    """The checkpoint gives the moments and the position, the recipe the hyperparameters: a lowered weight decay
    and betas are what the resumed optimizer uses (the saved param groups used to win silently)."""
    out = tmp_path / "run"
    train(recipe_from_dict(tiny(out, training__max_steps=6, training__stop_after_steps=3)))
    new = recipe_from_dict(tiny(out, training__max_steps=6, optimizer__weight_decay=0.01, optimizer__adam_beta2=0.9))
    engine = LocalEngine(new, build_model(new.model, AutoTokenizer.from_pretrained(str(out / "tokenizer"))), Topology(rank=0, world_size=1, num_stages=1),
                         log=lambda *a: None)
    engine.load(out / "checkpoint-0000003")
    decays = sorted({g["weight_decay"] for g in engine.optimizer.param_groups})
    assert decays == [0.0, 0.01] and {g["betas"] for g in engine.optimizer.param_groups} == {(0.9, 0.9)}
    assert engine.scheduler.last_epoch == 3 and engine.optimizer.state  # position and moments from the checkpoint
    assert engine.optimizer.param_groups[0]["lr"] == _transformers_lr(0.003, 6, 3)


def test_only_fields_that_change_numbers_are_reported():
    saved = {"training": {"max_steps": 6, "logging_steps": 2, "output_dir": "a"}, "optimizer": {"momentum": 0.9},
             "hub": {"push_to_hub": False}}
    now = {"training": {"max_steps": 6, "logging_steps": 5, "output_dir": "b", "new_field": 1},
           "optimizer": {"momentum": 0.95}, "hub": {"push_to_hub": True}}
    assert changed_fields(saved, now) == [("optimizer", "momentum", 0.9, 0.95)]


class _StubEngine:
    """What :meth:`hf_asyncpp.run.checkpointer.Checkpointer.resume` needs of an engine: ``load`` and the scheduler's position."""

    def __init__(self):
        self.loaded, self.scheduler = [], type("Scheduler", (), {"last_epoch": 0})()

    def load(self, path):
        self.loaded.append(path)


def test_a_data_parallel_resize_continues_after_the_blocks_the_replicas_read(tmp_path):
    """The data position across a change of the data-parallel size: 2 replicas that read 5 blocks each resume as one
    stream that skips the 10 blocks read (its next block is block 10 of a fresh single stream), and one stream that
    read 10 resumes as 2 replicas that each skip 5 of their own shard. The references are fresh
    ``BlockStream(rank, world_size)``s (tests/test_data.py checks those shard the stream)."""
    from hf_asyncpp.storage import checkpoint_io as ckpt
    from hf_asyncpp.run.checkpointer import Checkpointer
    from hf_asyncpp.run.seeds import rng_state
    from hf_asyncpp.config.sections import DataConfig, ModelConfig
    from hf_asyncpp.data.stream import BlockStream
    from hf_asyncpp.data.tokenizer import load_or_train_tokenizer

    tok = load_or_train_tokenizer(ModelConfig(config={"model_type": "llama"}, vocab_size=400), [str(FIXTURE)], "text",
                                  tmp_path / "tokenizer")
    cfg, files = DataConfig(seq_len=32, shuffle_buffer=8, min_document_tokens=0), [str(FIXTURE)]
    recipe = recipe_from_dict(tiny(tmp_path / "run"))

    def resume(path, engine, stream, topo):
        main = type("Accelerator", (), {"is_main_process": topo.rank == 0})()
        return Checkpointer(tmp_path / "run", recipe, topo, main, tok).resume(path, engine, stream)

    def stream(rank=0, world=1):
        return BlockStream(cfg, tok, files, rank=rank, world_size=world, seed=3)

    def checkpoint(name, states):
        path = tmp_path / name
        path.mkdir()
        ckpt.save_json(path / RUN_STATE, {"step": 5, "tokens": 0, "run_id": "k4", "data": states, "data_files": None,
                                               "world_size": len(states), "num_stages": 1,
                                               "schedule": recipe.pipeline.schedule})
        ckpt.save_state(path / rng_file(0), rng_state())
        return path

    def read(s, n):
        for _ in range(n):
            next(s)
        return s.state_dict()

    single = [next(s) for s in [stream()] for _ in range(12)]
    shards = [[next(s) for _ in range(7)] for s in (stream(0, 2), stream(1, 2))]

    two = checkpoint("from-2", [read(stream(0, 2), 5), read(stream(1, 2), 5)])
    engine, one = _StubEngine(), stream()
    state = resume(two, engine, one, Topology(rank=0, world_size=1, num_stages=1))
    assert engine.loaded == [two] and state.step == 5
    assert one.blocks == 10 and torch.equal(next(one), single[10]) and torch.equal(next(one), single[11])

    one_saved = checkpoint("from-1", [read(stream(), 10)])
    for rank in (0, 1):
        replica = stream(rank, 2)
        resume(one_saved, _StubEngine(), replica, Topology(rank=rank, world_size=2, num_stages=1))
        assert replica.blocks == 5 and torch.equal(next(replica), shards[rank][5]), rank
