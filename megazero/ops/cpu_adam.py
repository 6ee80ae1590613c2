"""CPU Adam/AdamW: ``CPUAdam`` (a ``torch.optim.Optimizer``) and the multi-tensor update
``adam_update_`` behind it and behind the fused ZeRO step, with its PyTorch reference.

The compiled kernel (``csrc/adam``, extension ``_adam``) reads each parameter, gradient and
moment once and writes parameter and moments once (28 bytes per fp32 parameter), on
``torch.get_num_threads()`` OpenMP threads, with the AVX-512/AVX2/scalar path picked at run
time. Without the extension the reference ``adam_update_reference_`` runs the same arithmetic
with torch ops. Per element, in fp32, every operation rounded (no FMA):

    g  = grad * grad_scale
    g  = g + p * wd                                   (L2 mode, adam_w_mode=False)
    m  = m * beta1 + g * (1 - beta1)
    v  = v * beta2 + (g * g) * (1 - beta2)
    d  = sqrt(v) / sqrt(1 - beta2^t) + eps
    p  = p * (1 - lr * wd)                            (AdamW mode)
    p  = p - ((lr / (1 - beta1^t)) * m) / d

with the scalars computed in float64 and rounded once to float32 (no bias correction: the
two corrections are 1), sqrt correctly rounded. Every SIMD level gives the same bits, and so
does the reference (one exception: at the avx512_bf16 level, bf16 stores flush fp32
denormals, |x| < 2^-126, to zero). torch.optim.Adam/AdamW differ in the last bit here and
there (lerp for m, a sqrt that is not correctly rounded); 100 steps agree to ~1e-7 relative.

The CUDA multi-tensor kernel (``FusedAdam``, megazero/ops/cuda_optim.py) computes the same
formula with fp32 fast math, so ``adam_update_reference_`` is its reference too.

Dtypes: parameters fp32, bf16 or fp16, updated in their own dtype (computed in fp32, rounded
to nearest even on store); gradients fp32/bf16/fp16; moments always fp32. There is no fp32
master copy for low-precision parameters (keep one yourself, or use the fused step).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from megazero.ops import _cpu_ext as cx
from megazero.ops._optim_base import BucketedOptimizer
from megazero.ops.registry import register_op

logger = logging.getLogger(__name__)

__all__ = ["CPUAdam", "adam_step_constants", "adam_update_", "adam_update_reference_"]


def adam_step_constants(lr: float, beta1: float, beta2: float, step: int,
                        bias_correction: bool) -> tuple[float, float]:
    """(step_size, bc2_sqrt) in float64: lr / (1 - beta1^step), sqrt(1 - beta2^step)."""
    if not bias_correction:
        return float(lr), 1.0
    return float(lr) / (1.0 - beta1 ** step), math.sqrt(1.0 - beta2 ** step)


def sqrt_f32(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root (the kernel's vsqrtps/sqrtss).

    torch.sqrt on fp32 CPU tensors is not correctly rounded (its vectorised path is off by one
    ulp on ~15% of inputs); sqrt in float64 rounded once to fp32 is exact.
    """
    return torch.sqrt(x.double()).float()


def _check_lists(params, grads, exp_avgs, exp_avg_sqs, copies) -> None:
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == n):
        raise ValueError("adam_update_: params, grads and moments must be lists of equal length")
    if copies is not None and len(copies) != n:
        raise ValueError("adam_update_: copies must be None or one per param")
    cx.check_dtypes("adam_update_", params, cx.FLOAT_DTYPES, "params")
    cx.check_dtypes("adam_update_", grads, cx.FLOAT_DTYPES, "grads")
    cx.check_dtypes("adam_update_", list(exp_avgs) + list(exp_avg_sqs), (torch.float32,),
                    "moments")
    if copies is not None:
        cx.check_dtypes("adam_update_", copies, cx.FLOAT_DTYPES, "copies")
        if params and params[0].dtype != torch.float32:
            raise ValueError("adam_update_: copies need fp32 params")
    for k in range(n):
        cx.check_same_numel("adam_update_", params[k], grads[k], exp_avgs[k], exp_avg_sqs[k],
                            None if copies is None else copies[k])


