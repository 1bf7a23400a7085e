"""Saves that never stall the pipeline: the training thread only stages (copies the state once to host memory); a
background writer serializes, hashes, writes and commits. Checked by the counts each save records in its manifest
(``save``: per rank, bytes staged, bytes the training thread wrote, bytes the writer wrote, bytes sent to the main
process), against the checkpoint's own files; and a checkpoint written that way, ZeRO-1 replicas each writing the
state they own, resumes the run bitwise."""
from __future__ import annotations

import threading
import time

from hf_asyncpp.config.recipe import recipe_from_dict
from hf_asyncpp.run.checkpointer import saved_positions
from hf_asyncpp.storage import checkpoint_io as ckpt
from hf_asyncpp.storage.names import checkpoint_name
from hf_asyncpp.storage.staging import BackgroundWriter
from support import launch, losses, tiny, write_recipe

SENT_PER_FILE = 400  # pickled bytes per file a writer sends the main process (its name, size and sha256), at most


def _rank_files(files: dict, rank: int, stages: int, dp: int, zero: bool) -> list[str]:
    """The files rank ``rank`` writes itself (the main process adds the run's files)."""
    stage, replica = divmod(rank, dp)
    mine = [f"rng-rank{rank:03d}.pt", f"data-rank{rank:03d}.json"]
    if replica == 0:
        mine += [f"stage-{stage:02d}.safetensors", f"stage-{stage:02d}-versions.safetensors",
                 f"stage-{stage:02d}-optimizer.pt"]
    elif zero:
        mine.append(f"stage-{stage:02d}-optimizer-replica{replica:02d}.pt")
    return [f for f in mine if f in files]


