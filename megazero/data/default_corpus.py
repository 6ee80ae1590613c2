"""The built-in corpus: the running interpreter's standard library, tokenized, cached locally.

With no ``--data-path``, training uses this corpus, so nothing is downloaded. The documents are
the standard library's ``.py`` files (sorted by path; test packages, ``test_*.py`` files and
site-/dist-packages excluded), one document each with an eod appended. A byte-fallback BPE
SentencePiece tokenizer (vocab 4096 by default) is trained on them and the documents are
written as a Megatron ``.bin/.idx`` pair. About 12 MB of source, some 4M tokens for Python 3.11;
the whole build takes about 10 s on 2 cores.

The cache folder is ``cache_dir``, else ``$MEGAZERO_CACHE``, else
``~/.cache/megazero/default_corpus``; inside it each build has its own subfolder named by a key
of the Python version, the building parameters and a digest of the file list, so a change of
interpreter or parameters rebuilds and a repeated call reuses. Safe to call from several ranks
at once: one process holds a file lock and builds into a temporary folder renamed into place;
the others wait on the lock and then reuse the result.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import sysconfig
import time
from dataclasses import dataclass

from megazero.data.indexed_dataset import MMapIndexedDataset, best_fitting_dtype
from megazero.data.preprocess import Encoder, encode_stream, write_documents
from megazero.tokenizer import train_sentencepiece_bpe

try:
    import fcntl
except ImportError:  # not POSIX: build-to-temp-then-rename alone keeps it safe
    fcntl = None

logger = logging.getLogger(__name__)

CORPUS_FORMAT = 1  # bump when the way the corpus is built changes
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
TOKENIZER_TYPE = "SentencePieceTokenizer"
DATA_NAME = "stdlib_text_document"
MODEL_NAME = "tokenizer"


@dataclass(frozen=True)
class DefaultCorpus:
    """Where the built corpus lives: pass ``data_prefix`` as ``--data-path``."""

    data_prefix: str  # path of the .bin/.idx without extension
    tokenizer_model: str  # the SentencePiece .model
    tokenizer_type: str = TOKENIZER_TYPE
    cache_dir: str = ""
    num_documents: int = 0
    num_tokens: int = 0


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_python_files(root: str | None = None, max_files: int | None = None) -> list[str]:
    """Sorted paths of the standard library's ``.py`` files (tests, site-packages excluded)."""
    root = root or stdlib_dir()
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS]
        for name in files:
            if name.endswith(".py") and not name.startswith("test_"):
                found.append(os.path.relpath(os.path.join(folder, name), root))
    found.sort()
    if max_files is not None:
        found = found[:max_files]
    return [os.path.join(root, rel) for rel in found]


def cache_root(cache_dir: str | None = None) -> str:
    return os.path.abspath(os.path.expanduser(
        cache_dir or os.environ.get("MEGAZERO_CACHE") or "~/.cache/megazero/default_corpus"))


def corpus_key(files: list[str], root: str, vocab_size: int, max_files: int | None) -> str:
    """Folder name: Python version, parameters and a digest of the (file, size) list."""
    h = hashlib.sha256()
    h.update(f"{CORPUS_FORMAT} {sys.version} {root} {vocab_size} {max_files}\n".encode())
    for path in files:
        h.update(f"{os.path.relpath(path, root)} {os.path.getsize(path)}\n".encode())
    return (f"stdlib-py{platform.python_version()}-v{vocab_size}"
            f"{'' if max_files is None else f'-n{max_files}'}-{h.hexdigest()[:12]}")


def _read_sources(files: list[str]) -> list[str]:
    texts = []
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                texts.append(f.read())
        except (UnicodeDecodeError, OSError) as exc:
            logger.warning("default corpus: skipping %s (%s)", path, exc)
    return texts


def _load(final: str) -> DefaultCorpus | None:
    manifest = os.path.join(final, "manifest.json")
    if not os.path.isfile(manifest):
        return None
    with open(manifest, encoding="utf-8") as f:
        info = json.load(f)
    return DefaultCorpus(data_prefix=os.path.join(final, DATA_NAME),
                         tokenizer_model=os.path.join(final, f"{MODEL_NAME}.model"),
                         cache_dir=final, num_documents=info["num_documents"],
                         num_tokens=info["num_tokens"])


