"""--compile on CPU: megazero's training iteration with and without torch.compile per layer.

Both contenders are the README's model (``scripts/pretrain_gpt2.sh``'s ``GPT_ARGS``, read from
the script: 4 layers, hidden 256, seq 256, micro-batch 4, global batch 16, i.e. 4 micro-batches
accumulated per iteration), built by ``pretrain_gpt2``'s provider from the same parsed flags
plus ``--compile`` for one of them, with megazero's ZeRO-0 optimizer, in one process. The
first iteration of each is timed alone (for ``--compile``: dynamo, AOTAutograd and inductor's
C++ build; with a fresh inductor cache unless ``--warm-cache``), then iterations alternate
(eager, compiled, eager, ...) and the median, min and max are reported, so machine noise hits
both alike.

    python benchmarks/bench_compile.py [--iters 10] [--warm-cache] [--threads N]
    python benchmarks/bench_compile.py --set num-layers=2 --set hidden-size=64 \
        --set seq-length=64 --set max-position-embeddings=64 --iters 2   # smoke run
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import tempfile
import time
from pathlib import Path

import torch

from megazero.arguments import parse_args
from megazero.data_parallel import ZeroOptimizer
from megazero.distributed.parallel_state import ParallelState
from megazero.model import build_gpt_model_chunks

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 4096  # the default corpus's SentencePiece vocabulary


def readme_flags(overrides: dict[str, str]) -> list[str]:
    """``GPT_ARGS`` of scripts/pretrain_gpt2.sh, with ``--name value`` overrides applied."""
    text = (ROOT / "scripts" / "pretrain_gpt2.sh").read_text()
    body = re.search(r"GPT_ARGS=\((.*?)\)", text, re.S).group(1)
    argv = shlex.split(body, comments=True)
    for name, value in overrides.items():
        flag = f"--{name}"
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    return argv


def contender(argv: list[str]):
    """(one training iteration as a function, tokens per iteration, the config)."""
    config = parse_args(argv, world_size=1)
    ps = ParallelState.build()
    (model,) = build_gpt_model_chunks(config.model, ps, seed=config.train.seed)
    opt = ZeroOptimizer([model], config.optimizer, ps)
    mb, seq = config.train.micro_batch_size, config.model.seq_length
    micro = config.train.global_batch_size // mb
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, VOCAB, (mb, seq), generator=gen),
                torch.randint(0, VOCAB, (mb, seq), generator=gen)) for _ in range(micro)]
    pos = torch.arange(seq).expand(mb, seq)

    def iteration():
        opt.zero_grad()
        for ids, labels in batches:
            (model(ids, pos, labels=labels).mean() / micro).backward()
        opt.finish_grad_sync()
        opt.step()

    return iteration, micro * mb * seq, config


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per contender")
    parser.add_argument("--warm-cache", action="store_true",
                        help="use inductor's usual on-disk cache (default: a fresh one, so the "
                             "first iteration pays the whole compile)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--set", action="append", default=[], metavar="FLAG=VALUE",
                        help="override a GPT_ARGS flag, e.g. --set num-layers=2")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cache = None
    if not args.warm_cache:
        cache = tempfile.TemporaryDirectory(prefix="bench-compile-inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache.name
    overrides = dict(s.split("=", 1) for s in args.set)
    base = readme_flags(overrides) + ["--mock-data", "--vocab-size", str(VOCAB)]
    names = ("eager", "--compile")
    runs = {"eager": contender(base), "--compile": contender(base + ["--compile"])}
    first = {}
    for name in names:
        t0 = time.perf_counter()
        runs[name][0]()
        first[name] = time.perf_counter() - t0
    times = {name: [] for name in names}
    for _ in range(args.iters):
        for name in names:
            t0 = time.perf_counter()
            runs[name][0]()
            times[name].append(time.perf_counter() - t0)
    cfg = runs["eager"][2]
    tokens = runs["eager"][1]
    print(f"GPT-2 training iteration on CPU (scripts/pretrain_gpt2.sh's model"
          f"{', overridden: ' + ' '.join(args.set) if args.set else ''}): "
          f"{cfg.model.num_layers} layers, h={cfg.model.hidden_size}, seq="
          f"{cfg.model.seq_length}, micro-batch {cfg.train.micro_batch_size}, global batch "
          f"{cfg.train.global_batch_size}; {torch.get_num_threads()} threads; "
          f"{'warm' if args.warm_cache else 'fresh'} inductor cache; median of {args.iters} "
          f"interleaved iterations")
    print(f"{'contender':<12}{'first iter s':>14}{'median ms':>11}{'min ms':>9}{'max ms':>9}"
          f"{'tokens/s':>10}")
    med = {}
    for name in names:
        t = times[name]
        med[name] = statistics.median(t)
        print(f"{name:<12}{first[name]:>14.2f}{med[name] * 1e3:>11.1f}{min(t) * 1e3:>9.1f}"
              f"{max(t) * 1e3:>9.1f}{tokens / med[name]:>10.0f}")
    gain = med["eager"] - med["--compile"]
    extra = first["--compile"] - first["eager"]
    print(f"--compile / eager step time: {med['--compile'] / med['eager']:.3f}; first-iteration "
          f"cost {extra:.1f} s" + (f", paid back after {extra / gain:.0f} iterations"
                                   if gain > 0 else ", not paid back (no gain per iteration)"))
    if cache is not None:
        cache.cleanup()


if __name__ == "__main__":
    main()
