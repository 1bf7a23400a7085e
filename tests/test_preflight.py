"""Runs a user can trust: what can be checked before training is checked before the processes start
(hf_asyncpp/run/preflight.py), and a failure in any process ends the run with one ``error:`` line naming the field
(hf_asyncpp/launch/failures.py). The self-starting launcher is run for real (`hf-asyncpp train` as one process); the
Hub is replaced by a stand-in HfApi (the network edge) only in-process."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from hf_asyncpp.launch.spawn import NO_SPAWN
from dist_utils import free_port
from support import launch, record_errors, tiny, write_recipe

STARTED = "starting 2 local processes"


def train_alone(tmp_path: Path, recipe: Path, *overrides: str) -> tuple[int, str]:
    """`hf-asyncpp train RECIPE ...` started as one process: it starts the recipe's 2 stage processes itself.
    Offline, with no Hugging Face token and no user accelerate config."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    for name in (NO_SPAWN, "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ASYNCPP_DEBUG"):
        env.pop(name, None)
    r = subprocess.run([sys.executable, "-m", "hf_asyncpp", "train", str(recipe), *overrides], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    record_errors("hf-asyncpp train (starts the stages)", r.returncode, r.stdout + r.stderr)
    return r.returncode, r.stdout + r.stderr


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


@pytest.fixture
def recipe(tmp_path) -> Path:
    return write_recipe(tmp_path / "r.yaml", tmp_path / "run", max_steps=2, save_steps=2)


@pytest.mark.parametrize("debug", [False, True])
def test_a_model_path_that_does_not_exist_is_one_line_before_the_processes_start(tmp_path, recipe, debug):
    code, out = train_alone(tmp_path, recipe, "--model.config=null", "--model.name_or_path=./my-model-typo",
                            *(["--debug"] if debug else []))
    assert code == 2, out[-3000:]
    [line] = error_lines(out)
    assert line.startswith("error: model.name_or_path: './my-model-typo'") and STARTED not in out
    assert ("Traceback" in out) == debug  # --debug through `hf-asyncpp train` shows the traceback behind the line


def test_a_model_folder_without_weights_is_one_line_before_the_processes_start(tmp_path, recipe):
    """It used to be 99 lines: both ranks' from_pretrained tracebacks, after the processes had started."""
    from transformers import AutoConfig

    AutoConfig.for_model("llama", hidden_size=64, num_hidden_layers=2).save_pretrained(tmp_path / "config-only")
    code, out = train_alone(tmp_path, recipe, "--model.config=null", f"--model.name_or_path={tmp_path}/config-only")
    assert code == 2, out[-3000:]
    [line] = error_lines(out)
    assert line.startswith(f"error: model.name_or_path: '{tmp_path}/config-only' has a config but no weights (none "
                           "of model.safetensors, ") and "give it as model.config" in line
    assert STARTED not in out and "Traceback" not in out


def test_an_unreachable_hub_dataset_is_one_line_before_the_processes_start(tmp_path, recipe):
    code, out = train_alone(tmp_path, recipe, "--data.dataset=roneneldan/TinyStories", "--data.train_files=null")
    assert code == 6, out[-3000:]
    [line] = error_lines(out)
    assert "data.dataset: 'roneneldan/TinyStories' cannot be loaded" in line and "Traceback" not in out
    assert STARTED not in out


def test_an_error_in_a_started_process_is_one_line_without_torchruns_report(tmp_path, recipe):
    """Rank 0 finds no usable document; rank 1, waiting for it at a barrier, sees its connection close: it leaves
    quietly, and torchrun's own `failed (exitcode: 6)` report is left out. --debug reaches the started processes."""
    code, out = train_alone(tmp_path, recipe, "--data.min_document_tokens=100000")
    assert code == 6, out[-3000:]
    [line] = error_lines(out)
    assert line.startswith("error: DataError: no usable document") and STARTED in out
    assert "Traceback" not in out and "exitcode" not in out and "Connection closed" not in out

    code, out = train_alone(tmp_path, recipe, "--data.min_document_tokens=100000", "--training.overwrite_output_dir=true",
                            "--debug")
    assert code == 6 and "Traceback" in out and "min_document_tokens" in out
    assert len(error_lines(out)) == 1


def test_an_unknown_tracker_is_printed_once(tmp_path, recipe):
    code, out = train_alone(tmp_path, recipe, "--training.report_to=[nosuch]")
    assert code == 2 and STARTED not in out
    [line] = error_lines(out)
    assert line.startswith("error: training.report_to: 'nosuch' is not a tracker")
    code, out = launch(recipe, "--training.report_to=[nosuch]")  # accelerate launch: both ranks meet it
    assert code != 0
    assert error_lines(out) == [line]


SHARED_ERROR = """
import os, sys, time
from hf_asyncpp.errors import RecipeError
from hf_asyncpp.launch.failures import report
if os.environ["LOCAL_RANK"] == "0":
    time.sleep(float(sys.argv[1]))  # the first process is the slow one: it runs checks the others skip
try:
    raise RecipeError("training.report_to: 'nosuch' is not a tracker")
except RecipeError as e:
    sys.exit(report(e, debug=False, same_everywhere=True))
"""


def test_a_shared_error_is_printed_even_when_the_first_process_meets_it_last(tmp_path):
    """torchrun ends every worker once one fails: the rank that leaves the line to its node's first process must
    not exit before that process has printed it (CI saw the line lost when rank 0 was the slower one)."""
    script = tmp_path / "shared_error.py"
    script.write_text(SHARED_ERROR)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(free_port()), str(script), "3"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert error_lines(r.stdout + r.stderr) == ["error: training.report_to: 'nosuch' is not a tracker"], r.stderr[-3000:]


def test_a_wrong_process_count_under_torchrun_is_said_once(tmp_path, recipe):
    """Each of 3 ranks of a 2-stage recipe printed the 4-line message (12 lines, interleaved) before torchrun's
    report: the count is checked with the other checks every rank meets alike, printed by the node's first process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3", "--master_port",
                        str(free_port()), "-m", "hf_asyncpp.cli.train", str(recipe), "--pipeline.schedule=1f1b",
                        "--pipeline.num_stages=2"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert error_lines(r.stdout + r.stderr) == [
        "error: pipeline.num_stages: 2 stages need a multiple of 2 processes, but 3 were started. Run:"], r.stderr[-3000:]


def test_a_damaged_checkpoint_under_torchrun_is_said_once(tmp_path, recipe):
    """Every rank verifies its share of the checkpoint and all learn every problem: the verdict is the same
    everywhere, so the node's first process says it (each rank printed it before)."""
    ckpt = tmp_path / "run" / "checkpoint-0000002"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text(json.dumps({"step": 2, "world_size": 2, "num_stages": 2, "files": {
        "stage-00.safetensors": {"size": 4, "sha256": "0" * 64}}}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(free_port()), "-m", "hf_asyncpp.cli.train", str(recipe), "--pipeline.schedule=1f1b",
                        "--pipeline.num_stages=2", f"--training.resume_from_checkpoint={ckpt}"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert error_lines(r.stdout + r.stderr) == [
        f"error: CheckpointError: training.resume_from_checkpoint: {ckpt} does not match its manifest: "
        f"{ckpt / 'stage-00.safetensors'}: missing; resume from another checkpoint (none in {ckpt.parent}) or start "
        "afresh"], r.stderr[-3000:]


def test_a_push_without_a_token_fails_before_training(tmp_path, recipe):
    code, out = train_alone(tmp_path, recipe, "--hub.push_to_hub=true", "--hub.hub_model_id=me/tiny")
    assert code == 8, out[-3000:]
    [line] = error_lines(out)
    assert line.startswith("error: HubError: hub.push_to_hub: the Hugging Face Hub does not accept the token")
    assert STARTED not in out and not (tmp_path / "run" / "metrics.jsonl").exists()


class Hub:
    """Stands in for huggingface_hub.HfApi (the network edge): refuses what ``refuse`` names."""

    refuse: set = set()
    calls: list = []

    def __init__(self, *a, **kw):
        pass

    def _call(self, name: str):
        Hub.calls.append((name, threading.current_thread().name))
        if name in Hub.refuse:
            raise ConnectionError(f"{name}: 403 Forbidden")

    def whoami(self, *a, **kw):
        self._call("whoami")
        return {"name": "me"}

    def create_repo(self, repo_id, **kw):
        self._call("create_repo")

    def upload_folder(self, *, repo_id, folder_path, **kw):
        self._call("upload_folder")
        return type("CommitInfo", (), {"commit_url": f"https://hub/{repo_id}/commit/1"})()


@pytest.fixture
def hub(monkeypatch):
    import huggingface_hub

    Hub.refuse, Hub.calls = set(), []
    monkeypatch.setattr(huggingface_hub, "HfApi", Hub)
    return Hub


def train_here(tmp_path: Path, capsys, **overrides) -> tuple[int, str, Path]:
    """`hf-asyncpp train` in this process, on a one-process recipe that pushes to the Hub."""
    from hf_asyncpp.cli.train import main

    out = tmp_path / "run"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(tiny(out, training__max_steps=2, training__save_steps=2, hub__push_to_hub=True,
                                          hub__hub_model_id="me/tiny", **overrides)))
    code = main([str(recipe)])
    return code, capsys.readouterr().err, out


@pytest.mark.parametrize("refused", ["whoami", "create_repo"])
def test_a_refused_token_or_repository_fails_before_step_1(tmp_path, capsys, hub, refused):
    hub.refuse = {refused}
    code, err, out = train_here(tmp_path, capsys)
    assert code == 8
    [line] = error_lines(err)
    field = "hub.push_to_hub" if refused == "whoami" else "hub.hub_model_id: 'me/tiny'"
    assert line.startswith(f"error: HubError: {field}") and "403 Forbidden" in line
    assert not (out / "metrics.jsonl").exists() and "upload_folder" not in [c[0] for c in hub.calls]


def test_a_push_that_fails_for_good_fails_the_run_after_the_export_is_safe(tmp_path, capsys, hub):
    hub.refuse = {"upload_folder"}
    code, err, out = train_here(tmp_path, capsys, training__export=True)
    assert code == 8
    [line] = error_lines(err)
    assert line.startswith("error: HubError: hub.hub_model_id: 1 push(es) to 'me/tiny' failed (export: ConnectionError")
    assert f"hf upload me/tiny {out / 'export'}" in line
    assert (out / "export" / "model.safetensors").exists() and (out / "final_eval.json").exists()
    assert [c[0] for c in hub.calls].count("upload_folder") == 3  # retried, then given up


def test_a_killed_rank_is_named_not_the_survivor_torchrun_stopped(tmp_path):
    """No rank left an error (an out-of-memory kill): the line names the killed rank, not the one torchrun then
    stopped with SIGTERM, nor one that only saw its peer's connection close."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from hf_asyncpp.launch.failures import first_error

    (tmp_path / "rank-2.json").write_text('{"line": "error: PeerFailure: ...", "code": 3, "peer_gone": true, "time": 1}')
    failures = {0: ProcessFailure(0, 100, -signal.SIGTERM, ""), 1: ProcessFailure(1, 101, -signal.SIGKILL, ""),
                2: ProcessFailure(2, 102, 3, "")}
    assert first_error(failures, tmp_path) == ("error: rank 1 was killed by SIGKILL (the out-of-memory killer? see dmesg)", 1)


@pytest.mark.parametrize("finished_first", [True, False])
def test_a_stop_signal_after_the_run_finished_is_no_failure(tmp_path, monkeypatch, capsys, finished_first):
    """SLURM's time limit in the run's last seconds: torchrun hands the launcher's SIGTERM to workers that have
    already finished (they note it and exit 0: cli.train keeps the stop handlers for the process's life) and then
    reports the signal. The main rank's note (``leave_finished``) makes that exit 0 with a line saying so; without
    the note it is still the failure it was. torchrun is replaced here only at that point (its report)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from hf_asyncpp.config.recipe import recipe_from_dict
    from hf_asyncpp.launch import spawn as spawn_module
    from hf_asyncpp.launch.failures import leave_finished

    def run(args):
        if finished_first:
            leave_finished()  # the worker's side, into the launcher's folder (ERROR_DIR, set by spawn)
        raise SignalException("Process 1 got signal: 15", signal.SIGTERM)

    monkeypatch.setattr(spawn_module.torchrun, "run", run)
    recipe = recipe_from_dict(tiny(tmp_path / "run", pipeline__num_stages=2, pipeline__schedule="2bw"))
    code = spawn_module.spawn(recipe, ["r.yaml"], debug=False)
    err = capsys.readouterr().err
    if finished_first:
        assert code == 0 and "hf_asyncpp: SIGTERM arrived after the run had finished; nothing was stopped" in err
    else:
        assert code == 1 and "error: the run's processes failed" in err
