"""vLLM's configs to lookahead's: ``speculative_config={"method": "lookahead"}`` selects the method (vLLM's
``custom_class`` route), ``additional_config={"lookahead": {...}}`` configures it (docs/configuration.md)."""

from __future__ import annotations

import importlib
from typing import Any

from lookahead_vllm.core.config import Settings, default_decoding_length, resolve

METHOD = "lookahead"
PROPOSER_PATH = "lookahead_vllm.vllm.proposer.LookaheadProposer"
ADDITIONAL_CONFIG_KEY = "lookahead"
# False beside it with --disable-log-stats, which vLLM keeps out of the VllmConfig the workers get (patch log_stats).
LOG_STATS_KEY = "lookahead_log_stats"


def is_lookahead(speculative_config: Any) -> bool:
    """Whether a vLLM ``SpeculativeConfig`` routes to our proposer or a subclass (benchmarks' fixed drafts)."""
    model = getattr(speculative_config, "model", None)
    return model == PROPOSER_PATH or (getattr(speculative_config, "method", None) == "custom_class"
                                      and isinstance(model, str) and _extends_proposer(model))


def _extends_proposer(path: str) -> bool:
    module, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return False  # vLLM reports a class it cannot import
    return isinstance(cls, type) and any(f"{c.__module__}.{c.__qualname__}" == PROPOSER_PATH for c in cls.__mro__)


def selects_lookahead(kwargs: dict[str, Any]) -> bool:
    """Whether ``SpeculativeConfig`` keyword arguments ask for lookahead."""
    return METHOD in (kwargs.get("method"), kwargs.get("model")) or kwargs.get("model") == PROPOSER_PATH


def translate_speculative_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Rewrite ``method="lookahead"`` (or ``model="lookahead"``) to vLLM's custom_class."""
    method, model = kwargs.get("method"), kwargs.get("model")
    if METHOD not in (method, model):
        return kwargs
    if method not in (None, METHOD, "custom_class"):
        raise ValueError(f"speculative_config: model='lookahead' conflicts with method={method!r}")
    if model not in (None, METHOD, PROPOSER_PATH):
        raise ValueError(f"speculative_config.model={model!r}: method 'lookahead' needs no draft model; leave it unset")
    k = kwargs.get("num_speculative_tokens")
    return {**kwargs, "method": "custom_class", "model": PROPOSER_PATH,
            "num_speculative_tokens": default_decoding_length(current_platform_name()) if k is None else k}


def unread_settings(additional_config: Any, lookahead: bool) -> str | None:
    """Why lookahead settings in ``additional_config`` go unread (a near-miss key, another method), or None."""
    additional_config = _dict(additional_config)
    near = sorted(k for k in additional_config if isinstance(k, str) and k != ADDITIONAL_CONFIG_KEY
                  and k.lower().replace("_", "").replace("-", "") == ADDITIONAL_CONFIG_KEY)
    if near:
        return (f"additional_config key(s) {near} are not read; lookahead's settings go under "
                f"{ADDITIONAL_CONFIG_KEY!r}")
    if not lookahead and ADDITIONAL_CONFIG_KEY in additional_config:
        return (f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] is not read: this engine's speculative method is "
                "not lookahead (select it with --speculative-config '{\"method\": \"lookahead\"}')")
    return None


def resolve_lookahead_config(additional_config: Any, num_speculative_tokens: int) -> Settings:
    """``additional_config["lookahead"]`` resolved for this platform and ``num_speculative_tokens`` (or ValueError)."""
    from vllm.v1.sample.rejection_sampler import MAX_SPEC_LEN  # the most drafts per request it verifies

    if additional_config is not None and not isinstance(additional_config, dict):  # vLLM takes any SupportsHash
        raise ValueError(f"additional_config is a {type(additional_config).__name__}: lookahead needs a dict, which "
                         f"it carries its settings in ({{'lookahead': {{...}}}} beside other keys)")
    values = _dict(additional_config).get(ADDITIONAL_CONFIG_KEY)
    if values is not None and not isinstance(values, dict):
        raise ValueError(f"additional_config['lookahead'] must be a mapping of lookahead fields, "
                         f"got {type(values).__name__}")
    if num_speculative_tokens > MAX_SPEC_LEN:
        raise ValueError(f"speculative_config.num_speculative_tokens={num_speculative_tokens}: vLLM's rejection "
                         f"sampler verifies at most {MAX_SPEC_LEN} draft tokens per request (MAX_SPEC_LEN); "
                         "lower it (and decoding_length)")
    return resolve(values, platform=current_platform_name(), num_speculative_tokens=num_speculative_tokens)


def resolve_engine_settings(vllm_config: Any) -> Settings:
    """``vllm_config``'s settings, carried in a new ``additional_config`` (:meth:`Settings.to_carried`)."""
    additional = vllm_config.additional_config
    settings = resolve_lookahead_config(additional, vllm_config.speculative_config.num_speculative_tokens)
    vllm_config.additional_config = {**_dict(additional), ADDITIONAL_CONFIG_KEY: settings.to_carried()}
    return settings


def logs_stats(vllm_config: Any) -> bool:
    """Whether the engine logs stats (False where :data:`LOG_STATS_KEY` carried ``--disable-log-stats``)."""
    return _dict(vllm_config.additional_config).get(LOG_STATS_KEY, True)


def engine_settings(vllm_config: Any) -> Settings:
    """The settings :func:`resolve_engine_settings` carried in ``vllm_config`` (workers)."""
    return Settings.from_carried(_dict(vllm_config.additional_config).get(ADDITIONAL_CONFIG_KEY) or {})


def _dict(additional_config: Any) -> dict[str, Any]:
    """vLLM's ``additional_config``, or ``{}`` where it is not a dict."""
    return additional_config if isinstance(additional_config, dict) else {}


def current_platform_name() -> str:
    """The profile's platform: "cpu" on vLLM's CPU platform, else "gpu"."""
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "gpu"
