"""Replace one marked section of docs/benchmarks.md (each benchmark owns its section)."""
from __future__ import annotations

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def write_section(key: str, body: str, first: bool = False) -> None:
    """Replace the section ``key``; a new one goes at the end (or right after the page's intro with ``first``)."""
    start, end = f"<!-- {key}:start -->", f"<!-- {key}:end -->"
    text = BENCHMARKS.read_text() if BENCHMARKS.exists() else "# Benchmarks\n"
    section = f"{start}\n{body}\n{end}"
    if start in text:
        text = text[: text.index(start)] + section + text[text.index(end) + len(end):]
    elif first and "\n\n" in text.split("<!--", 1)[0]:
        head, sep, rest = text.partition("<!--")
        text = head.rstrip() + "\n\n" + section + "\n\n" + sep + rest
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    BENCHMARKS.write_text(text)
