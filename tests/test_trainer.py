"""End-to-end single-process training through the real trainer loop.

Resume must be invisible: 2N steps straight equal N steps, stop, resume, N steps
(identical losses and weights). The loop writes the metrics, checkpoints and the
export the README promises.
"""
from __future__ import annotations

import io
import json
import logging
import sys
import typing
from pathlib import Path

import pytest
import torch

from hf_asyncpp.config.recipe import apply_overrides, load_recipe, recipe_from_dict
from hf_asyncpp.errors import RecipeError
from hf_asyncpp.optim.lr import build_scheduler, warmup_steps
from hf_asyncpp.run.folder import choose_resume
from hf_asyncpp.storage import checkpoint_io as ckpt
from hf_asyncpp.topology import Topology
from support import losses, tiny, tiny_llama
from hf_asyncpp.run.folder import list_checkpoints, prune
from hf_asyncpp.storage.names import MANIFEST, RUN_LOCK, RUN_STATE, TRAINER_STATE, checkpoint_name

ROOT = Path(__file__).resolve().parent.parent


def weights(out: Path, step: int) -> dict:
    return ckpt.load_tensors(out / checkpoint_name(step) / "model.safetensors")


# the dropout case makes the RNG state part of the computation: a resume that does not restore it draws other masks
@pytest.mark.parametrize("opt,delay,ef,dropout", [("adamw", "0", "none", 0.0), ("muon", "1", "error_feedback", 0.0),
                                                  ("adamw", "0", "none", 0.1)])
def test_resume_equals_uninterrupted(tmp_path, opt, delay, ef, dropout):
    from hf_asyncpp.run.trainer import train

    common = dict(optimizer__name=opt, optimizer__simulate_delay=delay, optimizer__delay_correction=ef)
    if dropout:
        common["model__config"] = tiny_llama(2, tie_word_embeddings=True, attention_dropout=dropout)
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(recipe_from_dict(tiny(straight, **common)))
    summary = train(recipe_from_dict(tiny(split, training__stop_after_steps=3, **common)))
    assert summary.get("stopped_early") and summary["step"] == 3
    assert not (split / checkpoint_name(6)).exists()
    train(recipe_from_dict(tiny(split, training__resume_from_checkpoint="latest", **common)))
    a, b = losses(straight), losses(split)
    assert len(a) == 6 and a == b  # bitwise: same data position, RNG, optimizer, EF and delay state
    for k, v in weights(straight, 6).items():
        assert torch.equal(v, weights(split, 6)[k]), k
    assert a[-1] < a[0]


def test_a_compiled_run_records_its_compiles_and_trains_as_the_eager_one(tmp_path, caplog):
    """``training.torch_compile`` (aot_eager: the eager kernels) through the trainer, one pipeline stage with bf16
    weight versions and an evaluation every 3 steps: the losses of the eager run bit for bit, and metrics.jsonl says
    per rank what Dynamo compiled at each drain point: the stage's 2 training and 2 evaluation graphs, none after,
    no graph break, no fallback to eager (and so no warning)."""
    from hf_asyncpp.run.trainer import train

    common = dict(pipeline__schedule="2bw", pipeline__num_stages=1, optimizer__name="muon",
                  optimizer__delay_correction="error_feedback", training__bf16=True, training__eval_steps=3)
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    train(recipe_from_dict(tiny(eager, training__torch_compile=False, **common)))
    torch._dynamo.reset()  # nothing another test compiled in this process is reused (the run counts its own)
    with caplog.at_level(logging.WARNING, logger="hf_asyncpp"):
        train(recipe_from_dict(tiny(compiled, training__torch_compile=True, training__torch_compile_backend="aot_eager",
                                    **common)))
    assert losses(compiled) == losses(eager) and len(losses(eager)) == 6
    rows = [json.loads(x) for x in (compiled / "metrics.jsonl").read_text().splitlines()]
    stats = {r["step"]: r["compile"] for r in rows if "compile" in r}
    assert sorted(stats) == [3, 6], stats  # each drain point: an evaluation's, the end's
    assert stats[3]["graphs"] == [4] and stats[6] == stats[3], stats  # 2 + 2, compiled before step 3's record
    assert stats[3]["graph_breaks"] == stats[3]["eager_fallbacks"] == [0], stats
    assert "compile" not in "".join((eager / "metrics.jsonl").read_text())  # an eager run has nothing to say
    assert "recompile limit" not in caplog.text


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    from hf_asyncpp.run.trainer import train

    out = tmp_path / "run"
    train(recipe_from_dict(tiny(out, training__max_steps=8, training__save_steps=2, training__save_total_limit=2)))
    steps = [s for s, _ in list_checkpoints(out)]
    assert steps == [6, 8]
    manifest = ckpt.load_json(out / checkpoint_name(8) / "manifest.json")
    assert {"model.safetensors", "run_state.json", "trainer_state.json"} <= set(manifest["files"])
    # a half-written checkpoint (no manifest) is never resumed from
    broken = out / checkpoint_name(10)
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"garbage")
    assert choose_resume(out, "latest", Topology()) == out / checkpoint_name(8)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == list(range(1, 9))
    for key in ("step", "loss", "learning_rate", "grad_norm", "num_input_tokens_seen", "tokens_per_s"):  # Trainer's names
        assert key in train_rows[-1]
    assert not {"lr", "tokens"} & set(train_rows[-1])
    assert train_rows[-1]["num_input_tokens_seen"] == 8 * 2 * 2 * 32
    assert any("eval_perplexity" in r for r in rows)


