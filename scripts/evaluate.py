"""Perplexity of an exported (or any AutoModelForCausalLM) folder on local text/jsonl/parquet files.

    python scripts/evaluate.py runs/cpu-tiny/export --data data/sotu/eval-00-of-01.jsonl [--seq-len 128] [--max-blocks 64] [--out ppl.json]
"""
import argparse
import json
import os
import sys

sys.path[0] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")  # repo root, not scripts/ (scripts/evaluate.py would shadow `evaluate`)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--data", nargs="+", required=True, help="files or globs")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--max-blocks", type=int, default=64)
    ap.add_argument("--text-column", default="text")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--out", default=None, help="JSON results (default: MODEL_DIR/eval_results.json)")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from hf_asyncpp.config import DataConfig
    from hf_asyncpp.data import eval_blocks, expand_files
    from hf_asyncpp.evaluation import evaluate_model_dir

    for needed in ("config.json",):
        if not os.path.exists(os.path.join(args.model_dir, needed)):
            sys.exit(f"error: {args.model_dir} has no {needed}; is it a model folder?")
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    cfg = DataConfig(seq_len=args.seq_len, text_column=args.text_column, shuffle_buffer=0, min_document_tokens=0)
    blocks = eval_blocks(cfg, tok, expand_files(args.data, "--data"), args.max_blocks)
    res = evaluate_model_dir(args.model_dir, blocks, args.batch_size)
    res.update(model_dir=args.model_dir, data=args.data, seq_len=args.seq_len, blocks=len(blocks))
    out = args.out or os.path.join(args.model_dir, "eval_results.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"{args.model_dir}: eval_loss {res['eval_loss']:.4f} perplexity {res['eval_ppl']:.2f} over {res['num_tokens']} tokens -> {out}")


if __name__ == "__main__":
    main()
