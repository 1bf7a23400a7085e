"""Export a training checkpoint to a standard Hugging Face folder with a model card.

    hf-asyncpp export runs/cpu-tiny/checkpoint-0000300 out/cpu-tiny
    hf-asyncpp export runs/cpu-tiny/checkpoint-0000300 --out out/cpu-tiny      (the same: every tool's --out DIR)

The checkpoint holds model.safetensors or stage-XX.safetensors (original HF names), config.json,
tokenizer/ and optionally recipe.yaml and run_state.json; the card takes the training setup from
them and the last evaluation from the run's metrics.jsonl (see hf_asyncpp.model_card). The arguments are read before
torch and transformers are imported (seconds), so a mistake in them answers at once.
"""
import argparse
import sys
from pathlib import Path

from ..errors import CheckpointError, WriteError


def check_replaceable(out: Path, state, config) -> None:
    """``out`` is empty, absent, or holds this checkpoint's own weights (an export repeated: replacing it loses
    nothing). Any other model folder (another run's ``export/``, a downloaded model) is refused unless
    ``--overwrite``: the command used to replace it without a word, its shards, index and card with it, where
    ``save_pretrained`` users choose the folder they replace. The run's own end-of-training export does not come
    here (``run.evaluator`` writes its ``export/``)."""
    from ..model.export import holds_model  # see main()

    if not out.is_dir() or not any(out.iterdir()) or holds_model(out, state, config):
        return
    if not (out / "config.json").is_file():
        return  # not a model folder: export_hf_model refuses it, with its own line, whatever the flag
    names = sorted(p.name for p in out.iterdir())
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    raise ValueError(f"export: {out} holds another model ({shown}), which this export would replace; choose another "
                     "folder, or pass --overwrite to replace it")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hf-asyncpp export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a checkpoint-* folder of a run")
    ap.add_argument("out", nargs="?", default=None, metavar="OUT",
                    help="the Hugging Face folder to write, created if missing (or --out DIR)")
    ap.add_argument("--out", dest="out_flag", default=None, metavar="DIR", help="the same as OUT")
    ap.add_argument("--max-shard-size", default="2GB", help="split safetensors shards above this size (e.g. 500MB)")
    ap.add_argument("--model-id", default=None, help="Hub id for the card title and the usage snippet")
    ap.add_argument("--unverified", action="store_true",
                    help="export a folder without manifest.json (hand-assembled) unverified; refused otherwise")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace OUT when it holds another model (refused otherwise; a folder that is no model is "
                         "never replaced)")
    args = ap.parse_args(argv)
    if args.out and args.out_flag and args.out != args.out_flag:
        ap.error(f"two output folders, {args.out} and --out {args.out_flag}: give one")
    args.out = args.out or args.out_flag
    if not args.out:
        ap.error("give the output folder: OUT or --out DIR")
    # imported here, after the arguments: they import torch and transformers
    from ..model.export import export_hf_model, load_checkpoint_state
    from ..run.folder import checkpoints_near
    from ..run.model_card import card_from_checkpoint, card_writer

    if not Path(args.checkpoint).is_dir():
        what = "no such folder" if not Path(args.checkpoint).exists() else "a file, not a checkpoint folder"
        print(f"error: {args.checkpoint}: {what}; {checkpoints_near(args.checkpoint)}", file=sys.stderr)
        return 1
    try:
        state, config, tok = load_checkpoint_state(args.checkpoint, unverified=args.unverified)
        if not args.overwrite:
            check_replaceable(Path(args.out), state, config)
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
