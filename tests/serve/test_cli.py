"""Server command line: the shorthand flag, merged configs, bad config at startup."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.serve.conftest import REPO, server_env

pytestmark = pytest.mark.vllm


def test_console_script_declared():
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["lookahead-vllm-serve"] == "lookahead_vllm.serve:main"
    from lookahead_vllm.serve import main

    assert callable(main)


def _parse(argv: list[str]):
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from lookahead_vllm.vllm.plugin import register

    register()
    return make_arg_parser(FlexibleArgumentParser()).parse_args(argv)


def _spec_config(tiny_llama_dir: str, argv: list[str]):
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = _parse([tiny_llama_dir, "--enforce-eager", "--dtype", "float32", "--max-model-len", "256", *argv])
    args.model = args.model_tag
    return AsyncEngineArgs.from_cli_args(args).create_engine_config().speculative_config


@pytest.mark.parametrize(
    "argv, k",
    [
        (["--speculative-model", "lookahead"], 16),  # DEFAULT_DECODING_LENGTH
        (["--speculative-model", "lookahead", "--num-speculative-tokens", "5"], 5),
        (["--speculative-config", '{"num_speculative_tokens": 4}', "--speculative-model", "lookahead"], 4),
        (["--speculative-config", '{"method": "lookahead", "num_speculative_tokens": 3}'], 3),
    ],
)
def test_shorthand_and_merged_flags_select_lookahead(tiny_llama_dir, argv, k):
    from lookahead_vllm.vllm.config import PROPOSER_PATH

    spec = _spec_config(tiny_llama_dir, argv)
    assert spec.method == "custom_class" and spec.model == PROPOSER_PATH
    assert spec.num_speculative_tokens == k


def test_other_flags_undisturbed(tiny_llama_dir):
    spec = _spec_config(tiny_llama_dir, ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert spec.method == "ngram" and spec.num_speculative_tokens == 3
    assert _spec_config(tiny_llama_dir, []) is None
    with pytest.raises(SystemExit):  # the restored flag takes only our method
        _parse([tiny_llama_dir, "--speculative-model", "some/draft-model"])


def test_bad_lookahead_config_at_startup_exits_nonzero_naming_field(smollm2_dir):
    bad = ["--speculative-model", "lookahead", "--additional-config", '{"lookahead": {"branch_length": 1}}']  # internal
    bad_k = ["--speculative-config", '{"method": "lookahead", "num_speculative_tokens": 4}',
             "--additional-config", '{"lookahead": {"decoding_length": 6}}']
    runs = {
        # Our console script: checked before anything is loaded, exit status 2.
        "script": [sys.executable, "-m", "lookahead_vllm.serve", smollm2_dir, "--port", "1", *bad],
        # vLLM's own server module (what `vllm serve` runs): the plugin's config validation.
        "vllm": [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", smollm2_dir,
                 "--port", "1", *bad_k],
    }
    procs = {
        name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=server_env(), cwd=REPO)
        for name, cmd in runs.items()
    }
    results = {name: p.communicate(timeout=300) for name, p in procs.items()}
    out, err = results["script"]
    assert procs["script"].returncode == 2
    assert "lookahead-vllm-serve: error: lookahead config: branch_length: no longer a lookahead field" in err
    out, err = results["vllm"]
    assert procs["vllm"].returncode != 0
    assert "decoding_length=6: must be <= speculative_config.num_speculative_tokens=4" in err


def test_the_precheck_leaves_a_non_integer_k_to_vllm():
    """``"num_speculative_tokens": "8"`` (vLLM's config coerces it or refuses it itself) does not
    stop the console script's early check with a traceback; a bad field still does."""
    from argparse import Namespace

    from lookahead_vllm.serve import lookahead_config_error

    args = Namespace(speculative_config={"method": "lookahead", "num_speculative_tokens": "8"},
                     additional_config={"lookahead": {"draft_shape": "one"}})
    assert lookahead_config_error(args) is None
    args.speculative_config["num_speculative_tokens"] = 8
    args.additional_config = {"lookahead": {"draft_shape": "star"}}
    assert "draft_shape='star'" in lookahead_config_error(args)
