"""A tiny random Llama for fast tests and dry benchmark runs.

:func:`build_tiny_llama` writes a tiny random fp32 Llama with a BPE tokenizer
trained on Python stdlib sources. Like the bundled SmolLM2
(:mod:`lookahead_vllm.models`), it is built in a
temporary sibling directory and renamed once complete, so an interrupted run
never leaves a half-written model and a second call is instant.
"""

from __future__ import annotations

import logging
import sysconfig
from pathlib import Path
from typing import Any

from lookahead_vllm.models import build_atomically, save_fast_tokenizer, set_rope_theta

logger = logging.getLogger(__name__)

_FORMAT = 1  # bump when the builder's output changes, to invalidate caches

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


def fast_tokenizer(backend: Any, special: dict[str, str], **kwargs: Any) -> Any:
    """A ``PreTrainedTokenizerFast`` around a ``tokenizers.Tokenizer`` (``special``: its special tokens)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=backend, **special, **kwargs)


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

    tok = fast_tokenizer(
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
    set_rope_theta(out / "config.json", config.rope_parameters["rope_theta"])
    save_fast_tokenizer(tok, out)


def build_tiny_llama(path: str | Path, seed: int = 0, vocab_size: int = 768) -> Path:
    """Write a tiny random fp32 LlamaForCausalLM + BPE tokenizer to ``path``.

    Hidden 128, 2 layers, 4 heads (head_dim 32: vLLM's CPU attention rejects 16),
    2 KV heads, 2048 positions. Same files for the same seed on the same Python.
    """
    info = {"kind": "tiny-llama", "seed": seed, "vocab_size": vocab_size, "format": _FORMAT}
    return build_atomically(
        Path(path), info, lambda out: _write_tiny_llama(out, seed, vocab_size), force=False
    )
