"""SentencePiece tokenizer: training helper, exact round trip, eod, padding and file errors."""

from __future__ import annotations

import pickle

import pytest
import sentencepiece as spm

from megazero.data.default_corpus import stdlib_python_files
from megazero.tokenizer import (
    SentencePieceTokenizer,
    TokenizerError,
    build_tokenizer,
    train_sentencepiece_bpe,
)

EXTRA = ("Café naïve 日本語 😀 tabs\t\tand   spaces\n\n  leading and trailing  \r\n"
         "It's what we'd've done. ")


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sp")
    files = stdlib_python_files(max_files=20)
    text_file = folder / "extra.txt"
    text_file.write_text(EXTRA * 20, encoding="utf-8")
    return train_sentencepiece_bpe(str(folder / "tok"), 800,
                                   input_files=[*files, str(text_file)], num_threads=2)


def test_round_trip_and_eod(sp_model):
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model,
                          make_vocab_size_divisible_by=64, tensor_model_parallel_size=4)
    assert tok.vocab_size == 800
    assert tok.padded_vocab_size == 1024
    sp = spm.SentencePieceProcessor(model_file=sp_model)
    assert tok.eod == sp.eos_id() >= 0
    for path in stdlib_python_files(max_files=30)[20:]:  # files not seen in training
        text = open(path, encoding="utf-8").read()
        ids = tok.tokenize(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.detokenize(ids) == text, path
    for text in ["", " ", EXTRA, "unseen ✓ glyphs ∮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and 🦜", "x" * 5000]:
        assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.eod not in tok.tokenize("</s> <|endoftext|>")  # control pieces stay text


def test_training_is_deterministic(sp_model, tmp_path):
    files = stdlib_python_files(max_files=20)
    extra = tmp_path / "extra.txt"
    extra.write_text(EXTRA * 20, encoding="utf-8")
    again = train_sentencepiece_bpe(str(tmp_path / "again"), 800,
                                    input_files=[*files, str(extra)], num_threads=2)
    assert open(again, "rb").read() == open(sp_model, "rb").read()
    one = train_sentencepiece_bpe(str(tmp_path / "one"), 800,
                                  input_files=[*files, str(extra)], num_threads=1)
    pieces = [spm.SentencePieceProcessor(model_file=m).id_to_piece(list(range(800)))
              for m in (one, sp_model)]
    assert pieces[0] == pieces[1]  # the thread count is recorded, but changes no piece


def test_pickles_by_path(sp_model):
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.tokenize("def f(): pass") == tok.tokenize("def f(): pass")
    assert clone.padded_vocab_size == tok.padded_vocab_size


def test_errors_name_the_problem(tmp_path, sp_model):
    with pytest.raises(TokenizerError, match="--tokenizer-model: no such file: .*missing.model"):
        SentencePieceTokenizer(str(tmp_path / "missing.model"))
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"\x00\x01 this is not a sentencepiece model")
    with pytest.raises(TokenizerError, match="garbage.model is not a valid SentencePiece model"):
        SentencePieceTokenizer(str(garbage))
    with pytest.raises(TokenizerError, match="needs --tokenizer-model"):
        build_tokenizer("SentencePieceTokenizer")
    tok = SentencePieceTokenizer(sp_model)
    with pytest.raises(ValueError, match="token id 800 is not in the vocabulary"):
        tok.detokenize([1, 800])
    no_eos = train_sentencepiece_bpe(str(tmp_path / "noeos"), 300, texts=[EXTRA * 5],
                                     eos_id=-1)
    with pytest.raises(TokenizerError, match="no eod id"):
        SentencePieceTokenizer(no_eos)
    with pytest.raises(ValueError, match="exactly one of input_files or texts"):
        train_sentencepiece_bpe(str(tmp_path / "x"), 300)
