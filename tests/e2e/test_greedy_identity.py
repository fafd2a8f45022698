"""Greedy lossless: lookahead's token ids equal plain vLLM's, on a real trained model.

SmolLM2-135M-Instruct (fp32), 20 HumanEval + 10 MT-Bench prompts, batch 1 and
batch 8, plus a floor on mean acceptance length so the drafts are really used.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lookahead_vllm.vllm.offline import count_mismatches, generate

from .conftest import MAX_TOKENS, plain_run

pytestmark = pytest.mark.vllm

# Floors on vLLM's mean acceptance length (1 + accepted / drafts) at
# MAX_TOKENS=64; measured values are recorded in the issue notes.
MAL_FLOOR = {"humaneval": 2.0, "mtbench": 1.5}


def _greedy(max_tokens: int = MAX_TOKENS):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def _plain(engines, prompts, dataset, bs):
    return plain_run(engines, prompts[dataset], _greedy(), bs, (dataset, "greedy"))


@pytest.mark.parametrize("bs", [1, 8])
@pytest.mark.parametrize("dataset", ["humaneval", "mtbench"])
def test_lookahead_greedy_identical_to_plain(engines, prompts, dataset, bs):
    plain = _plain(engines, prompts, dataset, bs)
    ours = generate(engines.get("lookahead"), prompts[dataset], _greedy(), bs)
    assert len(ours.token_ids) == len(prompts[dataset])
    assert count_mismatches(plain.token_ids, ours.token_ids) == 0
    assert ours.num_drafts > 0
    assert ours.mean_acceptance_length >= MAL_FLOOR[dataset], ours.mean_acceptance_length


def test_step_draft_budget_honoured_and_lossless(engines, prompts):
    from lookahead_vllm.vllm.proposer import find_proposers

    plain = _plain(engines, prompts, "humaneval", 8)
    llm = engines.get("lookahead-budget", lookahead={"step_draft_budget": 4})
    ours = generate(llm, prompts["humaneval"], _greedy(), 8)
    assert count_mismatches(plain.token_ids, ours.token_ids) == 0
    (proposer,) = find_proposers(llm)
    assert proposer.stats.max_step_draft_tokens <= 4
    assert ours.num_drafts > 0


def test_proposer_state_released_after_requests_finish(engines, prompts):
    from lookahead_vllm.vllm.proposer import find_proposers

    llm = engines.get("lookahead")
    generate(llm, prompts["mtbench"][:3], _greedy(8), 3)
    generate(llm, prompts["mtbench"][:1], _greedy(4), 1)  # a step that reports the finished ids
    (proposer,) = find_proposers(llm)
    assert len(proposer.trie.active_requests) <= 1
    stats = proposer.stats.as_dict()
    assert stats["draft_tokens"] > 0 and stats["drafter_ms_per_step"] > 0


def test_aborted_request_prompt_eliminated(engines, prompts):
    """An aborted request's prompt counts leave the trie (finished ones are covered above)."""
    from vllm import SamplingParams

    from lookahead_vllm.vllm.proposer import find_proposers

    llm = engines.get("lookahead-abort")
    engine = llm.llm_engine
    (proposer,) = find_proposers(llm)
    engine.add_request("abort-me", prompts["mtbench"][0], SamplingParams(temperature=0.0, max_tokens=200))
    for _ in range(4):
        engine.step()
    (live,) = proposer.trie.active_requests
    assert live.startswith("abort-me")
    slot = proposer.trie._requests[live].slot
    assert _nodes_tagged(proposer.trie, slot) > 0
    engine.abort_request(["abort-me"])
    engine.add_request("next", prompts["mtbench"][1], SamplingParams(temperature=0.0, max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    assert not any(r.startswith("abort-me") for r in proposer.trie.active_requests)
    assert _nodes_tagged(proposer.trie, slot) == 0


def _nodes_tagged(trie, slot: int) -> int:
    from lookahead_vllm.core.trie import _iter_nodes

    return sum(1 for n in _iter_nodes(trie.root) if n.prompt and slot in n.prompt)


_UNUSED_SCRIPT = r"""
import json, os, sys
from vllm import LLM, SamplingParams
from vllm.config import SpeculativeConfig
from lookahead_vllm.vllm.offline import engine_kwargs
if __name__ == "__main__":
    model, path = sys.argv[1], sys.argv[2]
    prompts = json.load(open(path))
    llm = LLM(model=model, **engine_kwargs("plain"))
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=int(sys.argv[3])), use_tqdm=False)
    patched = hasattr(SpeculativeConfig.__init__, "__lookahead_original__")
    print("RESULT " + json.dumps({"patched": patched, "ids": [list(o.outputs[0].token_ids) for o in outs]}))
"""


def test_plugin_installed_but_unused_identical_to_without_plugin(engines, prompts, smollm2_dir, tmp_path):
    """Plain vLLM with our plugin loaded == plain vLLM with plugins disabled (subprocess)."""
    from vllm.config import SpeculativeConfig

    subset = prompts["humaneval"][:8]
    with_plugin = generate(engines.get("plain"), subset, _greedy(), 8)
    assert hasattr(SpeculativeConfig.__init__, "__lookahead_original__"), "plugin not active in-process"
    (tmp_path / "p.json").write_text(json.dumps(subset))
    (tmp_path / "run.py").write_text(_UNUSED_SCRIPT)
    env = dict(os.environ, VLLM_PLUGINS="no-such-plugin")
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "run.py"), smollm2_dir, str(tmp_path / "p.json"), str(MAX_TOKENS)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result["patched"] is False, "plugin must not load with VLLM_PLUGINS filtering it out"
    assert result["ids"] == with_plugin.token_ids


@pytest.mark.slow
@pytest.mark.parametrize("bs", [1, 8])
def test_lookahead_greedy_identical_256_tokens(engines, prompts, bs):
    every = prompts["humaneval"] + prompts["mtbench"]
    plain = generate(engines.get("plain"), every, _greedy(256), bs)
    ours = generate(engines.get("lookahead"), every, _greedy(256), bs)
    assert count_mismatches(plain.token_ids, ours.token_ids) == 0
