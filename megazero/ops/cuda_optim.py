"""Multi-tensor fused Adam/AdamW and LAMB: CUDA kernels, with the CPU ops as their fallback and
reference.

``multi_tensor_adam`` / ``multi_tensor_lamb`` update lists of parameters in place with one
kernel launch per 320 chunks of 64Ki elements (apex's multi_tensor_apply; the kernels are
``csrc/multi_tensor/*.cu``, built as ``megazero.ops._multi_tensor_cuda`` when a CUDA torch and
GPU are present). :class:`FusedAdam` and :class:`FusedLamb` are the ``torch.optim.Optimizer``
faces (DeepSpeed's names).

The CUDA kernels compute the formulas of ``megazero.ops.cpu_adam`` and ``megazero.ops.cpu_lamb``
(module docs there): the same order of operations and bias corrections in the same places
(Adam: step size lr / (1 - beta1^t) and sqrt(v) / sqrt(1 - beta2^t); LAMB: on the moments,
not folded into the step size as DeepSpeed's FusedLamb does), the trust-ratio clamp of
DeepSpeed's FusedLamb (max 10, min 0.01), a ratio of 1 when a norm is 0. They differ only in
rounding (fp32 built with --use_fast_math, FMA contraction, fp32 norms), so one reference per
op serves both: ``cpu_adam.adam_update_reference_`` and ``cpu_lamb.lamb_update_reference_``.
Off the GPU, or without the extension, the same calls run ``cpu_adam.adam_update_`` and
``cpu_lamb.lamb_update_`` (the CPU kernels for CPU tensors, those references otherwise).

Params and grads share one dtype (fp32, bf16, fp16); moments are fp32; math is fp32.

On an H200 megazero's Adam kernel ran at 0.69x torch's fused AdamW (113M fp32 params,
``benchmarks/RESULTS.md``, "First run on a GPU"), so where torch's kernel computes the same
step (CUDA, all tensors fp32, bias correction on) ``multi_tensor_adam`` runs
``torch._fused_adam(w)_`` instead (:func:`torch_fused_adam_`); megazero's kernel keeps what
torch's lacks: bf16/fp16 parameters with fp32 moments, and Adam without bias correction.
"""

from __future__ import annotations

import torch

from megazero.ops._loader import load_extension
from megazero.ops._optim_base import BucketedOptimizer
from megazero.ops.cpu_adam import adam_update_
from megazero.ops.cpu_lamb import lamb_update_
from megazero.ops.registry import register_op

EXTENSION = "multi_tensor_cuda"


def _cuda_ext(params):
    if not params or not all(p.is_cuda for p in params):
        return None
    return load_extension(EXTENSION)


def takes_torch_fused(params, grads, exp_avgs, exp_avg_sqs, bias_correction) -> bool:
    """Whether ``multi_tensor_adam`` runs torch's fused kernel: CUDA, every tensor fp32, bias
    correction on (torch's kernel always applies it)."""
    tensors = [*params, *grads, *exp_avgs, *exp_avg_sqs]
    return bool(params) and bias_correction and all(
        t.is_cuda and t.dtype == torch.float32 for t in tensors)


def torch_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps,
                      weight_decay, step, adam_w_mode=True, grad_scale=1.0) -> None:
    """``adam_update_reference_``'s step (bias correction on) with ``torch._fused_adam(w)_``.

    params, grads, exp_avgs, exp_avg_sqs: lists of fp32 tensors [n_i] on one device; step: the
    count including this step; grads are read, never written (torch's kernel un-scales in
    place, so a ``grad_scale`` other than 1 multiplies into new tensors first)."""
    if not params:
        return
    if grad_scale != 1.0:
        grads = torch._foreach_mul(list(grads), grad_scale)
    steps = torch.full((), float(step), dtype=torch.float32, device=params[0].device)  # []
    kernel = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
    kernel(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), [], [steps] * len(params),
           lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False,
           maximize=False)


