"""`hf-asyncpp export` from a checkout: see hf_asyncpp/cli/export.py."""
import sys

from hf_asyncpp.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
