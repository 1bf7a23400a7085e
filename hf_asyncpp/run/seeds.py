"""Randomness of a run: the seed every rank starts from, each stage and replica its own stream, and the RNG
state a checkpoint carries."""
from __future__ import annotations

import hashlib
import random

import torch


def set_seed(seed: int) -> None:
    """Python's and torch's generators (torch.manual_seed also seeds every CUDA device)."""
    random.seed(seed)
    torch.manual_seed(seed)


def rank_seed(seed: int, stage: int, dp_rank: int) -> int:
    """The seed of one rank's random stream (dropout and any other draw after the model is built).

    Every rank builds the model from ``training.seed`` (so all start from the same weights); after that, stage s of
    data-parallel replica r draws from its own stream, or every stage and replica would draw the same dropout masks.
    Stage 0 of replica 0 keeps ``seed`` itself, so a single-process run is what it always was; the others get a
    hash of (seed, stage, replica). A run is reproducible for a given topology (not across topologies: a different
    split draws different masks, as different hardware would)."""
    if stage == 0 and dp_rank == 0:
        return seed
    digest = hashlib.sha256(f"hf_asyncpp/{seed}/stage{stage}/dp{dp_rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def rng_state() -> dict:
    """This rank's generators: Python's, torch's CPU one and, where CUDA is available, the current device's."""
    state = {"python": list(random.getstate()[1]), "python_pos": random.getstate()[2], "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():  # a CPU checkpoint resumed on a GPU keeps the seeded state
        torch.cuda.set_rng_state(state["cuda"])
