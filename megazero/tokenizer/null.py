"""The tokenizer of ``--mock-data``: ids written as decimal text, no vocabulary files."""

from __future__ import annotations


class NullTokenizer:
    """Tokenizer of ``--mock-data``: ids only; the last id is end-of-document."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1

    def tokenize(self, text):
        return [int(t) for t in text.split()]

    def detokenize(self, ids):
        return " ".join(str(i) for i in ids)
