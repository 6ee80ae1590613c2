"""Multi-tensor fused Adam/AdamW and LAMB: CUDA kernels with PyTorch reference paths.

``multi_tensor_adam`` / ``multi_tensor_lamb`` update lists of parameters in place with one
kernel launch per 320 chunks of 64Ki elements (apex's multi_tensor_apply; the kernels are
``csrc/multi_tensor/*.cu``, built as ``megazero.ops._multi_tensor_cuda`` when a CUDA torch and
GPU are present). Off the GPU, or without the extension, the same math runs as PyTorch ops
per tensor (:func:`adam_reference`, :func:`lamb_reference`). :class:`FusedAdam` and
:class:`FusedLamb` are the ``torch.optim.Optimizer`` faces (DeepSpeed's names); the CPU
optimizers are ``megazero.ops.CPUAdam`` and its LAMB counterpart.

Params and grads share one dtype (fp32, bf16, fp16); moments are fp32; math is fp32.
Adam follows torch.optim.Adam(W)'s order of operations; LAMB is (with m_hat, v_hat the
bias-corrected moments) ``u = m_hat / (sqrt(v_hat) + eps) + wd * p``,
``p -= lr * clamp(|p| / |u|, min_coeff, max_coeff) * u`` (ratio 1 when a norm is 0), the
trust-ratio clamp of DeepSpeed's FusedLamb (max 10, min 0.01).
"""

from __future__ import annotations

import math

import torch

from megazero.ops._loader import load_extension
from megazero.ops.registry import register_op

EXTENSION = "multi_tensor_cuda"


def _bias_corrections(beta1, beta2, step, bias_correction):
    if not bias_correction:
        return 1.0, 1.0
    return 1.0 - beta1 ** step, 1.0 - beta2 ** step


@torch.no_grad()
def adam_reference(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps,
                   weight_decay, step, adam_w_mode=True, bias_correction=True, grad_scale=1.0):
    """Adam/AdamW step in PyTorch ops, per tensor (the kernel's math, fp32)."""
    bc1, bc2 = _bias_corrections(beta1, beta2, step, bias_correction)
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        p32 = p.float()
        g = g.float() * grad_scale
        if not adam_w_mode and weight_decay:
            g = g + weight_decay * p32
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        if adam_w_mode and weight_decay:
            p32 = p32 * (1 - lr * weight_decay)
        p32 = p32.addcdiv(m, v.sqrt() / math.sqrt(bc2) + eps, value=-lr / bc1)
        p.copy_(p32)


@torch.no_grad()
def lamb_reference(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps,
                   weight_decay, step, bias_correction=True, grad_scale=1.0, max_coeff=10.0,
                   min_coeff=0.01):
    """LAMB step in PyTorch ops, per tensor (the kernel's math, fp32)."""
    bc1, bc2 = _bias_corrections(beta1, beta2, step, bias_correction)
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        p32 = p.float()
        g = g.float() * grad_scale
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        u = (m / bc1) / ((v / bc2).sqrt() + eps) + weight_decay * p32
        p_norm, u_norm = p32.norm().item(), u.norm().item()
        ratio = 1.0
        if p_norm > 0 and u_norm > 0:
            ratio = min(max(p_norm / u_norm, min_coeff), max_coeff)
        p.copy_(p32 - lr * ratio * u)


def _cuda_ext(params):
    if not params or not all(p.is_cuda for p in params):
        return None
    return load_extension(EXTENSION)


def multi_tensor_adam(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1=0.9, beta2=0.999,
                      eps=1e-8, weight_decay=0.0, step, adam_w_mode=True, bias_correction=True,
                      grad_scale=1.0):
    """One Adam/AdamW step over lists of tensors, in place (CUDA kernel or reference)."""
    ext = _cuda_ext(params)
    if ext is None:
        return adam_reference(params, grads, exp_avgs, exp_avg_sqs, lr=lr, beta1=beta1,
                              beta2=beta2, eps=eps, weight_decay=weight_decay, step=step,
                              adam_w_mode=adam_w_mode, bias_correction=bias_correction,
                              grad_scale=grad_scale)
    ext.adam(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), lr, beta1, beta2,
             eps, weight_decay, step, adam_w_mode, bias_correction, grad_scale)


