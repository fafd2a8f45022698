"""vLLM adapter: the only package of lookahead_vllm that imports vllm.

``plugin.register`` is the ``vllm.general_plugins`` entry point; ``patches`` holds the small named patches it applies;
``proposer.LookaheadProposer`` is the drafter vLLM instantiates through its ``custom_class`` machinery.
"""
