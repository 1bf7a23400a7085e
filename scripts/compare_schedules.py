"""`hf-asyncpp compare` from a checkout: see hf_asyncpp/cli/compare.py."""
import sys

from hf_asyncpp.cli.compare import main

if __name__ == "__main__":
    sys.exit(main())
