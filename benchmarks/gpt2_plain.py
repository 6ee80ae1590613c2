"""A plain PyTorch GPT-2, nanoGPT-style: the baseline anyone can write in an afternoon.

The same model as megazero's GPT-2 (megazero/model/gpt2.py, transformer.py) at the same shapes:
learned absolute position embeddings, pre-LayerNorm blocks (eps 1e-5), causal self-attention
through ``F.scaled_dot_product_attention(is_causal=True)`` (flash attention on a GPU), a
tanh-GELU MLP of 4h, biases on every linear layer, the output layer tied to the word embedding,
hidden and attention dropout, and the vocabulary padded to a multiple of 128 (megazero's
``--make-vocab-size-divisible-by`` default) with the padding columns left out of the softmax,
as megazero's loss does. Weights start as GPT-2/Megatron's: N(0, 0.02), the two layers that
write into the residual stream N(0, 0.02 / sqrt(2 L)), biases 0, LayerNorms 1 and 0.
tests/test_bench_gpu_step.py checks that its logits, loss and gradients equal megazero's with
the same weights.

Its training step is the standard fast recipe (nanoGPT's): fp32 weights, the forward under
``torch.autocast(bfloat16)`` (bf16 matmuls and attention, fp32 LayerNorm and loss), gradient
accumulation over micro-batches, ``clip_grad_norm_(1.0, foreach=True)``, ``AdamW(fused=True)``
on CUDA (``foreach`` elsewhere), ``zero_grad(set_to_none=True)``, and optionally
``torch.compile(model)``. fp32 weights with autocast rather than pure bf16 weights: the update
then happens in fp32 as in megazero's (and Megatron's) bf16 training with fp32 main
parameters, so both train the same way; bf16 weights would skip the per-micro-batch weight
casts but round every update to 8 bits of mantissa, which is not how GPT-2 is trained.

    model = GPT2(GPT2Config(num_layers=24, hidden_size=1024, num_heads=16, seq_length=1024))
    optimizer = make_optimizer(model)
    loss = train_step(model, optimizer, [(tokens, labels), (tokens, labels)])
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass
class GPT2Config:
    """Shapes and regularisation of a GPT-2 (megazero's flag names in the comments)."""

    num_layers: int = 24  # --num-layers
    hidden_size: int = 1024  # --hidden-size
    num_heads: int = 16  # --num-attention-heads
    seq_length: int = 1024  # --seq-length (= --max-position-embeddings)
    vocab_size: int = 50257  # the tokenizer's; --vocab-size
    make_vocab_size_divisible_by: int = 128  # --make-vocab-size-divisible-by
    hidden_dropout: float = 0.0  # --hidden-dropout
    attention_dropout: float = 0.0  # --attention-dropout
    layernorm_epsilon: float = 1e-5  # --layernorm-epsilon
    init_std: float = 0.02  # --init-method-std

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads "
                             f"{self.num_heads}")

    @property
    def padded_vocab_size(self) -> int:
        m = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // m) * m


def causal_sdpa(q, k, v, dropout_p: float):
    """Causal attention of q, k, v ``[b, nh, t, hs]`` -> ``[b, nh, t, hs]`` (torch picks the
    kernel: flash attention for bf16 on a GPU)."""
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPT2Config, attention):
        super().__init__()
        h = config.hidden_size
        self.c_attn = nn.Linear(h, 3 * h)  # rows: [q | k | v], heads inside each
        self.c_proj = nn.Linear(h, h)
        self.num_heads, self.dropout_p = config.num_heads, config.attention_dropout
        self.attention = attention

    def forward(self, x):
        b, t, h = x.shape  # [b, t, h]
        q, k, v = self.c_attn(x).split(h, dim=2)  # [b, t, h] each
        q, k, v = (z.view(b, t, self.num_heads, h // self.num_heads).transpose(1, 2)
                   for z in (q, k, v))  # [b, nh, t, hs]
        y = self.attention(q, k, v, self.dropout_p if self.training else 0.0)  # [b, nh, t, hs]
        return self.c_proj(y.transpose(1, 2).reshape(b, t, h))  # [b, t, h]


class MLP(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, 4 * config.hidden_size)
        self.c_proj = nn.Linear(4 * config.hidden_size, config.hidden_size)

    def forward(self, x):  # [b, t, h]
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # [b, t, h]


class Block(nn.Module):
    def __init__(self, config: GPT2Config, attention):
        super().__init__()
        eps = config.layernorm_epsilon
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.attn = CausalSelfAttention(config, attention)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, x):  # [b, t, h]
        x = x + self.dropout(self.attn(self.ln_1(x)))
        return x + self.dropout(self.mlp(self.ln_2(x)))