def adam_update_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                 exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], *,
                 step: int, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float | Sequence[float] = 0.0, adam_w_mode: bool = True,
                 bias_correction: bool = True, grad_scale: float = 1.0,
                 copies: Sequence[torch.Tensor] | None = None,
                 mask_nonfinite: bool = False) -> bool:
    """One Adam/AdamW step over lists of tensors, in place (kernel, else the reference).

    params[k] (any shape, fp32/bf16/fp16, one dtype for all), grads[k] (same numel, one dtype),
    exp_avgs[k] / exp_avg_sqs[k] (fp32, same numel). ``weight_decay``: one value or one per
    tensor. ``grad_scale`` multiplies the gradient first. ``copies[k]``: a tensor (bf16/fp16/
    fp32, needs fp32 params) that receives the updated parameter. With ``mask_nonfinite``,
    elements whose scaled gradient is inf/NaN keep param, moments and copy unchanged.
    Returns True when such an element was met (always False without ``mask_nonfinite``).
    """
    _check_lists(params, grads, exp_avgs, exp_avg_sqs, copies)
    if params and not cx.holds_data(params[0]):
        return False  # fake tensors (the dry run): the in-place kernel allocates nothing
    wds = cx.per_tensor("weight_decay", weight_decay, len(params))
    ext = cx.get_extension("adam")
    kernel_ok = ext is not None and all(
        cx.kernel_ready(params[k], exp_avgs[k], exp_avg_sqs[k],
                        None if copies is None else copies[k]) and grads[k].device.type == "cpu"
        for k in range(len(params)))
    kwargs = dict(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wds,
                  adam_w_mode=adam_w_mode, bias_correction=bias_correction,
                  grad_scale=grad_scale, copies=copies, mask_nonfinite=mask_nonfinite)
    if not kernel_ok:
        return adam_update_reference_(params, grads, exp_avgs, exp_avg_sqs, **kwargs)
    if not params:
        return False
    grads = [g.contiguous() for g in grads]  # read-only: a copy is harmless
    return adam_kernel_call(
        ext,
        [p.data_ptr() for p in params], [g.data_ptr() for g in grads],
        [m.data_ptr() for m in exp_avgs], [v.data_ptr() for v in exp_avg_sqs],
        [] if copies is None else [c.data_ptr() for c in copies],
        [p.numel() for p in params], wds,
        param_dtype=params[0].dtype, grad_dtype=grads[0].dtype,
        copy_dtype=None if copies is None else copies[0].dtype,
        **{k: v for k, v in kwargs.items() if k not in ("weight_decay", "copies")})


def adam_kernel_call(ext, p_ptrs, g_ptrs, m_ptrs, v_ptrs, c_ptrs, sizes, wds, *,
                     param_dtype, grad_dtype, copy_dtype, step, lr, beta1, beta2, eps,
                     adam_w_mode, bias_correction, grad_scale, mask_nonfinite) -> bool:
    """The raw kernel call on buffer addresses (checked by the caller)."""
    step_size, bc2_sqrt = adam_step_constants(lr, beta1, beta2, step, bias_correction)
    return bool(ext.adam_update(
        p_ptrs, g_ptrs, m_ptrs, v_ptrs, c_ptrs, sizes, wds,
        cx.DTYPE_CODES[param_dtype], cx.DTYPE_CODES[grad_dtype],
        cx.NO_DTYPE if copy_dtype is None else cx.DTYPE_CODES[copy_dtype],
        float(lr), float(beta1), float(beta2), float(eps), step_size, bc2_sqrt,
        float(grad_scale), bool(adam_w_mode), bool(mask_nonfinite), cx.num_threads()))


