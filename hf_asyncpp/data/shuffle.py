"""A streamed dataset's documents, shuffled, with a position that resumes without re-reading what was passed.

Why not datasets' shuffle alone: ``IterableDataset.state_dict()`` resumes a stream where it stopped, but "examples
from shuffle buffers are lost when resuming and the buffers are refilled with new data" (its docstring), so a resumed
run would train on other documents than an uninterrupted one. Here datasets shuffles the shard order only (a buffer
of one document, which holds nothing between two reads, so its state is exact) and the document buffer is this
module's: its texts and its generator's state are saved beside datasets' own state. A resumed epoch starts at the
saved shard and row (datasets seeks there) with the saved buffer: what the stream had passed is not read again.

The price: the position holds the buffer's texts (``data.shuffle_buffer`` documents per data-parallel rank in the
checkpoint's ``run_state.json``), against re-reading the epoch up to the position (millions of documents deep into a
Hub corpus).
"""
from __future__ import annotations

import collections
import logging
from typing import Callable, Iterator

import numpy as np

from ..errors import DataError

__all__ = ["ShuffledDocuments"]

_DRAWS = 1024  # uniforms drawn at a time for the buffer's picks
_MARKS = 256  # positions kept for documents read but not yet packed (the packer reads ahead one tokenizer batch)


class _NoBufferWarning(logging.Filter):
    """datasets warns that a resumed shuffle buffer is refilled; the shard-order shuffle here buffers nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "shuffle buffer of a dataset without the buffer content" not in record.getMessage()


logging.getLogger("datasets.iterable_dataset").addFilter(_NoBufferWarning())


class ShuffledDocuments:
    """One epoch of a streamed dataset's ``column``, shuffled through a buffer of ``buffer_size`` documents.

    Args:
        ds: this rank's (already split) ``datasets.IterableDataset``, unshuffled.
        column: the text column; a value that is not a string is yielded as None (the packer skips it).
        seed, epoch: the shard order and the buffer's draws follow ``seed + epoch``.
        buffer_size: 0 keeps the stream's order (no shard shuffle either).
        keep: which texts are yielded (the hashed hold-out); the others are read and dropped.
        state: a :meth:`state_at` of this epoch: continue from there.
        where: what a read error names.

    Documents are counted from the epoch's start, resumed or not: :meth:`state_at` ``(i)`` is the position before the
    ``i``-th yielded document, for any ``i`` from the last :data:`_MARKS` yielded up to the next one.
    """

    def __init__(self, ds, column: str, *, seed: int, epoch: int, buffer_size: int,
                 keep: Callable[[object], bool] | None = None, state: dict | None = None, where: object = ""):
        self.column, self.size, self.keep, self.where = column, buffer_size, keep, where
        if buffer_size:
            ds = ds.shuffle(seed=seed + epoch, buffer_size=1)  # the shard order only
        ds.set_epoch(epoch)  # datasets applies a saved state to the epoch it was saved in
        self.ds = ds
        self.rng = np.random.default_rng(seed + epoch)
        self._draws, self._used, self._rng_at = np.empty(0), 0, self.rng.bit_generator.state  # a batch of uniforms
        self.buffer: list = []
        self.index = 0  # documents yielded so far in the epoch
        self.source_done = False
        if state is not None:
            if state["epoch"] != epoch:
                raise DataError(f"data state of epoch {state['epoch']} loaded into epoch {epoch}")
            self.ds.load_state_dict(state["source"])
            self.buffer, self.index, self.source_done = list(state["buffer"]), state["document"], state["source_done"]
            self.rng.bit_generator.state = state["rng"]  # the batch of draws in use then, and how far it was used
            self._rng_at, self._draws, self._used = state["rng"], self.rng.random(_DRAWS), state["used"]
        self.epoch, self._start_source = epoch, state["source"] if state is not None else None
        self._marks: collections.deque = collections.deque(maxlen=_MARKS)
        self._it = None

    def state_at(self, document: int) -> dict:
        """The position before the ``document``-th yielded document (JSON-serialisable)."""
        if document == self.index:
            return self._state()
        for i, st in self._marks:
            if i == document:
                return st
        raise RuntimeError(f"no saved position for document {document} (yielded {self.index})")

    def _state(self) -> dict:
        source = self.ds.state_dict() if self._it is not None else self._start_source  # nothing read yet
        return {"epoch": self.epoch, "document": self.index, "source": source, "buffer": list(self.buffer),
                "rng": self._rng_at, "used": self._used, "source_done": self.source_done}

    def __iter__(self) -> Iterator[object]:
        while True:
            self._marks.append((self.index, self._state()))
            while True:
                text = self._draw()
                if text is _END:
                    return
                if self.keep is None or self.keep(text):
                    break
            self.index += 1
            yield text

    def _draw(self):
        """The next document out of the buffer, refilled from the source first."""
        while not self.source_done and len(self.buffer) < max(self.size, 1):
            text = self._read()
            if text is _END:
                self.source_done = True
            else:
                self.buffer.append(text)
        if not self.buffer:
            return _END
        if self.size == 0:
            return self.buffer.pop()
        if self._used == len(self._draws):  # one numpy call per _DRAWS documents, not one per document
            self._rng_at, self._draws, self._used = self.rng.bit_generator.state, self.rng.random(_DRAWS), 0
        i = int(self._draws[self._used] * len(self.buffer))
        self._used += 1
        self.buffer[i], self.buffer[-1] = self.buffer[-1], self.buffer[i]
        return self.buffer.pop()

    def _read(self):
        if self._it is None:
            self._it = iter(self.ds)
        try:
            ex = next(self._it)
        except StopIteration:
            return _END
        except (ValueError, OSError) as e:  # pyarrow.ArrowInvalid is a ValueError
            raise DataError(f"reading {self.where}: {type(e).__name__}: {e}") from e
        text = ex.get(self.column) if isinstance(ex, dict) else None
        return text if isinstance(text, str) else None


_END = object()
