"""Per-request lookahead control in ``SamplingParams.extra_args`` (README's per-request table): ``lookahead_enabled``
and ``lookahead_max_draft_tokens``; over HTTP in the body's ``vllm_xargs`` (flat keys: JSON ``true``/``false``
arrive as 1/0). Any other key starting with ``lookahead`` (in any case) is rejected, so a typo cannot leave
speculation on. A seeded request drafts nothing unless it sets ``lookahead_enabled`` itself: the rejection sampler
draws one uniform per draft token from its generator, and drafts depend on other requests and step times, so
drafting keeps the target distribution but not the text the seed names.
"""

from __future__ import annotations

from typing import Any, Mapping

ENABLED = "lookahead_enabled"
MAX_DRAFT_TOKENS = "lookahead_max_draft_tokens"
KEYS = (ENABLED, MAX_DRAFT_TOKENS)
MAX_CAP = 256  # LookaheadConfig.decoding_length's upper bound (its schema's maximum)


def draft_cap(extra_args: Mapping[str, Any] | None, seeded: bool = False) -> int | None:
    """This request's cap on draft nodes per step (None = no cap, 0 = off); ``seeded``: the request samples with a
    seed (off unless ``lookahead_enabled`` says otherwise). ValueError names the key, the value and what is allowed."""
    ours = {k: v for k, v in (extra_args or {}).items() if isinstance(k, str) and k.lower().startswith("lookahead")}
    unknown = sorted(set(ours) - set(KEYS))
    if unknown:
        raise ValueError(f"unknown per-request lookahead key(s) {unknown}; allowed keys: {list(KEYS)}")
    enabled = _as_bool(ENABLED, ours[ENABLED]) if ENABLED in ours else not seeded
    cap = None if enabled else 0
    if MAX_DRAFT_TOKENS in ours:
        value = ours[MAX_DRAFT_TOKENS]
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_CAP:
            raise ValueError(f"{MAX_DRAFT_TOKENS}={value!r}: must be an integer in [0, {MAX_CAP}]")
        cap = value if cap is None else min(cap, value)
    return cap


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):  # vllm_xargs turns JSON booleans into 0/1
        return bool(value)
    raise ValueError(f"{name}={value!r}: must be true or false (or 1/0)")
