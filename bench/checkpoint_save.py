"""How long a save stalls the training thread: the asynchronous save (stage, then train on while the background
writer writes) against the same save waited for until committed (what a synchronous save blocks: stage, serialize,
sha256, write, fsync, manifest, rename), side by side in one training run.

    python -m bench.checkpoint_save [--saves 8] [--hidden 384] [--layers 6] [--write]

One process trains a Llama of the given size (AdamW, the fixture corpus) and saves every 2 steps; the saves alternate
between the two ways, so both meet the same machine load. Each is timed on the training thread from the call to its
return, after the previous save's write is finished (not counted for either: at most one save is in flight, and a
steady run whose saves are further apart than a write never waits). The manifest's per-save counts give what the
training thread staged and wrote (``save`` in ``manifest.json``). CPU times are not targets: the ratio is the figure;
the bytes the training thread writes (0) are the count the tests hold. The waited-for save is a lower bound of a
synchronous save as the project made it before (the same serialize, hash, write and commit on the training thread,
plus a second host copy and the gathers through one rank). ``--write`` replaces the ``checkpoint-save``
section of docs/benchmarks/parts.md.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from hf_asyncpp.config.recipe import recipe_from_dict
from hf_asyncpp.run import checkpointer as ck
from hf_asyncpp.run.trainer import train
from hf_asyncpp.storage import checkpoint_io as ckpt
from hf_asyncpp.storage.names import checkpoint_name

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "sotu_slice.jsonl"


def recipe(out: Path, saves: int, hidden: int, layers: int) -> dict:
    return {
        "model": {"config": {"model_type": "llama", "hidden_size": hidden, "intermediate_size": 4 * hidden,
                             "num_attention_heads": 8, "num_key_value_heads": 8, "num_hidden_layers": layers,
                             "tie_word_embeddings": False}, "vocab_size": 2000},
        "data": {"train_files": [str(FIXTURE)], "eval_files": [str(FIXTURE)], "seq_len": 32, "eval_blocks": 2},
        "pipeline": {"schedule": "none", "num_stages": 1, "num_microbatches": 1, "microbatch_size": 2},
        "optimizer": {"name": "adamw", "learning_rate": 1e-3},
        "training": {"output_dir": str(out), "max_steps": 2 * saves, "save_steps": 2, "logging_steps": 2,
                     "report_to": [], "export": False, "save_total_limit": 2},
    }


def measure(saves: int, hidden: int, layers: int) -> dict:
    """Blocked seconds of each save, by way, and what the training thread staged and wrote."""
    blocked: dict[str, list[float]] = {"async": [], "waited": []}
    staged, wrote, sizes = [], [], []
    original = ck.Checkpointer.save

    def timed(self, state, engine, stream):
        self.finish()  # the previous save's write: counted for neither way
        way = "async" if len(blocked["async"]) <= len(blocked["waited"]) else "waited"
        began = time.perf_counter()
        final = original(self, state, engine, stream)
        if way == "waited":
            self.finish()
        blocked[way].append(time.perf_counter() - began)
        return final

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        ck.Checkpointer.save = timed
        try:
            train(recipe_from_dict(recipe(out, saves, hidden, layers)))
        finally:
            ck.Checkpointer.save = original
        for step in (2 * saves - 2, 2 * saves):  # the last two are kept (save_total_limit)
            manifest = ckpt.load_json(out / checkpoint_name(step) / "manifest.json")
            [counts] = manifest["save"]
            staged.append(counts["staged_bytes"])
            wrote.append(counts["training_thread_bytes"])
            sizes.append(sum(f["size"] for f in manifest["files"].values()))
    return {"blocked": blocked, "staged": max(staged), "wrote": max(wrote), "size": max(sizes)}


def table(res: dict, hidden: int, layers: int) -> str:
    a, w = (statistics.median(res["blocked"][k]) for k in ("async", "waited"))
    return "\n".join([
        f"Training-thread time blocked per save, one process, a {layers}-layer Llama of hidden size {hidden} (AdamW): "
        f"checkpoint {res['size'] / 1e6:.0f} MB, {len(res['blocked']['async'])} + {len(res['blocked']['waited'])} "
        f"saves alternating in one run (`python -m bench.checkpoint_save --write`, {time.strftime('%Y-%m-%d')}).",
        "",
        "| save | blocked per save (median) | bytes the training thread staged | bytes it serialized, hashed or wrote |",
        "|---|---|---|---|",
        f"| asynchronous (stage, then the background writer) | {a * 1000:.0f} ms | {res['staged'] / 1e6:.0f} MB | "
        f"{res['wrote']} |",
        f"| the same save waited for to its commit (synchronous) | {w * 1000:.0f} ms | {res['staged'] / 1e6:.0f} MB | "
        f"(all {res['size'] / 1e6:.0f} MB, through the writer) |",
        "",
        f"Ratio: the asynchronous save blocks the training thread **{w / a:.1f}x** less than the synchronous one "
        "(a 2-core CPU shared with other work: the ratio, not the milliseconds, is the figure; on a GPU the staging "
        "is a device-to-pinned copy). The synchronous row is a lower bound of the save the asynchronous one "
        "replaced, which did the same work on the training thread and besides copied the state to the host twice "
        "and gathered ZeRO-1's optimizer state and every data position through one rank.",
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--saves", type=int, default=8, help="saves in all (half each way)")
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--write", action="store_true", help="replace the checkpoint-save section of docs/benchmarks/parts.md")
    args = ap.parse_args()
    text = table(measure(args.saves, args.hidden, args.layers), args.hidden, args.layers)
    print(text)
    if args.write:
        from .report import write_section

        print(write_section("checkpoint-save", text))


if __name__ == "__main__":
    main()