def test_a_checkpoints_trainer_state_json_is_transformers_own(tmp_path):
    """``trainer_state.json`` is a Trainer's: transformers.TrainerState reads it, with the step, the counters and the
    log (an entry per logging interval with its mean loss, as the Trainer logs, and the evaluations)."""
    from transformers import TrainerState

    from hf_asyncpp.run.reporting import read_metrics
    from hf_asyncpp.run.trainer import train

    out = tmp_path / "run"
    train(recipe_from_dict(tiny(out, training__eval_steps=4)))  # 6 steps, logged every 2, checkpoints at 3 and 6
    state = TrainerState.load_from_json(str(out / checkpoint_name(6) / TRAINER_STATE))
    assert (state.global_step, state.max_steps, state.logging_steps, state.save_steps, state.eval_steps) == (6, 6, 2, 3, 4)
    assert state.num_input_tokens_seen == 6 * 2 * 2 * 32 and state.train_batch_size == 2
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    logs = [e for e in state.log_history if "loss" in e]
    assert [e["step"] for e in logs] == [2, 4, 6]
    assert [e["loss"] for e in logs] == pytest.approx([(rows[i]["loss"] + rows[i + 1]["loss"]) / 2 for i in (0, 2, 4)])
    assert [e["learning_rate"] for e in logs] == [rows[i]["learning_rate"] for i in (1, 3, 5)]
    assert [e["step"] for e in state.log_history if "eval_loss" in e] == [0, 4]
    earlier = TrainerState.load_from_json(str(out / checkpoint_name(3) / TRAINER_STATE))
    assert earlier.global_step == 3 and [e["step"] for e in earlier.log_history] == [0, 2]


def test_without_a_terminal_each_logging_interval_is_a_log_line(tmp_path, monkeypatch, caplog):
    """A SLURM batch log is no terminal: no progress bar there (its carriage returns), a log line per logging interval
    with the Trainer's numbers instead; a terminal keeps the bar and gets no lines."""
    from types import SimpleNamespace

    from hf_asyncpp.run import reporting
    from hf_asyncpp.run.checkpointer import RunState
    from hf_asyncpp.engine import StepResult

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    logged = []
    acc = SimpleNamespace(is_main_process=True, num_processes=1, init_trackers=lambda *a, **k: None,
                          log=lambda values, step: logged.append(values))
    r = recipe_from_dict({"model": {"config": {"model_type": "llama"}},
                          "training": {"max_steps": 4, "logging_steps": 2, "report_to": []}})
    lines = {}
    for stderr in (io.StringIO(), Terminal()):
        monkeypatch.setattr(sys, "stderr", stderr)
        out = tmp_path / type(stderr).__name__
        out.mkdir()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hf_asyncpp"):
            run = reporting.RunLog(out, r, acc, RunState(), tokens_per_step=10)
            for k in range(4):
                run.step(StepResult(k, 2.0 + k, 0.5, 1e-3, True), 10 * (k + 1))
            run.close()
        lines[type(stderr).__name__] = ([m for m in caplog.messages if m.startswith("step ")], stderr.getvalue())
    plain, bar = lines["StringIO"], lines["Terminal"]
    assert len(plain[0]) == 2 and plain[1] == ""
    assert plain[0][0].startswith("step 2/4: loss 2.5000, learning_rate 1.000e-03, grad_norm 0.5000, tokens/s ")
    assert plain[0][1].startswith("step 4/4: loss 4.5000, ")
    assert bar[0] == [] and "\r" in bar[1] and "4/4" in bar[1]
    assert set(logged[0]) == {"train/loss", "train/learning_rate", "train/grad_norm", "train/num_input_tokens_seen",
                              "train/tokens_per_s"}


