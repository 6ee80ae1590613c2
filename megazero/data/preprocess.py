"""Tokenize a jsonl corpus into Megatron ``.bin/.idx`` files (Megatron's ``preprocess_data.py``).

    python -m megazero.data.preprocess --input corpus.jsonl --output-prefix data/my \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 2

Each input line is a JSON object; the strings under ``--json-keys`` (default ``text``) are
tokenized and written to ``{output_prefix}_{key}_document.{bin,idx}``, one document each (empty
documents are skipped, as Megatron does). Lines are read as a stream and encoded by a process
pool (``--workers``) in chunks, with a bounded number of chunks in flight, so memory does not
grow with the input. Progress is logged every ``--log-interval`` documents (docs/s, MB/s).
A malformed line (bad JSON or UTF-8, not an object, missing key, non-string value, a lone
surrogate such as an escaped ``"\\ud800"``, text the tokenizer rejects) stops the run with
``file:line``, or is skipped and counted with ``--skip-bad-lines``; blank lines are skipped.
Outputs are written to temporary files beside them and renamed into place only when every
line was read: a failed or interrupted run removes its temporaries and leaves a dataset
already at the output prefix as it was.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from megazero.data.indexed_dataset import MMapIndexedDatasetBuilder, best_fitting_dtype
from megazero.tokenizer import TOKENIZER_TYPES, build_tokenizer

logger = logging.getLogger(__name__)


class PreprocessError(ValueError):
    """A malformed input line (the message names the file and the line number)."""


@dataclass
class PreprocessStats:
    documents: int = 0
    tokens: int = 0
    bytes: int = 0
    skipped: int = 0
    seconds: float = 0.0

    @property
    def docs_per_s(self) -> float:
        return self.documents / max(self.seconds, 1e-9)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / max(self.seconds, 1e-9)


CHUNK_BYTES = 1 << 18  # a task sent to a worker holds at most about this much input
# Workers fork where the platform can: they start at once instead of re-importing megazero
# (and torch) as spawned processes do. Forking is safe here: the parent has run no torch op and
# the workers only tokenize. Callers in a multi-threaded process may pass "spawn".
DEFAULT_MP_CONTEXT = "fork" if "fork" in mp.get_all_start_methods() else "spawn"

# Worker-process state: the encoder built once per process by ``_init_worker``.
_ENCODER = None


class Encoder:
    """Tokenizes one record (a jsonl line or a raw text) into per-key id arrays."""

    def __init__(self, tokenizer_kwargs: dict, json_keys=None, append_eod: bool = False,
                 dtype=np.int32):
        self.tokenizer_kwargs = dict(tokenizer_kwargs)
        self.json_keys = list(json_keys) if json_keys is not None else None  # None: raw text
        self.append_eod = append_eod
        self.dtype = np.dtype(dtype)
        self.tokenizer = None

    def build(self) -> Encoder:
        self.tokenizer = build_tokenizer(**self.tokenizer_kwargs)
        return self

    def _ids(self, text: str) -> np.ndarray:
        ids = self.tokenizer.tokenize(text)
        if ids and self.append_eod:
            ids.append(self.tokenizer.eod)
        return np.asarray(ids, dtype=self.dtype)

    def _encode_value(self, key: str, text: str) -> np.ndarray | str:
        """Ids of ``text``, or an error message (invalid Unicode, or the tokenizer failed)."""
        bad = lone_surrogate(text)
        if bad is not None:
            return (f"value of {key!r} holds a lone surrogate U+{ord(text[bad]):04X} at "
                    f"character {bad}, which is not valid Unicode (a broken \\u escape?)")
        try:
            return self._ids(text)
        except Exception as exc:  # noqa: BLE001 - any tokenizer failure is this line's error
            return f"the tokenizer failed on {key!r}: {type(exc).__name__}: {exc}"

    def encode(self, lineno: int, record) -> tuple[int, dict | str | None, int]:
        """``(lineno, {key: ids} | error message | None for a blank line, bytes read)``."""
        if self.json_keys is None:
            nbytes = len(record.encode("utf-8", "surrogatepass"))
            ids = self._encode_value("text", record)
            return lineno, ids if isinstance(ids, str) else {"text": ids}, nbytes
        nbytes = len(record)
        try:
            line = record.decode("utf-8")
        except UnicodeDecodeError as exc:
            return lineno, f"not valid UTF-8 ({exc})", nbytes
        if not line.strip():
            return lineno, None, nbytes
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            return lineno, f"invalid JSON ({exc})", nbytes
        if not isinstance(obj, dict):
            return lineno, f"expected a JSON object, got {type(obj).__name__}", nbytes
        out = {}
        for key in self.json_keys:
            if key not in obj:
                return lineno, f"missing key {key!r} (--json-keys)", nbytes
            if not isinstance(obj[key], str):
                kind = type(obj[key]).__name__
                return lineno, f"value of {key!r} is {kind}, not a string", nbytes
            ids = self._encode_value(key, obj[key])
            if isinstance(ids, str):
                return lineno, ids, nbytes
            out[key] = ids
        return lineno, out, nbytes

    def encode_chunk(self, chunk):
        return [self.encode(lineno, record) for lineno, record in chunk]


def lone_surrogate(text: str) -> int | None:
    """Index of the first lone surrogate in ``text`` (not encodable as UTF-8), else None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def _init_worker(encoder: Encoder) -> None:
    global _ENCODER
    _ENCODER = encoder.build()