def test_the_training_thread_only_stages_and_each_zero_replica_writes_its_own_state(tmp_path):
    """2 stages x 2 replicas under ZeRO-1: per save, every rank's training thread wrote 0 bytes; each rank's writer
    wrote exactly its own files (the manifest's sizes), including replica 1's own optimizer file; what a writer sent
    the main process is names and hashes (bytes per file, not the optimizer state's size). Resumed from step 2 in a
    new folder, the run continues bitwise as the one that went on."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    topo = ("--pipeline.num_microbatches=2", "--optimizer.shard_across_replicas=true")
    rc, log = launch(write_recipe(tmp_path / "a.yaml", straight, max_steps=4, save_steps=2), *topo, procs=4)
    assert rc == 0, log[-3000:]
    for step in (2, 4):
        path = straight / checkpoint_name(step)
        manifest = ckpt.load_json(path / "manifest.json")
        files = manifest["files"]
        assert len(manifest["save"]) == 4
        for rank, counts in enumerate(manifest["save"]):
            mine = _rank_files(files, rank, 2, 2, zero=True)
            assert counts["training_thread_bytes"] == 0, (rank, counts)
            assert counts["writer_bytes"] == sum(files[f]["size"] for f in mine), (rank, mine, counts)
            assert counts["staged_bytes"] > 0 and counts["blocked_s"] >= counts["waited_s"] >= 0
            assert counts["sent_bytes"] <= SENT_PER_FILE * len(mine), counts
        for stage in (0, 1):  # replica 1's optimizer state: in its own file, never sent to replica 0
            part = f"stage-{stage:02d}-optimizer-replica01.pt"
            assert part in files and files[part]["size"] > max(c["sent_bytes"] for c in manifest["save"])
        positions = saved_positions(path)
        assert positions[0] == positions[2] and positions[1] == positions[3] and positions[0]["blocks"] > 0
    rc, log = launch(write_recipe(tmp_path / "b.yaml", resumed, max_steps=4, save_steps=2), *topo,
                     f"--training.resume_from_checkpoint={straight / checkpoint_name(2)}", procs=4)
    assert rc == 0, log[-3000:]
    assert len(losses(straight)) == 4 and losses(resumed) == losses(straight)[2:]


def test_a_one_process_save_leaves_every_byte_to_the_writer(tmp_path):
    """One process: the training thread staged the weights and optimizer state (at least the weights' bytes) and
    wrote nothing; the writer wrote the model, optimizer, RNG and data files."""
    from hf_asyncpp.run.trainer import train

    out = tmp_path / "run"
    train(recipe_from_dict(tiny(out, training__max_steps=4, training__save_steps=2)))
    for step in (2, 4):
        manifest = ckpt.load_json(out / checkpoint_name(step) / "manifest.json")
        [counts] = manifest["save"]
        files = manifest["files"]
        assert counts["training_thread_bytes"] == 0, counts
        mine = ["model.safetensors", "optimizer.pt", "rng-rank000.pt", "data-rank000.json"]
        assert counts["writer_bytes"] == sum(files[f]["size"] for f in mine), counts
        assert counts["staged_bytes"] >= files["model.safetensors"]["size"] - 10_000  # (the safetensors header)


def test_the_writer_runs_one_save_at_a_time_and_raises_on_the_callers_thread():
    """The next job starts only after the previous one ended (one save's buffers in flight); a job's error is
    raised by the next submit or wait, on the caller's thread."""
    writer, spans = BackgroundWriter(), []

    def job(name, error=None):
        def run():
            began = time.monotonic()
            time.sleep(0.2)
            spans.append((name, began, time.monotonic(), threading.current_thread() is not threading.main_thread()))
            if error:
                raise error
        return run

    writer.submit(job("a"))
    writer.submit(job("b", OSError("disk")))
    try:
        writer.wait()
    except OSError as e:
        assert str(e) == "disk"
    else:
        raise AssertionError("the writer's error was not raised")
    writer.wait()  # raised once
    (a, a0, a1, a_bg), (b, b0, b1, b_bg) = spans
    assert (a, b) == ("a", "b") and b0 >= a1 and a_bg and b_bg


HELD_WRITER = """
import sys, threading, time
from pathlib import Path
from hf_asyncpp.run import checkpointer
from hf_asyncpp.storage import write as storage

real, marker = storage.open_for_write, Path(sys.argv[1])
save = checkpointer.Checkpointer._save


def held(path, append=False):  # the writer of checkpoint 4 never finishes: the process is killed meanwhile
    if ".tmp-checkpoint-0000004" in str(path) and threading.current_thread() is not threading.main_thread():
        marker.write_text("writing")
        time.sleep(600)
    return real(path, append)


def saving(self, state, engine, stream):  # the training thread reached the next save (where it waits for 4)
    if state.step == 6:
        marker.with_name("saving-6").write_text("")
    return save(self, state, engine, stream)


storage.open_for_write, checkpointer.Checkpointer._save = held, saving
from hf_asyncpp.cli.train import main
sys.exit(main(sys.argv[2:]))
"""


def test_a_process_killed_during_a_background_write_resumes_from_the_previous_checkpoint(tmp_path):
    """Checkpoint 4's writer is held; the training thread trains steps 5 and 6 meanwhile (their metrics records wait
    behind the save in flight), then waits for it at the save of step 6, and the process is SIGKILLed there.
    Checkpoint 2 stays the latest (4 was never committed: no manifest, only its temporary folder) and verifies; the
    resume trains steps 3-6 to the losses of a run never killed."""
    import os
    import signal
    import subprocess
    import sys

    from hf_asyncpp.run.folder import choose_resume
    from hf_asyncpp.run.trainer import train
    from hf_asyncpp.topology import Topology
    from support import recipe_file, train_steps

    out, marker = tmp_path / "run", tmp_path / "writing"
    recipe = recipe_file(tmp_path, out, training__max_steps=6, training__save_steps=2)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-c", HELD_WRITER, str(marker), recipe], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (marker.exists() and (tmp_path / "saving-6").exists()) and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None and marker.exists(), proc.stderr.read()[-3000:]
    time.sleep(0.5)  # in the save of step 6, waiting for the held write
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert train_steps(out) == [1, 2, 3, 4]  # 5 and 6 were to follow checkpoint 4's commit
    assert choose_resume(out, "latest", Topology()) == out / checkpoint_name(2)
    assert not (out / checkpoint_name(4)).exists() and (out / ".tmp-checkpoint-0000004").is_dir()
    assert ckpt.verify(out / checkpoint_name(2)) == []

    straight = tmp_path / "straight"
    train(recipe_from_dict(tiny(straight, training__max_steps=6, training__save_steps=2)))
    train(recipe_from_dict(tiny(out, training__max_steps=6, training__save_steps=2,
                                training__resume_from_checkpoint="latest")))
    assert train_steps(out) == [1, 2, 3, 4, 5, 6] and losses(out) == losses(straight)
    assert (out / checkpoint_name(6) / "manifest.json").exists() and not (out / ".tmp-checkpoint-0000004").exists()
