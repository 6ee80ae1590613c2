"""Framework overhead: megazero's GPT-2 training step at tp=1 against plain PyTorch.

Both sides run the same GPT-2 (pre-LN blocks, GELU-tanh MLP, SDPA causal attention, tied
output layer), the same batch and AdamW with the same hyper-parameters, in one process. The
plain model is written with ``torch.nn`` here; megazero's goes through its tensor-parallel
layers (identity collectives at tp=1), vocab-parallel cross entropy and flat-buffer optimizer
(with the fused kernels when built). Steps are interleaved (A, B, A, B, ...) and the median
is reported, so machine noise hits both alike.

    python benchmarks/bench_gpt2.py [--layers 4 --hidden 256 --seq 256 --batch 8 --steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from megazero.config import ModelConfig, OptimizerConfig
from megazero.data_parallel import ZeroOptimizer
from megazero.distributed.parallel_state import ParallelState
from megazero.model import build_gpt_model_chunks


class PlainBlock(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.heads = heads

    def forward(self, x):  # [b, s, h]
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class PlainGPT2(nn.Module):
    def __init__(self, vocab, seq, h, heads, layers):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(PlainBlock(h, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)

    def forward(self, ids, labels):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def plain_step_fn(args, ids, labels):
    model = PlainGPT2(args.vocab, args.seq, args.hidden, args.heads, args.layers)
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=False)
        model(ids, labels).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step, sum(p.numel() for p in model.parameters())


def megazero_step_fn(args, ids, labels):
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden,
                      num_attention_heads=args.heads, seq_length=args.seq,
                      vocab_size=args.vocab, make_vocab_size_divisible_by=128,
                      attention_dropout=0.0, hidden_dropout=0.0)
    ps = ParallelState.build()
    (model,) = build_gpt_model_chunks(cfg, ps, seed=1)
    opt = ZeroOptimizer([model], OptimizerConfig(lr=1e-4, weight_decay=0.1, clip_grad=1.0), ps)
    pos = torch.arange(args.seq).expand_as(ids)

    def step():
        opt.zero_grad()
        model(ids, pos, labels=labels).mean().backward()
        opt.finish_grad_sync()
        opt.step()

    return step, sum(p.numel() for p in model.parameters())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    labels = torch.randint(0, args.vocab, (args.batch, args.seq))
    contenders = {"plain torch.nn + AdamW": plain_step_fn(args, ids, labels),
                  "megazero (tp=1, ZeRO-0)": megazero_step_fn(args, ids, labels)}
    times = {name: [] for name in contenders}
    for step, _ in contenders.values():
        step()  # warm-up
    for _ in range(args.steps):
        for name, (step, _) in contenders.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    tokens = args.batch * args.seq
    print(f"GPT-2 training step: {args.layers} layers, h={args.hidden}, seq={args.seq}, "
          f"batch={args.batch}, vocab={args.vocab}; median of {args.steps} interleaved steps, "
          f"{torch.get_num_threads()} threads")
    print(f"{'contender':<28}{'params':>12}{'step ms':>10}{'tokens/s':>11}")
    med = {}
    for name, (_, nparams) in contenders.items():
        med[name] = statistics.median(times[name])
        print(f"{name:<28}{nparams:>12,}{med[name] * 1e3:>10.1f}{tokens / med[name]:>11.0f}")
    a, b = med["plain torch.nn + AdamW"], med["megazero (tp=1, ZeRO-0)"]
    print(f"megazero step time / plain: {b / a:.3f} (overhead {100 * (b / a - 1):+.1f}%)")


if __name__ == "__main__":
    main()