@torch.no_grad()
def adam_update_reference_(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2,
                           eps, weight_decay=0.0, adam_w_mode=True, bias_correction=True,
                           grad_scale=1.0, copies=None, mask_nonfinite=False) -> bool:
    """PyTorch reference of ``adam_update_``: the kernel's arithmetic, op by op, in fp32."""
    _check_lists(params, grads, exp_avgs, exp_avg_sqs, copies)
    wds = cx.per_tensor("weight_decay", weight_decay, len(params))
    step_size, bc2_sqrt = adam_step_constants(lr, beta1, beta2, step, bias_correction)
    b1, omb1, b2, omb2 = (cx.f32(x) for x in (beta1, 1.0 - beta1, beta2, 1.0 - beta2))
    e, ss, bc2, gs = (cx.f32(x) for x in (eps, step_size, bc2_sqrt, grad_scale))
    found = False
    for k, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        wd = wds[k]
        p0 = p.float()
        grad = g.float() * gs
        if mask_nonfinite:
            ok = torch.isfinite(grad)
            # (a fake tensor of the dry run has no values: it counts as finite)
            found = found or (cx.holds_data(ok) and not bool(ok.all()))
        if not adam_w_mode and wd != 0.0:
            grad = grad + p0 * cx.f32(wd)
        m1 = m * b1 + grad * omb1
        v1 = v * b2 + (grad * grad) * omb2
        denom = sqrt_f32(v1) / bc2 + e
        p1 = p0 * cx.f32(1.0 - lr * wd) if adam_w_mode and wd != 0.0 else p0
        p1 = p1 - (m1 * ss) / denom
        if mask_nonfinite:
            p1, m1, v1 = torch.where(ok, p1, p0), torch.where(ok, m1, m), torch.where(ok, v1, v)
        p.copy_(p1)
        m.copy_(m1)
        v.copy_(v1)
        if copies is not None:
            copies[k].copy_(p1)
    return found


class CPUAdam(BucketedOptimizer):
    """Adam/AdamW for CPU tensors, stepping them in place with megazero's kernel.

    Same hyperparameters as DeepSpeedCPUAdam; ``adam_w_mode=True`` is AdamW (decoupled weight
    decay), False is Adam with L2 (torch.optim.Adam's ``weight_decay``). ``state_dict()`` has
    torch.optim.Adam's layout (state[i] = {"step", "exp_avg", "exp_avg_sq"}), so checkpoints
    load both ways; the moments stay fp32 whatever the parameter dtype. Parameters must be
    CPU tensors; non-contiguous ones take the (slower) reference path.
    """

    cpu_only = True

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, adam_w_mode: bool = True,
                 bias_correction: bool = True):
        if lr < 0.0:
            raise ValueError(f"invalid learning rate {lr}")
        if eps < 0.0:
            raise ValueError(f"invalid eps {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}")
        if weight_decay < 0.0:
            raise ValueError(f"invalid weight_decay {weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        adam_w_mode=adam_w_mode, bias_correction=bias_correction,
                        amsgrad=False, maximize=False)
        super().__init__(params, defaults)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            # groups loaded from torch.optim.Adam/AdamW name the mode decoupled_weight_decay
            group.setdefault("adam_w_mode", group.get("decoupled_weight_decay",
                                                      self.defaults["adam_w_mode"]))
            group.setdefault("bias_correction", True)
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)

    def _update(self, group, step, params):
        if group["amsgrad"] or group["maximize"]:
            raise ValueError("CPUAdam has no amsgrad or maximize option; use "
                             "torch.optim.AdamW(amsgrad=..., maximize=...) for those")
        beta1, beta2 = group["betas"]
        adam_update_(params, [p.grad for p in params], *self.moments(params), step=step,
                     lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                     weight_decay=group["weight_decay"], adam_w_mode=group["adam_w_mode"],
                     bias_correction=group["bias_correction"])


register_op("cpu_adam", "adam", "CPU Adam/AdamW step (megazero.ops.CPUAdam)",
            simd_level_fn=lambda: cx.simd_level("adam"))
