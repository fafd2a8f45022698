"""Engines and prompts shared by the end-to-end tests (SmolLM2-135M-Instruct, fp32, CPU)."""

from __future__ import annotations

import gc

import pytest

from lookahead_lab.offline import engine_kwargs, shutdown_engine

# Kept short so the default suite stays fast; the slow suite uses 256.
MAX_TOKENS = 64
NUM_HUMANEVAL = 20
NUM_MTBENCH = 10
# Batch-1 losslessness runs (one step per token: the slow part of this suite)
# use the first NUM_BS1 HumanEval prompts, so that they share one plain run
# (plain_run key ("humaneval[:NUM_BS1]", "greedy")); batch-8 runs that need
# no more than one batch use the first 8 (key ("humaneval[:8]", "greedy")).
NUM_BS1 = 5
# Jacobi's and the trees' batch-1 runs take the first NUM_BS1_SHORT of those and
# are held to the first NUM_BS1_SHORT outputs of that same plain run (at batch
# 1 every prompt runs alone, so they are plain's outputs for these prompts).
NUM_BS1_SHORT = 3


def plain_bs1_prefix(engines, prompts: list, params, n: int, dataset: str = "humaneval") -> list[list[int]]:
    """Plain vLLM's batch-1 token ids for ``prompts[:n]`` (``prompts``: the
    dataset's list), from the shared run of its first NUM_BS1 prompts."""
    assert n <= NUM_BS1
    run = plain_run(engines, prompts[:NUM_BS1], params, 1, (f"{dataset}[:{NUM_BS1}]", "greedy"))
    return run.token_ids[:n]


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


# Engines alive at once (each holds ~1 GiB of KV cache plus the model, ~2 GiB
# in all); the least recently used one is shut down before another is built.
# "plain" stays. With 4, test_jacobi's three engines evicted "lookahead" and
# "lookahead-hier-cost0" and test_suite_identity's two "lookahead" again, and
# later modules rebuilt them (~5 s each); with 5 only test_jacobi evicts one.
MAX_LIVE_ENGINES = 5


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

    def release(self, llm) -> None:
        """Shut down ``llm`` (an engine of this pool) now: for engines one test
        uses, so that they do not evict engines other tests still use."""
        self.shutdown(next(name for name, e in self._llms.items() if e is llm))

    def close(self) -> None:
        while self._llms:
            self.shutdown(next(iter(self._llms)))
        gc.collect()


# Package scope: the engines' memory (KV cache included) is freed before the
# tests that start engines in other processes (servers, benchmarks) run.
@pytest.fixture(scope="package")
def engines(smollm2_dir):
    pool = Engines(smollm2_dir)
    _POOLS.append(pool)
    yield pool
    _POOLS.remove(pool)
    pool.close()


# Engines several modules use; every other engine a module builds is shut down
# when the module ends, so that the least-recently-used eviction never throws
# out (and a later module rebuilds, ~10 s each on 2 cores) one of these.
SHARED_ENGINES = {"plain", "lookahead", "lookahead-hier-cost0"}


_POOLS: list[Engines] = []


@pytest.fixture(scope="module", autouse=True)
def _module_engines():
    yield
    for pool in _POOLS:
        for name in [n for n in pool._llms if n not in SHARED_ENGINES]:
            pool.shutdown(name)


_PLAIN_RUNS: dict = {}


def count_preemptions(llm) -> list[int]:
    """Wrap the in-process scheduler's preemption; returns a live counter."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    count, preempt = [0], scheduler._preempt_request

    def counted(*args, **kwargs):
        count[0] += 1
        return preempt(*args, **kwargs)

    scheduler._preempt_request = counted
    return count


def plain_run(engines, prompts: list, params, bs: int, key: tuple):
    """Plain vLLM's outputs for ``prompts``/``params`` at batch ``bs``, once per session.

    ``key`` names the (prompts, params) combination; modules that use the same
    key share one plain run.
    """
    from lookahead_lab.offline import generate

    if (key, bs) not in _PLAIN_RUNS:
        _PLAIN_RUNS[(key, bs)] = generate(engines.get("plain"), prompts, params, bs)
    return _PLAIN_RUNS[(key, bs)]
