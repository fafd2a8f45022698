"""The drafting core: no torch, no vLLM (the native index and trie under it: csrc/draft_index)."""

from lookahead_vllm.core.config import DRAFT_SHAPES, LookaheadConfig, Settings, resolve

__all__ = ["DRAFT_SHAPES", "LookaheadConfig", "Settings", "resolve"]
