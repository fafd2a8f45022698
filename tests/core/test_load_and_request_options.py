"""Load adaptation and per-request options: pure functions, no vLLM."""

from __future__ import annotations

import pytest

from lookahead_vllm.core.config import LookaheadConfig
from lookahead_vllm.core.load import load_limits, load_scaled_budget
from lookahead_vllm.core.request_options import draft_cap


def test_budget_full_then_linear_then_zero():
    config = LookaheadConfig(decoding_length=8, load_shrink_above=8, load_stop_at=32)
    budgets = [load_scaled_budget(config, n) for n in range(0, 40)]
    assert budgets[:9] == [8] * 9
    assert budgets[16] == 6 and budgets[31] == 1
    assert budgets[32:] == [0] * 8
    assert all(a >= b for a, b in zip(budgets, budgets[1:]))  # never grows with load


def test_load_fields_validated():
    with pytest.raises(ValueError, match=r"load_stop_at=4: must be > load_shrink_above \(4\)"):
        LookaheadConfig(load_shrink_above=4, load_stop_at=4)
    with pytest.raises(ValueError, match=r"load_shrink_above=-2: must be -1 \(platform default\) or in \[0, 65536\]"):
        LookaheadConfig(load_shrink_above=-2)
    with pytest.raises(ValueError, match=r"load_stop_at=0: must be -1 \(platform default\) or in \[1, 65537\]"):
        LookaheadConfig(load_stop_at=0)
    assert load_scaled_budget(LookaheadConfig(load_shrink_above=0, load_stop_at=1), 1) == 0


def test_load_limits_follow_the_platform():
    """-1 takes the platform's limits (CPU 8/16, GPU 32/128); a value given
    for one of the two keeps the other on the right side of it."""
    config = LookaheadConfig(decoding_length=8)
    assert load_limits(config, "cpu") == (8, 16) and load_limits(config, "gpu") == (32, 128)
    assert [load_scaled_budget(config, n, "cpu") for n in (8, 12, 16)] == [8, 4, 0]
    assert [load_scaled_budget(config, n, "gpu") for n in (16, 32, 80, 127, 128)] == [8, 8, 4, 1, 0]
    assert load_limits(LookaheadConfig(load_stop_at=20), "gpu") == (19, 20)
    assert load_limits(LookaheadConfig(load_stop_at=20), "cpu") == (8, 20)
    assert load_limits(LookaheadConfig(load_shrink_above=200), "gpu") == (200, 201)
    assert load_limits(LookaheadConfig(load_shrink_above=2), "cpu") == (2, 16)


@pytest.mark.parametrize(
    "extra, cap",
    [
        (None, None),
        ({"kv_transfer_params": {"x": 1}}, None),  # other extensions' keys are not ours
        ({"lookahead_enabled": True}, None),
        ({"lookahead_enabled": False}, 0),
        ({"lookahead_enabled": 0}, 0),  # vllm_xargs sends JSON false as 0
        ({"lookahead_max_draft_tokens": 3}, 3),
        ({"lookahead_max_draft_tokens": 3, "lookahead_enabled": False}, 0),
    ],
)
def test_draft_cap(extra, cap):
    assert draft_cap(extra) == cap


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"lookahead_enable": False}, r"unknown per-request lookahead key\(s\) \['lookahead_enable'\]"),
        ({"lookahead": {"enabled": False}}, r"unknown per-request lookahead key\(s\) \['lookahead'\]"),
        ({"lookahead_enabled": "no"}, r"lookahead_enabled='no': must be true or false"),
        ({"lookahead_enabled": 2}, r"lookahead_enabled=2: must be true or false"),
        ({"lookahead_max_draft_tokens": -1}, r"lookahead_max_draft_tokens=-1: must be an integer in \[0, 256\]"),
        ({"lookahead_max_draft_tokens": 2.5}, r"lookahead_max_draft_tokens=2.5: must be an integer"),
        ({"lookahead_max_draft_tokens": "4"}, r"lookahead_max_draft_tokens='4': must be an integer"),
    ],
)
def test_bad_request_options_named(extra, message):
    with pytest.raises(ValueError, match=message):
        draft_cap(extra)
