"""Warm-start files (config ``warm_start``): past responses or a corpus the drafter learns before
serving. ``*.jsonl``: one JSON object a line, its text the first of ``TEXT_FIELDS`` that holds a
string (blank lines skipped; any other line skipped and counted); any other name: plain text,
paragraphs split on blank lines, each stripped.

Worked example: ``{"response": "def f(): pass"}`` then ``{"id": 3}`` gives one text and one skipped
line; the plain text ``"a b\\n\\nc\\n"`` gives ``["a b", "c"]``.

The file is read once (:func:`read_warm_file`): its digest (sha256, what a snapshot names) and its
texts come from the same bytes, so a file replaced while the engine starts is never named by one
version and learned as another.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass, field

# JSONL fields holding a text, in order of preference.
TEXT_FIELDS = ("text", "response", "output", "completion")
_PARAGRAPH_BREAK = re.compile(r"\n[ \t\r\f\v]*\n")


@dataclass(slots=True)
class WarmTexts:
    texts: list[str] = field(default_factory=list)
    # JSONL lines that were not an object with a text field (1-based).
    skipped_lines: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class WarmFile:
    """A warm-start file as read once: its bytes and their sha256."""
    path: str
    data: bytes
    # sha256 (hex) of ``data``: names this version of the file in a snapshot.
    digest: str

    def texts(self) -> WarmTexts:
        """The texts of these bytes (see the module docstring)."""
        # As a file opened in text mode reads: universal newlines.
        text = self.data.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
        if not self.path.endswith(".jsonl"):
            return WarmTexts([p.strip() for p in _PARAGRAPH_BREAK.split(text) if p.strip()])
        out = WarmTexts()
        for lineno, line in enumerate(text.splitlines(), 1):
            found = _text_of(line) if line.strip() else ""
            if found is None:
                out.skipped_lines.append(lineno)
            elif found:
                out.texts.append(found)
        return out


def read_warm_file(path: str | os.PathLike) -> WarmFile:
    """Read a warm-start file's bytes once; OSError if it cannot be read or is
    not a regular file (a FIFO would block the engine's start)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        data = f.read()
    return WarmFile(str(path), data, hashlib.sha256(data).hexdigest())


def _text_of(line: str) -> str | None:
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    return next((obj[name] for name in TEXT_FIELDS if isinstance(obj.get(name), str)), None)