def multi_tensor_lamb(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1=0.9, beta2=0.999,
                      eps=1e-6, weight_decay=0.0, step, bias_correction=True, grad_scale=1.0,
                      max_coeff=10.0, min_coeff=0.01):
    """One LAMB step over lists of tensors, in place (CUDA kernel or reference)."""
    ext = _cuda_ext(params)
    if ext is None:
        return lamb_reference(params, grads, exp_avgs, exp_avg_sqs, lr=lr, beta1=beta1,
                              beta2=beta2, eps=eps, weight_decay=weight_decay, step=step,
                              bias_correction=bias_correction, grad_scale=grad_scale,
                              max_coeff=max_coeff, min_coeff=min_coeff)
    ext.lamb(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), lr, beta1, beta2,
             eps, weight_decay, step, bias_correction, grad_scale, max_coeff, min_coeff)


class _MultiTensorOptimizer(torch.optim.Optimizer):
    """Shared step(): group params by (device, dtype, step) and call one multi-tensor op."""

    def _update(self, group, params, grads, ms, vs, step, grad_scale):  # pragma: no cover
        """One multi-tensor call for one (device, dtype, step) bucket; subclasses define it."""
        raise TypeError(f"{type(self).__name__} must define _update")

    @torch.no_grad()
    def step(self, closure=None, grad_scale: float = 1.0):
        """One step; gradients are multiplied by ``grad_scale`` (unscale and clip factor)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            buckets: dict[tuple, list] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse grads")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                key = (p.device, p.dtype, state["step"])
                buckets.setdefault(key, []).append(p)
            for (_, _, step), ps in buckets.items():
                grads = [p.grad.to(p.dtype).contiguous() for p in ps]
                self._update(group, ps, grads, [self.state[p]["exp_avg"] for p in ps],
                             [self.state[p]["exp_avg_sq"] for p in ps], step, grad_scale)
        return loss


class FusedAdam(_MultiTensorOptimizer):
    """Adam/AdamW over all params of a group in one multi-tensor CUDA launch (apex/DeepSpeed
    FusedAdam); ``adam_w_mode=True`` (default) decouples the weight decay."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 adam_w_mode=True, bias_correction=True):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        adam_w_mode=adam_w_mode, bias_correction=bias_correction)
        super().__init__(params, defaults)

    def _update(self, group, params, grads, ms, vs, step, grad_scale):
        beta1, beta2 = group["betas"]
        multi_tensor_adam(params, grads, ms, vs, lr=group["lr"], beta1=beta1, beta2=beta2,
                          eps=group["eps"], weight_decay=group["weight_decay"], step=step,
                          adam_w_mode=group["adam_w_mode"],
                          bias_correction=group["bias_correction"], grad_scale=grad_scale)


class FusedLamb(_MultiTensorOptimizer):
    """LAMB with per-tensor trust ratio clamped to [min_coeff, max_coeff] (DeepSpeed
    FusedLamb's defaults 0.01 and 10), multi-tensor CUDA kernels."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0,
                 bias_correction=True, max_coeff=10.0, min_coeff=0.01):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, max_coeff=max_coeff,
                        min_coeff=min_coeff)
        super().__init__(params, defaults)

    def _update(self, group, params, grads, ms, vs, step, grad_scale):
        beta1, beta2 = group["betas"]
        multi_tensor_lamb(params, grads, ms, vs, lr=group["lr"], beta1=beta1, beta2=beta2,
                          eps=group["eps"], weight_decay=group["weight_decay"], step=step,
                          bias_correction=group["bias_correction"], grad_scale=grad_scale,
                          max_coeff=group["max_coeff"], min_coeff=group["min_coeff"])


register_op("cuda_fused_adam", EXTENSION, "multi-tensor Adam/AdamW (CUDA, FusedAdam)",
            simd_level_fn=lambda: "cuda")
register_op("cuda_fused_lamb", EXTENSION, "multi-tensor LAMB (CUDA, FusedLamb)",
            simd_level_fn=lambda: "cuda")
