"""Patches fail closed for lookahead and open for plain vLLM.

A patch whose vLLM target moved (simulated by replacing it with one that
raises, or by a target with other parameters) must stop an engine that selects
lookahead, naming the patch; an engine without lookahead must start and
generate as before. The CPU sampling fix says loudly when its target moved.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from lookahead_vllm.vllm import patches, wrap  # noqa: E402

pytestmark = pytest.mark.vllm

MOVED = "GPUModelRunner has no attribute '_update_states' (simulated vLLM change)"


@pytest.fixture(scope="module", autouse=True)
def _plugin():
    from lookahead_vllm.vllm.plugin import register

    register()


@pytest.fixture
def break_patch(monkeypatch):
    """``break_patch(name)``: the named patch is not applied yet and raises when applied. The
    other runner patches (those an engine applies at start) apply as no-ops here: ``_applied``
    is restored after the test, so a runner method wrapped under it would be wrapped a second
    time by the next engine (``_sample`` twice: the argmax path and tree acceptance run twice)."""
    monkeypatch.setattr(patches, "_applied", set(patches._applied))
    monkeypatch.setattr(patches, "_failed", dict(patches._failed))
    for name in set(patches.PATCHES) - set(patches.EAGER):
        monkeypatch.setitem(patches.PATCHES, name, lambda: True)

    def boom() -> bool:
        raise AttributeError(MOVED)

    def make(name: str) -> None:
        monkeypatch.setitem(patches.PATCHES, name, boom)
        patches._applied.discard(name)

    return make


# ---------------------------------------------------------------- units


def test_changed_signature_is_refused():
    class Runner:
        def _sample(self, logits, metadata):  # vLLM renamed spec_decode_metadata
            return logits

    with pytest.raises(wrap.PatchTargetChanged, match=r"Runner._sample takes \(self, logits, metadata, \.\.\.\)"):
        wrap.wrap((Runner, "__init__", lambda original, *args: original(*args), ("self",)),
                  (Runner, "_sample", lambda original, *args: original(*args),
                   ("self", "logits", "spec_decode_metadata")))
    assert Runner._sample.__name__ == "_sample" and not hasattr(Runner._sample, "__lookahead_original__")
    assert not hasattr(Runner.__init__, "__lookahead_original__")  # all or nothing: the good target untouched


def test_classmethod_and_staticmethod_targets_checked_and_kept():
    """Serving and CPU patches wrap classmethods/staticmethods through the same check."""
    import inspect

    class Args:
        @staticmethod
        def add_cli_args(parser):
            return parser

        @classmethod
        def from_request(cls, req):
            return cls

    with pytest.raises(wrap.PatchTargetChanged, match=r"Args.from_request takes \(cls, req, \.\.\.\)"):
        wrap.wrap((Args, "from_request", lambda original, *args: original(*args), ("cls", "request")))
    wrap.wrap((Args, "add_cli_args", lambda original, parser: [original(parser)], ("parser",)))
    assert isinstance(inspect.getattr_static(Args, "add_cli_args"), staticmethod)
    assert Args().add_cli_args(1) == [1] and Args.add_cli_args.__name__ == "add_cli_args"


def test_require_names_failed_patch_and_reason(break_patch):
    break_patch("runner_request_ids")
    assert patches.apply("runner_request_ids") is False  # logged, not raised: plain vLLM goes on
    assert "AttributeError" in patches._failed["runner_request_ids"]
    with pytest.raises(RuntimeError, match=r"lookahead cannot start: .*patch\(es\) runner_request_ids "
                                           r"\(AttributeError: GPUModelRunner has no attribute"):
        patches.require(patches.LOOKAHEAD_PATCHES, "lookahead")


def test_engine_start_names_config_patch(break_patch):
    """A failed config-time patch (its guards never ran) is caught where the proposer starts."""
    from lookahead_vllm.core.config import resolve
    from lookahead_vllm.vllm.proposer import LookaheadProposer

    assert LookaheadProposer.prepare_engine is patches.prepare_engine  # handed over by the plugin
    break_patch("lookahead_validation")
    with pytest.raises(RuntimeError, match=r"lookahead draft_shape='hier' cannot start: .*lookahead_validation"):
        patches.prepare_engine(resolve({"draft_shape": "hier"}))


def test_cpu_sampling_fix_loud_when_target_moved(monkeypatch):
    from vllm.utils import cpu_triton_utils

    def _expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to):  # one parameter gone
        return None

    errors = []
    monkeypatch.setattr(cpu_triton_utils, "_expand_kernel_impl", _expand_kernel_impl)
    monkeypatch.setattr(patches.logger, "error", lambda msg, *args: errors.append(msg % args))
    assert patches.patch_cpu_expand_kernel() is False
    assert cpu_triton_utils._expand_kernel_impl is _expand_kernel_impl  # left alone
    (message,) = errors
    assert "CPU sampling fix NOT applied: vllm.utils.cpu_triton_utils._expand_kernel_impl found (output," in message
    assert "temperature > 0" in message


# ---------------------------------------------------------------- engines


def _llm(model: str, method: str, **lookahead):
    from vllm import LLM

    from lookahead_lab.offline import engine_kwargs

    return LLM(model=model, **engine_kwargs(method, lookahead=lookahead, max_model_len=256))


def test_plain_engine_starts_with_a_failed_patch(tiny_llama_dir, break_patch):
    from vllm import SamplingParams

    from lookahead_lab.offline import shutdown_engine

    break_patch("runner_request_ids")
    break_patch("tree_verification")
    llm = _llm(tiny_llama_dir, "plain")
    try:
        (out,) = llm.generate(["a b c a b c"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 8
    finally:
        shutdown_engine(llm)


@pytest.mark.parametrize("name, lookahead", [("runner_request_ids", {}),
                                             ("tree_verification", {"draft_shape": "hier"})])
def test_lookahead_engine_refuses_to_start(tiny_llama_dir, break_patch, name, lookahead):
    break_patch(name)
    with pytest.raises(Exception, match=rf"{name}.*{MOVED[:20]}|{name} patch"):
        _llm(tiny_llama_dir, "lookahead", **lookahead)
