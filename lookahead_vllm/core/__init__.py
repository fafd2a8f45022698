"""Pure-Python drafting core: no torch, no vLLM."""

from lookahead_vllm.core.config import DRAFT_SHAPES, LookaheadConfig, Settings, resolve
from lookahead_vllm.core.draft_tree import DraftTree
from lookahead_vllm.core.trie import TokenTrie

__all__ = ["DRAFT_SHAPES", "DraftTree", "LookaheadConfig", "Settings", "TokenTrie", "resolve"]
