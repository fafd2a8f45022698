"""Helpers for offline ``LLM`` runs: engine kwargs per method, batched generation,
the proposers of an in-process engine.

Used by the demo, the benchmarks and the end-to-end tests so that every method
is built the same way::

    llm = LLM(model=path, **engine_kwargs("lookahead", k=8, lookahead={"draft_shape": "one"}))
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from lookahead_vllm.serve import CPU_ENV as SERVER_CPU_ENV

if TYPE_CHECKING:
    from lookahead_vllm.vllm.proposer import LookaheadProposer

# The server's CPU defaults (lookahead_vllm.serve.CPU_ENV) plus one process
# (the engine in-process, so its proposers can be inspected) and no Hugging
# Face Hub access; must be applied before vllm is imported.
CPU_ENV: dict[str, str] = {
    **SERVER_CPU_ENV,
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


def apply_cpu_env(**extra: str) -> None:
    """Set :data:`CPU_ENV` (and ``extra``) where the caller has not set them."""
    for key, value in {**CPU_ENV, **extra}.items():
        os.environ.setdefault(key, value)

# Methods understood by engine_kwargs: "plain", "lookahead", "ngram<k>", "suffix".
CPU_DEFAULTS: dict[str, Any] = {
    "enforce_eager": True,
    "dtype": "float32",
    "max_model_len": 2048,
    "seed": 0,
    "disable_log_stats": False,
}
# Added for speculative methods only (vLLM rejects it without speculation).
SPEC_DEFAULTS: dict[str, Any] = {"per_request_spec_decode_metrics": "summary"}


def default_dtype() -> str:
    """float32 on CPUs (exact, and the CPU kernels' fast path); bfloat16 where CUDA is visible,
    since FlashAttention (the GPU backend tree verification wraps) takes bf16/fp16 only."""
    import torch

    return "bfloat16" if torch.cuda.is_available() else "float32"


def engine_kwargs(method: str, k: int = 8, lookahead: dict | None = None, **overrides: Any) -> dict[str, Any]:
    """``LLM(...)`` keyword arguments for ``method`` with ``k`` draft tokens (``dtype``: :func:`default_dtype`)."""
    kwargs = dict(CPU_DEFAULTS)
    if "dtype" not in overrides:
        kwargs["dtype"] = default_dtype()
    kwargs.update(overrides)
    if method == "plain":
        return kwargs
    for key, value in SPEC_DEFAULTS.items():
        kwargs.setdefault(key, value)
    if method == "lookahead":
        kwargs["speculative_config"] = {"method": "lookahead", "num_speculative_tokens": k}
        kwargs["additional_config"] = {"lookahead": dict(lookahead or {})}
    elif method == "ngram_gpu":  # bench's baselines.baseline_config gives its lookup window
        kwargs["speculative_config"] = {"method": "ngram_gpu", "num_speculative_tokens": k}
    elif method.startswith("ngram"):
        k = int(method[5:] or k)
        # vLLM's own defaults for the lookup window (prompt_lookup_min = max = 5).
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": k}
    elif method == "suffix":
        kwargs["speculative_config"] = {"method": "suffix", "num_speculative_tokens": k}
    else:
        raise ValueError(f"method={method!r}: must be 'plain', 'lookahead', 'ngram<k>', 'ngram_gpu' or 'suffix'")
    return kwargs


@dataclass
class GenerationResult:
    # Output token ids per prompt, in prompt order.
    token_ids: list[list[int]]
    # Output texts per prompt.
    texts: list[str]
    # Wall seconds per generate() call, in call order.
    seconds: list[float] = field(default_factory=list)
    # Verify steps that carried drafts, and draft tokens accepted / proposed.
    num_drafts: int = 0
    num_accepted: int = 0
    num_draft_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def mean_acceptance_length(self) -> float:
        """vLLM's definition: 1 + accepted / drafts (1.0 when nothing was drafted)."""
        return 1.0 + self.num_accepted / self.num_drafts if self.num_drafts else 1.0


def generate(llm: Any, prompts: Sequence[Any], params: Any, batch_size: int) -> GenerationResult:
    """Generate ``prompts`` in chunks of ``batch_size``; collect ids, times, acceptance.

    ``params``: one ``SamplingParams`` for all, or a list with one per prompt.
    """
    result = GenerationResult([], [])
    for lo in range(0, len(prompts), batch_size):
        chunk = list(prompts[lo:lo + batch_size])
        start = time.perf_counter()
        chunk_params = params[lo:lo + batch_size] if isinstance(params, list) else params
        outputs = llm.generate(chunk, chunk_params, use_tqdm=False)
        result.seconds.append(time.perf_counter() - start)
        for out in outputs:
            completion = out.outputs[0]
            result.token_ids.append(list(completion.token_ids))
            result.texts.append(completion.text)
            _add_spec_metrics(result, getattr(completion, "spec_decode_metrics", None))
    return result


def _add_spec_metrics(result: GenerationResult, metrics: Any) -> None:
    if metrics is None:
        return
    hist = list(metrics.histogram)
    result.num_drafts += sum(hist)
    result.num_accepted += sum(j * n for j, n in enumerate(hist))
    result.num_draft_tokens += int(metrics.num_draft_tokens)


def shutdown_engine(llm: Any, keep_parallel_groups: bool = False) -> None:
    """Shut an in-process ``LLM`` down to free its memory.

    In-process engines share vLLM's global parallel groups, and an engine's
    shutdown destroys them (``EngineCore.shutdown`` ends in
    ``cleanup_dist_env_and_memory``): an engine that is still alive then fails
    its next step ("pipeline model parallel group is not initialized").
    ``keep_parallel_groups=True`` leaves the groups to the engines still alive;
    the next engine build reuses them.
    """
    from unittest import mock

    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        # vLLM's shutdown unfreezes the GC heap and runs two or three full collections over it
        # (~0.6 s each with torch and vLLM loaded, while the engine is still referenced here); the
        # one below, once it is dropped, frees the same.
        with mock.patch.object(gc, "collect", lambda *a, **k: 0):
            if keep_parallel_groups:
                import vllm.v1.engine.core as engine_core

                with mock.patch.object(engine_core, "cleanup_dist_env_and_memory", lambda *a, **k: None):
                    core.shutdown()
            else:
                core.shutdown()
    del llm
    gc.collect()


def count_mismatches(reference: list[list[int]], other: list[list[int]]) -> int:
    """Number of sequences whose token ids differ from the reference."""
    return sum(1 for a, b in zip(reference, other, strict=True) if a != b)


def find_proposers(llm: Any) -> list[LookaheadProposer]:
    """Proposers of an in-process ``LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    from lookahead_vllm.vllm.proposer import LookaheadProposer  # noqa: F811 (imports vllm)

    found = []
    seen = set()
    stack = [llm]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, LookaheadProposer):
            found.append(obj)
            continue
        for name in ("llm_engine", "engine_core", "model_executor", "driver_worker", "worker", "model_runner", "drafter"):
            stack.append(getattr(obj, name, None))
    return found
