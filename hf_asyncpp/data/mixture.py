"""A weighted mixture of sources: each training block is one source's documents, the source drawn by weight.

Each source (``data.sources``: a Hub dataset, builder or local files, with its own column, config and splits) is a
:class:`~hf_asyncpp.data.stream.BlockStream` of its own: its documents shuffled, tokenized and packed into
``seq_len`` blocks, its position exact. :class:`MixtureStream` draws, for every block, which source gives it: one
uniform of a generator seeded by ``(training.seed, mixture epoch)`` against the sources' normalised weights. So a
source's share of the training tokens is its weight (a block is ``seq_len`` tokens whichever source it comes from),
as Megatron's and NeMo's blends weigh their sources, and the draws are the same on every data-parallel replica: the
tokens each source gave the whole run are exactly the replicas' number times one replica's.

Why not ``datasets.interleave_datasets(probabilities=...)``, which draws documents by weight and has a
``state_dict``: (1) its weights are shares of *documents*, so a source of long documents takes more of the tokens
than its weight says, while a recipe's weights (SmolLM2's, OLMo's, every Megatron blend's) are shares of tokens;
(2) an interleaved example no longer says which source it came from, which the per-source counts and
``eval_loss/<source>`` need; (3) exact resume: each source's position here is the single-source stream's own
(epoch, document, token offset; local files re-read without tokenizing, a streamed dataset through its own shuffle
buffer, :mod:`hf_asyncpp.data.shuffle`), whereas resuming shuffled sources through datasets loses their shuffle
buffers ("examples from shuffle buffers are lost when resuming"). The mixture's own position is the number of draws
of its epoch (the generator is advanced there, ``PCG64.advance``, not replayed), which sources have run out, and
every source's position.

``data.stopping_strategy`` keeps ``interleave_datasets``' names for when a mixture's epoch ends: ``all_exhausted``
(a source that runs out starts its next epoch and keeps its weight, until every source has run out once),
``first_exhausted`` (at the first source that runs out) and ``all_exhausted_without_replacement`` (a source that
runs out leaves the draws, the others' weights renormalised, until all have). A source that runs out always goes on
with its next epoch, reshuffled, and one that has not goes on where it is: no source's documents are dropped at a
mixture epoch's end, and each source's blocks are, in order, those of its own stream read alone. A training stream
goes on with the next mixture epoch (its draws seeded anew); ``repeat=False`` stops at the end of the first.
"""
from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from ..config.sections import DataConfig
from ..errors import DataError
from .sources import resolve_data_files, train_hold_out
from .stream import BlockStream, eval_blocks

__all__ = ["Source", "MixtureStream", "resolve_sources", "source_eval_blocks", "source_counts", "source_seed"]

log = logging.getLogger("hf_asyncpp.data")


@dataclass
class Source:
    """One source of a mixture, resolved: its data section, normalised weight and local files (None: streamed)."""

    name: str
    cfg: DataConfig
    weight: float
    train_files: list[str] | None
    eval_files: list[str] | None


def resolve_sources(cfg: DataConfig) -> list[Source]:
    """The recipe's ``data.sources``, each with its files expanded (a pattern that matches nothing is an error)."""
    out = []
    for name, (c, weight) in cfg.source_configs().items():
        train, evals = resolve_data_files(c)
        out.append(Source(name, c, weight, train, evals))
    return out


def source_seed(seed: int, name: str) -> int:
    """A source's shuffle seed: its own order whatever the other sources are, the same in every run of the recipe."""
    return seed + zlib.crc32(name.encode("utf-8"))


def source_eval_blocks(sources: list[Source], tokenizer, n_blocks: int) -> dict[str, torch.Tensor]:
    """Each source's held-out blocks (its ``eval_files``, ``eval_split`` or hashed hold-out; ``n_blocks`` at most)."""
    return {s.name: eval_blocks(s.cfg, tokenizer, s.eval_files, n_blocks, s.train_files) for s in sources}


def source_counts(state: dict, seq_len: int) -> dict[str, dict[str, int]]:
    """name -> documents and tokens one replica's stream had drawn by the position ``state`` (a
    :meth:`MixtureStream.state_dict`): tokens are its blocks times ``seq_len``; documents, those its blocks began."""
    return {name: {"documents": st.get("stats", {}).get("documents", 0), "tokens": state["seen"][name] * seq_len}
            for name, st in state["sources"].items()}