def multi_tensor_adam(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1=0.9, beta2=0.999,
                      eps=1e-8, weight_decay=0.0, step, adam_w_mode=True, bias_correction=True,
                      grad_scale=1.0):
    """One Adam/AdamW step over lists of tensors, in place (torch's fused kernel where
    ``takes_torch_fused``, else the CUDA kernel, else adam_update_)."""
    if takes_torch_fused(params, grads, exp_avgs, exp_avg_sqs, bias_correction):
        torch_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, lr=lr, beta1=beta1, beta2=beta2,
                          eps=eps, weight_decay=weight_decay, step=step,
                          adam_w_mode=adam_w_mode, grad_scale=grad_scale)
        return
    ext = _cuda_ext(params)
    if ext is None:
        adam_update_(params, grads, exp_avgs, exp_avg_sqs, step=step, lr=lr, beta1=beta1,
                     beta2=beta2, eps=eps, weight_decay=weight_decay, adam_w_mode=adam_w_mode,
                     bias_correction=bias_correction, grad_scale=grad_scale)
        return
    ext.adam(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), lr, beta1, beta2,
             eps, weight_decay, step, adam_w_mode, bias_correction, grad_scale)


def multi_tensor_lamb(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1=0.9, beta2=0.999,
                      eps=1e-6, weight_decay=0.0, step, bias_correction=True, grad_scale=1.0,
                      max_coeff=10.0, min_coeff=0.01):
    """One LAMB step over lists of tensors, in place (CUDA kernels, else lamb_update_)."""
    ext = _cuda_ext(params)
    if ext is None:
        lamb_update_(params, grads, exp_avgs, exp_avg_sqs, step=step, lr=lr, beta1=beta1,
                     beta2=beta2, eps=eps, weight_decay=weight_decay,
                     bias_correction=bias_correction, grad_scale=grad_scale,
                     max_coeff=max_coeff, min_coeff=min_coeff)
        return
    ext.lamb(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), lr, beta1, beta2,
             eps, weight_decay, step, bias_correction, grad_scale, max_coeff, min_coeff)


class _MultiTensorOptimizer(BucketedOptimizer):
    """One ``_op`` call (multi_tensor_adam or multi_tensor_lamb) per bucket, with the group's
    lr, betas, eps, weight_decay and the options named in ``_op_options``; gradients in the
    param dtype, contiguous, multiplied by step()'s ``grad_scale`` (unscale and clip)."""

    _op_options: tuple[str, ...] = ()

    def step(self, closure=None, grad_scale: float = 1.0):
        return super().step(closure, grad_scale=grad_scale)

    def _update(self, group, step, params, grad_scale=1.0):
        beta1, beta2 = group["betas"]
        grads = [p.grad.to(p.dtype).contiguous() for p in params]
        self._op(params, grads, *self.moments(params), lr=group["lr"], beta1=beta1, beta2=beta2,
                 eps=group["eps"], weight_decay=group["weight_decay"], step=step,
                 grad_scale=grad_scale, **{key: group[key] for key in self._op_options})


class FusedAdam(_MultiTensorOptimizer):
    """Adam/AdamW over all params of a group in one multi-tensor CUDA launch (apex/DeepSpeed
    FusedAdam: torch's fused kernel for fp32, megazero's for bf16/fp16 params or without bias
    correction); ``adam_w_mode=True`` (default) decouples the weight decay."""

    _op = staticmethod(multi_tensor_adam)
    _op_options = ("adam_w_mode", "bias_correction")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 adam_w_mode=True, bias_correction=True):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        adam_w_mode=adam_w_mode, bias_correction=bias_correction)
        super().__init__(params, defaults)


class FusedLamb(_MultiTensorOptimizer):
    """LAMB with per-tensor trust ratio clamped to [min_coeff, max_coeff] (DeepSpeed
    FusedLamb's defaults 0.01 and 10), multi-tensor CUDA kernels."""

    _op = staticmethod(multi_tensor_lamb)
    _op_options = ("bias_correction", "max_coeff", "min_coeff")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0,
                 bias_correction=True, max_coeff=10.0, min_coeff=0.01):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, max_coeff=max_coeff,
                        min_coeff=min_coeff)
        super().__init__(params, defaults)


register_op("cuda_fused_adam", EXTENSION, "multi-tensor Adam/AdamW (CUDA, FusedAdam)",
            simd_level_fn=lambda: "cuda")
register_op("cuda_fused_lamb", EXTENSION, "multi-tensor LAMB (CUDA, FusedLamb)",
            simd_level_fn=lambda: "cuda")
