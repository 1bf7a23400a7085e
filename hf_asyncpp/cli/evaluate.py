"""Evaluate exported (or any AutoModelForCausalLM) folders: zero-shot tasks by lm-evaluation-harness (its HFLM on
each folder; pip install hf_asyncpp[eval]) and perplexity, several models side by side.

    hf-asyncpp evaluate runs/sync/export runs/async/export --tasks hellaswag,piqa,arc_easy,mmlu --limit 500
    hf-asyncpp evaluate runs/cpu-tiny/export --data data/sotu/eval-00-of-01.jsonl            # perplexity
    hf-asyncpp evaluate MODEL --tasks arc_easy --task-file arc_easy=my_arc.jsonl               # local task data
    hf-asyncpp evaluate MODEL --tasks mmlu,hellaswag --device cuda:0                          # on a GPU

Prints a table and writes everything into one folder, --out (default: a new eval-YYYYMMDD-HHMMSS folder in the
current directory): eval_results.json, eval_results.png (a bar chart of the tasks) and, unless --no-card, each
model's card with the results added (NAME/README.md, to publish with the model). It writes nothing into the folders
it scores (an --out inside one is refused) and never through a symbolic link: a Hugging Face cache snapshot is a
folder of links into blobs that other snapshots share. The arguments are read before torch and transformers are
imported (seconds), so a mistake in them answers at once.
"""
import argparse
import sys
from datetime import datetime
from pathlib import Path

from . import at_least
from ..config.sections import DataConfig
from ..errors import DataError
from ..data.files import expand_files, screen_files
from ..storage.write import json_text, replace_file, write_file


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hf-asyncpp evaluate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dirs", nargs="+")
    ap.add_argument("--tasks", default=None, help="comma-separated lm-eval task or group names (hellaswag, piqa, "
                    "arc_easy, arc_challenge, mmlu, mmlu_<subject>, ...) and perplexity")
    ap.add_argument("--task-file", action="append", default=[], help="TASK=FILE: local data in the Hub record format")
    ap.add_argument("--limit", type=at_least(1), default=None, help="first documents per task, as lm-eval's --limit (per MMLU subject)")
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: the current GPU if there is one, else the CPU)")
    ap.add_argument("--data", nargs="+", default=None, help="text/jsonl/parquet files or globs for perplexity")
    ap.add_argument("--seq-len", type=at_least(2), default=128)
    ap.add_argument("--max-blocks", type=at_least(1), default=64)
    ap.add_argument("--text-column", default="text")
    ap.add_argument("--batch-size", type=at_least(1), default=8, help="starting batch size; halved on an out-of-memory error")
    ap.add_argument("--out", default=None, metavar="DIR", help="the folder for the results, created if missing: eval_results.json, "
                    "eval_results.png and each model's card with the results (NAME/README.md); never inside a folder "
                    "it scores (default: a new eval-YYYYMMDD-HHMMSS folder in the current directory)")
    ap.add_argument("--names", default=None, help="comma-separated column and legend names, one per model (default: "
                    "each folder's name, with parent folders where two would read the same)")
    ap.add_argument("--no-card", action="store_true", help="do not write the models' cards with the results into --out")
    args = ap.parse_args(argv)
    tasks = args.tasks.split(",") if args.tasks else (["perplexity"] if args.data else [])
    if not tasks:
        ap.error("give --tasks or --data")
    try:
        task_files = dict(tf.split("=", 1) for tf in args.task_file)
    except ValueError:
        ap.error("--task-file takes TASK=FILE")
    # imported here, after the arguments: they import torch and transformers
    from ..data.stream import eval_blocks
    from ..eval.downstream import check_model_dir, evaluate_models, model_names, plot_results, results_table
    from ..run.model_card import add_eval_results

    names = args.names.split(",") if args.names else model_names(args.model_dirs)
    if len(names) != len(args.model_dirs) or len(set(names)) != len(names):
        ap.error(f"--names: give {len(args.model_dirs)} distinct names, one per model")
    problem = out_problem(args.out, args.model_dirs)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    blocks, counts = None, []
    try:
        for d in args.model_dirs:
            check_model_dir(d)
        if "perplexity" in tasks:
            if not args.data:
                ap.error("task perplexity needs --data FILES")
            cfg = DataConfig(seq_len=args.seq_len, text_column=args.text_column, shuffle_buffer=0, min_document_tokens=0)
            files = expand_files(args.data, "--data")
            usable, _, skipped = screen_files(files, args.text_column)
            if not usable:  # said once, in this command's own flags (the screening speaks of the recipe's fields)
                reasons = "; ".join(skipped.values()).replace("data.text_column", "--text-column")
                raise DataError(f"--data: no usable file: {reasons}")

            def blocks(tokenizer):  # each model reads the text through its own tokenizer
                counts.append(len(ids := eval_blocks(cfg, tokenizer, files, args.max_blocks)))
                return ids
        results = evaluate_models(args.model_dirs, tasks, task_files=task_files, limit=args.limit, perplexity_blocks=blocks,
                                  batch_size=args.batch_size, device=args.device)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(results_table(results, names))
    out = Path(args.out) if args.out else new_folder(Path.cwd())
    single = len(args.model_dirs) == 1 and tasks == ["perplexity"]
    payload = {**results[args.model_dirs[0]]["perplexity"], "model_dir": args.model_dirs[0], "blocks": counts[0]} if single else results
    out.mkdir(parents=True, exist_ok=True)
    data = json_text(payload, indent=1).encode()
    replace_file(out / RESULTS, lambda tmp: write_file(tmp, lambda f: f.write(data)))
    if any(t != "perplexity" for t in tasks):
        print(f"chart: {replace_file(out / CHART, lambda tmp: plot_results(results, tmp, names))}")
    if not args.no_card:
        for (d, r), name in zip(results.items(), names):
            print(f"card: {add_eval_results(d, r, out / name.replace('/', '--'), task_files)}")
    print(f"results: {out}")
    return 0


RESULTS, CHART = "eval_results.json", "eval_results.png"


def out_problem(out: str | None, model_dirs: list[str]) -> str | None:
    """Why ``--out`` cannot be used, or None: it is a folder, and never one of the scored folders or inside one
    (links followed: a cache snapshot's files are links into its blobs)."""
    if out is None:
        return None
    if Path(out).suffix == ".json":
        return (f"--out {out}: --out is a folder (it gets {RESULTS}, {CHART} and the models' cards); give a "
                f"folder, e.g. --out {Path(out).with_suffix('')}")
    where = Path(out).resolve()
    for d in model_dirs:
        scored = Path(d).resolve()
        if where == scored or scored in where.parents:
            return (f"--out {out} is inside {d}, a folder it scores: evaluate writes nothing into what it reads; "
                    f"choose a folder beside it, e.g. --out {scored.name}-eval")
    return None


def new_folder(parent: Path) -> Path:
    """The default ``--out``: ``eval-YYYYMMDD-HHMMSS`` in ``parent`` (``-2``, ``-3``, ... when taken), created now,
    so that an evaluation never mixes its files with an earlier one's."""
    base = f"eval-{datetime.now():%Y%m%d-%H%M%S}"
    for n in range(1, 1000):
        path = parent / (base if n == 1 else f"{base}-{n}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"{parent}: {base} and 998 more are taken; give --out")


if __name__ == "__main__":
    sys.exit(main())