def test_export_and_perplexity_at_the_end(tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_asyncpp.run.trainer import train

    out = tmp_path / "run"
    summary = train(recipe_from_dict(tiny(out, training__export=True, training__max_steps=20, optimizer__learning_rate=0.01)))
    export = Path(summary["export_dir"])
    assert (export / "config.json").exists() and (export / "README.md").exists()
    model = AutoModelForCausalLM.from_pretrained(export)
    ids = torch.randint(0, 300, (1, 16))
    ref = ckpt.load_tensors(out / checkpoint_name(20) / "model.safetensors")
    for k, v in ref.items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=0, atol=0)
    assert summary["export_eval_perplexity"] < summary["untrained_eval_perplexity"]
    assert model(ids).logits.shape[-1] >= 300


def test_shipped_schedule_is_transformers_cosine_to_a_tenth():
    """recipes/*.yaml keep the paper's schedule (warm-up over 10% of the steps, cosine to 10% of the peak), now written
    with transformers' names; the lrs are transformers' own get_scheduler's."""
    from transformers import get_scheduler

    r = load_recipe(ROOT / "recipes" / "cpu-tiny.yaml", ["--training.max_steps=100"])
    t = r.training
    assert (t.lr_scheduler_type, t.lr_scheduler_kwargs, warmup_steps(t)) == ("cosine_with_min_lr", {"min_lr_rate": 0.1}, 10)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched, lrs = build_scheduler(opt, t), []
    for _ in range(100):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    ref_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    ref = get_scheduler("cosine_with_min_lr", ref_opt, num_warmup_steps=10, num_training_steps=100,
                        scheduler_specific_kwargs={"min_lr_rate": 0.1})
    assert lrs == [ref.lr_lambdas[0](k) for k in range(100)]
    assert lrs[0] == 0.0 and lrs[10] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.1, abs=1e-3)


def test_deprecated_and_surprising_scheduler_values_are_said(caplog):
    base = tiny(Path("/tmp/x"), training__max_steps=100)
    with caplog.at_level(logging.WARNING, logger="hf_asyncpp"):
        r = recipe_from_dict({**base, "training": {**base["training"], "warmup_ratio": 0.2}})
    assert "warmup_ratio is deprecated" in caplog.text and "warmup_steps: 0.2" in caplog.text
    assert warmup_steps(r.training) == 20
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_asyncpp"):
        recipe_from_dict({**base, "training": {**base["training"], "lr_scheduler_type": "constant", "warmup_steps": 5}})
    assert "constant_with_warmup" in caplog.text
    with pytest.raises(RecipeError, match=r"training\.lr_scheduler_type: 'cosine_to_floor' is not allowed"):
        recipe_from_dict({**base, "training": {**base["training"], "lr_scheduler_type": "cosine_to_floor"}})
    with pytest.raises(RecipeError, match=r"training\.warmup_steps: 2\.5 is neither"):
        recipe_from_dict({**base, "training": {**base["training"], "warmup_steps": 2.5}})


def test_scheduler_names_are_transformers_own():
    from transformers.trainer_utils import SchedulerType

    from hf_asyncpp.config.sections import SchedulerName

    needs_a_metric = {"reduce_lr_on_plateau", "greedy"}
    assert set(typing.get_args(SchedulerName)) == {s.value for s in SchedulerType} - needs_a_metric


def test_too_few_processes_prints_the_command_that_works():
    from hf_asyncpp.errors import RecipeError
    from hf_asyncpp.launch.spawn import check_topology

    r = recipe_from_dict(tiny(Path("/tmp/x"), pipeline__schedule="2bw", pipeline__num_stages=2))
    with pytest.raises(RecipeError, match=r"2 stages need a multiple of 2 processes, but 1 was started[\s\S]*recipes/accelerate/cpu-2proc.yaml"):
        check_topology(r, 1, "recipes/x.yaml")
    check_topology(r, 4, "recipes/x.yaml")


