"""Adam/AdamW over many tensors with torch's multi-tensor ops: megazero's optimizer step on GPU
tensors, where the compiled step (``fused_step``) takes CPU tensors only.

``adam_update_device_`` is the training step's path: torch's fused Adam/AdamW kernel
(``torch._fused_adam(w)_``, what ``torch.optim.AdamW(fused=True)`` runs: one multi-tensor
launch per 2,240 chunks of 64Ki elements) with the step's scalars as device tensors: the
gradient's divisor (un-scaling, dp averaging and clipping in one), the overflow flag (the
kernel leaves everything unchanged when it is set) and the step count. Nothing is read on the
host, so a step never waits for the device. Gradients in bf16/fp16 are copied to fp32 in
batches of ``DEVICE_BATCH_NUMEL`` elements first (the kernel takes one dtype), the updated fp32
values copied to the model's dtype after; differences from ``adam_update_foreach_`` are
rounding only (the kernel divides by the gradient's divisor and fuses its arithmetic).

``adam_update_foreach_`` is the path without bias correction (which the fused kernel always
applies) and the reference's twin:

Before this, a GPU step ran the PyTorch reference of that kernel once per segment: about 20
kernel launches per parameter, 12k launches per step of GPT-2 345M, and an H200 idle for half
of each step (``benchmarks/RESULTS.md``, "First run on a GPU"). Here each operation is one
multi-tensor launch over a batch of segments.

The arithmetic is ``cpu_adam.adam_update_reference_``'s, operation for operation (each op one
rounding, no fused multiply-add), so the result is bit-identical to that reference: on the GPU,
fp32 ``sqrt`` is correctly rounded as the reference's float64 route is; on the CPU (tests),
where torch's vectorised fp32 sqrt is not, the square root takes the reference's float64 route.
The reference masks non-finite gradient elements (the step leaves them unchanged); this path
first checks one norm per batch and, when any scaled gradient is not finite, runs the
reference on that batch instead. Batches hold at most ``BATCH_NUMEL`` elements, which bounds
the temporaries (four fp32 arrays of the batch).
"""

from __future__ import annotations

import torch

from megazero.ops import _cpu_ext as cx
from megazero.ops.cpu_adam import adam_step_constants, adam_update_reference_

BATCH_NUMEL = 1 << 26  # 64Mi elements: 1 GiB of fp32 temporaries at most
DEVICE_BATCH_NUMEL = 1 << 25  # 32Mi elements: 128 MiB of fp32 gradient copies at most


def adam_update_device_(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps,
                        weight_decay, adam_w_mode=True, grad_scale, found_inf, copies=None,
                        batch_numel: int = DEVICE_BATCH_NUMEL) -> None:
    """Adam/AdamW in place with torch's fused kernel, every scalar but lr on the device.

    params, exp_avgs, exp_avg_sqs: fp32 [n_i]; grads [n_i] fp32/bf16/fp16; step: fp32 []
    (the count including this step: used for bias correction); grad_scale: float64 [1], the
    factor the gradient is multiplied by; found_inf: bool [1] (skip the update); copies: None
    or [n_i] model-dtype tensors (None where not wanted) receiving the updated values. The
    kernel divides fp32 gradients in place (the others through their fp32 copies)."""
    n = len(params)
    wds = cx.per_tensor("weight_decay", weight_decay, n)
    divisor = torch.reciprocal(grad_scale).float()  # [1]: the kernel divides the gradient
    skip = found_inf.float()  # [1]
    kernel = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
    keep = [i for i in range(n) if params[i].numel()]
    fp32 = all(grads[i].dtype == torch.float32 for i in keep)
    for wd in sorted({wds[i] for i in keep}):
        group = [i for i in keep if wds[i] == wd]
        for batch in _batches([params[i].numel() for i in group], batch_numel):
            idx = [group[j] for j in batch]
            g = [grads[i] for i in idx]
            if not fp32:  # one flat fp32 copy of the batch's gradients
                flat = torch.empty(sum(t.numel() for t in g), dtype=torch.float32,
                                   device=g[0].device)
                g32 = list(torch.split(flat, [t.numel() for t in g]))
                torch._foreach_copy_(g32, g)
                g = g32
            kernel([params[i] for i in idx], g, [exp_avgs[i] for i in idx],
                   [exp_avg_sqs[i] for i in idx], [], [step] * len(idx), lr=lr, beta1=beta1,
                   beta2=beta2, weight_decay=wd, eps=eps, amsgrad=False, maximize=False,
                   grad_scale=divisor, found_inf=skip)
    _copy(copies, params)


