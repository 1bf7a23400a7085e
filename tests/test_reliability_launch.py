"""Faults of a pipelined run under the real launcher: the launcher killed with SIGKILL (what an OOM killer or a
scheduler does) leaves no worker behind, and a damaged stage file of the latest checkpoint is named and skipped."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from hf_asyncpp.storage import checkpoint_io as ckpt
from support import assert_each_damage_is_named, launch, losses, truncate, write_recipe
from hf_asyncpp.storage.names import checkpoint_name


def _ppid_and_state(pid: int) -> tuple[int, str] | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), fields[0]


def _workers(launcher: int) -> list[int]:
    """The launcher's children running the training script."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (_ppid_and_state(int(entry.name)) or (0, ""))[0] == launcher:
            try:
                if b"pretrain.py" in (entry / "cmdline").read_bytes():
                    out.append(int(entry.name))
            except OSError:
                pass
    return out


def _read_available(stream, wait_s: float = 5.0) -> str:
    """What the dead launcher's pipe holds, without waiting on a writer that might still hold it open."""
    fd, chunks, deadline = stream.fileno(), [], time.time() + wait_s
    while time.time() < deadline and select.select([fd], [], [], 0.2)[0]:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def _alive(pid: int) -> bool:
    info = _ppid_and_state(pid)
    return info is not None and info[1] != "Z"  # a zombie has stopped; only its exit status is left


def test_launcher_killed_leaves_no_orphan_and_no_later_checkpoint(tmp_path):
    out = tmp_path / "run"
    proc = launch(write_recipe(tmp_path / "r.yaml", out, max_steps=100000, save_steps=4, logging_steps=1), wait=False)
    workers = []
    try:
        deadline = time.time() + 300
        while not list(out.glob("checkpoint-*/manifest.json")) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        workers = _workers(proc.pid)
        assert len(workers) == 2, workers
        os.kill(proc.pid, signal.SIGKILL)  # the launcher only: its workers are in sessions of their own
        proc.wait()
        dead_at = time.time()
        while any(_alive(w) for w in workers) and time.time() < dead_at + 10:
            time.sleep(0.1)
        gone_after = time.time() - dead_at
        assert not any(_alive(w) for w in workers), "a worker outlived its launcher by 10 s"
        later = [m for m in out.glob("checkpoint-*/manifest.json") if m.stat().st_mtime > dead_at]
        assert not later, f"checkpoints committed after the launcher died: {later}"
        log = _read_available(proc.stdout)
        assert "the launcher that started it" in log and f"pid {proc.pid}" in log, log[-3000:]
        print(f"both ranks gone {gone_after:.2f} s after the launcher")
    finally:
        for w in workers:  # only if the test failed: the workers it started
            if _alive(w):
                os.kill(w, signal.SIGKILL)


def test_pipelined_checkpoint_damage_is_named_and_latest_falls_back(tmp_path):
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", out, max_steps=8, save_steps=4)
    rc, log = launch(recipe)
    assert rc == 0, log[-3000:]
    good = out / checkpoint_name(8)
    kinds = ["stage-00.safetensors", "stage-01.safetensors", "stage-00-versions.safetensors",
             "stage-01-optimizer.pt", "rng-rank001.pt"]
    assert_each_damage_is_named(good, kinds, tmp_path)
    reference = losses(out)
    truncate(good / "stage-01.safetensors")
    rc, log = launch(recipe, "--training.resume_from_checkpoint=latest")
    assert rc == 0, log[-3000:]
    assert "skipped 1 damaged checkpoint(s): checkpoint-0000008 (" in log and "stage-01.safetensors" in log
    assert f"resumed from {out / checkpoint_name(4)} at step 4" in log
    assert losses(out) == reference  # steps 5-8 again, from checkpoint 4: bitwise the same
    assert ckpt.verify(good) == []  # checkpoint 8 written anew


def test_every_rank_entry_point_notes_its_launcher_before_the_slow_imports():
    """``supervision`` notes the launcher's pid when it is imported; a launcher that dies during the seconds that
    torch and transformers take to import must still be noticed, so every entry point a rank runs imports it
    before torch (the order of ``sys.modules`` is the order of first import). ``cli.train`` imports the training
    machinery in ``main()``, once the recipe is read (test_cli_inputs.py): here imported after it, as main() does."""
    for entry in ("hf_asyncpp.cli.train", "hf_asyncpp.run.trainer"):
        code = (f"import sys, {entry}, hf_asyncpp.run.trainer; names = list(sys.modules); "
                "print(names.index('hf_asyncpp.supervision') < names.index('torch'))")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and r.stdout.strip() == "True", (entry, r.stdout, r.stderr[-2000:])
