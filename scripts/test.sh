#!/usr/bin/env bash
# The README's test command: the same set-up, then the test suite.
HF_ASYNCPP_EXTRAS=test source "$(dirname "$0")/setup_env.sh"
python scripts/prepare_data.py
exec python -m pytest -q tests "$@"
