"""The data path, per process: blocks/s packed from local files and from a streamed dataset (a local dataset folder
standing in for a Hub one), the time a resume takes to reach a deep position, and the stage-0 stall per step (the
time the training thread waits for its batch) with batches packed inline against packed ahead by the prefetch
worker, around a real forward/backward of the default recipe's model.

    python -m bench.data_path [--blocks 3000] [--steps 12] [--write]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hf_asyncpp.config.recipe import load_recipe
from hf_asyncpp.config.sections import DataConfig
from hf_asyncpp.data.corpus import prepare_default_corpus
from hf_asyncpp.data.sources import iter_documents
from hf_asyncpp.data.stream import BlockStream
from hf_asyncpp.model.build import build_model
from hf_asyncpp.data.prefetch import Prefetcher
from hf_asyncpp.data.tokenizer import load_or_train_tokenizer

ROOT = Path(__file__).resolve().parent.parent


def rate(stream, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        next(stream)
    return n / (time.perf_counter() - t0)


def resume_seconds(make, n: int) -> float:
    """Seconds from loading the position after ``n`` blocks to the next block."""
    s = make()
    for _ in range(n):
        next(s)
    state = json.loads(json.dumps(s.state_dict()))
    t0 = time.perf_counter()
    r = make()
    r.load_state_dict(state)
    next(r)
    return time.perf_counter() - t0


def stalls(make, model, recipe, steps: int, depth: int) -> tuple[float, float]:
    """(mean stall per step, mean step time) in seconds, the first step (an empty queue) left out."""
    rp = recipe.pipeline
    feed = Prefetcher(make(), rp.num_microbatches, rp.microbatch_size, depth)
    times = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            batch = next(feed)
            for ids in batch:
                model(input_ids=ids, labels=ids).loss.backward()
            times.append(time.perf_counter() - t0)
    finally:
        feed.close()
    return statistics.mean(feed.waits[1:]), statistics.mean(times[1:])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=3000)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)  # as in a launched run (one thread per process)
    recipe = load_recipe(str(ROOT / "recipes" / "cpu-tiny.yaml"))
    tmp = Path(tempfile.mkdtemp(prefix="data_path_"))
    train, _ = prepare_default_corpus(str(ROOT / "data" / "sotu"))
    tok = load_or_train_tokenizer(recipe.model, train, "text", tmp / "tokenizer")
    folder = tmp / "hub_like"  # the same documents as a dataset folder, streamed by load_dataset(folder)
    folder.mkdir()
    docs = list(iter_documents(train))
    for i in range(4):
        (folder / f"part-{i}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[i::4]))
    cfg = recipe.data
    streamed = DataConfig(dataset=str(folder), seq_len=cfg.seq_len, shuffle_buffer=cfg.shuffle_buffer)
    sources = {"local files": lambda: BlockStream(cfg, tok, train, seed=0),
               "streamed dataset": lambda: BlockStream(streamed, tok, None, seed=0)}
    rows = []
    for name, make in sources.items():
        rate(make(), 50)  # warm: file caches, builder resolution
        rows.append((name, rate(make(), args.blocks), resume_seconds(make, args.blocks)))
    model = build_model(recipe.model, tok)
    model.train()
    inline = stalls(sources["local files"], model, recipe, args.steps, 0)
    ahead = stalls(sources["local files"], model, recipe, args.steps, recipe.data.prefetch_batches)
    rp = recipe.pipeline
    per_step = rp.num_microbatches * rp.microbatch_size
    lines = [f"Per process, 1 torch thread, seq_len {cfg.seq_len}, shuffle_buffer {cfg.shuffle_buffer}, the default "
             f"corpus ({len(docs)} documents) and the cpu-tiny tokenizer ({len(tok)} tokens).", "",
             f"| source | blocks/s | tokens/s | resume at block {args.blocks} (s) |", "|---|---|---|---|"]
    lines += [f"| {n} | {r:,.0f} | {r * cfg.seq_len:,.0f} | {s:.3f} |" for n, r, s in rows]
    lines += ["", f"Stage-0 stall per step ({per_step} blocks a step; the cpu-tiny model's forward+backward of the whole "
              f"model on one thread stands in for the stage's work; mean of {args.steps - 1} steps after the first):", "",
              "| batches | stall per step (ms) | step (ms) |", "|---|---|---|",
              f"| packed inline (`data.prefetch_batches: 0`) | {inline[0] * 1e3:.1f} | {inline[1] * 1e3:.0f} |",
              f"| packed ahead (`data.prefetch_batches: {recipe.data.prefetch_batches}`) | {ahead[0] * 1e3:.2f} | "
              f"{ahead[1] * 1e3:.0f} |"]
    text = "\n".join(lines)
    print(text)
    if args.write:
        from .report import write_section

        write_section("data-path", "## Data path: blocks/s per process and the stage-0 stall\n\n"
                      f"Command: `python -m bench.data_path --blocks {args.blocks} --steps {args.steps} --write` "
                      f"({time.strftime('%Y-%m-%d')}; CPU)\n\n{text}")


if __name__ == "__main__":
    main()
