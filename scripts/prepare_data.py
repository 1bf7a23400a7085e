"""`hf-asyncpp prepare-data` from a checkout: see hf_asyncpp/cli/prepare_data.py."""
import sys

from hf_asyncpp.cli.prepare_data import main

if __name__ == "__main__":
    sys.exit(main())
