"""Per-request lookahead control, carried in ``SamplingParams.extra_args``.

vLLM has no per-request speculation switch; these keys give one. Over HTTP
they travel in the request body's ``vllm_xargs`` (flat keys, numbers or
strings: JSON ``true``/``false`` arrive as 1/0), offline in
``SamplingParams(extra_args=...)``:

  lookahead_enabled           true/false (or 1/0); false = never draft for
                              this request (default true, except for seeded
                              sampling: below)
  lookahead_max_draft_tokens  0..256: cap on this request's draft nodes per
                              step (0 = off); the engine's decoding_length
                              and load adaptation still apply on top

A request that samples with a seed (temperature > 0 and ``seed`` set) drafts
nothing unless it sets ``lookahead_enabled`` true itself: its text is then plain
vLLM's for that seed, every time. vLLM's rejection sampler draws one uniform per
draft token from the request's generator, and lookahead's drafts depend on other
requests' outputs and on measured step times, so a drafted seeded request keeps
the target distribution but not the text a seed names.

Every other key starting with ``lookahead`` (in any case) is rejected, so a
typo cannot silently leave speculation on. Example::

    SamplingParams(max_tokens=64, extra_args={"lookahead_max_draft_tokens": 2})
    client.completions.create(..., extra_body={"vllm_xargs": {"lookahead_enabled": False}})
"""

from __future__ import annotations

from typing import Any, Mapping

ENABLED = "lookahead_enabled"
MAX_DRAFT_TOKENS = "lookahead_max_draft_tokens"
KEYS = (ENABLED, MAX_DRAFT_TOKENS)
MAX_CAP = 256  # LookaheadConfig.decoding_length's upper bound (its schema's maximum)


def draft_cap(extra_args: Mapping[str, Any] | None, seeded: bool = False) -> int | None:
    """This request's cap on draft nodes per step (None = no cap, 0 = off); ``seeded``: the
    request samples with a seed (off unless ``lookahead_enabled`` says otherwise).

    Raises ``ValueError`` naming the key, the value and what is allowed.
    """
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
