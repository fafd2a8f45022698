"""Plugin wiring: method routing, config validation before the engine starts, CPU fixes."""

from __future__ import annotations

import pytest
torch = pytest.importorskip("torch")

from lookahead_vllm.ops.sampling import expand_kernel_impl

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", autouse=True)
def _plugin():
    from lookahead_vllm.vllm.plugin import register

    register()


def _engine_config(model: str, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, enforce_eager=True, dtype="float32", max_model_len=512, **kwargs).create_engine_config()


def test_plugin_registered_as_entry_point():
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("lookahead") == "lookahead_vllm.vllm.plugin:register"


@pytest.mark.parametrize("spec", [{"method": "lookahead"}, {"model": "lookahead"}])
def test_method_routes_to_proposer(tiny_llama_dir, spec):
    from lookahead_vllm.vllm.config import PROPOSER_PATH

    cfg = _engine_config(tiny_llama_dir, speculative_config=dict(spec))
    assert cfg.speculative_config.method == "custom_class"
    assert cfg.speculative_config.model == PROPOSER_PATH
    assert cfg.speculative_config.num_speculative_tokens == 16  # DEFAULT_DECODING_LENGTH


def test_default_draft_slots_follow_the_platform(monkeypatch):
    """No num_speculative_tokens given: 16 on the CPU, 8 on a GPU (every GPU step is filled to k
    tokens a row, so k is the step's price); one the user gives is kept on either."""
    from lookahead_vllm.vllm import config

    for platform, k in (("cpu", 16), ("gpu", 8)):
        monkeypatch.setattr(config, "current_platform_name", lambda p=platform: p)
        assert config.translate_speculative_kwargs({"method": "lookahead"})["num_speculative_tokens"] == k
        assert config.translate_speculative_kwargs({"method": "lookahead", "num_speculative_tokens": 5})[
            "num_speculative_tokens"] == 5


@pytest.mark.parametrize("disable", [False, True])
def test_the_periodic_line_follows_disable_log_stats(tiny_llama_dir, disable):
    """``--disable-log-stats`` (offline ``LLM``'s default) lives on EngineArgs, not in the VllmConfig the
    workers get: the plugin carries it there, and the proposer then logs no periodic line; a plain
    engine's config gets nothing."""
    import math

    from lookahead_lab.standalone import engine_free_config
    from lookahead_vllm.vllm.config import LOG_STATS_KEY
    from lookahead_vllm.vllm.proposer import LookaheadProposer

    cfg = _engine_config(tiny_llama_dir, speculative_config={"method": "lookahead"}, disable_log_stats=disable)
    assert cfg.additional_config.get(LOG_STATS_KEY, True) is not disable
    assert LOG_STATS_KEY not in _engine_config(tiny_llama_dir, disable_log_stats=True).additional_config
    config = engine_free_config(16, 512)
    config.additional_config = {**config.additional_config, **{k: v for k, v in cfg.additional_config.items()
                                                                if k == LOG_STATS_KEY}}
    assert math.isfinite(LookaheadProposer(config)._interval_log.interval_s) is not disable


def test_settings_resolved_once_and_carried_in_the_engine_config(tiny_llama_dir):
    """The VllmConfig patch resolves the settings and writes them into the
    config the workers get; the proposer reads them back unchanged."""
    from lookahead_vllm.core.config import PROFILE_KEY, resolve
    from lookahead_vllm.vllm.config import current_platform_name, engine_settings

    user = {"draft_shape": "hier", PROFILE_KEY: {"branch_length": 8}}
    cfg = _engine_config(tiny_llama_dir, speculative_config={"method": "lookahead", "num_speculative_tokens": 12},
                         additional_config={"lookahead": user})
    settings = engine_settings(cfg)
    assert settings == resolve(user, platform=current_platform_name(), num_speculative_tokens=12)
    assert (settings.decoding_length, settings.profile.branch_length) == (12, 8)
    assert user == {"draft_shape": "hier", PROFILE_KEY: {"branch_length": 8}}  # the caller's dict untouched
    assert cfg.compute_hash()  # vLLM hashes additional_config as JSON
    with pytest.raises(ValueError, match=r"not resolved where the engine config was built"):
        engine_settings(_engine_config(tiny_llama_dir))


