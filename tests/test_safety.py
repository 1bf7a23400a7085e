"""Bad input gets a clear error and loses nothing: Hub push (network edge replaced by a recorder),
non-finite steps, unwritable output, a kill during a checkpoint write, and bad inputs across recipe,
data, topology, model and checkpoint."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from hf_asyncpp.config.recipe import recipe_from_dict
from hf_asyncpp.errors import RecipeError, WriteError
from hf_asyncpp.run.checkpointer import Checkpointer
from hf_asyncpp.run.folder import choose_resume
from hf_asyncpp.run.hub import push_folder
from hf_asyncpp.storage import checkpoint_io as ckpt
from hf_asyncpp.topology import Topology
from support import tiny
from hf_asyncpp.run.folder import list_checkpoints
from hf_asyncpp.storage.names import MANIFEST, checkpoint_name, temp_dir

ROOT = Path(__file__).resolve().parent.parent


class Recorder:
    """Stands in for huggingface_hub.HfApi (the network edge); checks files exist when uploaded."""

    calls: list = []
    fail_times = 0

    def __init__(self, *a, **kw):
        pass

    def create_repo(self, repo_id, **kw):
        Recorder.calls.append(("create_repo", repo_id, kw))

    def upload_folder(self, *, repo_id, folder_path, **kw):
        files = sorted(p.name for p in Path(folder_path).iterdir())
        Recorder.calls.append(("upload_folder", repo_id, {**kw, "files": files, "thread": threading.current_thread().name}))
        if Recorder.fail_times > 0:
            Recorder.fail_times -= 1
            raise ConnectionError(f"503 from the Hub for token {os.environ.get('HF_TOKEN')}")
        return type("CommitInfo", (), {"commit_url": f"https://hub/{repo_id}/commit/1"})()


@pytest.fixture
def hub(monkeypatch):
    import huggingface_hub

    Recorder.calls, Recorder.fail_times = [], 0
    monkeypatch.setattr(huggingface_hub, "HfApi", Recorder)
    monkeypatch.setenv("HF_TOKEN", "hf_SeCrEtToKeN1234567890")
    return Recorder


@pytest.mark.parametrize("strategy", ["every_save", "checkpoint"])
def test_push_at_end_and_every_save(tmp_path, hub, caplog, strategy):
    """The Trainer's hub_strategy: every save pushes a loadable model (checkpoint: also the checkpoint to
    last-checkpoint/), in the background, and the end pushes the export; the card names license and versions."""
    from hf_asyncpp.run.trainer import train

    caplog.set_level(logging.INFO)
    out = tmp_path / "run"
    train(recipe_from_dict(tiny(out, training__export=True, training__max_steps=4, training__save_steps=2,
                                hub__push_to_hub=True, hub__hub_model_id="me/tiny", hub__hub_strategy=strategy,
                                hub__private=True, hub__license="apache-2.0")))
    creates = [c for c in hub.calls if c[0] == "create_repo"]
    uploads = [c for c in hub.calls if c[0] == "upload_folder"]
    assert all(c[1] == "me/tiny" and c[2]["private"] and c[2]["exist_ok"] for c in creates)
    where = [u[2]["path_in_repo"] for u in uploads]
    assert where == ([None, None, None] if strategy == "every_save" else [None, "last-checkpoint"] * 2 + [None])
    loadable = {"config.json", "model.safetensors", "README.md", "tokenizer.json", "generation_config.json"}
    assert all(loadable <= set(u[2]["files"]) for u in uploads if u[2]["path_in_repo"] is None)
    assert all({"manifest.json", "model.safetensors"} <= set(u[2]["files"]) for u in uploads if u[2]["path_in_repo"])
    assert all(u[2]["thread"].startswith("hf_asyncpp-hub") for u in uploads)  # never on the training thread
    assert not (out / ".hub-staging").exists() or not any((out / ".hub-staging").iterdir())  # snapshots cleaned up
    assert json.loads((out / "final_eval.json").read_text())["hub_commit"].endswith("/commit/1")
    card = (out / "export" / "README.md").read_text()
    assert "license: apache-2.0" in card and "transformers 5" in card
    assert "hf_SeCrEtToKeN" not in caplog.text


def test_failed_push_is_retried_then_reported_and_the_export_kept(tmp_path, hub, caplog):
    from hf_asyncpp.config.sections import HubConfig

    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    cfg = HubConfig(push_to_hub=True, hub_model_id="me/x")
    hub.fail_times = 2
    assert push_folder(folder, cfg, backoff_s=0).endswith("/commit/1")
    hub.fail_times = 10
    assert push_folder(folder, cfg, retries=3, backoff_s=0) is None
    assert folder.exists() and "giving up" in caplog.text and "hf_SeCrEtToKeN" not in caplog.text


def test_a_refused_push_is_not_retried(tmp_path, hub, monkeypatch):
    """A 401/403 from the Hub (token refused, repository forbidden) cannot succeed later: one attempt, reported.
    The error is huggingface_hub's own, as its HfApi raises it."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError

    from hf_asyncpp.config.sections import HubConfig

    def refuse(self, *, repo_id, folder_path, **kw):
        Recorder.calls.append(("upload_folder", repo_id, kw))
        request = httpx2.Request("POST", f"https://huggingface.co/api/models/{repo_id}/commit/main")
        raise HfHubHTTPError("403 Forbidden", response=httpx2.Response(403, request=request))

    monkeypatch.setattr(Recorder, "upload_folder", refuse)
    folder = tmp_path / "export"
    folder.mkdir()
    failures = []
    assert push_folder(folder, HubConfig(push_to_hub=True, hub_model_id="me/x"), retries=3, backoff_s=0,
                       failures=failures) is None
    assert [c[0] for c in hub.calls].count("upload_folder") == 1 and "403" in failures[0]


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_non_finite_steps(tmp_path, policy):
    from hf_asyncpp.errors import NonFiniteError
    from hf_asyncpp.run.trainer import train

    out = tmp_path / "run"
    rec = recipe_from_dict(tiny(out, optimizer__name="sgd", optimizer__learning_rate=1e30, training__max_grad_norm=0.0,
                                training__save_steps=1, training__max_steps=4, training__on_nonfinite=policy,
                                training__logging_steps=1))
    if policy == "stop":
        with pytest.raises(NonFiniteError, match=r"non-finite .*training.on_nonfinite: stop"):
            train(rec)
        good = choose_resume(out, "latest", Topology())
        assert good is not None and torch.isfinite(ckpt.load_tensors(good / "model.safetensors")["model.norm.weight"]).all()
    else:  # skipping itself, without the limits that make a run of skips give up (test_skip_mode_gives_up)
        rec.training.max_skipped_fraction, rec.training.max_consecutive_skips = 1.0, 10
        train(rec)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        skipped = [r["step"] for r in rows if r.get("skipped_nonfinite")]
        assert skipped and len([r for r in rows if "loss" in r]) == 4


