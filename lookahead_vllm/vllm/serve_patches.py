"""Named patches for serving (registered in :mod:`.patches`; docs/how-it-works.md, "How serving works")."""

from __future__ import annotations

import functools

from vllm.logger import init_logger

from lookahead_vllm.core.request_options import draft_cap
from lookahead_vllm.vllm import metrics
from lookahead_vllm.vllm.config import METHOD
from lookahead_vllm.vllm.wrap import method_patch

logger = init_logger(__name__)


@method_patch("vllm.sampling_params.SamplingParams", "_verify_args", ("self",))
def patch_request_options(original, self) -> None:
    """Validate the per-request lookahead keys of ``extra_args``: an error at construction (HTTP 400 in the server)."""
    original(self)
    try:
        draft_cap(self.extra_args)
    except ValueError as e:
        raise _request_error()(str(e), parameter="vllm_xargs") from None


@functools.cache
def _request_error() -> type:
    from vllm.exceptions import VLLMValidationError

    class LookaheadRequestError(VLLMValidationError, ValueError):
        """Also a ``ValueError``: HTTP 400 in the server."""

    return LookaheadRequestError


@method_patch("vllm.engine.arg_utils.EngineArgs", "add_cli_args", ("parser",))  # a staticmethod, put back as one
def patch_cli_speculative_model(original, parser):
    """vLLM's parser accepts the removed ``--speculative-model lookahead`` and ``--num-speculative-tokens``."""
    parser = original(parser)
    known = set(parser._option_string_actions)
    if "--speculative-model" not in known:
        parser.add_argument("--speculative-model", dest="spec_model", choices=[METHOD], default=None,
                            help="Shorthand restored by lookahead-vllm: '--speculative-model lookahead' selects "
                            "lookahead drafting (same as --speculative-config '{\"method\": \"lookahead\"}').")
    if "--num-speculative-tokens" not in known:
        parser.add_argument("--num-speculative-tokens", dest="spec_tokens", type=int, default=None,
                            help="Alias of --spec-tokens (restored by lookahead-vllm).")
    return parser


@method_patch("prometheus_client.multiprocess.MultiProcessCollector", "__init__", ("self", "registry"))
def patch_multiprocess_metrics(original, self, registry, *args, **kwargs):
    """The ``lookahead_*`` collector joins the registry several API servers build per scrape for ``/metrics``."""
    original(self, registry, *args, **kwargs)
    if registry is None:
        return
    try:
        metrics.export_to(registry)
    except Exception:  # noqa: BLE001 - never break vLLM's /metrics for the plugin's series
        logger.exception("lookahead-vllm: the lookahead_* series could not join a multiprocess registry")
