"""Data safety (issue 14): bad data is refused at setup with a message that names it, and a
failed preprocess never removes the dataset already at its output prefix.

Each case writes real files under ``tmp_path`` and builds the training datasets the way
``pretrain`` does (``prepare_tokenizer`` + ``build_data_iterators`` with the default provider),
single-process: the checks run on the data, before any parallelism is involved.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from megazero.arguments import parse_args
from megazero.data import indexed_dataset
from megazero.data import preprocess as pp
from megazero.data.gpt_dataset import build_train_valid_test_datasets
from megazero.data.indexed_dataset import (
    DatasetError,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    validation_cache_path,
)
from megazero.distributed.parallel_state import ParallelState
from megazero.tokenizer import build_tokenizer, train_sentencepiece_bpe
from megazero.training.data import (
    build_data_iterators,
    default_datasets_provider,
    prepare_tokenizer,
)
from tests.test_tokenizer_gpt2 import make_bpe_files

SEQ = 16


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    vocab, merges = make_bpe_files(tmp_path_factory.mktemp("bpe"), num_merges=100)
    return {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": vocab, "merge_file": merges}


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sp")
    texts = ["def f(x):\n    return x + 1\n", "The quick brown fox jumps over the lazy dog.\n"]
    return train_sentencepiece_bpe(str(folder / "tok"), 300, texts=texts * 50, num_threads=1)


def vocab_size_of(bpe) -> int:
    return build_tokenizer(**bpe).vocab_size


def write_docs(prefix, docs, dtype=np.uint16) -> str:
    with MMapIndexedDatasetBuilder(str(prefix), dtype) as builder:
        for doc in docs:
            builder.add_document(np.asarray(doc))
        builder.finalize()
    return str(prefix)


def good_docs(n=40, vocab=300, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(5, 60)) for _ in range(n)]


def setup_training_data(prefix, bpe, *, split="90,10,0", train_iters=4, eval_iters=1):
    """The datasets and iterators of a single-process run, built as ``pretrain`` builds them."""
    argv = (f"--data-path {prefix} --tokenizer-type GPT2BPETokenizer "
            f"--vocab-file {bpe['vocab_file']} --merge-file {bpe['merge_file']} "
            f"--split {split} --num-layers 1 --hidden-size 8 --num-attention-heads 2 "
            f"--seq-length {SEQ} --max-position-embeddings {SEQ} --micro-batch-size 2 "
            f"--global-batch-size 2 --train-iters {train_iters} --eval-iters {eval_iters} "
            "--make-vocab-size-divisible-by 128")
    config = parse_args(argv.split(), world_size=1)
    ps = ParallelState.build()
    tokenizer = prepare_tokenizer(config, ps)
    return build_data_iterators(default_datasets_provider, config, ps, tokenizer, train_iters,
                                0)


# --- finding 3: a failed preprocess deletes the good dataset at its output prefix -----------

def write_jsonl(path, texts, bad_line_at=None):
    lines = [json.dumps({"text": t}) for t in texts]
    if bad_line_at is not None:
        lines.insert(bad_line_at - 1, '{"text": "unterminated')
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("bad_line_at", [1, 40])
def test_failed_preprocess_keeps_the_old_dataset(tmp_path, bpe, bad_line_at):
    prefix = str(tmp_path / "out")
    good = write_jsonl(tmp_path / "good.jsonl", [f"document number {i}" for i in range(30)])
    pp.preprocess(good, prefix, **bpe)
    files = {ext: tmp_path / f"out_text_document.{ext}" for ext in ("bin", "idx")}
    before = {ext: f.read_bytes() for ext, f in files.items()}
    bad = write_jsonl(tmp_path / "bad.jsonl", [f"other text {i}" for i in range(50)],
                      bad_line_at=bad_line_at)
    with pytest.raises(pp.PreprocessError, match=rf"bad\.jsonl:{bad_line_at}: invalid JSON"):
        pp.preprocess(bad, prefix, chunk_size=4, **bpe)
    assert {ext: f.read_bytes() for ext, f in files.items()} == before
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "good.jsonl", "out_text_document.bin",
                                            "out_text_document.idx"]  # no temporaries
    assert len(MMapIndexedDataset(prefix + "_text_document")) == 30


def test_successful_preprocess_replaces_the_old_dataset(tmp_path, bpe):
    prefix = str(tmp_path / "out")
    pp.preprocess(write_jsonl(tmp_path / "a.jsonl", ["one", "two"]), prefix, **bpe)
    pp.preprocess(write_jsonl(tmp_path / "b.jsonl", ["three", "four", "five"]), prefix, **bpe)
    assert len(MMapIndexedDataset(prefix + "_text_document")) == 3
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]


# --- finding 5: out-of-vocab ids, float tokens, empty data, tiny documents, surrogates --------

@pytest.mark.parametrize("offset", [0, 40000])  # inside the padded vocab (trains silently
def test_out_of_vocab_token_id_is_refused(tmp_path, bpe, offset):  # at tp=2), and beyond it
    vocab = vocab_size_of(bpe)
    docs = good_docs(vocab=vocab)
    bad_id = vocab + offset
    docs[7][3] = bad_id
    prefix = write_docs(tmp_path / "oov", docs)
    with pytest.raises(DatasetError) as err:
        setup_training_data(prefix, bpe)
    msg = str(err.value)
    assert f"{prefix}.bin" in msg and "document 7" in msg and "position 3" in msg
    assert f"token id {bad_id}" in msg and f"vocabulary size {vocab}" in msg
    assert not os.path.exists(validation_cache_path(prefix))  # a failure is never cached


def test_out_of_vocab_found_across_scan_chunks(tmp_path, monkeypatch):
    """The scan reads the ``.bin`` in chunks; the first bad token is located exactly."""
    monkeypatch.setattr(indexed_dataset, "SCAN_CHUNK_TOKENS", 7)
    docs = [np.arange(n) % 50 for n in (5, 9, 0, 13, 4, 11)]
    docs[3][10] = 77
    docs[5][2] = 99
    prefix = write_docs(tmp_path / "chunks", docs)
    with pytest.raises(DatasetError, match=r"token id 77 at document 3, position 10 .* "
                                           r"vocabulary size 60"):
        build_train_valid_test_datasets([prefix], "1", (1, 0, 0), 4, 1, vocab_size=60)


def test_float_token_file_is_refused(tmp_path, bpe):
    prefix = write_docs(tmp_path / "floats", [np.arange(20) + 0.5] * 20, dtype=np.float32)
    with pytest.raises(DatasetError, match=rf"{prefix}\.idx.*float32.*not an integer"):
        setup_training_data(prefix, bpe)


def test_empty_jsonl_gives_a_clear_error(tmp_path, bpe):
    src = tmp_path / "empty.jsonl"
    src.write_text("", encoding="utf-8")
    pp.preprocess(str(src), str(tmp_path / "empty"), **bpe)
    prefix = str(tmp_path / "empty_text_document")
    with pytest.raises(DatasetError, match=rf"{prefix} has no documents \(0 tokens\)"):
        setup_training_data(prefix, bpe)


def test_zero_documents_give_a_clear_error(tmp_path, bpe):
    prefix = write_docs(tmp_path / "none", [])
    with pytest.raises(DatasetError, match=r"train split .* no documents"):
        setup_training_data(prefix, bpe)


def test_one_token_documents_give_a_clear_error(tmp_path, bpe):
    prefix = write_docs(tmp_path / "tiny", [[5], [6], [7]])
    with pytest.raises(DatasetError) as err:
        setup_training_data(prefix, bpe)
    msg = str(err.value)
    assert "train split" in msg and prefix in msg and "3 documents" in msg
    assert "3 tokens" in msg and f"--seq-length {SEQ}" in msg and f"{SEQ + 1} tokens" in msg


def test_small_valid_split_gives_a_clear_error(tmp_path, bpe):
    prefix = write_docs(tmp_path / "small", [np.arange(30) % 50] * 9 + [[1, 2, 3]])
    with pytest.raises(DatasetError, match=r"valid split .* 1 document \[9, 10\) with 3 tokens"):
        setup_training_data(prefix, bpe)


def test_corrupt_document_lengths_are_refused(tmp_path, bpe):
    """A guard: a negative length in the .idx is refused at setup, naming the file."""
    prefix = write_docs(tmp_path / "corrupt", good_docs())
    idx = tmp_path / "corrupt.idx"
    raw = bytearray(idx.read_bytes())
    raw[34 + 4 * 2: 34 + 4 * 3] = np.int32(-5).tobytes()  # sizes[2] = -5
    idx.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=rf"{prefix}\.idx: negative sequence length"):
        setup_training_data(prefix, bpe)


@pytest.mark.parametrize("tokenizer", ["sentencepiece", "gpt2"])
def test_lone_surrogate_names_file_and_line(tmp_path, bpe, sp_model, tokenizer):
    kwargs = (bpe if tokenizer == "gpt2" else
              {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": sp_model})
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "fine"}\n{"text": "ok too"}\n{"text": "bad \\ud800 half"}\n'
                   '{"text": "last"}\n', encoding="utf-8")
    with pytest.raises(pp.PreprocessError,
                       match=r"in\.jsonl:3: .*'text'.*lone surrogate U\+D800 at character 4"):
        pp.preprocess(str(src), str(tmp_path / "out"), **kwargs)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]
    stats = pp.preprocess(str(src), str(tmp_path / "out"), skip_bad_lines=True, **kwargs)
    assert stats.documents == 3 and stats.skipped == 1


# --- the validation result is cached beside the index -----------------------------------------

def test_validation_is_cached_and_invalidated(tmp_path, bpe, monkeypatch):
    vocab = vocab_size_of(bpe)
    prefix = write_docs(tmp_path / "cached", good_docs(vocab=vocab))
    setup_training_data(prefix, bpe)
    cache = validation_cache_path(prefix)
    assert cache == f"{prefix}.idx.validated.json" and os.path.isfile(cache)
    with open(cache, encoding="utf-8") as f:
        record = json.load(f)
    assert record["max_token_id"] < vocab and record["num_documents"] == 40

    def no_scan(*args, **kwargs):
        raise AssertionError("the token scan ran although its result is cached")

    monkeypatch.setattr(indexed_dataset, "scan_token_ids", no_scan)
    setup_training_data(prefix, bpe)  # reads the cache, does not scan
    # a smaller vocabulary than the cached max id: rescanned to locate the bad token
    with pytest.raises(AssertionError, match="scan ran"):
        build_train_valid_test_datasets([prefix], "1", (1, 0, 0), SEQ, 1,
                                        vocab_size=record["max_token_id"])
    # the dataset rewritten (new files at the same prefix): the cache no longer applies
    write_docs(prefix, good_docs(vocab=vocab, seed=1))
    with pytest.raises(AssertionError, match="scan ran"):
        setup_training_data(prefix, bpe)
    # a cache file with junk in it is ignored and rewritten
    monkeypatch.undo()
    with open(cache, "w", encoding="utf-8") as f:
        f.write("\x00junk{")
    setup_training_data(prefix, bpe)
    with open(cache, encoding="utf-8") as f:
        assert json.load(f)["num_documents"] == 40
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]
