"""Export a training checkpoint to a standard Hugging Face folder with a model card.

    python scripts/export.py runs/cpu-tiny/checkpoint-0000300 out/cpu-tiny
"""
import argparse
import json
import os
import sys
from pathlib import Path

sys.path[0] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")  # repo root, not scripts/ (scripts/evaluate.py would shadow `evaluate`)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--max-shard-size", default="2GB")
    args = ap.parse_args()
    from hf_asyncpp.export import export_hf_model, load_checkpoint_state

    state, config, tok = load_checkpoint_state(args.checkpoint)
    card = {}
    meta = Path(args.checkpoint) / "trainer_state.json"
    if meta.exists():
        info = json.loads(meta.read_text())
        card.update(steps=info.get("step"), tokens=info.get("tokens"))
    recipe_path = Path(args.checkpoint) / "recipe.yaml"
    if recipe_path.exists():
        from hf_asyncpp.config import load_recipe

        r = load_recipe(recipe_path)
        card.update(schedule=r.pipeline.schedule, num_stages=r.pipeline.num_stages, num_microbatches=r.pipeline.num_microbatches,
                    microbatch_size=r.pipeline.microbatch_size, optimizer=r.optimizer.name, learning_rate=r.optimizer.learning_rate,
                    delay_correction=r.optimizer.delay_correction, simulate_delay=r.optimizer.simulate_delay, seq_len=r.data.seq_len)
    out = export_hf_model(state, config, args.out, tokenizer=tok, card=card, max_shard_size=args.max_shard_size)
    print(f"exported {args.checkpoint} -> {out}")


if __name__ == "__main__":
    main()
