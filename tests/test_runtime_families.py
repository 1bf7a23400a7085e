"""The pipeline executor on families the stage builder once refused: an SSM (Mamba, tied embeddings), per-layer
embeddings carried between stages (Gemma-3n), ALiBi computed by the base model (Falcon) and a transformer block
shared by layers on two stages (Zamba: held on both, gradients summed), against the same single-process reference
as tests/test_runtime.py."""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from support import GEMMA3N, ZAMBA, check_against_reference, make_recipe, pipeline_worker, scenario

MAMBA = {"model_type": "mamba", "hidden_size": 32, "num_hidden_layers": 4, "vocab_size": 128, "state_size": 8,
         "tie_word_embeddings": True}
FALCON = {"model_type": "falcon", "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
          "vocab_size": 128, "alibi": True, "bias": True}
FAMILIES = {"mamba": MAMBA, "gemma3n_text": GEMMA3N, "falcon": FALCON, "zamba": ZAMBA}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_stages_are_exact(name):
    """In one process first: the chained stages give the model's loss (cheap, and names the family that fails)."""
    from hf_asyncpp.model.build import build_model
    from hf_asyncpp.partition import check_partition, partition_model

    torch.manual_seed(0)
    model = build_model(make_recipe(FAMILIES[name], "1f1b", 2, 2, 2).model)
    check_partition(model, partition_model(model, 2, check=False))


RUNS = [(MAMBA, "1f1b", 2, 2, 2, "adamw", False), (MAMBA, "2bw", 2, 2, 2, "adamw", True),
        (GEMMA3N, "gpipe", 2, 2, 2, "adamw", False), (GEMMA3N, "2bw", 2, 2, 2, "adamw", False),
        (FALCON, "1f1b", 2, 3, 2, "adamw", False), (FALCON, "pipedream", 2, 1, 2, "adamw", False),
        (ZAMBA, "gpipe", 2, 2, 2, "adamw", False)]


def test_new_families_match_single_process_reference(tmp_path):
    scenarios = [scenario(*s, seed=200 + i) for i, s in enumerate(RUNS)]
    results = run_distributed(pipeline_worker, 2, [(s[0], s[1]) for s in scenarios])
    check_against_reference(scenarios, results[0], export_dir=tmp_path)
