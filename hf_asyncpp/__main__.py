"""``python -m hf_asyncpp COMMAND ...``: the ``hf-asyncpp`` command."""
import sys

from hf_asyncpp.cli import main

sys.exit(main())
