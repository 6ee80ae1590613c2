"""Tokenizers with Megatron's interface: ``build_tokenizer(tokenizer_type, ...)``.

``GPT2BPETokenizer`` (``--vocab-file`` + ``--merge-file``, GPT-2's byte-level BPE) and
``SentencePieceTokenizer`` (``--tokenizer-model``), and ``NullTokenizer`` (``--mock-data``).
Each returned tokenizer has ``tokenize(text) -> list[int]``, ``detokenize(ids) -> str``,
``vocab_size`` (true size), ``eod`` and ``padded_vocab_size`` (vocab rounded up to
``make_vocab_size_divisible_by * tp``).
"""

from __future__ import annotations

import logging

from megazero.tokenizer.base import (
    AbstractTokenizer,
    TokenizerError,
    vocab_size_with_padding,
)
from megazero.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megazero.tokenizer.null import NullTokenizer
from megazero.tokenizer.sentencepiece import SentencePieceTokenizer, train_sentencepiece_bpe

logger = logging.getLogger(__name__)

TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer")


def build_tokenizer(tokenizer_type: str, vocab_file: str | None = None,
                    merge_file: str | None = None, tokenizer_model: str | None = None,
                    make_vocab_size_divisible_by: int = 128,
                    tensor_model_parallel_size: int = 1) -> AbstractTokenizer:
    """Build the tokenizer named by ``--tokenizer-type`` and set its ``padded_vocab_size``."""
    if tokenizer_type == "GPT2BPETokenizer":
        if vocab_file is None or merge_file is None:
            raise TokenizerError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and "
                                 "--merge-file")
        tokenizer = GPT2BPETokenizer(vocab_file, merge_file)
    elif tokenizer_type == "SentencePieceTokenizer":
        if tokenizer_model is None:
            raise TokenizerError("--tokenizer-type SentencePieceTokenizer needs "
                                 "--tokenizer-model")
        tokenizer = SentencePieceTokenizer(tokenizer_model)
    else:
        raise TokenizerError(f"--tokenizer-type must be one of {', '.join(TOKENIZER_TYPES)}, "
                             f"got {tokenizer_type!r}")
    padded = tokenizer.set_padding(make_vocab_size_divisible_by, tensor_model_parallel_size)
    logger.info("> building %s tokenizer: vocab size %d, padded to %d (%d dummy tokens)",
                tokenizer_type, tokenizer.vocab_size, padded, padded - tokenizer.vocab_size)
    return tokenizer


__all__ = [
    "AbstractTokenizer",
    "GPT2BPETokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "TOKENIZER_TYPES",
    "TokenizerError",
    "build_tokenizer",
    "train_sentencepiece_bpe",
    "vocab_size_with_padding",
]