class GPT2(nn.Module):
    """GPT-2 on token ids ``[b, t]``: the mean loss over the tokens given targets, else the
    logits ``[b, t, V]`` of the real vocabulary. ``attention(q, k, v, dropout_p)`` is the
    attention core (``causal_sdpa``; a caller may pass the kernel a GPU would take)."""

    def __init__(self, config: GPT2Config, attention=causal_sdpa, device=None):
        super().__init__()
        self.config = config
        h = config.hidden_size
        with torch.device(device or "cpu"):
            self.wte = nn.Embedding(config.padded_vocab_size, h)
            self.wpe = nn.Embedding(config.seq_length, h)
            self.drop = nn.Dropout(config.hidden_dropout)
            self.blocks = nn.ModuleList(Block(config, attention)
                                        for _ in range(config.num_layers))
            self.ln_f = nn.LayerNorm(h, eps=config.layernorm_epsilon)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        std = self.config.init_std
        residual_std = std / math.sqrt(2.0 * self.config.num_layers)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln_" in name or name.startswith("ln_"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, residual_std if name.endswith("c_proj.weight") else std)

    def forward(self, idx, targets=None):
        t = idx.shape[1]  # idx: [b, t]
        pos = torch.arange(t, device=idx.device)  # [t]
        x = self.drop(self.wte(idx) + self.wpe(pos))  # [b, t, h]
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        # tied output layer over the padded vocabulary (GEMM-friendly), padding dropped after
        logits = F.linear(x, self.wte.weight)[..., :self.config.vocab_size]  # [b, t, V]
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # mean over b t


def make_optimizer(model: nn.Module, lr: float = 3e-4, weight_decay: float = 0.1,
                   betas=(0.9, 0.999), eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices and embeddings only; torch's fused kernel on
    CUDA, the multi-tensor (foreach) implementation elsewhere."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    cuda = params[0].device.type == "cuda"
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=cuda or None,
                             foreach=None if cuda else True)


def compile_model(model: nn.Module) -> nn.Module:
    """The model under ``torch.compile`` (one graph: embedding to loss)."""
    return torch.compile(model)


def forward_backward(model: nn.Module, micro_batches, amp_dtype=torch.bfloat16,
                     device=None) -> torch.Tensor:
    """Forward and backward of every ``(tokens, labels)`` micro-batch (``[b, t]`` each, copied
    to ``device`` without blocking), gradients accumulated for their mean loss; returns that
    mean, detached, on the device (nothing is read on the host)."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    n = len(micro_batches)
    total = None
    for tokens, labels in micro_batches:
        tokens = tokens.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype != torch.float32):
            loss = model(tokens, labels) / n
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                   clip_grad: float = 1.0) -> None:
    """Clip the global gradient norm to ``clip_grad`` (multi-tensor), step, drop the grads."""
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches,
               amp_dtype=torch.bfloat16, clip_grad: float = 1.0, device=None) -> torch.Tensor:
    """One iteration: ``forward_backward`` then ``optimizer_step``; the mean loss (device)."""
    loss = forward_backward(model, micro_batches, amp_dtype, device)
    optimizer_step(model, optimizer, clip_grad)
    return loss
