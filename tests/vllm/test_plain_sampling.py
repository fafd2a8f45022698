"""``min_p``, ``logit_bias`` and logits processor plugins in a lookahead engine (patches plain_sampling_params,
runner_logits_processors).

vLLM refuses both with any speculative method, because its rejection sampler does not apply them at draft
positions; a lookahead engine accepts them (the requests that use them draft nothing: the end-to-end test in
tests/e2e/test_request_options.py holds their tokens to plain vLLM's), and every other engine still refuses them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from lookahead_vllm.vllm import config as la_config  # noqa: E402
from lookahead_vllm.vllm import guards  # noqa: E402
from lookahead_vllm.vllm.proposer import samples_plain_only  # noqa: E402

pytestmark = pytest.mark.vllm

LOOKAHEAD = SimpleNamespace(method="custom_class", model=la_config.PROPOSER_PATH)
NGRAM = SimpleNamespace(method="ngram", model=None)
REFUSAL = "min_p and logit_bias sampling parameters are not yet supported"


@pytest.fixture(scope="module", autouse=True)
def _plugin():
    from lookahead_vllm.vllm.plugin import register

    register()


def _params(**kwargs):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=8, **kwargs)


@pytest.mark.parametrize("kwargs", [{"min_p": 0.1}, {"logit_bias": {5: -3.0}}, {"min_p": 0.2, "logit_bias": {7: 1.0}}])
def test_lookahead_accepts_what_other_methods_refuse(kwargs):
    params = _params(temperature=0.7, **kwargs)
    assert samples_plain_only(params)
    params._validate_spec_decode(LOOKAHEAD)  # no error
    assert params.min_p == kwargs.get("min_p", 0.0) and params.logit_bias == kwargs.get("logit_bias")  # untouched
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match=REFUSAL):
        params._validate_spec_decode(NGRAM)


def test_other_requests_are_not_plain_only():
    assert not samples_plain_only(_params(temperature=0.7, min_p=0.0, logit_bias={}))
    assert not samples_plain_only(_params(temperature=0.0))


def _input_batch(*kinds):
    """A runner's input batch holding logits processors of ``kinds`` (built without __init__: the check reads only
    their types)."""
    from vllm.v1.sample.logits_processor.state import LogitsProcessors

    procs = LogitsProcessors()
    for kind in kinds:
        procs.non_argmax_invariant.append(kind.__new__(kind))
    return SimpleNamespace(logitsprocs=procs)


def test_input_batch_without_the_processors_is_refused():
    from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor, MinPLogitsProcessor,
                                                         MinTokensLogitsProcessor)

    assert guards.check_logits_processors(_input_batch(MinPLogitsProcessor, LogitBiasLogitsProcessor,
                                                       MinTokensLogitsProcessor)) == []
    with pytest.raises(RuntimeError, match=r"lacks vLLM's \['LogitBiasLogitsProcessor', 'MinPLogitsProcessor'\]"):
        guards.check_logits_processors(_input_batch(MinTokensLogitsProcessor))  # what vLLM builds for ngram, suffix


def test_logits_processor_plugins_stop_every_request_drafting(caplog):
    """An installed ``vllm.logits_processors`` plugin is loaded with vLLM's own processors (the runner patch builds
    them as a plain engine does), but vLLM's rejection sampler runs only min_tokens at draft positions: a draft token
    the plugin forbids would be accepted. While one is loaded, no request drafts, so every token is sampled where the
    plugin applies, as in plain vLLM."""
    import logging

    import numpy as np
    from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, LogitsProcessor

    from lookahead_lab.standalone import standalone_proposer
    from tests.settings import lookahead

    class BanToken(LogitsProcessor):  # as a plugin's (the check reads only its type)
        def __init__(self, vllm_config, device, is_pin_memory):
            pass

        def is_argmax_invariant(self):
            return False

        def update_state(self, batch_update):
            pass

        def apply(self, logits):
            return logits

    with caplog.at_level(logging.WARNING):
        assert guards.check_logits_processors(_input_batch(*BUILTIN_LOGITS_PROCESSORS, BanToken)) == [
            "test_logits_processor_plugins_stop_every_request_drafting.<locals>.BanToken"]
    assert any("no request drafts" in r.getMessage() for r in caplog.records)

    def drafts(plugins):
        p = standalone_proposer(4, 64, lookahead(cost_free_tokens=0))
        text = [1, 2, 3, 4, 5] * 3 + [1]
        batch = SimpleNamespace(req_ids=["a"], num_prompt_tokens=np.array([15]),
                                logitsprocs=_input_batch(*BUILTIN_LOGITS_PROCESSORS, *plugins).logitsprocs)
        p.on_step(batch, [], None)
        p.on_new_requests([SimpleNamespace(req_id="a", sampling_params=None)])
        tokens = np.zeros((1, 64), np.int64)
        tokens[0, :len(text)] = text
        return p.propose([[1]], np.array([len(text)]), tokens), p.metrics.skipped_request_steps["request"]

    assert drafts(()) == ([[2, 3, 4, 5]], 0)
    assert drafts((BanToken,)) == ([[]], 1)
