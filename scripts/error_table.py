"""Regenerate docs/troubleshooting.md's table of the error lines users meet, from the tests that meet them.

    .venv/bin/python scripts/error_table.py          # runs the bad-input tests (about 5 minutes), rewrites the table

The bad-input tests call the commands as users do (``hf-asyncpp train`` as one process, or starting the stages
itself; ``plan``; ``evaluate``) and note every ``error:`` line they see with its exit code and entry point
(``tests/support.record_errors``, when ``HF_ASYNCPP_ERROR_TABLE`` names a file). This script runs them with it set and
writes the lines, their temporary paths shortened, between the ``error-table`` markers of the page: the table is
what the code prints today, not what someone remembered it to print.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "troubleshooting.md"
TESTS = ["tests/test_cli_inputs.py", "tests/test_lose_nothing.py", "tests/test_preflight.py", "tests/test_reliability.py",
         "tests/test_reliability_rest.py", "tests/test_memory_plan.py::test_plan_takes_recipe_overrides_after_the_recipe",
         "tests/test_downstream.py::test_a_hub_task_out_of_reach_is_one_line_naming_the_ways_out",
         "tests/test_downstream.py::test_a_hub_task_with_the_hub_unreachable_is_one_request_then_one_line",
         "tests/test_downstream.py::test_bad_inputs"]
START, END = "<!-- error-table:start -->", "<!-- error-table:end -->"
_TMP = re.compile(r"/tmp/pytest-of-[^/\s]+/pytest-\d+/(popen-gw\d+/)?[^/\s']+?\d*/")


def shorten(line: str) -> str:
    """A line with pytest's temporary folders written ``TMP/`` (the same message in every run)."""
    return _TMP.sub("TMP/", line).replace(str(ROOT) + "/", "")


def table(records: list[dict]) -> str:
    rows = {}
    for r in records:
        line = shorten(r["line"])
        if len(line) > 300:
            line = line[:297] + "..."
        rows.setdefault((r["entry"], line), (r["code"], r["test"].split("::")[0].removeprefix("tests/")))
    out = ["| entry point | exit code | the line | met by |", "|---|---|---|---|"]
    for (entry, line), (code, test) in sorted(rows.items()):
        cell = line.replace("|", "\\|").replace("`", "")
        out.append(f"| {entry} | {code} | `{cell}` | {test} |")
    return "\n".join(out)


def main() -> int:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "errors.jsonl"
        env = {**os.environ, "HF_ASYNCPP_ERROR_TABLE": str(path)}
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", *TESTS], cwd=ROOT, env=env)
        if r.returncode != 0:
            print("error: the bad-input tests failed; the table is left as it was", file=sys.stderr)
            return r.returncode
        records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    text = PAGE.read_text()
    section = (f"{START}\n{len(records)} error lines met by the tests, {len({shorten(r['line']) for r in records})} "
               f"distinct (`python scripts/error_table.py` regenerates this table):\n\n{table(records)}\n{END}")
    if START in text:
        text = text[:text.index(START)] + section + text[text.index(END) + len(END):]
    else:
        raise SystemExit(f"error: {PAGE} has no {START} marker: put one (and {END}) where the table goes")
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}: {len(records)} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