def test_plain_config_untouched(tiny_llama_dir):
    cfg = _engine_config(tiny_llama_dir)
    assert cfg.speculative_config is None
    ngram = _engine_config(tiny_llama_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert ngram.speculative_config.method == "ngram"


@pytest.mark.parametrize(
    "lookahead, k, message",
    [
        ({"decoding_length": 0}, 8, r"decoding_length=0: must be an integer in \[1, 256\]"),
        ({"decoding_length": 16}, 8, r"decoding_length=16: must be <= speculative_config.num_speculative_tokens=8"),
        ({"draft_shape": "star"}, 8, r"draft_shape='star': must be one of"),
        ({"cost_marginal_tokens": 0.5}, 8, r"cost_marginal_tokens=0.5: must be -1 \(measured online\) or in"),
        ({"snapshot_path": None}, 8, r"snapshot_path=None: must be a file path"),
        ({"branch_length": 1}, 8, r"branch_length: no longer a lookahead field; it is internal now"),
        ({"index_upkeep": "thread"}, 8, r"index_upkeep: no longer a lookahead field; internal now"),
        ({"_profile": {"branch_length": 1}}, 8, r"_profile.branch_length=1: must be an integer in \[2, 128\]"),
        ({"_profile": {"max_match_length": 40}}, 8, r"_profile.max_match_length=40: must be in \[1, 11\]"),
        ({"_profile": {"insert_prompt": 1}}, 8, r"_profile.insert_prompt=1: must be true or false"),
        ({"bogus": 1}, 8, r"unknown lookahead field\(s\) \['bogus'\]"),
        ({"snapshot_path": "/tmp/la.jsonl", "warm_start": "/tmp/../tmp/la.jsonl"}, 8,
         r"snapshot_path='/tmp/la.jsonl' names the warm_start file"),
    ],
)
def test_bad_lookahead_config_rejected_before_engine(tiny_llama_dir, lookahead, k, message):
    with pytest.raises(ValueError, match=message):
        _engine_config(
            tiny_llama_dir,
            speculative_config={"method": "lookahead", "num_speculative_tokens": k},
            additional_config={"lookahead": lookahead},
        )


@pytest.mark.parametrize(
    "spec, additional, unread",
    [
        ({"method": "ngram", "num_speculative_tokens": 3}, {"lookahead": {"draft_shape": "hier"}},
         r"additional_config\['lookahead'\] is not read: this engine's speculative method is not lookahead"),
        (None, {"lookahead": {}}, r"is not read: this engine's speculative method is not lookahead"),
        ({"method": "lookahead"}, {"Lookahead": {"draft_shape": "hier"}},
         r"additional_config key\(s\) \['Lookahead'\] are not read"),
        ({"method": "ngram", "num_speculative_tokens": 3}, {"look_ahead": {}}, r"\['look_ahead'\] are not read"),
        ({"method": "lookahead"}, {"lookahead": {"draft_shape": "hier"}}, None),
        (None, {"other_plugin": 1}, None),
    ],
)
def test_unread_lookahead_settings_are_warned_about(tiny_llama_dir, monkeypatch, spec, additional, unread):
    """Lookahead settings that no engine reads (the method is not lookahead, or a near-miss
    key) are named in a warning rather than dropped without a word."""
    import re

    from lookahead_vllm.vllm import patches

    said = []
    monkeypatch.setattr(patches.logger, "warning_once", lambda msg, *args: said.append(msg % args))
    _engine_config(tiny_llama_dir, speculative_config=spec, additional_config=additional)
    if unread is None:
        assert said == []
    else:
        assert said and all(re.search(unread, m) for m in said)


def test_non_mapping_lookahead_config_rejected(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"additional_config\['lookahead'\] must be a mapping"):
        _engine_config(tiny_llama_dir, speculative_config={"method": "lookahead"}, additional_config={"lookahead": [1]})


def test_non_dict_additional_config_refused_with_lookahead(tiny_llama_dir):
    """vLLM takes any hashable object as additional_config; lookahead carries its resolved settings in a dict there,
    so it refuses one it would have replaced (the object was lost). Other methods keep it."""

    class Other:
        def compute_hash(self) -> str:
            return "other"

    with pytest.raises(ValueError, match=r"additional_config is a Other: lookahead needs a dict"):
        _engine_config(tiny_llama_dir, speculative_config={"method": "lookahead"}, additional_config=Other())
    assert isinstance(_engine_config(tiny_llama_dir, additional_config=Other()).additional_config, Other)


def test_lookahead_with_draft_model_rejected(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"speculative_config.model='some/model': method 'lookahead' needs no draft"):
        _engine_config(tiny_llama_dir, speculative_config={"method": "lookahead", "model": "some/model"})


def test_bad_lookahead_config_rejected_by_llm_constructor(tiny_llama_dir):
    from vllm import LLM

    with pytest.raises(ValueError, match=r"decoding_length=0: must be an integer in \[1, 256\]"):
        LLM(
            model=tiny_llama_dir,
            enforce_eager=True,
            speculative_config={"method": "lookahead"},
            additional_config={"lookahead": {"decoding_length": 0}},
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expand_kernel_matches_definition(dtype):
    values = torch.tensor([0.5, 2.0, -1.0]).to(dtype)
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)
    out = torch.full((7,), 9, dtype=dtype)
    expand_kernel_impl(out, values, cu, replace_from=0, replace_to=3)
    expected = torch.tensor([values[0], values[0], values[2], values[2], values[2], 9, 9], dtype=dtype)
    if dtype != torch.float32:  # 0.5 -> int 0 -> replaced by 3
        expected[:2] = 3
    assert torch.equal(out, expected)


def test_cpu_expand_kernel_patched():
    from vllm.utils import cpu_triton_utils

    assert cpu_triton_utils._expand_kernel_impl is expand_kernel_impl
