"""ZeRO-1 across the data-parallel replicas of a stage (``optimizer.shard_across_replicas``): who owns which tensor,
and the optimizer state of the owners (each replica's own checkpoint file) put back together when a checkpoint is
loaded.

A replica owns whole tensors, so Muon orthogonalises a matrix on one replica only. Owners are contiguous runs of the
stage's parameters in their order, balanced by size: the gradient buckets, laid out in that order (reversed), then
change owner at most dp - 1 times. A tensor several stages hold (a tied head) is owned by replica 0 on each of them,
so the replicas that sum its gradient across stages (``Groups.ties``, one group per replica) are its owners.
"""
from __future__ import annotations

import torch


def assign_owners(sizes: dict[str, int], dp: int, tied: set[str] = frozenset()) -> dict[str, int]:
    """Replica (0..dp-1) owning each name of ``sizes`` (in the stage's parameter order); ``tied`` names: replica 0."""
    order = [n for n in sizes if n in tied] + [n for n in sizes if n not in tied]
    total = sum(sizes.values()) or 1
    owners, done = {}, 0
    for n in order:
        owners[n] = 0 if n in tied else min(dp - 1, int((done + sizes[n] / 2) * dp / total))
        done += sizes[n]
    return owners


def merge_optimizer_states(parts: list[dict], ef_key: str) -> dict:
    """One optimizer state dict from the replicas' (each holds the state of the tensors it owns; same groups)."""
    merged = dict(parts[0])
    merged["state"] = {i: st for part in parts for i, st in part["state"].items()}
    if ef_key in merged:
        merged[ef_key] = dict(merged[ef_key])
        merged[ef_key]["prev"] = {i: t for part in parts for i, t in (part[ef_key].get("prev") or {}).items()}
    return merged


def keep_owned(optimizer: torch.optim.Optimizer, owned: set, ef_key: str) -> None:
    """Drop the optimizer and error-feedback state of the tensors this replica does not own (after a full load)."""
    for p in [p for p in optimizer.state if p not in owned]:
        del optimizer.state[p]
    ef = getattr(optimizer, ef_key, None)
    if ef:
        for p in [p for p in ef["prev"] if p not in owned]:
            del ef["prev"][p]
