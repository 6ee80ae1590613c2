"""Default corpus: file selection, a small build, cache reuse, cache key, concurrent builders."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from megazero.data import default_corpus as dc
from megazero.data.indexed_dataset import MMapIndexedDataset
from megazero.tokenizer import build_tokenizer

SMALL = {"max_files": 25, "vocab_size": 600}


def test_stdlib_file_selection():
    files = dc.stdlib_python_files()
    root = dc.stdlib_dir()
    rel = [os.path.relpath(f, root) for f in files]
    assert len(files) > 100 and rel == sorted(rel)
    for r in rel:
        parts = r.split(os.sep)
        assert r.endswith(".py") and not parts[-1].startswith("test_")
        assert not set(parts[:-1]) & dc.EXCLUDED_DIRS, r
    assert dc.stdlib_python_files(max_files=5) == files[:5]


def test_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGAZERO_CACHE", str(tmp_path / "env"))
    assert dc.cache_root() == str(tmp_path / "env")
    assert dc.cache_root(str(tmp_path / "arg")) == str(tmp_path / "arg")
    monkeypatch.delenv("MEGAZERO_CACHE")
    assert dc.cache_root().endswith(os.path.join(".cache", "megazero", "default_corpus"))


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    cache = tmp_path_factory.mktemp("corpus")
    return cache, dc.build_default_corpus(str(cache), **SMALL)


def test_small_build(small_corpus):
    cache, corpus = small_corpus
    assert corpus.tokenizer_type == "SentencePieceTokenizer"
    assert corpus.cache_dir.startswith(str(cache))
    import platform
    assert f"py{platform.python_version()}" in os.path.basename(corpus.cache_dir)
    tok = build_tokenizer(corpus.tokenizer_type, tokenizer_model=corpus.tokenizer_model)
    assert tok.vocab_size == SMALL["vocab_size"]
    ds = MMapIndexedDataset(corpus.data_prefix)
    files = [f for f in dc.stdlib_python_files(max_files=SMALL["max_files"])
             if os.path.getsize(f) > 0]
    assert len(ds) == len(files) == corpus.num_documents
    assert ds.num_tokens == corpus.num_tokens
    for i in (0, len(ds) - 1):
        ids = list(ds[i])
        assert ids[-1] == tok.eod
        assert tok.detokenize(ids[:-1]) == open(files[i], encoding="utf-8").read()
    assert not [p for p in os.listdir(cache) if ".tmp" in p]


def test_second_call_reuses_and_key_has_parameters(small_corpus, monkeypatch):
    cache, corpus = small_corpus

    def no_build(*args, **kwargs):
        raise AssertionError("rebuilt although cached")

    monkeypatch.setattr(dc, "_build", no_build)
    assert dc.build_default_corpus(str(cache), **SMALL) == corpus
    with pytest.raises(AssertionError, match="rebuilt"):
        dc.build_default_corpus(str(cache), max_files=25, vocab_size=700)
    with pytest.raises(AssertionError, match="rebuilt"):
        dc.build_default_corpus(str(cache), max_files=24, vocab_size=600)


def _concurrent_build(cache, marker_dir, queue):
    original = dc._build

    def counting_build(tmp, *args, **kwargs):
        open(os.path.join(marker_dir, f"built-{os.getpid()}"), "w").close()
        return original(tmp, *args, **kwargs)

    dc._build = counting_build
    try:
        queue.put(dc.build_default_corpus(cache, max_files=12, vocab_size=500).data_prefix)
    except BaseException as exc:  # noqa: BLE001
        queue.put(f"error: {exc!r}")


def test_concurrent_callers_build_once(tmp_path):
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    markers = tmp_path / "markers"
    markers.mkdir()
    procs = [ctx.Process(target=_concurrent_build, args=(str(tmp_path / "c"), str(markers),
                                                          queue)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    assert len(set(results)) == 1 and not results[0].startswith("error"), results
    assert len(os.listdir(markers)) == 1
    assert MMapIndexedDataset(results[0]).num_tokens > 0
