"""One run per output folder: the lock a run's main process holds, refused by name while held, free once its
holder has ended whatever the way (nothing to clean up), and never followed through a link."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from hf_asyncpp.errors import RecipeError
from hf_asyncpp.storage.write import lock_output_dir, unlock_output_dir
from hf_asyncpp.storage.names import RUN_LOCK
from support import ROOT


HOLDER = """
import sys
from pathlib import Path
from hf_asyncpp.storage.write import lock_output_dir
lock_output_dir(Path(sys.argv[1]))
print("locked", flush=True)
sys.stdin.read()
"""


def test_a_held_folder_is_refused_naming_its_holder_and_free_once_it_ends(tmp_path, caplog):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RecipeError, match=rf"training.output_dir: {tmp_path} is in use by another run \(pid "
                                              rf"{holder.pid} on .*\); wait for it to end"):
            lock_output_dir(tmp_path)
        holder.kill()  # no clean-up at all: the kernel releases the lock
        holder.wait(30)
        caplog.set_level(logging.INFO, logger="hf_asyncpp")
        lock_output_dir(tmp_path)
        assert f"the lock left by pid {holder.pid}" in caplog.text and "is free (that run ended without releasing it" in caplog.text
        assert f'"pid": {os.getpid()}' in (tmp_path / RUN_LOCK).read_text()
        lock_output_dir(tmp_path)  # this process already holds it: a second run here goes on
        unlock_output_dir(tmp_path)
        assert (tmp_path / RUN_LOCK).read_text() == ""  # released: the next run has no holder to name
    finally:
        if holder.poll() is None:
            holder.kill()
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
