"""The fused optimizer step for a ZeRO partition, and the global gradient norm before it.

A ZeRO rank owns one contiguous slice of the flat fp32 main parameters, of the gradients
(fp32, bf16 or fp16) and of the two Adam moments. With the global norm known, one pass

    grad * grad_scale  ->  inf/NaN check  ->  Adam/AdamW  ->  fp32 param, moments, and the
                                                             bf16/fp16 model copy

reads and writes each array once (28 bytes per parameter plus the copy, for fp32 grads),
where torch composes unscale, clip, fused Adam and a cast in four passes. The order the ZeRO
optimizer follows (one thread count, torch's, for every call):

    sq = global_grad_norm_sq([grad_partition])       # float64, inf/NaN if any grad is
    sq = all_reduce(sq, dp group)                     # sum over ranks (and tp/pp as needed)
    if not math.isfinite(sq): skip the step, lower the loss scale
    norm = math.sqrt(sq) / loss_scale
    clip_coef = min(1, max_norm / (norm + 1e-6))
    fused_adam_step(main, grad, m, v, step=t, ..., grad_scale=clip_coef / loss_scale,
                    weight_decay=segments, model_param_out=bf16_partition)

Weight decay per parameter: pass ``weight_decay`` as a list of (start, end, wd) segments of
the partition (sorted, disjoint; say (start, end, 0.0) for biases and norms). Elements in no
segment are not touched, so padding can be left out. Calling once per segment on views
(``main[s:e]``, ...) is equivalent, only slower for many small parameters.

Non-finite guard: the kernel also checks every scaled gradient; an element whose scaled
gradient is inf/NaN keeps its param, moments and copy, and the call returns True. That only
happens when the caller skipped the norm check above: treat True as "step partly skipped".

LAMB for ZeRO (per-parameter trust ratios need per-parameter norms): see
``fused_lamb_stage1`` / ``lamb_trust_ratios`` / ``fused_lamb_stage2`` in
``megazero.ops.cpu_lamb``, re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megazero.ops import _cpu_ext as cx
from megazero.ops.cpu_adam import adam_kernel_call, adam_update_reference_
from megazero.ops.cpu_lamb import (
    fused_lamb_stage1,
    fused_lamb_stage1_reference,
    fused_lamb_stage2,
    fused_lamb_stage2_reference,
    lamb_trust_ratios,
)
from megazero.ops.registry import op_status, register_op

__all__ = [
    "fused_adam_step", "fused_adam_step_reference", "fused_lamb_stage1",
    "fused_lamb_stage1_reference", "fused_lamb_stage2", "fused_lamb_stage2_reference",
    "global_grad_norm_sq", "global_grad_norm_sq_reference", "lamb_trust_ratios",
]


def global_grad_norm_sq(grads: Sequence[torch.Tensor]) -> float:
    """Sum of squares of all elements of ``grads`` (any shapes, fp32/bf16/fp16), in float64.

    inf or NaN when any element is inf or NaN. Vectorised and parallel; the result does not
    depend on the thread count or SIMD level (fixed summation order: per 16384-element block,
    16 float64 lanes, then blocks and tensors in order).
    """
    ext = cx.get_extension("adam")
    if ext is None or not all(g.device.type == "cpu" and g.dtype in cx.DTYPE_CODES
                              and cx.holds_data(g) for g in grads):
        return global_grad_norm_sq_reference(grads)
    grads = [g.contiguous() for g in grads]
    sums = [0.0] * len(grads)
    for dtype in cx.FLOAT_DTYPES:
        idx = [k for k, g in enumerate(grads) if g.dtype == dtype]
        if not idx:
            continue
        part = ext.sum_squares([grads[k].data_ptr() for k in idx],
                               [grads[k].numel() for k in idx], cx.DTYPE_CODES[dtype],
                               cx.num_threads())
        for k, s in zip(idx, part):
            sums[k] = s
    total = 0.0
    for s in sums:
        total += s
    return total


def global_grad_norm_sq_reference(grads: Sequence[torch.Tensor]) -> float:
    """Reference: the same sum with torch in float64 (equal up to float64 rounding)."""
    total = 0.0
    for g in grads:
        total += float(g.detach().double().square().sum())
    return total


def _check_partition(param_fp32, grad, exp_avg, exp_avg_sq, model_param_out) -> None:
    for name, t in (("param_fp32", param_fp32), ("grad", grad), ("exp_avg", exp_avg),
                    ("exp_avg_sq", exp_avg_sq), ("model_param_out", model_param_out)):
        if t is not None and t.dim() != 1:
            raise ValueError(f"fused_adam_step: {name} must be 1-D, got shape {tuple(t.shape)}")
    cx.check_same_numel("fused_adam_step", param_fp32, grad, exp_avg, exp_avg_sq,
                        model_param_out)
    for name, t in (("param_fp32", param_fp32), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32:
            raise ValueError(f"fused_adam_step: {name} must be fp32, got {t.dtype}")
    if grad.dtype not in cx.DTYPE_CODES:
        raise ValueError(f"fused_adam_step: grad must be fp32/bf16/fp16, got {grad.dtype}")
    if model_param_out is not None and model_param_out.dtype not in cx.DTYPE_CODES:
        raise ValueError("fused_adam_step: model_param_out must be bf16/fp16/fp32")


def fused_adam_step(param_fp32: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float,
                    beta2: float, eps: float,
                    weight_decay: float | Sequence[tuple[int, int, float]],
                    adam_w_mode: bool = True, bias_correction: bool = True,
                    grad_scale: float = 1.0,
                    model_param_out: torch.Tensor | None = None) -> bool:
    """One Adam/AdamW step of a ZeRO partition in one pass; returns found_nonfinite.

    param_fp32 [n] fp32 main parameters, grad [n] fp32/bf16/fp16, exp_avg / exp_avg_sq [n]
    fp32, all updated in place; model_param_out [n] bf16/fp16 (or None) receives the updated
    parameters. ``grad_scale`` multiplies the gradient (1/loss_scale * clip_coef).
    ``weight_decay``: a float for all elements, or (start, end, wd) segments (see module doc).
    Arithmetic: ``megazero.ops.cpu_adam`` module doc, with ``mask_nonfinite``.
    """
    _check_partition(param_fp32, grad, exp_avg, exp_avg_sq, model_param_out)
    if not cx.holds_data(param_fp32):
        # The dry run's fake tensors: the kernels update in place and allocate nothing, so
        # neither does this (the reference's op-by-op temporaries would not be the job's).
        return False
    segments = cx.normalize_segments(param_fp32.numel(), weight_decay)
    ext = cx.get_extension("adam")
    if ext is None or not (cx.kernel_ready(param_fp32, grad, exp_avg, exp_avg_sq,
                                           model_param_out)):
        return fused_adam_step_reference(
            param_fp32, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2,
            eps=eps, weight_decay=segments, adam_w_mode=adam_w_mode,
            bias_correction=bias_correction, grad_scale=grad_scale,
            model_param_out=model_param_out)
    if not segments:
        return False

    def ptrs(t: torch.Tensor | None) -> list[int]:
        if t is None:
            return []
        base, size = t.data_ptr(), t.element_size()
        return [base + s * size for s, _, _ in segments]

    return adam_kernel_call(
        ext, ptrs(param_fp32), ptrs(grad), ptrs(exp_avg), ptrs(exp_avg_sq),
        ptrs(model_param_out), [e - s for s, e, _ in segments], [wd for _, _, wd in segments],
        param_dtype=torch.float32, grad_dtype=grad.dtype,
        copy_dtype=None if model_param_out is None else model_param_out.dtype, step=step,
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, adam_w_mode=adam_w_mode,
        bias_correction=bias_correction, grad_scale=grad_scale, mask_nonfinite=True)


def fused_adam_step_reference(param_fp32, grad, exp_avg, exp_avg_sq, *, step, lr, beta1,
                              beta2, eps, weight_decay, adam_w_mode=True,
                              bias_correction=True, grad_scale=1.0,
                              model_param_out=None) -> bool:
    """PyTorch reference of ``fused_adam_step`` (bit-identical in fp32)."""
    _check_partition(param_fp32, grad, exp_avg, exp_avg_sq, model_param_out)
    segments = cx.normalize_segments(param_fp32.numel(), weight_decay)
    if not segments:
        return False

    def views(t):
        return None if t is None else [t[s:e] for s, e, _ in segments]

    return adam_update_reference_(
        views(param_fp32), views(grad), views(exp_avg), views(exp_avg_sq), step=step, lr=lr,
        beta1=beta1, beta2=beta2, eps=eps, weight_decay=[wd for _, _, wd in segments],
        adam_w_mode=adam_w_mode, bias_correction=bias_correction, grad_scale=grad_scale,
        copies=views(model_param_out), mask_nonfinite=True)


_ADAM_STEP = register_op("fused_adam_step", "adam",
                         "one-pass unscale+clip+Adam+cast step of a ZeRO partition "
                         "(fused_step)", simd_level_fn=lambda: cx.simd_level("adam"))


def fused_step_status() -> dict:
    """Whether the fused Adam step's kernel is built, at which SIMD level, and why not
    (``registry.op_status``)."""
    return op_status(_ADAM_STEP)
register_op("grad_norm_sq", "adam", "global gradient norm, float64 sum of squares (fused_step)",
            simd_level_fn=lambda: cx.simd_level("adam"))
