"""``lookahead-vllm-serve bundled`` serves the float32 weights in float32.

vLLM's ``--dtype auto`` downcasts a float32 model to bfloat16; there a
verification forward's numerics differ from one-token decoding, and a
lookahead server's greedy output left a plain server's within 70-90 tokens
(and its own streamed output). An explicit ``--dtype`` or ``--config`` wins.
"""

from __future__ import annotations

import pytest

from lookahead_vllm import serve

pytestmark = pytest.mark.vllm


@pytest.fixture
def bundled_dir(tmp_path, monkeypatch):
    import lookahead_vllm.models

    monkeypatch.setattr(lookahead_vllm.models, "prepare_smollm2", lambda: tmp_path)
    return str(tmp_path)


def _parse(argv: list[str]):
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from lookahead_vllm.vllm.plugin import register

    register()
    return make_arg_parser(FlexibleArgumentParser()).parse_args(argv)


@pytest.mark.parametrize("head", [["bundled"], ["--model", "bundled"], ["--model=bundled"]])
def test_bundled_defaults_to_float32(bundled_dir, head):
    argv, model = serve.resolve_model([*head, "--speculative-model", "lookahead", "--port", "8000"])
    assert model == bundled_dir
    args = _parse(argv)
    assert args.dtype == "float32"
    assert (args.model_tag or args.model) == bundled_dir


@pytest.mark.parametrize("flag", [["--dtype", "bfloat16"], ["--dtype=bfloat16"]])
def test_explicit_dtype_wins(bundled_dir, flag):
    argv, _ = serve.resolve_model(["bundled", *flag, "--enforce-eager"])
    assert argv == [bundled_dir, *flag, "--enforce-eager"]
    assert _parse(argv).dtype == "bfloat16"


def test_other_models_untouched(tmp_path):
    argv = [str(tmp_path), "--enforce-eager"]
    assert serve.resolve_model(list(argv)) == (argv, str(tmp_path))
