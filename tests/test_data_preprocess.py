"""jsonl -> .bin/.idx preprocessing: contents, workers, bad lines, interruption, CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megazero.data import preprocess as pp
from megazero.data.indexed_dataset import MMapIndexedDataset
from megazero.tokenizer import build_tokenizer
from tests.test_tokenizer_gpt2 import make_bpe_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = ["Hello world! It's a test.", "Café 日本語 😀", "", "def f(x):\n    return x\n",
         "  whitespace   runs  "] * 6


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    vocab, merges = make_bpe_files(tmp_path_factory.mktemp("bpe"))
    return {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": vocab, "merge_file": merges}


def write_jsonl(path, texts, key="text", extra=None):
    with open(path, "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            obj = {key: t, "title": f"doc {i}"}
            f.write(json.dumps(obj, ensure_ascii=False) + "\n")
            if extra and i in extra:
                f.write(extra[i] + "\n")
    return str(path)


@pytest.mark.parametrize("workers,context", [(1, None), (2, None), (2, "spawn")])
def test_output_matches_tokenizer(tmp_path, bpe, workers, context):
    src = write_jsonl(tmp_path / "in.jsonl", TEXTS)
    stats = pp.preprocess(src, str(tmp_path / "out"), json_keys=("text", "title"),
                          append_eod=True, workers=workers, chunk_size=4, mp_context=context,
                          **bpe)
    tok = build_tokenizer(**bpe)
    for key in ("text", "title"):
        ds = MMapIndexedDataset(str(tmp_path / f"out_{key}_document"))
        values = TEXTS if key == "text" else [f"doc {i}" for i in range(len(TEXTS))]
        want = [tok.tokenize(t) + [tok.eod] for t in values if t]
        assert ds.dtype == np.uint16
        assert len(ds) == len(want)
        assert list(ds.doc_idx) == list(range(len(want) + 1))
        for got, w in zip(ds[0:len(ds)], want):
            assert list(got) == w
    assert stats.documents == len(TEXTS) and stats.skipped == 0
    assert stats.bytes == os.path.getsize(src) and stats.tokens > 0


def test_no_eod_and_blank_lines(tmp_path, bpe):
    src = write_jsonl(tmp_path / "in.jsonl", ["abc", "def"], extra={0: "   "})
    pp.preprocess(src, str(tmp_path / "out"), **bpe)
    tok = build_tokenizer(**bpe)
    ds = MMapIndexedDataset(str(tmp_path / "out_text_document"))
    assert [list(x) for x in ds[0:2]] == [tok.tokenize("abc"), tok.tokenize("def")]


BAD_LINES = {1: '{"text": "unterminated', 2: '["a list"]', 3: '{"other": "x"}',
             4: '{"text": 5}'}
MESSAGES = ["invalid JSON", "expected a JSON object, got list", "missing key 'text'",
            "value of 'text' is int, not a string"]


@pytest.mark.parametrize("which", range(4))
def test_bad_line_fails_with_line_number(tmp_path, bpe, which):
    key = list(BAD_LINES)[which]
    src = write_jsonl(tmp_path / "in.jsonl", ["a", "b", "c", "d", "e"],
                      extra={key: BAD_LINES[key]})
    line = key + 2  # written right after good line key (line key + 1)
    with pytest.raises(pp.PreprocessError, match=rf"in\.jsonl:{line}: {MESSAGES[which]}"):
        pp.preprocess(src, str(tmp_path / "out"), workers=1, **bpe)
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out")]  # nothing left


def test_bad_utf8_and_skip_bad_lines(tmp_path, bpe):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"text": "ok"}\n{"text": "\xff\xfe"}\n' + b"garbage\n" +
                    b'{"text": "fine"}\n')
    with pytest.raises(pp.PreprocessError, match=r"in\.jsonl:2: not valid UTF-8"):
        pp.preprocess(str(src), str(tmp_path / "out"), **bpe)
    stats = pp.preprocess(str(src), str(tmp_path / "out"), skip_bad_lines=True, **bpe)
    assert stats.documents == 2 and stats.skipped == 2
    assert len(MMapIndexedDataset(str(tmp_path / "out_text_document"))) == 2


def test_interrupt_keeps_the_old_output(tmp_path, bpe, monkeypatch):
    src = write_jsonl(tmp_path / "in.jsonl", ["abc"] * 50)
    prefix = str(tmp_path / "out")
    pp.preprocess(src, prefix, **bpe)  # an earlier complete output at the same prefix
    before = [(tmp_path / f"out_text_document{ext}").read_bytes() for ext in (".bin", ".idx")]
    original = pp.Encoder.encode

    def interrupting(self, lineno, record):
        if lineno == 30:
            raise KeyboardInterrupt
        return original(self, lineno, record)

    monkeypatch.setattr(pp.Encoder, "encode", interrupting)
    with pytest.raises(KeyboardInterrupt):
        pp.preprocess(src, prefix, chunk_size=4, **bpe)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "out_text_document.bin",
                                            "out_text_document.idx"]  # no temporaries
    assert [(tmp_path / f"out_text_document{ext}").read_bytes()
            for ext in (".bin", ".idx")] == before


def test_cli(tmp_path, bpe):
    src = write_jsonl(tmp_path / "in.jsonl", TEXTS[:5])
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "preprocess_data.py"), "--input", src,
           "--output-prefix", str(tmp_path / "cli"), "--tokenizer-type", "GPT2BPETokenizer",
           "--vocab-file", bpe["vocab_file"], "--merge-file", bpe["merge_file"],
           "--append-eod", "--workers", "1", "--log-interval", "2"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "processed 2 documents" in run.stderr and "cli_text_document" in run.stderr
    assert len(MMapIndexedDataset(str(tmp_path / "cli_text_document"))) == 4
    with open(src, "a", encoding="utf-8") as f:
        f.write("{broken\n")
    run = subprocess.run([sys.executable, "-m", "megazero.data.preprocess", *cmd[2:]],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 1 and "in.jsonl:6: invalid JSON" in run.stderr
