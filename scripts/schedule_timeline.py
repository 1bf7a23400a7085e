"""`hf-asyncpp timeline` from a checkout: see hf_asyncpp/cli/timeline.py."""
import sys

from hf_asyncpp.cli.timeline import main

if __name__ == "__main__":
    sys.exit(main())
