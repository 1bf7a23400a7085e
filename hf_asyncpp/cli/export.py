"""Export a training checkpoint to a standard Hugging Face folder with a model card.

    hf-asyncpp export runs/cpu-tiny/checkpoint-0000300 out/cpu-tiny

The checkpoint holds model.safetensors or stage-XX.safetensors (original HF names), config.json,
tokenizer/ and optionally recipe.yaml and run_state.json; the card takes the training setup from
them and the last evaluation from the run's metrics.jsonl (see hf_asyncpp.model_card).
"""
import argparse
import sys

from ..errors import CheckpointError, WriteError
from ..model.export import export_hf_model, load_checkpoint_state
from ..run.model_card import card_from_checkpoint, card_writer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hf-asyncpp export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--max-shard-size", default="2GB", help="split safetensors shards above this size (e.g. 500MB)")
    ap.add_argument("--model-id", default=None, help="Hub id for the card title and the usage snippet")
    ap.add_argument("--unverified", action="store_true",
                    help="export a folder without manifest.json (hand-assembled) unverified; refused otherwise")
    args = ap.parse_args(argv)
    try:
        state, config, tok = load_checkpoint_state(args.checkpoint, unverified=args.unverified)
        card = card_from_checkpoint(args.checkpoint)
        if args.model_id:
            card["model_id"] = args.model_id
        out = export_hf_model(state, config, args.out, tokenizer=tok, card=card_writer(card),
                              max_shard_size=args.max_shard_size)
    except (FileNotFoundError, ValueError, KeyError, CheckpointError, WriteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"exported {args.checkpoint} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
