"""Mapping between vLLM's configs and :class:`LookaheadConfig`.

Users select the method with ``speculative_config={"method": "lookahead"}``
(optionally ``"num_speculative_tokens": k``, default 16) and tune it with
``additional_config={"lookahead": {...}}`` whose keys are the fields of
:class:`LookaheadConfig`. ``decoding_length`` defaults to ``k`` and may not
exceed it (vLLM reserves ``k`` draft slots per request). With a Jacobi source
the window's ``W * (N - 1) - 1`` lookahead nodes come on top, so
``decoding_length`` defaults to ``k`` minus them.
"""

from __future__ import annotations

from typing import Any

from lookahead_vllm.core.config import LookaheadConfig

METHOD = "lookahead"
PROPOSER_PATH = "lookahead_vllm.vllm.proposer.LookaheadProposer"
DEFAULT_NUM_SPECULATIVE_TOKENS = LookaheadConfig().decoding_length
ADDITIONAL_CONFIG_KEY = "lookahead"


def is_lookahead(speculative_config: Any) -> bool:
    """True if a vLLM ``SpeculativeConfig`` routes to our proposer."""
    return speculative_config is not None and getattr(speculative_config, "model", None) == PROPOSER_PATH


def selects_lookahead(kwargs: dict[str, Any]) -> bool:
    """Whether ``SpeculativeConfig`` keyword arguments ask for lookahead."""
    return METHOD in (kwargs.get("method"), kwargs.get("model")) or kwargs.get("model") == PROPOSER_PATH


def translate_speculative_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Rewrite ``method="lookahead"`` (or ``model="lookahead"``) to vLLM's custom_class."""
    if kwargs.get("method") != METHOD and kwargs.get("model") != METHOD:
        return kwargs
    method, model = kwargs.get("method"), kwargs.get("model")
    if method not in (None, METHOD, "custom_class"):
        raise ValueError(f"speculative_config: model='lookahead' conflicts with method={method!r}")
    if model not in (None, METHOD, PROPOSER_PATH):
        raise ValueError(
            f"speculative_config.model={model!r}: method 'lookahead' needs no draft model; leave it unset"
        )
    out = dict(kwargs)
    out["method"] = "custom_class"
    out["model"] = PROPOSER_PATH
    if out.get("num_speculative_tokens") is None:
        out["num_speculative_tokens"] = DEFAULT_NUM_SPECULATIVE_TOKENS
    return out


def resolve_lookahead_config(additional_config: Any, num_speculative_tokens: int) -> LookaheadConfig:
    """Validate ``additional_config["lookahead"]`` against ``k``; raise ValueError naming the field."""
    values = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY) if isinstance(additional_config, dict) else None
    if values is not None and not isinstance(values, dict):
        raise ValueError(
            f"additional_config['lookahead'] must be a mapping of lookahead fields, got {type(values).__name__}"
        )
    values = dict(values or {})
    limit = _max_spec_len()
    if num_speculative_tokens > limit:
        raise ValueError(
            f"speculative_config.num_speculative_tokens={num_speculative_tokens}: vLLM's rejection sampler "
            f"verifies at most {limit} draft tokens per request (MAX_SPEC_LEN); lower it "
            "(and decoding_length, or jacobi_window / jacobi_ngram / jacobi_guesses)"
        )
    probe = LookaheadConfig.from_dict({**values, "decoding_length": 1})  # validates the other fields
    window = probe.lookahead_nodes
    if probe.uses_jacobi:
        w, n, g = probe.jacobi_window, probe.jacobi_ngram, probe.jacobi_guesses
        if probe.jacobi_step_slots > num_speculative_tokens:
            raise ValueError(
                f"jacobi_window={w}, jacobi_ngram={n}, jacobi_guesses={g}: the step needs "
                f"(W + G) * (N - 1) - 1 = {probe.jacobi_step_slots} draft slots, more than "
                f"speculative_config.num_speculative_tokens={num_speculative_tokens} "
                "(raise num_speculative_tokens or lower W, N or G)"
            )
    values.setdefault("decoding_length", num_speculative_tokens - window)
    config = LookaheadConfig.from_dict(values)
    if config.decoding_length + window > num_speculative_tokens:
        extra = f" + {window} Jacobi lookahead nodes" if window else ""
        raise ValueError(
            f"decoding_length={config.decoding_length}{extra}: must be <= "
            f"speculative_config.num_speculative_tokens={num_speculative_tokens} "
            "(raise num_speculative_tokens or lower decoding_length)"
        )
    return config


def _max_spec_len() -> int:
    """vLLM's per-request draft limit (the rejection sampler asserts on it)."""
    try:
        from vllm.v1.sample.rejection_sampler import MAX_SPEC_LEN
    except ImportError:  # no vLLM here (pure config checks): no limit to enforce
        return 1 << 16
    return int(MAX_SPEC_LEN)
