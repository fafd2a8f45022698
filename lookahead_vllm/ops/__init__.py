"""Torch-only operators (no vLLM import): references for kernels and CPU fixes."""
