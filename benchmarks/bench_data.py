"""Data pipeline speed: preprocessing throughput and the compiled index helpers.

1. Preprocessing of the default corpus (the standard library's .py files as jsonl, the default
   corpus's SentencePiece tokenizer, --append-eod) with 1 worker (in-process) and 2 workers
   (process pool): docs/s, tokens/s, MB/s. Also the time of a fresh default-corpus build.
2. ``build_sample_idx`` and ``build_blending_indices`` for a synthetic 10^8-token dataset:
   the C++ extension (``megazero.ops._data``) against the numpy reference in the same run
   (for blending the reference is a Python loop, the algorithm being sequential).

    python benchmarks/bench_data.py [--tokens 100000000] [--repeats 3] [--skip-corpus-build]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import numpy as np

from megazero.data import helpers
from megazero.data.default_corpus import build_default_corpus, stdlib_python_files
from megazero.data.preprocess import preprocess


def _best_time(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_preprocess(tmp, corpus, repeats):
    src = os.path.join(tmp, "stdlib.jsonl")
    with open(src, "w", encoding="utf-8") as f:
        for path in stdlib_python_files():
            with open(path, encoding="utf-8", errors="replace") as g:
                f.write(json.dumps({"text": g.read()}) + "\n")
    rows = []
    for workers in (1, 2):
        runs = [preprocess(src, os.path.join(tmp, f"w{workers}"), corpus.tokenizer_type,
                           tokenizer_model=corpus.tokenizer_model, append_eod=True,
                           workers=workers, log_interval=0) for _ in range(repeats)]
        best = min(runs, key=lambda s: s.seconds)  # best of repeats (shared machine)
        rows.append((workers, best))
    return rows


def synthetic_sizes(total_tokens, mean_doc, seed=0):
    rng = np.random.default_rng(seed)
    sizes = rng.geometric(1.0 / mean_doc, size=int(1.2 * total_tokens / mean_doc))
    sizes = sizes[np.cumsum(sizes) <= total_tokens].astype(np.int32)
    return sizes


def bench_helpers(total_tokens, repeats):
    sizes = synthetic_sizes(total_tokens, mean_doc=500)
    doc_idx = np.random.default_rng(1).permutation(sizes.size).astype(np.int32)
    tokens = int(sizes.sum())
    rows = []
    for seq_length in (1024, 128):
        args = (sizes, doc_idx, seq_length, 1, tokens)
        n = (tokens - 1) // seq_length
        ref = _best_time(lambda a=args: helpers.build_sample_idx(*a, use_cpp=False), repeats)
        cpp = _best_time(lambda a=args: helpers.build_sample_idx(*a, use_cpp=True), repeats)
        assert np.array_equal(helpers.build_sample_idx(*args, use_cpp=True),
                              helpers.build_sample_idx(*args, use_cpp=False))
        rows.append((f"build_sample_idx seq {seq_length} ({n:,} samples, {sizes.size:,} docs)",
                     ref, cpp))
    weights = [0.2, 0.3, 0.5]
    for seq_length in (1024, 128):
        size = tokens // seq_length
        ref = _best_time(
            lambda n=size: helpers.build_blending_indices(weights, n, use_cpp=False), 1)
        cpp = _best_time(
            lambda n=size: helpers.build_blending_indices(weights, n, use_cpp=True), repeats)
        a = helpers.build_blending_indices(weights, size, use_cpp=True)
        b = helpers.build_blending_indices(weights, size, use_cpp=False)
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
        rows.append((f"build_blending_indices 3 datasets ({size:,} samples)", ref, cpp))
    return tokens, rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=10**8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-corpus-build", action="store_true",
                        help="do not time a fresh default-corpus build")
    args = parser.parse_args()
    if not helpers.cpp_available():
        raise SystemExit("megazero.ops._data is not built; build it first "
                         "(MEGAZERO_BUILD_ONLY=data python setup.py build_ext --inplace)")
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
          f"Python {platform.python_version()}, numpy {np.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        build_s = None
        if not args.skip_corpus_build:
            t0 = time.perf_counter()
            corpus = build_default_corpus(os.path.join(tmp, "fresh"))
            build_s = time.perf_counter() - t0
        else:
            corpus = build_default_corpus()
        pre = bench_preprocess(tmp, corpus, args.repeats)
    tokens, helper_rows = bench_helpers(args.tokens, args.repeats)

    print("\n## Preprocessing the default corpus (stdlib .py as jsonl, SentencePiece BPE 4096)")
    print(f"{'workers':>8} | {'docs':>6} | {'MB':>6} | {'tokens':>10} | {'time s':>7} | "
          f"{'docs/s':>8} | {'tokens/s':>10} | {'MB/s':>6} | {'vs 1 worker':>11}")
    base = pre[0][1].seconds
    for workers, s in pre:
        print(f"{workers:>8} | {s.documents:>6} | {s.bytes / 1e6:>6.1f} | {s.tokens:>10,} | "
              f"{s.seconds:>7.2f} | {s.docs_per_s:>8.0f} | {s.tokens_per_s:>10,.0f} | "
              f"{s.mb_per_s:>6.2f} | {base / s.seconds:>10.2f}x")
    if build_s is not None:
        print(f"fresh default-corpus build (train tokenizer + encode + write): {build_s:.1f} s, "
              f"{corpus.num_documents} documents, {corpus.num_tokens:,} tokens")

    print(f"\n## Index helpers, {tokens:,} tokens (C++ vs numpy reference, same run, "
          f"best of {args.repeats}; blending reference: 1 run)")
    print(f"{'function':<62} | {'numpy ms':>9} | {'C++ ms':>8} | {'speedup':>8}")
    for name, ref, cpp in helper_rows:
        print(f"{name:<62} | {ref * 1e3:>9.1f} | {cpp * 1e3:>8.2f} | {ref / cpp:>7.1f}x")


if __name__ == "__main__":
    main()
