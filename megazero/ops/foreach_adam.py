"""Adam/AdamW over many tensors with torch's multi-tensor (``torch._foreach_*``) ops: megazero's
optimizer step on GPU tensors, where the compiled step (``fused_step``) takes CPU tensors only.

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
