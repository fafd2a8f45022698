"""A ``LookaheadProposer`` without an engine, for benchmarks and tests that
drive it the way vLLM's model runner does (``on_step``, then ``propose``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def engine_free_config(k: int, max_model_len: int, lookahead: dict[str, Any] | None = None,
                       **model: Any) -> SimpleNamespace:
    """The parts of a ``VllmConfig`` the proposer reads: ``k`` draft slots, a
    model of ``max_model_len`` tokens (``model``: more model_config fields,
    e.g. ``tokenizer``), chain-safe defaults everywhere else; the lookahead
    settings resolved into it as the ``lookahead_validation`` patch does."""
    from lookahead_vllm.vllm.config import resolve_engine_settings

    config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        additional_config={"lookahead": dict(lookahead or {})},
        model_config=SimpleNamespace(max_model_len=max_model_len, uses_mrope=False, is_hybrid=False,
                                     is_attention_free=False, **model),
        scheduler_config=SimpleNamespace(async_scheduling=False),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        compilation_config=SimpleNamespace(cudagraph_mode=None),
        attention_config=None,
    )
    resolve_engine_settings(config)
    return config


def standalone_proposer(k: int, max_model_len: int, lookahead: dict[str, Any] | None = None, **model: Any) -> Any:
    """A proposer built from :func:`engine_free_config`."""
    from lookahead_vllm.vllm.proposer import LookaheadProposer

    return LookaheadProposer(engine_free_config(k, max_model_len, lookahead, **model))