def _batches(sizes: list[int], limit: int) -> list[list[int]]:
    """Consecutive index groups of at most ``limit`` elements (a larger tensor alone)."""
    out, cur, total = [], [], 0
    for i, n in enumerate(sizes):
        if cur and total + n > limit:
            out.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += n
    if cur:
        out.append(cur)
    return out


def _sqrt(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Correctly rounded fp32 square roots (``cpu_adam.sqrt_f32`` for a list)."""
    if xs[0].device.type == "cuda":
        return torch._foreach_sqrt(xs)
    wide = [torch.empty_like(x, dtype=torch.float64) for x in xs]
    torch._foreach_copy_(wide, xs)
    torch._foreach_sqrt_(wide)
    out = [torch.empty_like(x) for x in xs]
    torch._foreach_copy_(out, wide)
    return out


def adam_update_foreach_(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps,
                         weight_decay=0.0, adam_w_mode=True, bias_correction=True,
                         grad_scale=1.0, copies=None, batch_numel: int = BATCH_NUMEL) -> bool:
    """``adam_update_reference_(..., mask_nonfinite=True)`` with multi-tensor ops, in place.

    params, exp_avgs, exp_avg_sqs: lists of fp32 tensors [n_i]; grads [n_i] fp32/bf16/fp16;
    copies (None, or a list with None where no copy is wanted) [n_i] in the model dtype,
    receiving the updated parameters. Returns
    whether a scaled gradient held a non-finite value (those elements were left unchanged).
    """
    n = len(params)
    wds = cx.per_tensor("weight_decay", weight_decay, n)
    keep = [i for i in range(n) if params[i].numel()]
    found = False
    for batch in _batches([params[i].numel() for i in keep], batch_numel):
        idx = [keep[j] for j in batch]
        found |= _batch_step(
            [params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
            [exp_avg_sqs[i] for i in idx], None if copies is None else [copies[i] for i in idx],
            [wds[i] for i in idx], step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            adam_w_mode=adam_w_mode, bias_correction=bias_correction, grad_scale=grad_scale)
    return found


def _batch_step(p, g, m, v, copies, wds, *, step, lr, beta1, beta2, eps, adam_w_mode,
                bias_correction, grad_scale) -> bool:
    step_size, bc2_sqrt = adam_step_constants(lr, beta1, beta2, step, bias_correction)
    b1, omb1, b2, omb2 = (cx.f32(x) for x in (beta1, 1.0 - beta1, beta2, 1.0 - beta2))
    e, ss, bc2, gs = (cx.f32(x) for x in (eps, step_size, bc2_sqrt, grad_scale))
    grad = [torch.empty_like(t) for t in p]  # [n_i] fp32 each
    torch._foreach_copy_(grad, g)
    torch._foreach_mul_(grad, gs)
    norms = torch._foreach_norm(grad)
    if not bool(torch.stack(norms).isfinite().all()):  # rare: the reference masks elementwise
        found = adam_update_reference_(
            p, g, m, v, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wds,
            adam_w_mode=adam_w_mode, bias_correction=bias_correction, grad_scale=grad_scale,
            mask_nonfinite=True)
        _copy(copies, p)
        return found
    decayed = [i for i, wd in enumerate(wds) if wd != 0.0]
    if decayed and not adam_w_mode:  # L2: grad + p * wd
        torch._foreach_add_([grad[i] for i in decayed], torch._foreach_mul(
            [p[i] for i in decayed], [cx.f32(wds[i]) for i in decayed]))
    torch._foreach_mul_(m, b1)  # m1 = m * b1 + grad * omb1
    torch._foreach_add_(m, torch._foreach_mul(grad, omb1))
    torch._foreach_mul_(grad, grad)  # v1 = v * b2 + (grad * grad) * omb2
    torch._foreach_mul_(grad, omb2)
    torch._foreach_mul_(v, b2)
    torch._foreach_add_(v, grad)
    denom = _sqrt(v)  # sqrt(v1) / bc2 + eps
    torch._foreach_div_(denom, bc2)
    torch._foreach_add_(denom, e)
    if decayed and adam_w_mode:  # p * (1 - lr * wd)
        torch._foreach_mul_([p[i] for i in decayed], [cx.f32(1.0 - lr * wds[i]) for i in decayed])
    update = torch._foreach_mul(m, ss)  # p1 = p1 - (m1 * ss) / denom
    torch._foreach_div_(update, denom)
    torch._foreach_sub_(p, update)
    _copy(copies, p)
    return False


def _copy(copies, params) -> None:
    """copies[i] <- params[i] (rounded to the copy's dtype) where copies[i] is not None."""
    if copies is None:
        return
    pairs = [(c, t) for c, t in zip(copies, params) if c is not None]
    if pairs:
        torch._foreach_copy_([c for c, _ in pairs], [t for _, t in pairs])
