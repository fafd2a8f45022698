"""Warm-start files (config ``warm_start``): past responses or a corpus the drafter learns before serving.
``*.jsonl``: one JSON object a line, its text the first of ``TEXT_FIELDS`` holding a string (blank lines skipped,
any other line skipped and counted); any other name: plain text, paragraphs split on blank lines, each stripped.
A file is streamed as text mode reads it (UTF-8, undecodable bytes replaced, universal newlines), and the sha256 a
snapshot names is of exactly the bytes the texts came from: a file replaced while the engine starts is never named
by one version and learned as another.
"""

from __future__ import annotations

import errno
import hashlib
import io
import itertools
import json
import os
import stat
from typing import Iterator

TEXT_FIELDS = ("text", "response", "output", "completion")  # in order of preference
_BLANK = " \t\r\f\v"  # a plain-text line holding only these is a paragraph break
CHUNK_BYTES = 1 << 20  # bytes read at a time


class _Hashing(io.RawIOBase):
    """A readable file that hashes every byte read from it."""

    def __init__(self, fd: int) -> None:
        self._file = os.fdopen(fd, "rb", buffering=0)
        self.sha256 = hashlib.sha256()
        self.bytes_read = 0

    def readable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._file.fileno()

    def readinto(self, buffer) -> int:
        n = self._file.readinto(buffer)
        if n:
            self.sha256.update(memoryview(buffer)[:n])
            self.bytes_read += n
        return n

    def close(self) -> None:
        self._file.close()
        super().close()


class WarmReader:
    """One pass over a warm-start file: :meth:`texts` yields its texts in order, then :attr:`digest` is the sha256 (hex)
    of the bytes read and :attr:`skipped_lines` the 1-based JSONL lines with no text. OSError as :func:`_open`."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)
        self._raw = _open(path)
        self.size = os.fstat(self._raw.fileno()).st_size  # when opened: what progress is counted against
        self.skipped_lines: list[int] = []
        self.digest = ""

    @property
    def bytes_read(self) -> int:
        return self._raw.bytes_read

    def texts(self) -> Iterator[str]:
        with io.TextIOWrapper(io.BufferedReader(self._raw, CHUNK_BYTES), encoding="utf-8", errors="replace",
                              newline=None) as lines:
            yield from (self._jsonl(lines) if self.path.endswith(".jsonl") else _paragraphs(lines))
        self.digest = self._raw.sha256.hexdigest()

    def _jsonl(self, lines: Iterator[str]) -> Iterator[str]:
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            found = _text_of(line)
            if found is None:
                self.skipped_lines.append(lineno)
            elif found:
                yield found


def _paragraphs(lines: Iterator[str]) -> Iterator[str]:
    """The stripped, non-empty paragraphs of ``lines``, split on lines holding only ``_BLANK``."""
    paragraph: list[str] = []
    for line in itertools.chain(lines, [""]):  # the end closes the last paragraph
        if line.rstrip("\n").strip(_BLANK):
            paragraph.append(line)
            continue
        text = "".join(paragraph).strip()
        paragraph.clear()
        if text:
            yield text


def file_digest(path: str | os.PathLike) -> str:
    """The sha256 (hex) of a warm-start file, read in chunks (OSError as :class:`WarmReader`)."""
    with _open(path) as raw:
        while raw.read(CHUNK_BYTES):
            pass
    return raw.sha256.hexdigest()


def _open(path: str | os.PathLike) -> _Hashing:
    """``path`` opened for hashed reading; OSError if it is not a regular file (a FIFO would block the start)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
    except BaseException:
        os.close(fd)
        raise
    return _Hashing(fd)


def _text_of(line: str) -> str | None:
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    return next((obj[name] for name in TEXT_FIELDS if isinstance(obj.get(name), str)), None)