def test_skip_mode_gives_up(tmp_path):
    """A run whose steps are all skipped has stopped training: it ends with NonFiniteError (exit code 3) at the
    step that crossed the limit, never as a finished run (it exited 0, saved, exported and said "done")."""
    from hf_asyncpp.errors import NonFiniteError
    from hf_asyncpp.run.trainer import train

    out = tmp_path / "run"
    rec = recipe_from_dict(tiny(out, optimizer__name="sgd", optimizer__learning_rate=1e30, training__max_grad_norm=0.0,
                                training__max_steps=40, training__save_steps=0, training__on_nonfinite="skip",
                                training__max_skipped_fraction=1.0, training__max_consecutive_skips=3))
    with pytest.raises(NonFiniteError, match=r"non-finite gradients skipped in 3 steps in a row "
                                             r"\(training.max_consecutive_skips: 3\)"):
        train(rec)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("skipped_nonfinite")][-3:] == [rows[-1]["step"] - 2, rows[-1]["step"] - 1,
                                                                           rows[-1]["step"]]
    assert rows[-1]["step"] < 40 and not (out / checkpoint_name(40)).exists()


def test_unwritable_output_dir_fails_before_training(tmp_path):
    from hf_asyncpp.run.trainer import train

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(WriteError, match=r"training.output_dir: .* cannot be written"):
        train(recipe_from_dict(tiny(blocker / "run")))


WRITER = r"""
import sys, torch
sys.path.insert(0, sys.argv[2])
from pathlib import Path
from hf_asyncpp.run.folder import prune
from hf_asyncpp.storage import checkpoint_io as ckpt
from hf_asyncpp.storage.names import checkpoint_name
from hf_asyncpp.storage.names import checkpoint_name, temp_dir
out = Path(sys.argv[1])
step = 0
while True:
    step += 1
    tmp = temp_dir(out, step)
    tmp.mkdir(parents=True)
    ckpt.save_tensors(tmp / "model.safetensors", {"w": torch.full((2_000_000,), float(step))})
    ckpt.save_json(tmp / "trainer_state.json", {"step": step})
    ckpt.commit(tmp, out / checkpoint_name(step), {"step": step})
    prune(out, 2)
"""


