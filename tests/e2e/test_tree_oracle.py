"""Tree verification against HF transformers as the oracle (SmolLM2, fp32).

- node logits: every tree node's logits in the engine equal a plain forward
  over context + that node's ancestors + the node;
- compaction: after a tree step, the committed sequence's K/V (all layers) at
  the accepted positions equal a plain forward's K/V over the committed tokens.

Negative controls (slow) run the same checks with the mask / compaction
switched off; tests/e2e/test_tree_verify.py shows greedy identity breaks
without each piece in the default suite.
"""

from __future__ import annotations

import pytest
import torch

from lookahead_lab.offline import find_proposers, generate
from lookahead_lab.tree_recorder import recording

pytestmark = pytest.mark.vllm

# fp32 vLLM vs fp32 HF on CPU: different kernels and summation order.
LOGITS_ATOL = 2e-3
KV_ATOL = 1e-3
MAX_CHECKED = 6


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, torch_dtype=torch.float32).eval()


def _record(engines, prompts, name, **lookahead):
    from vllm import SamplingParams

    llm = engines.get(name, lookahead={"draft_shape": "hier", **lookahead})
    (verifier,) = [p.verifier for p in find_proposers(llm)]
    with recording(verifier) as entries:
        generate(llm, prompts["humaneval"][:3], SamplingParams(temperature=0.0, max_tokens=40), 1)
    return [e for e in entries if "logits" in e]


@torch.no_grad()
def _node_logit_errors(hf_model, entries) -> list[float]:
    errors = []
    for entry in entries[:MAX_CHECKED]:
        tree = entry["plan"].tree
        for row in range(len(tree) + 1):
            path = [tree.tokens[n] for n in tree.path_to(row - 1)] if row else []
            ids = torch.tensor([entry["context"] + path])
            expected = hf_model(ids).logits[0, -1]
            errors.append((entry["logits"][row] - expected).abs().max().item())
    return errors


@torch.no_grad()
def _kv_errors(hf_model, entries) -> list[float]:
    """Max |K/V engine - K/V HF| over layers, per entry that moved KV."""
    errors = []
    moved = [e for e in entries if _off_chain(e)]
    for entry in moved[:MAX_CHECKED]:
        accepted = entry["output"][:-1]
        root_pos = len(entry["context"]) - 1
        ids = torch.tensor([entry["context"] + accepted])
        past = hf_model(ids, use_cache=True).past_key_values
        worst = 0.0
        for layer, (k, v) in enumerate(entry["kv"]):
            hf_k, hf_v = _layer_kv(past, layer)
            span = slice(root_pos + 1, root_pos + 1 + len(accepted))
            worst = max(worst, (k - hf_k[0, :, span].transpose(0, 1)).abs().max().item())
            worst = max(worst, (v - hf_v[0, :, span].transpose(0, 1)).abs().max().item())
        errors.append(worst)
    return errors


def _layer_kv(past, layer):
    if hasattr(past, "layers"):
        return past.layers[layer].keys, past.layers[layer].values
    return past[layer][0], past[layer][1]


def _off_chain(entry) -> bool:
    """Whether an accepted node was not on the leading chain (so KV had to move)."""
    tree = entry["plan"].tree
    accepted = len(entry["output"]) - 1
    if accepted == 0:
        return False
    # Find the accepted nodes again by walking the emitted tokens.
    node, nodes = -1, []
    kids = tree.children()
    for tok in entry["output"][:-1]:
        node = next(c for c in kids[node] if tree.tokens[c] == tok)
        nodes.append(node)
    return any(n != j for j, n in enumerate(nodes))


def test_node_logits_and_compacted_kv_match_hf(engines, prompts, hf_model):
    entries = _record(engines, prompts, "lookahead-tree-oracle")
    assert len(entries) >= 4, "too few tree steps recorded"
    errors = _node_logit_errors(hf_model, entries)
    assert max(errors) < LOGITS_ATOL, f"node logits differ from HF by {max(errors):.2e}"
    kv = _kv_errors(hf_model, entries)
    assert kv, "no accepted off-chain node, compaction not exercised"
    assert max(kv) < KV_ATOL, f"compacted KV differs from HF by {max(kv):.2e}"


@pytest.mark.slow
def test_oracle_detects_missing_mask_and_compaction(engines, prompts, hf_model):
    """The same checks fail when the tree mask / compaction is switched off."""
    no_mask = _record(engines, prompts, "lookahead-tree-oracle-nomask", _profile={"debug_disable": ["mask"]})
    assert max(_node_logit_errors(hf_model, no_mask)) > 10 * LOGITS_ATOL
    no_compaction = _record(engines, prompts, "lookahead-tree-oracle-nocompact",
                            _profile={"debug_disable": ["compaction"]})
    kv = _kv_errors(hf_model, no_compaction)
    assert kv and max(kv) > 10 * KV_ATOL