class MixtureStream:
    """Iterator of ``seq_len`` blocks drawn from several sources by weight; the interface of :class:`BlockStream`
    (``state_dict``, ``load_state_dict``, ``epoch``, ``blocks``).

    Args:
        sources: the resolved sources (:func:`resolve_sources`).
        tokenizer, rank, world_size, seed: as :class:`BlockStream`'s; each source shuffles with
            :func:`source_seed`, the draws follow ``seed`` alone (the same on every replica).
        strategy: ``data.stopping_strategy``.
        repeat: start the next mixture epoch when one ends (else ``StopIteration``).
    """

    def __init__(self, sources: list[Source], tokenizer, *, rank: int = 0, world_size: int = 1, seed: int = 0,
                 strategy: str = "all_exhausted", repeat: bool = True):
        if strategy not in ("all_exhausted", "first_exhausted", "all_exhausted_without_replacement"):
            raise ValueError(f"stopping_strategy: {strategy!r}")
        self.names = [s.name for s in sources]
        self.weights = np.array([s.weight for s in sources], dtype=np.float64)
        self.seq_len = sources[0].cfg.seq_len
        self.seed, self.rank, self.world_size, self.strategy, self.repeat = seed, rank, world_size, strategy, repeat
        self.streams = {s.name: BlockStream(s.cfg, tokenizer, s.train_files, rank=rank, world_size=world_size,
                                            seed=source_seed(seed, s.name), repeat=False,
                                            hold_out=train_hold_out(s.cfg, s.eval_files)) for s in sources}
        self.seen = dict.fromkeys(self.names, 0)  # blocks each source gave, all epochs
        self._start(0)

    def _start(self, epoch: int, draws: int = 0) -> None:
        self.epoch, self.draws, self.blocks = epoch, draws, 0
        self.exhausted: set[str] = set()
        self._rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
        self._rng.bit_generator.advance(draws)  # one 64-bit output per uniform

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """JSON-serialisable position: the mixture epoch, its draws and blocks, the sources run out, every source's
        position, and the blocks each source gave."""
        return {"epoch": self.epoch, "blocks": self.blocks, "draws": self.draws, "exhausted": sorted(self.exhausted),
                "seed": self.seed, "rank": self.rank, "world_size": self.world_size, "strategy": self.strategy,
                "seen": dict(self.seen), "sources": {n: s.state_dict() for n, s in self.streams.items()}}

    def load_state_dict(self, sd: dict) -> None:
        """Continue from ``sd``. A state of ``{"epoch", "blocks"}`` only (another data-parallel size) replays the
        epoch's draws to give each source its number of blocks (not the uninterrupted order)."""
        if "sources" not in sd:
            self._start(int(sd["epoch"]))
            picks = [self._pick() for _ in range(int(sd["blocks"]))]
            self.blocks = len(picks)
            for name, stream in self.streams.items():
                stream.load_state_dict({"epoch": self.epoch, "blocks": picks.count(name)})
            return
        for key, mine in (("seed", self.seed), ("world_size", self.world_size), ("rank", self.rank),
                          ("strategy", self.strategy)):
            if key in sd and sd[key] != mine:
                raise DataError(f"data state was saved with {key}={sd[key]!r}, this mixture has {key}={mine!r}; resume "
                                "with the same training.seed, data-parallel layout and data.stopping_strategy")
        if set(sd["sources"]) != set(self.names):
            raise DataError(f"data state holds the sources {sorted(sd['sources'])}, the recipe's data.sources are "
                            f"{sorted(self.names)}; resume with the same sources")
        self._start(int(sd["epoch"]), int(sd["draws"]))
        self.blocks, self.exhausted = int(sd["blocks"]), set(sd["exhausted"])
        self.seen.update(sd["seen"])
        for name, stream in self.streams.items():
            stream.load_state_dict(sd["sources"][name])

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> "MixtureStream":
        return self

    def _pick(self) -> str:
        """The next draw's source: a uniform against the weights of the sources still drawn from."""
        live = [i for i, n in enumerate(self.names) if not (self.strategy == "all_exhausted_without_replacement"
                                                             and n in self.exhausted)]
        w = self.weights[live]
        u = self._rng.random()
        self.draws += 1
        i = int(np.searchsorted(np.cumsum(w) / w.sum(), u, side="right"))
        return self.names[live[min(i, len(live) - 1)]]

    def __next__(self) -> torch.Tensor:
        while True:
            name = self._pick()
            stream = self.streams[name]
            try:
                block = next(stream)
            except StopIteration:
                stream.next_epoch()  # its next epoch, reshuffled: where it continues, now or in the next mixture epoch
                self.exhausted.add(name)
                if self.strategy == "first_exhausted" or self.exhausted == set(self.names):
                    self._end_of_epoch()
                    continue
                if self.strategy == "all_exhausted":
                    block = next(stream)  # its weight holds: it repeats
                else:
                    continue  # without replacement: drawn no more this epoch
            self.blocks += 1
            self.seen[name] += 1
            return block

    def _end_of_epoch(self) -> None:
        log.info("mixture epoch %d done on rank %d/%d (%s): %d blocks; blocks per source so far %s", self.epoch,
                 self.rank, self.world_size, self.strategy, self.blocks, self.seen)
        self._start(self.epoch + 1)
        if not self.repeat:
            raise StopIteration
