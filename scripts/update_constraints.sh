#!/usr/bin/env bash
# Write constraints.txt from an environment the suite just passed in: by default .venv-latest, the newest releases
# that `bash scripts/test.sh --latest` installed. Meeting a new release on purpose:
#   bash scripts/test.sh --latest && bash scripts/update_constraints.sh
# then regenerate docs/supported-models.md with the new transformers and commit the three together.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$ROOT/.venv-latest}"
[ -x "$VENV/bin/python" ] || { echo "error: no environment at $VENV: run 'bash scripts/test.sh --latest' first" >&2; exit 1; }
{
  echo "# The exact versions the test suite passed with: every install of scripts/setup_env.sh (the README's two"
  echo "# commands, CI) is constrained by this file. setup.py's ranges start at tested versions."
  echo "# Test against the newest releases: bash scripts/test.sh --latest"
  echo "# Then pin them: bash scripts/update_constraints.sh (written from $(basename "$VENV"), $(date -u +%Y-%m-%d))"
  # torch without its local label (+cpu): the same pin takes the CPU wheel here and the CUDA build on a GPU machine
  "$VENV/bin/python" -m pip freeze --all --exclude-editable | grep -v -i "^hf[-_]asyncpp" | sed -E 's/^(torch==[^+]*)\+.*/\1/'
} > "$ROOT/constraints.txt.tmp"
mv "$ROOT/constraints.txt.tmp" "$ROOT/constraints.txt"
echo "wrote $ROOT/constraints.txt ($(grep -c '==' "$ROOT/constraints.txt") packages)"