def test_kill_during_checkpoint_write_leaves_the_previous_one_loadable(tmp_path):
    for delay in (0.4, 0.7, 1.1):
        out = tmp_path / f"k{delay}"
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(out), str(ROOT)])
        deadline = time.time() + 60
        while len(list_checkpoints(out)) < 1 and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        latest = choose_resume(out, "latest", Topology())
        step = ckpt.load_json(latest / "trainer_state.json")["step"]
        w = ckpt.load_tensors(latest / "model.safetensors")["w"]
        assert torch.equal(w, torch.full((2_000_000,), float(step)))


def test_a_commit_called_off_after_its_manifest_leaves_no_checkpoint(tmp_path):
    """The launcher check runs after the manifest is on disk (hashing and fsync take time in which the launcher
    can die): a commit called off there leaves nothing a resume would take."""
    tmp, final = temp_dir(tmp_path, 3), tmp_path / checkpoint_name(3)
    tmp.mkdir()
    ckpt.save_json(tmp / "trainer_state.json", {"step": 3})

    def launcher_gone():
        assert (tmp / MANIFEST).is_file()
        raise SystemExit(7)

    with pytest.raises(SystemExit):
        ckpt.commit(tmp, final, {"step": 3}, before_move=launcher_gone)
    assert not final.exists() and list_checkpoints(tmp_path) == []


def _bad(tmp_path, **kw):
    from hf_asyncpp.run.trainer import train

    return lambda: train(recipe_from_dict(tiny(tmp_path / "run", **kw)))


BAD_RUNS = [
    (dict(data__train_files=["/nonexistent/*.jsonl"]), FileNotFoundError, r"data.train_files: '/nonexistent/\*.jsonl' matches no file"),
    (dict(data__eval_files=["/nope.txt"]), FileNotFoundError, r"data.eval_files: '/nope.txt' matches no file"),
    (dict(model__config={"model_type": "not-a-model"}), RecipeError, r"model.config.model_type: 'not-a-model' is not a model type"),
    (dict(pipeline__schedule="1f1b", pipeline__num_stages=2), RecipeError, r"2 stages need a multiple of 2 processes, but 1 was started"),
    (dict(training__resume_from_checkpoint="/tmp"), FileNotFoundError, r"resume_from_checkpoint: '/tmp' is not a complete checkpoint"),
    (dict(optimizer__simulate_delay="pipedream", pipeline__num_stages=9, pipeline__num_microbatches=1), ValueError,
     r"num_stages: 9 stages for 2 decoder layers"),
]


@pytest.mark.parametrize("kw,exc,msg", BAD_RUNS, ids=[str(i) for i in range(len(BAD_RUNS))])
def test_bad_runs_name_the_problem(tmp_path, kw, exc, msg):
    with pytest.raises(exc, match=msg):
        _bad(tmp_path, **kw)()


def test_bad_data_files(tmp_path):
    from hf_asyncpp.run.trainer import train

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match=r"(no usable document|no text to train a tokenizer on) in .*empty.jsonl"):
        train(recipe_from_dict(tiny(tmp_path / "r1", data__train_files=[str(empty)], data__eval_files=[str(empty)],
                                    model__tokenizer_name_or_path=None)))
    mixed = [str(tmp_path / "a.jsonl"), str(tmp_path / "b.csv")]
    for f in mixed:
        Path(f).write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match=r"data files must all be (one of|of one kind)"):
        from hf_asyncpp.config.sections import DataConfig
        from hf_asyncpp.data.sources import load_stream

        load_stream(DataConfig(), mixed)


def test_resume_with_another_schedule_is_refused_clearly(tmp_path):
    out = tmp_path / "c"
    out.mkdir()
    ckpt.save_json(out / "run_state.json", {"world_size": 2, "num_stages": 2, "step": 3, "tokens": 0, "data": [],
                                                "schedule": "2bw"})
    with pytest.raises(RecipeError, match=r"pipeline.schedule: .* was written by a '2bw' run; resume it with the same schedule"):
        Checkpointer(out, recipe_from_dict(tiny(tmp_path / "run")), Topology(), None, None).resume(out, None, None)
