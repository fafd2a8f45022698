"""Engines and prompts shared by the end-to-end tests (SmolLM2-135M-Instruct, fp32, CPU)."""

from __future__ import annotations

import gc

import pytest

from lookahead_lab.offline import engine_kwargs, shutdown_engine

# Kept short so the default suite stays fast; the slow suite uses 256.
MAX_TOKENS = 64
NUM_HUMANEVAL = 20
NUM_MTBENCH = 10


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def prompts(tokenizer) -> dict[str, list[str]]:
    from lookahead_lab.datasets import load_prompts

    return {
        "humaneval": load_prompts("humaneval", tokenizer, NUM_HUMANEVAL),
        "mtbench": load_prompts("mtbench", tokenizer, NUM_MTBENCH),
    }


# Engines alive at once (each holds ~1 GiB of KV cache plus the model); the
# least recently used one is shut down before another is built. "plain" stays.
MAX_LIVE_ENGINES = 4


# The shared engine "lookahead" (the defaults otherwise) prices tokens at the
# CPU prior instead of measuring them online: what it drafts then does not
# depend on how busy this machine is, and the tests that use it assert
# acceptance floors. Engines with the full defaults (online prices: the tenant
# tests' "per-salt" engine among them) are held to plain's output too.
PINNED_PRICES = {"cost_free_tokens": 5, "cost_marginal_tokens": 20.0}


class Engines:
    """Lazily built engines, one per name, at most MAX_LIVE_ENGINES alive."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._llms: dict[str, object] = {}

    def get(self, name: str, **kwargs):
        if name in self._llms:
            self._llms[name] = self._llms.pop(name)  # most recently used last
            return self._llms[name]
        while len(self._llms) >= MAX_LIVE_ENGINES:
            oldest = next(n for n in self._llms if n != "plain")
            self.shutdown(oldest)
        from vllm import LLM

        method = "lookahead" if name.startswith("lookahead") else "plain" if name.startswith("plain") else name
        if name == "lookahead" and not kwargs:
            kwargs = {"lookahead": dict(PINNED_PRICES)}
        self._llms[name] = LLM(model=self.model, **engine_kwargs(method, **kwargs))
        return self._llms[name]

    def shutdown(self, name: str) -> None:
        """Shut engine ``name`` down now (as the engine's owner would), leaving
        vLLM's global parallel groups to the engines still alive."""
        shutdown_engine(self._llms.pop(name), keep_parallel_groups=bool(self._llms))

    def close(self) -> None:
        while self._llms:
            self.shutdown(next(iter(self._llms)))
        gc.collect()


# Package scope: the engines' memory (KV cache included) is freed before the
# tests that start engines in other processes (servers, benchmarks) run.
@pytest.fixture(scope="package")
def engines(smollm2_dir):
    pool = Engines(smollm2_dir)
    yield pool
    pool.close()


_PLAIN_RUNS: dict = {}


def plain_run(engines, prompts: list, params, bs: int, key: tuple):
    """Plain vLLM's outputs for ``prompts``/``params`` at batch ``bs``, once per session.

    ``key`` names the (prompts, params) combination; modules that use the same
    key share one plain run.
    """
    from lookahead_lab.offline import generate

    if (key, bs) not in _PLAIN_RUNS:
        _PLAIN_RUNS[(key, bs)] = generate(engines.get("plain"), prompts, params, bs)
    return _PLAIN_RUNS[(key, bs)]
