"""``python -m hf_asyncpp COMMAND ...``: the ``hf-asyncpp`` command."""
import sys

from .cli import main

sys.exit(main())
