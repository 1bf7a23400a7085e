"""`hf-asyncpp evaluate` from a checkout: see hf_asyncpp/cli/evaluate.py (not named evaluate.py: a script's
folder comes first on sys.path, and a scripts/evaluate.py would shadow the `evaluate` library)."""
import sys

from hf_asyncpp.cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
