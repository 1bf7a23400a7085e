"""One run per output folder: the lock a run's main process holds, refused by name while held, free once its
holder has ended whatever the way (nothing to clean up), and never followed through a link."""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal

import pytest

from hf_asyncpp.errors import RecipeError
from hf_asyncpp.run.folder import lock_output_dir, unlock_output_dir
from hf_asyncpp.storage.names import RUN_LOCK


def _hold(folder: str, ready, release) -> None:
    from pathlib import Path

    lock_output_dir(Path(folder))
    ready.set()
    release.wait(60)


def test_a_held_folder_is_refused_naming_its_holder_and_free_once_it_ends(tmp_path, caplog):
    ctx = mp.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(tmp_path), ready, release))
    holder.start()
    try:
        assert ready.wait(60)
        with pytest.raises(RecipeError, match=rf"training.output_dir: {tmp_path} is in use by another run \(pid "
                                              rf"{holder.pid} on .*\); wait for it to end"):
            lock_output_dir(tmp_path)
        os.kill(holder.pid, signal.SIGKILL)  # no clean-up at all: the kernel releases the lock
        holder.join(30)
        caplog.set_level(logging.INFO, logger="hf_asyncpp")
        lock_output_dir(tmp_path)
        assert f"the lock left by pid {holder.pid}" in caplog.text and "is free (that run has ended): taken over" in caplog.text
        assert f'"pid": {os.getpid()}' in (tmp_path / RUN_LOCK).read_text()
        lock_output_dir(tmp_path)  # this process already holds it: a second run here goes on
    finally:
        release.set()
        holder.join(30)
        unlock_output_dir(tmp_path)


def test_a_lock_file_that_is_a_link_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("keep")
    out = tmp_path / "run"
    out.mkdir()
    (out / RUN_LOCK).symlink_to(elsewhere)
    with pytest.raises(RecipeError, match=r"\.run\.lock is a symbolic link: remove it"):
        lock_output_dir(out)
    assert elsewhere.read_text() == "keep"
