"""A logits processor plugin (vLLM's ``vllm.logits_processors`` entry points) in a lookahead engine.

The runner patch that serves ``min_p`` and ``logit_bias`` builds vLLM's logits processors as a plain engine does, and
so loads installed plugins too; vLLM's rejection sampler does not run them at draft positions, so while one is loaded
no request drafts. Here a plugin bans a token the text keeps wanting: plain never emits it, nor may lookahead.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from lookahead_lab.offline import engine_kwargs, find_proposers, shutdown_engine  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPT = ("Repeat this list ten times: red, green, blue, cherry, plum, red, green, blue, cherry, plum, red, green, "
          "blue, cherry, plum, red, green,")


def test_a_plugin_banned_token_is_never_drafted(smollm2_dir, monkeypatch):
    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.v1.sample import logits_processor
    from vllm.v1.sample.logits_processor import LogitsProcessor

    banned = AutoTokenizer.from_pretrained(smollm2_dir).encode(" cherry", add_special_tokens=False)[0]

    class BanToken(LogitsProcessor):
        def __init__(self, vllm_config, device, is_pin_memory):
            pass

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update) -> None:
            pass

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            logits[:, banned] = float("-inf")
            return logits

    # As if installed: what vLLM's builder loads from the entry points (both engines run in this process).
    monkeypatch.setattr(logits_processor, "_load_logitsprocs_plugins", lambda: [BanToken])
    params = SamplingParams(temperature=0.0, max_tokens=48)
    outputs, drafted = {}, None
    for method in ("plain", "lookahead"):
        llm = LLM(model=str(smollm2_dir), **engine_kwargs(method, k=8, max_model_len=512))
        try:
            outputs[method] = list(llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids)
            if method == "lookahead":
                (proposer,) = find_proposers(llm)
                drafted = proposer.metrics.draft_tokens
        finally:
            shutdown_engine(llm, keep_parallel_groups=True)  # the suite's shared engines stay alive
    assert banned not in outputs["plain"] and len(outputs["plain"]) == 48
    assert outputs["lookahead"] == outputs["plain"]
    assert drafted == 0  # no request drafted
