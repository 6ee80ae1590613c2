"""Text generation speed: KV cache against recomputing the whole context at every step.

``megazero.generate.generate`` on a randomly initialised GPT-2 (one process, tp=1, fp32),
greedy, with the KV cache (the default) and with ``use_kv_cache=False`` (the whole context
again at each step, as before the cache), contenders interleaved round by round. Prints the
median milliseconds per generated token, tokens/s, the speed-up, and checks that both produce
the same tokens.

    python benchmarks/bench_generate.py [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megazero.config import MegazeroConfig, ModelConfig
from megazero.distributed.parallel_state import ParallelState
from megazero.inference.generate import generate
from megazero.model import GPTModel

# (name, layers, hidden, heads, max positions, vocab, prompt length, new tokens)
MODELS = [
    ("main-job model", 4, 256, 4, 256, 4096, 16, 192),
    ("GPT-2 small shape", 12, 768, 12, 512, 8192, 32, 96),
]


def bench(name, layers, hidden, heads, max_pos, vocab, prompt_len, new, rounds):
    cfg = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                      seq_length=max_pos, max_position_embeddings=max_pos, vocab_size=vocab,
                      attention_dropout=0.0, hidden_dropout=0.0)
    config = MegazeroConfig(model=cfg)
    ps = ParallelState.build(1, 1)
    model = GPTModel(cfg, ps, seed=1).eval()
    prompt = torch.randint(0, vocab, (prompt_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    times = {True: [], False: []}
    ids = {}
    for _ in range(rounds):
        for cached in (True, False):
            t = time.perf_counter()
            ids[cached] = generate(model, ps, config, prompt, max_new_tokens=new, greedy=True,
                                   use_kv_cache=cached)
            times[cached].append((time.perf_counter() - t) / new)
    same = ids[True] == ids[False]
    cached, full = statistics.median(times[True]), statistics.median(times[False])
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"{name:<18}{params:>7.1f}M{prompt_len:>7}{new:>6}{cached * 1e3:>11.2f}"
          f"{full * 1e3:>11.2f}{1 / cached:>10.1f}{1 / full:>10.1f}{full / cached:>9.2f}x"
          f"{'yes' if same else 'NO':>7}")
    return same


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, greedy, "
          f"median of {args.rounds} interleaved rounds")
    head = (f"{'model':<18}{'params':>8}{'prompt':>7}{'new':>6}{'ms/tok KV':>11}"
            f"{'ms/tok all':>11}{'tok/s KV':>10}{'tok/s all':>10}{'speed-up':>10}{'same':>7}")
    print(head)
    print("-" * len(head))
    ok = all([bench(*m, rounds=args.rounds) for m in MODELS])
    if not ok:
        raise SystemExit("the cached and recomputed generations differ")


if __name__ == "__main__":
    main()
