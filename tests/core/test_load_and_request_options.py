"""Load adaptation and per-request options: pure functions, no vLLM."""

from __future__ import annotations

import pytest

from lookahead_vllm.core.load import load_scaled_budget
from lookahead_vllm.core.request_options import draft_cap
from tests.settings import lookahead_settings


def test_budget_full_then_linear_then_zero():
    config = lookahead_settings(decoding_length=8, load_shrink_above=8, load_stop_at=32)
    budgets = [load_scaled_budget(config, n) for n in range(0, 40)]
    assert budgets[:9] == [8] * 9
    assert budgets[16] == 6 and budgets[31] == 1
    assert budgets[32:] == [0] * 8
    assert all(a >= b for a, b in zip(budgets, budgets[1:]))  # never grows with load


def test_load_knobs_validated():
    with pytest.raises(ValueError, match=r"_profile.load_stop_at=4: must be in \[5, 65537\]"):
        lookahead_settings(load_shrink_above=4, load_stop_at=4)
    with pytest.raises(ValueError, match=r"_profile.load_shrink_above=-1: must be an integer in \[0, 65536\]"):
        lookahead_settings(load_shrink_above=-1)
    assert load_scaled_budget(lookahead_settings(load_shrink_above=0, load_stop_at=1), 1) == 0


def test_load_limits_follow_the_platform():
    """The profile's limits: CPU 16/64, GPU 32/128."""
    cpu, gpu = lookahead_settings(decoding_length=8), lookahead_settings(decoding_length=8, platform="gpu")
    assert [load_scaled_budget(cpu, n) for n in (8, 16, 40, 63, 64)] == [8, 8, 4, 1, 0]
    assert [load_scaled_budget(gpu, n) for n in (16, 32, 80, 127, 128)] == [8, 8, 4, 1, 0]


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
    "extra, cap",
    [
        (None, 0),  # seeded sampling drafts nothing by default: the seed's text is plain's
        ({"kv_transfer_params": {"x": 1}}, 0),
        ({"lookahead_max_draft_tokens": 3}, 0),  # a cap does not opt in
        ({"lookahead_enabled": True}, None),  # the request opts in
        ({"lookahead_enabled": 1, "lookahead_max_draft_tokens": 3}, 3),
        ({"lookahead_enabled": False}, 0),
    ],
)
def test_draft_cap_of_seeded_sampling(extra, cap):
    assert draft_cap(extra, seeded=True) == cap


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"lookahead_enable": False}, r"unknown per-request lookahead key\(s\) \['lookahead_enable'\]"),
        ({"lookahead": {"enabled": False}}, r"unknown per-request lookahead key\(s\) \['lookahead'\]"),
        ({"Lookahead_enabled": False}, r"unknown per-request lookahead key\(s\) \['Lookahead_enabled'\]"),
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
