"""The drafting core: no torch, no vLLM (the native index and trie under it: csrc/draft_index)."""

from lookahead_vllm.core.config import DRAFT_SHAPES, LookaheadConfig, Settings, resolve
from lookahead_vllm.core.draft_tree import DraftTree

__all__ = ["DRAFT_SHAPES", "DraftTree", "LookaheadConfig", "Settings", "resolve"]