def test_only_evaluations_checkpoints_and_the_end_drain_the_pipeline():
    from hf_asyncpp.run.trainer import drain_points

    for every in (1, 7, 1000):
        r = recipe_from_dict(tiny(Path("/tmp/x"), training__max_steps=20, training__logging_steps=every,
                                  training__eval_steps=8, training__save_steps=10))
        assert drain_points(0, r) == [8, 10, 16, 20]
        assert drain_points(10, r) == [16, 20]


def test_trackers_get_trainer_keys_and_a_resume_continues_the_run(tmp_path):
    """The Trainer's tracker keys where the number is one it reports, in the project ``training.project`` (tensorboard:
    its folder under logs/), one tracker run continued by a resume."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hf_asyncpp.run.trainer import train

    out = tmp_path / "run"
    common = dict(training__report_to=["tensorboard"], training__logging_steps=2, training__run_name="tiny-run",
                  training__project="tiny-project")
    train(recipe_from_dict(tiny(out, training__stop_after_steps=4, **common)))
    first = ckpt.load_json(out / checkpoint_name(4) / RUN_STATE)["run_id"]
    train(recipe_from_dict(tiny(out, training__resume_from_checkpoint="latest", **common)))
    assert ckpt.load_json(out / checkpoint_name(6) / RUN_STATE)["run_id"] == first
    runs = {p.parent for p in (out / "logs").rglob("events.out.tfevents.*") if p.parent.parent.name == "logs"}
    assert runs == {out / "logs" / "tiny-project"}  # one tracker run (one directory), continued by the resume
    events = EventAccumulator(str(runs.pop())).Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/learning_rate", "train/grad_norm", "train/num_input_tokens_seen", "train/tokens_per_s",
            "eval/loss", "eval/perplexity"} <= tags
    assert sorted(e.step for e in events.Scalars("train/loss")) == [2, 4, 6]


def test_a_tracker_that_cannot_run_is_an_error_naming_it():
    from hf_asyncpp.run.reporting import check_trackers

    assert check_trackers(["tensorboard", "none"]) == ["tensorboard"]
    with pytest.raises(RecipeError, match=r"report_to: 'clearml' needs the package clearml, which is not installed"):
        check_trackers(["clearml"])
    with pytest.raises(RecipeError, match=r"report_to: 'tensorbored' is not a tracker; choose from .*tensorboard"):
        check_trackers(["tensorbored"])


def test_report_to_all_and_resume_from_checkpoint_true_are_the_trainers_values():
    """``report_to: all`` is every installed tracker (accelerate's list); ``resume_from_checkpoint: true`` the newest
    checkpoint, from a recipe or the command line."""
    from accelerate.tracking import get_available_trackers

    from hf_asyncpp.run.reporting import check_trackers

    assert check_trackers(["all"]) == [str(t) for t in get_available_trackers()] and "tensorboard" in check_trackers(["all"])
    assert recipe_from_dict(tiny(Path("/tmp/x"), training__resume_from_checkpoint=True)).training.resume_from_checkpoint == "latest"
    assert recipe_from_dict(tiny(Path("/tmp/x"), training__resume_from_checkpoint=False)).training.resume_from_checkpoint is None
    overrides = apply_overrides(tiny(Path("/tmp/x")), ["--training.resume_from_checkpoint=true"])
    assert recipe_from_dict(overrides).training.resume_from_checkpoint == "latest"


def test_an_unset_project_is_the_trackers_own_variable(monkeypatch):
    from hf_asyncpp.run.reporting import tracker_project

    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    assert tracker_project(None, ["tensorboard", "wandb"]) == "from-env"  # as the Trainer's wandb callback reads it
    assert tracker_project("mine", ["wandb"]) == "mine"
    assert tracker_project(None, ["tensorboard"]) == "hf_asyncpp"
    monkeypatch.delenv("WANDB_PROJECT")
    assert tracker_project(None, ["wandb"]) == "hf_asyncpp"


def test_each_stage_and_replica_draws_its_own_random_stream():
    """Same initial weights everywhere (training.seed), then per-rank dropout streams: rank (0, 0) keeps the seed (a
    single-process run is unchanged), every other (stage, replica) its own, reproducibly."""
    from hf_asyncpp.run.seeds import rank_seed, set_seed

    assert rank_seed(42, 0, 0) == 42
    seeds = {(s, r): rank_seed(42, s, r) for s in range(8) for r in range(4)}
    assert len(set(seeds.values())) == 32 and seeds == {(s, r): rank_seed(42, s, r) for s in range(8) for r in range(4)}
    assert rank_seed(43, 1, 0) != rank_seed(42, 1, 0)
    masks = []
    for stage in (0, 1, 0):
        set_seed(rank_seed(42, stage, 0))
        masks.append(torch.nn.functional.dropout(torch.ones(256), 0.5))
    assert not torch.equal(masks[0], masks[1]) and torch.equal(masks[0], masks[2])


def test_rng_state_round_trip_includes_cuda(monkeypatch):
    """The CPU generators round-trip; where CUDA is available its generator is saved and restored too (faked on a
    CPU-only machine: the calls and the state handed back are what is checked)."""
    from hf_asyncpp.run.seeds import rng_state, set_rng_state

    torch.manual_seed(5)
    saved = rng_state()
    first = torch.rand(4)
    set_rng_state(saved)
    assert torch.equal(torch.rand(4), first)
    if torch.cuda.is_available():  # the real thing
        saved = rng_state()
        a = torch.rand(4, device="cuda")
        set_rng_state(saved)
        assert torch.equal(torch.rand(4, device="cuda"), a)
        return
    fake = {"state": torch.tensor([1, 2, 3], dtype=torch.uint8), "set": None}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *a, **k: fake["state"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, *a, **k: fake.__setitem__("set", s))
    state = rng_state()
    assert torch.equal(state["cuda"], fake["state"])
    set_rng_state(state)
    assert torch.equal(fake["set"], fake["state"])
    set_rng_state({k: v for k, v in state.items() if k != "cuda"})  # a CPU checkpoint on a GPU: nothing to restore
    assert torch.equal(fake["set"], fake["state"])


def test_train_s_excludes_the_time_between_a_drain_and_the_next_step(tmp_path, monkeypatch):
    """``train_s`` is the time-to-loss clock: what passes between restart_clock calls after a step record (an
    evaluation, a checkpoint) is in ``elapsed_s`` but not in ``train_s``."""
    from types import SimpleNamespace

    from hf_asyncpp.run import reporting
    from hf_asyncpp.run.checkpointer import RunState
    from hf_asyncpp.engine import StepResult

    now = [100.0]
    monkeypatch.setattr(reporting.time, "perf_counter", lambda: now[0])
    acc = SimpleNamespace(is_main_process=True, num_processes=1, init_trackers=lambda *a, **k: None, log=lambda *a, **k: None)
    r = recipe_from_dict({"model": {"config": {"model_type": "llama"}}, "training": {"max_steps": 3, "report_to": []}})
    log = reporting.RunLog(tmp_path, r, acc, RunState(), tokens_per_step=10)
    for k, pause in enumerate((0.0, 50.0, 0.0)):  # an evaluation of 50 s after step 1
        if pause:
            now[0] += pause
            log.restart_clock()
        now[0] += 2.0
        log.step(StepResult(k, 1.0, None, 1e-3, True), 10 * (k + 1))
    log.close()
    rows = reporting.read_metrics(tmp_path / reporting.METRICS)
    assert [x["train_s"] for x in rows] == [2.0, 4.0, 6.0]
    assert [x["elapsed_s"] for x in rows] == [2.0, 54.0, 56.0]


def test_compare_reports_the_time_2bw_needs_to_reach_the_sync_loss(tmp_path):
    """``hf-asyncpp compare``'s arithmetic on two written metrics files: the crossing is interpolated between
    evaluations on the training clock, and a run that never gets there says so."""
    from hf_asyncpp.cli.compare import compare, crossing

    assert crossing([(0.0, 5.0), (10.0, 4.0), (20.0, 3.0)], 3.5) == pytest.approx(15.0)
    assert crossing([(0.0, 5.0), (10.0, 4.0)], 3.0) is None
    assert crossing([(0.0, 5.0), (10.0, 4.0)], 5.0) == 0.0

    def write(run, rows):
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    step = lambda k, t: {"step": k, "loss": 1.0, "train_s": t, "elapsed_s": t + 100}
    write(tmp_path / "sync", [{"step": 0, "eval_loss": 5.0}, step(1, 10.0), step(2, 20.0), {"step": 2, "eval_loss": 3.0}])
    write(tmp_path / "2bw", [{"step": 0, "eval_loss": 5.0}, step(1, 6.0), {"step": 1, "eval_loss": 3.5}, step(2, 12.0),
                             {"step": 2, "eval_loss": 2.5}])
    res = compare(tmp_path / "sync", tmp_path / "2bw")
    assert res["target_eval_loss"] == 3.0 and res["sync_train_s"] == 20.0 and res["2bw_train_s"] == 12.0
    assert res["2bw_reach_s"] == pytest.approx(9.0) and res["ratio"] == pytest.approx(0.45)
    # a 2BW arm with its own, longer budget: the step rate is per step, the crossing on its own curve
    write(tmp_path / "2bw-long", [{"step": 0, "eval_loss": 5.0}, step(1, 6.0), {"step": 1, "eval_loss": 4.0},
                                  step(2, 12.0), {"step": 2, "eval_loss": 3.5}, step(3, 18.0), {"step": 3, "eval_loss": 2.0}])
    res = compare(tmp_path / "sync", tmp_path / "2bw-long")
    assert res["2bw_steps"] == 3 and res["sync_steps"] == 2 and res["step_speedup"] == pytest.approx(10.0 / 6.0)
    assert res["2bw_reach_s"] == pytest.approx(14.0) and res["ratio"] == pytest.approx(0.7)


def test_a_fresh_run_never_writes_into_another_runs_folder(tmp_path):
    """A finished 6-step run's folder: a new run (no resume) stops before writing anything, naming both ways out;
    ``overwrite_output_dir`` replaces the old run; resuming it is untouched by the check."""
    from hf_asyncpp.errors import RecipeError
    from hf_asyncpp.run.trainer import train

    out = tmp_path / "run"
    train(recipe_from_dict(tiny(out)))
    # nothing of the old run is written; .run.lock is the folder's (its lock, which the refused run held a moment)
    before = {p.relative_to(out): p.stat().st_mtime_ns for p in out.rglob("*") if p.name != RUN_LOCK}
    with pytest.raises(RecipeError, match=r"holds another run \(checkpoint-0000003/, checkpoint-0000006/, metrics"
                                          r".*resume_from_checkpoint=latest.*overwrite_output_dir=true"):
        train(recipe_from_dict(tiny(out, training__max_steps=2, training__save_steps=0)))
    assert {p.relative_to(out): p.stat().st_mtime_ns for p in out.rglob("*") if p.name != RUN_LOCK} == before
    assert (out / RUN_LOCK).read_text() == ""  # released, with no holder left to name
    train(recipe_from_dict(tiny(out, training__max_steps=2, training__save_steps=0, training__overwrite_output_dir=True)))
    assert [p.name for _, p in list_checkpoints(out)] == [checkpoint_name(2)]
    assert len(losses(out)) == 2  # the new run's 2 steps, none of the old run's 6


@pytest.mark.parametrize("resume", [None, "latest"])
def test_a_start_that_failed_before_saving_leaves_a_folder_the_same_command_reuses(tmp_path, monkeypatch, resume):
    """A start that fails after writing its tokenizer, recipe and untrained eval (here its engine build) leaves
    nothing to continue: the same command, fixed, just runs there, and so does a torchrun restart's ``latest`` (of
    a run that died before its first save), where the folder used to refuse both. ``latest`` asked by hand, in no
    restart, finds nothing to resume and says so."""
    from hf_asyncpp.errors import MissingCheckpoint
    from hf_asyncpp.run import trainer

    out = tmp_path / "run"
    build = trainer.make_engine
    monkeypatch.setattr(trainer, "make_engine", lambda *a: (_ for _ in ()).throw(RuntimeError("out of memory")))
    with pytest.raises(RuntimeError, match="out of memory"):
        trainer.train(recipe_from_dict(tiny(out, training__max_steps=2, training__save_steps=0)))
    assert (out / "tokenizer").is_dir() and not list_checkpoints(out)
    monkeypatch.setattr(trainer, "make_engine", build)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    if resume == "latest":
        with pytest.raises(MissingCheckpoint, match=r"nothing to resume in .*: it holds no complete checkpoint"):
            trainer.train(recipe_from_dict(tiny(out, training__max_steps=2, training__save_steps=0,
                                                training__resume_from_checkpoint=resume)))
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun's restart of the failed start
    trainer.train(recipe_from_dict(tiny(out, training__max_steps=2, training__save_steps=0,
                                        training__resume_from_checkpoint=resume)))
    assert [p.name for _, p in list_checkpoints(out)] == [checkpoint_name(2)] and len(losses(out)) == 2


def test_pruning_keeps_the_checkpoint_just_written(tmp_path):
    """Resumed from an earlier checkpoint, a run's new checkpoint is older-numbered than the others: save_total_limit
    must not delete it."""
    for step in (3, 6, 9):
        (tmp_path / checkpoint_name(step)).mkdir()
        (tmp_path / checkpoint_name(step) / MANIFEST).write_text("{}")
    prune(tmp_path, 2, keep=tmp_path / checkpoint_name(3))
    assert [p.name for _, p in list_checkpoints(tmp_path)] == [checkpoint_name(3), checkpoint_name(9)]
    prune(tmp_path, 1, keep=tmp_path / checkpoint_name(3))
    assert [p.name for _, p in list_checkpoints(tmp_path)] == [checkpoint_name(3)]


def test_a_mixture_trains_reports_each_source_and_resumes_bitwise(tmp_path):
    """Two sources (the fixture corpus as zstd JSON lines, notes as gzip text), weights 3:1: the run trains on both,
    metrics.jsonl has each source's tokens at every drain point (summing to num_input_tokens_seen) and an
    eval_loss/<source> per evaluation, the final report both; and 3 steps, stop, resume, 3 steps is bitwise the
    straight run (every source's position, the draws, RNG and optimizer restored)."""
    import gzip

    import zstandard

    from hf_asyncpp.run.trainer import train

    fixture = ROOT / "tests" / "fixtures" / "sotu_slice.jsonl"
    (tmp_path / "sotu.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(fixture.read_bytes()))
    notes = [f"Note {i}: the river rose over the lower fields and the harvest came in late." for i in range(300)]
    (tmp_path / "notes.txt.gz").write_bytes(gzip.compress(("\n\n".join(notes) + "\n").encode()))
    data = {"seq_len": 32, "shuffle_buffer": 50, "eval_blocks": 4, "sources": [
        {"name": "sotu", "train_files": [str(tmp_path / "sotu.jsonl.zst")], "weight": 3},
        {"name": "notes", "train_files": [str(tmp_path / "notes.txt.gz")], "weight": 1}]}
    mixed = lambda out, **kw: recipe_from_dict({**tiny(out, training__eval_steps=3, **kw), "data": data})  # noqa: E731
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(mixed(straight, training__export=True))
    train(mixed(split, training__stop_after_steps=3))
    train(mixed(split, training__resume_from_checkpoint="latest"))
    a, b = losses(straight), losses(split)
    assert len(a) == 6 and a == b
    for k, v in weights(straight, 6).items():
        assert torch.equal(v, weights(split, 6)[k]), k
    rows = [json.loads(x) for x in (straight / "metrics.jsonl").read_text().splitlines()]
    seen = {r["step"]: r["num_input_tokens_seen"] for r in rows if "loss" in r}
    counts = {r["step"]: r for r in rows if "data/sotu/tokens" in r}
    assert sorted(counts) == [3, 6]
    for step, r in counts.items():
        assert r["data/sotu/tokens"] + r["data/notes/tokens"] == seen[step]
        assert r["data/sotu/tokens"] > 0 and r["data/notes/tokens"] > 0 and r["data/sotu/documents"] > 0
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 3, 6] and all({"eval_loss/sotu", "eval_loss/notes"} <= set(r) for r in evals)
    for r in evals:  # the pooled loss lies between the sources'
        assert min(r["eval_loss/sotu"], r["eval_loss/notes"]) <= r["eval_loss"] <= max(r["eval_loss/sotu"], r["eval_loss/notes"])
    report = json.loads((straight / "final_eval.json").read_text())["data_sources"]
    assert report == {**{k: v for k, v in counts[6].items() if k.startswith("data/")},
                      "eval_loss/sotu": evals[-1]["eval_loss/sotu"], "eval_loss/notes": evals[-1]["eval_loss/notes"]}
    assert [r for r in (json.loads(x) for x in (split / "metrics.jsonl").read_text().splitlines()) if "data/sotu/tokens" in r] \
        == [counts[3], counts[6]]  # the resumed run's counters continue
