"""Shared fixtures. vLLM env vars are set here, before anything imports vllm."""

from __future__ import annotations

import importlib.util

import pytest

from lookahead_lab.offline import apply_cpu_env

apply_cpu_env()

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_vllm = pytest.mark.skip(reason="vllm is not installed (pip install -e '.[cpu]')")
    skip_gpu = pytest.mark.skip(reason="no CUDA GPU on this machine")
    has_cuda = None
    for item in items:
        if "vllm" in item.keywords and not HAS_VLLM:
            item.add_marker(skip_vllm)
        if "gpu" in item.keywords:
            has_cuda = _has_cuda() if has_cuda is None else has_cuda
            if not has_cuda:
                item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    from lookahead_vllm.models import prepare_smollm2

    return str(prepare_smollm2())


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    from lookahead_lab.models import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(autouse=True)
def _caplog_sees_the_package(request):
    """The package's records go to the ``vllm`` logger, which stops propagating once vLLM has
    configured its logging (vllm/logs.py): a test that reads ``caplog`` also gets them then, at
    the levels the root logger passes, as if they propagated (once: while the ``vllm`` logger
    still propagates, they reach caplog through it)."""
    if "caplog" not in request.fixturenames:
        yield
        return
    import logging

    from lookahead_vllm.vllm.logs import PACKAGE_LOGGER

    caplog_handler = request.getfixturevalue("caplog").handler
    ours = logging.getLogger(PACKAGE_LOGGER)

    class AsPropagated(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if ours.propagate or logging.getLogger("vllm").propagate:
                return
            if record.levelno >= logging.getLogger().getEffectiveLevel():
                caplog_handler.handle(record)

    handler = AsPropagated()
    ours.addHandler(handler)
    yield
    ours.removeHandler(handler)
