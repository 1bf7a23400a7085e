"""Replace one marked section of a benchmark page (each benchmark owns its sections; ``--write`` calls this).

The pages are ``docs/benchmarks/<page>.md``; ``docs/benchmarks.md`` is their hand-written index. A section is the
text between ``<!-- key:start -->`` and ``<!-- key:end -->``; ``PAGES`` says which page holds each key, so a script
never appends its section to a page where nobody looks.
"""
from __future__ import annotations

from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
TITLES = {
    "speed": "Speed on a 2-core CPU: the pipeline against torch, one process and the no-bubble limit",
    "parts": "What one part costs: partitioning, the optimizer step, the reduction, the data path, logging",
    "memory": "Memory: the planner against the executor, bytes per parameter, the stage-local start",
    "quality": "Quality: delay tolerance, the paper's claims at our scale",
    "gpu": "The GPU proof",
}
PAGES = {
    "default": "speed", "cli-throughput": "speed", "cli-throughput-fused": "speed", "stage-ceiling": "speed",
    "time-to-loss": "speed", "soak": "speed", "schedules": "speed", "schedule-anchors": "speed",
    "partition": "parts", "optimizer-step": "parts", "host-overhead": "parts", "reduction": "parts",
    "data-path": "parts", "streaming": "parts", "checkpoint-save": "parts",
    "memory": "memory", "memory-per-param": "memory", "stage-local": "memory",
    "quality": "quality", "quality-long": "quality", "paper-regime": "quality",
    "gpu": "gpu",
}
"""Section key -> page. ``bench.throughput`` writes ``throughput-<layers>`` and ``throughput-h256-<layers>``
(speed)."""


def page(key: str) -> Path:
    """The page that holds section ``key``."""
    name = PAGES.get(key) or ("speed" if key.startswith("throughput-") else None)
    if name is None:
        raise KeyError(f"no page for benchmark section {key!r}: add it to PAGES in bench/report.py")
    return DOCS / f"{name}.md"


def write_section(key: str, body: str, first: bool = False) -> Path:
    """Replace the section ``key`` on its page; a new one goes at the end (or right after the page's intro with
    ``first``). Returns the page."""
    path = page(key)
    start, end = f"<!-- {key}:start -->", f"<!-- {key}:end -->"
    text = path.read_text() if path.exists() else f"# {TITLES[path.stem]}\n"
    section = f"{start}\n{body}\n{end}"
    if start in text:
        text = text[: text.index(start)] + section + text[text.index(end) + len(end):]
    elif first and "\n\n" in text.split("<!--", 1)[0]:
        head, sep, rest = text.partition("<!--")
        text = head.rstrip() + "\n\n" + section + "\n\n" + sep + rest
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