def _encode_chunk_in_worker(chunk):
    return _ENCODER.encode_chunk(chunk)


def _chunks(items: Iterable, size: int, max_bytes: int = CHUNK_BYTES) -> Iterator[list]:
    """Runs of up to ``size`` records, cut early at ``max_bytes`` (large documents)."""
    chunk, nbytes = [], 0
    for item in items:
        chunk.append(item)
        nbytes += len(item[1])
        if len(chunk) == size or nbytes >= max_bytes:
            yield chunk
            chunk, nbytes = [], 0
    if chunk:
        yield chunk


def encode_stream(records: Iterable[tuple[int, object]], encoder: Encoder, workers: int = 1,
                  chunk_size: int = 64, mp_context: str | None = None) -> Iterator[tuple]:
    """Encoded records in input order; at most ``4 * workers`` chunks are in flight.

    Records are ``(lineno, bytes or str)``; a chunk holds ``chunk_size`` records or about
    ``CHUNK_BYTES`` of input, whichever comes first, so memory stays bounded.
    """
    if workers <= 1:
        encoder.build()
        for chunk in _chunks(records, chunk_size):
            yield from encoder.encode_chunk(chunk)
        return
    ctx = mp.get_context(mp_context or DEFAULT_MP_CONTEXT)
    with ctx.Pool(workers, initializer=_init_worker, initargs=(encoder,)) as pool:
        pending = collections.deque()
        for chunk in _chunks(records, chunk_size):
            pending.append(pool.apply_async(_encode_chunk_in_worker, (chunk,)))
            if len(pending) >= 4 * workers:
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()


def write_documents(results: Iterable[tuple], output_prefixes: dict[str, str], dtype,
                    source: str, skip_bad_lines: bool = False, log_interval: int = 1000,
                    on_progress: Callable[[PreprocessStats], None] | None = None
                    ) -> PreprocessStats:
    """Write encoded records to one builder per key; renamed into place only on success."""
    stats = PreprocessStats()
    start = time.perf_counter()
    builders = {k: MMapIndexedDatasetBuilder(p, dtype) for k, p in output_prefixes.items()}
    try:
        for lineno, docs, nbytes in results:
            stats.bytes += nbytes
            if docs is None:
                continue
            if isinstance(docs, str):
                msg = f"{source}:{lineno}: {docs}"
                if not skip_bad_lines:
                    raise PreprocessError(msg + " (use --skip-bad-lines to skip such lines)")
                logger.warning("skipping %s", msg)
                stats.skipped += 1
                continue
            for key, ids in docs.items():
                if ids.size:
                    builders[key].add_document(ids)
                    stats.tokens += int(ids.size)
            stats.documents += 1
            if log_interval and stats.documents % log_interval == 0:
                stats.seconds = time.perf_counter() - start
                logger.info("processed %d documents (%.1f docs/s, %.2f MB/s)", stats.documents,
                            stats.docs_per_s, stats.mb_per_s)
                if on_progress is not None:
                    on_progress(stats)
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    for builder in builders.values():
        builder.finalize()
    stats.seconds = time.perf_counter() - start
    return stats


