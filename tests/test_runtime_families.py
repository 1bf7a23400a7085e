"""The pipeline executor on families the stage builder once refused: an SSM (Mamba, tied embeddings), per-layer
embeddings carried between stages (Gemma-3n), ALiBi computed by the base model (Falcon) and a transformer block
shared by layers on two stages (Zamba: held on both, gradients summed), against the same single-process reference
as tests/test_runtime.py."""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from test_runtime import _check, _scenario, pipeline_worker

MAMBA = {"model_type": "mamba", "hidden_size": 32, "num_hidden_layers": 4, "vocab_size": 128, "state_size": 8,
         "tie_word_embeddings": True}
GEMMA3N = {"model_type": "gemma3n_text", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 128,
           "vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 8, "num_kv_shared_layers": 0,
           "max_position_embeddings": 64, "sliding_window": 8}
FALCON = {"model_type": "falcon", "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
          "vocab_size": 128, "alibi": True, "bias": True}
# hybrid layers 1 and 3 run one shared block: with 2 stages each holds a copy (as with the tied embeddings)
ZAMBA = {"model_type": "zamba", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 128, "mamba_d_state": 8,
         "layers_block_type": ["linear_attention", "hybrid"] * 2, "max_position_embeddings": 64}
FAMILIES = {"mamba": MAMBA, "gemma3n_text": GEMMA3N, "falcon": FALCON, "zamba": ZAMBA}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_stages_are_exact(name):
    """In one process first: the chained stages give the model's loss (cheap, and names the family that fails)."""
    from hf_asyncpp.modeling import build_model
    from hf_asyncpp.partition import check_partition, partition_model
    from test_runtime import make_recipe

    torch.manual_seed(0)
    model = build_model(make_recipe(FAMILIES[name], "1f1b", 2, 2, 2).model)
    check_partition(model, partition_model(model, 2, check=False))


RUNS = [(MAMBA, "1f1b", 2, 2, 2, "adamw", False), (MAMBA, "2bw", 2, 2, 2, "adamw", True),
        (GEMMA3N, "gpipe", 2, 2, 2, "adamw", False), (GEMMA3N, "2bw", 2, 2, 2, "adamw", False),
        (FALCON, "1f1b", 2, 3, 2, "adamw", False), (FALCON, "pipedream", 2, 1, 2, "adamw", False),
        (ZAMBA, "gpipe", 2, 2, 2, "adamw", False)]


def test_new_families_match_single_process_reference(tmp_path):
    scenarios = [_scenario(*s, seed=200 + i) for i, s in enumerate(RUNS)]
    results = run_distributed(pipeline_worker, 2, [(s[0], s[1]) for s in scenarios])
    _check(scenarios, results[0], export_dir=tmp_path)
