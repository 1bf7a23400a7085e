"""`hf-asyncpp plan` from a checkout: see hf_asyncpp/cli/plan.py."""
import sys

from hf_asyncpp.cli.plan import main

if __name__ == "__main__":
    sys.exit(main())
