"""The tokenizer interface every megazero tokenizer implements (Megatron's ``AbstractTokenizer``).

A tokenizer turns text into a list of integer ids (``tokenize``) and back (``detokenize``), and
knows its true vocabulary size and its end-of-document id (``eod``). ``padded_vocab_size`` is
the embedding size the model allocates: the vocabulary rounded up to a multiple of
``make_vocab_size_divisible_by * tensor_model_parallel_size`` (Megatron's
``_vocab_size_with_padding``), so each tensor-parallel shard of the embedding is equal and
aligned.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod


class TokenizerError(ValueError):
    """A tokenizer file that is missing, unreadable or malformed (the message names it)."""


def vocab_size_with_padding(vocab_size: int, make_vocab_size_divisible_by: int = 128,
                            tensor_model_parallel_size: int = 1) -> int:
    """Round ``vocab_size`` up to a multiple of ``make_vocab_size_divisible_by * tp``."""
    if make_vocab_size_divisible_by < 1 or tensor_model_parallel_size < 1:
        raise ValueError(
            f"--make-vocab-size-divisible-by ({make_vocab_size_divisible_by}) and "
            f"--tensor-model-parallel-size ({tensor_model_parallel_size}) must be >= 1")
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


def check_file(path: str | os.PathLike | None, flag: str) -> str:
    """Return ``path`` as a string, or raise ``TokenizerError`` naming ``flag`` and the path."""
    if path is None:
        raise TokenizerError(f"{flag} is required for this tokenizer type")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise TokenizerError(f"{flag}: no such file: {path}")
    return path


class AbstractTokenizer(ABC):
    """Text <-> ids, with the true vocabulary size, the eod id and the padded size."""

    name = "abstract"

    def __init__(self):
        self.padded_vocab_size: int | None = None

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of distinct ids the tokenizer can produce (not padded)."""

    @property
    @abstractmethod
    def eod(self) -> int:
        """Id appended after each document (end of document)."""

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Ids of ``text``."""

    @abstractmethod
    def detokenize(self, ids) -> str:
        """Text of ``ids`` (any iterable of ints)."""

    def set_padding(self, make_vocab_size_divisible_by: int = 128,
                    tensor_model_parallel_size: int = 1) -> int:
        """Compute and store ``padded_vocab_size``; returns it."""
        self.padded_vocab_size = vocab_size_with_padding(
            self.vocab_size, make_vocab_size_divisible_by, tensor_model_parallel_size)
        return self.padded_vocab_size

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod}, "
                f"padded_vocab_size={self.padded_vocab_size})")
