"""Draft trace, proving every tensor-parallel rank drafted the same: :func:`record` appends ``<step> <digest> <rows>
<draft tokens>`` a step to ``<dir>/rank<r>-<pid>.trace``; ``python -m lookahead_lab.draft_traces DIR`` reports the
first step where two ranks' traces differ."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Sequence

from lookahead_vllm.vllm.metrics import tp_rank

TRACE_DIR_ENV = "LOOKAHEAD_DRAFT_TRACE_DIR"
SUFFIX = ".trace"

_writers: dict[tuple[int, str], Any] = {}


def draft_digest(req_ids: Sequence[Any], drafts: Sequence[Sequence[int]]) -> str:
    """Hash of one step: request ids (``None`` padding kept) and each row's draft token ids."""
    payload = [[None if r is None else str(r) for r in req_ids], [[int(t) for t in d] for d in drafts]]
    return hashlib.blake2b(json.dumps(payload, separators=(",", ":")).encode(), digest_size=8).hexdigest()


def directory() -> str | None:
    """The trace directory (``$LOOKAHEAD_DRAFT_TRACE_DIR``; None: no trace)."""
    return os.environ.get(TRACE_DIR_ENV) or None


def record(step: int, req_ids: Sequence[Any], drafts: Sequence[Sequence[int]], directory: str) -> None:
    """Append this step's digest to this rank's trace in ``directory`` (:func:`directory`, read once)."""
    key = (os.getpid(), directory)  # one open trace file per process and directory
    if key not in _writers:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"rank{tp_rank()}-{os.getpid()}{SUFFIX}")
        _writers[key] = open(path, "a", buffering=1)  # line-buffered: readable while the engine runs
    _writers[key].write(f"{int(step)} {draft_digest(req_ids, drafts)} {len(drafts)} {sum(len(d) for d in drafts)}\n")
