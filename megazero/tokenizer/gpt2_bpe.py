"""GPT-2's byte-level BPE tokenizer, reading the published ``vocab.json`` + ``merges.txt`` pair.

Encoding follows GPT-2's reference algorithm exactly, so ids match OpenAI's ``encoder.py`` (and
Megatron's ``GPT2Tokenizer``) for any input:

1. split the text with GPT-2's pre-tokenization pattern (``regex``, Unicode classes);
2. map each piece's UTF-8 bytes to printable characters with ``bytes_to_unicode``;
3. repeatedly merge the adjacent pair with the lowest rank in ``merges.txt`` (every occurrence,
   left to right) until no ranked pair is left;
4. look each resulting symbol up in ``vocab.json``.

Decoding maps ids back to bytes and decodes UTF-8, so ``detokenize(tokenize(s)) == s`` for any
``str``: lone surrogates (not valid Unicode, the reference raises on them) are carried through
with ``surrogatepass``. The per-word BPE cache is bounded (Megatron's grows without limit).
``<|endoftext|>`` is the eod id; like the reference, the string "<|endoftext|>" inside a text is
tokenized as ordinary characters.
"""

from __future__ import annotations

import functools
import json

import regex

from megazero.tokenizer.base import AbstractTokenizer, TokenizerError, check_file

EOD_TOKEN = "<|endoftext|>"
PRETOKENIZE_PATTERN = (r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+"""
                       r"""|\s+(?!\S)|\s+""")


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable Unicode characters.

    Printable Latin-1 bytes map to themselves; the 68 others (controls, space, ...) map to
    ``chr(256 + k)`` in byte order, so no symbol is whitespace or a control character.
    """
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return dict(sorted(table.items()))


def load_vocab(vocab_file: str) -> dict[str, int]:
    """Read a GPT-2 ``vocab.json`` (symbol -> id), validating its shape."""
    vocab_file = check_file(vocab_file, "--vocab-file")
    try:
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"--vocab-file {vocab_file} is not valid JSON: {exc}") from None
    if not isinstance(vocab, dict) or not vocab:
        raise TokenizerError(f"--vocab-file {vocab_file} must hold a non-empty JSON object "
                             "mapping tokens to ids")
    for token, idx in vocab.items():
        if not isinstance(idx, int) or isinstance(idx, bool) or idx < 0:
            raise TokenizerError(f"--vocab-file {vocab_file}: id of token {token!r} must be a "
                                 f"non-negative integer, got {idx!r}")
    if len(set(vocab.values())) != len(vocab):
        raise TokenizerError(f"--vocab-file {vocab_file}: two tokens share one id")
    return vocab


def load_merges(merge_file: str, vocab: dict[str, int] | None = None) -> list[tuple[str, str]]:
    """Read a GPT-2 ``merges.txt`` (optional ``#version`` header, then ``a b`` per line)."""
    merge_file = check_file(merge_file, "--merge-file")
    try:
        with open(merge_file, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except UnicodeDecodeError as exc:
        raise TokenizerError(f"--merge-file {merge_file} is not UTF-8 text: {exc}") from None
    merges = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip() or (lineno == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise TokenizerError(f"--merge-file {merge_file} line {lineno}: expected two "
                                 f"space-separated symbols, got {line!r}")
        if vocab is not None and parts[0] + parts[1] not in vocab:
            raise TokenizerError(f"--merge-file {merge_file} line {lineno}: merged symbol "
                                 f"{parts[0] + parts[1]!r} is not in the vocab file")
        merges.append((parts[0], parts[1]))
    return merges


def bpe_merge(word: tuple[str, ...], ranks: dict[tuple[str, str], int]) -> tuple[str, ...]:
    """Apply GPT-2's BPE to one pre-token given as a tuple of byte symbols."""
    while len(word) > 1:
        best, best_rank = None, None
        for pair in zip(word, word[1:]):
            rank = ranks.get(pair)
            if rank is not None and (best_rank is None or rank < best_rank):
                best, best_rank = pair, rank
        if best is None:
            break
        first, second = best
        merged, i, n = [], 0, len(word)
        while i < n:
            if i < n - 1 and word[i] == first and word[i + 1] == second:
                merged.append(first + second)
                i += 2
            else:
                merged.append(word[i])
                i += 1
        word = tuple(merged)
    return word


class GPT2BPETokenizer(AbstractTokenizer):
    """Byte-level BPE from ``vocab_file`` (vocab.json) and ``merge_file`` (merges.txt)."""

    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str, cache_size: int = 1 << 16):
        super().__init__()
        self._files = (vocab_file, merge_file, cache_size)
        self.encoder = load_vocab(vocab_file)
        self.decoder = {v: k for k, v in self.encoder.items()}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        missing = [c for c in self.byte_encoder.values() if c not in self.encoder]
        if missing:
            raise TokenizerError(
                f"--vocab-file {vocab_file} lacks {len(missing)} of the 256 byte symbols "
                f"(first: {missing[0]!r}); it is not a GPT-2 byte-level vocabulary")
        if EOD_TOKEN not in self.encoder:
            raise TokenizerError(f"--vocab-file {vocab_file} has no {EOD_TOKEN!r} token (eod)")
        merges = load_merges(merge_file, self.encoder)
        # like the reference, a repeated merge keeps the rank of its last occurrence
        self.bpe_ranks = dict(zip(merges, range(len(merges))))
        self.pattern = regex.compile(PRETOKENIZE_PATTERN)
        self._eod = self.encoder[EOD_TOKEN]
        self._vocab_size = max(self.decoder) + 1
        self._id_bytes = {i: self._symbol_bytes(sym) for i, sym in self.decoder.items()}
        self._encode_word = functools.lru_cache(maxsize=cache_size)(self._encode_word_uncached)

    def __getstate__(self):  # rebuild from the files (the word cache does not pickle)
        return {"files": self._files, "padded_vocab_size": self.padded_vocab_size}

    def __setstate__(self, state):
        self.__init__(*state["files"])
        self.padded_vocab_size = state["padded_vocab_size"]

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    def _encode_word_uncached(self, piece: str) -> tuple[int, ...]:
        symbols = tuple(self.byte_encoder[b] for b in piece.encode("utf-8", "surrogatepass"))
        return tuple(self.encoder[s] for s in bpe_merge(symbols, self.bpe_ranks))

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self.pattern.findall(text):
            ids.extend(self._encode_word(piece))
        return ids

    def _symbol_bytes(self, symbol: str) -> bytes:
        # a symbol outside the byte alphabet (a special token) stands for its own UTF-8 text
        if all(ch in self.byte_decoder for ch in symbol):
            return bytes(self.byte_decoder[ch] for ch in symbol)
        return symbol.encode("utf-8", "surrogatepass")

    def detokenize(self, ids) -> str:
        try:
            data = b"".join([self._id_bytes[int(i)] for i in ids])
        except KeyError as exc:
            raise ValueError(f"token id {exc.args[0]} is not in the vocabulary "
                             f"(size {self.vocab_size})") from None
        try:
            return data.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            return data.decode("utf-8", "replace")
