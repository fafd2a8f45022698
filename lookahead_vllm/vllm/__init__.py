"""vLLM adapter, the only package of lookahead_vllm that imports vllm: ``plugin.register`` (the entry point) applies
the named ``patches``; ``proposer.LookaheadProposer`` is the drafter vLLM instantiates as its ``custom_class``."""
