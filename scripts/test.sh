#!/usr/bin/env bash
# The README's test command: the same set-up, then the test suite. Arguments go to pytest.
# --latest (first argument): the newest releases of every dependency instead of constraints.txt's pins, in
# .venv-latest (see scripts/setup_env.sh), so a new release is met on purpose.
if [ "${1:-}" = "--latest" ]; then
  shift
  export HF_ASYNCPP_LATEST=1
fi
HF_ASYNCPP_EXTRAS=test source "$(dirname "$0")/setup_env.sh"
python scripts/prepare_data.py
# two workers (pytest-xdist): most tests use one core, so on a 2-core machine the suite takes about 10 minutes
# instead of 14; HF_ASYNCPP_TEST_WORKERS=0 runs it in this process (or pass -n 0)
exec python -m pytest -q -n "${HF_ASYNCPP_TEST_WORKERS:-2}" --dist worksteal tests "$@"