def _build(tmp: str, files: list[str], vocab_size: int, workers: int) -> dict:
    start = time.perf_counter()
    texts = _read_sources(files)
    if not texts:
        raise RuntimeError(f"default corpus: no readable .py files under {stdlib_dir()}")
    logger.info("default corpus: training a SentencePiece BPE tokenizer (vocab %d) on %d files "
                "(%.1f MB)", vocab_size, len(texts), sum(map(len, texts)) / 1e6)
    # trainer threads change no piece (only the thread count recorded in the model file)
    model = train_sentencepiece_bpe(os.path.join(tmp, MODEL_NAME), vocab_size, texts=texts,
                                    num_threads=min(os.cpu_count() or 1, 4))
    dtype = best_fitting_dtype(vocab_size)
    encoder = Encoder({"tokenizer_type": TOKENIZER_TYPE, "tokenizer_model": model},
                      json_keys=None, append_eod=True, dtype=dtype)
    records = ((i + 1, text) for i, text in enumerate(texts))
    results = encode_stream(records, encoder, workers=workers, chunk_size=16)
    stats = write_documents(results, {"text": os.path.join(tmp, DATA_NAME)}, dtype,
                            source="stdlib", log_interval=0)
    info = {"python": sys.version, "stdlib": stdlib_dir(), "vocab_size": vocab_size,
            "num_files": len(files), "num_documents": len(MMapIndexedDataset(
                os.path.join(tmp, DATA_NAME))), "num_tokens": stats.tokens,
            "seconds": round(time.perf_counter() - start, 2)}
    with open(os.path.join(tmp, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=1)
    return info


class _Lock:
    """An exclusive ``flock`` on ``path`` (no-op where fcntl is missing)."""

    def __init__(self, path: str, timeout: float):
        self.path, self.timeout, self.fd = path, timeout, None

    def __enter__(self):
        if fcntl is None:
            return self
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline, logged = time.monotonic() + self.timeout, False
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise TimeoutError(f"default corpus: waited {self.timeout:.0f} s for the "
                                       f"lock {self.path} held by another process") from None
                if not logged:
                    logger.info("default corpus: another process is building it; waiting")
                    logged = True
                time.sleep(0.1)

    def __exit__(self, *exc):
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)


def build_default_corpus(cache_dir: str | None = None, *, vocab_size: int = 4096,
                         max_files: int | None = None, workers: int | None = None,
                         wait_timeout: float = 1800.0) -> DefaultCorpus:
    """Build (or reuse) the standard-library corpus and its tokenizer; see the module doc.

    ``max_files`` keeps only the first files (sorted), for quick tests. ``workers`` > 1
    encodes in a process pool; the default, 1, encodes in this process (a few seconds), which
    spawns nothing inside a training launch.
    """
    root = cache_root(cache_dir)
    files = stdlib_python_files(max_files=max_files)
    final = os.path.join(root, corpus_key(files, stdlib_dir(), vocab_size, max_files))
    corpus = _load(final)
    if corpus is not None:
        logger.info("default corpus: reusing %s", final)
        return corpus
    os.makedirs(root, exist_ok=True)
    with _Lock(final + ".lock", wait_timeout):
        corpus = _load(final)  # built by another process while we waited
        if corpus is not None:
            logger.info("default corpus: reusing %s (built by another process)", final)
            return corpus
        logger.info("default corpus: building from %d standard-library files of %s into %s",
                    len(files), stdlib_dir(), final)
        tmp = f"{final}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        try:
            workers = workers or 1
            info = _build(tmp, files, vocab_size, workers)
            try:
                os.rename(tmp, final)
            except OSError:
                if _load(final) is None:  # not a concurrent builder's result: a real error
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("default corpus: %d documents, %d tokens, built in %.1f s, cached in %s",
                info["num_documents"], info["num_tokens"], info["seconds"], final)
    return _load(final)
