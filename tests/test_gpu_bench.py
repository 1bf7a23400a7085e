"""The GPU bench's own checks pass: ``bench/check_gpu.py`` runs bench/gpu.py's CPU mode (every part at a tiny size)
and its pure parts (the trace analysis, a failing part kept as a row). They run as the command a developer types, so
the suite never imports the bench."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HANG_GUARD_S = 3600  # only a check that hangs reaches it; the checks take 1-3 minutes on a quiet 2-core machine


def test_the_gpu_bench_checks_pass():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "bench/check_gpu.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    assert " passed" in r.stdout and " failed" not in r.stdout, r.stdout[-2000:]