def _numbered_lines(path: str) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as f:
        yield from enumerate(f, start=1)


def preprocess(input: str, output_prefix: str, tokenizer_type: str, *,
               vocab_file: str | None = None, merge_file: str | None = None,
               tokenizer_model: str | None = None, json_keys=("text",),
               append_eod: bool = False, workers: int = 1, chunk_size: int = 64,
               log_interval: int = 1000, skip_bad_lines: bool = False,
               mp_context: str | None = None) -> PreprocessStats:
    """Tokenize jsonl ``input`` into ``{output_prefix}_{key}_document.{bin,idx}`` per key."""
    if not os.path.isfile(input):
        raise FileNotFoundError(f"--input: no such file: {input}")
    tokenizer_kwargs = dict(tokenizer_type=tokenizer_type, vocab_file=vocab_file,
                            merge_file=merge_file, tokenizer_model=tokenizer_model)
    vocab_size = build_tokenizer(**tokenizer_kwargs).vocab_size  # fail early, in this process
    dtype = best_fitting_dtype(vocab_size)
    encoder = Encoder(tokenizer_kwargs, json_keys, append_eod, dtype)
    outputs = {k: f"{output_prefix}_{k}_document" for k in json_keys}
    logger.info("tokenizing %s with %s (%d workers) -> %s", input, tokenizer_type, workers,
                ", ".join(f"{p}.bin/.idx" for p in outputs.values()))
    results = encode_stream(_numbered_lines(input), encoder, workers, chunk_size, mp_context)
    stats = write_documents(results, outputs, dtype, input, skip_bad_lines, log_interval)
    if stats.documents == 0:
        logger.warning("%s holds no documents: the outputs are empty datasets, which training "
                       "refuses", input)
    logger.info("done: %d documents, %d tokens, %.1f MB in %.2f s (%.1f docs/s, %.2f MB/s)%s",
                stats.documents, stats.tokens, stats.bytes / 1e6, stats.seconds,
                stats.docs_per_s, stats.mb_per_s,
                f"; skipped {stats.skipped} bad lines" if stats.skipped else "")
    return stats


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Tokenize jsonl into Megatron .bin/.idx files",
                                allow_abbrev=False)
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="jsonl file, one JSON object per line")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys to extract from each JSON object")
    g.add_argument("--skip-bad-lines", action="store_true",
                   help="skip malformed lines (logged with their line number) instead of "
                        "failing")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=list(TOKENIZER_TYPES))
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--append-eod", action="store_true",
                   help="append the end-of-document token to each document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True)
    g.add_argument("--dataset-impl", default="mmap", choices=["mmap"])
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="encoding processes")
    g.add_argument("--chunk-size", type=int, default=64, help="lines per task sent to a worker")
    g.add_argument("--log-interval", type=int, default=1000, help="documents between reports")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.workers < 1 or args.chunk_size < 1:
        raise SystemExit("--workers and --chunk-size must be >= 1")
    try:
        stats = preprocess(args.input, args.output_prefix, args.tokenizer_type,
                           vocab_file=args.vocab_file, merge_file=args.merge_file,
                           tokenizer_model=args.tokenizer_model, json_keys=args.json_keys,
                           append_eod=args.append_eod, workers=args.workers,
                           chunk_size=args.chunk_size, log_interval=args.log_interval,
                           skip_bad_lines=args.skip_bad_lines)
    except (PreprocessError, FileNotFoundError, ValueError) as exc:
        logger.error("error: %s", exc)
        return 1
    for key in args.json_keys:
        logger.info("wrote %s_%s_document.bin/.idx", args.output_prefix, key)
    logger.info("%d documents, %d tokens, %d skipped", stats.documents, stats.tokens,
                stats.skipped)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
