"""CPU LAMB: ``CPULamb`` (a ``torch.optim.Optimizer``), the two-stage update behind it and
behind the ZeRO partition variant (``fused_lamb_stage1`` / ``fused_lamb_stage2``), and the
PyTorch reference of each.

LAMB as computed here (per parameter tensor; fp32 arithmetic, each operation rounded, moments
fp32, norms in float64):

    g = grad * grad_scale
    m = m * beta1 + g * (1 - beta1)
    v = v * beta2 + (g * g) * (1 - beta2)
    u = (m / bc1) / (sqrt(v / bc2) + eps) + p * weight_decay     bc = 1 - beta^t (or 1)
    r = clamp(||p|| / ||u||, min_coeff, max_coeff)   (r = 1 when ||p|| or ||u|| is 0)
    p = p - (lr * r) * u

The clamp (min_coeff 0.01, max_coeff 10) is DeepSpeed FusedLamb's. Unlike FusedLamb, which
folds the bias corrections into the step size (lr * sqrt(bc2) / bc1, u = m / (sqrt(v) + eps)
+ wd * p, so its weight decay and eps are rescaled too), the corrections apply to the moments,
as in the LAMB paper and apex's FusedLAMB. The trust ratio covers every tensor, weight
decay or not.

Stage 1 (``lamb_stage1_``) updates the moments and returns per tensor the sums of squares of
p and u; stage 2 (``lamb_stage2_``) recomputes u from the stored moments and applies the
trust ratio. Memory traffic: 24 + 16 bytes per fp32 parameter (Adam: 28). For ZeRO the two
stages take (start, end, weight_decay) segments of a flat partition; the caller adds the
per-segment sums of each parameter over the data-parallel ranks before ``lamb_trust_ratios``.
``lamb_update_`` runs the whole step (stage 1, ratios, stage 2); its reference
``lamb_update_reference_`` is also the reference of the CUDA kernels (``FusedLamb``,
megazero/ops/cuda_optim.py), which compute the same formula with fp32 fast math.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from megazero.ops import _cpu_ext as cx
from megazero.ops._optim_base import BucketedOptimizer
from megazero.ops.cpu_adam import sqrt_f32
from megazero.ops.registry import register_op

__all__ = [
    "CPULamb", "fused_lamb_stage1", "fused_lamb_stage1_reference", "fused_lamb_stage2",
    "fused_lamb_stage2_reference", "lamb_stage1_", "lamb_stage1_reference_", "lamb_stage2_",
    "lamb_stage2_reference_", "lamb_trust_ratio", "lamb_trust_ratios", "lamb_update_",
    "lamb_update_reference_",
]


def lamb_bias_corrections(beta1: float, beta2: float, step: int,
                          bias_correction: bool) -> tuple[float, float]:
    if not bias_correction:
        return 1.0, 1.0
    return 1.0 - beta1 ** step, 1.0 - beta2 ** step


def lamb_trust_ratio(w_sq: float, u_sq: float, min_coeff: float = 0.01,
                     max_coeff: float = 10.0) -> float:
    """clamp(sqrt(w_sq) / sqrt(u_sq), min_coeff, max_coeff), or 1 when either norm is 0."""
    w, u = math.sqrt(w_sq), math.sqrt(u_sq)
    if w == 0.0 or u == 0.0:
        return 1.0
    return min(max(w / u, min_coeff), max_coeff)


def lamb_trust_ratios(w_sq, u_sq, min_coeff: float = 0.01,
                      max_coeff: float = 10.0) -> torch.Tensor:
    """Elementwise ``lamb_trust_ratio`` over per-parameter sums; float64 tensor."""
    w = torch.as_tensor(w_sq, dtype=torch.float64).sqrt()
    u = torch.as_tensor(u_sq, dtype=torch.float64).sqrt()
    r = (w / u).clamp(min_coeff, max_coeff)
    return torch.where((w == 0) | (u == 0), torch.ones_like(r), r)


def _check(name, params, exp_avgs, exp_avg_sqs, grads=None, copies=None) -> None:
    n = len(params)
    if len(exp_avgs) != n or len(exp_avg_sqs) != n or (grads is not None and len(grads) != n):
        raise ValueError(f"{name}: params, grads and moments must be lists of equal length")
    if copies is not None and len(copies) != n:
        raise ValueError(f"{name}: copies must be None or one per param")
    cx.check_dtypes(name, params, cx.FLOAT_DTYPES, "params")
    cx.check_dtypes(name, list(exp_avgs) + list(exp_avg_sqs), (torch.float32,), "moments")
    if grads is not None:
        cx.check_dtypes(name, grads, cx.FLOAT_DTYPES, "grads")
    if copies is not None:
        cx.check_dtypes(name, copies, cx.FLOAT_DTYPES, "copies")
        if params and params[0].dtype != torch.float32:
            raise ValueError(f"{name}: copies need fp32 params")
    for k in range(n):
        cx.check_same_numel(name, params[k], exp_avgs[k], exp_avg_sqs[k],
                            None if grads is None else grads[k],
                            None if copies is None else copies[k])


def _kernel(params, *others) -> object | None:
    ext = cx.get_extension("lamb")
    if ext is None:
        return None
    for group in (params, *others):
        if group is not None and not all(cx.kernel_ready(t) for t in group):
            return None
    return ext


def _ptrs(tensors) -> list[int]:
    return [] if tensors is None else [t.data_ptr() for t in tensors]


def lamb_stage1_(params, grads, exp_avgs, exp_avg_sqs, *, step: int, beta1: float,
                 beta2: float, eps: float, weight_decay: float | Sequence[float] = 0.0,
                 bias_correction: bool = True, grad_scale: float = 1.0,
                 mask_nonfinite: bool = False) -> tuple[list[float], list[float], bool]:
    """Stage 1 in place on the moments; returns (sum p^2, sum u^2) per tensor and whether a
    non-finite scaled gradient was met (with ``mask_nonfinite``, those elements keep m, v)."""
    _check("lamb_stage1_", params, exp_avgs, exp_avg_sqs, grads=grads)
    wds = cx.per_tensor("weight_decay", weight_decay, len(params))
    grads = [g.contiguous() for g in grads]
    ext = _kernel(params, grads, exp_avgs, exp_avg_sqs)
    if ext is None:
        return lamb_stage1_reference_(params, grads, exp_avgs, exp_avg_sqs, step=step,
                                      beta1=beta1, beta2=beta2, eps=eps, weight_decay=wds,
                                      bias_correction=bias_correction, grad_scale=grad_scale,
                                      mask_nonfinite=mask_nonfinite)
    if not params:
        return [], [], False
    bc1, bc2 = lamb_bias_corrections(beta1, beta2, step, bias_correction)
    w_sq, u_sq, found = ext.lamb_stage1(
        _ptrs(params), _ptrs(grads), _ptrs(exp_avgs), _ptrs(exp_avg_sqs),
        [p.numel() for p in params], wds, cx.dtype_code(params[0]), cx.dtype_code(grads[0]),
        float(beta1), float(beta2), float(eps), bc1, bc2, float(grad_scale),
        bool(mask_nonfinite), cx.num_threads())
    return list(w_sq), list(u_sq), bool(found)


def _update_ref(p0, m, v, wd, b1c, b2c, e):
    u = (m / b1c) / (sqrt_f32(v / b2c) + e)
    return u + p0 * cx.f32(wd) if wd != 0.0 else u


@torch.no_grad()
def lamb_stage1_reference_(params, grads, exp_avgs, exp_avg_sqs, *, step, beta1, beta2, eps,
                           weight_decay=0.0, bias_correction=True, grad_scale=1.0,
                           mask_nonfinite=False) -> tuple[list[float], list[float], bool]:
    """PyTorch reference of ``lamb_stage1_`` (moments bit-identical; sums to float64 rounding)."""
    _check("lamb_stage1_", params, exp_avgs, exp_avg_sqs, grads=grads)
    wds = cx.per_tensor("weight_decay", weight_decay, len(params))
    bc1, bc2 = lamb_bias_corrections(beta1, beta2, step, bias_correction)
    b1, omb1, b2, omb2 = (cx.f32(x) for x in (beta1, 1.0 - beta1, beta2, 1.0 - beta2))
    e, b1c, b2c, gs = (cx.f32(x) for x in (eps, bc1, bc2, grad_scale))
    w_sq, u_sq, found = [], [], False
    for p, g, m, v, wd in zip(params, grads, exp_avgs, exp_avg_sqs, wds):
        p0 = p.float()
        grad = g.float() * gs
        m1 = m * b1 + grad * omb1
        v1 = v * b2 + (grad * grad) * omb2
        if mask_nonfinite:
            ok = torch.isfinite(grad)
            found = found or (cx.holds_data(ok) and not bool(ok.all()))
            m1, v1 = torch.where(ok, m1, m), torch.where(ok, v1, v)
        m.copy_(m1)
        v.copy_(v1)
        u = _update_ref(p0, m1, v1, wd, b1c, b2c, e)
        w_sq.append(float(p0.double().square().sum()))
        u_sq.append(float(u.double().square().sum()))
    return w_sq, u_sq, found


def lamb_stage2_(params, exp_avgs, exp_avg_sqs, *, step: int, lr: float, beta1: float,
                 beta2: float, eps: float, trust_ratios: Sequence[float],
                 weight_decay: float | Sequence[float] = 0.0, bias_correction: bool = True,
                 copies=None) -> None:
    """Stage 2 in place: p -= (lr * trust_ratios[k]) * u; copies[k] (fp32 params) gets p."""
    _check("lamb_stage2_", params, exp_avgs, exp_avg_sqs, copies=copies)
    wds = cx.per_tensor("weight_decay", weight_decay, len(params))
    ratios = cx.per_tensor("trust_ratios", trust_ratios, len(params))
    ext = _kernel(params, exp_avgs, exp_avg_sqs, copies)
    if ext is None:
        return lamb_stage2_reference_(params, exp_avgs, exp_avg_sqs, step=step, lr=lr,
                                      beta1=beta1, beta2=beta2, eps=eps, trust_ratios=ratios,
                                      weight_decay=wds, bias_correction=bias_correction,
                                      copies=copies)
    if not params:
        return None
    bc1, bc2 = lamb_bias_corrections(beta1, beta2, step, bias_correction)
    ext.lamb_stage2(
        _ptrs(params), _ptrs(exp_avgs), _ptrs(exp_avg_sqs), _ptrs(copies),
        [p.numel() for p in params], wds, [float(lr) * r for r in ratios],
        cx.dtype_code(params[0]), cx.dtype_code(None if copies is None else copies[0]),
        float(beta1), float(beta2), float(eps), bc1, bc2, cx.num_threads())
    return None


@torch.no_grad()
def lamb_stage2_reference_(params, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps,
                           trust_ratios, weight_decay=0.0, bias_correction=True,
                           copies=None) -> None:
    """PyTorch reference of ``lamb_stage2_`` (bit-identical in fp32)."""
    _check("lamb_stage2_", params, exp_avgs, exp_avg_sqs, copies=copies)
    wds = cx.per_tensor("weight_decay", weight_decay, len(params))
    ratios = cx.per_tensor("trust_ratios", trust_ratios, len(params))
    bc1, bc2 = lamb_bias_corrections(beta1, beta2, step, bias_correction)
    e, b1c, b2c = cx.f32(eps), cx.f32(bc1), cx.f32(bc2)
    for k, (p, m, v) in enumerate(zip(params, exp_avgs, exp_avg_sqs)):
        p0 = p.float()
        p1 = p0 - _update_ref(p0, m, v, wds[k], b1c, b2c, e) * cx.f32(float(lr) * ratios[k])
        p.copy_(p1)
        if copies is not None:
            copies[k].copy_(p1)


def lamb_update_(params, grads, exp_avgs, exp_avg_sqs, *, step: int, lr: float, beta1: float,
                 beta2: float, eps: float, weight_decay: float | Sequence[float] = 0.0,
                 bias_correction: bool = True, grad_scale: float = 1.0,
                 max_coeff: float = 10.0, min_coeff: float = 0.01,
                 reference: bool = False) -> list[float]:
    """One LAMB step over lists of tensors, in place: stage 1, each tensor's trust ratio
    (``lamb_trust_ratio``), stage 2. Returns the ratios. ``reference=True`` runs the PyTorch
    references of the stages instead of the kernel."""
    stage1 = lamb_stage1_reference_ if reference else lamb_stage1_
    stage2 = lamb_stage2_reference_ if reference else lamb_stage2_
    common = dict(step=step, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                  bias_correction=bias_correction)
    w_sq, u_sq, _ = stage1(params, grads, exp_avgs, exp_avg_sqs, grad_scale=grad_scale, **common)
    ratios = [lamb_trust_ratio(w, u, min_coeff, max_coeff) for w, u in zip(w_sq, u_sq)]
    stage2(params, exp_avgs, exp_avg_sqs, lr=float(lr), trust_ratios=ratios, **common)
    return ratios


def lamb_update_reference_(*args, **kwargs) -> list[float]:
    """PyTorch reference of ``lamb_update_``."""
    return lamb_update_(*args, reference=True, **kwargs)


# ---- ZeRO partition variant -------------------------------------------------------------

def _segment_views(t, segments):
    return None if t is None else [t[s:e] for s, e, _ in segments]


def fused_lamb_stage1(param_fp32: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                      exp_avg_sq: torch.Tensor, *,
                      segments: float | Sequence[tuple[int, int, float]], step: int,
                      beta1: float, beta2: float, eps: float, bias_correction: bool = True,
                      grad_scale: float = 1.0, reference: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """LAMB stage 1 on a ZeRO partition: param_fp32/exp_avg/exp_avg_sq [n] fp32, grad [n]
    fp32/bf16/fp16; ``segments`` (start, end, weight_decay), one per (piece of a) parameter.

    Returns (w_sq, u_sq) float64 tensors [len(segments)] and found_nonfinite (those elements
    keep their moments). Sum each parameter's entries over ranks, then ``lamb_trust_ratios``.
    ``reference=True`` runs the PyTorch reference instead of the kernel.
    """
    segs = cx.normalize_segments(param_fp32.numel(), segments, keep_empty=True)
    fn = lamb_stage1_reference_ if reference else lamb_stage1_
    w, u, found = fn(_segment_views(param_fp32, segs), _segment_views(grad, segs),
                     _segment_views(exp_avg, segs), _segment_views(exp_avg_sq, segs),
                     step=step, beta1=beta1, beta2=beta2, eps=eps,
                     weight_decay=[wd for _, _, wd in segs], bias_correction=bias_correction,
                     grad_scale=grad_scale, mask_nonfinite=True)
    return (torch.tensor(w, dtype=torch.float64), torch.tensor(u, dtype=torch.float64), found)


def fused_lamb_stage1_reference(*args, **kwargs):
    """PyTorch reference of ``fused_lamb_stage1``."""
    return fused_lamb_stage1(*args, reference=True, **kwargs)


def fused_lamb_stage2(param_fp32: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                      *, segments, trust_ratios, step: int, lr: float, beta1: float,
                      beta2: float, eps: float, bias_correction: bool = True,
                      model_param_out: torch.Tensor | None = None,
                      reference: bool = False) -> None:
    """LAMB stage 2 on a ZeRO partition; ``trust_ratios`` [len(segments)] (float64 tensor or
    floats); model_param_out [n] bf16/fp16 (or None) receives the updated parameters.
    ``reference=True`` runs the PyTorch reference instead of the kernel."""
    segs = cx.normalize_segments(param_fp32.numel(), segments, keep_empty=True)
    ratios = [float(r) for r in torch.as_tensor(trust_ratios, dtype=torch.float64).tolist()]
    fn = lamb_stage2_reference_ if reference else lamb_stage2_
    fn(_segment_views(param_fp32, segs), _segment_views(exp_avg, segs),
       _segment_views(exp_avg_sq, segs), step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
       trust_ratios=ratios, weight_decay=[wd for _, _, wd in segs],
       bias_correction=bias_correction, copies=_segment_views(model_param_out, segs))


def fused_lamb_stage2_reference(*args, **kwargs) -> None:
    """PyTorch reference of ``fused_lamb_stage2``."""
    fused_lamb_stage2(*args, reference=True, **kwargs)


class CPULamb(BucketedOptimizer):
    """LAMB for CPU tensors (formula in the module doc), stepping them in place.

    Hyperparameters as DeepSpeed's FusedLamb (without eps_inside_sqrt / max_grad_norm).
    ``state_dict()`` has torch.optim.Adam's layout (state[i] = {"step", "exp_avg",
    "exp_avg_sq"}, fp32 moments). ``get_lamb_coeffs()``: last step's trust ratios.
    """

    cpu_only = True

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, bias_correction: bool = True,
                 max_coeff: float = 10.0, min_coeff: float = 0.01):
        if lr < 0.0 or eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"invalid lr/eps/weight_decay {lr}, {eps}, {weight_decay}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}")
        if not 0.0 < min_coeff <= max_coeff:
            raise ValueError(f"need 0 < min_coeff <= max_coeff, got {min_coeff}, {max_coeff}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, max_coeff=max_coeff,
                        min_coeff=min_coeff)
        super().__init__(params, defaults)
        self._lamb_coeffs: list[float] = []

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            for key in ("bias_correction", "max_coeff", "min_coeff"):
                group.setdefault(key, self.defaults[key])

    def get_lamb_coeffs(self) -> list[float]:
        return list(self._lamb_coeffs)

    def step(self, closure=None):
        self._lamb_coeffs = []
        return super().step(closure)

    def _update(self, group, step, params):
        beta1, beta2 = group["betas"]
        self._lamb_coeffs += lamb_update_(
            params, [p.grad for p in params], *self.moments(params), step=step, lr=group["lr"],
            beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
            bias_correction=group["bias_correction"], max_coeff=group["max_coeff"],
            min_coeff=group["min_coeff"])


register_op("cpu_lamb", "lamb", "CPU LAMB step (megazero.ops.CPULamb)",
            simd_level_fn=lambda: cx.simd_level("lamb"))
register_op("fused_lamb_stages", "lamb", "two-stage LAMB of a ZeRO partition (fused_step)",
            simd_level_fn=lambda: cx.simd_level("lamb"))
