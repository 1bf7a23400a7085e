"""``python -m hf_asyncpp COMMAND ...``: the ``hf-asyncpp`` command."""
import sys

from .cli import run

sys.exit(run())
