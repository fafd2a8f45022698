"""lookahead-vllm: lossless lookahead drafting for vLLM speculative decoding. Layers (imports point one way): ``core``
(NumPy over the C++ drafting core) -> ``ops`` (torch) -> ``vllm`` (the only package that imports vLLM).
"""

__version__ = "0.1.0"
