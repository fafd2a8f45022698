"""Warm-start files: past responses or a corpus the drafter learns before
serving (config ``warm_start``).

Two formats, told apart by the file name:

  ``*.jsonl``  one JSON object a line; its text is the first of the fields
               ``TEXT_FIELDS`` that holds a string. Blank lines are skipped;
               a line that is not such an object is skipped and counted.
  any other    plain text: paragraphs split on blank lines, each stripped.

Worked example: ``{"response": "def f(): pass"}`` then ``{"id": 3}`` gives
one text and one skipped line; the plain text ``"a b\\n\\nc\\n"`` gives
``["a b", "c"]``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

# JSONL fields holding a text, in order of preference.
TEXT_FIELDS = ("text", "response", "output", "completion")
_PARAGRAPH_BREAK = re.compile(r"\n[ \t\r\f\v]*\n")


@dataclass(slots=True)
class WarmTexts:
    texts: list[str] = field(default_factory=list)
    # JSONL lines that were not an object with a text field (1-based).
    skipped_lines: list[int] = field(default_factory=list)


def read_warm_texts(path: str | os.PathLike) -> WarmTexts:
    """The texts of a warm-start file (see the module docstring); OSError if
    it cannot be read."""
    with open(path, encoding="utf-8", errors="replace") as f:
        data = f.read()
    if str(path).endswith(".jsonl"):
        return _jsonl_texts(data)
    return WarmTexts([p.strip() for p in _PARAGRAPH_BREAK.split(data) if p.strip()])


def _jsonl_texts(data: str) -> WarmTexts:
    out = WarmTexts()
    for lineno, line in enumerate(data.splitlines(), 1):
        text = _text_of(line) if line.strip() else ""
        if text is None:
            out.skipped_lines.append(lineno)
        elif text:
            out.texts.append(text)
    return out


def _text_of(line: str) -> str | None:
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    return next((obj[name] for name in TEXT_FIELDS if isinstance(obj.get(name), str)), None)
