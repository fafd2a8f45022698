"""Test shorthand for lookahead settings: public fields and profile knobs side by side.

The package takes profile knobs only under the explicit ``"_profile"`` key
(core/config.py); tests that set many knobs name them flat here and these
helpers put each where it belongs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lookahead_vllm.core.config import PROFILE_KEY, PUBLIC_FIELDS, Settings, resolve

if TYPE_CHECKING:
    from lookahead_vllm.core.draft_index import DraftIndexConfig


def lookahead(**fields: Any) -> dict[str, Any]:
    """``additional_config["lookahead"]`` for ``fields``: public ones as they
    are, the rest under ``"_profile"`` (omitted when there are none)."""
    public = {k: v for k, v in fields.items() if k in PUBLIC_FIELDS}
    knobs = {k: v for k, v in fields.items() if k not in PUBLIC_FIELDS}
    return {**public, PROFILE_KEY: knobs} if knobs else public


def lookahead_settings(platform: str = "cpu", num_speculative_tokens: int | None = None, **fields: Any) -> Settings:
    """The resolved settings of ``fields`` (see :func:`lookahead`)."""
    return resolve(lookahead(**fields), platform=platform, num_speculative_tokens=num_speculative_tokens)


def index_config(**overrides: Any) -> "DraftIndexConfig":
    """A draft index's settings as the default profile builds them, ``overrides`` replaced."""
    import dataclasses

    return dataclasses.replace(lookahead_settings().index_config(), **overrides)
