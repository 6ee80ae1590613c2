"""SentencePiece tokenizer (``--tokenizer-model``) and a helper that trains a BPE model.

``SentencePieceTokenizer`` loads a ``.model`` file; its eod is the model's ``</s>`` (eos) id, or
the piece ``<|endoftext|>`` when the model defines no eos. ``train_sentencepiece_bpe`` trains a
byte-fallback BPE model from text files (or any iterable of strings) with settings that keep
text exactly: identity normalisation, no dummy prefix, whitespace runs kept, so
``detokenize(tokenize(s)) == s`` for source code and prose alike. Training input is cut into
chunks of whole lines (newlines kept, a few KB each), so pieces can span line ends, and the
model is written to a temporary file and renamed into place.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Iterable, Iterator

import sentencepiece as spm

from megazero.tokenizer.base import AbstractTokenizer, TokenizerError, check_file

logger = logging.getLogger(__name__)

EOD_PIECE = "<|endoftext|>"
CHUNK_CHARS = 2000  # training "sentences" are runs of whole lines up to about this length


class SentencePieceTokenizer(AbstractTokenizer):
    """Ids from a SentencePiece ``.model``; eod is ``</s>`` (or ``<|endoftext|>``)."""

    name = "SentencePieceTokenizer"

    def __init__(self, model_file: str):
        super().__init__()
        model_file = check_file(model_file, "--tokenizer-model")
        with open(model_file, "rb") as f:
            proto = f.read()
        self.model_file = model_file
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.LoadFromSerializedProto(proto)
        except Exception as exc:  # noqa: BLE001 - sentencepiece raises RuntimeError/OSError
            raise TokenizerError(f"--tokenizer-model {model_file} is not a valid "
                                 f"SentencePiece model: {exc}") from None
        if self.sp.get_piece_size() <= 0:
            raise TokenizerError(f"--tokenizer-model {model_file} has an empty vocabulary")
        eod = self.sp.eos_id()
        if eod < 0:
            eod = self.sp.piece_to_id(EOD_PIECE)
            if eod == self.sp.unk_id():
                raise TokenizerError(f"--tokenizer-model {model_file} defines neither an eos "
                                     f"piece nor {EOD_PIECE!r}, so it has no eod id")
        self._eod = int(eod)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def detokenize(self, ids) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is not in the vocabulary "
                             f"(size {self.vocab_size})")
        return self.sp.decode(ids)

    def __getstate__(self):  # rebuild from the file in worker processes
        return {"model_file": self.model_file, "padded_vocab_size": self.padded_vocab_size}

    def __setstate__(self, state):
        self.__init__(state["model_file"])
        self.padded_vocab_size = state["padded_vocab_size"]


def line_chunks(texts: Iterable[str], max_chars: int = CHUNK_CHARS) -> Iterator[str]:
    """Cut each text into runs of whole lines (newlines kept) of at most ~``max_chars``."""
    for text in texts:
        buf, n = [], 0
        for line in text.splitlines(keepends=True):
            if buf and n + len(line) > max_chars:
                yield "".join(buf)
                buf, n = [], 0
            buf.append(line[:4 * max_chars])  # sentencepiece drops over-long sentences anyway
            n += len(line)
        if buf:
            yield "".join(buf)


def _read_texts(paths: Iterable[str]) -> Iterator[str]:
    for path in paths:
        with open(check_file(path, "--input"), encoding="utf-8", errors="replace") as f:
            yield f.read()


def train_sentencepiece_bpe(output_prefix: str, vocab_size: int,
                            input_files: Iterable[str] | None = None,
                            texts: Iterable[str] | None = None, *,
                            num_threads: int | None = None, **options) -> str:
    """Train a byte-fallback BPE SentencePiece model; return the path ``{output_prefix}.model``.

    Give ``input_files`` (UTF-8 text files) or ``texts`` (strings). ``options`` override
    SentencePiece trainer flags. Deterministic for a given input and settings.
    """
    if (input_files is None) == (texts is None):
        raise ValueError("train_sentencepiece_bpe needs exactly one of input_files or texts")
    if texts is None:
        texts = _read_texts(input_files)
    settings = dict(
        model_type="bpe", vocab_size=vocab_size, character_coverage=1.0, byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=False, allow_whitespace_only_pieces=True, split_digits=False,
        input_sentence_size=0, shuffle_input_sentence=False, max_sentence_length=32 * CHUNK_CHARS,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
        num_threads=num_threads or min(os.cpu_count() or 1, 8),
    )
    settings.update(options)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=line_chunks(texts), model_writer=model,
                                       **settings)
    except RuntimeError as exc:
        raise TokenizerError(f"SentencePiece training for {output_prefix}.model failed: "
                             f"{exc}") from None
    path = f"{output_prefix}.model"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(model.getvalue())
    os.replace(tmp, path)
    logger.info("trained SentencePiece BPE model (vocab %d) -> %s", vocab_size, path)
    return path
